"""Training data: read, tokenize once (cached), split by document, pack, and batch.

    data = prepare_data(cfg.data, tokenizer, seed=0)   # PreparedData: .train, .heldout (N, seq_len+1) int64
    print(data.summary())                               # how many tokens and sequences each side has
    batches = Batcher(data.train, batch_size=8, seed=0)
    input_ids, labels = batches.next()                  # (B, T) int64 tensors, labels = inputs shifted by one

Inputs (each entry of data.train / data.heldout; a glob like `src/**/*.py` is expanded, sorted):
- a directory: every file below it, recursively and sorted by path (names starting with "." and
  `__pycache__` are skipped); each file is read by its suffix as below, and whitespace-only files are
  skipped.
- `*.jsonl` / `*.ndjson`: one JSON object per line with a `text` string or an `input_ids` list of token
  ids (the first record decides which field every line must have); each line is a document; blank lines
  and records with empty text are skipped. A line may hold at most MAX_LINE_BYTES.
- `*.bin`: a pre-tokenized shard of little-endian token ids, no documents boundaries other than EOS
  tokens (the shard is split into documents at the tokenizer's EOS). The token width is given by
    * a 16-byte header: b"KDTOKENS", uint32 version = 1, uint32 bytes per token (2 or 4), then tokens
      (see `write_bin`), or
    * llm.c's 1024-byte header (int32 magic 20240520, version 1 = uint16 / 2 = uint32, token count), or
    * the suffix of a raw headerless file: `name.u16.bin` or `name.u32.bin`.
- any other file: UTF-8 text, one document (a leading BOM is dropped).

Tokenized files are cached in KDISTILL_CACHE_DIR, else data.cache_dir, else ~/.cache/kdistill/data,
under a key of (cache format, tokenizer identity, file content sha256, reader). Cache files are written
to a temporary name and renamed; each carries the sha256 of its payload, so a damaged one is detected and
rebuilt. `.bin` shards are memory-mapped, not cached.

Packing: the documents of one side are concatenated with the EOS token after each one, and cut into
windows of seq_len + 1 tokens with a stride of seq_len (consecutive windows share one token, so every
token but the first is a target exactly once); inputs = window[:-1], labels = window[1:]. The tail that
does not fill a window is dropped and counted.

Held-out split: unless data.heldout paths are given, a document goes to the held-out side when
sha256(f"{seed}:{key}") / 2**64 < heldout_fraction, where key is its path relative to the directory or
glob it came from (its file name when given directly), plus ":LINE" for a JSONL line and ":N" for the
N-th EOS-separated document of a .bin shard. So the split does not depend on where the data lives, on the
order of the inputs, or on the tokenizer.
"""

from __future__ import annotations

import codecs
import dataclasses
import glob
import hashlib
import json
import logging
import os
import struct
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

from kdistill.errors import UserError

log = logging.getLogger("kdistill.data")

CACHE_VERSION = 1
MAX_LINE_BYTES = 16 << 20  # a JSONL line longer than this is refused (bounded memory per line)
TEXT_BLOCK_BYTES = 1 << 20  # text is decoded and tokenized in blocks cut at newlines
BIN_MAGIC = b"KDTOKENS"
BIN_HEADER = 16
LLMC_MAGIC = 20240520
LLMC_HEADER = 256 * 4
SCAN_TOKENS = 1 << 24  # tokens per chunk when scanning a .bin shard
JSONL_SUFFIXES = (".jsonl", ".ndjson")
_GLOB_CHARS = "*?["


# ---------------------------------------------------------------------------------------------------
# Sources and documents
# ---------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class FileSpec:
    """One file to read: where it is, the key its documents are split by, and how to read it."""

    path: Path
    key: str  # relative path (or file name) used in split hashes
    kind: str  # "text" | "jsonl" | "bin"
    in_dir: bool  # found by expanding a directory or glob: whitespace-only files are skipped


@dataclasses.dataclass
class TokenDocs:
    """The documents of one file as one token array and per-document [start, end) offsets.

    `ordinals` numbers the documents within the file (the JSONL line number, or the index of an
    EOS-separated document of a .bin shard) for the split key; `skipped` counts documents left out
    (blank lines, empty text).
    """

    tokens: np.ndarray  # (n_tokens,) uint16/uint32, possibly a memmap
    starts: np.ndarray  # (n_docs,) int64
    ends: np.ndarray  # (n_docs,) int64
    ordinals: np.ndarray  # (n_docs,) int64
    skipped: int = 0
    whitespace_only: bool = False

    @property
    def num_docs(self) -> int:
        return int(self.starts.shape[0])

    @property
    def num_tokens(self) -> int:
        return int((self.ends - self.starts).sum()) if self.num_docs else 0

    def doc(self, i: int) -> np.ndarray:
        return self.tokens[int(self.starts[i]) : int(self.ends[i])]


def _kind(path: Path) -> str:
    name = path.name.lower()
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(".bin"):
        return "bin"
    return "text"


def expand_paths(paths: Sequence[str | Path], field: str = "data.train") -> list[FileSpec]:
    """Resolve data paths (files, directories, globs) to a sorted list of files, in the given order.

    Raises:
        UserError: a path that does not exist, a glob that matches nothing, an empty directory.
    """
    specs: list[FileSpec] = []
    for raw in paths:
        p = Path(raw)
        text = str(raw)
        if not p.exists() and any(c in text for c in _GLOB_CHARS):
            matches = sorted(m for m in glob.glob(text, recursive=True) if Path(m).is_file())
            if not matches:
                raise UserError(f"{field}: pattern '{text}' matches no files")
            base = _glob_base(text)
            for m in matches:
                mp = Path(m)
                specs.append(FileSpec(mp, _rel(mp, base), _kind(mp), True))
            continue
        if not p.exists():
            raise UserError(f"{field}: {p}: no such file or directory")
        if p.is_dir():
            found = _walk(p)
            if not found:
                raise UserError(
                    f"{field}: {p}: empty directory (no files), expected text, JSONL or .bin files"
                )
            specs.extend(FileSpec(f, f.relative_to(p).as_posix(), _kind(f), True) for f in found)
        elif p.is_file():
            specs.append(FileSpec(p, p.name, _kind(p), False))
        else:
            raise UserError(f"{field}: {p}: not a regular file or directory")
    return specs


def _glob_base(pattern: str) -> Path:
    parts = Path(pattern).parts
    keep = []
    for part in parts:
        if any(c in part for c in _GLOB_CHARS):
            break
        keep.append(part)
    return Path(*keep) if keep else Path(".")


def _rel(path: Path, base: Path) -> str:
    try:
        return path.relative_to(base).as_posix()
    except ValueError:
        return path.name


def _walk(root: Path) -> list[Path]:
    out = []
    for folder, dirs, files in os.walk(root):  # followlinks=False: no symlink loops
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "__pycache__")
        for name in sorted(files):
            if not name.startswith("."):
                f = Path(folder) / name
                if f.is_file():
                    out.append(f)
    return sorted(out, key=lambda f: f.relative_to(root).as_posix())


# ---------------------------------------------------------------------------------------------------
# Readers. Each takes an open binary stream so it can be tested (and fuzzed) on bytes in memory.
# ---------------------------------------------------------------------------------------------------


class UndecodableError(UserError):
    """A text file or JSONL line that is not UTF-8 (a UserError; skippable inside directories)."""


def _decoded_blocks(f: BinaryIO, name: str) -> Iterator[str]:
    """Decode a UTF-8 stream block by block; a bad byte is an error naming its offset."""
    dec = codecs.getincrementaldecoder("utf-8")("strict")
    consumed = 0
    first = True
    while True:
        data = f.read(TEXT_BLOCK_BYTES)
        final = not data
        pending = len(dec.getstate()[0])
        try:
            s = dec.decode(data, final=final)
        except UnicodeDecodeError as e:
            offset = consumed - pending + e.start
            raise UndecodableError(f"{name}: not UTF-8 text (invalid byte at offset {offset})") from None
        consumed += len(data)
        if first and s:
            s = s.removeprefix("\ufeff")
            first = False
        if s:
            yield s
        if final:
            return


def _line_chunks(blocks: Iterator[str]) -> Iterator[str]:
    """Re-cut decoded blocks at newlines so tokens rarely straddle a cut (bounded: 4 blocks max)."""
    carry = ""
    for s in blocks:
        s = carry + s
        cut = s.rfind("\n")
        if cut < 0 and len(s) < 4 * TEXT_BLOCK_BYTES:
            carry = s
            continue
        if cut < 0:
            cut = len(s) - 1
        yield s[: cut + 1]
        carry = s[cut + 1 :]
    if carry:
        yield carry


def read_text(f: BinaryIO, name: str, tokenizer: Any) -> TokenDocs:
    """One UTF-8 document from a stream. Whitespace-only text gives 0 documents, whitespace_only=True."""
    parts: list[np.ndarray] = []
    seen_text = False
    for chunk in _line_chunks(_decoded_blocks(f, name)):
        seen_text = seen_text or bool(chunk.strip())
        parts.append(np.asarray(tokenizer.encode(chunk), dtype=np.uint32))
    if not seen_text:
        return _docs([], [], 0, whitespace_only=True)
    tokens = np.concatenate(parts)
    return TokenDocs(
        tokens, np.array([0], np.int64), np.array([len(tokens)], np.int64), np.array([0], np.int64)
    )


def _docs(
    token_lists: list[list[int] | np.ndarray],
    ordinals: list[int],
    skipped: int,
    whitespace_only: bool = False,
) -> TokenDocs:
    lengths = np.array([len(t) for t in token_lists], dtype=np.int64)
    ends = np.cumsum(lengths, dtype=np.int64)
    starts = ends - lengths
    if token_lists:
        tokens = np.concatenate([np.asarray(t, dtype=np.uint32) for t in token_lists])
    else:
        tokens = np.zeros(0, np.uint32)
    return TokenDocs(tokens, starts, ends, np.asarray(ordinals, dtype=np.int64), skipped, whitespace_only)


def read_jsonl(f: BinaryIO, name: str, tokenizer: Any) -> TokenDocs:
    """Documents of a JSONL stream: one per line with a `text` string or an `input_ids` list.

    Raises:
        UserError: a line that is too long, not UTF-8 (byte offset), not a JSON object, lacks the field,
            has a wrong type, or holds a token id outside [0, vocab size).
    """
    vocab = int(tokenizer.vocab_size)
    field: str | None = None
    docs: list[list[int] | np.ndarray] = []
    ordinals: list[int] = []
    pending_text: list[str] = []
    pending_lines: list[int] = []
    pending_chars = 0
    skipped = 0
    offset = 0
    lineno = 0

    def flush() -> None:
        nonlocal pending_chars
        if pending_text:
            for ln, ids in zip(pending_lines, tokenizer.encode_batch(pending_text)):
                docs.append(np.asarray(ids, dtype=np.uint32))
                ordinals.append(ln)
            pending_text.clear()
            pending_lines.clear()
            pending_chars = 0

    while True:
        raw = f.readline(MAX_LINE_BYTES + 1)
        if not raw:
            break
        lineno += 1
        where = f"{name} line {lineno}"
        if len(raw) > MAX_LINE_BYTES:
            raise UserError(
                f"{where}: longer than {MAX_LINE_BYTES >> 20} MiB, expected one JSON object per line"
            )
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise UndecodableError(
                f"{where}: not UTF-8 (invalid byte at offset {offset + e.start})"
            ) from None
        offset += len(raw)
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
        except RecursionError:
            raise UserError(f"{where}: not valid JSON (nested too deeply)") from None
        if not isinstance(obj, dict):
            raise UserError(
                f"{where}: expected a JSON object with a 'text' string or an 'input_ids' list, "
                f"got a JSON {_json_type(obj)}"
            )
        if field is None:
            if "text" in obj:
                field = "text"
            elif "input_ids" in obj:
                field = "input_ids"
            else:
                raise UserError(
                    f"{where}: no 'text' or 'input_ids' field, expected a JSON object with a "
                    "'text' string or an 'input_ids' list"
                )
        if field not in obj:
            raise UserError(f"{where}: no '{field}' field (earlier lines have '{field}')")
        value = obj[field]
        if field == "text":
            if not isinstance(value, str):
                raise UserError(f"{where}: 'text' is a JSON {_json_type(value)}, expected a string")
            if not value.strip():
                skipped += 1
                continue
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise UndecodableError(
                    f"{where}: 'text' holds an unpaired surrogate escape "
                    "(\\ud800-\\udfff), expected valid Unicode"
                ) from None
            pending_text.append(value)
            pending_lines.append(lineno)
            pending_chars += len(value)
            if len(pending_text) >= 1024 or pending_chars >= (4 << 20):
                flush()
        else:
            if not isinstance(value, list):
                raise UserError(
                    f"{where}: 'input_ids' is a JSON {_json_type(value)}, expected a list of token ids"
                )
            for v in value:
                if type(v) is not int:
                    raise UserError(f"{where}: 'input_ids' holds {_short(v)}, expected integer token ids")
            if not value:
                skipped += 1
                continue
            lo, hi = min(value), max(value)
            if lo < 0:
                raise UserError(f"{where}: token id {lo} is negative, expected ids in [0, {vocab})")
            if hi >= vocab:
                raise UserError(f"{where}: token id {hi} >= vocab size {vocab}")
            flush()
            docs.append(np.asarray(value, dtype=np.uint32))
            ordinals.append(lineno)
    flush()
    return _docs(docs, ordinals, skipped)


def _json_type(v: Any) -> str:
    if isinstance(v, bool):
        return "boolean"
    if v is None:
        return "null"
    return {dict: "object", list: "array", str: "string", int: "number", float: "number"}.get(
        type(v), "value"
    )


def _short(v: Any) -> str:
    text = json.dumps(v)
    return text if len(text) <= 40 else text[:37] + "..."


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
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    with os.fdopen(fd, "wb") as f:
        f.write(BIN_MAGIC + struct.pack("<II", 1, width))
        f.write(arr.astype("<u2" if width == 2 else "<u4").tobytes())
    os.replace(tmp, path)
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


# ---------------------------------------------------------------------------------------------------
# Cache
# ---------------------------------------------------------------------------------------------------

_CACHE_MAGIC = b"KDCACHE\x01"


def cache_dir(cfg_dir: str = "") -> Path:
    """KDISTILL_CACHE_DIR, else data.cache_dir, else ~/.cache/kdistill/data."""
    env = os.environ.get("KDISTILL_CACHE_DIR")
    if env:
        return Path(env)
    if cfg_dir:
        return Path(cfg_dir)
    return Path.home() / ".cache" / "kdistill" / "data"


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


class TokenCache:
    """Tokenized files on disk, one file per (tokenizer, file content, reader); atomic and checksummed."""

    def __init__(self, folder: Path | None) -> None:
        self.folder = folder
        self.hits = 0
        self.misses = 0
        self.rebuilt = 0

    def key(self, tokenizer_identity: str, content_sha: str, kind: str) -> str:
        blob = json.dumps([CACHE_VERSION, tokenizer_identity, content_sha, kind, TEXT_BLOCK_BYTES])
        return hashlib.sha256(blob.encode()).hexdigest()[:40]

    def path(self, key: str) -> Path | None:
        return None if self.folder is None else self.folder / f"{key}.kdc"

    def load(self, key: str) -> TokenDocs | None:
        p = self.path(key)
        if p is None or not p.is_file():
            return None
        try:
            docs = _read_cache_file(p)
        except (OSError, ValueError, KeyError, TypeError, struct.error) as e:
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
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(_CACHE_MAGIC + struct.pack("<I", len(header)) + header)
            for a in arrays:
                f.write(memoryview(a).cast("B"))
        # No fsync: a file damaged by a crash fails its checksum on load and is rebuilt.
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


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


# ---------------------------------------------------------------------------------------------------
# Loading files
# ---------------------------------------------------------------------------------------------------


def load_file(spec: FileSpec, tokenizer: Any, cache: TokenCache) -> TokenDocs:
    """Token documents of one file, tokenized through the cache (or memory-mapped for .bin)."""
    name = str(spec.path)
    if spec.kind == "bin":
        return read_bin(spec.path, name, tokenizer.vocab_size, tokenizer.eos_id)
    try:
        sha = file_sha256(spec.path)
    except OSError as e:
        raise UserError(f"{name}: cannot read ({e.strerror or e.__class__.__name__})") from None
    key = cache.key(tokenizer.identity, sha, spec.kind)
    docs = cache.load(key)
    if docs is not None:
        return docs
    reader = read_jsonl if spec.kind == "jsonl" else read_text
    try:
        with open(spec.path, "rb") as f:
            docs = reader(f, name, tokenizer)
    except OSError as e:
        raise UserError(f"{name}: cannot read ({e.strerror or e.__class__.__name__})") from None
    cache.store(key, docs)
    return docs


@dataclasses.dataclass
class LoadedFile:
    spec: FileSpec
    docs: TokenDocs

    def key(self, i: int) -> str:
        if self.spec.kind == "text":
            return self.spec.key
        return f"{self.spec.key}:{int(self.docs.ordinals[i])}"


def load_files(
    paths: Sequence[str | Path],
    tokenizer: Any,
    cache: TokenCache,
    field: str = "data.train",
    skip_undecodable: bool = False,
    stop_after_tokens: int = 0,
) -> tuple[list[LoadedFile], int]:
    """Read and tokenize every file of `paths`. Returns (files with at least one document, skipped docs).

    Empty and whitespace-only files are skipped (and counted); when nothing else is left that is an error
    naming the file (an empty dataset). With skip_undecodable, non-UTF-8 files inside a directory or glob are skipped too.
    `stop_after_tokens` > 0 stops reading further files once that many tokens are loaded.
    """
    specs = expand_paths(paths, field)
    loaded: list[LoadedFile] = []
    blank: list[FileSpec] = []
    skipped = 0
    total = 0
    for spec in specs:
        try:
            docs = load_file(spec, tokenizer, cache)
        except UndecodableError:
            if skip_undecodable and spec.in_dir:
                skipped += 1
                log.warning("skipping %s: not UTF-8", spec.path)
                continue
            raise
        skipped += docs.skipped
        if docs.whitespace_only or docs.num_docs == 0:
            # Skipped and counted; an error below only when nothing at all is left.
            skipped += 1
            blank.append(spec)
            continue
        loaded.append(LoadedFile(spec, docs))
        total += docs.num_tokens
        if stop_after_tokens and total >= stop_after_tokens:
            break
    if not loaded:
        if len(blank) == 1:
            b = blank[0]
            if b.kind == "jsonl":
                what = "every line is blank or has empty text/input_ids"
            elif b.path.stat().st_size == 0:
                what = "empty file"
            else:
                what = "whitespace-only text"
            raise UserError(f"{field}: {b.path}: {what} (empty dataset), expected some text")
        shown = ", ".join(str(p) for p in paths[:3]) + (" ..." if len(paths) > 3 else "")
        raise UserError(
            f"{field}: no documents in {shown} (empty dataset: all {len(blank)} files are empty "
            "or whitespace-only)"
        )
    return loaded, skipped


# ---------------------------------------------------------------------------------------------------
# Split and pack
# ---------------------------------------------------------------------------------------------------


def split_score(key: str, seed: int = 0) -> float:
    """A document's place in [0, 1) for the held-out split: held out when below heldout_fraction."""
    digest = hashlib.sha256(f"{seed}:{key}".encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


Selection = list[tuple[TokenDocs, np.ndarray]]  # (file's docs, indices of the chosen documents)


def stream_tokens(selection: Selection, eos_id: int | None, max_tokens: int = 0) -> np.ndarray:
    """Concatenate the chosen documents with EOS after each one into one int64 stream (capped)."""
    total = sum(
        int((d.ends[idx] - d.starts[idx]).sum()) + (len(idx) if eos_id is not None else 0)
        for d, idx in selection
    )
    if max_tokens:
        total = min(total, max_tokens)
    out = np.empty(total, dtype=np.int64)
    pos = 0
    for docs, idx in selection:
        for i in idx:
            if pos >= total:
                return out
            t = docs.doc(int(i))
            n = min(len(t), total - pos)
            out[pos : pos + n] = t[:n]
            pos += n
            if eos_id is not None and pos < total:
                out[pos] = eos_id
                pos += 1
    return out[:pos]


def pack(stream: np.ndarray, seq_len: int) -> np.ndarray:
    """Windows of seq_len + 1 tokens with stride seq_len: (N, seq_len + 1) int64, a read-only view."""
    n = (len(stream) - 1) // seq_len if len(stream) > seq_len else 0
    if n == 0:
        return np.zeros((0, seq_len + 1), dtype=np.int64)
    view = np.lib.stride_tricks.sliding_window_view(stream, seq_len + 1)[::seq_len]
    return view[:n]


@dataclasses.dataclass
class PreparedData:
    """Packed training and held-out sequences, (N, seq_len + 1) int64 each, and what went into them."""

    train: np.ndarray
    heldout: np.ndarray
    stats: dict[str, Any]

    def summary(self) -> str:
        s = self.stats
        held = (
            (
                f"{s['heldout_tokens']:,} held-out tokens ({s['heldout_sequences']} sequences, "
                f"{s['heldout_documents']} documents)"
            )
            if s["heldout_sequences"]
            else "no held-out data"
        )
        return (
            f"data: {s['train_tokens']:,} train tokens ({s['train_sequences']} sequences of "
            f"{s['seq_len'] + 1}, {s['train_documents']} documents), {held}; "
            f"cache: {s['cache_hits']} hits, {s['cache_misses']} misses"
        )


def prepare_data(
    cfg: Any, tokenizer: Any, *, seed: int = 0, require_heldout: bool = True, skip_undecodable: bool = False
) -> PreparedData:
    """Read, tokenize (cached), split by document and pack `cfg` (a DataConfig).

    Args:
        cfg: DataConfig (train, heldout, heldout_fraction, seq_len, max_tokens, cache_dir).
        tokenizer: a kdistill Tokenizer (vocab_size, identity, eos_id, encode_batch).
        seed: salts the held-out split hash (keep it fixed to compare held-out losses across runs).
        require_heldout: an empty held-out side is an error (else .heldout has 0 rows). Not required when
            heldout_fraction is 0 and no held-out paths are given.
        skip_undecodable: skip non-UTF-8 files found inside directories or globs instead of failing.

    Raises:
        UserError: a missing path, an empty dataset, bad input (see the readers), too little data for one
            training sequence, or an empty held-out side when required.
    """
    seq_len = int(cfg.seq_len)
    if seq_len < 1:
        raise UserError(f"data.seq_len is {seq_len}, expected a positive integer")
    if not cfg.train:
        raise UserError("data.train is empty, expected one or more text, JSONL or .bin paths")
    folder = cache_dir(getattr(cfg, "cache_dir", ""))
    cache = TokenCache(folder)
    eos = tokenizer.eos_id
    frac = float(cfg.heldout_fraction)
    max_tokens = int(cfg.max_tokens or 0)
    stop = 0
    if max_tokens and not cfg.heldout:
        stop = int(max_tokens / max(1e-9, 1 - frac)) + seq_len + 1
    elif max_tokens:
        stop = max_tokens + seq_len + 1
    train_files, skipped = load_files(cfg.train, tokenizer, cache, "data.train", skip_undecodable, stop)
    train_sel: Selection = []
    held_sel: Selection = []
    if cfg.heldout:
        held_files, held_skipped = load_files(cfg.heldout, tokenizer, cache, "data.heldout", skip_undecodable)
        skipped += held_skipped
        train_sel = [(f.docs, np.arange(f.docs.num_docs)) for f in train_files]
        held_sel = [(f.docs, np.arange(f.docs.num_docs)) for f in held_files]
        split = "paths"
        need_held = require_heldout
    else:
        split = "hash"
        need_held = require_heldout and frac > 0
        scores = [
            np.array([split_score(f.key(i), seed) for i in range(f.docs.num_docs)]) for f in train_files
        ]
        if frac > 0 and not any((s < frac).any() for s in scores):
            # Few documents: hold out the one with the lowest score, if that leaves some for training.
            total_docs = sum(len(s) for s in scores)
            if total_docs >= 2:
                best = min(range(len(scores)), key=lambda k: scores[k].min())
                scores[best][int(np.argmin(scores[best]))] = -1.0
        for f, s in zip(train_files, scores):
            held = s < frac
            train_sel.append((f.docs, np.flatnonzero(~held)))
            held_sel.append((f.docs, np.flatnonzero(held)))
    train_stream = stream_tokens(train_sel, eos, max_tokens)
    held_stream = stream_tokens(held_sel, eos)
    train = pack(train_stream, seq_len)
    heldout = pack(held_stream, seq_len)
    n_train_docs = sum(len(i) for _, i in train_sel)
    n_held_docs = sum(len(i) for _, i in held_sel)
    if len(train) == 0:
        raise UserError(
            f"data.train: {len(train_stream)} training tokens from {_plural(n_train_docs, 'document')}, need at "
            f"least seq_len + 1 = {seq_len + 1} for one sequence (add data or lower data.seq_len)"
        )
    if need_held and len(heldout) == 0:
        how = (
            "add data.heldout paths or more held-out text"
            if cfg.heldout
            else ("add more documents, raise data.heldout_fraction, or give data.heldout paths")
        )
        raise UserError(
            f"data: the held-out side has {len(held_stream)} tokens from {_plural(n_held_docs, 'document')}, "
            f"need at least seq_len + 1 = {seq_len + 1} for one sequence ({how}; or lower data.seq_len)"
        )
    stats = {
        "seq_len": seq_len,
        "split": split,
        "train_tokens": int(len(train_stream)),
        "heldout_tokens": int(len(held_stream)),
        "train_sequences": int(len(train)),
        "heldout_sequences": int(len(heldout)),
        "train_documents": n_train_docs,
        "heldout_documents": n_held_docs,
        "train_dropped_tokens": int(len(train_stream) - (len(train) * seq_len + 1 if len(train) else 0)),
        "heldout_dropped_tokens": int(len(held_stream) - (len(heldout) * seq_len + 1 if len(heldout) else 0)),
        "skipped_documents": skipped,
        "files": len(train_files),
        "eos_id": eos,
        "cache_dir": str(folder),
        "cache_hits": cache.hits,
        "cache_misses": cache.misses,
        "cache_rebuilt": cache.rebuilt,
    }
    return PreparedData(train, heldout, stats)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


# ---------------------------------------------------------------------------------------------------
# Batches
# ---------------------------------------------------------------------------------------------------


class Batcher:
    """Deterministic shuffled batches over packed sequences, resumable exactly.

    The order is an endless stream of permutations, one per epoch, each drawn from (seed, epoch); a batch
    takes the next batch_size indices of that stream (crossing into the next epoch when needed, so a
    batch size above the number of sequences still works). `state_dict()` is (epoch, position).
    """

    def __init__(self, sequences: np.ndarray, batch_size: int, seed: int = 0) -> None:
        if batch_size < 1:
            raise UserError(f"batch size is {batch_size}, expected a positive integer")
        if len(sequences) == 0:
            raise UserError("no training sequences to batch (empty dataset)")
        self.sequences = sequences
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.epoch = 0
        self.position = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.sequences))

    def next_indices(self) -> np.ndarray:
        out = []
        need = self.batch_size
        while need:
            take = self._order[self.position : self.position + need]
            out.append(take)
            need -= len(take)
            self.position += len(take)
            if self.position >= len(self._order):
                self.epoch += 1
                self.position = 0
                self._order = self._permutation(self.epoch)
        return np.concatenate(out)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids, labels), each (B, T) int64."""
        rows = np.asarray(self.sequences[self.next_indices()], dtype=np.int64)  # (B, T + 1)
        batch = torch.from_numpy(np.ascontiguousarray(rows))
        return batch[:, :-1].contiguous(), batch[:, 1:].contiguous()

    def __iter__(self) -> Batcher:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.next()

    def state_dict(self) -> dict[str, int]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "batch_size": self.batch_size,
            "num_sequences": int(len(self.sequences)),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly where `state` was taken. The data and batch size must be the same."""
        try:
            epoch, position = int(state["epoch"]), int(state["position"])
            n, b = int(state["num_sequences"]), int(state["batch_size"])
            seed = int(state["seed"])
        except (KeyError, TypeError, ValueError):
            raise UserError(
                "data position in the checkpoint is incomplete (expected epoch, position, seed, "
                "batch_size, num_sequences)"
            ) from None
        if n != len(self.sequences):
            raise UserError(
                f"cannot resume: the data now packs into {len(self.sequences)} sequences, the "
                f"checkpoint was taken with {n} (data, tokenizer or seq_len changed)"
            )
        if b != self.batch_size:
            raise UserError(f"cannot resume: batch size is {self.batch_size}, the checkpoint used {b}")
        if not (epoch >= 0 and 0 <= position < max(1, n)):
            raise UserError(f"cannot resume: data position epoch={epoch} position={position} is out of range")
        self.seed, self.epoch, self.position = seed, epoch, position
        self._order = self._permutation(epoch)


class HeldoutBatches:
    """Re-iterable (input_ids, labels) batches over the first sequences in fixed order.

    Each iteration yields the same batches; the last one may be short. len() is the number of batches.
    """

    def __init__(self, sequences: np.ndarray, batch_size: int, max_batches: int | None = None) -> None:
        if batch_size < 1:
            raise UserError(f"batch size is {batch_size}, expected a positive integer")
        self.sequences = sequences
        self.batch_size = int(batch_size)
        count = (len(sequences) + self.batch_size - 1) // self.batch_size
        self.count = min(count, max_batches) if max_batches else count

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for b in range(self.count):
            rows = np.asarray(self.sequences[b * self.batch_size : (b + 1) * self.batch_size], dtype=np.int64)
            batch = torch.from_numpy(np.ascontiguousarray(rows))  # (B, T + 1)
            yield batch[:, :-1].contiguous(), batch[:, 1:].contiguous()


def heldout_batches(sequences: np.ndarray, batch_size: int, max_batches: int | None = None) -> HeldoutBatches:
    """Held-out batches in fixed order (at most max_batches; None or 0: all), iterable any number of times."""
    return HeldoutBatches(sequences, batch_size, max_batches)


def check_batch(labels: torch.Tensor | np.ndarray, ignore_index: int = -100) -> str | None:
    """Why a batch is degenerate (every target ignored, or one token repeated), else None."""
    t = torch.as_tensor(labels)
    valid = t[t != ignore_index]
    if valid.numel() == 0:
        return f"every target is ignore_index ({ignore_index})"
    first = valid.reshape(-1)[0]
    if bool((valid == first).all()):
        return f"every one of the {valid.numel()} targets is token {int(first)}"
    return None
