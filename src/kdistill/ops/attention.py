"""Causal grouped-query attention through PyTorch SDPA (flash / cuDNN / math backends).

Shapes: q (B, Hq, T, D), k and v (B, Hkv, T, D) with Hq a multiple of Hkv -> (B, Hq, T, D).
No hand-written kernel: SDPA picks the fastest backend for the device. kdistill.dispatch records a
library key (shape, dtype, grad, masked) so that prewarm runs SDPA once at the real shapes before training.

Packed conversations attend inside their own conversation only: `document_mask(doc_ids)` builds the
(B, 1, T, T) boolean mask (True: may attend) that is causal within each document, and attention takes
it instead of `is_causal=True`. Without a mask the call is exactly the plain causal one. The decoder
passes `document_bias(doc_ids, dtype)` instead: the same mask as an additive bias (0 or -inf) in the
attention's dtype, built once per forward in blocks of queries and shared by every layer. A boolean
mask would be converted by SDPA in every layer call (a new (B, 1, T, T) tensor in the query's dtype,
plus a negated boolean copy while converting), and each layer's memory-efficient attention would keep
its own converted copy for backward; the bias is one tensor, kept once (memory.document_mask_bytes).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kdistill.ops.rope import rope_reference


def document_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """(B, 1, T, T) bool from (B, T) document ids: query q may attend to key k when k <= q and both
    belong to the same document (padding, id -1, attends only to padding, so no row is empty)."""
    same = doc_ids[:, :, None] == doc_ids[:, None, :]  # (B, T, T)
    t = doc_ids.shape[-1]
    causal = torch.ones(t, t, dtype=torch.bool, device=doc_ids.device).tril()
    return (same & causal).unsqueeze(1)


BIAS_ALIGN = 16  # elements: memory-efficient SDPA copies (pads) a bias whose row stride is not a multiple
BIAS_BLOCK_ELEMENTS = 1 << 24  # query rows x keys of the boolean temporaries built at once


def bias_row_stride(t: int) -> int:
    """Elements between two query rows of a document bias over t keys (t rounded up to BIAS_ALIGN)."""
    return -(-t // BIAS_ALIGN) * BIAS_ALIGN


def document_bias(doc_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(B, 1, T, T) additive attention bias in `dtype` from (B, T) document ids: 0 where
    `document_mask` allows (same document, key <= query), -inf elsewhere. A view of a (B, 1, T, Tp)
    buffer with Tp = bias_row_stride(T), so that memory-efficient SDPA takes it without a padded copy.
    Built in blocks of query rows, so the boolean temporaries stay at most BIAS_BLOCK_ELEMENTS x B."""
    b, t = doc_ids.shape
    tp = bias_row_stride(t)
    buf = torch.empty((b, 1, t, tp), dtype=dtype, device=doc_ids.device)
    bias = buf[..., :t]  # (B, 1, T, T), row stride Tp
    keys = torch.arange(t, device=doc_ids.device)
    step = max(1, BIAS_BLOCK_ELEMENTS // max(1, b * t))
    zero = torch.zeros((), dtype=dtype, device=doc_ids.device)
    neg = torch.full((), float("-inf"), dtype=dtype, device=doc_ids.device)
    for start in range(0, t, step):
        stop = min(t, start + step)
        same = doc_ids[:, start:stop, None] == doc_ids[:, None, :]  # (B, Q, T)
        causal = keys[None, :] <= keys[start:stop, None]  # (Q, T)
        bias[:, 0, start:stop] = torch.where(same & causal, zero, neg)
    return bias


def attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Causal softmax(q k^T / sqrt(D)) v with k/v heads shared by groups of q heads; with `mask`
    (B, 1, T, T), bool (see document_mask) or an additive bias (see document_bias), the mask replaces
    the causal one.

    SDPA's own grouped-query support (`enable_gqa`) reads each k/v head for its group of q heads, so
    no (B, Hq, T, D) copies of k and v are made, stored for backward, or reduced in backward."""
    gqa = q.shape[1] != k.shape[1]
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    if mask.dtype != torch.bool and mask.dtype != q.dtype:  # SDPA takes a bias in the query's dtype only
        mask = mask.to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


def decode_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pos: torch.Tensor,
    k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
) -> torch.Tensor:
    """One new token per row over a static cache: q (B, Hq, D), k_cache and v_cache (B, Hkv, M, D),
    pos (B,) the row's newest slot; k_new and v_new (B, Hkv, D), when given, are written into slot
    pos[b] first (in place: the step's token joins the cache). -> (B, Hq, D) attending slots 0..pos[b]
    of row b (the kernel reads only those; here a (B, 1, 1, M) mask hides the rest). cos and sin (fp32
    (M', D) tables), when given: q and k_new are unrotated, and RoPE at position pos[b] comes first."""
    if cos is not None and sin is not None and k_new is not None:
        c, s = cos[pos][:, None], sin[pos][:, None]  # (B, 1, D)
        q, k_new = rope_reference(q, k_new, c, s)
    if k_new is not None and v_new is not None:
        rows = torch.arange(q.shape[0], device=q.device)
        k_cache[rows, :, pos] = k_new
        v_cache[rows, :, pos] = v_new
    m = k_cache.shape[2]
    mask = torch.arange(m, device=q.device)[None, :] <= pos[:, None]  # (B, M)
    gqa = q.shape[1] != k_cache.shape[1]
    o = F.scaled_dot_product_attention(
        q[:, :, None], k_cache, v_cache, attn_mask=mask[:, None, None, :], enable_gqa=gqa
    )
    return o[:, :, 0]


def decode_attention_multi_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    start: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
) -> torch.Tensor:
    """T new tokens per row over a static cache, as T calls of decode_attention_reference in order:
    q (B, Hq, T, D), k_cache and v_cache (B, Hkv, M, D), start (B,) >= 0, k_new and v_new (B, Hkv, T, D).
    Token j goes to slot p_j = min(start[b] + j, M - 1): its key and value are written there (in order,
    so a slot the clamp repeats keeps its last token), and it attends the slots before p_j and its own
    key -> (B, Hq, T, D). cos and sin (fp32 (M', D) tables), when given: q and k_new are unrotated, and
    RoPE at position p_j comes first."""
    b, _, t, _ = q.shape
    m = k_cache.shape[2]
    pos = (start[:, None] + torch.arange(t, device=q.device)).clamp(max=m - 1)  # (B, T)
    if cos is not None and sin is not None:
        q, k_new = rope_reference(q, k_new, cos[pos][:, None], sin[pos][:, None])  # tables (B, 1, T, D)
    k_new, v_new = k_new.to(k_cache.dtype), v_new.to(v_cache.dtype)
    rows = torch.arange(b, device=q.device)
    for j in range(t):  # token j's write before token j + 1's: the last one stays in a repeated slot
        k_cache[rows, :, pos[:, j]] = k_new[:, :, j]
        v_cache[rows, :, pos[:, j]] = v_new[:, :, j]
    # each token attends the cached slots before its own (written by earlier tokens or before the
    # step) and its own key: keys [cache | the step's T], masked (B, 1, T, M + T)
    before = torch.arange(m, device=q.device)[None, None, :] < pos[:, :, None]  # (B, T, M)
    own = torch.eye(t, dtype=torch.bool, device=q.device).expand(b, t, t)
    mask = torch.cat([before, own], -1)[:, None]
    keys, values = torch.cat([k_cache, k_new], 2), torch.cat([v_cache, v_new], 2)
    gqa = q.shape[1] != k_cache.shape[1]
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=gqa)
