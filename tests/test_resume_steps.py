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
def runs(tmp_path_factory) -> tuple[Path, Path]:
    """(a completed run of 8 steps with a checkpoint every 4: checkpoints 4 and 8, the same run cut back
    to what it leaves when stopped after step 4: checkpoint 4 alone)."""
    from kdistill.cli import main

    root = tmp_path_factory.mktemp("resume")
    cfg = write_config(root, steps=8, checkpoint_every=4)
    assert main(["run", str(cfg), "--quiet"]) == 0
    return root / "run", interrupted_copy(root / "run", root / "stopped", 4)


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _refused(capsys, run: Path, steps: int, held: int) -> None:
    """A resume of `run` with schedule.steps=`steps` is one line naming checkpoint `held`, and every file
    of the run is as it was (only the run's lock file may have come and gone)."""
    before = _files(run)
    rc, _, err = run_cli(capsys, "run", "--resume", str(run), f"schedule.steps={steps}", "--quiet")
    assert rc == 2
    assert one_error_line(err) == (
        f"--resume {run}: schedule.steps is {steps}, but step-{held:07d} holds step {held}; give "
        f"schedule.steps={held} or more (a checkpoint is never cut back)"
    )
    after = _files(run)
    assert after.keys() - before.keys() <= {".kdistill-lock"}
    assert {k: v for k, v in after.items() if k in before} == before  # config, manifest, checkpoints


def test_a_resume_with_fewer_steps_than_the_checkpoint_is_refused(runs, tmp_path, capsys, monkeypatch):
    from kdistill.train import recipe

    def never(*a, **k):
        raise AssertionError("the models were loaded before the refusal")

    monkeypatch.setattr(recipe, "load_models", never)  # refused before any model is read
    run = shutil.copytree(runs[1], tmp_path / "run")
    _refused(capsys, run, 3, 4)
    assert not (run / "student").exists()


def test_fewer_steps_than_the_newest_checkpoint_is_refused_once_it_is_read(runs, tmp_path, capsys):
    run = shutil.copytree(runs[0], tmp_path / "run")  # checkpoints 4 and 8: step 6 is past the first only
    _refused(capsys, run, 6, 8)


def test_a_resume_at_the_checkpoints_own_step_exports_it_as_written(runs, tmp_path, capsys):
    run = shutil.copytree(runs[1], tmp_path / "run")
    ckpt = run / "checkpoints" / "step-0000004"
    before = _files(ckpt)
    rc, out, err = run_cli(capsys, "run", "--resume", str(run), "schedule.steps=4", "--quiet")
    assert rc == 0, err
    assert "status completed: 4 steps" in out
    assert _files(ckpt) == before  # state.json included: the checkpoint is never rewritten
    assert (run / "student" / "model.safetensors").is_file()
