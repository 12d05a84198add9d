"""`kdistill data preview`: packed conversation rows with the learned tokens marked, or as JSON; every
bad input is one line and exit code 2."""

from __future__ import annotations

import json

from tests.chat_tiny import make_chat_model_dir
from tests.test_train_kit import run_cli

CHATS = [
    {"messages": [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "Paris"}]},
    {"prompt": "What is two plus two?", "completion": "Two plus two is four."},
]


def _files(tmp_path):
    model = make_chat_model_dir(tmp_path, "qwen2.5")
    a = tmp_path / "a.jsonl"
    a.write_text(json.dumps(CHATS[0]) + "\n" + json.dumps(CHATS[0]) + "\n", encoding="utf-8")
    return model, a


def test_preview_marks_the_answers_and_their_end_of_turn(tmp_path, capsys):
    model, data = _files(tmp_path)
    rc, out, err = run_cli(capsys, "data", "preview", "--model", str(model), "--data", str(data), "-n", "1")
    assert rc == 0, err
    assert "[[Paris<|im_end|>]]" in out
    assert "conversation 2" in out and "packing efficiency" in out
    assert "[[" not in out.split("user\n")[1].split("Hello there")[0]  # the prompt is not learned


def test_preview_json_gives_ids_masked_labels_and_boundaries(tmp_path, capsys):
    model, data = _files(tmp_path)
    rc, out, err = run_cli(
        capsys, "data", "preview", "--model", str(model), "--data", str(data), "--json", "--seq-len", "256"
    )
    assert rc == 0, err
    doc = json.loads(out)
    (row,) = doc["rows"]
    ids, labels = row["input_ids"], row["labels"]
    assert len(ids) == len(labels) == 256
    learned = [i for i, y in enumerate(labels) if y != -100]
    assert learned and all(labels[i] == ids[i + 1] for i in learned)
    a, b = row["conversations"][0]["start"], row["conversations"][0]["end"]
    assert row["conversations"][1]["start"] == b and a == 0
    assert labels[b - 1] == -100  # a conversation's last token never predicts the next one's first
    assert row["cu_seqlens"][:3] == [0, b, row["conversations"][1]["end"]]
    assert 0 < doc["packing_efficiency"] <= 1


def test_preview_errors_are_one_line(tmp_path, capsys):
    model, data = _files(tmp_path)
    text = tmp_path / "notes.txt"
    text.write_text("plain\n", encoding="utf-8")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(CHATS[0]) + "\n" + '{"messages": [{"role": "bot", "content": "x"}]}\n')
    cases = [
        (["--model", str(tmp_path / "missing"), "--data", str(data)], "missing"),
        (["--model", str(model), "--data", str(text)], "not a conversation file"),
        (["--model", str(model), "--data", str(bad)], "bad.jsonl:2"),
        (["--model", str(model), "--data", str(data), "-n", "0"], "-n is 0"),
        (["--model", str(model), "--data", str(data), "--train-on", "users"], "--train-on"),
        (
            ["--model", str(model), "--data", str(data), "--template-kwargs", "3"],
            "--template-kwargs is not a JSON",
        ),
        (
            ["--model", str(model), "--data", str(data), "--template-kwargs", "{"],
            "--template-kwargs is not valid",
        ),
        (
            ["--model", str(model), "--data", str(data), "--template-kwargs", '{"messages": []}'],
            "--template-kwargs has key 'messages'",
        ),
        (
            ["--model", str(model), "--data", str(data), "--chat-template", "x.jinja"],
            "--chat-template: x.jinja",
        ),
        (["--model", str(model), "--data", str(tmp_path / "nope.jsonl")], "nope.jsonl"),
    ]
    for argv, needle in cases:
        rc, out, err = run_cli(capsys, "data", "preview", *argv)
        lines = err.strip().splitlines()
        assert rc == 2 and len(lines) == 1 and needle in lines[0], (argv, err)
    rc, _, err = run_cli(capsys, "data")
    assert rc == 2 and "preview" in err
