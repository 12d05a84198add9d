"""The embedded on-policy comparison (`kdistill run src/kdistill/demo/on_policy.yaml`), shortened: a shared
off-policy warm-up, then the on-policy arm and the off-policy arm for the on-policy arm's training time,
all graded by the teacher on their own greedy completions of held-out prompts."""

from __future__ import annotations

import json

import pytest

from kdistill.demo.onpolicy import ON_POLICY_YAML, Comparison, load_demo_config, write_conversations
from kdistill.errors import UserError
from tests.test_train_kit import run_cli


def test_prompts_are_a_files_first_lines_and_completions_the_next(tmp_path):
    src = tmp_path / "a.py"
    src.write_text("".join(f"line {i}\n" for i in range(41)))
    (tmp_path / "short.py").write_text("x = 1\n")
    rows = write_conversations([str(src), str(tmp_path / "short.py")], tmp_path / "out.jsonl")
    window = [
        {
            "prompt": "".join(f"line {i}\n" for i in range(6)),
            "completion": "".join(f"line {i}\n" for i in range(6, 16)),
        }
    ]
    assert rows == window
    assert [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()] == rows
    # more windows per file: the next 16 lines, then the rest while it still holds a completion
    rows = write_conversations([str(src)], tmp_path / "out.jsonl", per_file=4)
    assert [r["prompt"].split("\n")[0] for r in rows] == ["line 0", "line 16", "line 32"]
    assert rows[2]["completion"] == "".join(f"line {i}\n" for i in range(38, 41))


def test_demo_settings_come_from_the_yaml_and_demo_overrides():
    cfg, settings = load_demo_config(["demo.warmup_steps=7", "kd.on_policy=0.5"])
    assert settings.warmup_steps == 7 and cfg.kd.on_policy == 0.5
    assert settings.off_policy_divergence == load_demo_config([])[1].off_policy_divergence
    assert (ON_POLICY_YAML.parent / "assets" / "teacher").samefile(cfg.teacher.path)
    assert isinstance(load_demo_config([])[1], Comparison)


@pytest.mark.parametrize(
    "override, message",
    [
        ("demo.warmup=3", "demo.warmup is not a setting"),
        ("demo.warmup_steps=-1", "demo.warmup_steps is -1"),
        ("demo.warmup_steps=abc", "demo.warmup_steps is 'abc', expected an integer"),
        ("demo.off_policy_divergence=kl", "demo.off_policy_divergence is 'kl'"),
        ("demo.a.b=1", "expected demo.KEY=VALUE"),
    ],
)
def test_a_bad_demo_setting_is_a_one_line_error(override, message):
    with pytest.raises(UserError, match=message) as e:
        load_demo_config([override])
    assert "\n" not in str(e.value)


def test_embedded_on_policy_comparison_runs(tmp_path, capsys):
    out = tmp_path / "demo"
    rc, stdout, err = run_cli(
        capsys, "run", str(ON_POLICY_YAML), f"output.dir={out}", "schedule.steps=3", "schedule.batch_size=2",
        "kd.max_new_tokens=8", "data.seq_len=48", "demo.warmup_steps=2", "demo.heldout_prompts=4",
        "--quiet", "--json",
    )  # fmt: skip
    assert rc == 0, err
    summary = json.loads(stdout)
    table = summary["comparison"]
    assert (
        list(table) == ["teacher", "warm_up", "off_policy", "on_policy"] and summary["heldout_prompts"] == 4
    )
    for row in table.values():
        assert (
            row["tokens"] > 0 and row["teacher_nll"] > 0 and row["reverse_kl"] >= 0 and row["heldout_ce"] > 0
        )
        assert row["reverse_kl_se"] >= 0 and 0 <= row["repeated_4grams"] <= 1
    assert table["teacher"]["reverse_kl"] == pytest.approx(0, abs=1e-5)  # graded by itself
    assert table["teacher"]["draft_alpha"] is None  # the students as the teacher's draft model
    assert all(0 <= table[arm]["draft_alpha"] <= 1 for arm in ("warm_up", "off_policy", "on_policy"))
    assert (
        table["warm_up"]["steps"] == 2
        and table["on_policy"]["steps"] == 3
        and table["off_policy"]["steps"] >= 1
    )
    assert summary["on_policy"]["on_policy_steps"] == 3  # lambda 1: every step of the arm generates
    verdicts = {}
    for key in ("reverse_kl", "teacher_nll"):
        m, se = (
            summary[f"on_policy_minus_off_policy_{key}"]["mean"],
            summary[f"on_policy_minus_off_policy_{key}"]["se"],
        )
        verdicts[key] = summary[f"on_policy_{key}_is"]
        assert verdicts[key] == ("within noise" if abs(m) <= 2 * se else "lower" if m < 0 else "higher")
    assert summary["on_policy_helps"] == (
        verdicts["reverse_kl"] == "lower" and verdicts["teacher_nll"] != "higher"
    )
    assert json.loads((out / "summary.json").read_text()) == summary
    assert (out / "comparison.png").stat().st_size > 0
    assert (out / "warm_up" / "student" / "model.safetensors").exists()
