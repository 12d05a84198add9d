"""Pack tokenized conversations into fixed-length rows without cross-talk, and show what is learned.

    rows = pack_conversations(tokenized, seq_len=2048, pad_id=0)    # PackedRows
    rows.input_ids, rows.labels, rows.position_ids, rows.doc_ids     # (R, seq_len) each
    rows.cu_seqlens(0)                                              # [0, n1, n1+n2, ..., seq_len] int32
    mask = document_attention_mask(torch.from_numpy(rows.doc_ids))  # (R, T, T) bool, causal per conversation
    print(rows.summary())                                           # conversations, rows, efficiency
    preview_json(rows, n=3)                                         # what `data preview --json` prints
    print(render_preview(rows, 0, tokenizer.decode))                # learned tokens marked or coloured

A row holds whole conversations one after another, then padding. Per row:
- `labels[i]` is the target of position i (the batcher's convention, inputs shifted by one inside a
  conversation): input_ids[i + 1] when that token is learned, else the ignore index. The last token
  of a conversation never predicts the first of the next: its label is always the ignore index.
- `position_ids` restart at 0 for each conversation (padding continues 0, 1, ... as its own segment).
- `doc_ids` number the conversations of the row 0, 1, ...; padding is -1. Attention is allowed from
  query q to key k when doc_ids[q] == doc_ids[k] and k <= q; `cu_seqlens` gives the same boundaries
  for varlen attention kernels (padding, if any, is the last segment).

Placement is online best fit: each conversation, in order, goes to the open row with the least room
that still fits it, else to a new row. A conversation longer than seq_len is truncated to its first
seq_len tokens (counted as `truncated`; dropped, and counted, when nothing learned is left), or is a
UserError naming it with truncate=False. Conversations with nothing to learn are dropped and counted.
Packing efficiency = real tokens / (rows x seq_len).
"""

from __future__ import annotations

import bisect
import dataclasses
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from kdistill.data.chat import TokenizedConversation
from kdistill.errors import UserError

TRAIN_OPEN, TRAIN_CLOSE = "[[", "]]"  # around learned text when the output is not a terminal
_GREEN, _DIM, _RESET = "\x1b[32m", "\x1b[2m", "\x1b[0m"


@dataclasses.dataclass
class PackedRows:
    """Packed rows of conversations (all arrays (R, seq_len)) and what packing did.

    Attributes:
        input_ids, labels, position_ids: int64; doc_ids: int32 (-1 on padding).
        sources: per row, the source ("file:line") of each conversation in it, in order.
        real_tokens: conversation tokens placed (padding excluded).
        conversations: conversations placed; truncated: of those, cut to seq_len;
        dropped: conversations left out (nothing to learn, or nothing left after truncation).
        prompt_ends: (R, seq_len) bool or None: True at the last token of each conversation's prompt
            (the conversation up to its first answer, the answer's generation prompt included) where
            packing was told it (data.train_on=all, whose labels do not show it); None: each prompt
            ends where the first learned token's input is (see kdistill.generate.sample_prompts).
    """

    input_ids: np.ndarray
    labels: np.ndarray
    position_ids: np.ndarray
    doc_ids: np.ndarray
    sources: list[list[str]]
    seq_len: int
    ignore_index: int
    real_tokens: int = 0
    conversations: int = 0
    truncated: int = 0
    dropped: int = 0
    prompt_ends: np.ndarray | None = None
    # per row, the index (in the list packed) of each conversation in it, in order
    members: list[list[int]] = dataclasses.field(default_factory=list)

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def efficiency(self) -> float:
        """Real tokens / slots (rows x seq_len); 0.0 with no rows."""
        slots = len(self) * self.seq_len
        return self.real_tokens / slots if slots else 0.0

    def cu_seqlens(self, row: int) -> np.ndarray:
        """(n_segments + 1,) int32 cumulative boundaries of row `row`: each conversation, then the
        padding (when there is any) as the last segment."""
        d = self.doc_ids[row]
        cuts = np.flatnonzero(d[1:] != d[:-1]) + 1
        return np.concatenate([[0], cuts, [len(d)]]).astype(np.int32)

    def learned_tokens(self) -> int:
        return int((self.labels != self.ignore_index).sum())

    def summary(self) -> str:
        parts = [
            f"{self.conversations} conversations in {len(self)} rows of {self.seq_len} tokens",
            f"packing efficiency {self.efficiency:.1%} (real tokens / slots)",
            f"{self.learned_tokens()} learned tokens",
        ]
        if self.truncated:
            parts.append(f"{self.truncated} truncated to seq_len")
        if self.dropped:
            parts.append(f"{self.dropped} dropped (nothing to learn)")
        return "; ".join(parts)


def pack_conversations(
    convs: Sequence[TokenizedConversation],
    seq_len: int,
    pad_id: int = 0,
    ignore_index: int = -100,
    truncate: bool = True,
    prompt_lens: Sequence[int] | None = None,
    sizes: Sequence[int] | None = None,
) -> PackedRows:
    """Pack tokenized conversations into rows of `seq_len` tokens (see the module docstring).
    prompt_lens: per conversation, the tokens of its prompt (recorded as PackedRows.prompt_ends).

    `sizes`: the room each conversation takes in a row, when more than its tokens (a cross-tokenizer
    run packs by the longer of its two tokenizations, so the teacher's side fits a row too).

    Raises:
        UserError: seq_len < 2; or, with truncate=False, a conversation longer than seq_len (named).
    """
    if seq_len < 2:
        raise UserError(f"seq_len is {seq_len}, expected at least 2 to pack conversations")
    pieces: list[tuple[np.ndarray, np.ndarray, str]] = []  # (ids, labels, source)
    kept_prompts: list[int] = []  # the prompt's tokens of each piece (prompt_lens given)
    index: list[int] = []  # the conversation of each piece
    truncated = dropped = 0
    for k, c in enumerate(convs):
        ids, labels = c.input_ids, c.labels(ignore_index)
        if len(ids) > seq_len:
            if not truncate:
                raise UserError(
                    f"{c.source}: conversation is {len(ids)} tokens, longer than seq_len {seq_len} "
                    "(shorten it, raise seq_len, or allow truncation)"
                )
            ids, labels = ids[:seq_len], labels[:seq_len].copy()
            labels[-1] = ignore_index  # its target was cut off
            truncated += 1
            if not (labels != ignore_index).any():
                dropped += 1
                continue
        elif len(ids) == 0 or not (labels != ignore_index).any():
            dropped += 1
            continue
        pieces.append((ids, labels, c.source))
        if prompt_lens is not None:
            kept_prompts.append(max(1, min(int(prompt_lens[k]), len(ids))))
        index.append(k)

    # Online best fit: `free` holds (room left, row) sorted, for the rows still open.
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []
    for i, (ids, _, _) in enumerate(pieces):
        n = min(max(len(ids), sizes[index[i]]), seq_len) if sizes is not None else len(ids)
        j = bisect.bisect_left(free, (n, -1))
        if j < len(free):
            room, r = free.pop(j)
        else:
            room, r = seq_len, len(rows)
            rows.append([])
        rows[r].append(i)
        if room - n > 0:
            bisect.insort(free, (room - n, r))

    R = len(rows)
    input_ids = np.full((R, seq_len), pad_id, dtype=np.int64)
    labels_out = np.full((R, seq_len), ignore_index, dtype=np.int64)
    position_ids = np.zeros((R, seq_len), dtype=np.int64)
    doc_ids = np.full((R, seq_len), -1, dtype=np.int32)
    prompt_ends = np.zeros((R, seq_len), dtype=bool) if prompt_lens is not None else None
    sources: list[list[str]] = []
    real = 0
    for r, members in enumerate(rows):
        pos = 0
        sources.append([])
        for d, i in enumerate(members):
            ids, labels, source = pieces[i]
            n = len(ids)
            input_ids[r, pos : pos + n] = ids
            labels_out[r, pos : pos + n] = labels
            position_ids[r, pos : pos + n] = np.arange(n)
            doc_ids[r, pos : pos + n] = d
            if prompt_ends is not None:
                prompt_ends[r, pos + kept_prompts[i] - 1] = True
            sources[r].append(source)
            pos += n
        position_ids[r, pos:] = np.arange(seq_len - pos)
        real += pos
    return PackedRows(
        input_ids=input_ids,
        labels=labels_out,
        position_ids=position_ids,
        doc_ids=doc_ids,
        sources=sources,
        seq_len=seq_len,
        ignore_index=ignore_index,
        real_tokens=real,
        conversations=len(pieces),
        truncated=truncated,
        dropped=dropped,
        prompt_ends=prompt_ends,
        members=[[index[i] for i in row] for row in rows],
    )


def document_attention_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """(B, T, T) bool mask from (B, T) doc_ids: True where query q may attend to key k, that is
    k <= q inside the same conversation (padding, doc -1, attends only to padding)."""
    same = doc_ids[:, :, None] == doc_ids[:, None, :]  # (B, T, T)
    T = doc_ids.shape[-1]
    causal = torch.ones(T, T, dtype=torch.bool, device=doc_ids.device).tril()
    return same & causal


# ---------------------------------------------------------------------------------------------------
# Preview


def _segments(rows: PackedRows, row: int) -> list[tuple[int, int, int]]:
    """(start, end, doc) of each conversation in `row`, padding excluded."""
    cu = rows.cu_seqlens(row)
    d = rows.doc_ids[row]
    return [(int(a), int(b), int(d[a])) for a, b in zip(cu[:-1], cu[1:]) if d[a] >= 0]


def preview_json(rows: PackedRows, n: int | None = None) -> list[dict[str, Any]]:
    """Per row (the first `n`, all when None), plain JSON types:
    {"row", "input_ids", "labels" (ignore index where masked), "position_ids", "cu_seqlens",
     "conversations": [{"source", "start", "end"}], "learned_tokens", "pad_tokens"}."""
    out = []
    count = len(rows) if n is None else min(n, len(rows))
    for r in range(count):
        segs = _segments(rows, r)
        out.append(
            {
                "row": r,
                "input_ids": rows.input_ids[r].tolist(),
                "labels": rows.labels[r].tolist(),
                "position_ids": rows.position_ids[r].tolist(),
                "cu_seqlens": rows.cu_seqlens(r).tolist(),
                "conversations": [{"source": rows.sources[r][d], "start": a, "end": b} for a, b, d in segs],
                "learned_tokens": int((rows.labels[r] != rows.ignore_index).sum()),
                "pad_tokens": int((rows.doc_ids[r] < 0).sum()),
            }
        )
    return out


def render_preview(
    rows: PackedRows, row: int, decode: Callable[[list[int]], str], color: bool | None = None
) -> str:
    """Row `row` as text: one header line per conversation, then its text with the learned tokens
    (the targets, labels[i - 1] != ignore) coloured green on a terminal and the rest dimmed, or,
    without colour, wrapped in TRAIN_OPEN / TRAIN_CLOSE. `color=None` asks whether stdout is a TTY.

    Consecutive tokens of the same kind are decoded together, so multi-byte characters stay whole."""
    if color is None:
        color = sys.stdout.isatty()
    ids = rows.input_ids[row]
    target = np.zeros(len(ids), dtype=bool)
    target[1:] = rows.labels[row][:-1] != rows.ignore_index
    lines = []
    for a, b, d in _segments(rows, row):
        lines.append(f"--- row {row}, conversation {d + 1}: {rows.sources[row][d]} (tokens {a}..{b - 1}) ---")
        parts = []
        i = a
        while i < b:
            j = i
            while j < b and target[j] == target[i]:
                j += 1
            text = decode([int(t) for t in ids[i:j]])
            if target[i]:
                parts.append(f"{_GREEN}{text}{_RESET}" if color else f"{TRAIN_OPEN}{text}{TRAIN_CLOSE}")
            else:
                parts.append(f"{_DIM}{text}{_RESET}" if color else text)
            i = j
        lines.append("".join(parts))
    pad = int((rows.doc_ids[row] < 0).sum())
    if pad:
        lines.append(f"--- {pad} padding tokens ---")
    return "\n".join(lines)
