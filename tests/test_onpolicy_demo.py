"""The embedded on-policy comparison (`kdistill run src/kdistill/demo/on_policy.yaml`), shortened: both
students train, the off-policy one for the on-policy run's training time, and both are graded by the
teacher on their own greedy completions of held-out prompts."""

from __future__ import annotations

import json

from kdistill.demo.onpolicy import ON_POLICY_YAML, write_conversations
from tests.test_train_kit import run_cli


def test_prompts_are_a_files_first_lines_and_completions_the_next(tmp_path):
    src = tmp_path / "a.py"
    src.write_text("".join(f"line {i}\n" for i in range(30)))
    (tmp_path / "short.py").write_text("x = 1\n")
    rows = write_conversations([str(src), str(tmp_path / "short.py")], tmp_path / "out.jsonl")
    assert rows == [
        {
            "prompt": "".join(f"line {i}\n" for i in range(6)),
            "completion": "".join(f"line {i}\n" for i in range(6, 16)),
        }
    ]
    assert [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()] == rows


def test_embedded_on_policy_comparison_runs(tmp_path, capsys):
    out = tmp_path / "demo"
    rc, stdout, err = run_cli(
        capsys, "run", str(ON_POLICY_YAML), f"output.dir={out}", "schedule.steps=3", "schedule.batch_size=2",
        "kd.max_new_tokens=8", "data.seq_len=48", "kd.on_policy=1", "--quiet", "--json",
    )  # fmt: skip
    assert rc == 0, err
    summary = json.loads(stdout)
    table = summary["comparison"]
    assert set(table) == {"on_policy", "off_policy"} and summary["heldout_prompts"] > 0
    for row in table.values():
        assert (
            row["tokens"] > 0 and row["teacher_nll"] > 0 and row["reverse_kl"] >= 0 and row["heldout_ce"] > 0
        )
    assert table["on_policy"]["steps"] == 3 and table["off_policy"]["steps"] >= 1
    assert summary["on_policy"]["on_policy_steps"] == 3  # at lambda 1 probe steps time the data steps
    assert json.loads((out / "summary.json").read_text()) == summary
