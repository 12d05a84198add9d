"""Triton linear of a decode step at a few rows (a batch bucket of at most 64), with the MLP's SwiGLU in
its epilogue: kernel, launcher, reference, key functions, registered KernelSpec.

    y = x W^T (+ bias)                        (EPI 0, 1)       x (M, K), W (N, K)  -> y (M, N)
    y = silu(x Wg^T) * (x Wu^T)               (EPI 2)          W = [Wg; Wu] (2N, K) -> y (M, N)

At one to 64 rows a decode step's linears are memory-bound matrix-vector products: what counts is
streaming W once with enough programs in flight, and each kernel's fixed latency. One program per
BLOCK_N output columns (and per K split) holds all rows (BLOCK_M = 16, the dot's smallest tile: a batch
of 1 computes 15 masked rows for free; 32 or 64 for a larger bucket of a narrow model, so the weights
still stream once). On sm_90 and newer the kernels launch with programmatic dependent
launch (keys.pdl): a program loads the weights of its first PRE_K inputs, which no earlier kernel writes,
then waits for the previous kernel, so the weights stream while that kernel finishes; then it reads its
input rows and walks the rest of its K range in BLOCK_K steps, accumulating in fp32. Products with few
column blocks split K over SPLIT programs: each writes an fp32 partial, and the last to arrive (an
acquire-release count per column block) sums them in split order and writes y. With EPI 2 the gate and
the up rows of its columns stream side by side, so the (M, 2N) gate/up output is never written and the
SwiGLU kernel is not launched; the epilogue rounds as the unfused path does (gate and up to the
weights' dtype, silu(gate) likewise).

The file reads top to bottom: kernel, launcher, reference, key functions and tile policy, then the
registered KernelSpec. No backward: generation runs without gradients.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from kdistill.dtypes import torch_dtype
from kdistill.errors import KernelError
from kdistill.kernels._triton import cdiv, jit, pdl_release, pdl_wait, tl
from kdistill.kernels.keys import (
    KernelKey,
    arch_capability,
    constexpr_value,
    dtype_name,
    f64_bits,
    launch_options,
    make_key,
    memoized,
    next_pow2,
    pdl,
    pdl_constexpr,
)
from kdistill.kernels.spec import Kernel, KernelSpec, tensor

EPI_NONE, EPI_BIAS, EPI_SWIGLU = 0, 1, 2
# A block's norms inside a small bucket's products (dispatch.folds): the product before the norm adds the
# residual and writes each row's sums of squares by column block (an ADD key), the product after it,
# whose weights hold the norm's weight (decode.DecodeWeights), scales each row by its rstd (an RSTD key);
# no norm launch. Which norms: None (the policy, norm_folds) those whose product before them is not
# split; for experiments (benchmarks/decode_profile.py --fold-norm) 0: none, 1: the norm after o_proj
# (o_proj, gate/up), 2: also the norm after the down (down, the next block's q/k/v).
FOLD_NORM: int | None = None
FOLD_ROWS = 32  # buckets of at most this many rows fold (Qwen2.5-0.5B at 64 rows: +0.8% a step folded)
MAX_ROWS = 64  # the buckets this kernel serves (16, 32 or 64 rows a tile); larger ones stay on cuBLAS
ROW_TILES = (16, 32, 64)  # BLOCK_M: the smallest tile that holds the bucket (16: the dot's smallest)
# A bucket of 17 to 64 rows: the products with a side of at most NARROW (measured on an H200,
# benchmarks/decode_products.py: Qwen2.5-0.5B's, 896 wide, on par with cuBLAS or faster; 1.5B's, 1,536
# wide, all slower alone; chained at 32 rows, below, faster), plain ones past 32 rows only up to NARROW
# inputs (0.5B's down at 64 rows slower).
NARROW = 1024
# A bucket of 17 to 32 rows also where a product has a side of at most NARROW_32 (Qwen2.5-1.5B, 1,536 wide:
# its step chained at 32 rows, the down on the long-K tile, gate/up on 64 columns a program; measured
# inside the step on an H200, batch 32 1.78 -> 1.65 ms; at 64 rows the same chain was slower, 1.92 -> 2.19)
NARROW_32 = 1536
LONG_ROWS = 32  # buckets of at most this many rows take the long-K tile past MAX_PLAIN_K inputs


def block_m(rows: int) -> int:
    """The row tile of a bucket of `rows` rows (at most MAX_ROWS)."""
    return next(t for t in ROW_TILES if rows <= t)


@jit
def _row_rstd(
    SS, rows, rmask, M, K: tl.constexpr, EPS: tl.constexpr, RSTD: tl.constexpr, RSTD_P2: tl.constexpr
):
    """Each row's 1 / sqrt(mean(x^2) + eps) from the RSTD partial sums of squares the producer of x wrote
    (SS (RSTD, M) fp32: one row a column block of it), summed in column-block order."""
    part = tl.arange(0, RSTD_P2)
    ss = tl.load(
        SS + part[:, None] * M + rows[None, :], mask=(part < RSTD)[:, None] & rmask[None, :], other=0.0
    )
    return tl.rsqrt(tl.sum(ss, axis=0) / K + EPS)  # (BLOCK_M,)


@jit
def _add_stats(Y, R, SS, y, rows, cols, ymask, yoffs, pid, M, N: tl.constexpr):
    """The product's output y (fp32) rounded to its dtype plus the residual R, rounded (the residual add
    of the norm after it: kernels/rmsnorm.py rounds the same way), written to Y; and this column block's
    sums of squares of it per row, to SS[pid] (the consumer's rstd)."""
    r = tl.load(R + yoffs, mask=ymask, other=0.0).to(tl.float32)
    s = (y.to(Y.dtype.element_ty).to(tl.float32) + r).to(Y.dtype.element_ty)
    tl.store(Y + yoffs, s, mask=ymask)
    sf = tl.where(ymask, s.to(tl.float32), 0.0)
    tl.store(SS + pid * M + rows, tl.sum(sf * sf, axis=1), mask=rows < M)


@jit(do_not_specialize=["M"], do_not_specialize_on_alignment=["R", "SS"])
def decode_gemv_kernel(
    X,
    W,
    BIAS,
    Y,
    P,
    CNT,
    R,
    SS,
    M,
    N: tl.constexpr,
    K: tl.constexpr,
    EPI: tl.constexpr,
    SPLIT: tl.constexpr,
    K_SPLIT: tl.constexpr,
    PRE_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
    COMBINE: tl.constexpr,
    ADD: tl.constexpr = False,
    RSTD: tl.constexpr = 0,
    RSTD_P2: tl.constexpr = 1,
    EPS: tl.constexpr = 0.0,
):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < M
    cmask = cols < N
    cols64 = cols.to(tl.int64)
    k_lo = split * K_SPLIT
    k_hi = tl.minimum(k_lo + K_SPLIT, K)
    pdl_release(PDL)
    # The weights of this program's first PRE_K inputs depend on no earlier kernel: they are loaded
    # before the wait for the previous kernel, so that wait and this kernel's launch hide their latency.
    kp = k_lo + tl.arange(0, PRE_K)
    pmask = kp < k_hi
    pwmask = cmask[:, None] & pmask[None, :]
    pw = tl.load(W + cols64[:, None] * K + kp[None, :], mask=pwmask, other=0.0)  # (BLOCK_N, PRE_K)
    pw2 = pw
    if EPI == 2:
        pw2 = tl.load(W + (cols64 + N)[:, None] * K + kp[None, :], mask=pwmask, other=0.0)
    pdl_wait(PDL)
    px = tl.load(X + rows[:, None] * K + kp[None, :], mask=rmask[:, None] & pmask[None, :], other=0.0)
    acc = tl.dot(px, tl.trans(pw), tl.zeros((BLOCK_M, BLOCK_N), tl.float32))
    acc2 = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    if EPI == 2:
        acc2 = tl.dot(px, tl.trans(pw2), acc2)
    for k0 in range(k_lo + PRE_K, k_hi, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        kmask = kk < k_hi
        x = tl.load(X + rows[:, None] * K + kk[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        wmask = cmask[:, None] & kmask[None, :]
        w = tl.load(W + cols64[:, None] * K + kk[None, :], mask=wmask, other=0.0)  # (BLOCK_N, BLOCK_K)
        acc = tl.dot(x, tl.trans(w), acc)
        if EPI == 2:
            w2 = tl.load(W + (cols64 + N)[:, None] * K + kk[None, :], mask=wmask, other=0.0)
            acc2 = tl.dot(x, tl.trans(w2), acc2)
    ymask = rmask[:, None] & cmask[None, :]
    yoffs = rows[:, None] * N + cols64[None, :]
    if SPLIT == 1:
        if RSTD > 0:  # x is the un-normed residual stream: each row's rstd scales the products
            rstd = _row_rstd(SS, rows, rmask, M, K, EPS, RSTD, RSTD_P2)
            acc = acc * rstd[:, None]
            acc2 = acc2 * rstd[:, None]
        if EPI == 1:
            acc += tl.load(BIAS + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        if EPI == 2:
            g = acc.to(Y.dtype.element_ty).to(tl.float32)
            u = acc2.to(Y.dtype.element_ty).to(tl.float32)
            act = (g * tl.sigmoid(g)).to(Y.dtype.element_ty).to(tl.float32)
            acc = act * u
        if ADD:
            _add_stats(Y, R, SS, acc, rows, cols, ymask, yoffs, pid, M, N)
        else:
            tl.store(Y + yoffs, acc.to(Y.dtype.element_ty), mask=ymask)
    elif not COMBINE:
        # the partials are the output (EPI 0): the next kernel sums them in split order (rmsnorm's PARTS)
        tl.store(P + split.to(tl.int64) * M * N + yoffs, acc, mask=ymask)
    else:
        # K split over SPLIT programs per column block: each writes its fp32 partial (with EPI 2 the
        # gate's, then the up's), and the last of them to arrive (an acquire-release count per column
        # block) sums the partials in split order (the same sum whichever program is last), applies the
        # epilogue, writes y and sets the count back to 0.
        PARTS: tl.constexpr = 2 if EPI == 2 else 1
        at = P + split.to(tl.int64) * PARTS * M * N + yoffs
        tl.store(at, acc, mask=ymask)
        if EPI == 2:
            tl.store(at + M * N, acc2, mask=ymask)
        tl.debug_barrier()
        arrived = tl.atomic_add(CNT + pid, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT - 1:
            tl.debug_barrier()
            tot = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            tot2 = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            for s in tl.static_range(SPLIT):
                tot += tl.load(P + s * PARTS * M * N + yoffs, mask=ymask, other=0.0, cache_modifier=".cg")
                if EPI == 2:
                    tot2 += tl.load(
                        P + (s * PARTS + 1) * M * N + yoffs, mask=ymask, other=0.0, cache_modifier=".cg"
                    )
            if RSTD > 0:
                rstd = _row_rstd(SS, rows, rmask, M, K, EPS, RSTD, RSTD_P2)
                tot = tot * rstd[:, None]
                tot2 = tot2 * rstd[:, None]
            if EPI == 1:
                tot += tl.load(BIAS + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
            if EPI == 2:
                g = tot.to(Y.dtype.element_ty).to(tl.float32)
                u = tot2.to(Y.dtype.element_ty).to(tl.float32)
                tot = (g * tl.sigmoid(g)).to(Y.dtype.element_ty).to(tl.float32) * u
            if ADD:
                _add_stats(Y, R, SS, tot, rows, cols, ymask, yoffs, pid, M, N)
            else:
                tl.store(Y + yoffs, tot.to(Y.dtype.element_ty), mask=ymask)
            tl.atomic_xchg(CNT + pid, 0, sem="relaxed", scope="gpu")


_COUNTERS: dict[tuple[str, int | None], torch.Tensor] = {}


def counters(device: torch.device, n: int) -> torch.Tensor:
    """The zeroed int32 arrival counts of split products on `device` (at least n): every launch leaves
    them at zero. One set per device: the kernels that use them run in stream order (a decode step's
    launches, each after the previous has finished)."""
    dev = torch.device(device)
    k = (dev.type, dev.index)
    c = _COUNTERS.get(k)
    if c is None or c.numel() < n:
        c = _COUNTERS[k] = torch.zeros(max(int(n), 1024), dtype=torch.int32, device=dev)
    return c


def launch(
    key: KernelKey,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    ss: torch.Tensor | None = None,
):
    """The kernel's (kernel, grid, args, kwargs, (y,)) for x (M, K) contiguous with M <= BLOCK_M, the
    weight (N, K) (EPI 0, 1) or the stacked (2N, K) (EPI 2) contiguous, bias (N,) for EPI 1. A key
    without COMBINE returns the fp32 partials (SPLIT, M, N) instead of y. A key with ADD (a plain
    product) adds `residual` (M, N) and returns (x W^T + residual, its sums of squares (column blocks,
    M) fp32): the residual add of the norm after it, whose rstd the next product computes. A key with
    RSTD takes x un-normed and `ss` (RSTD, M) such sums: each row's products scaled by its rstd (the
    norm's weight folded into `weight`)."""
    m, k = x.shape
    n, epi, split = int(key["N"]), int(key["EPI"]), int(key["SPLIT"])
    combine = bool(key["COMBINE"])
    add, nss = bool(key.get("ADD")), int(key.get("RSTD") or 0)
    if not combine and (split == 1 or epi != EPI_NONE or add):
        raise KernelError("decode_gemv: partials as the output need a split plain product (EPI 0)")
    if m > int(key["BLOCK_M"]) or k != int(key["K"]):
        raise KernelError(f"decode_gemv: x {tuple(x.shape)} does not fit the key (<= {key['BLOCK_M']} rows)")
    if weight.shape != ((2 * n if epi == EPI_SWIGLU else n), k) or not (
        x.is_contiguous() and weight.is_contiguous()
    ):
        raise KernelError(f"decode_gemv: weight {tuple(weight.shape)} does not fit the key")
    if add and (residual is None or residual.shape != (m, n) or not residual.is_contiguous()):
        raise KernelError(f"decode_gemv: an add key needs a contiguous ({m}, {n}) residual")
    if nss and (ss is None or ss.shape != (nss, m) or ss.dtype != torch.float32 or not ss.is_contiguous()):
        raise KernelError(f"decode_gemv: an rstd key needs ({nss}, {m}) fp32 sums of squares")
    y = torch.empty((m, n) if combine else (0,), dtype=torch_dtype(key["dtype"]), device=x.device)
    col_blocks = cdiv(n, int(key["BLOCK_N"]))
    cnt = counters(x.device, col_blocks)
    if split > 1:
        parts = torch.empty(
            (split, 2 if epi == EPI_SWIGLU else 1, m, n), dtype=torch.float32, device=x.device
        )
    else:
        parts = cnt.view(torch.float32)  # not read or written without a split
    ss_out = torch.empty((col_blocks, m), dtype=torch.float32, device=x.device) if add else None
    sums = ss_out if add else ss if nss else cnt.view(torch.float32)  # unread without ADD or RSTD
    args = (x, weight, bias if epi == EPI_BIAS else weight, y, parts, cnt, residual if add else y, sums, m)
    kwargs = dict(
        N=n,
        K=k,
        EPI=epi,
        SPLIT=split,
        K_SPLIT=int(key["K_SPLIT"]),
        PRE_K=int(key["PRE_K"]),
        BLOCK_M=int(key["BLOCK_M"]),
        BLOCK_N=int(key["BLOCK_N"]),
        BLOCK_K=int(key["BLOCK_K"]),
        PDL=pdl_constexpr(key),
        COMBINE=combine,
        **({"ADD": True} if add else {}),
        **({"RSTD": nss, "RSTD_P2": int(key["RSTD_P2"]), "EPS": constexpr_value(key["EPS"])} if nss else {}),
        **launch_options(key),
    )
    if add:
        return decode_gemv_kernel, (col_blocks, split), args, kwargs, (y, ss_out)
    out = y if combine else parts.view(split, m, n)
    return decode_gemv_kernel, (col_blocks, split), args, kwargs, (out,)


def run(spec) -> tuple:
    kernel, grid, args, kwargs, outs = spec
    kernel[grid](*args, **kwargs)
    return outs


def decode_gemv_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, swiglu: bool = False
) -> torch.Tensor:
    """The kernel's function in PyTorch: what the unfused step computes (a linear, then SwiGLU over the
    two halves of the stacked gate/up output, in the inputs' dtype)."""
    y = F.linear(x, weight, bias)
    if swiglu:
        gate, up = y.chunk(2, dim=-1)
        return F.silu(gate) * up
    return y


def add_stats_reference(
    x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, block_n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """What an ADD key computes: (x W^T rounded + residual, rounded; its sums of squares per row over each
    block_n columns, (column blocks, M) fp32)."""
    y = F.linear(x, weight)
    s = (y.float() + residual.float()).to(y.dtype)
    m, n = s.shape
    sf = F.pad(s.float(), (0, cdiv(n, block_n) * block_n - n))
    return s, sf.pow(2).view(m, -1, block_n).sum(-1).t().contiguous()


def scaled_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    ss: torch.Tensor,
    eps: float,
    bias: torch.Tensor | None = None,
    swiglu: bool = False,
) -> torch.Tensor:
    """What an RSTD key computes: x (un-normed) W^T with each row scaled by rsqrt(sum(ss) / K + eps) in
    fp32, then the bias or the SwiGLU (gate and up rounded first, as the unfused path)."""
    rstd = torch.rsqrt(ss.sum(0) / x.shape[1] + eps)
    y = F.linear(x.float(), weight.float()) * rstd[:, None]
    if bias is not None:
        y = y + bias.float()
    if swiglu:
        g, u = (t.to(x.dtype).float() for t in y.chunk(2, dim=-1))
        y = F.silu(g).to(x.dtype).float() * u
    return y.to(x.dtype)


# -- tile policy and key functions --------------------------------------------------------------
PROGRAMS = 256  # programs a product aims for at most (two resident per SM at the largest tiles)
MIN_SPLIT_K = 512  # inputs per split at least
PRE_K = {EPI_NONE: 1024, EPI_BIAS: 1024, EPI_SWIGLU: 512}  # at most, loaded before the wait
# the larger tiles' SwiGLU prefetch (measured, 0.5B's gate/up: at 32 rows 128 inputs, 9.2 us a launch
# against 28.7 at 512; at 64 rows 64 inputs, 8.7 us against 12.7 at 128)
PRE_K_TILE = {16: PRE_K, 32: {**PRE_K, EPI_SWIGLU: 128}, 64: {**PRE_K, EPI_SWIGLU: 64}}
# the 16-row tile's SwiGLU over more than WIDE_SWIGLU_K inputs (measured inside the step on an H200:
# Qwen2.5-1.5B, 1,536 inputs, batch 4 1.481 -> 1.417 ms a step with 256 against 512, 1.448 with 128; the
# 0.5B's 896 inputs keep 512: 0.758 -> 0.829 ms with 256)
PRE_K_WIDE_SWIGLU = 256
# SwiGLU products of more inputs than this take PRE_K_WIDE_SWIGLU at 16 rows and 64 columns a program at
# 32 (Qwen2.5-1.5B's gate/up at 32 rows, inside the step on an H200: 26.3 -> 20.8 us a block with 64
# columns, 24.7 with 16, 30-42 with 256-512 inputs before the wait); they are served in buckets of at most
# WIDE_SWIGLU_ROWS rows (an experiment's knob: benchmarks/decode_profile.py --narrow)
WIDE_SWIGLU_K = 1024
WIDE_SWIGLU_ROWS = MAX_ROWS
# Archs with tensor memory (sm_100 to sm_110): a tile of 64 rows takes the tcgen05 dot, which Triton
# builds with at most 512 prefetched inputs (more: "blockN must be less than or equal to 512")
TMEM_MAX_PRE_K = 512


def tensor_memory(arch: str) -> bool:
    """Whether `arch` has tensor memory (its dots of 64 rows and more run as tcgen05 MMAs)."""
    try:
        return 100 <= arch_capability(arch) < 120
    except ValueError:  # "cpu"
        return False


MAX_PLAIN_K = 5120  # plain products of more inputs take the long-K tile (below) or cuBLAS
# Plain products of MAX_PLAIN_K to MAX_LONG_K inputs at up to 16 rows (Qwen2.5-1.5B's down, 8,960 inputs):
# 64 columns a program, LONG_PROGRAMS programs (K split to fill them), LONG_PRE_K inputs before the wait.
# Measured on an H200 (benchmarks/decode_products.py, then inside the step): 9.5 / 10.1 us a product at 4 /
# 16 rows against cuBLAS's 11.7 / 11.3 (and its split-K reduction's launch); the 16-column tile took
# 16.2 / 16.5 (its K loop moves 4 KB a program an iteration: too few bytes in flight). Longer K (3B, 7B)
# is not measured: cuBLAS.
MAX_LONG_K = 9216
LONG_BLOCK_N, LONG_PROGRAMS, LONG_PRE_K = 64, 192, 512


def tiles(
    *, n: int, k: int, epilogue: int, rows: int = 1, arch: str = "sm_90", combine: bool = True
) -> dict[str, int]:
    """The bucket's row tile (block_m, its prefetch PRE_K_TILE, at most TMEM_MAX_PRE_K at 64 rows on an
    arch with tensor memory, at most PRE_K_WIDE_SWIGLU for a SwiGLU over more than WIDE_SWIGLU_K inputs);
    32 columns a program with the SwiGLU epilogue (two weight tiles each; 64 in the 32-row tile past
    WIDE_SWIGLU_K inputs), else 16 (LONG_BLOCK_N past MAX_PLAIN_K inputs); plain products with few
    column blocks split K (at least MIN_SPLIT_K inputs a split) into as many parts as keep them within
    PROGRAMS programs (more than fit at once and the last ones run alone after the others), where their
    partials go to the next kernel (combine False: the norm after o_proj and down sums them) or K is
    past MAX_PLAIN_K: a product the next kernel reads as it is (q/k/v, read by the attention) is not
    split, since its last-arriving program's combine would sit on that kernel's path (measured inside
    the step on an H200: Qwen2.5-1.5B's q/k/v unsplit, the block's attention ends ~1-2 us sooner); the
    first PRE_K inputs' weights loaded before the wait for
    the previous kernel, then BLOCK_K = 128 an iteration (benchmarks/decode_products.py, NOTES.md round
    twelve; round fifteen measured wider and longer tiles, and a split SwiGLU, inside the step: none
    faster). The SwiGLU epilogue stays in one program a column block: the kernel also takes it split
    (the last program to arrive applies it), which measured slower."""
    long_k = epilogue != EPI_SWIGLU and k > MAX_PLAIN_K
    tile = block_m(rows)
    block_n = 32 if epilogue == EPI_SWIGLU else (LONG_BLOCK_N if long_k else 16)
    if epilogue == EPI_SWIGLU and tile == ROW_TILES[1] and k > WIDE_SWIGLU_K:
        block_n = 64
    split, k_split = 1, k
    if epilogue != EPI_SWIGLU and (not combine or long_k):
        programs = LONG_PROGRAMS if long_k else PROGRAMS
        want = max(1, min(programs // cdiv(n, block_n), k // MIN_SPLIT_K))
        k_split = cdiv(cdiv(k, want), 128) * 128
        split = cdiv(k, k_split)
    cap = LONG_PRE_K if long_k else PRE_K_TILE[tile][epilogue]
    if epilogue == EPI_SWIGLU and k > WIDE_SWIGLU_K:
        cap = min(cap, PRE_K_WIDE_SWIGLU)
    if tile >= 64 and tensor_memory(arch):
        cap = min(cap, TMEM_MAX_PRE_K)
    pre_k = min(next_pow2(k_split), cap)
    return {
        "BLOCK_M": tile,
        "BLOCK_N": block_n,
        "BLOCK_K": 128,
        "PRE_K": pre_k,
        "SPLIT": split,
        "K_SPLIT": k_split,
    }


@memoized
def gemv_key(
    arch: str,
    *,
    n: int,
    k: int,
    dtype: str,
    epilogue: int = EPI_NONE,
    combine: bool = True,
    rows: int = 1,
    aligned: Sequence[bool] | None = None,
    add: bool = False,
    rstd: int = 0,
    eps: float = 0.0,
) -> KernelKey:
    """The kernel for an (n, k) weight in `dtype` (n: the output width; the stacked weight of the SwiGLU
    epilogue has 2n rows). combine False: a split plain product's output is its fp32 partials, summed
    by the next kernel (a residual add + RMSNorm with PARTS = SPLIT). rows: the bucket's (its row tile,
    block_m). aligned: X, W, BIAS. add: a plain product that adds the residual and writes its sums of
    squares (split as a product whose partials the next kernel sums, its last program combining them);
    rstd: a product whose input is un-normed, scaled by the rstd of `rstd` such sums (norm eps `eps`)."""
    return make_key(
        GEMV.op,
        arch,
        N=int(n),
        K=int(k),
        EPI=int(epilogue),
        COMBINE=bool(combine),
        dtype=dtype_name(dtype),
        align=GEMV.align(aligned),
        PDL=pdl(arch),
        num_warps=4,
        num_stages=3,
        **tiles(n=n, k=k, epilogue=epilogue, rows=rows, arch=arch, combine=combine and not add),
        **({"ADD": True} if add else {}),
        **({"RSTD": int(rstd), "RSTD_P2": next_pow2(rstd), "EPS": f64_bits(eps)} if rstd else {}),
    )


def supported(k: int) -> bool:
    """Shapes the kernel takes: K a multiple of 16 (the dot's smallest K)."""
    return k % 16 == 0


def split(n: int, k: int) -> int:
    """The programs a plain (n, k) product whose partials the next kernel sums (o_proj, down) splits each
    column block's K over (1: not split)."""
    return tiles(n=n, k=k, epilogue=EPI_NONE, combine=False)["SPLIT"]


def norm_folds(hidden: int, q_size: int, intermediate: int) -> tuple[bool, bool]:
    """Whether a model's decode step folds the norm after o_proj and the norm after the down into the
    products around them (in buckets of at most FOLD_ROWS rows, dispatch.folds): FOLD_NORM's level
    where set, else each norm whose product before it is not split. A split product would combine its
    own partials before it adds (its last program, on the critical path), which costs about what the
    norm's launch did: measured on an H200 (benchmarks/NOTES.md), Qwen2.5-0.5B's unsplit o_proj folded
    -2 to -4% a step, the 1.5B's split o_proj +1 to +3%."""
    if FOLD_NORM is not None:
        return FOLD_NORM >= 1, FOLD_NORM >= 2
    return split(hidden, q_size) == 1, split(hidden, intermediate) == 1


def serves(rows: int, k: int, epilogue: int, n: int) -> bool:
    """Where the engine's step uses this kernel instead of cuBLAS for an (n, k) product (measured,
    benchmarks/decode_products.py and decode_profile.py): buckets of at most 16 rows, of 17 to MAX_ROWS
    where n or k is at most NARROW, and of 17 to 32 where it is at most NARROW_32; q/k/v with its bias,
    o_proj and gate/up with its SwiGLU at any width (a SwiGLU of more than WIDE_SWIGLU_K inputs up to
    WIDE_SWIGLU_ROWS rows), down up to MAX_PLAIN_K inputs (MAX_LONG_K up to LONG_ROWS rows, past 32 rows
    NARROW)."""
    side = min(n, k)
    fits = (
        rows <= ROW_TILES[0]
        or (rows <= MAX_ROWS and side <= NARROW)
        or (rows <= ROW_TILES[1] and side <= NARROW_32)
    )
    plain_k = MAX_LONG_K if rows <= LONG_ROWS else MAX_PLAIN_K if rows <= ROW_TILES[1] else NARROW
    if epilogue == EPI_SWIGLU:
        return fits and supported(k) and (k <= WIDE_SWIGLU_K or rows <= WIDE_SWIGLU_ROWS)
    return fits and supported(k) and k <= plain_k


def step_rows(hidden: int) -> int:
    """The largest bucket whose decode step runs on this kernel (and chains, runtime.chained) for a model
    `hidden` wide: every block product has a side of `hidden` (serves; a product it leaves to cuBLAS, the
    0.5B's down at 64 rows, sits in the chain unchained)."""
    return MAX_ROWS if hidden <= NARROW else ROW_TILES[1] if hidden <= NARROW_32 else ROW_TILES[0]


# -- registered description ---------------------------------------------------------------------
def _warm(key: KernelKey, device: Any) -> tuple:
    """Two rows, aligned as `key` says, through the launcher (with a residual or sums of squares where
    the key adds or scales)."""
    al = [c == "A" for c in str(key["align"])]
    n, k, epi, dt = int(key["N"]), int(key["K"]), int(key["EPI"]), key["dtype"]
    x = tensor((2, k), dt, device, al[0])
    w = tensor((2 * n if epi == EPI_SWIGLU else n, k), dt, device, al[1])
    bias = tensor((n,), dt, device, al[2]) if epi == EPI_BIAS else None
    residual = tensor((2, n), dt, device, True) if key.get("ADD") else None
    nss = int(key.get("RSTD") or 0)
    ss = torch.ones((nss, 2), dtype=torch.float32, device=device) if nss else None
    return launch(key, x, w, bias, residual, ss)


def plan(
    arch: str,
    *,
    grad: bool,
    hidden: int,
    q_size: int,
    kv_size: int,
    intermediate: int,
    qkv_bias: bool,
    dtype: str,
    rows: int = 1,
    eps: float = 1e-6,
) -> set[KernelKey]:
    """Keys of the decode step's products this kernel serves: q/k/v (with its bias), o_proj, gate/up
    with its SwiGLU, down (one key per product and row tile: every bucket of at most 16 rows launches
    the same binary, and an engine of any batch size decodes a few prompts in such a bucket; an engine
    of more rows, `rows`, also has the larger buckets' tiles where serves says so). o_proj and down feed
    a residual add + RMSNorm: split, their partials go to it (combine False) in the step (runtime.chained);
    for each norm folded (norm_folds), the ADD key of the product before it and the RSTD key (norm eps
    `eps`) of the product after it."""
    del grad
    products = (
        (q_size + 2 * kv_size, hidden, EPI_BIAS if qkv_bias else EPI_NONE),
        (hidden, q_size, EPI_NONE),
        (intermediate, hidden, EPI_SWIGLU),
        (hidden, intermediate, EPI_NONE),
    )
    keys = set()
    for tile in ROW_TILES:
        if tile > block_m(min(rows, MAX_ROWS)):  # no bucket of the engine takes it
            continue
        for n, k, epi in products:
            if serves(tile, k, epi, n):
                keys.add(gemv_key(arch, n=n, k=k, dtype=dtype, epilogue=epi, rows=tile))
        for n, k, epi in products[1::2]:  # o_proj, down
            if serves(tile, k, epi, n) and split(n, k) > 1:
                keys.add(gemv_key(arch, n=n, k=k, dtype=dtype, epilogue=epi, combine=False, rows=tile))
        qkv_n, qkv_epi = products[0][0], products[0][2]
        post, pre = norm_folds(hidden, q_size, intermediate) if tile <= FOLD_ROWS else (False, False)
        folded = ((q_size, intermediate, EPI_SWIGLU),) * post + (  # o_proj + add, gate/up
            (intermediate, qkv_n, qkv_epi),  # the down + the add, then the next block's q/k/v
        ) * pre
        for k, consumer_n, epi in folded:
            if serves(tile, k, EPI_NONE, hidden) and serves(tile, hidden, epi, consumer_n):
                add = gemv_key(arch, n=hidden, k=k, dtype=dtype, rows=tile, add=True)
                keys.add(add)
                parts = cdiv(hidden, int(add["BLOCK_N"]))
                keys.add(  # scaled by the rstd from the sums of squares the add wrote
                    gemv_key(
                        arch,
                        n=consumer_n,
                        k=hidden,
                        dtype=dtype,
                        epilogue=epi,
                        rows=tile,
                        rstd=parts,
                        eps=eps,
                    )
                )
    return keys


GEMV = Kernel(
    "decode_gemv",
    decode_gemv_kernel,
    gemv_key,
    _warm,
    {
        "X": "dtype",
        "W": "dtype",
        "BIAS": "dtype",
        "Y": "dtype",
        "P": "fp32",
        "CNT": "i32",
        "R": "dtype",
        "SS": "fp32",
    },
    outputs=("Y", "P", "CNT"),
)
SPEC = KernelSpec(name="decode_gemv", kernels=(GEMV,), tiles=tiles, plan=plan)
