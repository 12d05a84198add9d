"""LoRA adapters on our decoder's linears, saved and loaded in PEFT's layout, and merged for export.

    apply_lora(student, rank=8, alpha=16, dropout=0.0, targets=["q_proj", "v_proj"], seed=0)
    adapter_state(student)        # {"model.layers.0.self_attn.q_proj.lora_A.weight": (r, in), ...}
    checkpoint_state(student)     # the adapters and the `kd_` modules: what a training checkpoint holds
    save_adapter(student, out_dir, base_model="path/to/student")    # adapter_config.json + safetensors
    save_adapter(sharded, out_dir, base_model=..., tensors=full)     # FSDP2: the gathered adapters
    load_adapter(student_with_lora, adapter_dir)                    # the inverse
    merge_lora(student)           # W <- W + (alpha / r) B A, wrappers replaced by plain nn.Linear

A wrapped linear computes, as PEFT's `LoraLayer` does,

    y = base(x) + (dropout(x) @ A^T @ B^T) * alpha / r        A: (r, in), B: (out, r)

with A initialised kaiming-uniform (a = sqrt(5), like nn.Linear) and B zeros, so training starts from
the base model exactly. The base is frozen; only A and B train. Module names follow PEFT
(`q_proj.base_layer`, `q_proj.lora_A`, `q_proj.lora_B`), so the saved keys are ours with PEFT's prefix:
`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`, which `peft.PeftModel.from_pretrained`
loads onto a transformers model of the base student.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from kdistill.errors import UserError
from kdistill.fileio import atomic_write_text, fault_point, write_json_durable
from kdistill.jsonio import read_json
from kdistill.models.decoder import KD_ONLY_PREFIX
from kdistill.outputs import staged_output
from kdistill.rundir import has_marker

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# The chat template the run rendered its conversations with (data.chat_template), as trained: what
# `kdistill export --merge` gives the merged model, whatever happens to the template file later.
ADAPTER_TEMPLATE = "chat_template.jinja"
PEFT_PREFIX = "base_model.model."
_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


class LoraLinear(nn.Module):
    """A frozen nn.Linear plus a trainable low-rank update (see the module docstring for the math)."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float) -> None:
        super().__init__()
        self.base_layer = base.requires_grad_(False)
        dev = base.weight.device
        self.lora_A = nn.Linear(base.in_features, rank, bias=False, device=dev, dtype=torch.float32)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False, device=dev, dtype=torch.float32)
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.rank, self.alpha = rank, alpha
        self.scaling = alpha / rank

    @property
    def in_features(self) -> int:
        return self.base_layer.in_features

    @property
    def out_features(self) -> int:
        return self.base_layer.out_features

    @torch.no_grad()
    def reset_adapter(self, generator: torch.Generator | None = None) -> None:
        """A kaiming-uniform (as nn.Linear and PEFT), B zeros: the wrapped layer starts as the base."""
        a = torch.empty(self.lora_A.weight.shape, dtype=torch.float32)
        nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
        self.lora_A.weight.copy_(a)
        self.lora_B.weight.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., in) -> (..., out)."""
        return self.base_layer(x) + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling

    @torch.no_grad()
    def merged(self) -> nn.Linear:
        """The base linear with (alpha / r) B A folded into its weight (computed in fp32)."""
        base = self.base_layer
        delta = (self.lora_B.weight.float() @ self.lora_A.weight.float()) * self.scaling  # (out, in)
        base.weight.copy_((base.weight.float() + delta).to(base.weight.dtype))
        return base


def check_rank(rank: int, targets: list[str], spec: Any, where: str = "student.lora.rank") -> None:
    """A rank no larger than the smallest dimension of a targeted linear (`spec.linear_shapes()`): a
    larger one is not a low-rank update (and only costs memory). One line naming the rank and the limit,
    before anything is allocated."""
    shapes = spec.linear_shapes()
    limit, name = min((min(shapes[t]), t) for t in targets if t in shapes)
    if rank > limit:
        raise UserError(
            f"{where} is {rank}, expected at most {limit} (the smallest dimension of the targeted "
            f"{name}: {shapes[name][0]} x {shapes[name][1]}); LoRA ranks are usually 4 to 64"
        )


def check_lora(lora: Any, spec: Any) -> None:
    """A config's student.lora against the student's shapes (check_rank); nothing when LoRA is off."""
    if lora.enabled:
        check_rank(lora.rank, lora.targets, spec)


def _target_modules(model: nn.Module, targets: list[str]) -> list[tuple[nn.Module, str]]:
    """(parent module, attribute) of every targeted linear of every decoder layer."""
    found = []
    for block in model.model.layers:
        for name in targets:
            if name not in _ATTN + _MLP:
                raise UserError(
                    f"student.lora.targets has '{name}', expected some of: {', '.join(_ATTN + _MLP)}"
                )
            parent = block.self_attn if name in _ATTN else block.mlp
            found.append((parent, name))
    return found


def apply_lora(
    model: nn.Module, *, rank: int, alpha: float, dropout: float, targets: list[str], seed: int = 0
) -> nn.Module:
    """Freeze `model` and wrap its targeted linears in LoraLinear (fp32 adapters, deterministic init
    from `seed`). Returns the model; its only trainable parameters are the adapters."""
    model.requires_grad_(False)
    g = torch.Generator(device="cpu").manual_seed(seed)
    for parent, name in _target_modules(model, targets):
        base = getattr(parent, name)
        if isinstance(base, LoraLinear):
            raise ValueError(f"{name} already has an adapter")
        wrapped = LoraLinear(base, rank, alpha, dropout)
        wrapped.reset_adapter(g)
        setattr(parent, name, wrapped)
    return model


def has_lora(model: nn.Module) -> bool:
    return any(isinstance(m, LoraLinear) for m in model.modules())


def lora_modules(model: nn.Module) -> list[tuple[str, LoraLinear]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, LoraLinear)]


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' tensors under our names (`model.layers.0.self_attn.q_proj.lora_A.weight`, ...)."""
    out: dict[str, torch.Tensor] = {}
    for name, m in lora_modules(model):
        out[f"{name}.lora_A.weight"] = m.lora_A.weight
        out[f"{name}.lora_B.weight"] = m.lora_B.weight
    return out


def checkpoint_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """What a LoRA student's training checkpoint holds: its adapters (`adapter_state`) and the tensors of
    the distillation-only modules that train beside them (names with models.decoder.KD_ONLY_PREFIX, e.g.
    kd.layer_map's `kd_layer_proj.0.weight`); never the frozen base, which is student.path's weights.
    The `kd_` tensors stay out of the exported adapter (`save_adapter` writes the adapters only)."""
    out = adapter_state(model)
    out.update(
        (name, t) for name, t in model.state_dict(keep_vars=True).items() if name.startswith(KD_ONLY_PREFIX)
    )
    return out


def peft_config(model: nn.Module, base_model: str) -> dict[str, Any]:
    """adapter_config.json as PEFT writes it for a LoRA on a causal LM."""
    mods = lora_modules(model)
    if not mods:
        raise ValueError("the model has no LoRA adapters")
    first = mods[0][1]
    targets = sorted({name.rsplit(".", 1)[-1] for name, _ in mods})
    dropout = first.lora_dropout.p if isinstance(first.lora_dropout, nn.Dropout) else 0.0
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": first.rank,
        "lora_alpha": first.alpha,
        "lora_dropout": dropout,
        "target_modules": targets,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "revision": None,
    }


def save_adapter(
    model: nn.Module,
    out_dir: Path,
    *,
    base_model: str,
    tensors: dict[str, torch.Tensor] | None = None,
    kind: str = "adapter",
    intact: str | None = None,
    chat_template: str | None = None,
) -> None:
    """Write adapter_config.json and adapter_model.safetensors (PEFT's key names), atomically
    (kdistill.outputs): into a temporary sibling marked as kdistill's output of `kind`, then renamed over
    `out_dir`, which is replaced only when it carries the marker of an earlier `kind`.

    Args:
        model: the student with its adapters (their config: rank, alpha, dropout, targets).
        out_dir: the adapter directory.
        base_model: adapter_config.json's base_model_name_or_path.
        tensors: full tensors by name, at least the adapters' (`adapter_state`'s names), when the model
            holds only shards of them (FSDP2: gathered by the caller, every process taking part); the
            default is the model's own. Other names (e.g. other trainable parameters) are not written.
        kind: the marker's kind ("adapter"; `kdistill export`: "export-adapter").
        intact: what a write fault leaves intact, for its one-line error.
        chat_template: the template text the run trained with, written beside them as
            chat_template.jinja (None: none written).
    """
    out_dir = Path(out_dir)
    own = adapter_state(model)
    if tensors is not None:
        missing = sorted(k for k in own if k not in tensors)
        if missing:
            raise ValueError(f"no tensor given for the adapter {missing[0]!r}")
        own = {k: tensors[k] for k in own}
    tensors = {PEFT_PREFIX + k: v.detach().to("cpu", torch.float32).contiguous() for k, v in own.items()}

    def legacy(p: Path) -> bool:  # the run's own adapter/, written before markers existed
        return kind == "adapter" and (p / ADAPTER_CONFIG).is_file() and has_marker(p.absolute().parent)

    with staged_output(out_dir, kind, name="", what="write the adapter", intact=intact, legacy=legacy) as tmp:
        write_json_durable(tmp / ADAPTER_CONFIG, peft_config(model, base_model))
        if chat_template is not None:
            fault_point(tmp / ADAPTER_TEMPLATE)
            atomic_write_text(tmp / ADAPTER_TEMPLATE, chat_template)
        fault_point(tmp / ADAPTER_WEIGHTS, "safetensors")
        save_file(tensors, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        with open(tmp / ADAPTER_WEIGHTS, "rb+") as f:
            os.fsync(f.fileno())


def read_adapter(adapter_dir: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(adapter_config.json, tensors under our names) of a PEFT LoRA adapter directory."""
    adapter_dir = Path(adapter_dir)
    cfg_path, w_path = adapter_dir / ADAPTER_CONFIG, adapter_dir / ADAPTER_WEIGHTS
    cfg = read_json(cfg_path, max_bytes=16 << 20, what="a LoRA adapter_config.json")
    try:
        raw = load_file(str(w_path))
    except FileNotFoundError as e:
        raise UserError(f"{e.filename}: not found (expected a LoRA adapter directory)") from None
    except (OSError, ValueError, SafetensorError) as e:
        raise UserError(f"{adapter_dir}: adapter is unreadable ({e.__class__.__name__})") from None
    if not isinstance(cfg, dict) or cfg.get("peft_type") != "LORA":
        raise UserError(f"{cfg_path}: peft_type is not LORA (expected a LoRA adapter)")
    for key in ("r", "lora_alpha", "target_modules"):
        if key not in cfg:
            raise UserError(f"{cfg_path}: missing field '{key}'")
    r, alpha, targets = cfg["r"], cfg["lora_alpha"], cfg["target_modules"]
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise UserError(f"{cfg_path}: r is {r!r}, expected a positive integer (the adapters' rank)")
    if (
        not isinstance(alpha, int | float)
        or isinstance(alpha, bool)
        or not math.isfinite(alpha)
        or alpha <= 0
    ):
        raise UserError(f"{cfg_path}: lora_alpha is {alpha!r}, expected a positive number")
    if not (
        isinstance(targets, str)
        or (isinstance(targets, list) and targets and all(isinstance(t, str) for t in targets))
    ):
        raise UserError(
            f"{cfg_path}: target_modules is {targets!r}, expected a module name or a list of them"
        )
    bad = [k for k in raw if not k.startswith(PEFT_PREFIX)]
    if bad:
        raise UserError(f"{w_path}: tensor {bad[0]!r} does not start with '{PEFT_PREFIX}'")
    return cfg, {k[len(PEFT_PREFIX) :]: v for k, v in raw.items()}


def load_adapter(model: nn.Module, adapter_dir: Path) -> nn.Module:
    """Wrap `model` as the adapter's config says and load its tensors (names and shapes checked)."""
    cfg, tensors = read_adapter(adapter_dir)
    targets = cfg["target_modules"]
    if isinstance(targets, str):
        targets = [targets]
    w_path = Path(adapter_dir) / ADAPTER_WEIGHTS
    for k, t in tensors.items():  # the rank the tensors hold, before r-sized adapters are allocated
        dim = 0 if ".lora_A." in k else 1
        if t.dim() != 2 or t.shape[dim] != cfg["r"]:
            raise UserError(
                f"{w_path}: tensor {PEFT_PREFIX + k!r} has shape {list(t.shape)}, not rank r={cfg['r']} "
                f"of {Path(adapter_dir) / ADAPTER_CONFIG}"
            )
    apply_lora(model, rank=int(cfg["r"]), alpha=float(cfg["lora_alpha"]), dropout=0.0, targets=list(targets))
    own = adapter_state(model)
    odd = sorted(set(own) ^ set(tensors))
    if odd:
        what = "unexpected" if odd[0] in tensors else "missing"
        raise UserError(f"{Path(adapter_dir) / ADAPTER_WEIGHTS}: {what} tensor {PEFT_PREFIX + odd[0]!r}")
    with torch.no_grad():
        for k, p in own.items():
            if tuple(tensors[k].shape) != tuple(p.shape):
                raise UserError(
                    f"{Path(adapter_dir) / ADAPTER_WEIGHTS}: tensor {PEFT_PREFIX + k!r} has shape "
                    f"{list(tensors[k].shape)}, expected {list(p.shape)} for this base model"
                )
            p.copy_(tensors[k])
    return model


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight and put the plain nn.Linear back (in place)."""
    for name, m in lora_modules(model):
        parent_name, attr = name.rsplit(".", 1)
        setattr(model.get_submodule(parent_name), attr, m.merged())
    return model
