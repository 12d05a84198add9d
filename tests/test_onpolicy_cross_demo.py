"""The embedded on-policy comparison across tokenizers (`kdistill run src/kdistill/demo/on_policy.yaml
demo.student_vocab=N`), shortened: a student with a byte-level BPE of its own, both arms run with
kd.cross_tokenizer, and the teacher grades each model's completions re-tokenized into its own tokens."""

from __future__ import annotations

import json
import math

import pytest
import yaml

from kdistill.demo.onpolicy import (
    ON_POLICY_YAML,
    TEMPLATE,
    _teacher_tokens,
    cross_models,
    load_demo_config,
    make_student_tokenizer,
    side,
    write_conversations,
)
from kdistill.errors import UserError
from kdistill.models.tokenizer import load_tokenizer
from kdistill.train.corpus import expand_data_paths
from tests.test_train_kit import run_cli


@pytest.fixture(scope="module")
def train_rows(tmp_path_factory):
    out = tmp_path_factory.mktemp("rows") / "train.jsonl"
    return write_conversations(expand_data_paths(["stdlib:train"])[:60], out)


def test_the_students_tokenizer_is_the_same_file_from_the_same_rows_and_not_the_teachers(
    tmp_path, train_rows
):
    size_a = make_student_tokenizer(train_rows, 700, tmp_path / "a")
    size_b = make_student_tokenizer(train_rows, 700, tmp_path / "b")
    assert size_a == size_b == 700
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (
        tmp_path / "b" / "tokenizer.json"
    ).read_bytes()
    cfg, _ = load_demo_config([])
    student, teacher = load_tokenizer(tmp_path / "a"), load_tokenizer(cfg.teacher.path)
    assert student.vocab_size == 700 != teacher.vocab_size
    assert student.token_to_id("<|endoftext|>") == 0 == student.eos_id  # the student config's eos id
    text = train_rows[0]["prompt"]
    assert student.decode(student.encode(text)) == text
    assert student.encode(text) != teacher.encode(text)  # other merges: another tokenization


def test_cross_models_give_the_student_its_tokenizer_and_both_the_demo_template(tmp_path, train_rows):
    cfg, _ = load_demo_config([])
    teacher, student = cross_models(cfg, train_rows, 500, tmp_path)
    config = json.loads((student / "config.json").read_text())
    assert config["vocab_size"] == load_tokenizer(student).vocab_size == 500
    assert config["hidden_size"] == json.loads(open(cfg.student.path).read())["hidden_size"]
    assert not list(student.glob("*.safetensors"))  # a random student: no weights
    assert (teacher / "model.safetensors").stat().st_size > 0
    for folder in (teacher, student):
        assert (folder / "chat_template.jinja").read_text() == TEMPLATE


def test_a_student_vocabulary_of_the_teachers_size_is_refused_before_anything_is_written(tmp_path, capsys):
    out = tmp_path / "demo"
    rc, stdout, err = run_cli(
        capsys, "run", str(ON_POLICY_YAML), f"output.dir={out}", "demo.student_vocab=4096", "--quiet"
    )
    assert rc == 2
    message = (
        "kdistill: error: demo.student_vocab is 4096, the teacher's own vocabulary size: expected another"
    )
    assert err.strip().startswith(message) and len(err.strip().splitlines()) == 1
    assert not out.exists()


@pytest.mark.parametrize(
    "override, message",
    [
        ("demo.student_vocab=100", "demo.student_vocab is 100, expected 0"),
        ("demo.grade_points=0", "demo.grade_points is 0, expected a positive integer"),
    ],
)
def test_a_bad_cross_tokenizer_setting_is_a_one_line_error(override, message):
    with pytest.raises(UserError, match=message) as e:
        load_demo_config([override])
    assert "\n" not in str(e.value)


def test_the_teacher_grades_a_completions_text_and_its_end_of_turn_only_when_it_stopped(tmp_path, train_rows):
    cfg, _ = load_demo_config([])
    teacher, _ = cross_models(cfg, train_rows, 500, tmp_path)
    t = side(teacher, ["def f(x):\n"], cfg)
    tok = t.tok
    assert t.prompts == [tok.encode("def f(x):\n")]
    assert tok.eos_id in t.stops
    text = "    return x + 1\n"
    assert _teacher_tokens(t, "def f(x):\n", text, False) == tok.encode(text)
    assert _teacher_tokens(t, "def f(x):\n", text, True) == tok.encode(text) + [tok.eos_id]


def test_embedded_on_policy_comparison_runs_across_tokenizers(tmp_path, capsys):
    out = tmp_path / "demo"
    train, heldout = expand_data_paths(["stdlib:train"])[:80], expand_data_paths(["stdlib:heldout"])[:12]
    rc, stdout, err = run_cli(
        capsys, "run", str(ON_POLICY_YAML), f"output.dir={out}", f"data.train=[{','.join(train)}]",
        f"data.heldout=[{','.join(heldout)}]", "schedule.steps=2", "schedule.batch_size=2",
        "kd.max_new_tokens=6", "data.seq_len=48", "demo.warmup_steps=1", "demo.heldout_prompts=3",
        "demo.student_vocab=600", "demo.grade_points=2", "--quiet", "--json",
    )  # fmt: skip
    assert rc == 0, err
    summary = json.loads(stdout)
    assert summary["cross_tokenizer"]["student_vocab"] == 600 != summary["cross_tokenizer"]["teacher_vocab"]
    for phase in ("warm_up", "on_policy", "off_policy"):  # every phase distilled across tokenizers
        config = yaml.safe_load((out / phase / "config.yaml").read_text())
        assert config["kd"]["cross_tokenizer"] is True
        assert load_tokenizer(out / phase / "student").vocab_size == 600
    assert summary["on_policy"]["on_policy_steps"] == 2  # lambda 1: every step of the arm generated
    table = summary["comparison"]
    assert list(table) == ["teacher", "warm_up", "off_policy", "on_policy"]
    # the grades are the teacher's, of the texts in completions.jsonl re-tokenized by the teacher
    t_tok = load_tokenizer(out / "models" / "teacher")
    graded = [json.loads(x) for x in (out / "completions.jsonl").read_text().splitlines()]
    for name, row in table.items():
        mine = [g for g in graded if g["model"] == name]
        assert len(mine) == summary["heldout_prompts"] == 3
        tokens = sum(len(t_tok.encode(g["completion"])) + g["stopped"] for g in mine)
        assert row["tokens"] == tokens and row["chars"] == sum(
            len(g["completion"]) + g["stopped"] for g in mine
        )
        for key in ("teacher_nll", "teacher_nll_per_char"):
            assert math.isfinite(row[key]) and row[key] > 0 and row[f"{key}_se"] >= 0
        assert "reverse_kl" not in row  # no KL between two vocabularies
    assert table["teacher"]["heldout_ce"] is None and table["on_policy"]["heldout_ce"] > 0
    # graded at the warm-up's end, halfway and at the end of each arm
    assert [p["step"] for p in summary["curves"]["on_policy"]] == [0, 1, 2]
    assert summary["curves"]["on_policy"][0]["teacher_nll"] == table["warm_up"]["teacher_nll"]
    assert summary["curves"]["on_policy"][-1]["teacher_nll"] == table["on_policy"]["teacher_nll"]
    assert summary["on_policy_helps"] == (summary["on_policy_teacher_nll_per_char_is"] == "lower")
    assert (out / "comparison.png").stat().st_size > 0
