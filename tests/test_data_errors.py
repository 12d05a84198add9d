"""Bad data inputs: each is one UserError line naming the file/line and what was expected, through the API
(prepare_data) and through `kdistill eval` (exit 2, `kdistill: error: ...` on stderr, no traceback)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from kdistill import data as D
from kdistill.cli import main
from kdistill.config import DataConfig
from kdistill.data import binfmt, sources
from kdistill.errors import UserError
from kdistill.models.tokenizer import load_tokenizer
from tests.tiny import make_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("m"), family="qwen2", tokenizer_vocab=320)


@pytest.fixture(scope="module")
def tok(model_dir):
    return load_tokenizer(model_dir)


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KDISTILL_CACHE_DIR", str(tmp_path / "cache"))


def _write(path, content):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return path


def _u16(tokens):
    return np.asarray(tokens, dtype="<u2").tobytes()


# name -> (file name, content or None for a missing path / "dir" for an empty directory, expected fragments)
CASES = {
    "missing_path": ("nope.txt", None, ["nope.txt: no such file or directory"]),
    "empty_directory": ("emptydir", "dir", ["empty directory"]),
    "empty_file": ("empty.txt", b"", ["empty.txt: empty file (empty dataset)"]),
    "whitespace_only": ("ws.txt", " \n\t\n  \r\n", ["ws.txt: whitespace-only text"]),
    "jsonl_all_blank": ("blank.jsonl", '\n{"text": "  "}\n\n', ["blank.jsonl", "every line is blank"]),
    "non_utf8_text": ("latin1.txt", b"caf" + b"\xe9 au lait", ["latin1.txt: not UTF-8", "offset 3"]),
    "jsonl_not_json": (
        "bad.jsonl",
        '{"text": "a"}\n{"text": "b"}\n{"text": oops}\n',
        ["bad.jsonl line 3: not valid JSON"],
    ),
    "jsonl_no_field": (
        "nofield.jsonl",
        '{"content": "a"}\n',
        ["nofield.jsonl line 1: no 'text' or 'input_ids' field"],
    ),
    "jsonl_field_missing_later": (
        "later.jsonl",
        '{"text": "a"}\n\n{"body": "b"}\n',
        ["later.jsonl line 3: no 'text' field"],
    ),
    "jsonl_not_object": (
        "arr.jsonl",
        '["text", "a"]\n',
        ["arr.jsonl line 1: expected a JSON object", "got a JSON array"],
    ),
    "jsonl_text_not_string": ("num.jsonl", '{"text": 42}\n', ["num.jsonl line 1: 'text' is a JSON number"]),
    "jsonl_ids_not_ints": ("f.jsonl", '{"input_ids": [1, 2.5]}\n', ["f.jsonl line 1: 'input_ids' holds 2.5"]),
    "jsonl_ids_not_list": (
        "s.jsonl",
        '{"input_ids": "1 2 3"}\n',
        ["s.jsonl line 1: 'input_ids' is a JSON string"],
    ),
    "jsonl_id_too_large": (
        "big.jsonl",
        '{"input_ids": [1, 2]}\n{"input_ids": [3, 100000]}\n',
        ["big.jsonl line 2: token id 100000 >= vocab size 320"],
    ),
    "jsonl_id_negative": (
        "neg.jsonl",
        '{"input_ids": [1, -4]}\n',
        ["neg.jsonl line 1: token id -4 is negative"],
    ),
    "jsonl_non_utf8": (
        "u.jsonl",
        b'{"text": "ok"}\n{"text": "\xff"}\n',
        ["u.jsonl line 2: not UTF-8", "offset 25"],
    ),
    "jsonl_surrogate": (
        "sur.jsonl",
        '{"text": "a\\ud800b"}\n',
        ["sur.jsonl line 1: 'text' holds an unpaired surrogate"],
    ),
    "jsonl_too_deep": ("deep.jsonl", "[" * 100000 + "\n", ["deep.jsonl line 1: not valid JSON"]),
    "bin_unknown_width": ("raw.bin", _u16([1, 2, 3]), ["raw.bin: unknown token width", "*.u16.bin"]),
    "bin_truncated": (
        "odd.u16.bin",
        _u16([1, 2, 3]) + b"\x01",
        ["odd.u16.bin", "not a whole number of 2-byte tokens"],
    ),
    "bin_id_too_large": (
        "hi.u16.bin",
        _u16([1, 2, 5000]),
        ["hi.u16.bin: token id 5000 at position 2 >= vocab size 320"],
    ),
    "bin_empty": ("e.u32.bin", b"", ["e.u32.bin: no tokens (empty shard)"]),
    "bin_bad_header": (
        "h.bin",
        b"KDTOKENS" + b"\x01\x00\x00\x00\x03\x00\x00\x00" + b"\x00" * 6,
        ["h.bin: KDTOKENS token width 3 bytes"],
    ),
    "bin_llmc_count": (
        "l.bin",
        np.array([binfmt.LLMC_MAGIC, 1, 99] + [0] * 253, "<i4").tobytes() + _u16([1, 2]),
        ["l.bin: llm.c header says 99 tokens"],
    ),
    "glob_no_match": ("nothing/*.txt", None, ["pattern", "matches no files"]),
}


def _make(tmp_path, case):
    name, content, expect = CASES[case]
    path = tmp_path / "data" / name
    if content == "dir":
        path.mkdir(parents=True)
    elif content is not None:
        _write(path, content)
    return path, expect


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_api(tok, tmp_path, case):
    path, expect = _make(tmp_path, case)
    with pytest.raises(UserError) as e:
        D.prepare_data(DataConfig(train=[str(path)], seq_len=8), tok)
    msg = str(e.value)
    assert "\n" not in msg
    for fragment in expect:
        assert fragment in msg, msg


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_cli(model_dir, tmp_path, capsys, case):
    path, expect = _make(tmp_path, case)
    rc = main(["eval", "--model", str(model_dir), "--data", str(path), "--seq-len", "8", "--device", "cpu"])
    err = capsys.readouterr().err
    assert rc == 2
    expect = [f.replace("vocab size 320", "vocab size") for f in expect]
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kdistill: error: "), err
    assert "Traceback" not in err
    for fragment in expect:
        assert fragment in err, err


def test_line_too_long(tok, tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "MAX_LINE_BYTES", 64)
    p = _write(tmp_path / "long.jsonl", '{"text": "short"}\n' + json.dumps({"text": "x" * 200}) + "\n")
    with pytest.raises(UserError, match="long.jsonl line 2: longer than"):
        D.prepare_data(DataConfig(train=[str(p)], seq_len=4), tok)


def test_non_utf8_offset_across_blocks(tok, tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "TEXT_BLOCK_BYTES", 5)
    raw = "héllo wörld ".encode() * 3 + b"\xc3(" + b" tail"
    p = _write(tmp_path / "x.txt", raw)
    bad_at = raw.index(b"\xc3(")
    with pytest.raises(UserError, match=f"offset {bad_at}"):
        D.prepare_data(DataConfig(train=[str(p)], seq_len=4), tok)


def test_too_little_data_for_one_sequence(tok, tmp_path):
    p = _write(tmp_path / "short.txt", "a few words")
    with pytest.raises(UserError, match=r"need at least seq_len \+ 1 = 513"):
        D.prepare_data(DataConfig(train=[str(p)], seq_len=512, heldout_fraction=0.0), tok)


def test_empty_heldout_when_required(tok, tmp_path):
    p = _write(tmp_path / "one.txt", "one document only, so nothing can be held out " * 20)
    cfg = DataConfig(train=[str(p)], seq_len=8, heldout_fraction=0.1)
    with pytest.raises(UserError, match="held-out side has 0 tokens.*give data.heldout paths"):
        D.prepare_data(cfg, tok)
    out = D.prepare_data(cfg, tok, require_heldout=False)
    assert out.heldout.shape == (0, 9) and out.train.shape[0] > 0
    out = D.prepare_data(DataConfig(train=[str(p)], seq_len=8, heldout_fraction=0.0), tok)
    assert out.heldout.shape == (0, 9)


def test_empty_train_list(tok):
    with pytest.raises(UserError, match="data.train is empty"):
        D.prepare_data(DataConfig(train=[], seq_len=8), tok)


def test_undecodable_files_in_directories_can_be_skipped(tok, tmp_path):
    _write(tmp_path / "d" / "good.txt", "fine text here " * 20)
    _write(tmp_path / "d" / "bad.txt", b"\xff\xfe binary")
    cfg = DataConfig(train=[str(tmp_path / "d")], seq_len=8, heldout_fraction=0.0)
    with pytest.raises(UserError, match="bad.txt: not UTF-8"):
        D.prepare_data(cfg, tok)
    out = D.prepare_data(cfg, tok, skip_undecodable=True)
    assert out.stats["skipped_documents"] == 1 and out.stats["files"] == 1


@pytest.mark.parametrize(
    "extra,expect",
    [
        (["--seq-len", "0"], "--seq-len is 0"),
        (["--batch-size", "0"], "--batch-size is 0"),
        (["--max-tokens", "0"], "--max-tokens is 0"),
        (["--seq-len", "100000"], "exceeds the model's max_position_embeddings"),
    ],
)
def test_eval_argument_errors(model_dir, tmp_path, capsys, extra, expect):
    p = _write(tmp_path / "t.txt", "some text for the model " * 10)
    rc = main(["eval", "--model", str(model_dir), "--data", str(p), "--device", "cpu", *extra])
    err = capsys.readouterr().err
    assert (
        rc == 2
        and err.startswith("kdistill: error: ")
        and expect in err
        and len(err.strip().splitlines()) == 1
    )


def test_eval_missing_model(tmp_path, capsys):
    p = _write(tmp_path / "t.txt", "text")
    rc = main(["eval", "--model", str(tmp_path / "no_model"), "--data", str(p)])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("kdistill: error: ") and "no_model" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_eval_cuda_without_gpu(model_dir, tmp_path, capsys):
    p = _write(tmp_path / "t.txt", "text " * 50)
    rc = main(["eval", "--model", str(model_dir), "--data", str(p), "--device", "cuda"])
    assert rc == 2 and "no CUDA GPU" in capsys.readouterr().err
