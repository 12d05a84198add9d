"""Loading data files: every file of a list of paths, read by its kind, through the token cache.

    files, skipped = load_files(["corpus/"], tokenizer, TokenCache(cache_dir()))
    files[0].docs.doc(0)      # the first document's tokens
    files[0].key(0)           # its split key: "relative/path" or "relative/path:LINE"

Text and JSONL files are tokenized once and cached (see kdistill.data.cache); `.bin` shards are
memory-mapped (see kdistill.data.binfmt).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kdistill.data.binfmt import read_bin
from kdistill.data.cache import TokenCache
from kdistill.data.sources import FileSpec, TokenDocs, UndecodableError, expand_paths, read_jsonl, read_text
from kdistill.errors import UserError
from kdistill.fileio import file_sha256

log = logging.getLogger("kdistill.data")


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
