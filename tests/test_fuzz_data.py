"""Fuzzing the data readers (JSONL, text, .bin) with hypothesis: only UserError escapes, what is read back
is consistent, and memory stays bounded by the input size.

Deterministic (derandomize=True), so CI sees the same inputs every run: 2,000 per reader. Each reader's
checks, removed or bent one at a time, fail by the 474th input: JSONL nesting past the recursion limit
(23rd) and an unpaired surrogate escape (474th); text, the offset of a bad byte cut by a block (16th) and a
short last line (4th); .bin, an empty shard (18th), empty documents between EOS (77th) and a partial token
(76th). `KDISTILL_FUZZ_EXAMPLES=10000` runs the long version (tests/fuzz_util.py).
"""

from __future__ import annotations

import io
import json
import struct
import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kdistill import data as D
from kdistill.data import binfmt, sources
from kdistill.errors import UserError
from kdistill.models.tokenizer import load_tokenizer
from tests.fuzz_util import fuzz_examples
from tests.tiny import make_tokenizer

N = fuzz_examples(2_000)
FUZZ = settings(
    max_examples=N, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck)
)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_tokenizer(make_tokenizer(tmp_path_factory.mktemp("tok"), vocab_size=300))


# -- JSONL ---------------------------------------------------------------------------------------

# Lines from templates filled with drawn values (cheap to generate), plus raw bytes and known nasties.
_TEMPLATES = [
    '{"text": %(s)s}',
    '{"text": %(s)s, "meta": {"n": %(i)d}}',
    '{"input_ids": [%(i)d, %(j)d]}',
    '{"input_ids": [%(i)d, %(s)s]}',
    '{"input_ids": %(s)s}',
    '{"input_ids": []}',
    '{"text": %(i)d}',
    '{"other": %(s)s}',
    "[%(s)s]",
    "%(s)s",
    "%(i)d",
    '{"text": %(s)s',
    '{"input_ids": [%(i)d.5]}',
    '{"input_ids": [%(i)d, true]}',
    '{"text": null}',
    '{"text": "\\ud800%(i)d"}',
    '{"input_ids": [1e400]}',
]
_FRAGMENTS = [b"", b"   ", b"{", b"[" * 3000, b"NaN", b"\xff\xfe", b"\x00", b"{}", b'{"text": "a"}']


def _fill(t):
    picks, text, i, j, ascii_only, raw = t
    lines = []
    for k in picks:
        if k >= len(_TEMPLATES):
            lines.append(_FRAGMENTS[k - len(_TEMPLATES)] if k - len(_TEMPLATES) < len(_FRAGMENTS) else raw)
        else:
            filled = _TEMPLATES[k] % {"s": json.dumps(text, ensure_ascii=ascii_only), "i": i, "j": j}
            lines.append(filled.encode("utf-8", "surrogatepass"))
    return b"\n".join(lines)


# One draw per field (cheap): template picks for up to 5 lines, filled from one text, two ints, raw bytes.
_jsonl = st.one_of(
    st.tuples(
        st.lists(st.integers(0, len(_TEMPLATES) + len(_FRAGMENTS)), max_size=5),
        st.text(max_size=16),
        st.integers(-3, 310),
        st.integers(-(2**66), 2**66),
        st.booleans(),
        st.binary(max_size=24),
    ).map(_fill),
    st.binary(max_size=120),
)


def test_fuzz_jsonl_reader(tok):
    count = [0]

    @FUZZ
    @given(data=_jsonl)
    def run(data):
        count[0] += 1
        try:
            docs = D.read_jsonl(io.BytesIO(data), "f.jsonl", tok)
        except UserError as e:
            assert "\n" not in str(e) and str(e).startswith("f.jsonl")
            return
        assert docs.starts.shape == docs.ends.shape == docs.ordinals.shape
        assert (docs.starts <= docs.ends).all()
        assert docs.tokens.size == 0 or int(docs.tokens.max()) < tok.vocab_size

    run()
    assert count[0] >= N


# -- text ------------------------------------------------------------------------------------------

_text_bytes = st.one_of(
    st.text(max_size=80).map(lambda s: s.encode("utf-8", "surrogatepass")),
    st.binary(max_size=80),
    st.tuples(st.text(max_size=40), st.binary(max_size=4), st.text(max_size=40)).map(
        lambda t: t[0].encode("utf-8", "surrogatepass") + t[1] + t[2].encode("utf-8", "surrogatepass")
    ),
    st.sampled_from(["\ufeff", " \n\t", "東京🙂", "\r\n" * 10]).map(str.encode),
)


def test_fuzz_text_reader(tok, monkeypatch):
    monkeypatch.setattr(sources, "TEXT_BLOCK_BYTES", 7)  # many block cuts, inside multi-byte characters too
    count = [0]

    @FUZZ
    @given(data=_text_bytes)
    def run(data):
        count[0] += 1
        try:
            expected = data.decode("utf-8")
        except UnicodeDecodeError as e:
            with pytest.raises(UserError, match=f"offset {e.start}\\)"):
                D.read_text(io.BytesIO(data), "t.txt", tok)
            return
        docs = D.read_text(io.BytesIO(data), "t.txt", tok)
        text = expected.removeprefix("\ufeff")
        if not text.strip():
            assert docs.whitespace_only and docs.num_docs == 0
        else:
            assert (
                docs.num_docs == 1 and tok.decode(docs.doc(0).tolist()) == text
            )  # byte-level BPE round trip

    run()
    assert count[0] >= N


# -- .bin ------------------------------------------------------------------------------------------

_payload = st.binary(max_size=64)
_bin = st.one_of(
    _payload,
    st.tuples(st.integers(0, 3), st.integers(0, 6), _payload).map(
        lambda t: binfmt.BIN_MAGIC + struct.pack("<II", t[0], t[1]) + t[2]
    ),
    st.tuples(st.integers(0, 3), st.integers(-5, 40), _payload).map(
        lambda t: (
            struct.pack("<iii", binfmt.LLMC_MAGIC, t[0], t[1]) + b"\x00" * (binfmt.LLMC_HEADER - 12) + t[2]
        )
    ),
    st.lists(st.integers(0, 299), max_size=20).map(
        lambda ids: binfmt.BIN_MAGIC + struct.pack("<II", 1, 2) + np.asarray(ids, "<u2").tobytes()
    ),
    st.binary(max_size=10).map(lambda b: binfmt.BIN_MAGIC[: len(b) % 9] + b),
)


def test_fuzz_bin_reader(tok, tmp_path):
    count = [0]
    names = ["s.bin", "s.u16.bin", "s.u32.bin"]

    @FUZZ
    @given(data=_bin, which=st.integers(0, 2), eos=st.sampled_from([None, 0, tok.eos_id]))
    def run(data, which, eos):
        count[0] += 1
        path = tmp_path / f"{count[0]}.{names[which]}"  # a new file: overwriting is slow on ext4
        path.write_bytes(data)
        try:
            docs = D.read_bin(path, names[which], tok.vocab_size, eos)
        except UserError as e:
            assert "\n" not in str(e) and str(e).startswith(names[which])
            path.unlink()
            return
        assert docs.tokens.size > 0 and int(docs.tokens.max()) < tok.vocab_size
        assert (docs.starts < docs.ends).all()
        if eos is not None:
            assert all(eos not in docs.doc(i).tolist() for i in range(docs.num_docs))
        del docs
        path.unlink()

    run()
    assert count[0] >= N


# -- bounded memory -------------------------------------------------------------------------------


def test_readers_allocate_memory_bounded_by_input(tok, tmp_path):
    """Inputs whose headers or shapes claim huge sizes: peak Python/numpy allocation stays small."""
    cases = [
        ("jsonl", b"[" * 200_000),
        ("jsonl", b'{"input_ids": [' + b"1," * 50_000 + b"1]}"),
        ("jsonl", b"x" * 300_000),  # a long line without a newline
        ("text", b"\xff" + b"a" * 300_000),
        ("text", b"a" * 300_000),
        (
            "bin",
            struct.pack("<iii", binfmt.LLMC_MAGIC, 2, 2**31 - 1)
            + b"\x00" * (binfmt.LLMC_HEADER - 12)
            + b"\x01\x00",
        ),
        ("bin", binfmt.BIN_MAGIC + struct.pack("<II", 1, 4) + b"\x01\x00\x00\x00" * 50_000),
    ]
    for kind, data in cases:
        tracemalloc.start()
        try:
            if kind == "bin":
                path = tmp_path / "m.bin"
                path.write_bytes(data)
                D.read_bin(path, "m.bin", tok.vocab_size, tok.eos_id)
            elif kind == "jsonl":
                D.read_jsonl(io.BytesIO(data), "m.jsonl", tok)
            else:
                D.read_text(io.BytesIO(data), "m.txt", tok)
        except UserError:
            pass
        finally:
            _, peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
        assert peak < 64 * len(data) + (8 << 20), (kind, len(data), peak)
