"""Run evidence: manifest.json, metrics.jsonl, loss.png, summary.json, and `kdistill report`.

kdistill report runs/demo          # readable summary of a finished or interrupted run
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from kdistill import __version__
from kdistill.errors import UserError


def atomic_write_text(path: Path, text: str) -> None:
    """Write text to a temp file in the same folder, fsync, then rename over `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, default=str) + "\n")


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def model_hashes(model_dir: str) -> dict[str, str]:
    """sha256 of each weight and tokenizer file of a model directory (empty for presets)."""
    d = Path(model_dir)
    if not d.is_dir():
        return {}
    names = sorted(p for p in d.iterdir() if p.suffix in (".safetensors", ".json") and p.is_file())
    return {p.name: file_sha256(p) for p in names}


def git_commit() -> str | None:
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(
            ["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def make_manifest(cfg_dict: dict[str, Any], device: str, device_name: str) -> dict[str, Any]:
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "kdistill": __version__,
        "torch": torch.__version__,
        "triton": triton_version,
        "python": platform.python_version(),
        "git_commit": git_commit(),
        "device": device,
        "device_name": device_name,
        "config": cfg_dict,
        "teacher_files": model_hashes(cfg_dict["teacher"]["path"]),
        "student_files": model_hashes(cfg_dict["student"]["path"]),
    }


class MetricsWriter:
    """Appends one JSON line per step to metrics.jsonl (flushed each line)."""

    def __init__(self, path: Path, keep_until_step: int | None = None) -> None:
        self.path = path
        if keep_until_step is not None and path.exists():
            # On resume, drop lines written after the checkpoint we continue from.
            kept = [ln for ln in read_metrics(path) if ln.get("step", 0) <= keep_until_step]
            atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in kept))
        self._f = open(path, "a", encoding="utf-8")

    def write(self, row: dict[str, Any]) -> None:
        self._f.write(json.dumps(row) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    rows = []
    if not path.exists():
        return rows
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut by a kill
    return rows


def plot_losses(run_dir: Path, title: str = "kdistill") -> Path | None:
    """loss.png: training loss (and its CE/KD parts) and held-out curves against the step."""
    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r and r.get("loss") is not None]
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    steps = [r["step"] for r in rows]
    ax.plot(steps, [r["loss"] for r in rows], label="train loss (total)", lw=1.2)
    if any(r.get("ce") is not None for r in rows):
        ax.plot(steps, [r.get("ce") for r in rows], label="train CE", lw=0.8, alpha=0.7)
    if any(r.get("kd") for r in rows):
        ax.plot(steps, [r.get("kd") for r in rows], label="train KD", lw=0.8, alpha=0.7)
    evals = [r for r in read_metrics(run_dir / "eval.jsonl")]
    if evals:
        ax.plot(
            [r["step"] for r in evals], [r["student_loss"] for r in evals], "o-", label="held-out student CE"
        )
        if evals[0].get("teacher_loss") is not None:
            ax.axhline(evals[0]["teacher_loss"], color="gray", ls="--", label="held-out teacher CE")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out = run_dir / "loss.png"
    tmp = run_dir / ".loss.tmp.png"
    fig.savefig(tmp)
    plt.close(fig)
    os.replace(tmp, out)
    return out


def smoke_contract(rows: list[dict[str, Any]]) -> tuple[float | None, float | None, bool]:
    """(initial loss, final loss = mean of the last 10% of steps, final < initial) over good steps."""
    good = [
        r["loss"]
        for r in rows
        if r.get("loss") is not None and not r.get("skipped") and not r.get("degenerate")
    ]
    if not good:
        return None, None, False
    tail = max(1, len(good) // 10)
    final = sum(good[-tail:]) / tail
    return good[0], final, final < good[0]


def report_command(args: argparse.Namespace) -> int:
    from kdistill.cli import print_json

    run_dir = Path(args.run_dir)
    if not (run_dir / "manifest.json").is_file():
        raise UserError(f"{run_dir}: not a kdistill run directory (no manifest.json)")
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    rows = read_metrics(run_dir / "metrics.jsonl")
    evals = read_metrics(run_dir / "eval.jsonl")
    from kdistill.train.checkpoint import list_checkpoints

    ckpts = [p.name for p in list_checkpoints(run_dir)]
    initial, final, ok = smoke_contract(rows)
    report = {
        "run_dir": str(run_dir),
        "status": summary.get("status", "running or killed (no summary.json)"),
        "steps_done": rows[-1]["step"] if rows else 0,
        "initial_loss": summary.get("initial_loss", initial),
        "final_loss": summary.get("final_loss", final),
        "smoke_passed": summary.get("smoke_passed", ok),
        "heldout": summary.get("heldout", evals[-1] if evals else {}),
        "tokens_per_s": summary.get("tokens_per_s"),
        "jit_after_prewarm": summary.get("jit_after_prewarm"),
        "checkpoints": ckpts,
    }
    if args.json:
        print_json(report)
        return 0
    print(f"run         {run_dir}")
    print(f"status      {report['status']}")
    print(f"steps       {report['steps_done']}")
    if report["initial_loss"] is not None:
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
    print(f"checkpoints {', '.join(ckpts) if ckpts else 'none'}")
    return 0


def plot_comparison(runs: dict[str, Path], out: Path, title: str) -> Path | None:
    """One figure of held-out student loss against the step for several runs, with the teacher's."""
    curves = {name: read_metrics(d / "eval.jsonl") for name, d in runs.items()}
    if not any(curves.values()):
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    teacher = None
    for name, rows in curves.items():
        if rows:
            ax.plot([r["step"] for r in rows], [r["student_loss"] for r in rows], "o-", label=name)
            teacher = teacher or next((r["teacher_loss"] for r in rows if r.get("teacher_loss")), None)
    if teacher is not None:
        ax.axhline(teacher, color="gray", ls="--", label="teacher")
    ax.set_xlabel("step")
    ax.set_ylabel("held-out loss (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    tmp = out.with_name(f".{out.name}.tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    os.replace(tmp, out)
    return out
