"""`kdistill run`: a new run, a resumed run, the embedded demo, or any of them under torchrun.

    kdistill run                                   # the embedded demo (CPU, offline, < 3 minutes)
    kdistill run run.yaml kd.temperature=2         # a config plus dotted overrides
    kdistill run --resume runs/a                   # continue exactly where runs/a stopped
    torchrun --nproc_per_node=8 -m kdistill run run.yaml
    torchrun --nproc_per_node=8 --max-restarts=3 -m kdistill run run.yaml    # a failed rank: restart,
                                                                              # resume from the last checkpoint

The recipe itself is kdistill.train.recipe.train; this module turns arguments into its inputs,
prepares the run folder and prints the summary line.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any

from kdistill import signals
from kdistill.commands.common import split_config_args
from kdistill.config import RunConfig, load_config
from kdistill.console import print_json
from kdistill.demo.onpolicy import is_onpolicy_demo, run_onpolicy_demo
from kdistill.demo.run import run_demo
from kdistill.errors import UserError
from kdistill.models.hub import resolve_run_models
from kdistill.outputs import check_inputs
from kdistill.rundir import RunLock
from kdistill.train import checkpoint as ckpt
from kdistill.train import distributed as dist
from kdistill.train.preflight import resolve_device
from kdistill.train.recipe import train
from kdistill.train.resume import check_steps_held
from kdistill.train.rundir import (
    Claim,
    check_identity,
    discard_unstarted,
    prepare_output,
    print_config,
    start_run_dir,
)


def run_command(args: argparse.Namespace) -> int:
    """One process: resume, the demo, or a new run from CONFIG; torchrun: `run_distributed`."""
    logging.basicConfig(level=logging.WARNING, format="kdistill: %(message)s")
    if args.allow_changes and not args.resume:
        raise UserError("--allow-changes applies to --resume RUN_DIR only")
    if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
        return run_distributed(args)
    if args.resume:
        cfg, run_dir = resume_config(args)
        with RunLock(run_dir, name="--resume"):
            summary = train(cfg, run_dir, resume=True, quiet=args.quiet)
        print_summary(summary, args.json)
        return 0
    config_path, overrides = new_run_args(args)
    if is_demo(config_path, overrides):
        return run_demo(overrides, quiet=args.quiet, as_json=args.json)
    if is_onpolicy_demo(config_path):  # the embedded on-policy comparison (two runs and a table)
        return run_onpolicy_demo(overrides, quiet=args.quiet, as_json=args.json)
    cfg = load_config(config_path, overrides).validate()
    summary = new_run(cfg, overwrite=args.overwrite, quiet=args.quiet)
    print_summary(summary, args.json)
    return 0


def new_run(cfg: RunConfig, *, overwrite: bool = False, quiet: bool = False) -> dict[str, Any]:
    """A new run of a validated config in one process (`kdistill run` and `kdistill.distill`): Hub
    names resolved, output.dir prepared, manifest and config written, trained; returns the summary.
    A run that fails before its first step leaves nothing behind."""
    hub = resolve_run_models(cfg)
    run_dir = Path(cfg.output.dir)
    check_inputs(run_dir, run_inputs(cfg), name="output.dir")  # --overwrite never removes an input
    claim = prepare_output(run_dir, overwrite)  # marker + lock, held for the whole run
    try:
        try:
            with signals.stage("setup"):
                print_config(cfg, quiet)
                device, _ = resolve_device(cfg)
                start_run_dir(cfg, run_dir, str(device), hub)
            return train(cfg, run_dir, quiet=quiet)
        except BaseException:
            discard_unstarted(run_dir, claim.created)
            raise
    finally:
        claim.release()


def run_inputs(cfg: RunConfig) -> list[tuple[str, str]]:
    """(label, path) of what a run reads: output.dir may not be, or contain, any of them."""
    return [
        ("teacher.path", cfg.teacher.path),
        *((f"teachers[{i}].path", t.path) for i, t in enumerate(cfg.teachers)),
        ("student.path", cfg.student.path),
        ("teacher.cache", cfg.teacher.cache),
        *((f"data.train[{i}]", p) for i, p in enumerate(cfg.data.train)),
        *((f"data.heldout[{i}]", p) for i, p in enumerate(cfg.data.heldout)),
    ]


def run_distributed(args: argparse.Namespace) -> int:
    """`torchrun --nproc_per_node=N -m kdistill run CONFIG`: every process trains its slice of each batch;
    rank 0 alone prepares the output folder, writes the run's files and prints the summary.

    A restarted attempt (torchrun --max-restarts, TORCHELASTIC_RESTART_COUNT > 0) of a new run whose
    folder the first attempt made resumes from its newest checkpoint, or starts over when it has none."""
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0
    if restarted and not args.resume:
        args = restart_args(args)
    if args.resume:
        cfg, run_dir = resume_config(args)
    else:
        config_path, overrides = new_run_args(args)
        if is_demo(config_path, overrides):
            raise UserError("the embedded demo runs in one process: give torchrun a run config (CONFIG)")
        cfg = load_config(config_path, overrides).validate()
        run_dir = Path(cfg.output.dir)
    # A one-line error before anything is written, and before joining the process group: a process that
    # joined and left at once could end its peers' joining with a connection error of their own.
    dist.check_divisible(cfg.schedule.batch_size, dist.env_world())
    hub = resolve_run_models(cfg)
    device, _ = resolve_device(cfg)
    info = dist.init_from_env(device.type)
    if info.device is not None:
        device = info.device
    claims: list[Claim] = []  # rank 0's claim on the run directory (marker and lock)

    def start() -> None:
        if args.resume:
            claims.append(Claim(RunLock(run_dir, name="--resume").acquire(), None))
            return
        check_inputs(run_dir, run_inputs(cfg), name="output.dir")
        claims.append(prepare_output(run_dir, args.overwrite))
        with signals.stage("setup"):
            print_config(cfg, args.quiet)
            start_run_dir(cfg, run_dir, str(device), hub)

    try:
        try:
            dist.run_on_main(start)
            summary = train(cfg, run_dir, resume=bool(args.resume), quiet=args.quiet)
        except BaseException:
            if not args.resume and claims:
                discard_unstarted(run_dir, claims[0].created)
            raise
        if dist.is_main():
            print_summary(summary, args.json)
    finally:
        for claim in claims:
            claim.release()
        dist.destroy()
    return 0


def restart_args(args: argparse.Namespace) -> argparse.Namespace:
    """The arguments of a restarted torchrun attempt: --resume the run folder when the first attempt
    made it (config.yaml) and left a checkpoint; --overwrite it when it left none (start over)."""
    config_path, overrides = new_run_args(args)
    if is_demo(config_path, overrides):
        return args
    run_dir = Path(load_config(config_path, overrides).output.dir)
    if not (run_dir / "config.yaml").is_file():
        return args
    if ckpt.list_checkpoints(run_dir):
        return argparse.Namespace(**{**vars(args), "resume": str(run_dir), "config": None, "overrides": []})
    return argparse.Namespace(**{**vars(args), "overwrite": True})


def resume_config(args: argparse.Namespace) -> tuple[RunConfig, Path]:
    """The config of the run in --resume RUN_DIR (its saved config.yaml plus any overrides)."""
    run_dir = Path(args.resume)
    cfg_path = run_dir / "config.yaml"
    if not cfg_path.is_file():
        raise UserError(f"--resume {run_dir}: no config.yaml there (not a kdistill run directory)")
    cfg = load_config(cfg_path, [*([args.config] if args.config else []), *args.overrides]).validate()
    found = ckpt.list_checkpoints(run_dir)
    if not found:
        raise UserError(f"--resume {run_dir}: no complete checkpoint to resume from")
    saved = load_config(cfg_path)
    # before anything is loaded or written, when every checkpoint is past the steps asked for (the one
    # resumed from, the newest loadable, is checked again once it is read)
    if int(found[0].name.removeprefix("step-")) > cfg.schedule.steps:
        check_steps_held(run_dir, found[-1].name, int(found[-1].name.removeprefix("step-")), saved, cfg)
    if os.environ.get("RANK", "0") == "0":
        check_identity(run_dir, cfg, args.allow_changes)
    if saved.schedule.steps != cfg.schedule.steps and not args.quiet and os.environ.get("RANK", "0") == "0":
        print(
            f"schedule.steps {saved.schedule.steps} -> {cfg.schedule.steps}: the learning-rate schedule follows "
            "the new total from here on",
            file=sys.stderr,
        )
    return cfg, run_dir


def new_run_args(args: argparse.Namespace) -> tuple[str | None, list[str]]:
    """(config path, overrides): `kdistill run key=value ...` has no config file."""
    return split_config_args(args.config, args.overrides)


def is_demo(config_path: str | None, overrides: list[str]) -> bool:
    """No config and no teacher (teacher.path or teachers): the embedded demo (overrides apply to it)."""
    teacher = ("teacher.path=", "teachers=", "teachers.", "teachers[")
    return config_path is None and not any(o.startswith(teacher) for o in overrides)


def print_summary(summary: dict[str, Any], as_json: bool) -> None:
    """The run's last line on stdout (or the whole summary as JSON)."""
    if as_json:
        print_json(summary)
        return

    def num(v: Any) -> str:
        return f"{v:.4f}" if isinstance(v, int | float) else "n/a"

    h = summary["heldout"]
    print(
        f"status {summary['status']}: {summary['steps']} steps, loss {num(summary['initial_loss'])} -> "
        f"{num(summary['final_loss'])}, held-out student {num(h.get('student_loss'))}, "
        f"jit_after_prewarm {summary['jit_after_prewarm']}"
    )
