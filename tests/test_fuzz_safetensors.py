"""Fuzzing the safetensors header reader: over 10,000 generated and mutated files, only UserError
escapes, and no input (e.g. a header length claiming terabytes) makes it allocate more than a bound."""

from __future__ import annotations

import json
import os
import struct
import tempfile
import tracemalloc
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kdistill.errors import UserError
from kdistill.models.hf_io import read_safetensors_header, sniff_format

DTYPES = ["F32", "F16", "BF16", "I8", "F64", "U8", "BOOL", "", "f32", 3, None]
ALLOC_BOUND = 1 << 20  # bytes of Python allocations any single fuzz input may cause (seen: ~7 KB)


def _valid_header() -> st.SearchStrategy[bytes]:
    """Headers built like real ones, with every field drawn from good and bad values."""
    ints = st.one_of(
        st.integers(0, 64), st.integers(-3, 2**70), st.booleans(), st.none(), st.text(max_size=3)
    )
    entry = st.fixed_dictionaries(
        {
            "dtype": st.sampled_from(DTYPES),
            "shape": st.one_of(st.lists(st.integers(0, 8), max_size=3), st.lists(ints, max_size=3), ints),
            "data_offsets": st.one_of(
                st.lists(st.integers(0, 300), min_size=2, max_size=2), st.lists(ints, max_size=3)
            ),
        }
    )
    entries = st.dictionaries(st.text(max_size=12), st.one_of(entry, ints), max_size=4)
    return entries.map(lambda d: json.dumps(d).encode())


def _file(header: st.SearchStrategy[bytes]) -> st.SearchStrategy[bytes]:
    """length field (honest, off by a little, or huge) + header + some data bytes."""
    return st.tuples(
        header,
        st.one_of(st.just(0), st.integers(-8, 8), st.integers(2**20, 2**64 - 1)),
        st.binary(max_size=300),
    ).map(
        lambda t: (
            struct.pack("<Q", max(0, min(2**64 - 1, len(t[0]) + t[1] if t[1] < 2**20 else t[1])))
            + t[0]
            + t[2]
        )
    )


def _mutated() -> st.SearchStrategy[bytes]:
    """A valid file with some bytes overwritten, inserted or cut off."""
    good_header = json.dumps(
        {
            "__metadata__": {"format": "pt"},
            "a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
            "b": {"dtype": "BF16", "shape": [4], "data_offsets": [24, 32]},
        }
    ).encode()
    good = struct.pack("<Q", len(good_header)) + good_header + bytes(range(32))

    def mutate(edits: list[tuple[int, int]], cut: int) -> bytes:
        b = bytearray(good)
        for pos, val in edits:
            b[pos % len(b)] = val
        return bytes(b[: len(b) - cut])

    return st.builds(
        mutate,
        st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), max_size=6),
        st.integers(0, 40),
    )


FILES = st.one_of(st.binary(max_size=64), _file(_valid_header()), _file(st.binary(max_size=80)), _mutated())


def test_fuzz_header_reader_only_raises_user_error():
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "fuzz.safetensors"
        stats = {"ok": 0, "refused": 0, "peak": 0}

        @settings(
            max_examples=10_500,
            deadline=None,
            database=None,
            derandomize=True,
            suppress_health_check=list(HealthCheck),
        )
        @given(FILES)
        def run(data: bytes) -> None:
            path.write_bytes(data)
            tracemalloc.start()  # traced only around the reader: hypothesis itself runs untraced
            try:
                header, offset = read_safetensors_header(path)
            except UserError as e:
                assert "\n" not in str(e) and str(path) in str(e)
                stats["refused"] += 1
            else:
                assert isinstance(header, dict) and 8 <= offset <= len(data)
                stats["ok"] += 1
            finally:
                sniff_format(path)  # must never raise on a readable file
                stats["peak"] = max(stats["peak"], tracemalloc.get_traced_memory()[1])
                tracemalloc.stop()

        run()
    assert stats["ok"] + stats["refused"] >= 10_000
    assert stats["ok"] > 100 and stats["refused"] > 100  # the generators reach both sides
    assert stats["peak"] < ALLOC_BOUND


def test_gigabyte_header_length_does_not_allocate(tmp_path):
    big = tmp_path / "big.safetensors"
    # a sparse file of 200 MB whose header length claims 150 MB: refused by the 100 MB cap before reading
    with open(big, "wb") as f:
        f.write(struct.pack("<Q", 150 << 20) + b"{")
        f.truncate(200 << 20)
    lie = tmp_path / "lie.safetensors"
    lie.write_bytes(struct.pack("<Q", 2**63) + b"{}")
    tracemalloc.start()
    try:
        messages = []
        for p in (big, lie):
            try:
                read_safetensors_header(p)
            except UserError as e:
                messages.append(str(e))
            else:
                raise AssertionError(f"{p} was accepted")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        os.unlink(big)
    assert peak < 1 << 20
    assert messages[0] == f"{big}: safetensors header length 157286400 exceeds the 104857600 byte limit"
    assert "runs past the end of the file (10 bytes)" in messages[1]
