"""A resume never cuts a checkpoint back: asking for fewer steps than the newest checkpoint holds is one
line and leaves the run as it was; a resume at the checkpoint's own step exports it without rewriting it.

One run of the tiny pair of tests/test_train_kit.py (8 steps, a checkpoint every 4), cut back to what a
run stopped after step 4 leaves.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.test_train_kit import interrupted_copy, one_error_line, run_cli, write_config


@pytest.fixture(scope="module")
def stopped_at_4(tmp_path_factory) -> Path:
    """A run of 8 steps with a checkpoint every 4, cut back to what it leaves when stopped after step 4."""
    from kdistill.cli import main

    root = tmp_path_factory.mktemp("resume")
    cfg = write_config(root, steps=8, checkpoint_every=4)
    assert main(["run", str(cfg), "--quiet"]) == 0
    return interrupted_copy(root / "run", root / "stopped", 4)


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_resume_with_fewer_steps_than_the_checkpoint_is_refused(stopped_at_4, tmp_path, capsys):
    run = shutil.copytree(stopped_at_4, tmp_path / "run")
    before = _files(run)
    rc, _, err = run_cli(capsys, "run", "--resume", str(run), "schedule.steps=3", "--quiet")
    assert rc == 2
    assert one_error_line(err) == (
        f"--resume {run}: schedule.steps is 3, but step-0000004 holds step 4; give schedule.steps=4 or more "
        "(a checkpoint is never cut back)"
    )
    after = _files(run)
    assert after.keys() - before.keys() <= {".kdistill-lock"} and not (run / "student").exists()
    assert {
        k: v for k, v in after.items() if k in before
    } == before  # config, manifest, checkpoint as they were


def test_a_resume_at_the_checkpoints_own_step_exports_it_as_written(stopped_at_4, tmp_path, capsys):
    run = shutil.copytree(stopped_at_4, tmp_path / "run")
    ckpt = run / "checkpoints" / "step-0000004"
    before = _files(ckpt)
    rc, out, err = run_cli(capsys, "run", "--resume", str(run), "schedule.steps=4", "--quiet")
    assert rc == 0, err
    assert "status completed: 4 steps" in out
    assert _files(ckpt) == before  # state.json included: the checkpoint is never rewritten
    assert (run / "student" / "model.safetensors").is_file()
