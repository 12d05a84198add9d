"""kdistill.models.tokenizer: loading tokenizer.json, identity, EOS lookup, encode/decode, one-line errors."""

from __future__ import annotations

import json
import shutil

import pytest

from kdistill.errors import UserError
from kdistill.models.tokenizer import load_tokenizer
from tests.tiny import SPECIAL_TOKENS, make_tokenizer


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    make_tokenizer(d, vocab_size=320)
    return d


def _copy(src, dst):
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copy(src / "tokenizer.json", dst / "tokenizer.json")
    return dst


def test_load_from_dir_and_file(tok_dir):
    a = load_tokenizer(tok_dir)
    b = load_tokenizer(tok_dir / "tokenizer.json")
    assert a.vocab_size == b.vocab_size == 320  # 256 bytes + merges + 2 special tokens
    assert a.identity == b.identity and len(a.identity) == 64
    assert a.eos_id == a.token_to_id("<|endoftext|>")


def test_encode_decode_without_special_tokens(tok_dir):
    tok = load_tokenizer(tok_dir)
    text = "the quick brown fox, café 東京"
    ids = tok.encode(text)
    assert ids and all(isinstance(i, int) for i in ids)
    assert tok.decode(ids) == text
    assert tok.eos_id not in ids
    assert tok.encode_batch([text, "dog"]) == [ids, tok.encode("dog")]
    assert tok.encode("") == []


def test_identity_ignores_formatting(tok_dir, tmp_path):
    data = json.loads((tok_dir / "tokenizer.json").read_text())
    # Same content: other indentation, reversed key order, merges spelled as "a b" strings.
    model = data["model"]
    model["vocab"] = dict(reversed(list(model["vocab"].items())))
    model["merges"] = [" ".join(m) if isinstance(m, list) else m for m in model["merges"]]
    d = tmp_path / "reformatted"
    d.mkdir()
    (d / "tokenizer.json").write_text(json.dumps(dict(reversed(list(data.items()))), indent=4))
    assert load_tokenizer(d).identity == load_tokenizer(tok_dir).identity


def test_identity_changes_with_content(tok_dir, tmp_path):
    data = json.loads((tok_dir / "tokenizer.json").read_text())
    data["model"]["merges"] = data["model"]["merges"][:-1]
    last = max(data["model"]["vocab"], key=data["model"]["vocab"].get)
    del data["model"]["vocab"][last]
    d = tmp_path / "other"
    d.mkdir()
    (d / "tokenizer.json").write_text(json.dumps(data))
    assert load_tokenizer(d).identity != load_tokenizer(tok_dir).identity
    other = tmp_path / "other_trained"
    make_tokenizer(other, vocab_size=300)
    assert load_tokenizer(other).identity != load_tokenizer(tok_dir).identity


def test_eos_sources(tok_dir, tmp_path):
    base = load_tokenizer(tok_dir)
    pad = base.token_to_id("<|pad|>")
    # tokenizer_config.json's eos_token wins (string or dict form)
    d = _copy(tok_dir, tmp_path / "cfg")
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|pad|>"}}))
    assert load_tokenizer(d).eos_id == pad
    # config.json's eos_token_id (a list: the first)
    d = _copy(tok_dir, tmp_path / "model_cfg")
    (d / "config.json").write_text(json.dumps({"eos_token_id": [pad, 0]}))
    assert load_tokenizer(d).eos_id == pad
    # no side files: a known token name
    d = _copy(tok_dir, tmp_path / "bare")
    assert load_tokenizer(d).eos_id == base.token_to_id("<|endoftext|>")


def test_no_eos(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tk = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.save(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(tmp_path)
    assert tok.eos_id is None and tok.vocab_size == 3
    assert tok.encode("a b a") == [0, 1, 0]


def test_special_tokens_counted(tok_dir):
    tok = load_tokenizer(tok_dir)
    for t in SPECIAL_TOKENS:
        assert tok.token_to_id(t) is not None and tok.token_to_id(t) < tok.vocab_size


@pytest.mark.parametrize(
    "content,expect",
    [
        (None, "no tokenizer.json"),
        (b"", "not valid JSON"),
        (b"{not json", "not valid JSON"),
        (b"[1, 2]", "no 'model' object"),
        (b'{"model": {"type": "Nope"}}', "not a valid tokenizer.json"),
        (b"\xff\xfe{}", "not UTF-8"),
    ],
)
def test_missing_or_corrupt_is_one_line_error(tmp_path, content, expect):
    if content is not None:
        (tmp_path / "tokenizer.json").write_bytes(content)
    with pytest.raises(UserError) as e:
        load_tokenizer(tmp_path)
    msg = str(e.value)
    assert expect in msg
    assert "\n" not in msg
    assert str(tmp_path) in msg


def test_missing_path(tmp_path):
    with pytest.raises(UserError, match="no such tokenizer file or model directory"):
        load_tokenizer(tmp_path / "nope")


def test_truncated_tokenizer_json(tok_dir, tmp_path):
    raw = (tok_dir / "tokenizer.json").read_bytes()
    (tmp_path / "tokenizer.json").write_bytes(raw[: len(raw) // 2])
    with pytest.raises(UserError, match="not valid JSON"):
        load_tokenizer(tmp_path)
