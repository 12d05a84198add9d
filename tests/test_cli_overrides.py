"""Every command that reads a run config takes key=value overrides alone, without a CONFIG file: `run`
with several teachers (`teachers=[...]`), `teacher-cache`, `plan`; with no teacher at all `run` is the
embedded demo, and the others ask for CONFIG or overrides in one line."""

from __future__ import annotations

import json

from tests.test_train_kit import assets, one_error_line, run_cli


def _common():
    a = assets()
    return [
        f"student.path={a.student_config}",
        "student.init=random",
        f"data.train=[{a.train}]",
        f"data.heldout=[{a.heldout}]",
        "data.seq_len=32",
        "data.max_tokens=512",
        f"data.cache_dir={a.cache}",
        "schedule.steps=1",
        "schedule.batch_size=2",
        "schedule.eval_batches=1",
        "runtime.device=cpu",
    ]


def test_run_with_teachers_from_overrides_alone(tmp_path, capsys):
    t = assets().teacher
    teachers = f"teachers=[{{path: {t}, weight: 1}}, {{path: {t}, weight: 3}}]"
    rc, _, err = run_cli(capsys, "run", teachers, f"output.dir={tmp_path / 'run'}", *_common(), "--quiet")
    assert rc == 0, err
    saved = (tmp_path / "run" / "config.yaml").read_text()
    assert "teachers:" in saved and "weight: 0.75" in saved


def test_teacher_cache_and_plan_from_overrides_alone(tmp_path, capsys):
    argv = [f"teacher.path={assets().teacher}", *_common()]
    rc, out, err = run_cli(capsys, "teacher-cache", *argv, "--out", str(tmp_path / "tc"), "--quiet", "--json")
    assert rc == 0, err
    assert json.loads(out)["rows"] == json.loads((tmp_path / "tc" / "manifest.json").read_text())["rows"]
    rc, out, err = run_cli(capsys, "plan", *argv, "--json")
    assert rc == 0, err
    assert json.loads(out)["memory_bytes"]["total"] > 0


def test_no_config_and_no_overrides_is_one_line(tmp_path, capsys):
    rc, _, err = run_cli(capsys, "teacher-cache", "--out", str(tmp_path / "tc"))
    assert rc == 2 and "CONFIG" in one_error_line(err)
    rc, _, err = run_cli(capsys, "teacher-cache", "--out", str(tmp_path / "tc"), "kd.alpha=0.5")
    assert rc == 2 and "teacher.path is empty" in one_error_line(err)
    assert not (tmp_path / "tc").exists()
