"""Token alignment between two tokenizations of the same text (kd.cross_tokenizer).

    pairs = align_ends([3, 7, 8], [2, 7, 9])            # [1, 1, 1]: teacher position per student token
    t_ids, pairs = retokenize(student_tok, teacher_tok, row_ids)

Each student position i is paired with the teacher position j whose token ends at the same character
offset as student token i, or, when no teacher token ends there, at the nearest offset (ties: the earlier
teacher token). Both positions then predict what follows the same (or the nearest) point of the text.
"""

from __future__ import annotations

import bisect
from typing import Any

import numpy as np


def align_ends(student_ends: list[int], teacher_ends: list[int]) -> list[int]:
    """For each student token end offset, the index of the teacher token ending at it or nearest to it."""
    if not teacher_ends:
        raise ValueError("align_ends: the teacher tokenization is empty")
    out = []
    for e in student_ends:
        j = bisect.bisect_left(teacher_ends, e)  # first teacher end >= e
        if j == len(teacher_ends):
            out.append(j - 1)
        elif teacher_ends[j] == e or j == 0:
            out.append(j)
        else:
            out.append(j - 1 if e - teacher_ends[j - 1] <= teacher_ends[j] - e else j)
    return out


def token_ends(tok: Any, ids: list[int]) -> tuple[str, list[int]]:
    """(text of ids, the character offset where each of them ends in it). Re-encoding the text gives the
    offsets when it gives back the same ids; otherwise they are read from decoded prefixes."""
    text = tok.decode(ids)
    again, ends = tok.encode_offsets(text)
    if again == list(ids):
        return text, ends
    return text, [len(tok.decode(ids[: i + 1])) for i in range(len(ids))]


def retokenize(student_tok: Any, teacher_tok: Any, ids: list[int]) -> tuple[list[int], list[int]]:
    """(teacher token ids of the row's text, teacher position for each student position)."""
    text, s_ends = token_ends(student_tok, ids)
    t_ids, t_ends = teacher_tok.encode_offsets(text)
    if not t_ids:  # an empty text: one teacher token stands in (its logits are still a distribution)
        return [0], [0] * len(ids)
    return t_ids, align_ends(s_ends, t_ends)


def vocab_map(student_tok: Any, teacher_tok: Any) -> np.ndarray:
    """(Vs,) int64: for each student token id, the teacher token id that decodes to the same text, or -1.
    Only texts that one token alone decodes to in each vocabulary map (one to one); a token that decodes
    to a partial character (a byte-level piece of a UTF-8 sequence) maps to none."""

    def texts(tok: Any) -> dict[str, int]:
        backend = getattr(tok, "_tk", tok)
        size = backend.get_vocab_size(with_added_tokens=True)
        decoded = backend.decode_batch([[i] for i in range(size)], skip_special_tokens=False)
        seen: dict[str, int] = {}
        dup: set[str] = set()
        for i, t in enumerate(decoded):
            if not t or "\ufffd" in t:
                continue
            if t in seen:
                dup.add(t)
            seen.setdefault(t, i)
        return {t: i for t, i in seen.items() if t not in dup}

    s, t = texts(student_tok), texts(teacher_tok)
    out = np.full(
        getattr(student_tok, "_tk", student_tok).get_vocab_size(with_added_tokens=True), -1, np.int64
    )
    for text, i in s.items():
        j = t.get(text)
        if j is not None:
            out[i] = j
    return out


def exact_positions(
    next_ids: np.ndarray,
    ends: np.ndarray,
    next_ends: np.ndarray,
    pairs: np.ndarray,
    t_ids: np.ndarray,
    t_ends: np.ndarray,
    vmap: np.ndarray,
) -> np.ndarray:
    """(n,) bool: the paired positions whose text maps one to one. Student position i (its token ending
    at ends[i], its next token next_ids[i] ending at next_ends[i], both as offsets of the teacher's text)
    is exact when its partner j = pairs[i] ends at the same offset, the teacher's next token ends where
    the student's does and the two next tokens are the same text (vmap). pairs[i] < 0: not exact."""
    j = np.clip(pairs, 0, max(len(t_ids) - 2, 0))
    has_next = (pairs >= 0) & (pairs + 1 < len(t_ids))
    if not len(t_ids):
        return np.zeros(len(pairs), dtype=bool)
    same_point = t_ends[j] == ends
    nxt = np.minimum(j + 1, len(t_ids) - 1)
    same_next = (t_ends[nxt] == next_ends) & (vmap[np.clip(next_ids, 0, len(vmap) - 1)] == t_ids[nxt])
    return has_next & same_point & same_next & (next_ids >= 0) & (next_ids < len(vmap))
