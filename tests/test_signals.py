"""Signals: SIGTERM or SIGINT from outside finishes the current step, saves a checkpoint,
writes summary.json with status "interrupted" and exits 0 within a bounded time; a second signal exits at
once with a non-zero code (here: while the first signal's checkpoint write is paused by the test hook).

The children are long runs (`python -m kdistill run`, 100,000 steps) signalled once they have logged a
few steps; all three run in parallel. The exact point of a graceful stop and the resume after it are
tested bit for bit in tests/test_resume.py (chain "b").
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.test_train_kit import read_summary, start_proc, write_config

BOUND_S = 20.0  # a signalled tiny run must be gone within this many seconds


def _steps_logged(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def _wait_for(cond, p: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while not cond():
        if p.poll() is not None or time.time() > deadline:
            raise AssertionError(
                f"child ended or timed out early: rc={p.poll()} {p.communicate()[1][-2000:]}"
            )
        time.sleep(0.05)


def _signalled(cfg: Path, run_dir: Path, sig: signal.Signals, second: signal.Signals | None) -> dict:
    flag = run_dir.parent / f"{run_dir.name}.pause"
    env = {"KDISTILL_TEST_CKPT_PAUSE": str(flag)} if second else {}
    p = start_proc(["run", str(cfg), f"output.dir={run_dir}", "--quiet"], **env)
    _wait_for(lambda: _steps_logged(run_dir) >= 3, p)
    t0 = time.time()
    p.send_signal(sig)
    if second:
        _wait_for(flag.exists, p, timeout=BOUND_S)  # the first signal's checkpoint write is under way
        t0 = time.time()
        p.send_signal(second)
    try:
        _, err = p.communicate(timeout=BOUND_S)
    except subprocess.TimeoutExpired:
        p.kill()
        raise
    return {"rc": p.returncode, "err": err, "seconds": time.time() - t0, "run": run_dir}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("signals")
    cfg = write_config(root, steps=100_000, eval_every=0, checkpoint_every=0)
    cases = {
        "term": (signal.SIGTERM, None),
        "int": (signal.SIGINT, None),
        "twice": (signal.SIGTERM, signal.SIGINT),
    }
    with ThreadPoolExecutor(len(cases)) as pool:
        futs = {k: pool.submit(_signalled, cfg, root / k, *v) for k, v in cases.items()}
        return {k: f.result() for k, f in futs.items()}


@pytest.mark.parametrize("case,name", [("term", "SIGTERM"), ("int", "SIGINT")])
def test_signal_finishes_the_step_saves_and_exits_zero(results, case, name, capsys):
    from kdistill.train.checkpoint import latest_loadable

    r = results[case]
    assert r["rc"] == 0, r["err"]
    assert r["seconds"] < BOUND_S
    assert f"kdistill: {name} received: finishing this step and saving a checkpoint" in r["err"]
    summary = read_summary(r["run"])
    assert summary["status"] == "interrupted"
    rows = [json.loads(x) for x in (r["run"] / "metrics.jsonl").read_text().splitlines()]
    # The step in progress was finished (logged) and is the one saved; nothing after it ran.
    assert summary["steps"] == rows[-1]["step"] >= 3
    assert [row["step"] for row in rows] == list(range(1, summary["steps"] + 1))
    path, (weights, _, state) = latest_loadable(r["run"])
    assert path.name == f"step-{summary['steps']:07d}" and state["step"] == summary["steps"]
    assert not (r["run"] / "student").exists()  # only a completed run exports the student
    # `kdistill report` reads the interrupted run.
    from kdistill.cli import main

    assert main(["report", str(r["run"]), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["status"] == "interrupted" and report["steps_done"] == summary["steps"]
    assert report["checkpoints"] == [path.name]


def test_second_signal_exits_at_once(results):
    from kdistill.train.checkpoint import list_checkpoints

    r = results["twice"]
    assert r["rc"] == 130, r["err"]
    assert r["seconds"] < 5
    assert "kdistill: second signal, exiting now" in r["err"]
    # It left the checkpoint it was writing under its temp name: no complete checkpoint claims that step.
    assert list_checkpoints(r["run"]) == []
    assert [p.name.startswith(".tmp-step-") for p in (r["run"] / "checkpoints").iterdir()] == [True]
