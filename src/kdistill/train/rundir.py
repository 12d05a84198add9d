"""The run folder before and around training: refuse to clobber, claim it, start it, clean up a failed start.

claim = prepare_output(run_dir, overwrite=False)   # one-line error if it holds a run or is not writable;
                                                   # creates it with the kdistill marker and locks it
print_config(cfg, quiet)                           # the fields that differ from the defaults
start_run_dir(cfg, run_dir, "cpu")                 # manifest.json and config.yaml
discard_unstarted(run_dir, claim.created)          # after a failure before the first step
claim.release()                                    # the lock, at the end of the run

Only a directory kdistill made is ever removed (`--overwrite`, or a start that failed): one carrying the
marker `.kdistill-run`, or, for runs made before the marker existed, one whose manifest.json was
written by kdistill (a JSON object with "kdistill" and "config" entries); never the working directory,
a parent of it, the home directory or `/` (kdistill.rundir).
"""

from __future__ import annotations

import contextlib
import dataclasses
import platform
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import yaml

from kdistill.config import RunConfig
from kdistill.errors import UserError
from kdistill.fileio import atomic_write_json, atomic_write_text, write_guard
from kdistill.jsonio import read_json
from kdistill.rundir import (
    LOCK_NAME,
    MARKER_NAME,
    RunLock,
    check_path_value,
    creating_run_dir,
    has_marker,
    protected_reason,
    safe_remove_run_dir,
    write_marker,
)
from kdistill.train import checkpoint as ckpt
from kdistill.train.evidence import make_manifest, read_metrics, run_identity

RUN_FILES = ("manifest.json", "config.yaml", "metrics.jsonl", "eval.jsonl")


@dataclasses.dataclass
class Claim:
    """A run directory claimed for a new run: its lock (None when not locked) and the outermost
    directory this claim created (None when the directory existed), removed if the start fails."""

    lock: RunLock | None
    created: Path | None

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()


def made_by_kdistill(run_dir: Path) -> bool:
    """The directory carries the marker, or (runs from before the marker) a manifest.json written by
    kdistill."""
    if has_marker(run_dir):
        return True
    try:
        manifest = read_json(run_dir / "manifest.json", max_bytes=1 << 20, what="a kdistill manifest.json")
    except UserError:
        return False
    return isinstance(manifest.get("kdistill"), str) and isinstance(manifest.get("config"), dict)


def _replace_run(run_dir: Path) -> RunLock:
    """--overwrite: lock the run directory, then empty it (only one kdistill made); returns the lock."""
    why = protected_reason(run_dir.resolve())
    if why:
        raise UserError(f"output.dir '{run_dir}': refusing to remove it ({why})")
    if not made_by_kdistill(run_dir):
        raise UserError(
            f"output.dir '{run_dir}' was not created by kdistill (no {MARKER_NAME} marker and no kdistill "
            "manifest.json); refusing to remove it: delete it yourself or choose another directory"
        )
    if not has_marker(run_dir):
        with write_guard(run_dir, what="mark the run directory"):
            write_marker(run_dir)  # a kdistill run from before the marker existed
    lock = RunLock(run_dir).acquire()
    try:
        safe_remove_run_dir(run_dir, keep=(LOCK_NAME, MARKER_NAME))
    except BaseException:
        lock.release()
        raise
    return lock


def prepare_output(run_dir: Path, overwrite: bool, *, lock: bool = True) -> Claim:
    """Refuse to clobber an existing run (or, with `overwrite`, replace one kdistill made); create the
    directory with the marker and take its lock, checking it is writable before any work."""
    run_dir = check_path_value("output.dir", run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise UserError(f"output.dir '{run_dir}' is a file, expected a directory")
    holds_run = (run_dir / "manifest.json").exists() or (run_dir / "checkpoints").exists()
    if run_dir.is_dir() and holds_run:
        if not overwrite:
            raise UserError(
                f"output.dir '{run_dir}' already holds a run: use --resume {run_dir} to continue it, "
                "--overwrite to replace it, or another output.dir"
            )
        held = _replace_run(run_dir)
        if not lock:
            held.release()
        return Claim(held if lock else None, None)
    try:
        with creating_run_dir(run_dir) as made:  # if locking fails, what this made is removed
            held = RunLock(run_dir).acquire() if lock else None
    except OSError as e:
        raise UserError(f"output.dir '{run_dir}' is not writable ({e.strerror or e})") from None
    return Claim(held, made.created[0] if made.created else None)


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
    with write_guard(run_dir, what="start the run (nothing of it is kept)"):
        atomic_write_json(run_dir / "manifest.json", manifest)
        atomic_write_text(run_dir / "config.yaml", yaml.safe_dump(cfg.to_dict(), sort_keys=False))


def device_name(device: str) -> str:
    """The GPU's name, or the CPU's as the platform reports it."""
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    return platform.processor() or platform.machine()


def discard_unstarted(run_dir: Path, created: Path | None) -> None:
    """A run that failed before its first step leaves nothing behind (so a corrected rerun just works):
    the directories this run created are removed, else the run's files in a directory that was there."""
    if read_metrics(run_dir / "metrics.jsonl") or ckpt.list_checkpoints(run_dir):
        return
    if created is not None:
        shutil.rmtree(created, ignore_errors=True)
        return
    for name in RUN_FILES:
        with contextlib.suppress(OSError):
            (run_dir / name).unlink(missing_ok=True)
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)


def check_identity(run_dir: Path, cfg: RunConfig, allow_changes: bool) -> list[str]:
    """Compare the teacher, student (tokenizer included) and data the run started from (manifest.json)
    with the current config's. A change is a one-line error unless `allow_changes`, which records the
    changes in the manifest. Returns the changes."""
    path = run_dir / "manifest.json"
    manifest = read_json(path, max_bytes=16 << 20, what="a kdistill manifest.json")
    now = run_identity(cfg.to_dict())
    changes = []
    for key, what in (("teacher_files", "teacher"), ("student_files", "student"), ("data_files", "data")):
        before = manifest.get(key)
        if not isinstance(before, dict):
            continue  # a manifest from before this entry existed
        differ = sorted(k for k in set(before) | set(now[key]) if before.get(k) != now[key].get(k))
        if differ:
            names = ", ".join(Path(k).name for k in differ[:3]) + (" ..." if len(differ) > 3 else "")
            changes.append(f"{what} ({names})")
    if not changes:
        return []
    if not allow_changes:
        raise UserError(
            f"--resume {run_dir}: the run's inputs changed since it started: {'; '.join(changes)} "
            "differ from manifest.json; use --resume with --allow-changes to continue anyway"
        )
    history = manifest.get("resume_changes")
    history = history if isinstance(history, list) else []
    history.append({"at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "changed": changes})
    manifest.update(now, resume_changes=history)
    with write_guard(path, what="record the changes in the manifest"):
        atomic_write_json(path, manifest)
    return changes


def record_resume_overrides(run_dir: Path, saved: RunConfig, cfg: RunConfig) -> dict[str, list[Any]]:
    """A --resume with overrides (schedule.steps=N, ...): config.yaml becomes the config the run now
    follows, and manifest.json's `resume_overrides` records each change ({"field": [old, new]}), so that a
    later plain --resume (after a killed export, say) continues with the same config. Returns the
    changes (empty: nothing written)."""
    old, new = _flat(saved.to_dict()), _flat(cfg.to_dict())
    changed = {k: [old.get(k), new.get(k)] for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)}
    if not changed:
        return {}
    path = run_dir / "manifest.json"
    with write_guard(run_dir / "config.yaml", what="record the resumed run's config"):
        manifest = read_json(path, max_bytes=16 << 20, what="a kdistill manifest.json")
        history = manifest.get("resume_overrides")
        history = history if isinstance(history, list) else []
        history.append({"at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "changed": changed})
        manifest["resume_overrides"] = history
        atomic_write_json(path, manifest)
        atomic_write_text(run_dir / "config.yaml", yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    return changed


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"schedule": {"steps": 8}} -> {"schedule.steps": 8} (lists kept whole)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out
