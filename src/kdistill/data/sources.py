"""Data sources: data paths expanded to files, and the text and JSONL readers.

    specs = expand_paths(["corpus/", "extra/*.jsonl"])      # [FileSpec(path, key, kind, in_dir), ...]
    docs = read_jsonl(open("a.jsonl", "rb"), "a.jsonl", tokenizer)   # TokenDocs: tokens + offsets

Inputs (each entry of data.train / data.heldout; a glob like `src/**/*.py` is expanded, sorted):
- a directory: every file below it, recursively and sorted by path (names starting with "." and
  `__pycache__` are skipped); each file is read by its suffix as below, and whitespace-only files are
  skipped.
- `*.jsonl` / `*.ndjson`: one JSON object per line with a `text` string or an `input_ids` list of token
  ids (the first record decides which field every line must have); each line is a document; blank lines
  and records with empty text are skipped. A line may hold at most MAX_LINE_BYTES.
- `*.bin`: a pre-tokenized shard (see kdistill.data.binfmt).
- any other file: UTF-8 text, one document (a leading BOM is dropped).

Each reader takes an open binary stream, so it can be tested (and fuzzed) on bytes in memory.
"""

from __future__ import annotations

import codecs
import dataclasses
import glob
import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from kdistill.errors import UserError

MAX_LINE_BYTES = 16 << 20  # a JSONL line longer than this is refused (bounded memory per line)
TEXT_BLOCK_BYTES = 1 << 20  # text is decoded and tokenized in blocks cut at newlines
JSONL_SUFFIXES = (".jsonl", ".ndjson")
_GLOB_CHARS = "*?["


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
