"""Nothing lost: kdistill never deletes what it did not make, runs one run per directory, checks the
meaning of every number it reads, turns write faults and signals at every stage into one line (or a clean
"interrupted" stop) and resumes afterwards; `--resume` checks what the run was trained from.

In-process (`cli.main`) runs of the tiny pair of tests/test_train_kit.py, a few steps each.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
from pathlib import Path

import pytest
import yaml

from tests.test_train_kit import base_config, one_error_line, run_cli, write_config


def _error(capsys, *argv: str) -> str:
    rc, _, err = run_cli(capsys, *argv)
    assert rc == 2, err
    return one_error_line(err)


def _leftovers(root: Path) -> list[str]:
    """Temp files and folders anywhere below root (none may survive a fault or a signal)."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if ".tmp" in p.name)


# -- never delete what we did not make ----------------------------------------------------------------
def test_empty_output_dir_with_overwrite_never_touches_the_working_directory(tmp_path, capsys, monkeypatch):
    cwd = tmp_path / "work"
    (cwd / "checkpoints").mkdir(parents=True)
    (cwd / "precious.txt").write_text("keep me")
    monkeypatch.chdir(cwd)
    cfg = write_config(tmp_path)
    for value in ("output.dir=", "output.dir=  "):
        assert _error(capsys, "run", str(cfg), value, "--overwrite", "--quiet") == (
            "output.dir is empty, expected a directory path"
        )
    assert _error(capsys, "run", str(cfg), f"output.dir={cwd}", "--overwrite", "--quiet") == (
        f"output.dir '{cwd}': refusing to remove it (it is the current working directory)"
    )
    assert (cwd / "precious.txt").read_text() == "keep me" and (cwd / "checkpoints").is_dir()


def test_overwrite_refuses_a_directory_kdistill_did_not_make(tmp_path, capsys):
    out = tmp_path / "mine"
    (out / "checkpoints").mkdir(parents=True)
    (out / "manifest.json").write_text('{"not": "ours"}')
    cfg = write_config(tmp_path, run_dir=out)
    msg = _error(capsys, "run", str(cfg), "--overwrite", "--quiet")
    assert msg.startswith(f"output.dir '{out}' was not created by kdistill")
    assert (out / "manifest.json").read_text() == '{"not": "ours"}'


def test_a_run_from_before_the_marker_is_ours_by_its_manifest(tmp_path, capsys):
    cfg = write_config(tmp_path, steps=2)
    assert run_cli(capsys, "run", str(cfg), "--quiet")[0] == 0
    run = tmp_path / "run"
    (run / ".kdistill-run").unlink()  # as an older kdistill left it
    assert run_cli(capsys, "run", str(cfg), "--overwrite", "--quiet")[0] == 0
    assert (run / ".kdistill-run").is_file()


# -- one run per directory ----------------------------------------------------------------------------
def test_live_lock_is_one_line_and_a_stale_one_is_taken_over(tmp_path, capsys):
    cfg = write_config(tmp_path, steps=2)
    run = tmp_path / "run"
    run.mkdir()
    (run / ".kdistill-run").write_text('{"kdistill_run": "x"}')
    host = socket.gethostname()
    (run / ".kdistill-lock").write_text(json.dumps({"pid": os.getppid(), "host": host}))
    msg = _error(capsys, "run", str(cfg), "--quiet")
    assert msg.startswith(f"output.dir '{run}' is in use by another kdistill run (pid {os.getppid()}")
    (run / ".kdistill-lock").write_text(json.dumps({"pid": 2**22 + 12345, "host": host}))
    assert run_cli(capsys, "run", str(cfg), "--quiet")[0] == 0
    assert not (run / ".kdistill-lock").exists()


# -- meaning, not only type ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "override,message",
    [
        ("optim.lr=inf", "optim.lr is inf, expected a finite number"),
        ("kd.temperature=.inf", "kd.temperature is inf, expected a finite number"),
        ("optim.grad_clip=nan", "optim.grad_clip is nan, expected a finite number"),
        ("schedule.seed=-1", "schedule.seed is -1, expected an integer >= 0 and < 4294967296"),
        (
            "schedule.seed=99999999999",
            "schedule.seed is 99999999999, expected an integer >= 0 and < 4294967296",
        ),
    ],
)
def test_numbers_must_be_sane(tmp_path, capsys, override, message):
    assert _error(capsys, "run", str(write_config(tmp_path)), override, "--quiet") == message
    assert not (tmp_path / "run").exists()


def test_a_section_given_twice_is_refused(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    text = yaml.safe_dump(base_config(tmp_path / "run"), sort_keys=False)
    path.write_text(text + "kd:\n  alpha: 0.1\n")
    msg = _error(capsys, "run", str(path))
    assert msg.startswith(f"{path}: line ") and "duplicate key 'kd'" in msg


def test_alias_bomb_is_a_short_line(tmp_path, capsys):
    path = tmp_path / "bomb.yaml"
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]
    path.write_text("\n".join(lines) + "\n")
    assert len(_error(capsys, "run", str(path))) < 300


def test_tokenizer_ids_beyond_the_embedding(tmp_path, capsys):
    from tests.test_train_kit import assets

    teacher = tmp_path / "teacher"
    shutil.copytree(assets().teacher, teacher)
    tok = json.loads((teacher / "tokenizer.json").read_text())
    tok.setdefault("added_tokens", []).append(
        {"id": 100000, "content": "<big>", "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True}
    )  # fmt: skip
    (teacher / "tokenizer.json").write_text(json.dumps(tok))
    cfg = write_config(tmp_path)
    msg = _error(capsys, "run", str(cfg), f"teacher.path={teacher}", "--quiet")
    assert "token id 100000" in msg or "tokenizer" in msg
    assert not (tmp_path / "run").exists()


def test_argparse_errors_are_one_line(capsys):
    assert (
        _error(capsys, "run", "--resume")
        == "run: argument --resume: expected one argument (see kdistill run --help)"
    )


def test_no_heldout_data_reports_null(tmp_path, capsys):
    cfg = write_config(tmp_path, steps=2)
    rc, _, err = run_cli(
        capsys, "run", str(cfg), "data.heldout=[]", "data.heldout_fraction=0", "--quiet", "--json"
    )
    if rc == 2:  # a config that needs held-out data says so in one line
        one_error_line(err)
        return
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["heldout"].get("student_loss") in (None,) and summary["heldout"].get("student") is None


# -- resume checks identity ---------------------------------------------------------------------------
def test_resume_refuses_changed_inputs_unless_allowed(tmp_path, capsys):
    from tests.test_train_kit import assets

    data = tmp_path / "data"
    shutil.copytree(assets().train, data)
    cfg = write_config(tmp_path, steps=4, checkpoint_every=2)
    run = tmp_path / "run"
    assert run_cli(capsys, "run", str(cfg), f"data.train=[{data}]", "--quiet")[0] == 0
    (data / "doc0.txt").write_text((data / "doc0.txt").read_text() + " more words")
    msg = _error(capsys, "run", "--resume", str(run), "schedule.steps=6", "--quiet")
    assert msg.startswith(f"--resume {run}: the run's inputs changed since it started: data (doc0.txt)")
    rc, _, err = run_cli(
        capsys, "run", "--resume", str(run), "schedule.steps=6", "--allow-changes", "--quiet"
    )
    assert rc == 2 or rc == 0, err  # the data may no longer pack the same (a one-line error) or resume
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["resume_changes"][-1]["changed"] == ["data (doc0.txt)"]


def test_data_identity_sees_same_size_edits_and_glob_matches(tmp_path):
    from kdistill.train.evidence import data_identity

    (tmp_path / "a.txt").write_text("alpha beta")
    (tmp_path / "b.txt").write_text("gamma")
    before = data_identity([str(tmp_path / "*.txt")])
    assert sorted(Path(k).name for k in before) == ["a.txt", "b.txt"]
    (tmp_path / "a.txt").write_text("alpha bet4")  # same size, other content
    after = data_identity([str(tmp_path / "*.txt")])
    changed = [Path(k).name for k in before if before[k] != after[k]]
    assert changed == ["a.txt"]


def test_resume_with_no_loadable_checkpoint_lists_what_it_found(tmp_path, capsys):
    cfg = write_config(tmp_path, steps=2)
    run = tmp_path / "run"
    assert run_cli(capsys, "run", str(cfg), "--quiet")[0] == 0
    state = run / "checkpoints" / "step-0000002" / "state.json"
    state.write_text("{not json")
    msg = _error(capsys, "run", "--resume", str(run), "schedule.steps=3", "--quiet")
    assert msg.startswith(
        f"--resume {run}: no loadable checkpoint (found: step-0000002: state.json: not valid JSON"
    )


def test_optimizer_tensor_of_the_wrong_shape(tmp_path, capsys):
    import torch
    from safetensors.torch import load_file, save_file

    cfg = write_config(tmp_path, steps=2)
    run = tmp_path / "run"
    assert run_cli(capsys, "run", str(cfg), "--quiet")[0] == 0
    path = run / "checkpoints" / "step-0000002" / "optimizer.safetensors"
    t = load_file(str(path))
    t["0.exp_avg"] = torch.zeros(3, 3)
    save_file(t, str(path))
    msg = _error(capsys, "run", "--resume", str(run), "schedule.steps=3", "--quiet")
    assert "optimizer tensor '0.exp_avg' has shape [3, 3]" in msg


# -- signals at each stage ----------------------------------------------------------------------------
def _kill_self_in(monkeypatch, module, name: str, times: int = 1):
    real = getattr(module, name)
    left = [times]

    def wrapped(*a, **k):
        if left[0] > 0:
            left[0] -= 1
            os.kill(os.getpid(), signal.SIGTERM)
        return real(*a, **k)

    monkeypatch.setattr(module, name, wrapped)


def test_sigterm_during_setup_leaves_nothing_and_a_rerun_works(tmp_path, capsys, monkeypatch):
    from kdistill.train import recipe

    cfg = write_config(tmp_path, steps=2)
    _kill_self_in(monkeypatch, recipe, "load_data")
    rc, _, err = run_cli(capsys, "run", str(cfg), "--quiet")
    assert rc == 2 and err.strip() == "kdistill: error: interrupted by SIGTERM during setup", err
    assert not (tmp_path / "run").exists()
    monkeypatch.undo()
    assert run_cli(capsys, "run", str(cfg), "--quiet")[0] == 0


@pytest.mark.parametrize("stage", ["eval", "checkpoint"])
def test_sigterm_in_the_loop_stops_cleanly_and_resumes(tmp_path, capsys, monkeypatch, stage):
    from kdistill.train import checkpoint, recipe

    cfg = write_config(tmp_path, steps=6, checkpoint_every=2, eval_every=2)
    module, name = (recipe, "heldout_eval") if stage == "eval" else (checkpoint, "save_file")
    _kill_self_in(monkeypatch, module, name)
    rc, _, err = run_cli(capsys, "run", str(cfg), "--quiet")
    assert rc == 0 and "Traceback" not in err, err
    run = tmp_path / "run"
    assert json.loads((run / "summary.json").read_text())["status"] == "interrupted"
    assert _leftovers(run) == []
    monkeypatch.undo()
    assert run_cli(capsys, "run", "--resume", str(run), "--quiet")[0] == 0
    assert json.loads((run / "summary.json").read_text())["status"] == "completed"


def test_sigterm_during_export_resumes_straight_into_the_export(tmp_path, capsys, monkeypatch):
    from kdistill.models import hf_io

    cfg = write_config(tmp_path, steps=2)
    run = tmp_path / "run"
    _kill_self_in(monkeypatch, hf_io, "save_file")
    rc, _, err = run_cli(capsys, "run", str(cfg), "--quiet")
    assert rc == 0 and "received during the export" in err and "Traceback" not in err, err
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["export"] == "interrupted"
    assert not (run / "student").exists() and _leftovers(tmp_path) == []
    monkeypatch.undo()
    rc, _, err = run_cli(capsys, "run", "--resume", str(run), "--quiet")
    assert rc == 0, err
    assert (run / "student" / "model.safetensors").is_file()
    assert json.loads((run / "summary.json").read_text())["status"] == "completed"


def test_side_json_files_nested_too_deeply_are_one_line(tmp_path):
    """A teacher cache manifest, a LoRA adapter config and a tokenizer_config.json nested far past any
    real file: one-line errors, never a RecursionError."""
    from kdistill.data.chat_template import load_chat_template
    from kdistill.errors import UserError
    from kdistill.models.lora import read_adapter
    from kdistill.teacher_cache import read_manifest

    deep = "[" * 100_000 + "]" * 100_000
    cases = [
        ("cache", "manifest.json", read_manifest),
        ("adapter", "adapter_config.json", read_adapter),
        ("tok", "tokenizer_config.json", load_chat_template),
    ]
    for folder, name, read in cases:
        d = tmp_path / folder
        d.mkdir()
        (d / name).write_text(deep)
        with pytest.raises(UserError) as e:
            read(d)
        assert "\n" not in str(e.value) and str(d / name) in str(e.value), str(e.value)
