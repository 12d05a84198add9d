"""Shared helpers for the training-loop tests (no tests here): tiny models, a corpus, run configs, runners.

    from tests.test_train_kit import assets, write_config, run_cli, run_proc
    a = assets()                                   # teacher/student dirs and text files, built once
    cfg = write_config(tmp_path, steps=6)          # a run YAML for the tiny pair (dotted overrides)
    rc, out, err = run_cli(capsys, "run", str(cfg), "--quiet")      # in-process, kdistill.cli.main
    proc = run_proc(["run", str(cfg), "--quiet"], env_extra={...})  # `python -m kdistill` subprocess

Every model is saved by transformers itself (tests/tiny.py) and shares one BPE tokenizer (same corpus and
seed); the models are built once per test process in a temporary folder.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

from tests.tiny import corpus_text, make_tiny_model

REPO = Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class Assets:
    root: Path
    teacher: Path  # qwen2, hidden 64, 2 layers, weights + tokenizer
    student: Path  # qwen2, hidden 32, 2 layers, weights + tokenizer (an HF dir with initial weights)
    student_config: Path  # a config.json only (random init), hidden 32, 2 layers
    train: Path  # text files
    heldout: Path
    cache: Path  # tokenized-data cache shared by every run of this process


@functools.cache
def assets() -> Assets:
    root = Path(tempfile.mkdtemp(prefix="kdistill-train-"))
    atexit.register(shutil.rmtree, root, True)
    teacher = make_tiny_model(
        root, "qwen2", tied=False, seed=3, name="teacher", hidden_size=64, intermediate_size=128
    )
    student = make_tiny_model(root, "qwen2", tied=True, seed=1, name="student")
    cfg_dir = root / "student-config"
    cfg_dir.mkdir()
    shutil.copy(student / "config.json", cfg_dir / "config.json")
    train = root / "data" / "train"
    train.mkdir(parents=True)
    for i in range(4):
        (train / f"doc{i}.txt").write_text(corpus_text(700, seed=10 + i), encoding="utf-8")
    heldout = root / "data" / "heldout.txt"
    heldout.write_text(corpus_text(500, seed=99), encoding="utf-8")
    cache = root / "cache"
    cache.mkdir()
    return Assets(root, teacher, student, cfg_dir / "config.json", train, heldout, cache)


def base_config(run_dir: Path, **schedule: Any) -> dict[str, Any]:
    """A small, fast run of the tiny pair: 8 steps of 4 x 32 tokens on the CPU."""
    a = assets()
    sched = dict(
        steps=8, batch_size=4, grad_accum=1, eval_every=0, eval_batches=2, checkpoint_every=0, seed=0
    )
    sched.update(schedule)
    return {
        "teacher": {"path": str(a.teacher)},
        "student": {"path": str(a.student_config), "init": "random"},
        "data": {
            "train": [str(a.train)],
            "heldout": [str(a.heldout)],
            "seq_len": 32,
            "cache_dir": str(a.cache),
        },
        "kd": {"alpha": 0.5, "temperature": 2.0, "divergence": "forward_kl", "chunk_size": 64},
        "optim": {"lr": 3e-3, "warmup_steps": 2},
        "schedule": sched,
        "output": {"dir": str(run_dir), "keep_checkpoints": 2},
        "runtime": {"device": "cpu"},
    }


def write_config(folder: Path, name: str = "run.yaml", run_dir: Path | None = None, **schedule: Any) -> Path:
    """Write base_config (run dir folder/run unless given) as YAML and return its path."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    cfg = base_config(run_dir or folder / "run", **schedule)
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    """kdistill.cli.main(argv) in this process: (exit code, stdout, stderr)."""
    from kdistill.cli import main

    capsys.readouterr()
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def child_env(**extra: str) -> dict[str, str]:
    """Environment of a `python -m kdistill` child: one thread (so every child computes the same bits).
    A batch started in the background (tests/background.py) starts from the suite's first environment."""
    from tests import background

    env = {k: v for k, v in background.environ().items() if not k.startswith("KDISTILL_TEST_")}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONPATH=str(REPO / "src"))
    env.update(extra)
    return env


def start_proc(argv: list[str], **env_extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "kdistill", *argv],
        cwd=REPO,
        env=child_env(**env_extra),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def run_proc(argv: list[str], timeout: float = 120, **env_extra: str) -> subprocess.CompletedProcess:
    p = start_proc(argv, **env_extra)
    out, err = p.communicate(timeout=timeout)
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def student_weights(path: Path) -> dict[str, Any]:
    """Tensors of a safetensors file (a checkpoint's student.safetensors or student/model.safetensors)."""
    from safetensors.torch import load_file

    return load_file(str(path))


def final_weights(run_dir: Path) -> dict[str, Any]:
    """The newest checkpoint's student tensors (the final one holds every parameter, lm_head included)."""
    from kdistill.train.checkpoint import list_checkpoints

    ckpts = list_checkpoints(run_dir)
    assert ckpts, f"no checkpoint in {run_dir}"
    return student_weights(ckpts[-1] / "student.safetensors")


def assert_same_weights(a: dict[str, Any], b: dict[str, Any]) -> None:
    import torch

    assert a.keys() == b.keys()
    diff = [k for k in a if not torch.equal(a[k], b[k])]
    assert not diff, f"tensors differ: {diff[:5]}"


def interrupted_copy(run_dir: Path, dst: Path, step: int) -> Path:
    """A copy of a completed run cut back to what the run leaves when it stops after its checkpoint of
    `step` and before the next one: that checkpoint and the earlier ones, no later checkpoint, no export
    (student/ or adapter/), no summary or loss plot. Its metrics and eval lines after `step` stay, as a
    killed run's lines after its last checkpoint do: the resume drops them. One run is then both the
    uninterrupted reference and, resumed from the copy, the interrupted one (no second run to start)."""
    shutil.copytree(run_dir, dst)
    from kdistill.train.checkpoint import list_checkpoints

    later = [c for c in list_checkpoints(dst) if int(c.name.removeprefix("step-")) > step]
    assert len(later) < len(list_checkpoints(dst)), f"no checkpoint at or before step {step} in {run_dir}"
    for path in [*later, dst / "student", dst / "adapter", dst / "summary.json", dst / "loss.png"]:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    return dst


def read_summary(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "summary.json").read_text())


def one_error_line(err: str) -> str:
    """The single `kdistill: error:` line of stderr (asserts there is exactly one line and no traceback)."""
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, f"expected one line on stderr, got {lines!r}"
    assert lines[0].startswith("kdistill: error: "), lines[0]
    assert "Traceback" not in err
    return lines[0].removeprefix("kdistill: error: ")
