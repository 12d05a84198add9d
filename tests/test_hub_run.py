"""`kdistill run` with Hugging Face names for teacher.path and student.path, read offline from a cache laid
out as huggingface_hub lays it out (tests/test_hub.py builds it): the run trains on the cached snapshots and
its manifest records the repo, revision and commit; a name missing from the cache is one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.test_hub import DEV, MAIN, add_snapshot
from tests.test_train_kit import assets, base_config, one_error_line, run_cli


@pytest.fixture
def hf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "hf" / "hub"
    add_snapshot(cache, "org/tiny-teacher", MAIN, assets().teacher, refs=("main",))
    add_snapshot(cache, "org/tiny-student", DEV, assets().student, refs=("v1",))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def _config(tmp_path: Path, teacher: str, student: str) -> Path:
    cfg = base_config(tmp_path / "run", steps=2, eval_batches=1)
    cfg["teacher"] = {"path": teacher}
    cfg["student"] = {"path": student, "init": "pretrained"}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def test_run_reads_hub_names_from_the_cache(tmp_path: Path, hf_cache: Path, capsys) -> None:
    cfg = _config(tmp_path, "org/tiny-teacher", "org/tiny-student@v1")
    rc, out, err = run_cli(capsys, "run", str(cfg), "--quiet")
    assert rc == 0, err
    assert "status completed: 2 steps" in out
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    teacher_snap = hf_cache / "models--org--tiny-teacher" / "snapshots" / MAIN
    student_snap = hf_cache / "models--org--tiny-student" / "snapshots" / DEV
    assert manifest["hub"] == {
        "teacher": {
            "path": str(teacher_snap),
            "repo_id": "org/tiny-teacher",
            "revision": "main",
            "commit": MAIN,
        },
        "student": {
            "path": str(student_snap),
            "repo_id": "org/tiny-student",
            "revision": "v1",
            "commit": DEV,
        },
    }
    # The saved config points at the snapshots, so --resume reads the same commit.
    assert manifest["config"]["teacher"]["path"] == str(teacher_snap)
    assert set(manifest["teacher_files"]) >= {"config.json", "model.safetensors", "tokenizer.json"}
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert saved["student"]["path"] == str(student_snap)


def test_a_name_missing_from_the_offline_cache_is_one_line(tmp_path: Path, hf_cache: Path, capsys) -> None:
    cfg = _config(tmp_path, "org/absent", str(assets().student))
    rc, _, err = run_cli(capsys, "run", str(cfg), "--quiet")
    assert rc == 2
    line = one_error_line(err)
    assert (
        "teacher.path" in line and "org/absent" in line and str(hf_cache) in line and "HF_HUB_OFFLINE" in line
    )
    assert not (tmp_path / "run").exists()
