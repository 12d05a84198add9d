"""Triton attention of new tokens (one, or T) per row over a static KV cache (generation): kernels, launchers.

    K[b, :, p_b], V[b, :, p_b] = k_new[b], v_new[b]          (the step's token joins the cache)
    o[b, h] = softmax(q[b, h] . K[b, h // G, 0..p_b]^T / sqrt(D)) V[b, h // G, 0..p_b]

q (B, Hq, D) is each row's newest token, at cache slot p_b = positions[b]; its key and value are read
from k_new and v_new (B, Hkv, D) and written into the cache by the program whose split holds p_b (no
separate scatter kernels); the caches K and V are (B, Hkv, M, D) contiguous, M the cache's length;
G = Hq / Hkv query heads share a key/value head. Only slots 0..p_b are read: a row's cost follows its filled length, not M, and no
mask over M is built (the decode step of kdistill.decode stays the same graph as rows grow).

Split-K ("flash decoding"): program (b, kv head, s) takes the slots [s * SPLIT, (s + 1) * SPLIT) of
its row, for all G query heads of that kv head at once (one tile of K and V serves G queries), and
writes an fp32 partial output and its log-sum-exp; a split past p_b returns at once (the row's `used`
splits, p_b // SPLIT + 1, are the ones that count). The last of a (b, kv head)'s used splits to arrive
(an acquire-release count, set back to zero by it) combines the parts of its G heads: o = sum_s
exp(lse_s - lse) o_s, with no kernel of its own. So a row's cost follows its filled length in the
combine too: a short row in a long cache reads back few parts. Where one split holds the whole row
(p_b < SPLIT: a row still short, or a wide step's short cache) it writes o directly: no parts, no
count. The newest slot is never read back from the cache: the split holding it starts its online
softmax from the new key's score and value, and its loop over cached tiles feeds the loads straight
to the dots (which lets Triton's pipeline stage them). The number of splits is a runtime grid size
(ceil(M / SPLIT)), so one binary serves every batch and cache length; D, the head counts and the
tiles are in the key. A step of more than WIDE_ROWS rows has programs enough without
short splits: its key takes splits of at least WIDE_SPLIT keys (split_len), fewer parts to combine; a
step of 17 to 32 rows (MID_ROWS) at least MID_SPLIT (half the programs of a short cache's 64-key
splits: the launches after the attention are placed sooner); a wide split over a short cache keeps
three tiles in flight (num_stages). In a small bucket's decode step (runtime.chained) it launches with
programmatic dependent launch (keys.pdl) and reads its first tile of cached keys and values before the
wait for the previous kernel (key PRELOAD).

RoPE (key ROPE): the decode engine hands q and the new key over unrotated, straight from the q/k/v
GEMM's output (q's rows strided by that output's width); the split kernel rotates them at the row's
position pos[b] in registers, from the fp32 cos/sin tables, and caches the rotated key. Scores are then
q1.k1 + q2.k2 over the two halves of a head: no rotated head is assembled, and the step needs no RoPE
kernel (nor the gathers of the tables' rows).

T new tokens per row in one launch (decode_attn_multi_split; speculative decoding's draft and verify
steps, DecodeEngine.forward_at): token j of row b goes to slot p_bj = min(start[b] + j, M - 1) and
attends the slots before p_bj and its own key, exactly what T one-token launches in order compute
(the clamp: a row at the cache's end repeats its last slot, each token there seeing only its own key,
and the slot keeps the last token's). q (B, Hq, T, D), k_new and v_new (B, Hkv, T, D) are views of
the step's q/k/v output (heads contiguous, any token and row strides). Program (b, kv head, s) holds
a tile of T x G rows, the (token, q head) pairs of its kv head: the cached slots of its split below
c_b = min(start[b], M - 1) (slots no token of this step writes) are read once for all rows; the split
holding c_b then attends the step's own keys from registers (rotated at each token's slot with the key's
ROPE), causal among them, and writes them into the cache. No program reads a slot >= c_b, so the writes
race with no read and no barrier is needed. Parts are (B, T, Hq, S): the combine kernel runs over
B * T rows; a split past c_b returns at once with its log-sum-exp alone (-inf), whose output the
combine does not read. T is in the key (the tile's rows, the causal mask); a step of more
than MAX_ROWS rows runs as several launches in order (token_chunks). It is a kernel of its own rather
than a T parameter of the one-token kernel, so the plain decode step's kernel and key stay as they are.

The file reads top to bottom: kernels, launchers, key functions and tile policy, then the registered
KernelSpec. No backward: generation runs without gradients.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from kdistill.dtypes import torch_dtype
from kdistill.errors import KernelError
from kdistill.kernels import decode_gemv
from kdistill.kernels._triton import jit, pdl_release, pdl_wait, tl
from kdistill.kernels.keys import (
    KernelKey,
    dtype_name,
    launch_options,
    make_key,
    memoized,
    next_pow2,
    pdl,
    pdl_constexpr,
    step_buckets,
)
from kdistill.kernels.spec import Kernel, KernelSpec, tensor

INT32_MAX = 2**31 - 1


@jit
def _rope_halves(X, COS, SIN, trow, d2, HALF: tl.constexpr):
    """cos and sin of table row `trow`, each as its two halves (c1, c2, s1, s2), cast to X's dtype and
    back to fp32 as kernels/rope.py does (the rotation is then computed in fp32 and rounded once)."""
    c1 = tl.load(COS + trow + d2).to(X.dtype.element_ty).to(tl.float32)
    c2 = tl.load(COS + trow + HALF + d2).to(X.dtype.element_ty).to(tl.float32)
    s1 = tl.load(SIN + trow + d2).to(X.dtype.element_ty).to(tl.float32)
    s2 = tl.load(SIN + trow + HALF + d2).to(X.dtype.element_ty).to(tl.float32)
    return c1, c2, s1, s2


@jit
def _store_part(OP, LSE, part, gmask, m_i, l_i, acc, D: tl.constexpr):
    """A split's fp32 partial output and its log-sum-exp (a row the split holds no slot of, l_i = 0:
    lse -inf, weight 0 in the combination)."""
    d = tl.arange(0, D)
    filled = l_i > 0
    tl.store(
        LSE + part, tl.where(filled, m_i + tl.log(tl.where(filled, l_i, 1.0)), float("-inf")), mask=gmask
    )
    out = acc / tl.where(filled, l_i, 1.0)[:, None]
    tl.store(OP + part[:, None] * D + d[None, :], out, mask=gmask[:, None])


@jit
def _attend(qa, qb, ka, kb, v, nmask, m_i, l_i, acc, sm_scale, ROPE: tl.constexpr):
    """One tile of keys in the online softmax: scores qa.ka (+ qb.kb with ROPE: the two halves of the
    heads), masked to `nmask`; returns the updated (m_i, l_i, acc). A tile masked whole (an empty
    split's) leaves them as they were: its maximum is taken as 0, so no exp sees -inf - -inf."""
    scores = tl.dot(qa, tl.trans(ka))
    if ROPE:
        scores += tl.dot(qb, tl.trans(kb))
    scores = tl.where(nmask[None, :], scores * sm_scale, float("-inf"))  # (BLOCK_G, BLOCK_N) fp32
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@jit
def _cached_tile(K, V, kv, n, nmask, HALF: tl.constexpr, D: tl.constexpr, ROPE: tl.constexpr):
    """Slots n of the cache where nmask: (ka, kb, v), the keys as their two halves with ROPE (kb unused
    without). The loads feed the tile's dots directly (no select between load and dot), so the loop's
    pipeline can stage them."""
    rows = (kv + n)[:, None].to(tl.int64) * D
    if ROPE:
        dk = tl.arange(0, HALF)
        ka = tl.load(K + rows + dk[None, :], mask=nmask[:, None], other=0.0)
        kb = tl.load(K + rows + HALF + dk[None, :], mask=nmask[:, None], other=0.0)
    else:
        ka = tl.load(K + rows + tl.arange(0, D)[None, :], mask=nmask[:, None], other=0.0)
        kb = ka
    v = tl.load(V + rows + tl.arange(0, D)[None, :], mask=nmask[:, None], other=0.0)
    return ka, kb, v


@jit
def _split_body(
    Q, K, V, KN, VN, COS, SIN, b, h, heads, gmask, kv, last, start,
    sqn, skn, svn, sm_scale,
    D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
    ROPE: tl.constexpr, PDL: tl.constexpr, PRELOAD: tl.constexpr,
):  # fmt: skip
    """The split's slots [start, min(start + SPLIT, last + 1)) of row b, kv head h: the online
    softmax's (m_i, l_i, acc) over them.

    The cached slots [start, min(start + SPLIT, last)) are read from the cache; the row's newest slot
    `last` (which this step writes) is not read back: the split holding it starts its softmax from the
    new key's score and value, taken from registers, and writes them into the cache there. With PRELOAD
    (a chained key: PDL), the split's first tile of cached slots (and the RoPE tables' row) is loaded
    before the wait for the previous kernel: no kernel of the step's chain writes them (slots below
    `last` were written by earlier steps). Then q, the new key and value (this step's q/k/v product) are
    read. With ROPE they arrive unrotated and are rotated at the row's position in registers, before
    they are used or cached: scores are the two halves' dots (q1.k1 + q2.k2), so no rotated head is
    assembled."""
    HALF: tl.constexpr = D // 2 if ROPE else D
    d = tl.arange(0, D)
    dk = tl.arange(0, HALF)
    cend = tl.minimum(start + SPLIT, last)  # the split's cached slots: [start, cend)
    own = (last >= start) & (last < start + SPLIT)  # the split holds the newest slot
    first = start  # the first tile the loop below reads
    if PRELOAD:  # the first tile in registers across the wait (else the loop's pipeline reads it)
        n = start + tl.arange(0, BLOCK_N)
        nmask = n < cend
        ka, kb, v = _cached_tile(K, V, kv, n, nmask, HALF, D, ROPE)
        first = start + BLOCK_N
    if ROPE:
        c1, c2, s1, s2 = _rope_halves(Q, COS, SIN, last.to(tl.int64) * D, dk, HALF)
    pdl_wait(PDL)  # q, the new key and value come from this step's q/k/v product
    qrow = Q + b * sqn + heads[:, None] * D + dk[None, :]
    krow = KN + b * skn + h * D
    vn = tl.load(VN + b * svn + h * D + d)
    if ROPE:
        q1 = tl.load(qrow, mask=gmask[:, None], other=0.0).to(tl.float32)
        q2 = tl.load(qrow + HALF, mask=gmask[:, None], other=0.0).to(tl.float32)
        qa = (q1 * c1[None, :] - q2 * s1[None, :]).to(Q.dtype.element_ty)  # (BLOCK_G, HALF)
        qb = (q2 * c2[None, :] + q1 * s2[None, :]).to(Q.dtype.element_ty)
        k1 = tl.load(krow + dk).to(tl.float32)
        k2 = tl.load(krow + HALF + dk).to(tl.float32)
        ka_new = (k1 * c1 - k2 * s1).to(K.dtype.element_ty)  # (HALF,)
        kb_new = (k2 * c2 + k1 * s2).to(K.dtype.element_ty)
        s_new = tl.sum(qa.to(tl.float32) * ka_new.to(tl.float32)[None, :], axis=1)
        s_new += tl.sum(qb.to(tl.float32) * kb_new.to(tl.float32)[None, :], axis=1)
    else:
        qa = tl.load(qrow, mask=gmask[:, None], other=0.0)
        qb = qa
        ka_new = tl.load(krow + dk).to(K.dtype.element_ty)
        kb_new = ka_new
        s_new = tl.sum(qa.to(tl.float32) * ka_new.to(tl.float32)[None, :], axis=1)
    # the newest key first: the owning split's softmax starts from its score (weight 1, its value)
    m_i = tl.where(own, s_new * sm_scale, float("-inf"))  # (BLOCK_G,)
    l_i = tl.where(own, 1.0, 0.0) + tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.where(own, vn.to(V.dtype.element_ty).to(tl.float32)[None, :], 0.0) + tl.zeros(
        (BLOCK_G, D), tl.float32
    )
    if PRELOAD:
        m_i, l_i, acc = _attend(qa, qb, ka, kb, v, nmask, m_i, l_i, acc, sm_scale, ROPE)
    for n0 in range(first, cend, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        nmask = n < cend
        ka, kb, v = _cached_tile(K, V, kv, n, nmask, HALF, D, ROPE)
        m_i, l_i, acc = _attend(qa, qb, ka, kb, v, nmask, m_i, l_i, acc, sm_scale, ROPE)
    slot = (kv + last).to(tl.int64) * D
    tl.store(K + slot + dk, ka_new, mask=(dk * 0 + own) != 0)
    if ROPE:
        tl.store(K + slot + HALF + dk, kb_new, mask=(dk * 0 + own) != 0)
    tl.store(V + slot + d, vn.to(V.dtype.element_ty), mask=(d * 0 + own) != 0)
    return m_i, l_i, acc


@jit(do_not_specialize=["M", "NSPLIT", "sqn", "skn", "svn"])
def decode_attn_split_kernel(
    Q,
    K,
    V,
    POS,
    KN,
    VN,
    COS,
    SIN,
    OP,
    LSE,
    O,
    CNT,
    M,
    NSPLIT,
    sqn,
    skn,
    svn,
    sm_scale,
    D: tl.constexpr,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    G: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    ROPE: tl.constexpr,
    PDL: tl.constexpr,
    PRELOAD: tl.constexpr,
    LANES: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.program_id(2)
    pdl_release(PDL)
    # the row's newest slot (keys 0..last are attended): written before the step's chain of kernels
    last = tl.load(POS + b).to(tl.int32)
    start = s * SPLIT
    if start > last:  # the row's slots end before this split: no part, no count
        return
    used = last // SPLIT + 1  # the splits that hold slots of the row: the count and the combine's parts
    g = tl.arange(0, BLOCK_G)
    gmask = g < G
    heads = h * G + g  # (BLOCK_G,) query heads of this kv head
    kv = (b * HKV + h) * M  # first slot of this (row, kv head)
    m_i, l_i, acc = _split_body(
        Q, K, V, KN, VN, COS, SIN, b, h, heads, gmask, kv, last, start,
        sqn, skn, svn, sm_scale, D, BLOCK_G, BLOCK_N, SPLIT, ROPE, PDL, PRELOAD,
    )  # fmt: skip
    if used == 1:  # one split holds the row (a short row, or a wide step's cache): the output directly
        d = tl.arange(0, D)
        o = acc / l_i[:, None]  # the split holds the newest slot: l_i >= 1
        tl.store(
            O + (b * HQ + heads)[:, None] * D + d[None, :], o.to(O.dtype.element_ty), mask=gmask[:, None]
        )
    else:
        part = (b * HQ + heads) * NSPLIT + s  # (BLOCK_G,) rows of OP / LSE
        _store_part(OP, LSE, part, gmask, m_i, l_i, acc, D)
        # The last split of (row, kv head) to arrive (an acquire-release count, set back to zero by
        # it) combines its G heads' parts: the combine kernel's sum, with no launch of its own.
        tl.debug_barrier()
        arrived = tl.atomic_add(CNT + b * HKV + h, 1, sem="acq_rel", scope="gpu")
        if arrived == used - 1:
            tl.debug_barrier()
            _combine_heads(OP, LSE, O, b * HQ + heads, gmask, NSPLIT, used, D, BLOCK_G, LANES)
            tl.atomic_xchg(CNT + b * HKV + h, 0, sem="relaxed", scope="gpu")


@jit
def _combine_heads(
    OP, LSE, O, rows, gmask, NSPLIT, used, D: tl.constexpr, BLOCK_G: tl.constexpr, LANES: tl.constexpr
):
    """Rows `rows` (b * HQ + head, the G heads of one kv head at once) of the output: each row's
    first `used` parts (of NSPLIT a row) weighted by their log-sum-exps, read through L2 (other
    programs wrote them) LANES splits at a time, each chunk's log-sum-exps and parts in one round trip,
    folded in with a running maximum (a row of up to LANES splits is one chunk)."""
    d = tl.arange(0, D)
    m = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    total = tl.zeros((BLOCK_G,), tl.float32)
    o = tl.zeros((BLOCK_G, D), tl.float32)
    for c0 in range(0, used, LANES):
        ln = c0 + tl.arange(0, LANES)
        cmask = gmask[:, None] & (ln < used)[None, :]  # (BLOCK_G, LANES)
        at = rows[:, None] * NSPLIT + ln[None, :]
        lse = tl.load(LSE + at, mask=cmask, other=float("-inf"), cache_modifier=".cg")
        parts = tl.load(
            OP + at[:, :, None] * D + d[None, None, :],
            mask=cmask[:, :, None],
            other=0.0,
            cache_modifier=".cg",
        )
        m_new = tl.maximum(m, tl.max(lse, axis=1))
        m_new = tl.where(m_new == float("-inf"), 0.0, m_new)  # padding rows and empty chunks: no -inf - -inf
        scale = tl.exp(m - m_new)
        w = tl.exp(lse - m_new[:, None])  # (BLOCK_G, LANES)
        total = total * scale + tl.sum(w, axis=1)
        o = o * scale[:, None] + tl.sum(parts * w[:, :, None], axis=1)
        m = m_new
    o = o / tl.where(total > 0, total, 1.0)[:, None]  # split 0 always holds slot 0: total > 0 for a head
    tl.store(O + rows[:, None] * D + d[None, :], o.to(O.dtype.element_ty), mask=gmask[:, None])


@jit(do_not_specialize=["NSPLIT"])
def decode_attn_combine_kernel(OP, LSE, O, NSPLIT, D: tl.constexpr, HQ: tl.constexpr, BLOCK_S: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # (b * T + t) * HQ + head: a row of the (B * T, HQ) parts
    s = tl.arange(0, BLOCK_S)
    smask = s < NSPLIT
    lse = tl.load(LSE + row * NSPLIT + s, mask=smask, other=float("-inf"))  # (BLOCK_S,)
    top = tl.max(lse, axis=0)  # split 0 always holds slot 0: finite
    w = tl.exp(lse - top)
    w = w / tl.sum(w, axis=0)
    d = tl.arange(0, D)
    # an empty part (a split past the row's slots) wrote its log-sum-exp alone: its output is not read
    filled = smask & (lse > float("-inf"))
    parts = tl.load(OP + (row * NSPLIT + s)[:, None] * D + d[None, :], mask=filled[:, None], other=0.0)
    o = tl.sum(parts * w[:, None], axis=0)  # (D,)
    tl.store(O + row * D + d, o.to(O.dtype.element_ty))


# -- T new tokens per row in one launch (speculative decoding's draft and verify steps) -------------
@jit
def _multi_new_tokens(
    K, V, KN, VN, COS, SIN, b, h, qa, qb, jrow, first, kv, M,
    skb, skt, svb, svt, sm_scale, m_i, l_i, acc,
    D: tl.constexpr, T: tl.constexpr, BLOCK_T: tl.constexpr, ROPE: tl.constexpr,
):  # fmt: skip
    """The split holding the rows' first new slot: every row attends its earlier new tokens and its own
    (token t is seen by row j when its slot precedes j's, or t = j: a clamped row's repeated last slot
    shows each token only its own key, as T one-token steps in order would), read from the step's k and
    v (rotated here with the key's ROPE); then the new keys and values go into the cache, each slot
    written once, by its last token. Returns the online softmax's (m_i, l_i, acc)."""
    HALF: tl.constexpr = D // 2
    d = tl.arange(0, D)
    d2 = tl.arange(0, HALF)
    tt = tl.arange(0, BLOCK_T)
    tmask = tt < T
    # (BLOCK_T,) each token's slot (padding tokens: the last one's)
    pos_t = tl.minimum(first + tl.minimum(tt, T - 1), M - 1)
    pos_r = tl.minimum(first + jrow, M - 1)  # (BLOCK_R,)
    krow = KN + b * skb + tt[:, None] * skt + h * D
    vn = tl.load(VN + b * svb + tt[:, None] * svt + h * D + d[None, :], mask=tmask[:, None], other=0.0)
    if ROPE:
        c1, c2, s1, s2 = _rope_halves(KN, COS, SIN, pos_t[:, None].to(tl.int64) * D, d2[None, :], HALF)
        k1 = tl.load(krow + d2[None, :], mask=tmask[:, None], other=0.0).to(tl.float32)
        k2 = tl.load(krow + HALF + d2[None, :], mask=tmask[:, None], other=0.0).to(tl.float32)
        ka = (k1 * c1 - k2 * s1).to(K.dtype.element_ty)  # (BLOCK_T, HALF)
        kb = (k2 * c2 + k1 * s2).to(K.dtype.element_ty)
        scores = tl.dot(qa, tl.trans(ka)) + tl.dot(qb, tl.trans(kb))  # (BLOCK_R, BLOCK_T)
    else:
        kn = tl.load(krow + d[None, :], mask=tmask[:, None], other=0.0).to(K.dtype.element_ty)
        scores = tl.dot(qa, tl.trans(kn))
    seen = tmask[None, :] & ((pos_t[None, :] < pos_r[:, None]) | (tt[None, :] == jrow[:, None]))
    scores = tl.where(seen, scores * sm_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))  # finite: every row sees its own token
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(vn.dtype), vn)
    # a slot's last token is the one T one-token steps leave there (clamped rows repeat the last slot)
    keep = tmask & ((tt == T - 1) | (first + tt < M - 1))
    slot = (kv + pos_t)[:, None].to(tl.int64) * D
    if ROPE:
        tl.store(K + slot + d2[None, :], ka, mask=keep[:, None])
        tl.store(K + slot + HALF + d2[None, :], kb, mask=keep[:, None])
    else:
        tl.store(K + slot + d[None, :], kn, mask=keep[:, None])
    tl.store(V + slot + d[None, :], vn.to(V.dtype.element_ty), mask=keep[:, None])
    return m_new, l_i, acc


@jit(do_not_specialize=["M", "NSPLIT", "sqb", "sqt", "skb", "skt", "svb", "svt"])
def decode_attn_multi_split_kernel(
    Q,
    K,
    V,
    START,
    KN,
    VN,
    COS,
    SIN,
    OP,
    LSE,
    M,
    NSPLIT,
    sqb,
    sqt,
    skb,
    skt,
    svb,
    svt,
    sm_scale,
    D: tl.constexpr,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    G: tl.constexpr,
    T: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    ROPE: tl.constexpr,
):
    """Program (b, kv head h, split s): the tile's rows are the T x G (token j, q head of h) pairs. The
    cached slots of the split before the row's first new slot c = min(start[b], M - 1) are read from
    the cache by all rows at once; the split holding c adds the new tokens from registers and writes
    them into the cache. No program reads a slot >= c, so the writes race with no read."""
    HALF: tl.constexpr = D // 2
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.program_id(2)
    first = tl.load(START + b).to(tl.int32)  # token j's slot: min(first + j, M - 1)
    c = tl.minimum(first, M - 1)
    lo = s * SPLIT
    r = tl.arange(0, BLOCK_R)
    rmask = r < T * G
    jrow = tl.minimum(r // G, T - 1)  # (BLOCK_R,) the row's token (padding rows: the last token's)
    heads = h * G + r % G
    pos_r = tl.minimum(first + jrow, M - 1)
    part = ((b * T + jrow) * HQ + heads) * NSPLIT + s  # rows of OP / LSE: (B, T, HQ, NSPLIT)
    if lo > c:  # past the row's slots: an empty part, its log-sum-exp alone (the combine reads no output)
        tl.store(LSE + part, tl.full((BLOCK_R,), float("-inf"), tl.float32), mask=rmask)
        return
    kv = (b * HKV + h) * M
    d = tl.arange(0, D)
    d2 = tl.arange(0, HALF)
    qrow = Q + b * sqb + jrow[:, None] * sqt + heads[:, None] * D
    # scores are qa.k + qb.k' : with ROPE the two rotated halves of q (against the halves of each key),
    # without it qa is q whole (and qb is never read)
    if ROPE:  # q rotated at each row's own position
        c1, c2, s1, s2 = _rope_halves(Q, COS, SIN, pos_r[:, None].to(tl.int64) * D, d2[None, :], HALF)
        x1 = tl.load(qrow + d2[None, :], mask=rmask[:, None], other=0.0).to(tl.float32)
        x2 = tl.load(qrow + HALF + d2[None, :], mask=rmask[:, None], other=0.0).to(tl.float32)
        qa = (x1 * c1 - x2 * s1).to(Q.dtype.element_ty)  # (BLOCK_R, HALF)
        qb = (x2 * c2 + x1 * s2).to(Q.dtype.element_ty)
    else:
        qa = tl.load(qrow + d[None, :], mask=rmask[:, None], other=0.0)  # (BLOCK_R, D)
        qb = qa
    m_i = tl.full((BLOCK_R,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_R,), tl.float32)
    acc = tl.zeros((BLOCK_R, D), tl.float32)
    end = tl.minimum(lo + SPLIT, c)  # cached slots only: the same for every row
    for n0 in range(lo, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        nmask = n < end
        rows = (kv + n)[:, None].to(tl.int64) * D
        if ROPE:
            ka = tl.load(K + rows + d2[None, :], mask=nmask[:, None], other=0.0)
            kb = tl.load(K + rows + HALF + d2[None, :], mask=nmask[:, None], other=0.0)
            scores = tl.dot(qa, tl.trans(ka)) + tl.dot(qb, tl.trans(kb))  # (BLOCK_R, BLOCK_N)
        else:
            k = tl.load(K + rows + d[None, :], mask=nmask[:, None], other=0.0)
            scores = tl.dot(qa, tl.trans(k))
        v = tl.load(V + rows + d[None, :], mask=nmask[:, None], other=0.0)
        scores = tl.where(nmask[None, :], scores * sm_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    if (c >= lo) & (c < lo + SPLIT):
        m_i, l_i, acc = _multi_new_tokens(
            K, V, KN, VN, COS, SIN, b, h, qa, qb, jrow, first, kv, M,
            skb, skt, svb, svt, sm_scale, m_i, l_i, acc, D, T, BLOCK_T, ROPE,
        )  # fmt: skip
    _store_part(OP, LSE, part, rmask, m_i, l_i, acc, D)


def _check_launch(
    key: KernelKey, k_cache: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None
) -> bool:
    """Refuse a cache past the kernels' indexing and a RoPE key without its tables; the key's ROPE."""
    b, hkv, m, d = k_cache.shape
    if b * hkv * m * d > INT32_MAX * 64 or m > INT32_MAX:
        raise KernelError(
            f"decode_attention: a cache of {b} x {hkv} x {m} x {d} exceeds the kernel's indexing"
        )
    rope = bool(key["ROPE"])
    if rope and (cos is None or sin is None):
        raise KernelError("decode_attention: a RoPE key needs the cos and sin tables")
    return rope


def launch(
    key: KernelKey,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pos: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
):
    """The split kernel's (kernel, grid, args, kwargs, (o,)) for q (B, Hq, D), caches (B, Hkv, M, D)
    contiguous, pos (B,) int64 (each row's newest slot) and the step's k_new and v_new (B, Hkv, D),
    written into slot pos[b]; q, k_new and v_new need contiguous heads in each row (any row stride).
    With the key's ROPE, cos and sin are the fp32 (M', D) tables (M' > every pos) and q and k_new arrive
    unrotated: the kernel rotates them at position pos[b]. o (B, Hq, D) in q's dtype: the last split of
    each (row, kv head) combines the parts."""
    b, hq, d = q.shape
    hkv, m = k_cache.shape[1], k_cache.shape[2]
    rope = _check_launch(key, k_cache, cos, sin)
    parts, lse = empty_parts(key, q, m)
    nsplit = lse.shape[-1]
    o = torch.empty((b, hq, d), dtype=q.dtype, device=q.device)
    cnt = decode_gemv.counters(q.device, b * hkv)
    kwargs = dict(
        D=d,
        HQ=hq,
        HKV=hkv,
        G=hq // hkv,
        BLOCK_G=key["BLOCK_G"],
        BLOCK_N=key["BLOCK_N"],
        SPLIT=key["SPLIT"],
        ROPE=rope,
        PDL=pdl_constexpr(key),
        PRELOAD=bool(key["PRELOAD"]),
        LANES=key["LANES"],
    )
    for t in (q, k_new, v_new):
        if t.stride(2) != 1 or t.stride(1) != d:
            raise KernelError("decode_attention: q and the new k and v need contiguous heads in each row")
    tables = (cos, sin) if rope else (parts, lse)  # without RoPE the table pointers are never read
    args = (q, k_cache, v_cache, pos, k_new, v_new, *tables, parts, lse, o, cnt, m, nsplit)
    args = (*args, q.stride(0), k_new.stride(0), v_new.stride(0), 1.0 / math.sqrt(d))
    return (
        decode_attn_split_kernel,
        (b, hkv, nsplit),
        args,
        {**kwargs, **launch_options(key)},
        (o,),
    )


def multi_launch(
    key: KernelKey,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    start: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
):
    """The T-token split kernel's (kernel, grid, args, kwargs, (parts, lse)) for q (B, Hq, T, D), caches
    (B, Hkv, M, D) contiguous, start (B,) int64 >= 0 (token j's slot: min(start[b] + j, M - 1)) and the
    step's k_new and v_new (B, Hkv, T, D), written into those slots; q, k_new and v_new need contiguous
    heads (stride D) of contiguous elements, any batch and token strides (views of the q/k/v GEMM's
    output). parts (B, T, Hq, S, D) and lse (B, T, Hq, S): combine_launch takes them as B * T rows. With
    the key's ROPE, cos and sin are the fp32 (M', D) tables (M' > every slot), q and k_new unrotated."""
    b, hq, t, d = q.shape
    hkv, m = k_cache.shape[1], k_cache.shape[2]
    rope = _check_launch(key, k_cache, cos, sin)
    parts, lse = empty_multi_parts(key, q, m)
    nsplit = lse.shape[-1]
    for x in (q, k_new, v_new):
        if x.stride(3) != 1 or x.stride(1) != d:
            raise KernelError("decode_attention: q and the new k and v need contiguous heads in each token")
    kwargs = dict(
        D=d,
        HQ=hq,
        HKV=hkv,
        G=hq // hkv,
        T=t,
        BLOCK_R=key["BLOCK_R"],
        BLOCK_T=key["BLOCK_T"],
        BLOCK_N=key["BLOCK_N"],
        SPLIT=key["SPLIT"],
        ROPE=rope,
    )
    tables = (cos, sin) if rope else (parts, lse)  # without RoPE the table pointers are never read
    args = (q, k_cache, v_cache, start, k_new, v_new, *tables, parts, lse, m, nsplit)
    strides = (q.stride(0), q.stride(2), k_new.stride(0), k_new.stride(2), v_new.stride(0), v_new.stride(2))
    args = (*args, *strides, 1.0 / math.sqrt(d))
    return (
        decode_attn_multi_split_kernel,
        (b, hkv, nsplit),
        args,
        {**kwargs, **launch_options(key)},
        (parts, lse),
    )


def combine_launch(key: KernelKey, parts: torch.Tensor, lse: torch.Tensor, dtype: torch.dtype):
    """The combine kernel's (kernel, grid, args, kwargs, (o,)) for parts (B, Hq, S, D) -> o (B, Hq, D)."""
    b, hq, nsplit, d = parts.shape
    o = torch.empty((b, hq, d), dtype=dtype, device=parts.device)
    kwargs = dict(D=d, HQ=hq, BLOCK_S=key["BLOCK_S"], **launch_options(key))
    return decode_attn_combine_kernel, (b * hq,), (parts, lse, o, nsplit), kwargs, (o,)


def empty_parts(key: KernelKey, q: torch.Tensor, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialised (parts, lse) as the split kernel writes them for a cache of max_len slots."""
    b, hq, d = q.shape
    nsplit = -(-max_len // key["SPLIT"])
    return (
        torch.empty((b, hq, nsplit, d), dtype=torch.float32, device=q.device),
        torch.empty((b, hq, nsplit), dtype=torch.float32, device=q.device),
    )


def empty_multi_parts(key: KernelKey, q: torch.Tensor, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialised (parts (B, T, Hq, S, D), lse (B, T, Hq, S)) of the T-token split kernel."""
    b, hq, t, d = q.shape
    nsplit = -(-max_len // key["SPLIT"])
    return (
        torch.empty((b, t, hq, nsplit, d), dtype=torch.float32, device=q.device),
        torch.empty((b, t, hq, nsplit), dtype=torch.float32, device=q.device),
    )


def run(spec) -> tuple:
    kernel, grid, args, kwargs, outs = spec
    kernel[grid](*args, **kwargs)
    return outs


# -- tile policy and key functions --------------------------------------------------------------
MAX_SPLITS = 64  # the combine holds at most this many parts of a row: longer caches get longer splits


SHORT_CACHE = 1024  # slots up to which a split is one tile of keys
WIDE_ROWS = 32  # a step of more rows than this is wide: its splits take at least WIDE_SPLIT keys
WIDE_SPLIT = 256
MID_ROWS = (16, 32)  # a step of more rows than the first and at most the second: at least MID_SPLIT keys
MID_SPLIT = 128


def min_split(rows: int) -> int:
    """The fewest keys a split of a one-token step of `rows` rows takes (0: no bound beyond the cache's)."""
    if rows > WIDE_ROWS:
        return WIDE_SPLIT
    return MID_SPLIT if MID_ROWS[0] < rows <= MID_ROWS[1] else 0


def split_len(max_len: int, rows: int = 1) -> int:
    """Keys a split takes: 64 (one tile: each program runs one iteration, so a short cache still
    spreads over many programs) for caches of up to SHORT_CACHE slots, 128 past that, and longer where
    a cache of max_len slots would need more than MAX_SPLITS parts; at least `min_split(rows)` for a
    step of `rows` rows. A wide step (more than WIDE_ROWS rows) has programs enough without short
    splits: at least WIDE_SPLIT keys, fewer parts to write and combine; a step of 17 to 32 rows at least
    MID_SPLIT, whose fewer programs let the launches after the attention be placed sooner
    (benchmarks/decode_attention_tiles.py and decode_profile.py --attn-split measure the choices;
    benchmarks/NOTES.md has the numbers)."""
    base = max(64 if max_len <= SHORT_CACHE else 128, next_pow2(-(-int(max_len) // MAX_SPLITS)))
    return max(base, min_split(rows))


ONE_TILE_HEAD = 64  # heads at most this wide read a split of 128 keys as one tile
COMBINE_LANES = 4  # parts the last split of a row reads back per round trip (key LANES)
LONG_LANES = 16  # the same for narrow heads over a long cache in a short step (combine_lanes)


def combine_lanes(head_dim: int, max_len: int, split_min: int = 0) -> int:
    """Parts the combine reads back per round trip: LONG_LANES for a step of up to WIDE_ROWS rows of
    heads at most ONE_TILE_HEAD wide over a cache longer than SHORT_CACHE (its 128-key splits number
    nine at 1,152 slots: one round trip instead of three, measured 2.5% of the 0.5B's step faster at 16
    rows; a 128-wide head's parts take twice the registers, and 8 lanes measured a tie there),
    COMBINE_LANES otherwise (a short cache's row spans few splits)."""
    if head_dim <= ONE_TILE_HEAD and max_len > SHORT_CACHE and split_min < WIDE_SPLIT:
        return LONG_LANES
    return COMBINE_LANES


def tiles(
    head_dim: int, q_heads: int, kv_heads: int, max_len: int = 256, split_min: int = 0
) -> dict[str, int]:
    """The G query heads of a kv head padded to >= 16 rows (the dot's smallest tile), 64 keys a tile
    (128 where the head is at most ONE_TILE_HEAD wide and the split is 128 keys, or a wide step's over a
    cache longer than SHORT_CACHE: measured faster for a 64-wide head, slower for a 128-wide one, whose
    tile's registers double), `split_len(max_len)` keys a split, at least split_min (min_split of the
    step's rows), the loop's pipeline depth and the parts its combine reads back at a time
    (`combine_lanes`)."""
    split = max(split_len(max_len), split_min)
    wide_long = split_min >= WIDE_SPLIT and max_len > SHORT_CACHE
    return {
        "BLOCK_G": max(16, next_pow2(q_heads // kv_heads)),
        # a wide step's split over a long cache: 128-key tiles too where the head allows (measured at 64
        # and 128 rows over 1,152 slots, 64-wide heads: a tie and 3.7% of the step faster)
        "BLOCK_N": 128 if (split == 128 or wide_long) and head_dim <= ONE_TILE_HEAD else 64,
        "SPLIT": split,
        "LANES": combine_lanes(head_dim, max_len, split_min),
        # a wide step's split over a short cache: three tiles in flight (measured faster at 64 and 128
        # rows over 256 slots; over 1,152 slots two)
        "num_stages": 3 if split_min >= WIDE_SPLIT and max_len <= SHORT_CACHE else 2,
    }


MAX_ROWS = 256  # (token, q head) rows of one T-token tile: a longer step runs as several launches


def token_chunks(tokens: int, q_heads: int, kv_heads: int) -> list[int]:
    """The T-token kernel's launches for a step of `tokens` new tokens per row, in order: as many tokens
    per launch as MAX_ROWS rows of G query heads hold (one launch up to 36 tokens at G = 7)."""
    per = max(1, MAX_ROWS // (q_heads // kv_heads))
    return [per] * (tokens // per) + ([tokens % per] if tokens % per else [])


def multi_tiles(
    head_dim: int, q_heads: int, kv_heads: int, tokens: int, max_len: int = 256
) -> dict[str, int]:
    """The T x G rows padded to >= 16 (the dot's smallest tile), the T new keys likewise, 64 cached keys a
    tile (32 past 64 rows, to keep the tile's registers), `split_len(max_len)` keys a split."""
    del head_dim
    rows = max(16, next_pow2(tokens * (q_heads // kv_heads)))
    return {
        "BLOCK_R": rows,
        "BLOCK_T": max(16, next_pow2(tokens)),
        "BLOCK_N": 64 if rows <= 64 else 32,
        "SPLIT": split_len(max_len),
    }


def combine_tiles(max_len: int) -> dict[str, int]:
    """Enough lanes for every split of a cache of max_len slots."""
    return {"BLOCK_S": max(16, next_pow2(-(-int(max_len) // split_len(max_len))))}


def supported(head_dim: int, q_heads: int, kv_heads: int) -> bool:
    """Shapes the kernel takes: whole groups of q heads per kv head, a power-of-two head size >= 16
    (the dot's smallest K). Other shapes run the reference (no key is planned or launched)."""
    return q_heads % kv_heads == 0 and head_dim >= 16 and head_dim & (head_dim - 1) == 0


def rope_supported(head_dim: int) -> bool:
    """RoPE inside the kernel: each half of a head is a dot's K, so at least 16 wide."""
    return head_dim >= 32


def _check(head_dim: int, q_heads: int, kv_heads: int) -> None:
    if not supported(head_dim, q_heads, kv_heads):
        raise KernelError(
            f"decode_attention: {q_heads} q heads over {kv_heads} kv heads of size {head_dim} "
            "(needs a whole group per kv head and a power-of-two head size >= 16)"
        )


def _head_params(head_dim: int, q_heads: int, kv_heads: int, rope: bool, dtype: str) -> dict[str, Any]:
    """The key parameters both split kernels take from the heads (checked: `supported`)."""
    _check(head_dim, q_heads, kv_heads)
    return {
        "D": int(head_dim),
        "HQ": int(q_heads),
        "HKV": int(kv_heads),
        "G": int(q_heads // kv_heads),
        "ROPE": bool(rope),
        "dtype": dtype_name(dtype),
    }


@memoized
def split_key(
    arch: str,
    *,
    head_dim: int,
    q_heads: int,
    kv_heads: int,
    dtype: str,
    max_len: int,
    rope: bool = False,
    chained: bool = False,
    split_min: int = 0,
    aligned: Sequence[bool] | None = None,
) -> KernelKey:
    """The split kernel over caches of max_len slots in `dtype` (the split's length follows max_len, at
    least split_min: min_split of the step's rows, so the key stays a function of its arguments); rope:
    q and the new key arrive unrotated (the kernel applies RoPE); chained: inside a small bucket's decode
    step (runtime.chained: programmatic dependent launch where the arch has it). aligned: Q, K, V, POS,
    KN, VN, COS, SIN (without rope the tables' flags are the outputs', always aligned)."""
    return make_key(
        SPLIT_K.op,
        arch,
        **_head_params(head_dim, q_heads, kv_heads, rope, dtype),
        align=SPLIT_K.align(aligned),
        PDL=bool(chained) and pdl(arch),
        # the chained split's order of loads (its first tile before the wait), also under the interpreter
        PRELOAD=bool(chained) and pdl(arch),
        num_warps=4,
        **tiles(head_dim, q_heads, kv_heads, max_len, split_min),
    )


@memoized
def multi_split_key(
    arch: str,
    *,
    head_dim: int,
    q_heads: int,
    kv_heads: int,
    tokens: int,
    dtype: str,
    max_len: int,
    rope: bool = False,
    aligned: Sequence[bool] | None = None,
) -> KernelKey:
    """The T-token split kernel for `tokens` new tokens per row (T in the key: the tile's rows and the
    causal mask among the new tokens follow it) over caches of max_len slots in `dtype`; rope and
    aligned (Q, K, V, START, KN, VN, COS, SIN) as split_key's."""
    params = _head_params(head_dim, q_heads, kv_heads, rope, dtype)
    tl_ = multi_tiles(head_dim, q_heads, kv_heads, tokens, max_len)
    return make_key(
        MULTI_SPLIT.op,
        arch,
        **params,
        T=int(tokens),
        align=MULTI_SPLIT.align(aligned),
        num_warps=4 if tl_["BLOCK_R"] <= 64 else 8,
        num_stages=2,
        **tl_,
    )


@memoized
def combine_key(arch: str, *, head_dim: int, q_heads: int, dtype: str, max_len: int) -> KernelKey:
    """The combine kernel (the T-token step's parts) writing `dtype` for caches of up to max_len slots
    (the lanes' count)."""
    return make_key(
        COMBINE.op,
        arch,
        D=int(head_dim),
        HQ=int(q_heads),
        dtype=dtype_name(dtype),
        align=COMBINE.align(),
        num_warps=4,
        num_stages=1,
        **combine_tiles(max_len),
    )


# -- registered description ---------------------------------------------------------------------
def _warm_split(key: KernelKey, device: Any) -> tuple:
    """A (1, HQ, D) query over (1, HKV, 2, D) caches, aligned as `key` says (RoPE tables of 2 rows)."""
    al, d = [c == "A" for c in str(key["align"])], key["D"]
    q = tensor((1, key["HQ"], d), key["dtype"], device, al[0])
    k = tensor((1, key["HKV"], 2, d), key["dtype"], device, al[1])
    v = tensor((1, key["HKV"], 2, d), key["dtype"], device, al[2])
    buf = torch.ones(3, dtype=torch.int64, device=device)  # newest slot 1: both cached keys attended
    pos = buf[:1] if al[3] else buf[1:2]
    kn = tensor((1, key["HKV"], d), key["dtype"], device, al[4])
    vn = tensor((1, key["HKV"], d), key["dtype"], device, al[5])
    cos = sin = None
    if key["ROPE"]:
        cos, sin = tensor((2, d), "fp32", device, al[6]), tensor((2, d), "fp32", device, al[7])
    return launch(key, q, k, v, pos, kn, vn, cos, sin)


def _warm_multi_split(key: KernelKey, device: Any) -> tuple:
    """A (1, HQ, T, D) query (a view of (1, T, HQ, D), as the engine's) over (1, HKV, 2, D) caches from
    slot 1 (the later tokens clamped to it), aligned as `key` says (RoPE tables of 2 rows)."""
    al, d, t = [c == "A" for c in str(key["align"])], key["D"], key["T"]
    q = tensor((1, t, key["HQ"], d), key["dtype"], device, al[0]).transpose(1, 2)  # heads contiguous
    k = tensor((1, key["HKV"], 2, d), key["dtype"], device, al[1])
    v = tensor((1, key["HKV"], 2, d), key["dtype"], device, al[2])
    buf = torch.ones(3, dtype=torch.int64, device=device)
    start = buf[:1] if al[3] else buf[1:2]
    kn = tensor((1, t, key["HKV"], d), key["dtype"], device, al[4]).transpose(1, 2)
    vn = tensor((1, t, key["HKV"], d), key["dtype"], device, al[5]).transpose(1, 2)
    cos = sin = None
    if key["ROPE"]:
        cos, sin = tensor((2, d), "fp32", device, al[6]), tensor((2, d), "fp32", device, al[7])
    return multi_launch(key, q, k, v, start, kn, vn, cos, sin)


def _warm_combine(key: KernelKey, device: Any) -> tuple:
    parts = tensor((1, key["HQ"], 2, key["D"]), "fp32", device)
    lse = tensor((1, key["HQ"], 2), "fp32", device)
    return combine_launch(key, parts, lse, torch_dtype(key["dtype"]))


def plan(
    arch: str,
    *,
    grad: bool,
    head_dim: int,
    q_heads: int,
    kv_heads: int,
    dtype: str,
    max_len: int,
    rope: bool = True,
    tokens: Sequence[int] = (),
    chained: Sequence[bool] = (False, True),
    rows: int = 1,
) -> set[KernelKey]:
    """Keys of one decode step's attention (no backward: generation only); none for shapes the
    kernel does not take (`supported`). rope: the engine's step, which leaves RoPE to the kernel.
    tokens: the T > 1 of the engine's T-token steps (DecodeEngine.forward_at), each a launch of the
    T-token kernel per chunk of token_chunks. chained: the one-token step's keys for each of these
    (runtime.chained: a small bucket's step, or not). rows: the engine's batch, whose buckets (powers of
    two below it, and itself) take their rows' splits (split_len): past MID_ROWS[0] the mid ones, past
    WIDE_ROWS the wide ones, each chained or not."""
    del grad
    if not supported(head_dim, q_heads, kv_heads):
        return set()
    rope = rope and rope_supported(head_dim)
    multi = {
        multi_split_key(
            arch,
            head_dim=head_dim,
            q_heads=q_heads,
            kv_heads=kv_heads,
            tokens=c,
            dtype=dtype,
            max_len=max_len,
            rope=rope,
        )
        for t in tokens
        if t > 1
        for c in token_chunks(t, q_heads, kv_heads)
    }
    out = set(multi)
    if multi:  # the T-token kernel's parts are combined by the combine kernel
        out.add(combine_key(arch, head_dim=head_dim, q_heads=q_heads, dtype=dtype, max_len=max_len))
    for b in step_buckets(rows):
        for c in chained:  # a wide bucket chains too where the model is narrow (decode_gemv.step_rows)
            out.add(
                split_key(
                    arch,
                    head_dim=head_dim,
                    q_heads=q_heads,
                    kv_heads=kv_heads,
                    dtype=dtype,
                    max_len=max_len,
                    rope=rope,
                    chained=c,
                    split_min=min_split(b),
                )
            )
    return out


SPLIT_K = Kernel(
    "decode_attn_split",
    decode_attn_split_kernel,
    split_key,
    _warm_split,
    {
        "Q": "dtype",
        "K": "dtype",
        "V": "dtype",
        "POS": "i64",
        "KN": "dtype",
        "VN": "dtype",
        "COS": "fp32",
        "SIN": "fp32",
        "OP": "fp32",
        "LSE": "fp32",
        "O": "dtype",
        "CNT": "i32",
    },
    outputs=("OP", "LSE", "O", "CNT"),
)
MULTI_SPLIT = Kernel(
    "decode_attn_multi_split",
    decode_attn_multi_split_kernel,
    multi_split_key,
    _warm_multi_split,
    {
        "Q": "dtype",
        "K": "dtype",
        "V": "dtype",
        "START": "i64",
        "KN": "dtype",
        "VN": "dtype",
        "COS": "fp32",
        "SIN": "fp32",
        "OP": "fp32",
        "LSE": "fp32",
    },
    outputs=("OP", "LSE"),
)
COMBINE = Kernel(
    "decode_attn_combine",
    decode_attn_combine_kernel,
    combine_key,
    _warm_combine,
    {"OP": "fp32", "LSE": "fp32", "O": "dtype"},
    outputs=("O",),
)
SPEC = KernelSpec(name="decode_attention", kernels=(SPLIT_K, MULTI_SPLIT, COMBINE), tiles=tiles, plan=plan)
