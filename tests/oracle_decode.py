"""The test oracle of generation: left-padded eager decoding through the decoder's own KV cache.

    new = generate_ids(model, [[1, 2, 3], [4, 5]], Sampling(max_new_tokens=8), stop_ids={0})

Every product path generates with the decode engine (kdistill.decode.DecodeEngine); this is the
independent reference the engine is compared with, token for token. Prompts of different lengths are
left-padded to the longest; padding slots are excluded from attention by the KV cache's mask and each
row's positions start at 0 on its first real token (as transformers' `generate` does with an attention
mask), so a row's tokens do not depend on its batch. The prompt runs once (prefill), then one token per
step through Decoder.forward_cached. Greedy below decode.MIN_TEMPERATURE; otherwise logits /
temperature, top-k, top-p, drawn by torch.multinomial from a generator seeded by `seed` (other draws
than the engine's inverse CDF: sampled tokens are compared for reproducibility, not for equality).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kdistill.decode import Sampling
from kdistill.models.decoder import Decoder, KVCache

GREEDY = Sampling()  # 128 new tokens


def pick(logits: torch.Tensor, s: Sampling, gen: torch.Generator | None) -> torch.Tensor:
    """Next token per row from fp32 logits (B, V) -> (B,)."""
    if s.greedy:
        return logits.argmax(-1)
    logits = logits / s.temperature
    if s.top_k:
        kth = torch.topk(logits, min(s.top_k, logits.shape[-1])).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if s.top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs >= s.top_p  # tokens after the first ones that reach p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
    return torch.multinomial(logits.softmax(-1), 1, generator=gen).squeeze(1)


def left_pad(
    prompts: Sequence[Sequence[int]], pad_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, positions, valid), each (B, P): prompts right-aligned, padding positions 0 and invalid."""
    p = max(len(x) for x in prompts)
    ids = torch.full((len(prompts), p), pad_id, dtype=torch.long)
    valid = torch.zeros((len(prompts), p), dtype=torch.bool)
    for i, row in enumerate(prompts):
        ids[i, p - len(row) :] = torch.tensor(list(row), dtype=torch.long)
        valid[i, p - len(row) :] = True
    pos = (valid.long().cumsum(1) - 1).clamp(min=0)
    return ids.to(device), pos.to(device), valid.to(device)


@torch.no_grad()
def generate_ids(
    model: Decoder,
    prompts: Sequence[Sequence[int]],
    sampling: Sampling = GREEDY,
    stop_ids: Sequence[int] | set[int] = (),
    *,
    pad_id: int = 0,
) -> list[list[int]]:
    """New token ids per prompt (each non-empty), a row's stop token included as its last id."""
    device = model.lm_head_weight.device
    ids, pos, valid = left_pad(prompts, pad_id, device)
    b, p = ids.shape
    n = sampling.max_new_tokens
    cache = KVCache.empty(model.spec, batch=b, max_len=p + n, device=device, dtype=model.lm_head_weight.dtype)
    gen = None if sampling.greedy else torch.Generator(device=device).manual_seed(int(sampling.seed))
    stops = torch.tensor(sorted(set(stop_ids)) or [-1], dtype=torch.long, device=device)
    w = model.lm_head_weight  # (V, H)
    h = model.forward_cached(ids, pos, valid, cache)[:, -1]  # (B, H)
    next_pos = pos[:, -1:] + 1  # (B, 1)
    out: list[list[int]] = [[] for _ in range(b)]
    done = torch.zeros(b, dtype=torch.bool, device=device)
    ones = torch.ones((b, 1), dtype=torch.bool, device=device)
    for step in range(n):
        tok = pick((h @ w.t()).float(), sampling, gen)  # (B,)
        tok = torch.where(done, torch.full_like(tok, pad_id), tok)
        was_done = done.tolist()
        done = done | torch.isin(tok, stops)
        for i, t in enumerate(tok.tolist()):
            if not was_done[i]:
                out[i].append(t)
        if bool(done.all()) or step == n - 1:
            break
        h = model.forward_cached(tok[:, None], next_pos, ones, cache)[:, -1]
        next_pos = next_pos + 1
    return out
