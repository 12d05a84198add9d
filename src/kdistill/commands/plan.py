"""`kdistill plan`: parameter counts, FLOPs per token and peak GPU memory, from configs alone.

    kdistill plan run.yaml            # teacher/student from the config
    kdistill plan qwen2.5-1.5b:qwen2.5-0.5b data.seq_len=2048 schedule.batch_size=4 --json

The memory terms come from `kdistill.memory.estimate_memory`.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from kdistill.commands.common import resolve_run
from kdistill.config import RunConfig
from kdistill.console import print_json
from kdistill.memory import GIB, estimate_memory
from kdistill.models.spec import ModelSpec


def make_plan(cfg: RunConfig, teacher: ModelSpec, student: ModelSpec) -> dict[str, Any]:
    """Parameters, FLOPs per token and per step, and the memory estimate of one process."""
    seq = cfg.data.seq_len
    t_fwd = teacher.matmul_flops_per_token(seq)
    s_fwd = student.matmul_flops_per_token(seq)
    tokens_per_step = cfg.schedule.batch_size * seq * cfg.schedule.grad_accum
    mem = estimate_memory(teacher, student, cfg)
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
        "memory_bytes": mem,
        "memory_gib": {k: round(v / GIB, 3) for k, v in mem.items()},
    }


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
        "peak memory per device (estimate):",
    ]
    for k, v in plan["memory_gib"].items():
        if k != "total":
            lines.append(f"  {k:28s}{v:10.2f} GiB")
    lines.append(f"  {'total':28s}{plan['memory_gib']['total']:10.2f} GiB")
    return "\n".join(lines)


def plan_command(args: argparse.Namespace) -> int:
    """`kdistill plan CONFIG [key=value ...] [--json]`: the table (or JSON) of `make_plan`."""
    cfg, teacher, student = resolve_run(args.config, args.overrides)
    plan = make_plan(cfg, teacher, student)
    print_json(plan) if args.json else print(format_plan(plan))
    return 0
