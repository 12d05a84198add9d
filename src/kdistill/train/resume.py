"""What a checkpoint saves of a run, and how a resumed run puts it back.

    counters = new_counters()
    save_state(run_dir, step, student, opt, batcher, counters, cfg)              # every checkpoint
    start_step = restore_state(run_dir, student, opt, batcher, counters, cfg, device)   # --resume

Saved: the student's weights (a LoRA student's adapters and `kd_` modules only, see below) and the AdamW
state (tensors, checkpoint.py), and state.json: the step, the data position (the batcher's shuffle state),
the CPU RNG, the counters below and the config. So a resumed run draws the same batches, the same random
numbers and continues the same schedule; its metrics.jsonl and eval.jsonl keep the lines up to the step
resumed from.

Under torchrun (`dist.active()`) every process writes its own shards (torch.distributed.checkpoint;
collective: every process calls `save_state`), nothing gathered. `restore_state` reads either format into
either kind of run: a sharded checkpoint into a sharded or a one-process student (DCP reshards), a
one-process checkpoint's full tensors into a sharded student. A checkpoint of N processes resumes on M
(tests/test_distributed.py: 2 -> 1, 1 -> 2, 2 -> 4).
A LoRA student's checkpoints hold its adapters, the distillation-only `kd_` modules that train with them
(kd.layer_map's projections: `lora.checkpoint_state`) and their AdamW state in either format, never the
base.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException

from kdistill.config import RunConfig, load_config
from kdistill.data import Batcher
from kdistill.errors import UserError
from kdistill.jsonio import cut, short_repr
from kdistill.models.lora import checkpoint_state, has_lora
from kdistill.train import checkpoint as ckpt
from kdistill.train import distributed as dist
from kdistill.train.rundir import record_resume_overrides


def new_counters() -> dict[str, Any]:
    """The run's totals, carried across a resume (state.json "counters") and reported in summary.json."""
    return {"nonfinite_skipped": 0, "degenerate_batches": 0, "tokens_seen": 0, "train_seconds": 0.0}


def save_state(
    run_dir: Path,
    step: int,
    student: torch.nn.Module,
    opt: torch.optim.Optimizer,
    batcher: Batcher,
    counters: dict[str, Any],
    cfg: RunConfig,
    onpolicy: Any = None,
) -> None:
    """Checkpoint `step` (atomic, rotated to output.keep_checkpoints). onpolicy: a run's
    kdistill.train.onpolicy.OnPolicy (its prompt order, sampling generator and totals), or None."""
    state = {
        "batcher": batcher.state_dict(),
        "rng_cpu": torch.get_rng_state().tolist(),
        "counters": counters,
        "config": cfg.to_dict(),
    }
    if onpolicy is not None:
        state["onpolicy"] = onpolicy.state_dict()
    if dist.active():  # every process writes its own shards (collective), rank 0 commits the folder
        ckpt.save_sharded_checkpoint(
            run_dir,
            step,
            lambda folder: dist.save_sharded(student, opt, folder),
            state,
            cfg.output.keep_checkpoints,
        )
        return
    # A LoRA student's checkpoint holds its adapters and `kd_` modules (layer-map projections) only: the
    # frozen base is student.path's weights. (Sharded: every trainable tensor, the same set.)
    held = dist.FullState(checkpoint_state(student)) if has_lora(student) else student
    ckpt.save_checkpoint(run_dir, step, held, opt, state, cfg.output.keep_checkpoints)  # type: ignore[arg-type]


def restore_state(
    run_dir: Path,
    student: torch.nn.Module,
    opt: torch.optim.Optimizer,
    batcher: Batcher,
    counters: dict[str, Any],
    cfg: RunConfig,
    device: torch.device,
    onpolicy: Any = None,
) -> int:
    """Load the newest loadable checkpoint into student, opt, batcher, the RNG and `counters`; return
    the step to continue from (0 when there is none). A checkpoint that does not fit this run is a
    one-line UserError."""
    multi = dist.active()
    if multi:
        dist.run_on_main(lambda: ckpt.clean_partial(run_dir))
    else:
        ckpt.clean_partial(run_dir)
    found = ckpt.latest_loadable(run_dir)
    if found is None:  # never a silent restart from step 0
        raise UserError(f"--resume {run_dir}: no loadable checkpoint (found: {ckpt.why_unloadable(run_dir)})")
    path, (weights, opt_tensors, state) = found
    try:
        if weights is None or opt_tensors is None:  # a sharded checkpoint, read into any layout
            shards = str(path / ckpt.SHARDS)
            saved_lora = any(".lora_A." in k for k in dist.sharded_model_names(shards))
            if saved_lora != has_lora(student):
                kinds = ("LoRA adapters", "a full student")
                saved, run = kinds if saved_lora else kinds[::-1]
                raise ValueError(f"a sharded checkpoint of {saved}, this run trains {run}")
            dist.load_sharded(student, opt, shards)
        else:
            _load_full(student, opt, weights, opt_tensors, state, device)
        batcher.load_state_dict(state["batcher"])
        torch.set_rng_state(torch.tensor(state["rng_cpu"], dtype=torch.uint8))
        if onpolicy is not None:  # KeyError for a checkpoint of a run that did not generate
            onpolicy.load_state_dict(state["onpolicy"])
        start_step = state["step"]
        if type(start_step) is not int or start_step < 0:
            raise ValueError(f"step {start_step!r}")
        counters.update({k: type(v)(state["counters"][k]) for k, v in counters.items()})
    except (
        RuntimeError,
        KeyError,
        TypeError,
        ValueError,
        AttributeError,
        IndexError,
        OverflowError,
        CheckpointException,
    ) as e:
        # A damaged or foreign checkpoint: names, shapes or state that do not fit this run.
        what = str(e).splitlines()[0][:200] if str(e) else e.__class__.__name__
        raise UserError(f"{path}: checkpoint does not match this run ({cut(what, 200)})") from None
    saved = load_config(run_dir / "config.yaml")
    check_steps_held(run_dir, path.name, start_step, saved, cfg)
    if dist.is_main():
        print(f"resuming from {path} (step {start_step})", file=sys.stderr)
        # the checkpoint fits: overrides given with --resume (schedule.steps=N) become the run's config,
        # so that a later plain --resume (after a killed export) continues with them
        record_resume_overrides(run_dir, saved, cfg)
    return start_step


def check_steps_held(run_dir: Path, name: str, step: int, saved: RunConfig, cfg: RunConfig) -> None:
    """A checkpoint is never edited after it is written, so a resume cannot ask for fewer steps than
    checkpoint `name` (at `step`) holds: one line. (A plain --resume whose config.yaml predates recorded
    overrides, and so names fewer steps than a checkpoint of an extended run, is no such request: it
    goes straight to the export of that checkpoint.)"""
    if step > cfg.schedule.steps and cfg.schedule.steps != saved.schedule.steps:
        raise UserError(
            f"--resume {run_dir}: schedule.steps is {cfg.schedule.steps}, but {name} holds step {step}; "
            f"give schedule.steps={step} or more (a checkpoint is never cut back)"
        )


def _load_full(
    student: torch.nn.Module,
    opt: torch.optim.Optimizer,
    weights: dict[str, torch.Tensor],
    opt_tensors: dict[str, torch.Tensor],
    state: dict[str, Any],
    device: torch.device,
) -> None:
    """A one-process checkpoint's full tensors into the student (sharded or not) and its optimizer;
    names and shapes checked first (a ValueError names the first that does not fit)."""
    lora = has_lora(student)
    own = checkpoint_state(student) if lora else student.state_dict()
    odd = sorted(set(own) ^ set(weights))
    if odd:
        raise ValueError(f"{'unexpected' if odd[0] in weights else 'missing'} tensor {short_repr(odd[0])}")
    for k, v in weights.items():
        if v.shape != own[k].shape:
            raise ValueError(f"tensor {k!r} has shape {list(v.shape)}, expected {list(own[k].shape)}")
    if dist.active():
        holder = dist.FullState({})
        ckpt.load_optimizer_tensors(holder, opt_tensors, state["optimizer"])  # type: ignore[arg-type]
        dist.load_full_state(student, opt, weights, holder.loaded)
    else:
        check_optimizer_shapes(opt, opt_tensors)
        student.load_state_dict({k: v.to(device) for k, v in weights.items()}, strict=not lora)
        ckpt.load_optimizer_tensors(
            opt, {k: v.to(device) for k, v in opt_tensors.items()}, state["optimizer"]
        )


def check_optimizer_shapes(opt: torch.optim.Optimizer, tensors: dict[str, torch.Tensor]) -> None:
    """Every saved optimizer tensor '<param index>.<name>' names a parameter of this run and has its shape
    (or is a scalar, like AdamW's step); else a ValueError naming the tensor."""
    params = [p for group in opt.param_groups for p in group["params"]]
    for key, t in tensors.items():
        idx, _, name = key.partition(".")
        if not idx.isdigit() or not name or int(idx) >= len(params):
            raise ValueError(f"unexpected optimizer tensor {short_repr(key)}")
        want = list(params[int(idx)].shape)
        if t.dim() > 0 and list(t.shape) != want:
            raise ValueError(f"optimizer tensor {key!r} has shape {list(t.shape)}, expected {want}")
