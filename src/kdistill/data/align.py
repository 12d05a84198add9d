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
