"""Resuming after what a first resume changed or left: a run extended with `--resume RUN
schedule.steps=N` records the new config (config.yaml and the manifest's resume_overrides), so a plain
`--resume RUN` after a killed export finishes it; a checkpoint past schedule.steps resumes straight into
the export; a damaged metrics.jsonl line is moved aside with a warning; the eval paths check token ids as
the training step does."""

from __future__ import annotations

import contextlib
import json
import shutil

import numpy as np
import pytest
import torch
import yaml

from kdistill.errors import UserError
from kdistill.models.hf_io import load_model
from tests.test_train_kit import assets, read_summary, run_cli, write_config


@pytest.fixture
def done(tmp_path, capsys):
    cfg = write_config(tmp_path, steps=2, checkpoint_every=1)
    rc, _, err = run_cli(capsys, "run", str(cfg), "--quiet")
    assert rc == 0, err
    return tmp_path / "run"


def _kill_export(run):
    """What a kill during the export leaves: training complete, no student/ and no summary.json."""
    shutil.rmtree(run / "student")
    (run / "summary.json").unlink()


def test_a_plain_resume_finishes_an_extended_run_whose_export_was_killed(done, capsys):
    rc, _, err = run_cli(capsys, "run", "--resume", str(done), "schedule.steps=4", "--quiet")
    assert rc == 0, err
    assert yaml.safe_load((done / "config.yaml").read_text())["schedule"]["steps"] == 4
    history = json.loads((done / "manifest.json").read_text())["resume_overrides"]
    assert history[-1]["changed"] == {"schedule.steps": [2, 4]}
    _kill_export(done)
    (done / ".student.tmp-4194311-dead").mkdir()  # what the killed export left beside the run's files
    (done / ".student.tmp-4194311-dead" / "model.safetensors").write_bytes(b"partial")
    (done / ".summary.json.k1ll3d.tmp").write_text("{")
    rc, _, err = run_cli(capsys, "run", "--resume", str(done), "--quiet")
    assert rc == 0, err
    assert read_summary(done)["status"] == "completed" and read_summary(done)["steps"] == 4
    assert not [p.name for p in done.iterdir() if ".tmp" in p.name]
    assert (done / "student" / "model.safetensors").is_file()


def test_a_checkpoint_past_schedule_steps_resumes_into_the_export(done, capsys):
    rc, _, err = run_cli(capsys, "run", "--resume", str(done), "schedule.steps=3", "--quiet")
    assert rc == 0, err
    _kill_export(done)
    cfg = yaml.safe_load((done / "config.yaml").read_text())
    cfg["schedule"]["steps"] = 2  # as config.yaml was before resumes recorded their overrides
    (done / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    rc, _, err = run_cli(capsys, "run", "--resume", str(done), "--quiet")
    assert rc == 0, err
    assert read_summary(done)["steps"] == 3 and (done / "student" / "config.json").is_file()


def test_a_damaged_metrics_line_is_moved_aside(done, capsys, caplog):
    metrics = done / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    metrics.write_text(lines[0] + "\n" + '{"step": 2, "loss": "oops"\n')  # cut and mistyped
    rc, _, err = run_cli(capsys, "run", "--resume", str(done), "schedule.steps=3", "--quiet")
    assert rc == 0, err
    warned = caplog.text  # the CLI's log handler prints it as one "kdistill: ..." line on stderr
    assert (
        f"{metrics} line 2: damaged (not valid JSON" in warned and "moved to metrics.jsonl.damaged" in warned
    )
    assert (done / "metrics.jsonl.damaged").read_text() == '{"step": 2, "loss": "oops"\n'
    assert [json.loads(x)["step"] for x in metrics.read_text().splitlines()] == [1, 3]


def test_eval_paths_check_token_ids_like_training():
    from kdistill.config import RunConfig
    from kdistill.scoring import evaluate
    from kdistill.train.step import heldout_eval

    model = load_model(assets().student).eval()
    vocab = int(model.lm_head_weight.shape[0])
    with pytest.raises(
        UserError,
        match=rf"--data: input holds token id {vocab + 5} outside the model's vocabulary \[0, {vocab}\)",
    ):
        evaluate(model, [np.array([1, vocab + 5, 2, 3])], 1, torch.device("cpu"))
    ids = torch.tensor([[1, 2, 3, 4]])
    for batch, needle in (
        ((ids, torch.tensor([[2, 3, vocab, -100]])), f"held-out data: labels hold token id {vocab} outside"),
        ((ids * vocab, torch.tensor([[2, 3, 4, -100]])), f"held-out data: input holds token id {4 * vocab}"),
    ):
        with pytest.raises(UserError, match=needle):
            heldout_eval(
                model, None, [batch], RunConfig(), torch.device("cpu"), contextlib.nullcontext(), False
            )
