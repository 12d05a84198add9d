"""kdistill.data: readers, packing with EOS, the held-out split, the token cache, batches.

Bad inputs (each a one-line UserError) are in tests/test_data_errors.py; fuzzing in test_fuzz_data.py.
"""

from __future__ import annotations

import io
import json
import random
import struct

import numpy as np
import pytest
import torch

from kdistill import data as D
from kdistill.config import DataConfig
from kdistill.data import binfmt, sources
from kdistill.errors import UserError
from kdistill.models.tokenizer import load_tokenizer
from tests.tiny import corpus_text, make_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_tokenizer(make_tokenizer(tmp_path_factory.mktemp("tok"), vocab_size=320))


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KDISTILL_CACHE_DIR", str(tmp_path / "cache"))


def _cfg(train, seq_len=16, **kw):
    return DataConfig(train=[str(p) for p in train], seq_len=seq_len, **kw)


def _jsonl_ids(path, docs):
    path.write_text("".join(json.dumps({"input_ids": list(map(int, d))}) + "\n" for d in docs))
    return path


# -- readers -------------------------------------------------------------------------------------


def test_text_file_is_one_document(tok, tmp_path):
    text = corpus_text(300, seed=1)
    (tmp_path / "a.md").write_text("\ufeff" + text, encoding="utf-8")
    files, skipped = D.load_files([tmp_path / "a.md"], tok, D.TokenCache(None))
    assert len(files) == 1 and skipped == 0
    docs = files[0].docs
    assert docs.num_docs == 1
    assert docs.doc(0).tolist() == tok.encode(text)  # BOM dropped, no special tokens


def test_text_blocks_cut_at_newlines_and_multibyte(tok, monkeypatch):
    monkeypatch.setattr(sources, "TEXT_BLOCK_BYTES", 7)  # cuts inside multi-byte characters
    text = "héllo 東京\nwörld 🙂 café\n" * 20 + "no newline at end " * 5
    docs = D.read_text(io.BytesIO(text.encode()), "x.txt", tok)
    assert tok.decode(docs.doc(0).tolist()) == text


def test_directory_recursive_sorted_each_file_a_document(tok, tmp_path):
    root = tmp_path / "corpus"
    (root / "sub" / "deeper").mkdir(parents=True)
    (root / ".git").mkdir()
    (root / "__pycache__").mkdir()
    (root / "b.py").write_text("def b():\n    return 2\n")
    (root / "a.txt").write_text("alpha text\n")
    (root / "sub" / "c.md").write_text("# gamma\n")
    (root / "sub" / "deeper" / "d.jsonl").write_text('{"text": "delta one"}\n\n{"text": "delta two"}\n')
    (root / "sub" / "empty.py").write_text("  \n")
    (root / ".hidden").write_text("skip me")
    (root / ".git" / "HEAD").write_text("ref")
    (root / "__pycache__" / "x.pyc").write_bytes(b"\x00\xff\xfe")
    specs = D.expand_paths([root])
    assert [s.key for s in specs] == ["a.txt", "b.py", "sub/c.md", "sub/deeper/d.jsonl", "sub/empty.py"]
    assert [s.kind for s in specs] == ["text", "text", "text", "jsonl", "text"]
    files, skipped = D.load_files([root], tok, D.TokenCache(None))
    assert skipped == 1  # the whitespace-only file
    keys = [f.key(i) for f in files for i in range(f.docs.num_docs)]
    assert keys == ["a.txt", "b.py", "sub/c.md", "sub/deeper/d.jsonl:1", "sub/deeper/d.jsonl:3"]
    assert files[0].docs.doc(0).tolist() == tok.encode("alpha text\n")
    assert files[3].docs.doc(1).tolist() == tok.encode("delta two")


def test_glob(tok, tmp_path):
    (tmp_path / "p" / "q").mkdir(parents=True)
    (tmp_path / "p" / "one.py").write_text("x = 1\n")
    (tmp_path / "p" / "q" / "two.py").write_text("y = 2\n")
    (tmp_path / "p" / "q" / "skip.txt").write_text("no\n")
    specs = D.expand_paths([str(tmp_path / "p" / "**" / "*.py")])
    assert [s.key for s in specs] == ["one.py", "q/two.py"]


def test_jsonl_text_and_input_ids(tok, tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text('{"text": "first line", "id": 1}\n\n   \n{"text": ""}\n{"text": "third"}\n')
    docs = D.read_jsonl(open(p, "rb"), str(p), tok)
    assert docs.num_docs == 2 and docs.skipped == 1
    assert docs.ordinals.tolist() == [1, 5]
    assert docs.doc(0).tolist() == tok.encode("first line") and docs.doc(1).tolist() == tok.encode("third")
    q = _jsonl_ids(tmp_path / "i.jsonl", [[1, 2, 3], [319, 0]])
    docs = D.read_jsonl(open(q, "rb"), str(q), tok)
    assert [docs.doc(i).tolist() for i in range(2)] == [[1, 2, 3], [319, 0]]


@pytest.mark.parametrize("layout", ["kdtokens16", "kdtokens32", "llmc16", "llmc32", "raw16", "raw32"])
def test_bin_layouts(tok, tmp_path, layout):
    eos = tok.eos_id
    toks = [5, 6, 7, eos, 8, 9, eos, eos, 10]
    width = 4 if layout.endswith("32") else 2
    dt = "<u4" if width == 4 else "<u2"
    payload = np.asarray(toks, dtype=dt).tobytes()
    if layout.startswith("kdtokens"):
        p = D.write_bin(tmp_path / "s.bin", toks, width=width)
    elif layout.startswith("llmc"):
        header = np.zeros(256, dtype="<i4")
        header[:3] = [binfmt.LLMC_MAGIC, 1 if width == 2 else 2, len(toks)]
        p = tmp_path / "s.bin"
        p.write_bytes(header.tobytes() + payload)
    else:
        p = tmp_path / f"s.u{8 * width}.bin"
        p.write_bytes(payload)
    docs = D.read_bin(p, str(p), tok.vocab_size, eos)
    assert [docs.doc(i).tolist() for i in range(docs.num_docs)] == [[5, 6, 7], [8, 9], [10]]
    assert docs.ordinals.tolist() == [0, 1, 3] and docs.skipped == 1
    assert D.read_bin(p, str(p), tok.vocab_size, None).num_docs == 1


def test_bin_width_detected_from_header_not_suffix(tok, tmp_path):
    p = D.write_bin(tmp_path / "s.u16.bin", [1, 2, 3], width=4)  # header wins over the suffix
    assert D.read_bin(p, str(p), tok.vocab_size, None).doc(0).tolist() == [1, 2, 3]


# -- packing and split -------------------------------------------------------------------------


def test_pack_with_eos_between_documents(tok, tmp_path):
    docs = [[10, 11, 12], [20, 21], [30, 31, 32, 33, 34, 35, 36]]
    p = _jsonl_ids(tmp_path / "ids.jsonl", docs)
    out = D.prepare_data(_cfg([p], seq_len=4, heldout_fraction=0.0), tok)
    e = tok.eos_id
    stream = [10, 11, 12, e, 20, 21, e, 30, 31, 32, 33, 34, 35, 36, e]
    assert out.train.dtype == np.int64 and out.train.shape == (3, 5)
    assert out.train.tolist() == [stream[0:5], stream[4:9], stream[8:13]]  # stride seq_len
    assert out.stats["train_tokens"] == 15 and out.stats["train_dropped_tokens"] == 2
    assert out.heldout.shape == (0, 5) and out.stats["heldout_sequences"] == 0
    assert "15 train tokens" in out.summary()


def test_split_is_deterministic_by_document(tok, tmp_path):
    docs = [[1 + (i % 50)] * (3 + i % 7) for i in range(400)]
    p = _jsonl_ids(tmp_path / "many.jsonl", docs)
    cfg = _cfg([p], seq_len=8, heldout_fraction=0.25)
    a, b = D.prepare_data(cfg, tok), D.prepare_data(cfg, tok)
    assert np.array_equal(a.train, b.train) and np.array_equal(a.heldout, b.heldout)
    frac = a.stats["heldout_documents"] / 400
    assert 0.15 < frac < 0.35
    assert a.stats["train_documents"] + a.stats["heldout_documents"] == 400
    assert a.stats["train_tokens"] + a.stats["heldout_tokens"] == sum(len(d) + 1 for d in docs)
    other = D.prepare_data(cfg, tok, seed=1)
    assert not np.array_equal(a.heldout, other.heldout)  # the seed salts the hash


def test_split_keys_independent_of_location_and_order(tok, tmp_path):
    texts = {f"f{i}.txt": corpus_text(40, seed=i) for i in range(30)}
    for folder in ("one", "two"):
        (tmp_path / folder).mkdir()
        for name, t in texts.items():
            (tmp_path / folder / name).write_text(t)
    cfg = _cfg([tmp_path / "one"], heldout_fraction=0.3)
    moved = _cfg([tmp_path / "two"], heldout_fraction=0.3)
    assert np.array_equal(D.prepare_data(cfg, tok).heldout, D.prepare_data(moved, tok).heldout)
    held = {k for k in texts if D.split_score(k) < 0.3}
    files = [tmp_path / "one" / k for k in reversed(sorted(texts))]  # given directly, reversed order
    r = D.prepare_data(_cfg(files, heldout_fraction=0.3), tok)
    assert r.stats["heldout_documents"] == len(held)


def test_explicit_heldout_paths(tok, tmp_path):
    a = _jsonl_ids(tmp_path / "a.jsonl", [[1, 2, 3, 4, 5, 6, 7, 8]] * 3)
    b = _jsonl_ids(tmp_path / "b.jsonl", [[9, 9, 8, 8, 7, 7]] * 2)
    cfg = DataConfig(train=[str(a)], heldout=[str(b)], seq_len=4, heldout_fraction=0.5)
    out = D.prepare_data(cfg, tok)
    assert out.stats["split"] == "paths"
    assert out.stats["train_documents"] == 3 and out.stats["heldout_documents"] == 2
    assert set(np.unique(out.heldout).tolist()) <= {7, 8, 9, tok.eos_id}


def test_few_documents_still_give_a_heldout_side(tok, tmp_path):
    p = _jsonl_ids(tmp_path / "two.jsonl", [list(range(1, 40)), list(range(40, 80))])
    out = D.prepare_data(_cfg([p], seq_len=8, heldout_fraction=0.01), tok)
    assert out.stats["heldout_documents"] == 1 and out.stats["train_documents"] == 1


def test_max_tokens_caps_training_tokens(tok, tmp_path):
    p = _jsonl_ids(tmp_path / "m.jsonl", [list(range(1, 100))] * 10)
    out = D.prepare_data(_cfg([p], seq_len=8, heldout_fraction=0.0, max_tokens=50), tok)
    assert out.stats["train_tokens"] == 50 and out.train.shape == (6, 9)


# -- cache ------------------------------------------------------------------------------------


def test_cache_hit_and_invalidation(tok, tmp_path):
    (tmp_path / "d").mkdir()
    for i in range(3):
        (tmp_path / "d" / f"{i}.txt").write_text(corpus_text(60, seed=i))
    cfg = _cfg([tmp_path / "d"], heldout_fraction=0.0)
    first = D.prepare_data(cfg, tok)
    assert first.stats["cache_misses"] == 3 and first.stats["cache_hits"] == 0
    second = D.prepare_data(cfg, tok)
    assert second.stats["cache_hits"] == 3 and second.stats["cache_misses"] == 0
    assert np.array_equal(first.train, second.train)
    # a changed file is re-tokenized, the others still hit
    (tmp_path / "d" / "1.txt").write_text(corpus_text(60, seed=99))
    third = D.prepare_data(cfg, tok)
    assert third.stats["cache_hits"] == 2 and third.stats["cache_misses"] == 1
    assert not np.array_equal(first.train, third.train)
    # another tokenizer: every file is re-tokenized
    other = load_tokenizer(make_tokenizer(tmp_path / "tok2", vocab_size=300))
    assert other.identity != tok.identity
    fourth = D.prepare_data(cfg, other)
    assert fourth.stats["cache_misses"] == 3


@pytest.mark.parametrize("damage", ["flip", "truncate", "garbage", "empty"])
def test_corrupted_cache_is_rebuilt(tok, tmp_path, damage):
    (tmp_path / "c.txt").write_text(corpus_text(200))
    cfg = _cfg([tmp_path / "c.txt"], heldout_fraction=0.0)
    good = D.prepare_data(cfg, tok)
    [entry] = list((tmp_path / "cache").glob("*.kdc"))
    raw = bytearray(entry.read_bytes())
    if damage == "flip":
        raw[-3] ^= 0x40
    elif damage == "truncate":
        raw = raw[: len(raw) - 5]
    elif damage == "garbage":
        raw = bytearray(b"KDCACHE\x01" + struct.pack("<I", 10) + b"not json!!" + b"\x00" * 40)
    else:
        raw = bytearray()
    entry.write_bytes(bytes(raw))
    again = D.prepare_data(cfg, tok)
    assert again.stats["cache_rebuilt"] == 1 and again.stats["cache_misses"] == 1
    assert np.array_equal(good.train, again.train)
    assert D.prepare_data(cfg, tok).stats["cache_hits"] == 1  # the rebuilt entry is good


def test_cache_dir_precedence(tok, tmp_path, monkeypatch):
    (tmp_path / "c.txt").write_text(corpus_text(100))
    cfg = _cfg([tmp_path / "c.txt"], heldout_fraction=0.0, cache_dir=str(tmp_path / "cfgcache"))
    D.prepare_data(cfg, tok)
    assert list((tmp_path / "cache").glob("*.kdc")) and not (tmp_path / "cfgcache").exists()  # env wins
    monkeypatch.delenv("KDISTILL_CACHE_DIR")
    D.prepare_data(cfg, tok)
    assert list((tmp_path / "cfgcache").glob("*.kdc"))
    assert list((tmp_path / "cfgcache").glob("*.tmp")) == []  # no temp files left behind


def test_unwritable_cache_is_not_fatal(tok, tmp_path, monkeypatch):
    (tmp_path / "blocker").write_text("a file where the cache folder should be")
    monkeypatch.setenv("KDISTILL_CACHE_DIR", str(tmp_path / "blocker" / "sub"))
    (tmp_path / "c.txt").write_text(corpus_text(100))
    out = D.prepare_data(_cfg([tmp_path / "c.txt"], heldout_fraction=0.0), tok)
    assert out.stats["train_sequences"] > 0


# -- batches ------------------------------------------------------------------------------------


def _seqs(n=13, t=6):
    return np.arange(n * (t + 1), dtype=np.int64).reshape(n, t + 1)


def test_batcher_shapes_and_epochs():
    s = _seqs()
    b = D.Batcher(s, batch_size=4, seed=3)
    inputs, labels = b.next()
    assert inputs.dtype == labels.dtype == torch.int64 and inputs.shape == labels.shape == (4, 6)
    assert torch.equal(inputs[:, 1:], labels[:, :-1])
    seen = [int(r) for r in (inputs[:, 0] // 7)]
    for _ in range(2):
        seen += [int(r) for r in (b.next()[0][:, 0] // 7)]
    seen += [int(r) for r in (b.next()[0][:, 0] // 7)][:1]
    assert sorted(seen) == list(range(13))  # one epoch: each sequence once
    assert b.epoch == 1


def test_batcher_resume_is_exact():
    s = _seqs(29)
    ref = D.Batcher(s, batch_size=5, seed=7)
    expected = [ref.next() for _ in range(20)]
    for stop in (0, 1, 5, 6, 13):
        a = D.Batcher(s, batch_size=5, seed=7)
        for _ in range(stop):
            a.next()
        state = json.loads(json.dumps(a.state_dict()))  # survives a JSON round trip
        b = D.Batcher(s, batch_size=5, seed=7)
        b.load_state_dict(state)
        for want in expected[stop:]:
            got = b.next()
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_batcher_seed_changes_order_and_small_data():
    s = _seqs(10)
    a, b = D.Batcher(s, 4, seed=0), D.Batcher(s, 4, seed=1)
    assert not all(torch.equal(a.next()[0], b.next()[0]) for _ in range(3))
    tiny = D.Batcher(_seqs(2), batch_size=5, seed=0)  # batch larger than the data: wraps epochs
    assert tiny.next()[0].shape == (5, 6)


def test_batcher_refuses_a_mismatched_state():
    b = D.Batcher(_seqs(10), 4)
    state = b.state_dict()
    with pytest.raises(UserError, match="cannot resume"):
        D.Batcher(_seqs(11), 4).load_state_dict(state)
    with pytest.raises(UserError, match="batch size"):
        D.Batcher(_seqs(10), 3).load_state_dict(state)
    with pytest.raises(UserError, match="incomplete"):
        D.Batcher(_seqs(10), 4).load_state_dict({"epoch": 1})
    with pytest.raises(UserError, match="empty dataset"):
        D.Batcher(np.zeros((0, 5), np.int64), 4)


def test_heldout_batches_fixed_order_and_reiterable():
    s = _seqs(10)
    hb = D.heldout_batches(s, batch_size=4, max_batches=None)
    first = list(hb)
    assert len(hb) == 3 and [x.shape[0] for x, _ in first] == [4, 4, 2]
    assert torch.equal(torch.cat([x for x, _ in first]), torch.from_numpy(s[:, :-1]))
    assert all(torch.equal(a[0], b[0]) for a, b in zip(first, list(hb)))  # same batches again
    assert len(list(D.heldout_batches(s, 4, max_batches=2))) == 2


def test_check_batch():
    assert D.check_batch(torch.tensor([[1, 2], [3, 4]])) is None
    assert "ignore_index" in D.check_batch(torch.full((2, 3), -100))
    assert "token 7" in D.check_batch(torch.tensor([[7, 7, -100], [7, -100, 7]]))
    assert D.check_batch(np.array([[5, 5, 6]])) is None
    assert D.check_batch(torch.tensor([[0, 0]]), ignore_index=0) is not None


def test_packed_batches_from_real_text_are_not_degenerate(tok, tmp_path):
    (tmp_path / "t.txt").write_text(corpus_text(500))
    out = D.prepare_data(_cfg([tmp_path / "t.txt"], heldout_fraction=0.0), tok)
    b = D.Batcher(out.train, 4, seed=0)
    for _ in range(5):
        assert D.check_batch(b.next()[1]) is None


def test_random_documents_round_trip_through_packing(tok, tmp_path):
    rng = random.Random(0)
    docs = [[rng.randrange(1, 300) for _ in range(rng.randrange(1, 30))] for _ in range(50)]
    p = _jsonl_ids(tmp_path / "r.jsonl", docs)
    out = D.prepare_data(_cfg([p], seq_len=7, heldout_fraction=0.0), tok)
    # undo the stride: first window whole, then the last seq_len tokens of each next window
    stream = out.train[0].tolist() + [t for row in out.train[1:] for t in row[1:].tolist()]
    full = [t for d in docs for t in d + [tok.eos_id]]
    assert stream == full[: len(stream)] and len(full) - len(stream) < 7
