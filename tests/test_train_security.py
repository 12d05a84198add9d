"""Security of a run, in process via kdistill.cli.main.

- A file or tensor name from a model or checkpoint cannot write (or read) outside the directories of the
  run: a shard index naming '../evil.safetensors' is refused; a checkpoint whose tensors are named
  '../../evil' or whose state names a step like '../x' is refused with one line; every file a run writes
  lies inside its run directory.
- No code runs from model files: nothing is unpickled (pickle and torch.load are booby-trapped during a
  run and a resume) and a config.json's auto_map to custom modelling code is never imported.
- Nothing reaches the network: socket connect/getaddrinfo raise during a whole run, resume and report.
"""

from __future__ import annotations

import json
import pickle
import shutil
import socket
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import save_file

from tests.test_train_kit import assets, base_config, one_error_line, run_cli, write_config
from tests.tiny import make_tiny_model


def _error(capsys, *argv: str) -> str:
    rc, _, err = run_cli(capsys, *argv)
    assert rc == 2, err
    return one_error_line(err)


def test_shard_index_naming_a_file_outside_the_model_dir_is_refused(tmp_path, capsys):
    teacher = make_tiny_model(tmp_path / "m", "qwen2", tied=False, seed=3, name="t", max_shard_size="20KB")
    index_path = teacher / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["model.norm.weight"] = "../evil.safetensors"
    index_path.write_text(json.dumps(index))
    # The file exists outside: only the name is at fault, and it must not be opened.
    shutil.copy(next(teacher.glob("model-0000*.safetensors")), teacher.parent / "evil.safetensors")
    cfg = base_config(tmp_path / "run", steps=2)
    cfg["teacher"]["path"] = str(teacher)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert _error(capsys, "run", str(path), "--quiet") == (
        f"{index_path}: weight_map['model.norm.weight'] is '../evil.safetensors', expected a file name inside {teacher}"
    )
    assert not (tmp_path / "run").exists()


@pytest.fixture()
def finished(tmp_path, capsys):
    cfg = write_config(tmp_path, steps=2, checkpoint_every=1)
    rc, _, err = run_cli(capsys, "run", str(cfg), "output.keep_checkpoints=1", "--quiet")
    assert rc == 0, err
    return tmp_path / "run"


def test_checkpoint_tensor_names_cannot_escape(finished, capsys):
    ckpt = finished / "checkpoints" / "step-0000002"
    weights = {"../../evil": torch.zeros(2), "/tmp/evil-abs": torch.zeros(1)}
    save_file(weights, str(ckpt / "student.safetensors"))
    msg = _error(capsys, "run", "--resume", str(finished), "schedule.steps=3", "--quiet")
    assert msg == f"{ckpt}: checkpoint does not match this run (unexpected tensor '../../evil')"
    assert not (finished.parent.parent / "evil").exists() and not Path("/tmp/evil-abs").exists()
    assert not list(finished.parent.rglob("*evil*"))


def test_checkpoint_state_with_a_path_for_a_step_is_refused(finished, capsys):
    ckpt = finished / "checkpoints" / "step-0000002"
    state = json.loads((ckpt / "state.json").read_text())
    state["step"] = "../../x"
    (ckpt / "state.json").write_text(json.dumps(state))
    assert _error(capsys, "run", "--resume", str(finished), "schedule.steps=3", "--quiet") == (
        f"{ckpt}: checkpoint does not match this run (step '../../x')"
    )
    assert not (finished.parent.parent / "x").exists()


def test_every_file_of_a_run_is_inside_the_run_dir(finished):
    root = finished.resolve()
    files = [p for p in finished.rglob("*") if p.is_file()]
    assert files and all(p.resolve().is_relative_to(root) and not p.is_symlink() for p in files)
    names = {p.relative_to(finished).as_posix() for p in files}
    assert {
        "manifest.json",
        "summary.json",
        "student/model.safetensors",
        "checkpoints/step-0000002/state.json",
    } <= names


def test_no_code_runs_from_model_files(tmp_path, capsys, monkeypatch):
    # A teacher whose config.json asks for custom modelling code (trust_remote_code style).
    teacher = tmp_path / "teacher"
    shutil.copytree(assets().teacher, teacher)
    marker = tmp_path / "code-ran"
    (teacher / "modeling_evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    hf = json.loads((teacher / "config.json").read_text())
    hf["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}
    (teacher / "config.json").write_text(json.dumps(hf))

    def trap(*a, **k):
        raise AssertionError("something was unpickled")

    monkeypatch.setattr(pickle, "load", trap)
    monkeypatch.setattr(pickle, "loads", trap)
    monkeypatch.setattr(torch, "load", trap)
    cfg = base_config(tmp_path / "run", steps=2, checkpoint_every=1)
    cfg["teacher"]["path"] = str(teacher)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert run_cli(capsys, "run", str(path), "--quiet")[0] == 0
    rc, _, err = run_cli(capsys, "run", "--resume", str(tmp_path / "run"), "schedule.steps=3", "--quiet")
    assert rc == 0, err
    assert not marker.exists()


def test_no_network_access_during_a_run(tmp_path, capsys, monkeypatch):
    attempts: list[str] = []

    def refuse(name):
        def f(*a, **k):
            attempts.append(f"{name}{a[1:] if name.startswith('socket.') else a}")
            raise OSError("network access attempted during a test")

        return f

    monkeypatch.setattr(socket.socket, "connect", refuse("socket.connect"))
    monkeypatch.setattr(socket.socket, "connect_ex", refuse("socket.connect_ex"))
    monkeypatch.setattr(socket.socket, "sendto", refuse("socket.sendto"))
    monkeypatch.setattr(socket, "getaddrinfo", refuse("getaddrinfo"))
    monkeypatch.setattr(socket, "create_connection", refuse("create_connection"))
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)  # kdistill must not depend on these to stay offline
    cfg = write_config(tmp_path, steps=3, checkpoint_every=2, eval_every=2)
    assert run_cli(capsys, "run", str(cfg), "--quiet")[0] == 0
    assert run_cli(capsys, "run", "--resume", str(tmp_path / "run"), "schedule.steps=4", "--quiet")[0] == 0
    assert run_cli(capsys, "report", str(tmp_path / "run"))[0] == 0
    assert attempts == []
