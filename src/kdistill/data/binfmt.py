"""`.bin` token shards: their layouts, a reader that memory-maps them and a writer.

    write_bin("train.bin", ids)                        # KDTOKENS header, uint16 when every id fits
    docs = read_bin(Path("train.bin"), "train.bin", vocab_size, eos_id)   # TokenDocs over a memmap

A shard holds little-endian token ids with no document boundaries other than EOS tokens (it is split
into documents at the tokenizer's EOS). The token width is given by
  * a 16-byte header: b"KDTOKENS", uint32 version = 1, uint32 bytes per token (2 or 4), then tokens
    (see `write_bin`), or
  * llm.c's 1024-byte header (int32 magic 20240520, version 1 = uint16 / 2 = uint32, token count), or
  * the suffix of a raw headerless file: `name.u16.bin` or `name.u32.bin`.
Shards are memory-mapped, never copied into the token cache.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from kdistill.data.sources import TokenDocs
from kdistill.errors import UserError
from kdistill.fileio import atomic_write_bytes

BIN_MAGIC = b"KDTOKENS"
BIN_HEADER = 16
LLMC_MAGIC = 20240520
LLMC_HEADER = 256 * 4
SCAN_TOKENS = 1 << 24  # tokens per chunk when scanning a .bin shard


def bin_layout(head: bytes, size: int, name: str) -> tuple[int, np.dtype]:
    """(payload offset, token dtype) of a .bin shard from its first bytes and its size.

    Raises:
        UserError: an unknown layout, a bad header, a size that is not a whole number of tokens, no tokens.
    """
    lower = name.lower()
    if head[:8] == BIN_MAGIC:
        if size < BIN_HEADER:
            raise UserError(f"{name}: truncated KDTOKENS header ({size} bytes, expected {BIN_HEADER})")
        version, width = struct.unpack("<II", head[8:16])
        if version != 1:
            raise UserError(f"{name}: KDTOKENS version {version}, expected 1")
        if width not in (2, 4):
            raise UserError(f"{name}: KDTOKENS token width {width} bytes, expected 2 (uint16) or 4 (uint32)")
        offset, dtype = BIN_HEADER, np.dtype("<u2" if width == 2 else "<u4")
    elif len(head) >= 12 and struct.unpack("<i", head[:4])[0] == LLMC_MAGIC:
        if size < LLMC_HEADER:
            raise UserError(f"{name}: truncated llm.c header ({size} bytes, expected {LLMC_HEADER})")
        version, count = struct.unpack("<ii", head[4:12])
        if version not in (1, 2):
            raise UserError(f"{name}: llm.c token file version {version}, expected 1 (uint16) or 2 (uint32)")
        dtype = np.dtype("<u2" if version == 1 else "<u4")
        if count < 0 or LLMC_HEADER + count * dtype.itemsize != size:
            raise UserError(
                f"{name}: llm.c header says {count} tokens but the file holds "
                f"{(size - LLMC_HEADER) / dtype.itemsize:g}"
            )
        offset = LLMC_HEADER
    elif lower.endswith(".u16.bin"):
        offset, dtype = 0, np.dtype("<u2")
    elif lower.endswith(".u32.bin"):
        offset, dtype = 0, np.dtype("<u4")
    else:
        raise UserError(
            f"{name}: unknown token width: expected a KDTOKENS or llm.c header, "
            "or a raw file named *.u16.bin / *.u32.bin"
        )
    payload = size - offset
    if payload % dtype.itemsize:
        raise UserError(
            f"{name}: {payload} payload bytes is not a whole number of {dtype.itemsize}-byte tokens "
            "(truncated file?)"
        )
    if payload == 0:
        raise UserError(f"{name}: no tokens (empty shard)")
    return offset, dtype


def write_bin(path: str | Path, tokens: Sequence[int] | np.ndarray, width: int | None = None) -> Path:
    """Write a KDTOKENS shard: b"KDTOKENS", uint32 version 1, uint32 bytes per token, then the tokens.

    width 2 (uint16) or 4 (uint32); default: 2 when every id fits in uint16. Written atomically.
    """
    arr = np.asarray(tokens, dtype=np.int64)
    if width is None:
        width = 2 if arr.size == 0 or int(arr.max()) < (1 << 16) else 4
    if width not in (2, 4):
        raise ValueError("width must be 2 or 4")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= (1 << (8 * width))):
        raise ValueError(f"token ids do not fit in {width} bytes")
    path = Path(path)
    dtype = np.dtype("<u2" if width == 2 else "<u4")
    buf = np.empty(BIN_HEADER + arr.size * width, dtype=np.uint8)  # header + tokens, one buffer
    buf[:BIN_HEADER] = np.frombuffer(BIN_MAGIC + struct.pack("<II", 1, width), dtype=np.uint8)
    buf[BIN_HEADER:].view(dtype)[:] = arr
    atomic_write_bytes(path, memoryview(buf))
    return path


def read_bin(path: Path, name: str, vocab_size: int, eos_id: int | None) -> TokenDocs:
    """Memory-map a .bin shard, check its ids, and split it into documents at EOS (the EOS dropped)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(16)
    except OSError as e:
        raise UserError(f"{name}: cannot read ({e.strerror or e.__class__.__name__})") from None
    offset, dtype = bin_layout(head, size, name)
    n = (size - offset) // dtype.itemsize
    tokens = np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=(n,))
    cuts: list[np.ndarray] = []
    for lo in range(0, n, SCAN_TOKENS):
        chunk = tokens[lo : lo + SCAN_TOKENS]
        bad = chunk >= vocab_size
        if bad.any():
            i = int(np.argmax(bad))
            raise UserError(
                f"{name}: token id {int(chunk[i])} at position {lo + i} >= vocab size {vocab_size}"
            )
        if eos_id is not None:
            cuts.append(np.flatnonzero(chunk == eos_id).astype(np.int64) + lo)
    eos_at = np.concatenate(cuts) if cuts else np.zeros(0, np.int64)
    starts = np.concatenate([[0], eos_at + 1]).astype(np.int64)
    ends = np.concatenate([eos_at, [n]]).astype(np.int64)
    ordinals = np.arange(len(starts), dtype=np.int64)
    keep = ends > starts
    return TokenDocs(tokens, starts[keep], ends[keep], ordinals[keep], skipped=int((~keep).sum()))
