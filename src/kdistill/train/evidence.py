"""Run evidence: manifest.json, metrics.jsonl and eval.jsonl, loss.png and comparison.png.

write manifest:  atomic_write_json(run_dir / "manifest.json", make_manifest(cfg.to_dict(), ...))
metrics = MetricsWriter(run_dir / "metrics.jsonl", keep_until_step=resumed_step)
initial, final, passed = smoke_contract(read_metrics(run_dir / "metrics.jsonl"))
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import logging
import os
import platform
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import torch

from kdistill import __version__
from kdistill.errors import UserError
from kdistill.fileio import atomic_write_text, fault_point, file_sha256, write_guard
from kdistill.jsonio import check_int, cut, iter_jsonl, parse_json, short_repr, type_name
from kdistill.train.checkpoint import intact_text

log = logging.getLogger(__name__)


def model_hashes(model_dir: str) -> dict[str, str]:
    """sha256 of each weight and tokenizer file of a model directory (empty for presets)."""
    d = Path(model_dir)
    if not d.is_dir():
        return {}
    names = sorted(p for p in d.iterdir() if p.suffix in (".safetensors", ".json") and p.is_file())
    return {p.name: file_sha256(p) for p in names}


def git_commit() -> str | None:
    """The commit of the source tree kdistill runs from, or None outside a git checkout."""
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(
            ["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def make_manifest(cfg_dict: dict[str, Any], device: str, device_name: str) -> dict[str, Any]:
    """Versions, commit, device and the sha256 of the model files: what a run's numbers came from."""
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
        **run_identity(cfg_dict),
    }


def data_identity(paths: list[str]) -> dict[str, str]:
    """Each data file given (a directory: each file below it; a glob pattern: each match), by path:
    its size and a sha256 of its first and last MiB. Cheap for any size, and it changes when a file
    grows or shrinks or its content changes within a MiB of either end (all of a file under 2 MiB)."""
    out: dict[str, str] = {}
    for text in paths:
        matches = sorted(glob.glob(text, recursive=True)) if any(c in text for c in "*?[") else [text]
        for p in map(Path, matches):
            files = sorted(q for q in p.rglob("*") if q.is_file()) if p.is_dir() else [p]
            for q in files:
                with contextlib.suppress(OSError):
                    out[str(q)] = _ends_digest(q)
    return out


def _ends_digest(path: Path, span: int = 1 << 20) -> str:
    """'<size>:<sha256 of the first and last `span` bytes, 16 hex>'."""
    size = path.stat().st_size
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read(span))
        if size > span:
            f.seek(max(span, size - span))
            h.update(f.read(span))
    return f"{size}:{h.hexdigest()[:16]}"


def run_identity(cfg_dict: dict[str, Any]) -> dict[str, Any]:
    """What a checkpoint was trained from: the teacher's and student's files (sha256, the tokenizer
    included) and the data files (size and the sha256 of their ends). --resume compares it with the
    current config."""
    data = cfg_dict["data"]
    return {
        "teacher_files": model_hashes(cfg_dict["teacher"]["path"]),
        "student_files": model_hashes(cfg_dict["student"]["path"]),
        "data_files": data_identity([*data["train"], *data["heldout"]]),
    }


class MetricsWriter:
    """Appends one JSON line per step to metrics.jsonl (flushed each line). A disk-full, read-only or
    permission fault is one line naming the file and the last good checkpoint."""

    def __init__(self, path: Path, keep_until_step: int | None = None) -> None:
        self.path = path
        with self._guard():
            if keep_until_step is not None and path.exists():
                # On resume, drop lines written after the checkpoint we continue from; damaged lines
                # are moved aside (they would block every later read of the file).
                kept = [ln for ln in salvage_metrics(path) if ln.get("step", 0) <= keep_until_step]
                atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in kept))
            fault_point(path)
            self._f = open(path, "a", encoding="utf-8")

    def _guard(self) -> Any:
        return write_guard(self.path, what="write metrics", intact=intact_text(self.path.parent))

    def write(self, row: dict[str, Any]) -> None:
        try:
            fault_point(self.path)
            self._f.write(json.dumps(row) + "\n")
            self._f.flush()
        except OSError:
            with self._guard():
                raise

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._f.close()


_NUMBER_FIELDS = ("loss", "ce", "kd", "student_loss", "teacher_loss", "kl_to_teacher")


def _check_row(row: Any, where: str) -> dict[str, Any]:
    """A metrics row: a JSON object whose step is an int and whose losses are numbers or null."""
    if not isinstance(row, dict):
        raise UserError(f"{where}: {short_repr(row)} ({type_name(row)}), expected a JSON object")
    if "step" in row:
        check_int("'step'", row["step"], min=0, prefix=f"{where}: ")
    for k in _NUMBER_FIELDS:
        v = row.get(k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int | float)):
            raise UserError(f"{where}: '{k}' is {short_repr(v)} ({type_name(v)}), expected a number or null")
    return row


def salvage_metrics(path: Path) -> list[dict[str, Any]]:
    """The good rows of a .jsonl file, for a resumed run: each damaged line (not JSON, not a row, a line
    cut by a kill) is appended to `<file>.damaged` with a warning naming it, instead of stopping the
    resume."""
    rows: list[dict[str, Any]] = []
    bad: list[bytes] = []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            where = f"{path} line {lineno}"
            try:
                rows.append(_check_row(parse_json(raw, where=str(path), line=lineno), where))
            except (UserError, ValueError, RecursionError) as e:
                bad.append(raw if raw.endswith(b"\n") else raw + b"\n")
                why = cut(str(e).removeprefix(f"{where}: "), 120)
                log.warning("%s: damaged (%s); moved to %s", where, why, path.name + ".damaged")
    if bad:
        fault_point(path.with_name(path.name + ".damaged"))
        with open(path.with_name(path.name + ".damaged"), "ab") as f:
            f.write(b"".join(bad))
    return rows


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The rows of a .jsonl file (none if it is missing); a last line cut by a kill is skipped; a row that
    is not an object, or whose step or losses are not numbers, is a one-line error naming the line."""
    rows: list[dict[str, Any]] = []
    if not path.exists():
        return rows
    for lineno, row in iter_jsonl(path, skip_torn_tail=True):
        where = f"{path} line {lineno}"
        if not isinstance(row, dict):
            raise UserError(f"{where}: {short_repr(row)} ({type_name(row)}), expected a JSON object")
        if "step" in row:
            check_int("'step'", row["step"], min=0, prefix=f"{where}: ")
        for k in _NUMBER_FIELDS:
            v = row.get(k)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int | float)):
                raise UserError(
                    f"{where}: '{k}' is {short_repr(v)} ({type_name(v)}), expected a number or null"
                )
        rows.append(row)
    return rows


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend; imported, the first time, in a thread of its own. While
    matplotlib imports, pyparsing raises exceptions and keeps them (with their tracebacks, hence every
    frame above the import and those frames' locals); imported from a run's `finish`, they kept the
    finished run (its models, optimizer and CUDA graphs) alive after `train` returned, until Python's
    next full garbage collection. A thread's frames hold nothing of its caller's."""

    def load() -> Any:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        return plt

    if "matplotlib.pyplot" not in sys.modules:
        failed: list[BaseException] = []

        def first() -> None:
            try:
                load()
            except BaseException as e:
                failed.append(e)

        loader = threading.Thread(target=first, name="kdistill-pyplot")
        loader.start()
        loader.join()
        if failed:
            raise failed[0]
    return load()  # imported by now: the backend set again, as every call does


def plot_losses(run_dir: Path, title: str = "kdistill") -> Path | None:
    """loss.png: training loss (and its CE/KD parts) and held-out curves against the step."""
    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r and r.get("loss") is not None]
    if not rows:
        return None
    plt = pyplot()

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
    try:
        fault_point(tmp)
        fig.savefig(tmp)
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    finally:
        plt.close(fig)
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


def plot_comparison(runs: dict[str, Path], out: Path, title: str) -> Path | None:
    """One figure of held-out student loss against the step for several runs, with the teacher's."""
    curves = {name: read_metrics(d / "eval.jsonl") for name, d in runs.items()}
    if not any(curves.values()):
        return None
    plt = pyplot()

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


class NullWriter:
    """The metrics/eval writer of processes other than rank 0 under torchrun: writes nothing."""

    def write(self, row: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass
