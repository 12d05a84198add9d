"""Non-finite losses and gradients, in process via kdistill.cli.main.

The loop's test hook KDISTILL_TEST_NAN_STEPS makes the loss of chosen steps NaN (exactly where we want
it); KDISTILL_TEST_POISON_STEP puts a real +inf into a weight, which the forward and backward carry (a
mechanism, not a float overflow: the same on every CPU). `runtime.on_nonfinite=skip` skips and counts such steps and
stops after runtime.max_nonfinite in a row; `stop` exits 2 at once naming the step and the cause, and the
last good checkpoint stays loadable and resumable.
"""

from __future__ import annotations

import json
import math

import torch

from tests.test_train_kit import one_error_line, read_summary, run_cli, write_config


def _rows(run):
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def test_skip_counts_and_continues(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("KDISTILL_TEST_NAN_STEPS", "3,4")
    cfg = write_config(tmp_path, steps=6)
    rc, _, err = run_cli(capsys, "run", str(cfg), "runtime.on_nonfinite=skip", "--quiet")
    assert rc == 0, err
    run = tmp_path / "run"
    summary = read_summary(run)
    assert summary["status"] == "completed" and summary["nonfinite_skipped"] == 2
    rows = _rows(run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [r.get("skipped") for r in rows] == [None, None, "loss is nan", "loss is nan", None, None]
    assert rows[2]["loss"] is None and math.isfinite(rows[4]["loss"])
    from safetensors.torch import load_file

    w = load_file(str(run / "student" / "model.safetensors"))
    assert all(torch.isfinite(t).all() for t in w.values())


def test_skip_stops_after_max_nonfinite_in_a_row(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("KDISTILL_TEST_NAN_STEPS", "2,4,5,6,7")
    cfg = write_config(tmp_path, steps=8, checkpoint_every=1)
    rc, _, err = run_cli(capsys, "run", str(cfg), "runtime.max_nonfinite=3", "--quiet")
    assert rc == 2
    assert one_error_line(err) == (
        "step 6: 3 non-finite steps in a row (loss is nan); stopped (runtime.max_nonfinite=3)"
    )
    run = tmp_path / "run"
    # Steps 1-5 logged (the stopping step raises before its line).
    assert [r.get("skipped") is not None for r in _rows(run)] == [False, True, False, True, True]
    assert not (run / "summary.json").exists()  # not a finished run: it can be resumed


def test_stop_names_step_and_cause_and_keeps_the_last_good_checkpoint(tmp_path, capsys, monkeypatch):
    from kdistill.train.checkpoint import latest_loadable

    monkeypatch.setenv("KDISTILL_TEST_NAN_STEPS", "5")
    cfg = write_config(tmp_path, steps=8, checkpoint_every=2)
    rc, _, err = run_cli(capsys, "run", str(cfg), "runtime.on_nonfinite=stop", "--quiet")
    assert rc == 2
    assert one_error_line(err) == (
        "step 5: non-finite value (loss is nan); stopped (runtime.on_nonfinite=stop); "
        "the last good checkpoint is kept"
    )
    run = tmp_path / "run"
    path, (weights, _, state) = latest_loadable(run)
    assert path.name == "step-0000004" and state["step"] == 4
    assert all(torch.isfinite(t).all() for t in weights.values())
    assert not list((run / "checkpoints").glob(".tmp-*"))
    # The cause gone, the run resumes from that checkpoint and finishes.
    monkeypatch.delenv("KDISTILL_TEST_NAN_STEPS")
    rc, _, err = run_cli(capsys, "run", "--resume", str(run), "--quiet")
    assert rc == 0 and "(step 4)" in err
    assert read_summary(run)["steps"] == 8 and read_summary(run)["nonfinite_skipped"] == 0


def test_a_real_non_finite_value_in_the_weights_stops_the_run(tmp_path, capsys, monkeypatch):
    """A weight set to +inf before step 3 (KDISTILL_TEST_POISON_STEP): the real forward, KD loss and
    backward carry it, and the loop stops at that step. Deterministic on any CPU, unlike an overflow from
    a huge learning rate, whose float path decides whether and when anything turns non-finite."""
    monkeypatch.setenv("KDISTILL_TEST_POISON_STEP", "3")
    cfg = write_config(tmp_path, steps=6, checkpoint_every=1)
    rc, _, err = run_cli(capsys, "run", str(cfg), "runtime.on_nonfinite=stop", "--quiet")
    assert rc == 2
    msg = one_error_line(err)
    assert msg.startswith("step 3: non-finite value (") and "stopped (runtime.on_nonfinite=stop)" in msg
    assert ("loss is nan" in msg) or ("loss is inf" in msg) or ("gradient norm is" in msg)
    from kdistill.train.checkpoint import latest_loadable

    step = 3
    path, _ = latest_loadable(tmp_path / "run")
    assert path.name == f"step-{step - 1:07d}"  # every good step before it was saved and is readable
    _, (weights, _, _) = latest_loadable(tmp_path / "run")
    assert all(torch.isfinite(t).all() for t in weights.values())
