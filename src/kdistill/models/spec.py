"""ModelSpec: the architecture of a decoder, read from a Hugging Face config.json alone.

A spec holds shapes and numerics only (no weights, no run options). The planner, the kernel keys and
the decoder all read the same spec. Presets (kdistill.models.presets) give real model shapes by name,
without any file:

    spec = load_spec("qwen2.5-0.5b")          # preset
    spec = load_spec("path/to/model_dir")     # reads path/to/model_dir/config.json
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from kdistill.errors import UserError
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


def _need(cfg: dict[str, Any], key: str, kind: type, where: str) -> Any:
    if key not in cfg or cfg[key] is None:
        raise UserError(f"{where}: field '{key}' is missing (expected {kind.__name__})")
    value = cfg[key]
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise UserError(f"{where}: field '{key}' is {value!r}, expected an integer")
    if kind is float and (isinstance(value, bool) or not isinstance(value, int | float)):
        raise UserError(f"{where}: field '{key}' is {value!r}, expected a number")
    if kind in (int, float) and not value > 0:
        raise UserError(f"{where}: field '{key}' is {value!r}, expected a positive number")
    return kind(value)


def spec_from_hf_config(cfg: dict[str, Any], where: str = "config.json") -> ModelSpec:
    """Build a ModelSpec from a Hugging Face config dict; refuses unsupported architectures by name."""
    if not isinstance(cfg, dict):
        raise UserError(f"{where}: expected a JSON object")
    model_type = cfg.get("model_type")
    archs = cfg.get("architectures") or []
    if model_type not in SUPPORTED:
        named = model_type or (archs[0] if archs else "none given")
        raise UserError(
            f"{where}: architecture '{named}' is not supported (supported model_type: {', '.join(SUPPORTED)})"
        )
    if archs and archs[0] != SUPPORTED[model_type]:
        raise UserError(f"{where}: architectures[0] is '{archs[0]}', expected '{SUPPORTED[model_type]}'")
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise UserError(f"{where}: field 'hidden_act' is '{act}', expected 'silu'")
    if cfg.get("mlp_bias"):
        raise UserError(f"{where}: field 'mlp_bias' is true, expected false (MLP biases are not supported)")
    if cfg.get("use_sliding_window"):
        raise UserError(f"{where}: field 'use_sliding_window' is true, expected false")

    hidden = _need(cfg, "hidden_size", int, where)
    heads = _need(cfg, "num_attention_heads", int, where)
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    if kv_heads <= 0 or heads % kv_heads:
        raise UserError(
            f"{where}: field 'num_key_value_heads' is {kv_heads}, expected a divisor of num_attention_heads ({heads})"
        )
    head_dim = cfg.get("head_dim")
    if head_dim is None:
        if hidden % heads:
            raise UserError(f"{where}: hidden_size {hidden} is not divisible by num_attention_heads {heads}")
        head_dim = hidden // heads
    if not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 2:
        raise UserError(f"{where}: field 'head_dim' is {head_dim!r}, expected a positive even integer")

    rope = cfg.get("rope_parameters") or {}
    legacy = cfg.get("rope_scaling") or {}
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    if isinstance(theta, bool) or not isinstance(theta, int | float) or not theta > 0:
        raise UserError(f"{where}: field 'rope_theta' is {theta!r}, expected a positive number")
    rope_type = rope.get("rope_type") or legacy.get("rope_type") or legacy.get("type") or "default"
    scaling = None
    if rope_type == "llama3":
        src = rope if "factor" in rope else legacy
        try:
            scaling = RopeScaling(
                factor=float(src["factor"]),
                low_freq_factor=float(src["low_freq_factor"]),
                high_freq_factor=float(src["high_freq_factor"]),
                original_max_position_embeddings=int(src["original_max_position_embeddings"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise UserError(f"{where}: llama3 rope scaling lacks a valid field {e}") from None
    elif rope_type != "default":
        raise UserError(f"{where}: rope_type '{rope_type}' is not supported (expected 'default' or 'llama3')")

    eps = cfg.get("rms_norm_eps", 1e-6)
    if isinstance(eps, bool) or not isinstance(eps, int | float) or not (0 < eps < 1):
        raise UserError(f"{where}: field 'rms_norm_eps' is {eps!r}, expected a number in (0, 1)")

    eos = cfg.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    dtype = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    return ModelSpec(
        arch=model_type,
        vocab_size=_need(cfg, "vocab_size", int, where),
        hidden_size=hidden,
        intermediate_size=_need(cfg, "intermediate_size", int, where),
        num_layers=_need(cfg, "num_hidden_layers", int, where),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_eps=float(eps),
        rope_theta=float(theta),
        max_position_embeddings=int(cfg.get("max_position_embeddings") or 2048),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", model_type != "llama")),
        attention_bias=True if model_type == "qwen2" else bool(cfg.get("attention_bias", False)),
        qk_norm=model_type == "qwen3",
        rope_scaling=scaling,
        bos_token_id=cfg.get("bos_token_id") if isinstance(cfg.get("bos_token_id"), int) else None,
        eos_token_id=eos if isinstance(eos, int) else None,
        torch_dtype=str(dtype),
        name=where,
    )


def read_config_json(path: Path) -> dict[str, Any]:
    """Read a config.json with one-line errors for a missing or malformed file."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"{path}: no such file (expected a Hugging Face config.json)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: cannot read ({e.__class__.__name__}: {e})") from None
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: line {e.lineno}: not valid JSON ({e.msg})") from None
    if not isinstance(cfg, dict):
        raise UserError(f"{path}: expected a JSON object at the top level")
    return cfg


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
