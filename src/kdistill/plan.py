"""The planner: parameter counts, FLOPs per token and peak GPU memory, from configs alone.

    kdistill plan run.yaml            # teacher/student from the config
    kdistill plan qwen2.5-1.5b:qwen2.5-0.5b data.seq_len=2048 schedule.batch_size=4 --json

The memory model (bytes on one device, GPU path: bf16 teacher, fp32 student master weights with bf16
autocast, AdamW) is written term by term in `estimate_memory`; docs/memory.md compares it with
`torch.cuda.max_memory_allocated` on an H100.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from kdistill.config import RunConfig, load_config
from kdistill.errors import UserError
from kdistill.models.spec import ModelSpec, load_spec

GIB = 1024**3

# Saved-for-backward bytes per token per layer, per unit of width, for the bf16-autocast student on
# the kernel path. Counted from the decoder's ops: two fp32 residual sums kept by the fused norms (8H)
# and five bf16 casts of normed inputs for the q/k/v/gate/up projections (10H); q, k, v saved by SDPA,
# its output and o_proj's input (about 6 per unit of q + 2kv); gate, up and the SwiGLU output (6I).
# Checked against torch.cuda.max_memory_allocated on an H200 (docs/memory.md).
ACT_COEF_GPU = {"hidden": 18.0, "inter": 6.0, "qkv": 6.0}
ACT_COEF_CPU = {"hidden": 28.0, "inter": 16.0, "qkv": 12.0}  # fp32 everywhere, reference ops


def resolve_pair(config: str | None, overrides: list[str]) -> tuple[RunConfig, ModelSpec, ModelSpec]:
    """A RunConfig and the two specs from a YAML path or a 'TEACHER:STUDENT' preset pair."""
    if config and config.endswith((".yaml", ".yml")) or (config and ":" not in config):
        cfg = load_config(config, overrides)
    else:
        if not config:
            raise UserError(
                "expected CONFIG: a YAML run config or a preset pair like qwen2.5-1.5b:qwen2.5-0.5b"
            )
        teacher, student = config.split(":", 1)
        cfg = load_config(None, [f"teacher.path={teacher}", f"student.path={student}", *overrides])
    cfg.validate()
    return cfg, load_spec(cfg.teacher.path), load_spec(cfg.student.path)


def estimate_memory(
    teacher: ModelSpec, student: ModelSpec, cfg: RunConfig, device: str = "cuda"
) -> dict[str, int]:
    """Peak memory of one training step on one device, by term, in bytes.

    The peak is at the end of the student's forward pass, when everything below is live at once:
    weights, AdamW state and autocast's bf16 weight copies; the student's saved activations; the
    teacher's final hidden states; the KD head's gradient buffers for the hidden states and the
    lm_head; and two [chunk x vocab] fp32 logits buffers of the chunk being computed. (The teacher's
    own forward runs before the student's activations exist, and the student's gradients replace its
    activations during the backward pass, so neither adds to this peak unless it is larger:
    `optimizer_phase` covers the end of the backward pass.)
    """
    gpu = device != "cpu"
    n = cfg.schedule.batch_size * cfg.data.seq_len  # tokens per micro-batch
    ps = student.param_counts()["total"]
    pt = teacher.param_counts()["total"]
    act_bytes = 2 if gpu else 4
    coef = ACT_COEF_GPU if gpu else ACT_COEF_CPU
    per_tok_layer = (
        coef["hidden"] * student.hidden_size
        + coef["inter"] * student.intermediate_size
        + coef["qkv"] * (student.q_size + 2 * student.kv_size)
    )
    vocab = student.vocab_size
    chunk = min(cfg.kd.chunk_size, n)
    fixed = {
        "teacher_weights": pt * act_bytes,
        "student_weights": ps * 4,
        "optimizer_state": ps * 8,
        "autocast_weight_copies": ps * 2 if gpu else 0,
    }
    forward_peak = {
        "student_activations": int(n * student.num_layers * per_tok_layer) + n * student.hidden_size * 4,
        "teacher_hidden": n * teacher.hidden_size * act_bytes,
        "loss_gradients": n * student.hidden_size * 4 + vocab * student.hidden_size * 4,
        "loss_chunk_logits": 2 * chunk * vocab * 4,
    }
    optimizer_phase = ps * 4 * 2  # gradients plus AdamW's foreach temporaries
    terms = {**fixed, **forward_peak}
    live_forward = sum(forward_peak.values())
    if optimizer_phase > live_forward:
        terms = {**fixed, "gradients_and_optimizer_temporaries": optimizer_phase}
    terms["total"] = sum(terms.values())
    return terms


def fit_limits(teacher: ModelSpec, student: ModelSpec, cfg: RunConfig, budget: int) -> dict[str, int]:
    """Largest batch size (at the configured seq_len) and seq_len (at the configured batch) that fit."""

    def peak(bs: int, sl: int) -> int:
        c = dataclasses.replace(
            cfg,
            schedule=dataclasses.replace(cfg.schedule, batch_size=bs),
            data=dataclasses.replace(cfg.data, seq_len=sl),
        )
        return estimate_memory(teacher, student, c)["total"]

    best_bs = 0
    for bs in range(1, cfg.schedule.batch_size + 1):
        if peak(bs, cfg.data.seq_len) <= budget:
            best_bs = bs
    best_sl, sl = 0, 64
    while sl <= cfg.data.seq_len:
        if peak(cfg.schedule.batch_size, sl) <= budget:
            best_sl = sl
        sl *= 2
    return {"batch_size": best_bs, "seq_len": best_sl}


def make_plan(cfg: RunConfig, teacher: ModelSpec, student: ModelSpec) -> dict[str, Any]:
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
    from pathlib import Path

    p = Path(name)
    short = p.parent.name if p.name == "config.json" else p.name
    return short if len(short) <= width else short[: width - 1] + "…"


def format_plan(plan: dict[str, Any]) -> str:
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
    from kdistill.cli import print_json

    cfg, teacher, student = resolve_pair(args.config, args.overrides)
    plan = make_plan(cfg, teacher, student)
    print_json(plan) if args.json else print(format_plan(plan))
    return 0
