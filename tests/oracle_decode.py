"""The test oracle of generation: left-padded eager decoding through the decoder's own KV cache.

    new = generate_ids(model, [[1, 2, 3], [4, 5]], Sampling(max_new_tokens=8), stop_ids={0})

Every product path generates with the decode engine (kdistill.decode.DecodeEngine); this is the
independent reference the engine is compared with, token for token. Prompts of different lengths are
left-padded to the longest; padding slots are excluded from attention by the KV cache's mask and each
row's positions start at 0 on its first real token (as transformers' `generate` does with an attention
mask), so a row's tokens do not depend on its batch. The prompt runs once (prefill), then one token per
step through this file's own KV cache (`forward_cached`: the decoder's modules, attention by SDPA over
the cached keys with the cache's mask), independent of the engine's static cache and kernels. Greedy below decode.MIN_TEMPERATURE; otherwise logits /
temperature, top-k, top-p, drawn by torch.multinomial from a generator seeded by `seed` (other draws
than the engine's inverse CDF: sampled tokens are compared for reproducibility, not for equality).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from kdistill.decode import Sampling
from kdistill.dispatch import add_rmsnorm, apply_rope, rmsnorm
from kdistill.models.decoder import Decoder
from kdistill.models.spec import ModelSpec

GREEDY = Sampling()  # 128 new tokens


@dataclasses.dataclass
class KVCache:
    """Keys and values of every layer: k[i], v[i] (B, Hkv, max_len, D), slots 0..length-1 filled;
    valid (B, max_len) False for a left-padding slot, which no query attends to."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    valid: torch.Tensor
    length: int = 0

    @classmethod
    def empty(
        cls, spec: ModelSpec, *, batch: int, max_len: int, device: torch.device | str, dtype: torch.dtype
    ) -> KVCache:
        shape = (batch, spec.num_kv_heads, max_len, spec.head_dim)
        return cls(
            k=[torch.zeros(shape, device=device, dtype=dtype) for _ in range(spec.num_layers)],
            v=[torch.zeros(shape, device=device, dtype=dtype) for _ in range(spec.num_layers)],
            valid=torch.zeros((batch, max_len), dtype=torch.bool, device=device),
        )

    @property
    def max_len(self) -> int:
        return self.valid.shape[1]

    def mask(self, t: int) -> torch.Tensor:
        """(B, 1, t, length + t) bool for t new tokens: causal over the filled slots, padding excluded;
        each query always sees its own slot (no empty row)."""
        s0, s = self.length, self.length + t
        keys = torch.arange(s, device=self.valid.device)
        queries = torch.arange(s0, s, device=self.valid.device)
        causal = keys[None, :] <= queries[:, None]  # (t, S)
        own = keys[None, :] == queries[:, None]
        return ((causal[None] & self.valid[:, None, :s]) | own[None]).unsqueeze(1)  # (B, 1, t, S)


def _attend(attn, x, cos, sin, mask, k_cache, v_cache, start: int) -> torch.Tensor:
    """One attention module on x (B, T, H) at cache slots start..start+T-1; writes this step's keys."""
    b, t, _ = x.shape
    s = attn.spec
    q = attn.q_proj(x).view(b, t, s.num_heads, s.head_dim)
    k = attn.k_proj(x).view(b, t, s.num_kv_heads, s.head_dim)
    v = attn.v_proj(x).view(b, t, s.num_kv_heads, s.head_dim)
    if s.qk_norm:
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, T, D)
    q, k = apply_rope(q, k, cos, sin)
    k_cache[:, :, start : start + t] = k
    v_cache[:, :, start : start + t] = v
    end = start + t
    o = F.scaled_dot_product_attention(
        q, k_cache[:, :, :end], v_cache[:, :, :end], attn_mask=mask, enable_gqa=s.num_heads != s.num_kv_heads
    )  # (B, Hq, T, D)
    return attn.o_proj(o.transpose(1, 2).reshape(b, t, s.q_size))


@torch.no_grad()
def forward_cached(
    model: Decoder, input_ids: torch.Tensor, position_ids: torch.Tensor, valid: torch.Tensor, cache: KVCache
) -> torch.Tensor:
    """input_ids (B, T) into cache slots length..length+T-1 -> final-normed hidden states (B, T, H);
    position_ids (B, T) each token's position; valid (B, T) False for padding. The cache advances by T."""
    t, start, eps = input_ids.shape[1], cache.length, model.spec.rms_eps
    if start + t > cache.max_len:
        raise ValueError(f"KV cache holds {cache.max_len} tokens; {start} + {t} do not fit")
    cos, sin = model.rope(cache.max_len, input_ids.device)
    cos, sin = cos[position_ids], sin[position_ids]  # (B, T, D)
    cache.valid[:, start : start + t] = valid
    mask = cache.mask(t)
    delta, residual = model.model.embed_tokens(input_ids), None
    for i, block in enumerate(model.model.layers):
        if residual is None:
            residual = delta
            h = rmsnorm(delta, block.input_layernorm.weight, eps, to_gemm=True)
        else:
            h, residual = add_rmsnorm(delta, residual, block.input_layernorm.weight, eps, to_gemm=True)
        a = _attend(block.self_attn, h, cos, sin, mask, cache.k[i], cache.v[i], start)
        x, residual = add_rmsnorm(a, residual, block.post_attention_layernorm.weight, eps, to_gemm=True)
        delta = block.mlp(x)
    cache.length = start + t
    if residual is None:
        return rmsnorm(delta, model.model.norm.weight, eps, to_gemm=True)
    return add_rmsnorm(delta, residual, model.model.norm.weight, eps, to_gemm=True)[0]


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
    h = forward_cached(model, ids, pos, valid, cache)[:, -1]  # (B, H)
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
        h = forward_cached(model, tok[:, None], next_pos, ones, cache)[:, -1]
        next_pos = next_pos + 1
    return out
