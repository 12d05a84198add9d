"""Exact resume: a `python -m kdistill run` killed with SIGKILL at a chosen point and
resumed with `--resume` ends with the same student weights, bit for bit, as the run that was not killed.

The children kill themselves at a named point through the loop's test hook (KDISTILL_TEST_KILL_AT), so the
kill points are exact, not timing races: right after a checkpoint, mid-accumulation (grad_accum=2), after
the last micro-batch's backward but before the optimizer step, between checkpoints, after the last step
but before the final save, and a SIGTERM mid-step (graceful stop). Each chain kills a run, resumes it and
kills the resumed run again, so later kills also exercise a resumed process. The chains and the
uninterrupted run go in parallel (one thread per child).
"""

from __future__ import annotations

import json
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from tests.test_train_kit import (
    assert_same_weights,
    final_weights,
    read_summary,
    run_proc,
    start_proc,
    student_weights,
    write_config,
)

SCHED = dict(steps=8, grad_accum=2, checkpoint_every=2, eval_every=4)

# Two chains of kills; each stage is one process (the first a fresh run, then `--resume`) that stops at
# its point; a last `--resume` finishes. Points: "S.M" after micro-batch M's backward of step S, "S" after
# step S's metrics line, "S.saved" right after the checkpoint of step S; "SIGTERM@S.M" a graceful stop.
CHAINS = {
    "a": ["2.saved", "4.2", "6.saved", "8"],  # after a checkpoint; before the optimizer step; last step
    "b": ["3.1", "5", "SIGTERM@7.1"],  # mid-accumulation; between checkpoints; a signal mid-step
}


def _metrics(run_dir: Path) -> list[dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        r.pop("tokens_per_s")
    return rows


def _chain(cfg: Path, run_dir: Path, points: list[str]) -> list[dict]:
    stages = []
    for i, point in enumerate([*points, None]):
        argv = ["run", str(cfg), f"output.dir={run_dir}"] if i == 0 else ["run", "--resume", str(run_dir)]
        env = {"KDISTILL_TEST_KILL_AT": point} if point else {}
        r = run_proc([*argv, "--quiet"], timeout=180, **env)
        summary = read_summary(run_dir) if (run_dir / "summary.json").exists() else None
        ckpts = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
        stages.append(dict(point=point, rc=r.returncode, err=r.stderr, summary=summary, ckpts=ckpts))
    return stages


def _pause_chain(cfg: Path, run_dir: Path) -> dict:
    """Kill after step 3 (step 2 saved), resume and SIGKILL it inside the step-4 checkpoint write, resume."""
    out: dict = {}
    r = run_proc(["run", str(cfg), f"output.dir={run_dir}", "--quiet"], 180, KDISTILL_TEST_KILL_AT="3")
    out["first"] = (r.returncode, r.stderr)
    flag = run_dir.parent / f"{run_dir.name}.pause"
    p = start_proc(["run", "--resume", str(run_dir), "--quiet"], KDISTILL_TEST_CKPT_PAUSE=str(flag))
    deadline = time.time() + 120
    while not flag.exists() and time.time() < deadline and p.poll() is None:
        time.sleep(0.05)
    out["stage"] = flag.read_text() if flag.exists() else None
    out["during"] = {d.name: sorted(f.name for f in d.iterdir()) for d in (run_dir / "checkpoints").iterdir()}
    p.kill()
    out["killed"] = p.wait(timeout=30)
    p.communicate()
    r = run_proc(["run", "--resume", str(run_dir), "--quiet"], 180)
    out["last"] = (r.returncode, r.stderr)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The uninterrupted run and the two kill chains, in parallel (one thread per child)."""
    root = tmp_path_factory.mktemp("resume")
    cfg = write_config(root, **SCHED)
    with ThreadPoolExecutor(4) as pool:
        base = pool.submit(run_proc, ["run", str(cfg), f"output.dir={root / 'baseline'}", "--quiet"], 180)
        chains = {k: pool.submit(_chain, cfg, root / k, pts) for k, pts in CHAINS.items()}
        paused = pool.submit(_pause_chain, cfg, root / "paused")
        r = base.result()
        assert r.returncode == 0, r.stderr
        return root, {k: f.result() for k, f in chains.items()}, paused.result()


@pytest.mark.parametrize("chain", list(CHAINS))
def test_killed_and_resumed_run_matches_uninterrupted(runs, chain):
    root, chains, _ = runs
    stages = chains[chain]
    for st in stages[:-1]:
        if st["point"].startswith("SIGTERM@"):
            step = int(st["point"].split("@")[1].split(".")[0])
            assert st["rc"] == 0, st["err"]
            # The signalled step was finished, then saved; the summary says interrupted.
            assert st["summary"]["status"] == "interrupted" and st["summary"]["steps"] == step
            assert f"step-{step:07d}" in st["ckpts"]
        else:
            assert st["rc"] == -signal.SIGKILL, st["err"]
    for st in stages[1:]:
        assert "resuming from" in st["err"]
    assert stages[-1]["rc"] == 0, stages[-1]["err"]

    base, run = root / "baseline", root / chain
    assert_same_weights(final_weights(base), final_weights(run))
    # The exported Hugging Face student, too.
    assert_same_weights(
        student_weights(base / "student" / "model.safetensors"),
        student_weights(run / "student" / "model.safetensors"),
    )
    # Same losses, learning rates and gradient norms at every step; each step logged once.
    assert _metrics(base) == _metrics(run)
    s_base, s_run = read_summary(base), read_summary(run)
    assert s_run["status"] == "completed" and s_run["steps"] == 8
    for k in ("initial_loss", "final_loss", "tokens_seen", "heldout"):
        assert s_run[k] == s_base[k], k
    # keep_checkpoints=2 and no temp folders left.
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert len(names) == 2 and names[-1] == "step-0000008" and all(n.startswith("step-") for n in names)


def test_checkpoint_holds_everything_resume_needs(runs):
    root, _, _ = runs
    from kdistill.train.checkpoint import list_checkpoints, load_checkpoint

    path = list_checkpoints(root / "baseline")[0]
    weights, opt, state = load_checkpoint(path)
    assert state["step"] == 6 and path.name == "step-0000006"
    assert {"batcher", "rng_cpu", "counters", "optimizer", "config"} <= state.keys()
    assert state["batcher"]["position"] >= 0 and state["counters"]["tokens_seen"] == 6 * 2 * 4 * 32
    assert any(k.endswith(".exp_avg_sq") for k in opt) and all(
        torch.isfinite(v).all() for v in weights.values()
    )


def test_kill_inside_a_checkpoint_write_resumes_from_the_newest_complete_one(runs):
    """Atomic checkpoints: SIGKILL between the weight and optimizer files of step 4."""
    root, _, paused = runs
    assert paused["first"][0] == -signal.SIGKILL, paused["first"][1]
    assert paused["stage"] == "between-files"
    during = paused["during"]
    tmp = [name for name in during if name.startswith(".tmp-step-0000004-")]
    assert len(tmp) == 1 and during[tmp[0]] == ["student.safetensors"]  # half-written, under a temp name
    assert "step-0000004" not in during and during["step-0000002"] == [
        "optimizer.safetensors",
        "state.json",
        "student.safetensors",
    ]
    assert paused["killed"] == -signal.SIGKILL
    rc, err = paused["last"]
    assert rc == 0, err
    assert f"resuming from {root / 'paused' / 'checkpoints' / 'step-0000002'} (step 2)" in err
    assert_same_weights(final_weights(root / "baseline"), final_weights(root / "paused"))
    assert _metrics(root / "baseline") == _metrics(root / "paused")
    names = sorted(p.name for p in (root / "paused" / "checkpoints").iterdir())
    assert names == ["step-0000006", "step-0000008"]  # the temp folder is gone; rotation kept 2


def test_damaged_newest_checkpoint_is_skipped(tmp_path, capsys):
    """A newest checkpoint whose weights file is cut short: resume falls back to the one before."""
    from tests.test_train_kit import run_cli

    cfg = write_config(tmp_path, steps=4, checkpoint_every=1, eval_every=0)
    rc, _, err = run_cli(capsys, "run", str(cfg), "output.keep_checkpoints=3", "--quiet")
    assert rc == 0, err
    run = tmp_path / "run"
    assert len(list((run / "checkpoints").iterdir())) == 3
    w = run / "checkpoints" / "step-0000004" / "student.safetensors"
    w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])
    rc, _, err = run_cli(capsys, "run", "--resume", str(run), "schedule.steps=5", "--quiet")
    assert rc == 0, err
    assert f"resuming from {run / 'checkpoints' / 'step-0000003'} (step 3)" in err
    assert read_summary(run)["steps"] == 5
