"""Training checkpoints: atomic, rotated, and complete enough to resume bit for bit.

A checkpoint is a folder `checkpoints/step-0000100/` holding
    student.safetensors   the student's parameters (a LoRA student's adapters and `kd_` modules only:
                          models.lora.checkpoint_state)
    optimizer.safetensors AdamW moments and step counts, one tensor each
    state.json            step, optimizer hyper-parameters, data position, RNG, counters
It is written into `checkpoints/.tmp-step-.../` and renamed into place only when every file is
flushed, so a kill during the write leaves the previous checkpoint as the newest complete one.
Nothing is ever unpickled: tensors go through safetensors and everything else through JSON.

Under torchrun a checkpoint is sharded instead (`save_sharded_checkpoint`): the folder holds
    shards/               torch.distributed.checkpoint files, each process's own shards of the
                          student and its AdamW state (nothing gathered to one process; a LoRA
                          student's trainable tensors only, its adapters and `kd_` modules, as in a
                          one-process checkpoint)
    state.json            as above, with "format": "sharded" and the number of processes
written the same way: every process writes into the temp folder, then rank 0 adds state.json and
renames it into place. `load_checkpoint` returns no tensors for it (None): they are read straight into
the model, sharded or not (train/resume.py).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from kdistill import signals
from kdistill.errors import UserError
from kdistill.fileio import fault_point, fsync_dir, write_guard, write_json_durable
from kdistill.jsonio import read_json
from kdistill.outputs import clean_stale  # outputs -> rundir -> fileio: no cycle at import time
from kdistill.train import distributed as dist
from kdistill.train import faults

_PREFIX = "step-"
SHARDS = "shards"  # the torch.distributed.checkpoint folder of a sharded checkpoint


def optimizer_tensors(opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Flatten an optimizer's state into named tensors plus JSON-able hyper-parameters."""
    sd = opt.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    for idx, st in sd["state"].items():
        for name, value in st.items():
            t = value if torch.is_tensor(value) else torch.tensor(value)
            tensors[f"{idx}.{name}"] = t.detach().to("cpu").contiguous()
    return tensors, {"param_groups": sd["param_groups"]}


def load_optimizer_tensors(opt: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    """Put the tensors of `optimizer_tensors` (and its hyper-parameters) back into an optimizer."""
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        idx, name = key.split(".", 1)
        state.setdefault(int(idx), {})[name] = t
    opt.load_state_dict({"state": state, "param_groups": meta["param_groups"]})


def save_checkpoint(
    run_dir: Path,
    step: int,
    student: torch.nn.Module,
    opt: torch.optim.Optimizer,
    state: dict[str, Any],
    keep: int,
) -> Path:
    """Write checkpoint `step` atomically and keep only the newest `keep` ones."""
    root = run_dir / "checkpoints"
    final = root / f"{_PREFIX}{step:07d}"
    tmp = root / f".tmp-{_PREFIX}{step:07d}-{os.getpid()}"
    with write_guard(final, what="write checkpoint", intact=intact_text(run_dir), temps=[tmp]):
        fault_point(root)
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        weights = {k: v.detach().to("cpu").contiguous() for k, v in student.state_dict().items()}
        fault_point(tmp / "student.safetensors", "safetensors")
        save_file(weights, str(tmp / "student.safetensors"))
        faults.checkpoint_pause("between-files")
        opt_t, opt_meta = optimizer_tensors(opt)
        fault_point(tmp / "optimizer.safetensors", "safetensors")
        save_file(opt_t, str(tmp / "optimizer.safetensors"))
        write_json_durable(tmp / "state.json", {"step": step, "optimizer": opt_meta, **state})
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        fsync_dir(tmp)
        with signals.deferred():  # the swap of the same step's folder is not cut in half by a signal
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
        fsync_dir(root)
    for old in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def save_sharded_checkpoint(
    run_dir: Path, step: int, write_shards: Callable[[str], None], state: dict[str, Any], keep: int
) -> Path:
    """Collective: every process calls it. Rank 0 makes the temp folder, every process writes its
    shards there (`write_shards(folder)`), then rank 0 writes state.json, flushes, renames the folder
    into place and keeps the newest `keep` checkpoints. A failure on any process leaves the earlier
    checkpoints as they were and is a UserError on every process."""
    root = run_dir / "checkpoints"
    final = root / f"{_PREFIX}{step:07d}"
    tmp = root / f".tmp-{_PREFIX}{step:07d}-sharded"  # one name for every process (a shared folder)

    def prepare() -> None:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()

    def commit() -> None:
        try:
            meta = {"step": step, "format": "sharded", "world_size": dist.info().world, **state}
            write_json_durable(tmp / "state.json", meta)
            for f in (tmp / SHARDS).iterdir():
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
            fsync_dir(tmp / SHARDS)
            fsync_dir(tmp)
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            fsync_dir(root)
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise UserError(
                f"{final}: cannot write checkpoint ({e.strerror or e}); earlier checkpoints are intact"
            ) from None
        for old in list_checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)

    dist.run_on_main(prepare)
    write_shards(str(tmp / SHARDS))
    faults.checkpoint_pause("between-files")
    dist.barrier()
    dist.run_on_main(commit)
    return final


def is_sharded(path: Path) -> bool:
    """A checkpoint written under torchrun (torch.distributed.checkpoint shards, no safetensors)."""
    return (path / SHARDS / ".metadata").is_file()


def intact_text(run_dir: Path) -> str:
    """What a failed write leaves intact, for its one-line error: 'last good checkpoint: step N'."""
    found = list_checkpoints(run_dir)
    if not found:
        return "no checkpoint has been written yet"
    return f"last good checkpoint: step {int(found[-1].name[len(_PREFIX) :])}"


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first (a folder without state.json is incomplete)."""
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return []
    found = [
        p
        for p in root.iterdir()
        if p.name.startswith(_PREFIX) and p.name[len(_PREFIX) :].isdigit() and (p / "state.json").is_file()
    ]
    return sorted(found, key=lambda p: p.name)


def load_checkpoint(
    path: Path,
) -> tuple[dict[str, torch.Tensor] | None, dict[str, torch.Tensor] | None, dict[str, Any]]:
    """(student weights, optimizer tensors, state) of one checkpoint, with one-line errors; a sharded
    checkpoint's tensors are None (read them with distributed.load_sharded)."""
    state = read_json(path / "state.json", max_bytes=256 << 20, what="a checkpoint state.json")
    try:
        if state.get("format") == "sharded":
            if not is_sharded(path):
                raise OSError(f"no {SHARDS}/.metadata")
            return None, None, state
        weights = load_file(str(path / "student.safetensors"))
        opt = load_file(str(path / "optimizer.safetensors"))
    except (OSError, ValueError, SafetensorError) as e:
        raise UserError(f"{path}: checkpoint is unreadable ({e.__class__.__name__})") from None
    return weights, opt, state


def latest_loadable(run_dir: Path) -> tuple[Path, tuple] | None:
    """The newest checkpoint that loads, skipping damaged ones; None if there is none."""
    for path in reversed(list_checkpoints(run_dir)):
        try:
            return path, load_checkpoint(path)
        except UserError:
            continue
    return None


def why_unloadable(run_dir: Path) -> str:
    """Each checkpoint found and why it does not load, for the 'no loadable checkpoint' error."""
    parts = []
    for path in list_checkpoints(run_dir)[-4:]:
        try:
            load_checkpoint(path)
            parts.append(f"{path.name}: loads")
        except UserError as e:
            parts.append(
                f"{path.name}: {str(e).removeprefix(str(path) + ': ').removeprefix(str(path) + '/')}"
            )
    return "; ".join(parts) or "none"


def clean_partial(run_dir: Path) -> None:
    """Remove what a killed process left in the run directory (the caller holds the run's lock): temp
    folders of a checkpoint write, of the export (`.student.tmp-*`, `.adapter.tmp-*`: kdistill.outputs)
    and temp files of atomic writes (`.summary.json.<random>.tmp`, ...)."""
    root = run_dir / "checkpoints"
    if root.is_dir():
        for p in root.iterdir():
            if p.name.startswith(".tmp-"):
                shutil.rmtree(p, ignore_errors=True)
    for name in ("student", "adapter"):
        clean_stale(run_dir / name)
    if run_dir.is_dir():
        for p in run_dir.glob(".*.tmp"):
            if p.is_file() and not p.is_symlink():
                p.unlink(missing_ok=True)
