"""`kdistill generate --out`: the bookkeeping of a resumable answer file under bad input and faults.

- A refused start (a size check) writes nothing: the corrected command then starts the file.
- Weights replaced in place (same names and shapes, other values) are another model: refused in one
  line, whether the files are hashed whole or sampled (large files), even with the old mtime put back.
- Answers that do not fit the prompts (an index beyond them, a duplicate, a complete file with answers
  missing) are one line naming the file's line.
- A real SIGKILL between the last answer and the complete mark, or a file left out of order by one, is
  finished by the next start: in prompt order, marked complete, equal to an uninterrupted run's.
- A deeply nested manifest or answer line, and --samples-per-prompt out of its bounds (alone, or times
  the prompts), are one line.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from kdistill import answer_file, generate
from tests import test_generate
from tests.test_decode import prompts_file
from tests.test_generate import cli

ROOT = Path(__file__).resolve().parents[1]
chat_dir = test_generate.chat_dir  # the tiny chat model of the generate tests (a module fixture)


def _argv(model: Path, msgs: Path, out: Path, *extra: str) -> list[str]:
    return ["--model", str(model), "--messages", str(msgs), "--out", str(out), "--device", "cpu",
            "--max-new-tokens", "4", "--batch-size", "2", "--quiet", *extra]  # fmt: skip


def _one_line(rc: int, err: str) -> str:
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def _copy_model(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for p in src.iterdir():
        if p.is_file():
            (dst / p.name).write_bytes(p.read_bytes())
    return dst


def test_a_refused_start_writes_nothing_and_the_corrected_rerun_starts_the_file(chat_dir, tmp_path, capsys):
    msgs = prompts_file(tmp_path / "p.jsonl", 4)
    out = tmp_path / "a.jsonl"
    rc, _, err = cli(capsys, *_argv(chat_dir, msgs, out, "--max-length", "4"))
    assert "prompt 1 has" in _one_line(rc, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.jsonl"]  # no manifest, no answers, no lock
    rc, _, err = cli(capsys, *_argv(chat_dir, msgs, out))
    assert rc == 0, err
    assert len(out.read_text().splitlines()) == 4


@pytest.mark.parametrize("sampled", [False, True], ids=["hashed_whole", "sampled"])
def test_weights_replaced_in_place_are_refused(chat_dir, tmp_path, capsys, monkeypatch, sampled):
    if sampled:  # every file counts as large: header, mtime and spread chunks identify it
        monkeypatch.setattr(answer_file, "FULL_HASH_BYTES", 0)
    model = _copy_model(chat_dir, tmp_path / "model")
    msgs = prompts_file(tmp_path / "p.jsonl", 3)
    out = tmp_path / "a.jsonl"
    rc, _, err = cli(capsys, *_argv(model, msgs, out))
    assert rc == 0, err
    before = out.read_bytes()
    rc, _, err = cli(capsys, *_argv(model, msgs, out))  # the same weights: nothing to do
    assert rc == 0 and out.read_bytes() == before, err

    weights = model / "model.safetensors"
    stat = weights.stat()
    tensors = load_file(weights)
    save_file({k: v * 1.5 for k, v in tensors.items()}, weights, metadata={"format": "pt"})
    assert weights.stat().st_size == stat.st_size  # same names, shapes and offsets: another content
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # even with the old mtime put back
    rc, _, err = cli(capsys, *_argv(model, msgs, out))
    assert "was written by other weights: model.safetensors of the model changed" in _one_line(rc, err)
    assert out.read_bytes() == before


def _complete(
    chat_dir: Path, tmp_path: Path, capsys, n: int = 4, *extra: str
) -> tuple[Path, Path, list[str]]:
    msgs = prompts_file(tmp_path / "p.jsonl", n)
    out = tmp_path / "a.jsonl"
    rc, _, err = cli(capsys, *_argv(chat_dir, msgs, out, *extra))
    assert rc == 0, err
    return msgs, out, out.read_text().splitlines()


def _set_status(out: Path, status: str) -> None:
    mpath = answer_file.manifest_path(out)
    m = json.loads(mpath.read_text())
    m["status"] = status
    mpath.write_text(json.dumps(m))


@pytest.mark.parametrize(
    ("edit", "status", "message"),
    [
        (lambda rows: rows + [rows[0].replace('"index": 0', '"index": 7', 1)], "running",
         "a.jsonl:5: answer index 7 is outside the 4 prompts"),
        (lambda rows: rows + [rows[0].replace('"index": 0', '"index": ' + "9" * 300, 1)], "running",
         "a.jsonl:5: answer index 9999999999999999999999999999999999999999... is outside the 4 prompts"),
        (lambda rows: rows + [rows[0].replace('"index": 0', '"index": true', 1)], "running",
         'a.jsonl:5: expected an answer with integer "index" and "sample"'),
        (lambda rows: rows + [rows[1]], "running", "a.jsonl:5: a second answer of prompt 1 sample 0"),
        (lambda rows: rows[:1] + rows[2:], "complete",
         "marked complete but 1 of its 4 answers are missing (the first: prompt 1 sample 0)"),
        (lambda rows: [rows[0].replace('"sample": 0', '"sample": 3', 1)] + rows[1:], "running",
         "a.jsonl:1: answer sample 3 is outside 0..0"),
    ],
    ids=["beyond_the_prompts", "huge_index", "boolean_index", "duplicate", "gap_in_a_complete_file", "sample_beyond"],
)  # fmt: skip
def test_answers_that_do_not_fit_the_prompts_are_one_line(chat_dir, tmp_path, capsys, edit, status, message):
    msgs, out, rows = _complete(chat_dir, tmp_path, capsys)
    assert all('"index": ' in r and '"sample": ' in r for r in rows)
    out.write_text("".join(r + "\n" for r in edit(rows)))
    _set_status(out, status)
    before = out.read_bytes()
    rc, _, err = cli(capsys, *_argv(chat_dir, msgs, out))
    assert message in _one_line(rc, err)
    assert out.read_bytes() == before


@pytest.mark.parametrize("point", ["generate.rewrite", "generate.mark"])
def test_a_kill_between_the_last_answer_and_the_complete_mark_is_finished_by_the_rerun(
    chat_dir, tmp_path, capsys, point
):
    msgs = prompts_file(tmp_path / "p.jsonl", 6)
    out, ref = tmp_path / "a.jsonl", tmp_path / "ref.jsonl"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "KDISTILL_TEST_KILL_AT": point}
    proc = subprocess.run(
        [sys.executable, "-m", "kdistill", "generate", *_argv(chat_dir, msgs, out)],
        env=env,
        capture_output=True,
    )
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]  # a real SIGKILL at that point
    assert json.loads(answer_file.manifest_path(out).read_text())["status"] == "running"
    assert len(out.read_text().splitlines()) == 6
    rc, _, err = cli(capsys, *_argv(chat_dir, msgs, out))
    assert rc == 0, err
    rc, _, err = cli(capsys, *_argv(chat_dir, msgs, ref))
    assert rc == 0, err
    assert out.read_text() == ref.read_text()
    m = json.loads(answer_file.manifest_path(out).read_text())
    assert m["status"] == "complete" and m["written"] == 6


def test_a_file_left_out_of_order_by_a_kill_is_put_in_order_before_it_is_marked_complete(
    chat_dir, tmp_path, capsys
):
    """Exactly the state a kill after the last chunk leaves when answers finished out of order: every
    answer written, shuffled, the manifest still running."""
    msgs, out, rows = _complete(chat_dir, tmp_path, capsys, 6, "--samples-per-prompt", "2")
    shuffled = rows[:]
    random.Random(0).shuffle(shuffled)
    assert shuffled != rows
    out.write_text("".join(r + "\n" for r in shuffled))
    _set_status(out, "running")
    rc, _, err = cli(capsys, *_argv(chat_dir, msgs, out, "--samples-per-prompt", "2"))
    assert rc == 0, err
    assert out.read_text().splitlines() == rows
    assert json.loads(answer_file.manifest_path(out).read_text())["status"] == "complete"


@pytest.mark.parametrize("where", ["manifest", "answer"])
def test_a_deeply_nested_manifest_or_answer_line_is_one_line(chat_dir, tmp_path, capsys, where):
    msgs, out, rows = _complete(chat_dir, tmp_path, capsys)
    nested = "[" * 100_000 + "]" * 100_000
    if where == "manifest":
        answer_file.manifest_path(out).write_text(nested)
        expected = "unreadable manifest"
    else:
        out.write_text("".join(r + "\n" for r in rows[:2]) + nested + "\n")
        _set_status(out, "running")
        expected = "a.jsonl:3: not a JSON answer line"
    rc, _, err = cli(capsys, *_argv(chat_dir, msgs, out))
    assert expected in _one_line(rc, err) and len(err) < 400


@pytest.mark.parametrize(
    ("samples", "to_file"), [("1025", True), (str(10**12), True), ("1025", False), ("0", True)]
)
def test_samples_per_prompt_out_of_its_bounds_is_one_line_before_anything_is_read(
    tmp_path, capsys, samples, to_file
):
    msgs = prompts_file(tmp_path / "p.jsonl", 2)
    where = ["--out", str(tmp_path / "a.jsonl")] if to_file else ["--json"]
    rc, _, err = cli(capsys, "--model", str(tmp_path / "nowhere"), "--messages", str(msgs), *where,
                     "--device", "cpu", "--samples-per-prompt", samples)  # fmt: skip
    assert "--samples-per-prompt is" in _one_line(rc, err) and "expected an integer from 1 to 1024" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.jsonl"]


@pytest.mark.parametrize("to_file", [True, False])
def test_too_many_answers_in_all_is_one_line(chat_dir, tmp_path, capsys, monkeypatch, to_file):
    monkeypatch.setattr(generate, "MAX_ANSWERS", 10)  # the bound, made small: 4 prompts x 3 samples
    msgs = prompts_file(tmp_path / "p.jsonl", 4)
    where = ["--out", str(tmp_path / "a.jsonl")] if to_file else ["--json"]
    rc, _, err = cli(capsys, "--model", str(chat_dir), "--messages", str(msgs), *where, "--device", "cpu",
                     "--samples-per-prompt", "3")  # fmt: skip
    assert "--samples-per-prompt 3 x 4 prompts is 12 answers, expected at most 10" in _one_line(rc, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.jsonl"]
