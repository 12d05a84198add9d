"""Several teachers (`teachers: [{path, weight}, ...]`): a tiny run with two teachers finishes and
exports a student, the kernel plan and memory plan count both teachers, and the config's errors are
one line each.

Run: .venv/bin/python -m pytest tests/test_multi_teacher.py -q
"""

from __future__ import annotations

import functools

import pytest
import yaml

from kdistill.config import load_config
from kdistill.errors import UserError
from kdistill.kernels.plan import required_kernels
from kdistill.memory import estimate_memory
from kdistill.models.spec import load_spec
from tests.test_train_kit import assets, base_config, one_error_line, read_summary, run_cli
from tests.tiny import make_tiny_model


@functools.cache
def second_teacher():
    """A second tiny teacher (llama, another width) with the same tokenizer as the first."""
    a = assets()
    return make_tiny_model(
        a.root, "llama", tied=True, seed=5, name="teacher-b", hidden_size=48, intermediate_size=96
    )


def two_teachers(run_dir, **schedule):
    cfg = base_config(run_dir, **schedule)
    cfg.pop("teacher")
    cfg["teachers"] = [
        {"path": str(assets().teacher), "weight": 3},
        {"path": str(second_teacher()), "weight": 1},
    ]
    return cfg


def test_two_teachers_run_finishes(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(two_teachers(tmp_path / "run", steps=6, eval_every=3), sort_keys=False))
    rc, out, err = run_cli(capsys, "run", str(path), "--quiet")
    assert rc == 0, err
    s = read_summary(tmp_path / "run")
    assert s["status"] == "completed" and s["final_loss"] < s["initial_loss"]
    assert "kl_to_teacher" in s["heldout"]
    assert (tmp_path / "run" / "student" / "model.safetensors").is_file()
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert [t["weight"] for t in saved["teachers"]] == [0.75, 0.25]


def test_plans_cover_every_teacher(tmp_path):
    cfg = load_config(None, base=two_teachers(tmp_path / "run")).validate()
    t0, t1 = load_spec(cfg.teachers[0].path), load_spec(cfg.teachers[1].path)
    student = load_spec(cfg.student.path)
    one = required_kernels(t0, student, cfg, "sm_90")
    both = required_kernels(t0, student, cfg, "sm_90", extra_teachers=[t1])
    assert one < both  # the second teacher's shapes (its width) add keys
    m1 = estimate_memory(t0, student, cfg)
    m2 = estimate_memory(t0, student, cfg, extra_teachers=[t1])
    assert m2["teacher_weights"] == m1["teacher_weights"] + t1.param_counts()["total"] * 2
    assert m2["total"] > m1["total"]


@pytest.mark.parametrize(
    "teachers, match",
    [
        ([{"path": "a", "weight": -1}], r"teachers\[0\]\.weight is -1.0, expected a positive number"),
        ([{"path": ""}], r"teachers\[0\]\.path is empty"),
        (["a"], r"teachers\[0\] is 'a', expected a mapping"),
    ],
)
def test_config_errors(teachers, match):
    with pytest.raises(UserError, match=match):
        load_config(None, base={"teachers": teachers}).validate(need_paths=False)


def test_both_teacher_and_teachers_is_an_error():
    with pytest.raises(UserError, match="teacher.path and teachers are both set"):
        load_config(None, base={"teacher": {"path": "x"}, "teachers": [{"path": "y"}]}).validate(
            need_paths=False
        )


def test_a_teacher_with_another_tokenizer_is_one_line(tmp_path, capsys):
    other = make_tiny_model(tmp_path, "qwen2", tied=True, seed=2, name="other-tok", tokenizer_vocab=320)
    cfg = two_teachers(tmp_path / "run", steps=2)
    cfg["teachers"][1]["path"] = str(other)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    rc, _, err = run_cli(capsys, "run", str(path), "--quiet")
    assert rc != 0
    assert "tokenizer differs from teachers[0]'s" in one_error_line(err)


def test_plan_counts_every_teacher_of_a_mixture():
    from kdistill.commands.plan import make_plan
    from kdistill.config import RunConfig, TeacherEntry
    from kdistill.models.spec import load_spec

    teacher, student = load_spec("qwen2.5-1.5b"), load_spec("qwen2.5-0.5b")
    one = RunConfig()
    two = RunConfig()
    two.teachers = [TeacherEntry("qwen2.5-1.5b", 1.0), TeacherEntry("qwen2.5-1.5b", 1.0)]
    a, b = make_plan(one, teacher, student), make_plan(two, teacher, student)
    t_fwd = teacher.matmul_flops_per_token(one.data.seq_len)
    assert b["flops_per_token"]["teacher_forward"] == 2 * t_fwd == 2 * a["flops_per_token"]["teacher_forward"]
    assert b["memory_bytes"]["total"] > a["memory_bytes"]["total"]


def test_a_teacher_cache_of_several_teachers_is_one_line(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(two_teachers(tmp_path / "run", steps=2), sort_keys=False))
    rc, _, err = run_cli(capsys, "teacher-cache", str(path), "--out", str(tmp_path / "tc"), "--quiet")
    assert rc == 2
    assert one_error_line(err).startswith("teachers: a teacher cache holds one teacher's targets")
    assert not (tmp_path / "tc").exists()
