"""The Python API, for notebooks and scripts: the same functions the command line runs.

    import kdistill
    run = kdistill.distill("run.yaml", "schedule.steps=100", kd={"temperature": 2.0})
    run.summary["heldout"]["student_loss"], run.run_dir, run.student_dir
    model, tokenizer = kdistill.load(run.student_dir)          # our Decoder (and the tokenizer, if saved)
    kdistill.evaluate(run.student_dir, ["held_out.jsonl"])      # the dict `kdistill eval --json` prints
    kdistill.plan("qwen2.5-1.5b:qwen2.5-0.5b", "data.seq_len=2048")

A config is a `RunConfig`, a dict of sections, a YAML path, or None (the embedded demo's config, one
KD run without the CE-only baseline). Overrides are dotted strings (`"kd.alpha=0.3"`), or keywords:
a section with a dict (`kd={"alpha": 0.3}`) or a dotted name (`**{"kd.alpha": 0.3}`). Every error a
user can cause raises `kdistill.UserError` with a one-line message.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from kdistill.commands.common import resolve_run
from kdistill.commands.eval import evaluate_model
from kdistill.commands.plan import make_plan
from kdistill.commands.run import new_run
from kdistill.config import RunConfig, load_config
from kdistill.demo import DEMO_YAML
from kdistill.dtypes import torch_dtype
from kdistill.errors import UserError
from kdistill.models.decoder import Decoder
from kdistill.models.hf_io import load_model
from kdistill.models.hub import resolve_model_path, resolve_run_models
from kdistill.models.spec import load_spec
from kdistill.models.tokenizer import Tokenizer, load_tokenizer

ConfigLike = RunConfig | dict[str, Any] | str | Path | None


# ----------------------------------------------------------------------------------------------
# Argument checks: a wrong type is the one-line UserError the CLI gives, not a TypeError from inside


def _kind(value: Any) -> str:
    """'None', 'an int', 'a str', ...: the type of a wrong argument, for its message."""
    if value is None:
        return "None"
    name = type(value).__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def _path_arg(name: str, value: Any) -> str:
    """A path argument (str or os.PathLike, not empty) as a string."""
    if isinstance(value, Path) or (isinstance(value, str) and value.strip()):
        return str(value)
    if isinstance(value, str):
        raise UserError(f"{name} is empty, expected a path")
    if hasattr(value, "__fspath__"):
        return str(Path(value))
    raise UserError(f"{name} is {_kind(value)}, expected a path (str or pathlib.Path)")


def _int_arg(name: str, value: Any, *, optional: bool = False) -> int | None:
    """A positive int (None allowed when optional); bools are not ints here."""
    if value is None and optional:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise UserError(f"{name} is {_kind(value)}, expected a positive integer")
    if value < 1:
        raise UserError(f"{name} is {value}, expected a positive integer")
    return value


def _bool_arg(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise UserError(f"{name} is {_kind(value)}, expected True or False")
    return value


def _overrides(overrides: tuple[Any, ...]) -> list[str]:
    """Dotted overrides: each a 'section.field=value' string."""
    for item in overrides:
        if not isinstance(item, str):
            raise UserError(
                f"override {item!r} is {_kind(item)}, expected a string 'section.field=value' "
                "(or a keyword: kd={'alpha': 0.3})"
            )
    return list(overrides)


def _device_arg(value: Any) -> str | torch.device:
    if isinstance(value, torch.device):
        return value
    if not isinstance(value, str):
        raise UserError(f"device is {_kind(value)}, expected 'cpu', 'cuda', 'cuda:N' or a torch.device")
    try:
        torch.device(value)
    except (RuntimeError, ValueError):
        raise UserError(f"device is {value!r}, expected 'cpu', 'cuda', 'cuda:N' or a torch.device") from None
    return value


def _dtype_arg(value: Any) -> torch.dtype:
    """torch.float32/bfloat16/float16, or one of their names ('bfloat16', 'bf16', ...)."""
    if isinstance(value, torch.dtype | str):
        try:
            return torch_dtype(value)
        except ValueError:
            pass
    raise UserError(
        f"dtype is {value!r}, expected torch.float32, torch.bfloat16 or torch.float16 (or its name)"
    )


@dataclasses.dataclass(frozen=True)
class DistillResult:
    """What `distill` returns.

    Attributes:
        summary: the run's summary.json as a dict (status, losses, held-out losses, throughput, ...).
        run_dir: the run directory (metrics.jsonl, eval.jsonl, checkpoints, loss.png, student/).
    """

    summary: dict[str, Any]
    run_dir: Path

    @property
    def student_dir(self) -> Path:
        """The distilled student as a Hugging Face model directory."""
        return self.run_dir / "student"


def build_config(config: ConfigLike = None, *overrides: str, **keywords: Any) -> RunConfig:
    """A RunConfig from a RunConfig, a dict, a YAML path or None (the demo), plus overrides (not validated)."""
    overrides = tuple(_overrides(overrides))
    if isinstance(config, RunConfig):
        config.check_values()  # before to_dict, which deep-copies every value
        cfg = load_config(None, list(overrides), base=config.to_dict())
    elif isinstance(config, dict):
        cfg = load_config(None, list(overrides), base=config)
    elif config is None or isinstance(config, str | Path):
        cfg = load_config(DEMO_YAML if config is None else config, list(overrides))
    else:
        raise UserError(f"config is {_kind(config)}, expected a RunConfig, a dict or a YAML path")
    if keywords:
        nested: dict[str, Any] = cfg.to_dict()
        for key, value in keywords.items():
            parts = key.split(".")
            if len(parts) == 1 and isinstance(value, list):  # a list of sections: teachers=[{...}, ...]
                nested[key] = value
                continue
            if len(parts) == 1 and isinstance(value, dict):
                nested.setdefault(key, {}).update(value)
                continue
            if len(parts) != 2:
                raise UserError(
                    f"override {key}={value!r}: expected section.field=value or section={{field: value}}"
                )
            section = nested.setdefault(parts[0], {})
            if not isinstance(section, dict):
                raise UserError(f"override {key}: '{parts[0]}' is not a config section")
            section[parts[1]] = value
        cfg = load_config(None, base=nested)
    return cfg


def distill(
    config: ConfigLike = None, *overrides: str, overwrite: bool = False, quiet: bool = True, **keywords: Any
) -> DistillResult:
    """Distil a teacher into a student, as `kdistill run CONFIG key=value ...` does.

    Args:
        config: a RunConfig, a dict of sections, a YAML path, or None for the embedded demo's config.
        *overrides: dotted overrides, e.g. "schedule.steps=100".
        overwrite: replace a run already in output.dir (else that is an error).
        quiet: no progress bar or set-up lines.
        **keywords: more overrides: `kd={"alpha": 0.3}` or `**{"kd.alpha": 0.3}`.

    Returns:
        DistillResult: the summary dict and the run directory.

    Raises:
        UserError: a bad config, model, data file or output folder (one line).
    """
    _bool_arg("overwrite", overwrite)
    _bool_arg("quiet", quiet)
    cfg = build_config(config, *overrides, **keywords).validate()
    summary = new_run(cfg, overwrite=overwrite, quiet=quiet)
    return DistillResult(summary=summary, run_dir=Path(cfg.output.dir))


def load(
    path: str | Path, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> tuple[Decoder, Tokenizer | None]:
    """(our Decoder in eval mode, the tokenizer or None) from a model directory or a Hub name.

    `path` is a Hugging Face model directory (a run's `student/`, a teacher), or `org/name[@revision]`;
    `dtype` a torch dtype or its name ("bfloat16", "bf16", ...).
    """
    path = _path_arg("path", path)
    device, dtype = _device_arg(device), _dtype_arg(dtype)
    model_dir = resolve_model_path(path, field="model").path
    model = load_model(model_dir, device=device, dtype=dtype).eval()
    tok = load_tokenizer(model_dir) if (Path(model_dir) / "tokenizer.json").is_file() else None
    return model, tok


def evaluate(
    model: str | Path,
    data: str | Path | list[str | Path],
    *,
    seq_len: int | None = None,
    batch_size: int = 8,
    packed: bool = True,
    device: str = "auto",
    max_tokens: int | None = None,
) -> dict[str, Any]:
    """Held-out cross-entropy and perplexity of a model directory on data files (`kdistill eval`).

    Returns:
        dict: loss (nats/token), perplexity, tokens, sequences, packed, seq_len, model, data, device, dtype.
    """
    model = _path_arg("model", model)
    if isinstance(data, list | tuple):
        if not data:
            raise UserError("data is an empty list, expected one or more data files")
        files = [_path_arg(f"data[{i}]", d) for i, d in enumerate(data)]
    else:
        files = [_path_arg("data", data)]
    seq_len = _int_arg("seq_len", seq_len, optional=True)
    batch_size = _int_arg("batch_size", batch_size)
    max_tokens = _int_arg("max_tokens", max_tokens, optional=True)
    packed = _bool_arg("packed", packed)
    if not isinstance(device, str):
        raise UserError(f"device is {_kind(device)}, expected 'cpu', 'cuda' or 'auto'")
    return evaluate_model(
        model,
        files,
        seq_len=seq_len,
        batch_size=batch_size,
        packed=packed,
        device=device,
        max_tokens=max_tokens,
    )


def plan(config: ConfigLike, *overrides: str, **keywords: Any) -> dict[str, Any]:
    """Parameters, FLOPs and the memory estimate of a run, from configs alone (`kdistill plan --json`).

    `config` may also be a `TEACHER:STUDENT` pair of presets or model directories.
    """
    overrides = tuple(_overrides(overrides))
    if isinstance(config, str | Path) and not keywords:
        cfg, teacher, student = resolve_run(str(config), list(overrides))
    else:
        cfg = build_config(config, *overrides, **keywords).validate()
        resolve_run_models(cfg)
        teacher, student = load_spec(cfg.teacher.path), load_spec(cfg.student.path)
    return make_plan(cfg, teacher, student)
