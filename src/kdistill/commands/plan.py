"""`kdistill plan`: parameter counts, FLOPs per token and peak GPU memory, from configs alone.

    kdistill plan run.yaml            # teacher/student from the config
    kdistill plan qwen2.5-1.5b:qwen2.5-0.5b data.seq_len=2048 schedule.batch_size=4 --json
    kdistill plan qwen2.5-32b:qwen2.5-1.5b schedule.batch_size=8 --nproc 2     # one of 2 processes

The memory terms come from `kdistill.memory.estimate_memory`, for one process of --nproc (its share
of schedule.batch_size) with the layout the run would choose on a GPU of runtime.gpu_memory_gib (80
GiB when unset): teacher placement and activation checkpointing, their `auto` resolved. The plan also
says how many such GPUs the pair needs (`memory.gpus_needed`).
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

from kdistill.commands.common import resolve_run
from kdistill.config import RunConfig
from kdistill.console import print_json
from kdistill.errors import UserError
from kdistill.memory import GIB, choose_layout, estimate_memory, gpus_needed
from kdistill.models.lora import check_lora
from kdistill.models.spec import ModelSpec, load_spec
from kdistill.train.preflight import disk_plan

DEFAULT_GPU_GIB = 80.0


def make_plan(cfg: RunConfig, teacher: ModelSpec, student: ModelSpec, nproc: int = 1) -> dict[str, Any]:
    """Parameters, FLOPs per token and per step, the memory estimate of one of `nproc` processes, and
    the number of GPUs the pair needs."""
    if nproc < 1 or cfg.schedule.batch_size % nproc:
        raise UserError(
            f"--nproc {nproc}: expected a positive number that divides schedule.batch_size "
            f"({cfg.schedule.batch_size})"
        )
    check_lora(cfg.student.lora, student)
    gpu_gib = cfg.runtime.gpu_memory_gib or DEFAULT_GPU_GIB
    budget = int(gpu_gib * GIB * 0.95)
    per = cfg.schedule.batch_size // nproc
    layout = choose_layout(teacher, student, cfg, budget, nproc, per)
    needed = gpus_needed(teacher, student, cfg, int(gpu_gib * GIB))
    seq = cfg.data.seq_len
    # a mixture (`teachers:`): the other teachers run forward too and are held in memory
    extras = [load_spec(t.path) for t in cfg.teachers[1:]]
    t_fwd = teacher.matmul_flops_per_token(seq) + sum(t.matmul_flops_per_token(seq) for t in extras)
    s_fwd = student.matmul_flops_per_token(seq)
    tokens_per_step = cfg.schedule.batch_size * seq * cfg.schedule.grad_accum
    mem = estimate_memory(teacher, student, cfg, batch=per, layout=layout, extra_teachers=extras)
    disk = disk_plan(cfg, student, teacher=teacher)  # what the run writes into output.dir at its largest
    return {
        "teacher": {"name": teacher.name, "arch": teacher.arch, "params": teacher.param_counts()},
        "student": {"name": student.name, "arch": student.arch, "params": student.param_counts()},
        "flops_per_token": {
            "teacher_forward": t_fwd,
            "student_forward_backward": 3 * s_fwd,
            "total": t_fwd + 3 * s_fwd,
        },
        "tokens_per_step": tokens_per_step,
        "flops_per_step": (t_fwd + 3 * s_fwd) * tokens_per_step,
        "batch_size": cfg.schedule.batch_size,
        "seq_len": seq,
        "nproc": nproc,
        "batch_per_process": per,
        "layout": dataclasses.asdict(layout),
        "memory_bytes": mem,
        "memory_gib": {k: round(v / GIB, 3) for k, v in mem.items()},
        "disk_bytes": disk,
        "gpus": {
            "gpu_gib": gpu_gib,
            "needed": needed[0] if needed else None,
            "layout": dataclasses.asdict(needed[1]) if needed else None,
            "line": gpus_line(needed, gpu_gib),
        },
    }


def gpus_line(needed: Any, gpu_gib: float) -> str:
    """`needs 2 GPUs of 80 GiB with the teacher sharded` (what `gpus_needed` found), in words."""
    if needed is None:
        return f"does not fit GPUs of {gpu_gib:g} GiB at this batch and seq_len, on up to 64 of them"
    world, layout = needed
    how = []
    if world > 1:
        how.append("the teacher sharded" if layout.teacher_sharded else "the teacher replicated")
        if layout.student_replicated:
            how.append("the student replicated")
    if layout.checkpointing:
        how.append("activation checkpointing")
    gpus = "1 GPU" if world == 1 else f"{world} GPUs"
    return f"needs {gpus} of {gpu_gib:g} GiB" + (f" with {' and '.join(how)}" if how else "")


def _recompute(layout: dict) -> str:
    """What the layout recomputes in backward (runtime.activation_checkpointing, resolved)."""
    if layout["checkpointing"]:
        return "blocks (activation checkpointing)"
    return "nothing" if layout.get("swiglu_kept") else "SwiGLU outputs"


def _short(name: str, width: int = 17) -> str:
    """A model name for the table: a preset as is, a path by its folder name."""
    p = Path(name)
    short = p.parent.name if p.name == "config.json" else p.name
    return short if len(short) <= width else short[: width - 1] + "…"


def format_plan(plan: dict[str, Any]) -> str:
    """The plan as the table `kdistill plan` prints."""
    t, s = plan["teacher"], plan["student"]
    lines = [
        f"{'':24s}{'teacher':>18s}{'student':>18s}",
        f"{'model':24s}{_short(t['name']):>18s}{_short(s['name']):>18s}",
        f"{'parameters (M)':24s}{t['params']['total'] / 1e6:>18.1f}{s['params']['total'] / 1e6:>18.1f}",
        f"{'non-embedding (M)':24s}{t['params']['non_embedding'] / 1e6:>18.1f}{s['params']['non_embedding'] / 1e6:>18.1f}",
        "",
        f"FLOPs per token: teacher forward {plan['flops_per_token']['teacher_forward'] / 1e9:.2f} G, "
        f"student forward+backward {plan['flops_per_token']['student_forward_backward'] / 1e9:.2f} G",
        f"tokens per step: {plan['tokens_per_step']} (batch {plan['batch_size']} x seq {plan['seq_len']} x accum), "
        f"{plan['flops_per_step'] / 1e12:.2f} TFLOP per step",
        "",
        f"peak memory per device (estimate, {plan['layout']['world']} process(es) of batch "
        f"{plan['batch_per_process']}, teacher {'sharded' if plan['layout']['teacher_sharded'] else 'whole'}, "
        + ("student whole, " if plan["layout"].get("student_replicated") else "")
        + f"recompute: {_recompute(plan['layout'])}):",
    ]
    for k, v in plan["memory_gib"].items():
        if k != "total":
            lines.append(f"  {k:28s}{v:10.2f} GiB")
    lines.append(f"  {'total':28s}{plan['memory_gib']['total']:10.2f} GiB")
    lines.append("")
    lines.append(f"GPUs: {plan['gpus']['line']} (schedule.batch_size split over them)")
    d = plan["disk_bytes"]
    lines.append(
        f"disk in output.dir: up to {d['total'] / GIB:.2f} GiB ({d['at_once']} checkpoint(s) of "
        f"{d['checkpoint'] / GIB:.2f} GiB at once, the export {d['export'] / GIB:.2f} GiB)"
    )
    return "\n".join(lines)


def plan_command(args: argparse.Namespace) -> int:
    """`kdistill plan CONFIG [key=value ...] [--json]`: the table (or JSON) of `make_plan`."""
    cfg, teacher, student = resolve_run(args.config, args.overrides)
    plan = make_plan(cfg, teacher, student, nproc=args.nproc)
    print_json(plan) if args.json else print(format_plan(plan))
    return 0
