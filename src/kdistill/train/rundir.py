"""The run folder before and around training: refuse to clobber, start it, clean up a failed start.

prepare_output(run_dir, overwrite=False)        # one-line error if it holds a run, or is not writable
print_config(cfg, quiet)                        # the fields that differ from the defaults
start_run_dir(cfg, run_dir, "cpu")              # manifest.json and config.yaml
discard_unstarted(run_dir, fresh)               # after a failure before the first step
"""

from __future__ import annotations

import contextlib
import platform
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import yaml

from kdistill.config import RunConfig
from kdistill.errors import UserError
from kdistill.fileio import atomic_write_json
from kdistill.train import checkpoint as ckpt
from kdistill.train.evidence import make_manifest, read_metrics

RUN_FILES = ("manifest.json", "config.yaml", "metrics.jsonl", "eval.jsonl")


def prepare_output(run_dir: Path, overwrite: bool) -> None:
    """Refuse to clobber an existing run; check the folder is writable before any work."""
    if run_dir.exists() and not run_dir.is_dir():
        raise UserError(f"output.dir '{run_dir}' is a file, expected a directory")
    if run_dir.is_dir() and any(run_dir.iterdir()):
        holds_run = (run_dir / "manifest.json").exists() or (run_dir / "checkpoints").exists()
        if holds_run and not overwrite:
            raise UserError(
                f"output.dir '{run_dir}' already holds a run: use --resume {run_dir} to continue it, "
                "--overwrite to replace it, or another output.dir"
            )
        if holds_run:
            shutil.rmtree(run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / ".write-probe"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise UserError(f"output.dir '{run_dir}' is not writable ({e.strerror or e})") from None


def print_config(cfg: RunConfig, quiet: bool) -> None:
    """Print the resolved config as the fields that differ from the defaults, unless quiet (the whole
    config goes to RUN_DIR/config.yaml)."""
    if quiet:
        return
    changed = config_diff(cfg)
    print(
        f"resolved config ({len(changed)} fields differ from the defaults; all in {cfg.output.dir}/config.yaml):"
    )
    for key, value in changed.items():
        print(
            f"  {key}: {yaml.safe_dump(value, default_flow_style=True, width=10**6).strip().removesuffix('...').strip()}"
        )


def config_diff(cfg: RunConfig) -> dict[str, Any]:
    """{"section.field": value} for every field whose value differs from RunConfig()'s, in config order."""
    defaults = RunConfig().to_dict()
    out: dict[str, Any] = {}
    for section, fields in cfg.to_dict().items():
        if not isinstance(fields, dict):  # a list of sections (teachers)
            if fields != defaults.get(section):
                out[section] = fields
            continue
        out.update({f"{section}.{k}": v for k, v in fields.items() if defaults.get(section, {}).get(k) != v})
    return out


def start_run_dir(cfg: RunConfig, run_dir: Path, device: str, hub: Mapping[str, Any] | None = None) -> None:
    """manifest.json (versions, device, file hashes; for models named on the Hugging Face Hub, the repo,
    revision and commit used: `hub` maps teacher/student to a ResolvedModel) and config.yaml (what
    --resume reads back)."""
    manifest = make_manifest(cfg.to_dict(), device, device_name(device))
    if hub:
        manifest["hub"] = {name: m.manifest() for name, m in hub.items()}
    atomic_write_json(run_dir / "manifest.json", manifest)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))


def device_name(device: str) -> str:
    """The GPU's name, or the CPU's as the platform reports it."""
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    return platform.processor() or platform.machine()


def discard_unstarted(run_dir: Path, fresh: bool) -> None:
    """A run that failed before its first step leaves nothing behind (so a corrected rerun just works)."""
    if read_metrics(run_dir / "metrics.jsonl") or ckpt.list_checkpoints(run_dir):
        return
    for name in RUN_FILES:
        (run_dir / name).unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        (run_dir / "checkpoints").rmdir()
    if fresh:
        with contextlib.suppress(OSError):
            run_dir.rmdir()
