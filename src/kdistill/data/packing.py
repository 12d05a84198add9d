"""Split by document, join with EOS and pack into fixed-length training sequences.

    data = prepare_data(cfg.data, tokenizer, seed=0)   # PreparedData: .train, .heldout (N, seq_len+1) int64
    print(data.summary())                               # how many tokens and sequences each side has

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

import dataclasses
import hashlib
from typing import Any

import numpy as np

from kdistill.data.cache import TokenCache, cache_dir
from kdistill.data.load import load_files
from kdistill.data.sources import TokenDocs
from kdistill.errors import UserError


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
    """Packed training and held-out sequences, (N, seq_len + 1) int64 each, and what went into them;
    for conversations (kdistill.data.chat_data) two PackedRows instead (stats["format"] says so)."""

    train: np.ndarray
    heldout: np.ndarray
    stats: dict[str, Any]

    @property
    def documents(self) -> bool:
        """True for packed conversations (batches carry position and document ids)."""
        return self.stats.get("format") == "conversations"

    def summary(self) -> str:
        s = self.stats
        if self.documents:
            return (
                f"data: {s['train_documents']} conversations in {s['train_sequences']} rows of {s['seq_len']} "
                f"tokens (packing efficiency {s['packing_efficiency']:.1%}, {s['train_learned_tokens']:,} "
                f"learned tokens), {s['heldout_documents']} held-out conversations in "
                f"{s['heldout_sequences']} rows; template {s['chat_template']}, train_on={s['train_on']}"
            )
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
