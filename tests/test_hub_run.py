"""`kdistill run` with Hugging Face names for teacher.path, student.path and every teachers[i].path of a
mixture, read offline from a cache laid out as huggingface_hub lays it out (tests/test_hub.py builds it):
the run trains on the cached snapshots, its manifest records the repo, revision and commit of each, and
it resumes from the saved config; a name missing from the cache is one line naming the field.
`kdistill teacher-cache` reads a Hub teacher.path the same way."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.test_hub import DEV, MAIN, add_snapshot
from tests.test_multi_teacher import second_teacher
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


@pytest.fixture
def hf_mixture(hf_cache: Path) -> Path:
    """The Hub cache with a second tiny teacher (the first's tokenizer) as org/teacher-b at revision v2."""
    add_snapshot(hf_cache, "org/teacher-b", DEV, second_teacher(), refs=("v2",))
    return hf_cache


def _mixture_config(tmp_path: Path, *paths: str) -> Path:
    cfg = base_config(tmp_path / "run", steps=2, eval_batches=1, checkpoint_every=1)
    cfg.pop("teacher")
    cfg["teachers"] = [{"path": p, "weight": w} for p, w in zip(paths, (3, 1, 1))]
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def test_every_teacher_of_a_mixture_reads_a_hub_name(tmp_path: Path, hf_mixture: Path, capsys) -> None:
    cfg = _mixture_config(tmp_path, "org/tiny-teacher", "org/teacher-b@v2")
    rc, out, err = run_cli(capsys, "run", str(cfg), "--quiet")
    assert rc == 0, err
    first = hf_mixture / "models--org--tiny-teacher" / "snapshots" / MAIN
    second = hf_mixture / "models--org--teacher-b" / "snapshots" / DEV
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["hub"]["teacher"]["path"] == str(first)
    assert manifest["hub"]["teachers[1]"] == {
        "path": str(second),
        "repo_id": "org/teacher-b",
        "revision": "v2",
        "commit": DEV,
    }
    # The saved config names the snapshots: teacher.path and teachers[0].path agree, so --resume reads it.
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert saved["teacher"]["path"] == saved["teachers"][0]["path"] == str(first)
    assert saved["teachers"][1]["path"] == str(second)
    rc, out, err = run_cli(capsys, "run", "--resume", str(tmp_path / "run"), "schedule.steps=3", "--quiet")
    assert rc == 0, err
    assert "status completed: 3 steps" in out


@pytest.mark.parametrize("index", [0, 1])
def test_a_mixture_teacher_missing_from_the_cache_is_one_line(
    tmp_path: Path, hf_mixture: Path, capsys, index: int
) -> None:
    paths = ["org/tiny-teacher", "org/teacher-b@v2", str(assets().teacher)]
    paths[index] = "org/absent@v9"
    rc, _, err = run_cli(capsys, "run", str(_mixture_config(tmp_path, *paths)), "--quiet")
    assert rc == 2
    line = one_error_line(err)
    assert line.startswith(f"teachers[{index}].path: Hugging Face model org/absent (revision v9)"), line
    assert str(hf_mixture) in line and "HF_HUB_OFFLINE" in line
    assert not (tmp_path / "run").exists()


def test_teacher_cache_reads_a_hub_name(tmp_path: Path, hf_cache: Path, capsys) -> None:
    cfg = _config(tmp_path, "org/tiny-teacher", str(assets().student))
    rc, out, err = run_cli(capsys, "teacher-cache", str(cfg), "--out", str(tmp_path / "tc"), "--quiet")
    assert rc == 0, err
    rc, out, err = run_cli(capsys, "run", str(cfg), f"teacher.cache={tmp_path / 'tc'}", "--quiet")
    assert rc == 0, err
    assert "status completed: 2 steps" in out
