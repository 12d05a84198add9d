"""`output.report_to` through a real run: a tiny `kdistill run` with report_to=[tensorboard] writes the
metrics.jsonl scalars, the held-out losses and the resolved config (as HParams) into TensorBoard event
files, read back with tensorboard's own reader; a bad tracker name is a one-line config error."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from tests.test_train_kit import base_config, one_error_line, run_cli


def _write(tmp_path: Path, report_to) -> Path:
    cfg = base_config(tmp_path / "run", steps=4, eval_every=2, eval_batches=1)
    cfg["output"]["report_to"] = report_to
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def test_run_reports_to_tensorboard(tmp_path: Path, capsys) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    rc, _, err = run_cli(capsys, "run", str(_write(tmp_path, ["tensorboard"])), "--quiet")
    assert rc == 0, err
    run = tmp_path / "run"
    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    scalars = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    for name, tag in [("loss", "train/loss"), ("ce", "train/ce"), ("kd", "train/kd"), ("lr", "train/lr")]:
        assert [s for s, _ in scalars[tag]] == [1, 2, 3, 4]
        assert all(math.isclose(v, r[name], rel_tol=1e-5) for (_, v), r in zip(scalars[tag], rows))
    for tag in ("train/grad_norm", "perf/tokens_per_s", "kernels/jit_after_prewarm"):
        assert [s for s, _ in scalars[tag]] == [1, 2, 3, 4], tag
    evals = [json.loads(x) for x in (run / "eval.jsonl").read_text().splitlines()]
    assert [s for s, _ in scalars["heldout/student_loss"]] == [e["step"] for e in evals] == [2, 4]
    assert math.isclose(scalars["heldout/student_loss"][-1][1], evals[-1]["student_loss"], rel_tol=1e-5)
    assert "heldout/teacher_loss" in scalars and "heldout/kl_to_teacher" in scalars
    content = acc.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    hp = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info.hparams
    assert hp["schedule.steps"].number_value == 4 and hp["kd.divergence"].string_value == "forward_kl"


def test_unknown_tracker_is_one_line(tmp_path: Path, capsys) -> None:
    rc, _, err = run_cli(capsys, "run", str(_write(tmp_path, ["tensorbored"])), "--quiet")
    assert rc == 2
    line = one_error_line(err)
    assert "output.report_to" in line and "tensorbored" in line and "tensorboard" in line
    assert not (tmp_path / "run").exists()
