"""The token cache: tokenized files on disk, so each file is tokenized once per tokenizer.

    cache = TokenCache(cache_dir(cfg.data.cache_dir))
    key = cache.key(tokenizer.identity, file_sha256(path), "jsonl")
    docs = cache.load(key)            # TokenDocs (memory-mapped) or None; a damaged file is rebuilt
    cache.store(key, docs)

Tokenized files are cached in KDISTILL_CACHE_DIR, else data.cache_dir, else ~/.cache/kdistill/data,
under a key of (cache format, tokenizer identity, file content sha256, reader). Cache files are written
to a temporary name and renamed; each carries the sha256 of its payload, so a damaged one is detected and
rebuilt.

File format (`KEY.kdc`): b"KDCACHE\\x01", uint32 header length, a JSON header (version, n_docs, n_tokens,
skipped, whitespace_only, sha256 of the payload), then the payload: starts, ends and ordinals (n_docs
little-endian int64 each) and the tokens (n_tokens little-endian uint32).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
from pathlib import Path

import numpy as np

from kdistill.data import sources
from kdistill.data.sources import TokenDocs
from kdistill.fileio import atomic_write_bytes

log = logging.getLogger("kdistill.data")

CACHE_VERSION = 1
_CACHE_MAGIC = b"KDCACHE\x01"


def cache_dir(cfg_dir: str = "") -> Path:
    """KDISTILL_CACHE_DIR, else data.cache_dir, else ~/.cache/kdistill/data."""
    env = os.environ.get("KDISTILL_CACHE_DIR")
    if env:
        return Path(env)
    if cfg_dir:
        return Path(cfg_dir)
    return Path.home() / ".cache" / "kdistill" / "data"


class TokenCache:
    """Tokenized files on disk, one file per (tokenizer, file content, reader); atomic and checksummed."""

    def __init__(self, folder: Path | None) -> None:
        self.folder = folder
        self.hits = 0
        self.misses = 0
        self.rebuilt = 0

    def key(self, tokenizer_identity: str, content_sha: str, kind: str) -> str:
        # The block size is part of the key: tokens may differ where a block boundary cuts the text.
        blob = json.dumps([CACHE_VERSION, tokenizer_identity, content_sha, kind, sources.TEXT_BLOCK_BYTES])
        return hashlib.sha256(blob.encode()).hexdigest()[:40]

    def path(self, key: str) -> Path | None:
        return None if self.folder is None else self.folder / f"{key}.kdc"

    def load(self, key: str) -> TokenDocs | None:
        p = self.path(key)
        if p is None or not p.is_file():
            return None
        try:
            docs = _read_cache_file(p)
        except (OSError, ValueError, KeyError, TypeError, RecursionError, struct.error) as e:
            log.warning("data cache file %s is damaged (%s); rebuilding it", p, e)
            self.rebuilt += 1
            try:
                p.unlink()
            except OSError:
                pass
            return None
        self.hits += 1
        return docs

    def store(self, key: str, docs: TokenDocs) -> None:
        self.misses += 1
        p = self.path(key)
        if p is None:
            return
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
            _write_cache_file(p, docs)
        except OSError as e:  # a read-only or full cache disk only costs re-tokenizing next time
            log.warning("cannot write data cache %s (%s); continuing without it", p, e.strerror or e)


def _cache_arrays(docs: TokenDocs) -> list[np.ndarray]:
    return [
        np.ascontiguousarray(docs.starts, dtype="<i8"),
        np.ascontiguousarray(docs.ends, dtype="<i8"),
        np.ascontiguousarray(docs.ordinals, dtype="<i8"),
        np.ascontiguousarray(docs.tokens, dtype="<u4"),
    ]


def _write_cache_file(path: Path, docs: TokenDocs) -> None:
    arrays = _cache_arrays(docs)
    h = hashlib.sha256()
    for a in arrays:
        h.update(memoryview(a).cast("B"))
    header = json.dumps(
        {
            "version": CACHE_VERSION,
            "n_docs": docs.num_docs,
            "n_tokens": int(arrays[3].shape[0]),
            "skipped": docs.skipped,
            "whitespace_only": docs.whitespace_only,
            "sha256": h.hexdigest(),
        }
    ).encode()
    # One buffer (magic, header length, header, payload), renamed into place whole. A file damaged
    # anyway fails its checksum on load and is rebuilt.
    head = _CACHE_MAGIC + struct.pack("<I", len(header)) + header
    buf = np.empty(len(head) + sum(a.nbytes for a in arrays), dtype=np.uint8)
    buf[: len(head)] = np.frombuffer(head, dtype=np.uint8)
    pos = len(head)
    for a in arrays:
        buf[pos : pos + a.nbytes] = a.view(np.uint8)
        pos += a.nbytes
    atomic_write_bytes(path, memoryview(buf))


def _read_cache_file(path: Path) -> TokenDocs:
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(12)
        if len(head) < 12 or head[:8] != _CACHE_MAGIC:
            raise ValueError("bad magic")
        (hlen,) = struct.unpack("<I", head[8:12])
        if hlen > 1 << 16 or 12 + hlen > size:
            raise ValueError("bad header length")
        meta = json.loads(f.read(hlen))
        n_docs, n_tokens = int(meta["n_docs"]), int(meta["n_tokens"])
        base = 12 + hlen
        if n_docs < 0 or n_tokens < 0 or base + 24 * n_docs + 4 * n_tokens != size:
            raise ValueError("size does not match header")
        h = hashlib.sha256()
        while block := f.read(1 << 20):
            h.update(block)
        if h.hexdigest() != meta["sha256"]:
            raise ValueError("checksum mismatch")
    arrays = []
    pos = base
    for dtype, count in (("<i8", n_docs), ("<i8", n_docs), ("<i8", n_docs), ("<u4", n_tokens)):
        if count:
            arrays.append(np.memmap(path, dtype=dtype, mode="r", offset=pos, shape=(count,)))
        else:
            arrays.append(np.zeros(0, dtype=dtype))
        pos += count * np.dtype(dtype).itemsize
    starts, ends, ordinals, tokens = arrays
    return TokenDocs(
        tokens,
        np.asarray(starts),
        np.asarray(ends),
        np.asarray(ordinals),
        int(meta.get("skipped", 0)),
        bool(meta.get("whitespace_only", False)),
    )
