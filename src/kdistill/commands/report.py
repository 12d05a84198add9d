"""`kdistill report RUN_DIR`: a readable summary of a finished or interrupted run.

kdistill report runs/demo          # summary.json when the run finished, metrics.jsonl otherwise
kdistill report runs/demo --json

With samples.jsonl (the eval samples), the student's latest answers are printed beside the teacher's.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kdistill.console import print_json
from kdistill.errors import UserError
from kdistill.jsonio import Fields, read_json
from kdistill.train.checkpoint import list_checkpoints
from kdistill.train.evidence import read_metrics, smoke_contract


def report_command(args: argparse.Namespace) -> int:
    """`kdistill report RUN_DIR [--json]`: status, steps, losses, held-out, throughput, checkpoints."""
    run_dir = Path(args.run_dir)
    if not (run_dir / "manifest.json").is_file():
        raise UserError(f"{run_dir}: not a kdistill run directory (no manifest.json)")
    summary_path = run_dir / "summary.json"
    summary = read_summary(summary_path) if summary_path.is_file() else {}
    rows = read_metrics(run_dir / "metrics.jsonl")
    evals = read_metrics(run_dir / "eval.jsonl")
    ckpts = [p.name for p in list_checkpoints(run_dir)]
    initial, final, ok = smoke_contract(rows)
    report = {
        "run_dir": str(run_dir),
        "status": summary.get("status", "running or killed (no summary.json)"),
        "steps_done": rows[-1].get("step", 0) if rows else 0,
        "initial_loss": summary.get("initial_loss", initial),
        "final_loss": summary.get("final_loss", final),
        "smoke_passed": summary.get("smoke_passed", ok),
        "heldout": summary.get("heldout", evals[-1] if evals else {}),
        "tokens_per_s": summary.get("tokens_per_s"),
        "jit_after_prewarm": summary.get("jit_after_prewarm"),
        "draft": summary.get("draft"),
        "checkpoints": ckpts,
        "samples": latest_samples(run_dir / "samples.jsonl"),
    }
    if args.json:
        print_json(report)
        return 0
    print(f"run         {run_dir}")
    print(f"status      {report['status']}")
    print(f"steps       {report['steps_done']}")
    if report["initial_loss"] is not None and report["final_loss"] is not None:
        print(
            f"loss        {report['initial_loss']:.4f} -> {report['final_loss']:.4f} "
            f"({'smoke passed' if report['smoke_passed'] else 'smoke NOT passed'})"
        )
    for k, v in (report["heldout"] or {}).items():
        if isinstance(v, int | float) and k != "step":
            print(f"heldout     {k:14s} {v:.4f}")
    if report["tokens_per_s"]:
        print(f"throughput  {report['tokens_per_s']:.0f} tokens/s")
    if report["jit_after_prewarm"] is not None:
        print(f"jit after prewarm  {report['jit_after_prewarm']}")
    draft = report["draft"]
    if isinstance(draft, dict):
        print(f"draft       {_draft_line(draft)}")
    print(f"checkpoints {', '.join(ckpts) if ckpts else 'none'}")
    for i, row in enumerate(report["samples"]):
        print(f"\nsample {i + 1} (student at step {row['step']})")
        print(f"  prompt   {_one_line(row['prompt'])}")
        if row["teacher"] is not None:
            print(f"  teacher  {_one_line(row['teacher'])}")
        print(f"  student  {_one_line(row['student'])}")
    return 0


def _draft_line(d: dict) -> str:
    """summary.json's `draft`: the student's acceptance as its teacher's draft, or why it was skipped."""
    if d.get("skipped"):
        return f"acceptance not measured: {d['skipped']}"

    def num(key: str, digits: int) -> str:
        v = d.get(key)
        return f"{v:.{digits}f}" if isinstance(v, int | float) and not isinstance(v, bool) else "n/a"

    return (
        f"alpha {num('alpha', 3)} ± {num('alpha_se', 3)} greedy, {num('tokens_per_verify', 2)} tokens per "
        f"verify step of K = {d.get('draft_tokens')} drafts ({d.get('prompts')} held-out prompts)"
    )


def _one_line(text: str, limit: int = 300) -> str:
    """A sample on one line: newlines shown as ⏎, long text cut with …."""
    flat = text.replace("\n", "⏎")
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def latest_samples(path: Path) -> list[dict]:
    """The student's answers at the last step in samples.jsonl, each beside the teacher's answer to
    the same prompt (None when the teacher did not answer it): [{step, prompt, teacher, student}]."""
    rows = read_metrics(path)
    student = [r for r in rows if r.get("model") == "student"]
    if not student:
        return []
    last = max(r.get("step", 0) for r in student)
    teacher = {r.get("prompt"): r.get("answer") for r in rows if r.get("model") == "teacher"}
    return [
        {
            "step": last,
            "prompt": r.get("prompt", ""),
            "teacher": teacher.get(r.get("prompt")),
            "student": r.get("answer", ""),
        }
        for r in student
        if r.get("step") == last
    ]


def read_summary(path: Path) -> dict:
    """summary.json through the one JSON reader; the fields the report prints are type-checked."""
    data = read_json(path, max_bytes=16 << 20, what="a kdistill summary.json")
    f = Fields(data, str(path))
    f.optional("status", "str", max_len=200)
    f.optional("smoke_passed", "bool")
    for key in ("initial_loss", "final_loss", "tokens_per_s"):
        f.optional(key, "float", finite=False)
    f.optional("jit_after_prewarm", "int")
    draft = f.optional("draft", "obj")
    if draft is not None:
        for key in ("alpha", "alpha_se", "tokens_per_verify"):
            draft.optional(key, "float", finite=False)
        draft.optional("skipped", "str", max_len=300)
    held = f.optional("heldout", "obj")
    if held is not None:
        for key in held.keys():
            held.optional(key, "float", finite=False)
    return data
