"""A run's samples: its fixed held-out prompts and the greedy answers the decode engine writes to them.

    prompts = sample_prompts(heldout, 4)     # conversations up to their first answer, or raw text's start
    rows = answer_rows(student, prompts, 32, stops, tokenizer.decode, max_len=seq_len + 33)

At each eval the student (and, once, the teacher) answers a handful of prompts (samples.jsonl). The
answers come from the decode engine (kdistill.decode), as every generation does, built for the call and
dropped after it: on a CPU in the model's own dtype, sharing its tensors (only the stacked q/k/v and
gate/up are copies), stepping eagerly; on a GPU in bf16 (a copy of an fp32 student's weights; a bf16
teacher's unstacked tensors are shared), stepping eagerly too (a few dozen steps do not repay a graph
capture). The run's kernel plan holds the engine's keys at the samples' shapes and its memory plan the
engine's weights and cache (kernels.plan.required_kernels, memory.sample_engine_memory), so a sealed,
strict run launches nothing unplanned.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from kdistill.data.chat_pack import PackedRows
from kdistill.decode import DecodeEngine, Sampling
from kdistill.models.decoder import Decoder

RAW_PROMPT_TOKENS = 16  # raw-text held-out rows: the first tokens (at most half the row) are the prompt


def sample_prompts(heldout: Any, n: int) -> list[list[int]]:
    """The first n fixed prompts of a held-out set: for packed conversations, each conversation up to
    its first answer (the template's header of the answer included: up to its first learned token, or
    to PackedRows.prompt_ends where packing marked it, as data.train_on=all does); for raw windows
    (N, T + 1), the first min(16, T // 2) tokens of the first n rows."""
    out: list[list[int]] = []
    if isinstance(heldout, PackedRows):
        marks = heldout.prompt_ends  # data.train_on=all: where each prompt ends, marked when packed
        for r in range(len(heldout)):
            doc, labels, ids = heldout.doc_ids[r], heldout.labels[r], heldout.input_ids[r]
            for d in range(int(doc.max()) + 1 if (doc >= 0).any() else 0):
                where = np.flatnonzero(doc == d)
                ends = (
                    where[marks[r, where]]
                    if marks is not None
                    else where[labels[where] != heldout.ignore_index]
                )
                if len(ends) and len(out) < n:
                    out.append([int(t) for t in ids[where[0] : ends[0] + 1]])
        return out
    rows = np.asarray(heldout)
    k = max(1, min(RAW_PROMPT_TOKENS, (rows.shape[1] - 1) // 2)) if rows.ndim == 2 else 0
    return [[int(t) for t in rows[i, :k]] for i in range(min(n, len(rows)))]


def answer_rows(
    model: Decoder,
    prompts: list[list[int]],
    tokens: int,
    stops: set[int],
    decode: Callable[[list[int]], str],
    *,
    max_len: int = 0,
) -> list[dict[str, Any]]:
    """Greedy answers of `tokens` new tokens at most, as {"prompt", "answer", "answer_ids"} rows (the
    stop token left out of the text), written by a decode engine of len(prompts) rows and max_len cache
    slots (at least the longest prompt + tokens: the run passes the length its kernel plan was made for)."""
    need = max(len(p) for p in prompts) + tokens
    engine = DecodeEngine(
        model,
        batch_size=len(prompts),
        max_len=max(max_len, need),
        sampling=Sampling(max_new_tokens=tokens),
        stop_ids=stops,
        pad_id=min(stops, default=0),
        cuda_graphs="off",
    )
    new = engine.generate(prompts)
    out = []
    for p, row in zip(prompts, new):
        body = row[:-1] if row and row[-1] in stops else row
        out.append({"prompt": decode(p), "answer": decode(body), "answer_ids": row})
    return out
