"""Data-parallel runs under torchrun (2 processes, gloo on the CPU, FSDP2 student and teacher).

One uninterrupted 2-process run and one 1-process run of the same config (same global batch of 4
sequences) go in parallel; then a 2-process run killed after step 4 (checkpoint at step 3) is resumed
under torchrun and must end with the uninterrupted 2-process run's weights, bit for bit.

Why 2 processes match 1 process only closely, not exactly: the batch, the initial weights and every
per-token loss are the same, but the gradient of the 4-row batch is the average of two 2-row gradients
(FSDP's reduce-scatter) instead of one 4-row reduction, and the logged loss is a token-weighted sum of
two means. Float32 summation order differs, so each step differs by ~1e-7 relative; AdamW over 6 steps
keeps that well under 1e-5 (measured: losses equal to ~1e-7, weights to ~5e-6 absolute). The tolerances
below (1e-5 relative on losses, 1e-4 absolute on weights) leave room for other BLAS builds while
still catching a wrong loss scaling (a factor of 2 on the gradient moves the final loss by ~1e-2).
"""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from tests.test_train_kit import (
    REPO,
    assert_same_weights,
    child_env,
    read_summary,
    run_proc,
    student_weights,
    write_config,
)

pytestmark = pytest.mark.slow

SCHED = dict(steps=6, batch_size=4, checkpoint_every=3, eval_every=3)


def torchrun(
    argv: list[str], nproc: int = 2, timeout: float = 120, **env: str
) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--standalone"]
    p = subprocess.run(
        [*cmd, "-m", "kdistill", *argv],
        cwd=REPO,
        env=child_env(**env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return p


def _losses(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dist")
    cfg = write_config(tmp, **SCHED)
    dirs = {k: tmp / k for k in ("two", "one", "killed")}
    with ThreadPoolExecutor(3) as pool:
        two = pool.submit(torchrun, ["run", str(cfg), f"output.dir={dirs['two']}", "--quiet"])
        one = pool.submit(run_proc, ["run", str(cfg), f"output.dir={dirs['one']}", "--quiet"], 120)
        killed = pool.submit(
            torchrun, ["run", str(cfg), f"output.dir={dirs['killed']}", "--quiet"], KDISTILL_TEST_KILL_AT="4"
        )
        out = {"two": two.result(), "one": one.result(), "killed": killed.result()}
    return tmp, cfg, dirs, out


def test_two_processes_complete_and_write_once(runs):
    _, _, dirs, out = runs
    r = out["two"]
    assert r.returncode == 0, r.stderr[-3000:]
    run = dirs["two"]
    summary = read_summary(run)
    assert summary["status"] == "completed" and summary["steps"] == 6
    assert summary["world_size"] == 2
    rows = _losses(run)
    assert [row["step"] for row in rows] == [1, 2, 3, 4, 5, 6]  # rank 1 wrote nothing
    assert [json.loads(x)["step"] for x in (run / "eval.jsonl").read_text().splitlines()] == [3, 6]
    assert r.stdout.count("status completed") == 1  # the summary line comes from rank 0 only
    ckpts = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert ckpts == ["step-0000003", "step-0000006"]
    # The exported student is a whole (unsharded) Hugging Face model.
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(run / "student", dtype=torch.float32).eval()
    assert sum(p.numel() for p in model.parameters()) > 0
    exported = student_weights(run / "student" / "model.safetensors")
    final = student_weights(run / "checkpoints" / "step-0000006" / "student.safetensors")
    for k, v in exported.items():
        assert torch.equal(v, final[k]), k


def test_two_processes_match_one_process(runs):
    _, _, dirs, out = runs
    assert out["one"].returncode == 0, out["one"].stderr[-3000:]
    assert out["two"].returncode == 0, out["two"].stderr[-3000:]
    a, b = _losses(dirs["one"]), _losses(dirs["two"])
    for x, y in zip(a, b, strict=True):
        for key in ("loss", "ce", "kd", "grad_norm"):  # grad_norm: the global norm over every shard
            assert y[key] == pytest.approx(x[key], rel=1e-5), (x["step"], key)
    s1, s2 = read_summary(dirs["one"]), read_summary(dirs["two"])
    assert s2["final_loss"] == pytest.approx(s1["final_loss"], rel=1e-5)
    assert s2["tokens_seen"] == s1["tokens_seen"]
    w1 = student_weights(dirs["one"] / "student" / "model.safetensors")
    w2 = student_weights(dirs["two"] / "student" / "model.safetensors")
    assert w1.keys() == w2.keys()
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], rtol=0, atol=1e-4)


def test_resume_under_torchrun_is_exact(runs):
    _, _, dirs, out = runs
    assert out["killed"].returncode != 0
    run = dirs["killed"]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-0000003"]
    r = torchrun(["run", "--resume", str(run), "--quiet"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert read_summary(run)["status"] == "completed"
    assert [row["step"] for row in _losses(run)] == [1, 2, 3, 4, 5, 6]
    assert_same_weights(
        student_weights(run / "student" / "model.safetensors"),
        student_weights(dirs["two"] / "student" / "model.safetensors"),
    )


def test_batch_not_divisible_is_one_line_error(runs):
    tmp, cfg, _, _ = runs
    r = torchrun(["run", str(cfg), f"output.dir={tmp / 'odd'}", "schedule.batch_size=3", "--quiet"])
    assert r.returncode != 0
    errors = {ln for ln in r.stderr.splitlines() if ln.startswith("kdistill: error:")}
    assert len(errors) == 1, r.stderr[-3000:]
    assert "schedule.batch_size 3" in errors.pop()
    assert "src/kdistill" not in r.stderr  # no traceback from kdistill (torchrun reports the exit code)
    assert not (tmp / "odd").exists()  # refused before the output folder was made
