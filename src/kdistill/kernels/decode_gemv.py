"""Triton linear of a decode step at a few rows (a batch bucket of at most 16), with the MLP's SwiGLU in
its epilogue: kernel, launcher, reference, key functions, registered KernelSpec.

    y = x W^T (+ bias)                        (EPI 0, 1)       x (M, K), W (N, K)  -> y (M, N)
    y = silu(x Wg^T) * (x Wu^T)               (EPI 2)          W = [Wg; Wu] (2N, K) -> y (M, N)

and the residual add with RMSNorm folded into the products on either side of it (FUSE, below):

    s = x W^T + r, ss[m, j] = sum of s[m, c]^2 over column block j        (FUSE_ADD: o_proj, down)
    y = (norm(x) * nw) W^T ..., norm(x) = x / sqrt(sum_j ss[m, j] / K + eps)   (FUSE_NORM: q/k/v, gate/up)

At one to sixteen rows a decode step's linears are memory-bound matrix-vector products: what counts is
streaming W once with enough programs in flight, and each kernel's fixed latency. One program per
BLOCK_N output columns (and per K split) holds all rows (BLOCK_M = 16, the dot's smallest tile: a batch
of 1 computes 15 masked rows for free). On sm_90 and newer the kernels launch with programmatic dependent
launch (keys.pdl): a program loads the weights of its first PRE_K inputs, which no earlier kernel writes,
then waits for the previous kernel, so the weights stream while that kernel finishes; then it reads its
input rows and walks the rest of its K range in BLOCK_K steps, accumulating in fp32. Products with few
column blocks split K over SPLIT programs: each writes an fp32 partial, and the last to arrive (an
acquire-release count per column block) sums them in split order and writes y. With EPI 2 the gate and
the up rows of its columns stream side by side, so the (M, 2N) gate/up output is never written and the
SwiGLU kernel is not launched; the epilogue rounds as the unfused path does (gate and up to the
weights' dtype, silu(gate) likewise).

FUSE: a decode block's residual add and RMSNorm without a norm kernel between two products. The product
before the norm (FUSE_ADD) adds the residual r to its output and writes the sum s (the next residual)
and, per row, the sum of squares of each of its column blocks (ss (M, column blocks), fp32); the product
after it (FUSE_NORM) reads s as its input, sums those partials in column order for each row's rstd
(the same partials whichever program reads them: graph and eager stay token-identical), and normalises
each input tile before its dot, rounding as the norm kernel does (s to its dtype, s * rstd to the
dtype, then times the norm's weight nw). Two launches fewer a block.

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
    dtype_name,
    launch_options,
    make_key,
    memoized,
    next_pow2,
    pdl,
    pdl_constexpr,
)
from kdistill.kernels.spec import Kernel, KernelSpec, tensor

EPI_NONE, EPI_BIAS, EPI_SWIGLU = 0, 1, 2
FUSE_NONE, FUSE_NORM, FUSE_ADD = 0, 1, 2  # the product after a block's norm, the product before it
ADD_BLOCK_N = 16  # columns a program of a FUSE_ADD product: one partial sum of squares each
MAX_ROWS = 16  # the buckets this kernel serves (one row tile); larger ones stay on cuBLAS


@jit
def _normed(x, rstd, nw):
    """An input tile (rows, k) of residual sums, normed as the norm kernel rounds: s * rstd to the
    tile's dtype, then times the norm's weight (fp32 nw (k,)), to the dtype again."""
    n = (x.to(tl.float32) * rstd[:, None]).to(x.dtype).to(tl.float32)
    return (n * nw[None, :]).to(x.dtype)


@jit
def _add_store(acc, res, Y, SS, yoffs, ymask, rows, rmask, pid, BLOCK_SS: tl.constexpr):
    """FUSE_ADD's epilogue: the product rounded to Y's dtype (as the unfused product writes it) plus
    the residual, rounded again (as the norm kernel's sum), stored, and each row's sum of squares over
    this program's columns stored at (row, column block)."""
    d = acc.to(Y.dtype.element_ty).to(tl.float32)
    sm = (d + res).to(Y.dtype.element_ty)
    tl.store(Y + yoffs, sm, mask=ymask)
    sf = tl.where(ymask, sm.to(tl.float32), 0.0)
    tl.store(SS + rows * BLOCK_SS + pid, tl.sum(sf * sf, axis=1), mask=rmask)


@jit(do_not_specialize=["M"])
def decode_gemv_kernel(
    X,
    W,
    BIAS,
    Y,
    P,
    CNT,
    RES,
    NW,
    SS,
    M,
    eps,
    N: tl.constexpr,
    K: tl.constexpr,
    EPI: tl.constexpr,
    FUSE: tl.constexpr,
    BLOCK_SS: tl.constexpr,
    SPLIT: tl.constexpr,
    K_SPLIT: tl.constexpr,
    PRE_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
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
    pnw = pw  # FUSE_NORM: the norm's weight over the first PRE_K inputs (a weight: before the wait)
    if FUSE == 1:
        pnw = tl.load(NW + kp, mask=pmask, other=0.0).to(tl.float32)
    pdl_wait(PDL)
    px = tl.load(X + rows[:, None] * K + kp[None, :], mask=rmask[:, None] & pmask[None, :], other=0.0)
    rstd = tl.zeros((BLOCK_M,), tl.float32)
    if FUSE == 1:  # each row's rstd from the previous product's partial sums of squares, in column order
        nb = tl.arange(0, BLOCK_SS)
        nbmask = nb < (K + 15) // 16  # the column blocks of ADD_BLOCK_N (16) the previous product wrote
        ss = tl.load(
            SS + rows[:, None] * BLOCK_SS + nb[None, :], mask=rmask[:, None] & nbmask[None, :], other=0.0
        )
        rstd = tl.rsqrt(tl.sum(ss, axis=1) / K + eps)
        px = _normed(px, rstd, pnw)
    res = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    if FUSE == 2:  # the residual this product adds (written by an earlier kernel: after the wait)
        res = tl.load(
            RES + rows[:, None] * N + cols64[None, :], mask=rmask[:, None] & cmask[None, :], other=0.0
        )
        res = res.to(tl.float32)
    acc = tl.dot(px, tl.trans(pw), tl.zeros((BLOCK_M, BLOCK_N), tl.float32))
    acc2 = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    if EPI == 2:
        acc2 = tl.dot(px, tl.trans(pw2), acc2)
    for k0 in range(k_lo + PRE_K, k_hi, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        kmask = kk < k_hi
        x = tl.load(X + rows[:, None] * K + kk[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        if FUSE == 1:
            x = _normed(x, rstd, tl.load(NW + kk, mask=kmask, other=0.0).to(tl.float32))
        wmask = cmask[:, None] & kmask[None, :]
        w = tl.load(W + cols64[:, None] * K + kk[None, :], mask=wmask, other=0.0)  # (BLOCK_N, BLOCK_K)
        acc = tl.dot(x, tl.trans(w), acc)
        if EPI == 2:
            w2 = tl.load(W + (cols64 + N)[:, None] * K + kk[None, :], mask=wmask, other=0.0)
            acc2 = tl.dot(x, tl.trans(w2), acc2)
    ymask = rmask[:, None] & cmask[None, :]
    yoffs = rows[:, None] * N + cols64[None, :]
    if SPLIT == 1:
        if EPI == 1:
            acc += tl.load(BIAS + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        if EPI == 2:
            g = acc.to(Y.dtype.element_ty).to(tl.float32)
            u = acc2.to(Y.dtype.element_ty).to(tl.float32)
            act = (g * tl.sigmoid(g)).to(Y.dtype.element_ty).to(tl.float32)
            acc = act * u
        if FUSE == 2:
            _add_store(acc, res, Y, SS, yoffs, ymask, rows, rmask, pid, BLOCK_SS)
        else:
            tl.store(Y + yoffs, acc.to(Y.dtype.element_ty), mask=ymask)
    else:
        # K split over SPLIT programs per column block (EPI 0 and 1): each writes its fp32 partial, and
        # the last of them to arrive (an acquire-release count per column block) sums the partials in
        # split order (the same sum whichever program is last), writes y and sets the count back to 0.
        tl.store(P + split.to(tl.int64) * M * N + yoffs, acc, mask=ymask)
        tl.debug_barrier()
        arrived = tl.atomic_add(CNT + pid, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT - 1:
            tl.debug_barrier()
            tot = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            for s in tl.static_range(SPLIT):
                tot += tl.load(P + s * M * N + yoffs, mask=ymask, other=0.0, cache_modifier=".cg")
            if EPI == 1:
                tot += tl.load(BIAS + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
            if FUSE == 2:
                _add_store(tot, res, Y, SS, yoffs, ymask, rows, rmask, pid, BLOCK_SS)
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
    norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
):
    """The kernel's (kernel, grid, args, kwargs, outs) for x (M, K) contiguous with M <= BLOCK_M, the
    weight (N, K) (EPI 0, 1) or the stacked (2N, K) (EPI 2) contiguous, bias (N,) for EPI 1. FUSE_ADD:
    residual (M, N) contiguous, outs (s, ss); FUSE_NORM: norm = (ss, the norm's weight (K,), eps) with
    ss the previous FUSE_ADD product's, x its s; else outs (y,)."""
    m, k = x.shape
    n, epi, split, fuse = int(key["N"]), int(key["EPI"]), int(key["SPLIT"]), int(key["FUSE"])
    if m > int(key["BLOCK_M"]) or k != int(key["K"]):
        raise KernelError(f"decode_gemv: x {tuple(x.shape)} does not fit the key (<= {key['BLOCK_M']} rows)")
    if weight.shape != ((2 * n if epi == EPI_SWIGLU else n), k) or not (
        x.is_contiguous() and weight.is_contiguous()
    ):
        raise KernelError(f"decode_gemv: weight {tuple(weight.shape)} does not fit the key")
    if split > 1 and epi == EPI_SWIGLU:
        raise KernelError("decode_gemv: the SwiGLU epilogue needs the whole K in one program (SPLIT 1)")
    dtype = torch_dtype(key["dtype"])
    block_ss = int(key["BLOCK_SS"])
    if (fuse == FUSE_ADD) != (residual is not None) or (fuse == FUSE_NORM) != (norm is not None):
        raise KernelError(
            f"decode_gemv: FUSE {fuse} with residual={residual is not None}, norm={norm is not None}"
        )
    if residual is not None and (
        residual.shape != (m, n) or residual.dtype != dtype or not residual.is_contiguous()
    ):
        raise KernelError(
            f"decode_gemv: residual {tuple(residual.shape)} {residual.dtype} does not fit the key"
        )
    ss, nw, eps = (None, None, 0.0) if norm is None else norm
    if ss is not None and (ss.shape != (m, block_ss) or ss.dtype != torch.float32):
        raise KernelError(f"decode_gemv: sums of squares {tuple(ss.shape)} do not fit the key")
    if nw is not None and (nw.shape != (k,) or nw.dtype != dtype):
        raise KernelError(f"decode_gemv: norm weight {tuple(nw.shape)} {nw.dtype} does not fit the key")
    y = torch.empty((m, n), dtype=dtype, device=x.device)
    col_blocks = cdiv(n, int(key["BLOCK_N"]))
    cnt = counters(x.device, col_blocks)
    if split > 1:
        parts = torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    else:
        parts = cnt.view(torch.float32)  # not read or written without a split
    if fuse == FUSE_ADD:
        ss = torch.empty((m, block_ss), dtype=torch.float32, device=x.device)
    outs = (y, ss) if fuse == FUSE_ADD else (y,)
    args = (
        x,
        weight,
        bias if epi == EPI_BIAS else weight,
        y,
        parts,
        cnt,
        residual if residual is not None else weight,
        nw if nw is not None else weight,
        ss if ss is not None else parts,
        m,
        float(eps),
    )
    kwargs = dict(
        N=n,
        K=k,
        EPI=epi,
        FUSE=fuse,
        BLOCK_SS=block_ss,
        SPLIT=split,
        K_SPLIT=int(key["K_SPLIT"]),
        PRE_K=int(key["PRE_K"]),
        BLOCK_M=int(key["BLOCK_M"]),
        BLOCK_N=int(key["BLOCK_N"]),
        BLOCK_K=int(key["BLOCK_K"]),
        PDL=pdl_constexpr(key),
        **launch_options(key),
    )
    return decode_gemv_kernel, (col_blocks, split), args, kwargs, outs


def run(spec) -> tuple:
    kernel, grid, args, kwargs, outs = spec
    kernel[grid](*args, **kwargs)
    return outs


def decode_gemv_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    swiglu: bool = False,
    residual: torch.Tensor | None = None,
    norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> tuple[torch.Tensor, ...]:
    """The kernel's function in PyTorch: what the unfused step computes (a linear, then SwiGLU over the
    two halves of the stacked gate/up output, in the inputs' dtype) -> (y,); with `norm` (FUSE_NORM)
    x normed first by the partial sums of squares, with `residual` (FUSE_ADD) -> (y + residual, its
    sums of squares per row and column block of ADD_BLOCK_N (M, norm_blocks(N)))."""
    if norm is not None:
        ss, nw, eps = norm
        rstd = torch.rsqrt(ss.sum(-1, keepdim=True) / x.shape[-1] + eps)
        x = nw * (x.float() * rstd).to(x.dtype)
    y = F.linear(x, weight, bias)
    if swiglu:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    if residual is None:
        return (y,)
    s = y + residual
    m, n = s.shape
    blocks = cdiv(n, ADD_BLOCK_N)
    sq = F.pad(s.float().pow(2), (0, blocks * ADD_BLOCK_N - n)).view(m, blocks, ADD_BLOCK_N).sum(-1)
    return s, F.pad(sq, (0, norm_blocks(n) - blocks))


def norm_blocks(n: int) -> int:
    """The row stride of the sums of squares a FUSE_ADD product of width n writes (its column blocks,
    rounded up to a power of two: the next product loads them as one tile)."""
    return next_pow2(cdiv(n, ADD_BLOCK_N))


# -- tile policy and key functions --------------------------------------------------------------
PROGRAMS = 256  # programs a product aims for at most (two resident per SM at the largest tiles)
MIN_SPLIT_K = 512  # inputs per split at least
PRE_K = {EPI_NONE: 1024, EPI_BIAS: 1024, EPI_SWIGLU: 512}  # at most, loaded before the wait
MAX_PLAIN_K = 5120  # plain products of more inputs stay on cuBLAS (measured: 4,864 faster here, 8,960 not)


def tiles(*, n: int, k: int, epilogue: int, fuse: int = FUSE_NONE) -> dict[str, int]:
    """16 rows (every bucket it serves); 32 columns a program with the SwiGLU epilogue (two weight tiles
    each), else 16; plain products with few column blocks split K (at least MIN_SPLIT_K inputs a split)
    into as many parts as keep them within PROGRAMS programs (more than fit at once and the last ones
    run alone after the others); the first PRE_K inputs' weights loaded before the wait for the
    previous kernel, then BLOCK_K = 128 an iteration (benchmarks/decode_products.py, NOTES.md round
    twelve). FUSE_ADD: 16 columns a program (one partial sum of squares each, ADD_BLOCK_N); BLOCK_SS:
    the row stride of the sums of squares written (FUSE_ADD) or read (FUSE_NORM)."""
    block_n = 32 if epilogue == EPI_SWIGLU else 16
    if fuse == FUSE_ADD and (epilogue == EPI_SWIGLU or block_n != ADD_BLOCK_N):
        raise ValueError("decode_gemv: the residual add needs 16 columns a program and no SwiGLU")
    split, k_split = 1, k
    if epilogue != EPI_SWIGLU:
        want = max(1, min(PROGRAMS // cdiv(n, block_n), k // MIN_SPLIT_K))
        k_split = cdiv(cdiv(k, want), 128) * 128
        split = cdiv(k, k_split)
    pre_k = min(next_pow2(k_split), PRE_K[epilogue])
    return {
        "BLOCK_M": MAX_ROWS,
        "BLOCK_N": block_n,
        "BLOCK_K": 128,
        "PRE_K": pre_k,
        "SPLIT": split,
        "K_SPLIT": k_split,
        "BLOCK_SS": norm_blocks(n) if fuse == FUSE_ADD else norm_blocks(k) if fuse == FUSE_NORM else 1,
    }


@memoized
def gemv_key(
    arch: str,
    *,
    n: int,
    k: int,
    dtype: str,
    epilogue: int = EPI_NONE,
    fuse: int = FUSE_NONE,
    aligned: Sequence[bool] | None = None,
) -> KernelKey:
    """The kernel for an (n, k) weight in `dtype` (n: the output width; the stacked weight of the SwiGLU
    epilogue has 2n rows); fuse: FUSE_NONE, FUSE_NORM or FUSE_ADD. aligned: X, W, BIAS, RES, NW."""
    return make_key(
        GEMV.op,
        arch,
        N=int(n),
        K=int(k),
        EPI=int(epilogue),
        FUSE=int(fuse),
        dtype=dtype_name(dtype),
        align=GEMV.align(aligned),
        PDL=pdl(arch),
        num_warps=4,
        num_stages=3,
        **tiles(n=n, k=k, epilogue=epilogue, fuse=fuse),
    )


def supported(k: int) -> bool:
    """Shapes the kernel takes: K a multiple of 16 (the dot's smallest K)."""
    return k % 16 == 0


def serves(rows: int, k: int, epilogue: int) -> bool:
    """Where the engine's step uses this kernel instead of cuBLAS (measured, benchmarks/decode_products.py):
    buckets of at most 16 rows; q/k/v with its bias, o_proj and gate/up with its SwiGLU at any width,
    down up to MAX_PLAIN_K inputs."""
    return rows <= MAX_ROWS and supported(k) and (epilogue == EPI_SWIGLU or k <= MAX_PLAIN_K)


def fuses_add(rows: int, k: int, n: int, next_epilogue: int) -> bool:
    """Whether a plain product of k inputs and n outputs at `rows` rows takes the residual add (FUSE_ADD),
    the product after the norm (n inputs, next_epilogue) then normalising its input (FUSE_NORM): both
    served by this kernel."""
    return serves(rows, k, EPI_NONE) and serves(rows, n, next_epilogue)


# -- registered description ---------------------------------------------------------------------
def _warm(key: KernelKey, device: Any) -> tuple:
    """Two rows, aligned as `key` says, through the launcher."""
    al = [c == "A" for c in str(key["align"])]
    n, k, epi, dt = int(key["N"]), int(key["K"]), int(key["EPI"]), key["dtype"]
    x = tensor((2, k), dt, device, al[0])
    w = tensor((2 * n if epi == EPI_SWIGLU else n, k), dt, device, al[1])
    bias = tensor((n,), dt, device, al[2]) if epi == EPI_BIAS else None
    fuse, block_ss = int(key["FUSE"]), int(key["BLOCK_SS"])
    residual = tensor((2, n), dt, device, al[6]) if fuse == FUSE_ADD else None  # X W BIAS Y P CNT RES
    norm = None
    if fuse == FUSE_NORM:
        ss = torch.ones((2, block_ss), dtype=torch.float32, device=device)
        norm = (ss, tensor((k,), dt, device, al[7]), 1e-6)
    return launch(key, x, w, bias, residual, norm)


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
) -> set[KernelKey]:
    """Keys of the decode step's products this kernel serves: q/k/v (with its bias), o_proj, gate/up
    with its SwiGLU, down (one key per product and fusion: every bucket of at most 16 rows launches the
    same binary, and an engine of any batch size decodes a few prompts in such a bucket). Where the
    residual add and norm fold into the products around them (fuses_add): o_proj adds and gate/up
    norms; down adds (the last block's does not: the final norm follows it) and q/k/v norms (the first
    block's does not: the embedding's norm is a kernel)."""
    del grad
    qkv_epi = EPI_BIAS if qkv_bias else EPI_NONE
    qkv, o, gate_up, down = (
        (q_size + 2 * kv_size, hidden, qkv_epi),
        (hidden, q_size, EPI_NONE),
        (intermediate, hidden, EPI_SWIGLU),
        (hidden, intermediate, EPI_NONE),
    )
    after_o = fuses_add(1, q_size, hidden, EPI_SWIGLU)
    after_down = fuses_add(1, intermediate, hidden, qkv_epi)
    keys: set[tuple[tuple[int, int, int], int]] = {(qkv, FUSE_NONE), (down, FUSE_NONE)}
    keys |= {(o, FUSE_ADD), (gate_up, FUSE_NORM)} if after_o else {(o, FUSE_NONE), (gate_up, FUSE_NONE)}
    if after_down:
        keys |= {(qkv, FUSE_NORM), (down, FUSE_ADD)}
    return {
        gemv_key(arch, n=n, k=k, dtype=dtype, epilogue=epi, fuse=fuse)
        for (n, k, epi), fuse in keys
        if serves(1, k, epi)
    }


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
        "RES": "dtype",
        "NW": "dtype",
        "SS": "fp32",
    },
    outputs=("Y", "P", "CNT", "SS"),
)
SPEC = KernelSpec(name="decode_gemv", kernels=(GEMV,), tiles=tiles, plan=plan)
