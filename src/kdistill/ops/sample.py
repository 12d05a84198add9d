"""A decode step's sampler and bookkeeping: the next token of every row from the lm_head's logits, and
the rows' state after it (kdistill.decode's engine keeps that state in its slots).

    tok = sample_tokens(logits, sampling, u)          # (B, V) -> (B,): greedy, or inverse CDF at u
    append(tok, rows.lens + 1, rows)                  # rows: Rows, every row's state, updated in place
    sample_append(logits, u, sampling, rows)          # both (the decode step)

Reference math only (PyTorch, no host synchronisation: graph-safe); kdistill.dispatch picks it or
the Triton kernel in kernels/decode_sample.py (greedy, or a temperature without top-k and top-p).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F


def sample_tokens(logits: torch.Tensor, s: Any, u: torch.Tensor | None) -> torch.Tensor:
    """Next token per row from logits (B, V) -> (B,) int64, with no host synchronisation (it runs
    inside the captured step). u (B,): uniform numbers in [0, 1) (unused when greedy). Greedy takes the
    argmax of the logits as they are (bf16 on a GPU): widening is exact, so the token is the same, and
    no fp32 copy of (B, V) is written and read back."""
    if s.greedy or u is None:
        return logits.argmax(-1)
    logits = logits.float()
    logits = logits / s.temperature
    idx = None
    if s.top_k and s.top_k < logits.shape[-1]:
        logits, idx = torch.topk(logits, s.top_k, dim=-1)  # (B, k), sorted descending
    elif s.top_p < 1:
        logits, idx = logits.sort(dim=-1, descending=True)
    probs = logits.softmax(-1)
    if s.top_p < 1:  # keep the most probable tokens up to the first whose cumulative mass reaches p
        drop = probs.cumsum(-1) - probs >= s.top_p
        probs = probs.masked_fill(drop, 0.0)
    choice = inverse_cdf(probs, u)[:, None]  # (B, 1)
    if idx is not None:
        choice = idx.gather(1, choice)
    return choice[:, 0]


CDF_BLOCK = 128  # tokens per block of inverse_cdf's two-level search


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of probs (N, V) (any non-negative mass, not necessarily normalised) at u (N,) in
    [0, 1): the first token whose cumulative mass exceeds u times the row's total (never a token of mass
    0). No host sync, fixed shapes (graph-safe).

    Two levels, so no scan runs over the whole vocabulary (a (N, 151936) cumsum is one slow kernel of
    ~190 µs on an H200, an eighth of a sampled decode step): the blocks of CDF_BLOCK tokens are summed
    and searched first, then the chosen block's own cumulative sum. The token is the one-level search's
    up to the rounding of the two sums' orders."""
    n, v = probs.shape
    nb = -(-v // CDF_BLOCK)
    p = F.pad(probs, (0, nb * CDF_BLOCK - v)) if nb * CDF_BLOCK != v else probs
    blocks = p.view(n, nb, CDF_BLOCK)
    outer = blocks.sum(-1).cumsum(-1)  # (N, nb)
    target = u.to(outer.dtype)[:, None] * outer[:, -1:]  # (N, 1)
    j = torch.searchsorted(outer, target, right=True).clamp_(max=nb - 1)  # (N, 1): a block of mass > 0
    before = torch.where(j > 0, outer.gather(1, (j - 1).clamp(min=0)), torch.zeros_like(target))
    row = blocks.gather(1, j[:, :, None].expand(n, 1, CDF_BLOCK))[:, 0]  # (N, CDF_BLOCK)
    inner = row.cumsum(-1)
    k = torch.searchsorted(inner, target - before, right=True)  # (N, 1)
    # rounding may put the residual at or past the block's total: its last token of mass > 0 then
    last = CDF_BLOCK - 1 - (row > 0).flip(-1).int().argmax(-1, keepdim=True)
    k = torch.minimum(k, last)
    return (j * CDF_BLOCK + k).clamp_(max=v - 1)[:, 0]


class Rows(NamedTuple):
    """Every row's state that a decode step's bookkeeping updates in place (the decode engine's slots hold
    the tensors), and what it reads besides: tok (B,) int64 the token each row feeds next, lens (B,)
    int64 its filled slots, ngen (B,) int64 the new tokens it has written to out (B, N) int64, limit (B,)
    int64 its budget of new tokens, done (B,) bool; stops (S,) int64 the stop ids, pad_id the token a
    done row writes, max_len the cache's slots a row."""

    tok: torch.Tensor
    lens: torch.Tensor
    ngen: torch.Tensor
    limit: torch.Tensor
    done: torch.Tensor
    out: torch.Tensor
    stops: torch.Tensor
    pad_id: int
    max_len: int


def append(tok: torch.Tensor, new_lens: torch.Tensor, rows: Rows, at: torch.Tensor | None = None) -> None:
    """The bookkeeping of rows `at` ((n,) indices; None: every row) after sampling `tok` (n,), in place:
    the token is a row's next output (out[b, ngen[b]]) unless the row is done (then the pad id); an
    active row's fed token now fills its slots up to new_lens (n,); it is done on a stop id, at its
    budget (ngen >= limit) or with a full cache (lens >= max_len); rows.tok takes the token it feeds
    next."""
    i = torch.arange(len(tok), device=tok.device) if at is None else at
    done = rows.done[i]
    active = ~done
    tok = torch.where(active, tok, torch.full_like(tok, rows.pad_id))
    ngen = rows.ngen[i]
    rows.out[i, ngen] = tok
    ngen = ngen + active
    lens = torch.where(active, new_lens, rows.lens[i])
    stop = (tok[:, None] == rows.stops[None, :]).any(-1) | (ngen >= rows.limit[i]) | (lens >= rows.max_len)
    rows.ngen[i] = ngen
    rows.lens[i] = lens
    rows.done[i] = done | (active & stop)
    rows.tok[i] = tok


def sample_append(logits: torch.Tensor, u: torch.Tensor, s: Any, rows: Rows) -> None:
    """A decode step's sampler and bookkeeping for every row: the token from logits (B, V) (u: the
    rows' uniforms, unused when greedy), each row's fed token filling one more slot."""
    append(sample_tokens(logits, s, u), rows.lens + 1, rows)
