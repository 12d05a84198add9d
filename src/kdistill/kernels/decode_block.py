"""Triton decode step of one transformer block in one launch (a persistent kernel), at a few rows:
kernel, launcher, reference, key functions, registered KernelSpec.

    r1  = delta + residual                    h1 = rmsnorm(r1) * ln1        (phase 1, with q/k/v)
    qkv = h1 Wqkv^T (+ bias)
    o   = attention(q, cache + k, v)          RoPE at each row's slot, k and v cached   (phases 2, 3)
    a   = o Wo^T                                                                          (phase 4)
    r2  = a + r1                              h2 = rmsnorm(r2) * ln2
    act = silu(h2 Wg^T) * (h2 Wu^T)                                                       (phase 5)
    delta' = act Wd^T                         accumulated in fp32 (split over K)          (phase 6)

A decode step at one to sixteen rows streams each block's weights once (30 MB for Qwen2.5-0.5B, 7 us at
the card's bandwidth), but as eight kernels of 1.5-7 us each, most of it the latency of a kernel too small
to fill the card (NOTES.md, round nine). Here one launch of as many programs as the card has SMs runs the
six phases in order; a grid-wide barrier (an atomic counter at gpu scope: each program's release add,
then acquire reads until every program has arrived) separates them, since each phase needs all of the
previous one's output. Every program holds the grid's co-residency: the grid is at most the SM count
and a program's registers and shared memory fit one to an SM, so all of them run at once and a barrier cannot wait on a program
that has not started. The counters are reset by the last program out, so the next launch finds zeros.

Work of each phase is strided over the programs: tiles of BLOCK_N output columns of the products
(matrix-vector products with the rows in one 16-row dot tile, as kernels/decode_gemv.py), splits of
(row, kv head) for the attention (the split kernel's own body: kernels/decode_attention.py), (row,
head) pairs for the combine. The norms need whole rows, so every program computes the statistics of
the rows itself (a row is H values: read from L2) and normalizes each K chunk of its product's input
as it loads it; program 0 alone writes the new residuals. The down product is split over K (SPLITK
parts, each program's part added into the fp32 delta with atomics): 56 column tiles alone would leave
most SMs idle. The next block's phase 1 reads that delta (rounded to the weights' dtype as the unfused
product's output is); program 0 zeroes it after phase 1 for this block's own accumulation.

PHASE (key parameter): 0 runs every phase with the barriers between (the GPU); 1..6 runs that phase
alone, without barriers: the interpreter runs programs one after another, where a barrier would wait
forever, so the CPU tests launch the six phases in order (dispatch.decode_block does). Every phase's
code is the same in both.

Roundings follow the unfused step (rmsnorm_fwd_kernel's, the products' outputs in the weights' dtype,
the SwiGLU epilogue of decode_gemv), so the fused step differs from it only by the order of fp32 sums.

The file reads top to bottom: kernel helpers, kernel, launcher, reference, key functions and tile
policy, then the registered KernelSpec. No backward: generation runs without gradients.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from kdistill.dtypes import torch_dtype
from kdistill.errors import KernelError
from kdistill.kernels import decode_attention as attn
from kdistill.kernels._triton import cdiv, jit, tl
from kdistill.kernels.keys import KernelKey, dtype_name, launch_options, make_key, memoized, next_pow2
from kdistill.kernels.spec import Kernel, KernelSpec, tensor

MAX_ROWS = 16  # the buckets this kernel serves (one row tile); larger ones run the unfused step
PHASES = 8


# -- kernel helpers ------------------------------------------------------------------------------
@jit
def _grid_sync(CNT, target):
    """Wait until `target` arrivals are counted at CNT (every program's arrival at this barrier and the
    earlier ones): this program's writes are released before its arrival, every other program's
    acquired after the wait."""
    tl.debug_barrier()
    tl.atomic_add(CNT, 1, sem="release", scope="gpu")
    seen = tl.atomic_add(CNT, 0, sem="acquire", scope="gpu")
    while seen < target:
        seen = tl.atomic_add(CNT, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@jit
def _norm_rows(
    DL, RS, LNW, HOUT, ROUT, pid, NPROG, B, eps, H: tl.constexpr, FIRST: tl.constexpr, BLOCK_H: tl.constexpr
):  # fmt: skip
    """Rows dealt out to the programs (one each on a GPU): r = delta + residual of the row (FIRST:
    r = delta; delta read in any dtype and rounded to the weights' dtype first, as a product's output),
    written to ROUT; rmsnorm(r) * LNW written to HOUT. Rounded as rmsnorm_fwd_kernel rounds."""
    dt = LNW.dtype.element_ty
    cols = tl.arange(0, BLOCK_H)
    cmask = cols < H
    for b in range(pid, B, NPROG):
        offs = b * H + cols
        r = tl.load(DL + offs, mask=cmask, other=0.0).to(dt).to(tl.float32)
        if not FIRST:
            r = (r + tl.load(RS + offs, mask=cmask, other=0.0).to(tl.float32)).to(dt).to(tl.float32)
        tl.store(ROUT + offs, r.to(dt), mask=cmask)
        rstd = tl.rsqrt(tl.sum(r * r, axis=0) / H + eps)
        n = (r * rstd).to(dt).to(tl.float32)
        lw = tl.load(LNW + cols, mask=cmask, other=0.0).to(tl.float32)
        tl.store(HOUT + offs, (n * lw).to(dt), mask=cmask)


@jit
def _gemv(
    X, W, BIAS, Y, rows, rmask, pid, NPROG,
    N: tl.constexpr, K: tl.constexpr, EPI: tl.constexpr, SPLITK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Y = X W^T (X: rows of K) over work items of BLOCK_N columns x one of SPLITK parts of K, dealt out
    to the programs in turn. One flat loop over this program's (item, K chunk) pairs, the epilogue at
    each item's last chunk, so that the loads of the next chunks (the next item's too) are issued ahead
    by the loop's pipelining. EPI 0: store; 1: + bias; 2: W = [Wg; Wu] (2N, K), store silu(gate) * up;
    3: atomic add into Y (fp32)."""
    dt = W.dtype.element_ty
    KS: tl.constexpr = ((K + SPLITK - 1) // SPLITK + BLOCK_K - 1) // BLOCK_K * BLOCK_K  # a part's K
    KCH: tl.constexpr = KS // BLOCK_K
    NT: tl.constexpr = (N + BLOCK_N - 1) // BLOCK_N * SPLITK
    mine = tl.cdiv(tl.maximum(NT - pid, 0), NPROG)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    acc2 = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for i in range(0, mine * KCH):
        t = pid + (i // KCH) * NPROG
        c = i % KCH
        kk = (t % SPLITK) * KS + c * BLOCK_K + tl.arange(0, BLOCK_K)
        kmask = kk < K
        cols = (t // SPLITK) * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < N
        cols64 = cols.to(tl.int64)
        x = tl.load(X + rows[:, None] * K + kk[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        wmask = cmask[:, None] & kmask[None, :]
        w = tl.load(W + cols64[:, None] * K + kk[None, :], mask=wmask, other=0.0)
        acc = tl.dot(x.to(dt), tl.trans(w), acc)
        if EPI == 2:
            w2 = tl.load(W + (cols64 + N)[:, None] * K + kk[None, :], mask=wmask, other=0.0)
            acc2 = tl.dot(x.to(dt), tl.trans(w2), acc2)
        if c == KCH - 1:
            ymask = rmask[:, None] & cmask[None, :]
            yoffs = rows[:, None] * N + cols64[None, :]
            if EPI == 3:
                tl.atomic_add(Y + yoffs, acc, mask=ymask, sem="relaxed")
            else:
                out = acc
                if EPI == 1:
                    out = out + tl.load(BIAS + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
                if EPI == 2:
                    g = acc.to(dt).to(tl.float32)
                    u = acc2.to(dt).to(tl.float32)
                    out = (g * tl.sigmoid(g)).to(dt).to(tl.float32) * u
                tl.store(Y + yoffs, out.to(dt), mask=ymask)
            acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            acc2 = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)


@jit(do_not_specialize=["B", "M", "NSPLIT", "NPROG"])
def decode_block_kernel(
    X,
    RESID,
    DELTA,
    LN1,
    WQKV,
    BQKV,
    QKV,
    KC,
    VC,
    POS,
    COS,
    SIN,
    OP,
    LSE,
    O,
    WO,
    A,
    RES1,
    HN,
    LN2,
    WGU,
    ACT,
    WD,
    CNT,
    B,
    M,
    NSPLIT,
    NPROG,
    eps,
    sm_scale,
    H: tl.constexpr,
    NQKV: tl.constexpr,
    QS: tl.constexpr,
    I: tl.constexpr,
    D: tl.constexpr,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    G: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_NA: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLITK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    FIRST: tl.constexpr,
    PHASE: tl.constexpr,
):
    """X: the block's input delta (FIRST: the embeddings; else DELTA, fp32); RESID: the residual stream
    in, and out (r2); DELTA: the fp32 accumulator of the down product (read in phase 1, zeroed in phase
    2, accumulated in phase 8); QKV, OP/LSE, O, A, RES1, HN (a normed input), ACT: the phases' scratch;
    CNT: two int32 counters (barrier arrivals, programs out), zero between launches."""
    dt = LN1.dtype.element_ty
    pid = tl.program_id(0)
    rows = tl.arange(0, BLOCK_M)
    rmask = rows < B
    if PHASE == 0 or PHASE == 1:  # r1 = delta + residual, h1 = rmsnorm(r1) * ln1: program b, row b
        _norm_rows(X, RESID, LN1, HN, RES1, pid, NPROG, B, eps, H, FIRST, BLOCK_H)
    if PHASE == 0:
        _grid_sync(CNT, NPROG)
    if PHASE == 0 or PHASE == 2:  # q/k/v = h1 Wqkv^T (+ bias); DELTA zeroed (phase 1 has read it)
        if pid == 0:
            for k0 in range(0, H, BLOCK_K):
                kk = k0 + tl.arange(0, BLOCK_K)
                zmask = rmask[:, None] & (kk < H)[None, :]
                zeros = tl.zeros((BLOCK_M, BLOCK_K), tl.float32)
                tl.store(DELTA + rows[:, None] * H + kk[None, :], zeros, mask=zmask)
        _gemv(HN, WQKV, BQKV, QKV, rows, rmask, pid, NPROG, NQKV, H, HAS_BIAS, 1, BLOCK_M, BLOCK_N, BLOCK_K)
    if PHASE == 0:
        _grid_sync(CNT, 2 * NPROG)
    if PHASE == 0 or PHASE == 3:  # attention splits (RoPE, the cache write)
        KVS: tl.constexpr = HKV * D
        g = tl.arange(0, BLOCK_G)
        gmask = g < G
        for item in range(pid, B * HKV * NSPLIT, NPROG):
            b = (item // (HKV * NSPLIT)).to(tl.int64)
            h = (item // NSPLIT) % HKV
            s = item % NSPLIT
            last = tl.load(POS + b).to(tl.int32)
            heads = h * G + g
            part = (b * HQ + heads) * NSPLIT + s
            kv = (b * HKV + h) * M
            attn._rope_split(
                QKV, KC, VC, QKV + QS, QKV + QS + KVS, COS, SIN, OP, LSE, b, h, heads, gmask, part, kv, last,
                s * SPLIT, NQKV, NQKV, NQKV, sm_scale, D, BLOCK_G, BLOCK_NA, SPLIT,
            )  # fmt: skip
    if PHASE == 0:
        _grid_sync(CNT, 3 * NPROG)
    if PHASE == 0 or PHASE == 4:  # combine the splits of each (row, q head)
        sidx = tl.arange(0, BLOCK_S)
        smask = sidx < NSPLIT
        d = tl.arange(0, D)
        for row in range(pid, B * HQ, NPROG):
            lse = tl.load(LSE + row * NSPLIT + sidx, mask=smask, other=float("-inf"))
            top = tl.max(lse, axis=0)
            wts = tl.exp(lse - top)
            wts = wts / tl.sum(wts, axis=0)
            parts = tl.load(
                OP + (row * NSPLIT + sidx)[:, None] * D + d[None, :], mask=smask[:, None], other=0.0
            )
            tl.store(O + row * D + d, tl.sum(parts * wts[:, None], axis=0).to(dt))
    if PHASE == 0:
        _grid_sync(CNT, 4 * NPROG)
    if PHASE == 0 or PHASE == 5:  # a = o Wo^T
        _gemv(O, WO, WO, A, rows, rmask, pid, NPROG, H, QS, 0, 1, BLOCK_M, BLOCK_N, BLOCK_K)
    if PHASE == 0:
        _grid_sync(CNT, 5 * NPROG)
    if PHASE == 0 or PHASE == 6:  # r2 = a + r1 (into RESID), h2 = rmsnorm(r2) * ln2: program b, row b
        _norm_rows(A, RES1, LN2, HN, RESID, pid, NPROG, B, eps, H, False, BLOCK_H)
    if PHASE == 0:
        _grid_sync(CNT, 6 * NPROG)
    if PHASE == 0 or PHASE == 7:  # act = silu(h2 Wg^T) * (h2 Wu^T)
        _gemv(HN, WGU, WGU, ACT, rows, rmask, pid, NPROG, I, H, 2, 1, BLOCK_M, BLOCK_N, BLOCK_K)
    if PHASE == 0:
        _grid_sync(CNT, 7 * NPROG)
    if PHASE == 0 or PHASE == 8:  # delta' += act Wd^T, split over K
        _gemv(ACT, WD, WD, DELTA, rows, rmask, pid, NPROG, H, I, 3, SPLITK, BLOCK_M, BLOCK_N, BLOCK_K)
    if PHASE == 0:  # the last program out resets both counters for the next launch
        out = tl.atomic_add(CNT + 1, 1, sem="acq_rel", scope="gpu")
        if out == NPROG - 1:
            tl.store(CNT, 0)
            tl.store(CNT + 1, 0)


# -- launcher -------------------------------------------------------------------------------------
@dataclasses.dataclass
class Scratch:
    """The fused step's buffers for MAX_ROWS rows over caches of max_len slots (one per engine bucket):
    resid and delta carry the residual stream and the fp32 down product from block to block; the rest
    hold one phase's output for the next (see the kernel); cnt: the barrier's two counters."""

    resid: torch.Tensor  # (16, H) dtype
    delta: torch.Tensor  # (16, H) fp32
    qkv: torch.Tensor  # (16, NQKV)
    parts: torch.Tensor  # (16 * HQ * NSPLIT * D,) fp32
    lse: torch.Tensor  # (16 * HQ * NSPLIT,) fp32
    o: torch.Tensor  # (16, QS)
    a: torch.Tensor  # (16, H)
    res1: torch.Tensor  # (16, H)
    hn: torch.Tensor  # (16, H)
    act: torch.Tensor  # (16, I)
    cnt: torch.Tensor  # (2,) int32, zero between launches
    nsplit: int

    @classmethod
    def empty(
        cls, *, hidden: int, q_size: int, kv_size: int, intermediate: int, q_heads: int, head_dim: int,
        max_len: int, dtype: torch.dtype, device: Any,
    ) -> Scratch:  # fmt: skip
        nsplit = cdiv(max_len, attn.split_len(max_len))
        r = MAX_ROWS

        def z(*shape: int, dt: torch.dtype = dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dt, device=device)

        return cls(
            resid=z(r, hidden),
            delta=z(r, hidden, dt=torch.float32),
            qkv=z(r, q_size + 2 * kv_size),
            parts=z(r * q_heads * nsplit * head_dim, dt=torch.float32),
            lse=z(r * q_heads * nsplit, dt=torch.float32),
            o=z(r, q_size),
            a=z(r, hidden),
            res1=z(r, hidden),
            hn=z(r, hidden),
            act=z(r, intermediate),
            cnt=z(2, dt=torch.int32),
            nsplit=nsplit,
        )


@dataclasses.dataclass
class BlockWeights:
    """One block's weights as the decode engine holds them (kdistill.decode._Layer)."""

    ln1: torch.Tensor  # (H,)
    qkv: torch.Tensor  # (NQKV, H)
    qkv_bias: torch.Tensor | None  # (NQKV,)
    o: torch.Tensor  # (H, QS)
    ln2: torch.Tensor  # (H,)
    gate_up: torch.Tensor  # (2I, H)
    down: torch.Tensor  # (H, I)


def launch(
    key: KernelKey,
    x: torch.Tensor | None,
    w: BlockWeights,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pos: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    sc: Scratch,
    programs: int,
    eps: float,
):
    """The kernel's (kernel, grid, args, kwargs, ()) for the B = len(pos) <= 16 rows of x (the
    embeddings (B, H) of the step's tokens; a later block reads sc.delta instead), caches (B, Hkv, M, D)
    contiguous, pos (B,) int64 each row's slot, the fp32 RoPE tables (M', D), on `programs` programs
    (at most the SM count: every program must be resident at once)."""
    b = int(pos.shape[0])
    h, d, hkv, m = int(key["H"]), int(key["D"]), int(key["HKV"]), int(k_cache.shape[2])
    if (
        b > MAX_ROWS
        or k_cache.shape[:2] != (b, hkv)
        or k_cache.shape[3] != d
        or m > sc.nsplit * int(key["SPLIT"])
    ):
        raise KernelError(
            f"decode_block: {b} rows over caches {tuple(k_cache.shape)} do not fit the key and its scratch"
        )
    if w.qkv.shape != (int(key["NQKV"]), h) or w.gate_up.shape != (2 * int(key["I"]), h):
        raise KernelError(f"decode_block: weights {tuple(w.qkv.shape)} do not fit the key")
    if not key["FIRST"]:
        x = sc.delta  # a later block's input is the down product's accumulator
    elif x is None or x.shape[0] < b:
        raise KernelError("decode_block: the first block needs the embeddings of its rows")
    args = (
        x, sc.resid, sc.delta, w.ln1, w.qkv, w.qkv_bias if w.qkv_bias is not None else w.ln1, sc.qkv,
        k_cache, v_cache, pos, cos, sin, sc.parts, sc.lse, sc.o, w.o, sc.a, sc.res1, sc.hn, w.ln2,
        w.gate_up, sc.act, w.down, sc.cnt, b, m, sc.nsplit, int(programs), float(eps), 1.0 / math.sqrt(d),
    )  # fmt: skip
    names = (
        "H", "NQKV", "QS", "I", "D", "HQ", "HKV", "G", "BLOCK_G", "BLOCK_NA", "SPLIT", "BLOCK_S", "BLOCK_H",
        "BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLITK", "HAS_BIAS", "FIRST", "PHASE",
    )  # fmt: skip
    kwargs = {n: key[n] for n in names}
    return decode_block_kernel, (int(programs),), args, {**kwargs, **launch_options(key)}, ()


def run(spec) -> tuple:
    kernel, grid, args, kwargs, outs = spec
    kernel[grid](*args, **kwargs)
    return outs


def decode_block_reference(
    x: torch.Tensor | None,
    w: BlockWeights,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pos: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    sc: Scratch,
    eps: float,
    first: bool,
) -> None:
    """The kernel's function in PyTorch, the unfused step's ops in its order: reads x (first) or
    sc.delta and sc.resid, writes sc.resid (r2), sc.delta (the down product, fp32) and the caches."""
    from kdistill.ops.attention import decode_attention_reference
    from kdistill.ops.rmsnorm import rmsnorm_reference

    b, dt = int(pos.shape[0]), w.ln1.dtype
    hkv, d = k_cache.shape[1], k_cache.shape[3]
    delta = (x if first else sc.delta)[:b].to(dt)
    r1 = delta if first else delta + sc.resid[:b]
    qkv = F.linear(rmsnorm_reference(r1, w.ln1, eps), w.qkv, w.qkv_bias)
    qs = w.o.shape[1]
    q, k, v = qkv.split([qs, hkv * d, hkv * d], dim=-1)
    o = decode_attention_reference(
        q.reshape(b, -1, d), k_cache, v_cache, pos, k.reshape(b, hkv, d), v.reshape(b, hkv, d), cos, sin
    )
    r2 = F.linear(o.reshape(b, qs), w.o) + r1
    gate, up = F.linear(rmsnorm_reference(r2, w.ln2, eps), w.gate_up).chunk(2, dim=-1)
    y = F.linear(F.silu(gate) * up, w.down)
    sc.resid[:b] = r2
    sc.delta[:b] = y.float()


# -- tile policy and key functions --------------------------------------------------------------
PROGRAMS = 132  # SMs of an H100 / H200 (SXM): the split policy's programs


def split_k(n: int, k: int, block_n: int, block_k: int, programs: int = PROGRAMS) -> int:
    """Parts of K for a product of n columns over k inputs: the one whose busiest program takes the
    least time, each work item (tile x part) dealt out in turn and costing its K chunks plus one (its
    first chunk's latency and its atomic epilogue), the fewest parts on ties."""
    tiles, chunks = cdiv(n, block_n), cdiv(k, block_k)

    def cost(s: int) -> tuple[int, int]:
        return cdiv(tiles * s, programs) * (cdiv(chunks, s) + 1), s

    return min(range(1, chunks + 1), key=cost)


def tiles(*, hidden: int, intermediate: int, head_dim: int, q_heads: int, kv_heads: int, max_len: int):
    """16 rows (every bucket it serves), 16 columns and 256 of K a product tile (measured:
    benchmarks/decode_block_phases.py), the down product split over K (split_k). The attention's tiles as
    the split kernel's."""
    a = attn.tiles(head_dim, q_heads, kv_heads, max_len)
    chunk = 256
    return {
        "BLOCK_H": next_pow2(hidden),
        "BLOCK_M": MAX_ROWS,
        "BLOCK_N": 16,
        "BLOCK_K": chunk,
        "SPLITK": split_k(hidden, intermediate, 16, chunk),
        "BLOCK_G": a["BLOCK_G"],
        "BLOCK_NA": a["BLOCK_N"],
        "SPLIT": a["SPLIT"],
        "BLOCK_S": attn.combine_tiles(max_len)["BLOCK_S"],
    }


@memoized
def block_key(
    arch: str,
    *,
    hidden: int,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    intermediate: int,
    dtype: str,
    max_len: int,
    bias: bool,
    first: bool,
    phase: int = 0,
    aligned: Sequence[bool] | None = None,
) -> KernelKey:
    """The fused block for a model of these shapes in `dtype` over caches of max_len slots; bias: the
    q/k/v product has one; first: the first block (its input the embeddings, in `dtype`; later blocks
    read the fp32 delta). phase 0: the GPU's launch (all phases); 1..6: one phase (the interpreter)."""
    if not supported(hidden=hidden, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim):
        raise KernelError(f"decode_block: heads {q_heads}/{kv_heads} of {head_dim} are not supported")
    dt = dtype_name(dtype)
    return make_key(
        BLOCK.op,
        arch,
        H=int(hidden),
        NQKV=int((q_heads + 2 * kv_heads) * head_dim),
        QS=int(q_heads * head_dim),
        I=int(intermediate),
        D=int(head_dim),
        HQ=int(q_heads),
        HKV=int(kv_heads),
        G=int(q_heads // kv_heads),
        HAS_BIAS=bool(bias),
        FIRST=bool(first),
        PHASE=int(phase),
        dtype=dt,
        x_dtype=dt if first else "fp32",
        align=BLOCK.align(aligned),
        num_warps=4,
        num_stages=3,
        **tiles(
            hidden=hidden,
            intermediate=intermediate,
            head_dim=head_dim,
            q_heads=q_heads,
            kv_heads=kv_heads,
            max_len=max_len,
        ),  # fmt: skip
    )


def phase_key(key: KernelKey, phase: int) -> KernelKey:
    """`key` running one phase alone (1..6; the interpreter's launches) or all of them (0)."""
    return KernelKey(key.op, key.arch, tuple((n, int(phase) if n == "PHASE" else v) for n, v in key.params))


def supported(*, hidden: int, q_heads: int, kv_heads: int, head_dim: int) -> bool:
    """Shapes the kernel takes: the decode attention's with RoPE inside it, widths a multiple of 16."""
    return attn.supported(head_dim, q_heads, kv_heads) and attn.rope_supported(head_dim) and hidden % 16 == 0


# -- registered description ---------------------------------------------------------------------
def _warm(key: KernelKey, device: Any) -> tuple:
    """One row over caches of 2 slots (aligned: every pointer is)."""
    h, i, d, hq, hkv = (int(key[n]) for n in ("H", "I", "D", "HQ", "HKV"))
    dt = key["dtype"]
    w = BlockWeights(
        ln1=tensor((h,), dt, device),
        qkv=tensor((int(key["NQKV"]), h), dt, device),
        qkv_bias=tensor((int(key["NQKV"]),), dt, device) if key["HAS_BIAS"] else None,
        o=tensor((h, hq * d), dt, device),
        ln2=tensor((h,), dt, device),
        gate_up=tensor((2 * i, h), dt, device),
        down=tensor((h, i), dt, device),
    )
    sc = Scratch.empty(
        hidden=h, q_size=hq * d, kv_size=hkv * d, intermediate=i, q_heads=hq, head_dim=d, max_len=2,
        dtype=torch_dtype(dt), device=device,
    )  # fmt: skip
    k = tensor((1, hkv, 2, d), dt, device)
    v = tensor((1, hkv, 2, d), dt, device)
    pos = torch.ones(1, dtype=torch.int64, device=device)
    cos, sin = tensor((2, d), "fp32", device), tensor((2, d), "fp32", device)
    x = tensor((1, h), key["x_dtype"], device)
    return launch(key, x, w, k, v, pos, cos, sin, sc, 1, 1e-6)


def plan(
    arch: str,
    *,
    grad: bool,
    hidden: int,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    intermediate: int,
    dtype: str,
    max_len: int,
    bias: bool,
) -> set[KernelKey]:
    """Keys of the fused decode step (every bucket of at most 16 rows launches the same two binaries:
    the first block's and the others')."""
    del grad
    if not supported(hidden=hidden, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim):
        return set()
    kw = dict(
        hidden=hidden, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim, intermediate=intermediate,
        dtype=dtype, max_len=max_len, bias=bias,
    )  # fmt: skip
    return {block_key(arch, first=True, **kw), block_key(arch, first=False, **kw)}


BLOCK = Kernel(
    "decode_block",
    decode_block_kernel,
    block_key,
    _warm,
    {
        "X": "x_dtype",
        "RESID": "dtype",
        "DELTA": "fp32",
        "LN1": "dtype",
        "WQKV": "dtype",
        "BQKV": "dtype",
        "QKV": "dtype",
        "KC": "dtype",
        "VC": "dtype",
        "POS": "i64",
        "COS": "fp32",
        "SIN": "fp32",
        "OP": "fp32",
        "LSE": "fp32",
        "O": "dtype",
        "WO": "dtype",
        "A": "dtype",
        "RES1": "dtype",
        "HN": "dtype",
        "LN2": "dtype",
        "WGU": "dtype",
        "ACT": "dtype",
        "WD": "dtype",
        "CNT": "i32",
    },
)
SPEC = KernelSpec(name="decode_block", kernels=(BLOCK,), tiles=tiles, plan=plan)
