"""What several commands share: reading CONFIG as a YAML run config or a TEACHER:STUDENT pair.

cfg, teacher_spec, student_spec = resolve_run("run.yaml", ["data.seq_len=2048"])
cfg, teacher_spec, student_spec = resolve_run("qwen2.5-1.5b:qwen2.5-0.5b", [])
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from kdistill.config import RunConfig, load_config
from kdistill.errors import UserError
from kdistill.models.hub import resolve_run_models
from kdistill.models.spec import ModelSpec, load_spec


def split_config_args(config: str | None, overrides: Sequence[str] = ()) -> tuple[str | None, list[str]]:
    """(config path or None, overrides): CONFIG is optional wherever a run config is read, so a first
    argument `key=value` that is not an existing file is an override (`kdistill run teacher.path=...`)."""
    overrides = list(overrides)
    if config is not None and "=" in config and not Path(config).exists():
        return None, [config, *overrides]
    return config, overrides


def resolve_run(config: str | None, overrides: Sequence[str] = ()) -> tuple[RunConfig, ModelSpec, ModelSpec]:
    """(validated RunConfig, teacher spec, student spec) from CONFIG plus dotted overrides.

    CONFIG is a YAML run config when it is an existing file, ends in .yaml/.yml or has no ':';
    otherwise it is a 'TEACHER:STUDENT' pair of presets or model directories. Without CONFIG the
    overrides alone make the config (`kdistill plan teacher.path=A student.path=B`). Hugging Face names
    (org/name[@revision]) are resolved to their cached snapshot. The specs are read from config.json
    alone (no weights).
    """
    config, overrides = split_config_args(config, overrides)
    if not config and not overrides:
        raise UserError(
            "expected CONFIG (a YAML run config or a preset pair like qwen2.5-1.5b:qwen2.5-0.5b) or "
            "key=value overrides (teacher.path=... student.path=...)"
        )
    if not config:
        cfg = load_config(None, overrides)
    elif Path(config).is_file() or config.endswith((".yaml", ".yml")) or ":" not in config:
        cfg = load_config(config, list(overrides))
    else:
        teacher, student = config.split(":", 1)
        cfg = load_config(None, [f"teacher.path={teacher}", f"student.path={student}", *overrides])
    cfg.validate()
    resolve_run_models(cfg)
    return cfg, load_spec(cfg.teacher.path), load_spec(cfg.student.path)
