"""ModelSpec: the architecture of a decoder, read from a Hugging Face config.json alone.

A spec holds shapes and numerics only (no weights, no run options). The planner, the kernel keys and
the decoder all read the same spec. Presets (kdistill.models.presets) give real model shapes by name,
without any file:

    spec = load_spec("qwen2.5-0.5b")          # preset
    spec = load_spec("path/to/model_dir")     # reads path/to/model_dir/config.json
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

from kdistill.errors import UserError
from kdistill.jsonio import Fields, MiB, read_json, short_repr, type_name
from kdistill.models.presets import PRESETS

SUPPORTED = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency-dependent rope scaling (rope_type 'llama3')."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Architecture of a Llama-family decoder (Llama 3.x, Qwen2/2.5, Qwen3)."""

    arch: str  # "llama" | "qwen2" | "qwen3"
    vocab_size: int  # embedding rows (may exceed the tokenizer's vocabulary: padding)
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v projections (Qwen2)
    qk_norm: bool  # per-head RMSNorm on q and k (Qwen3)
    rope_scaling: RopeScaling | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    torch_dtype: str = "float32"
    name: str = ""  # preset name or directory, for messages only

    # -- derived sizes -------------------------------------------------------------------------
    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of each of a layer's linears, by Hugging Face name."""
        h, i = self.hidden_size, self.intermediate_size
        return {
            "q_proj": (h, self.q_size),
            "k_proj": (h, self.kv_size),
            "v_proj": (h, self.kv_size),
            "o_proj": (self.q_size, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }

    def lora_params(self, rank: int, targets: list[str]) -> int:
        """Trainable parameters of LoRA adapters of `rank` on the `targets` linears of every layer."""
        shapes = self.linear_shapes()
        return self.num_layers * sum(rank * (shapes[t][0] + shapes[t][1]) for t in targets)

    def param_counts(self) -> dict[str, int]:
        """Parameter counts: embedding, per-layer total, final norm, lm_head (0 when tied), total."""
        h, i = self.hidden_size, self.intermediate_size
        attn = h * self.q_size + 2 * h * self.kv_size + self.q_size * h
        if self.attention_bias:
            attn += self.q_size + 2 * self.kv_size
        if self.qk_norm:
            attn += 2 * self.head_dim
        mlp = 3 * h * i
        layer = attn + mlp + 2 * h
        emb = self.vocab_size * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        total = emb + self.num_layers * layer + h + head
        return {
            "embedding": emb,
            "per_layer": layer,
            "layers": self.num_layers * layer,
            "lm_head": head,
            "total": total,
            "non_embedding": total - emb - head,
        }

    def matmul_flops_per_token(self, seq_len: int) -> int:
        """Forward FLOPs per token: 2 x matmul params plus attention scores (causal, averaged)."""
        h = self.hidden_size
        per_layer = 2 * (
            h * self.q_size + 2 * h * self.kv_size + self.q_size * h + 3 * h * self.intermediate_size
        )
        # QK^T and PV: 2 * 2 * heads * head_dim * (average causal context ~ seq_len / 2)
        per_layer += 4 * self.num_heads * self.head_dim * (seq_len + 1) // 2
        head = 2 * h * self.vocab_size
        return self.num_layers * per_layer + head

    def to_hf_config(self) -> dict[str, Any]:
        """A config.json dict that transformers reads back as the same architecture."""
        rope: dict[str, Any] = {"rope_theta": self.rope_theta, "rope_type": "default"}
        if self.rope_scaling is not None:
            rope.update(rope_type="llama3", **dataclasses.asdict(self.rope_scaling))
        cfg: dict[str, Any] = {
            "architectures": [SUPPORTED[self.arch]],
            "model_type": self.arch,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": rope,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "torch_dtype": self.torch_dtype,
            "dtype": self.torch_dtype,
            "use_cache": True,
        }
        if self.rope_scaling is not None:
            cfg["rope_scaling"] = dict(rope)
        if self.arch == "llama":
            cfg["attention_bias"] = self.attention_bias
            cfg["mlp_bias"] = False
        if self.arch == "qwen3":
            cfg["attention_bias"] = self.attention_bias
        if self.arch in ("qwen2", "qwen3"):
            cfg["use_sliding_window"] = False
            cfg["sliding_window"] = None
        return cfg


def _model_type(f: Fields) -> str:
    """model_type (and architectures[0], when given) of a supported architecture, else a one-line error."""
    model_type = f.raw("model_type", None)
    archs = f.raw("architectures", None)
    if archs is not None and not isinstance(archs, list):
        raise UserError(
            f"{f.where}: architectures is {short_repr(archs)} ({type_name(archs)}), expected a list"
        )
    first = archs[0] if archs else None
    if first is not None and not isinstance(first, str):
        raise UserError(
            f"{f.where}: architectures[0] is {short_repr(first)} ({type_name(first)}), expected a string"
        )
    if not isinstance(model_type, str) or model_type not in SUPPORTED:
        named = model_type if isinstance(model_type, str) and model_type else (first or "none given")
        raise UserError(
            f"{f.where}: architecture {short_repr(named)} is not supported "
            f"(supported model_type: {', '.join(SUPPORTED)})"
        )
    if first is not None and first != SUPPORTED[model_type]:
        raise UserError(
            f"{f.where}: architectures[0] is {short_repr(first)}, expected '{SUPPORTED[model_type]}'"
        )
    return model_type


def _rope(f: Fields) -> tuple[float, RopeScaling | None]:
    """(rope_theta, llama3 scaling or None) from rope_parameters (new) or rope_theta / rope_scaling (old)."""
    rope = f.optional("rope_parameters", "obj") or Fields({}, f.where, "rope_parameters")
    legacy = f.optional("rope_scaling", "obj") or Fields({}, f.where, "rope_scaling")
    if rope.raw("rope_theta", None) is not None:
        theta = rope.float("rope_theta", min_exclusive=0)
    else:
        theta = (
            f.float("rope_theta", default=10000.0, min_exclusive=0)
            if f.raw("rope_theta", None) is not None
            else 10000.0
        )
    kinds = ("default", "llama3")
    rope_type = "default"
    for src, key in ((rope, "rope_type"), (legacy, "rope_type"), (legacy, "type")):
        if src.raw(key, None) is not None:
            rope_type = src.str(key, max_len=64)
            break
    if rope_type not in kinds:
        raise UserError(
            f"{f.where}: rope_type {short_repr(rope_type)} is not supported (expected 'default' or 'llama3')"
        )
    if rope_type != "llama3":
        return theta, None
    src = rope if rope.has("factor") else legacy
    low = src.float("low_freq_factor", min_exclusive=0)
    return theta, RopeScaling(
        factor=src.float("factor", min_exclusive=0),
        low_freq_factor=low,
        high_freq_factor=src.float("high_freq_factor", min_exclusive=low),
        original_max_position_embeddings=src.int("original_max_position_embeddings", min=1, max=_BIG),
    )


# Sizes beyond these are no real model; they would only make the planner allocate or overflow.
_BIG = 1 << 31


def spec_from_hf_config(cfg: dict[str, Any], where: str = "config.json") -> ModelSpec:
    """Build a ModelSpec from a Hugging Face config dict; refuses unsupported architectures by name and
    every field of the wrong type or out of range (sizes that feed a division or an allocation) as one line."""
    f = Fields(cfg, where)
    model_type = _model_type(f)
    act = f.str("hidden_act", default="silu", max_len=64)
    if act not in ("silu", "swish"):
        raise UserError(f"{where}: field 'hidden_act' is {short_repr(act)}, expected 'silu'")
    if f.raw("mlp_bias", None):
        raise UserError(f"{where}: field 'mlp_bias' is true, expected false (MLP biases are not supported)")
    if f.raw("use_sliding_window", None):
        raise UserError(f"{where}: field 'use_sliding_window' is true, expected false")

    hidden = f.int("hidden_size", min=1, max=_BIG)
    heads = f.int("num_attention_heads", min=1, max=_BIG)
    kv_heads = f.optional("num_key_value_heads", "int", min=1, max=_BIG) or heads
    if heads % kv_heads:
        raise UserError(
            f"{where}: field 'num_key_value_heads' is {kv_heads}, expected a divisor of num_attention_heads ({heads})"
        )
    head_dim = f.optional("head_dim", "int", min=1, max=_BIG)
    if head_dim is None:
        if hidden % heads:
            raise UserError(f"{where}: hidden_size {hidden} is not divisible by num_attention_heads {heads}")
        head_dim = hidden // heads
    if head_dim % 2:
        raise UserError(f"{where}: field 'head_dim' is {head_dim!r}, expected a positive even integer")
    theta, scaling = _rope(f)
    eps = (
        f.float("rms_norm_eps", default=1e-6, min_exclusive=0, max_exclusive=1)
        if f.raw("rms_norm_eps", None) is not None
        else 1e-6
    )

    eos = f.raw("eos_token_id", None)
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    bos = f.raw("bos_token_id", None)
    dtype = f.raw("dtype", None) or f.raw("torch_dtype", None) or "float32"
    max_pos = f.optional("max_position_embeddings", "int", min=1, max=_BIG) or 2048
    tie = f.raw("tie_word_embeddings", model_type != "llama")
    bias = f.raw("attention_bias", False)
    return ModelSpec(
        arch=model_type,
        vocab_size=f.int("vocab_size", min=1, max=_BIG),
        hidden_size=hidden,
        intermediate_size=f.int("intermediate_size", min=1, max=_BIG),
        num_layers=f.int("num_hidden_layers", min=1, max=1 << 16),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_eps=float(eps),
        rope_theta=float(theta),
        max_position_embeddings=max_pos,
        tie_word_embeddings=f.bool("tie_word_embeddings")
        if tie is not None and not isinstance(tie, bool)
        else bool(tie),
        attention_bias=True
        if model_type == "qwen2"
        else (f.bool("attention_bias") if not isinstance(bias, bool) and bias is not None else bool(bias)),
        qk_norm=model_type == "qwen3",
        rope_scaling=scaling,
        bos_token_id=bos if isinstance(bos, int) and not isinstance(bos, bool) and 0 <= bos < _BIG else None,
        eos_token_id=eos if isinstance(eos, int) and not isinstance(eos, bool) and 0 <= eos < _BIG else None,
        torch_dtype=dtype if isinstance(dtype, str) and len(dtype) < 32 else "float32",
        name=where,
    )


def read_config_json(path: Path) -> dict[str, Any]:
    """Read a config.json through the one JSON reader (size and depth limits, one-line errors)."""
    if not path.exists():
        raise UserError(f"{path}: no such file (expected a Hugging Face config.json)")
    return read_json(path, max_bytes=16 * MiB, what="a Hugging Face config.json")


def load_spec(ref: str | Path) -> ModelSpec:
    """A spec from a preset name, a model directory, or a path to a config.json."""
    key = str(ref)
    if key.lower() in PRESETS:
        return dataclasses.replace(spec_from_hf_config(PRESETS[key.lower()], key.lower()), name=key.lower())
    path = Path(ref)
    if path.is_dir():
        path = path / "config.json"
    if not path.exists():
        raise UserError(
            f"{ref}: not a model directory, config.json or preset (presets: {', '.join(sorted(PRESETS))})"
        )
    return spec_from_hf_config(read_config_json(path), str(path))


def rope_inv_freq(spec: ModelSpec) -> list[float]:
    """Inverse rotary frequencies (head_dim / 2 values), with llama3 scaling applied if configured."""
    d = spec.head_dim
    inv = [1.0 / (spec.rope_theta ** (2 * j / d)) for j in range(d // 2)]
    s = spec.rope_scaling
    if s is None:
        return inv
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    out = []
    for f in inv:
        wavelen = 2 * math.pi / f
        if wavelen < high_wavelen:
            out.append(f)
        elif wavelen > low_wavelen:
            out.append(f / s.factor)
        else:
            smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
                s.high_freq_factor - s.low_freq_factor
            )
            out.append((1 - smooth) * f / s.factor + smooth * f)
    return out
