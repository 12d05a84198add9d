"""Triton linear of a decode step at a few rows (a batch bucket of at most 16), with the MLP's SwiGLU in
its epilogue: kernel, launcher, reference, key functions, registered KernelSpec.

    y = x W^T (+ bias)                        (EPI 0, 1)       x (M, K), W (N, K)  -> y (M, N)
    y = silu(x Wg^T) * (x Wu^T)               (EPI 2)          W = [Wg; Wu] (2N, K) -> y (M, N)

At one to sixteen rows a decode step's linears are memory-bound matrix-vector products: what counts is
streaming W once with enough programs in flight. One program per BLOCK_N output columns holds all rows
(BLOCK_M = 16, the dot's smallest tile: a batch of 1 computes 15 masked rows for free) and walks K in
BLOCK_K steps, accumulating in fp32; with EPI 2 it streams the gate and the up rows of its columns
side by side, so the (M, 2N) gate/up output is never written and the SwiGLU kernel is not launched.
The epilogue rounds as the unfused path does (gate and up to the weights' dtype, silu(gate) likewise).
Measured against cuBLAS at the decode step's shapes in benchmarks/decode_linear_bench.py (NOTES.md,
round nine): the engine uses it where it wins (kdistill.decode: the gate/up product at every width,
o_proj up to 1024 inputs, buckets of at most 16 rows).

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
from kdistill.kernels._triton import cdiv, jit, tl
from kdistill.kernels.keys import KernelKey, dtype_name, launch_options, make_key, memoized
from kdistill.kernels.spec import Kernel, KernelSpec, tensor

EPI_NONE, EPI_BIAS, EPI_SWIGLU = 0, 1, 2
MAX_ROWS = 16  # the buckets this kernel serves (one row tile); larger ones stay on cuBLAS


@jit(do_not_specialize=["M"])
def decode_gemv_kernel(
    X,
    W,
    BIAS,
    Y,
    M,
    N: tl.constexpr,
    K: tl.constexpr,
    EPI: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < M
    cmask = cols < N
    cols64 = cols.to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    acc2 = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        kmask = kk < K
        x = tl.load(X + rows[:, None] * K + kk[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        wmask = cmask[:, None] & kmask[None, :]
        w = tl.load(W + cols64[:, None] * K + kk[None, :], mask=wmask, other=0.0)  # (BLOCK_N, BLOCK_K)
        acc = tl.dot(x, tl.trans(w), acc)
        if EPI == 2:
            w2 = tl.load(W + (cols64 + N)[:, None] * K + kk[None, :], mask=wmask, other=0.0)
            acc2 = tl.dot(x, tl.trans(w2), acc2)
    if EPI == 1:
        acc += tl.load(BIAS + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    if EPI == 2:
        g = acc.to(Y.dtype.element_ty).to(tl.float32)
        u = acc2.to(Y.dtype.element_ty).to(tl.float32)
        act = (g * tl.sigmoid(g)).to(Y.dtype.element_ty).to(tl.float32)
        acc = act * u
    ymask = rmask[:, None] & cmask[None, :]
    tl.store(Y + rows[:, None] * N + cols64[None, :], acc.to(Y.dtype.element_ty), mask=ymask)


def launch(key: KernelKey, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """The kernel's (kernel, grid, args, kwargs, (y,)) for x (M, K) contiguous with M <= BLOCK_M, the
    weight (N, K) (EPI 0, 1) or the stacked (2N, K) (EPI 2) contiguous, bias (N,) for EPI 1."""
    m, k = x.shape
    n, epi = int(key["N"]), int(key["EPI"])
    if m > int(key["BLOCK_M"]) or k != int(key["K"]):
        raise KernelError(f"decode_gemv: x {tuple(x.shape)} does not fit the key (<= {key['BLOCK_M']} rows)")
    if weight.shape != ((2 * n if epi == EPI_SWIGLU else n), k) or not (
        x.is_contiguous() and weight.is_contiguous()
    ):
        raise KernelError(f"decode_gemv: weight {tuple(weight.shape)} does not fit the key")
    y = torch.empty((m, n), dtype=torch_dtype(key["dtype"]), device=x.device)
    args = (x, weight, bias if epi == EPI_BIAS else weight, y, m)
    kwargs = dict(
        N=n,
        K=k,
        EPI=epi,
        BLOCK_M=int(key["BLOCK_M"]),
        BLOCK_N=int(key["BLOCK_N"]),
        BLOCK_K=int(key["BLOCK_K"]),
        **launch_options(key),
    )
    return decode_gemv_kernel, (cdiv(n, int(key["BLOCK_N"])),), args, kwargs, (y,)


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


# -- tile policy and key functions --------------------------------------------------------------
def tiles(*, n: int, k: int, epilogue: int) -> dict[str, int]:
    """16 rows (every bucket it serves), 128 of K an iteration; 32 columns a program with the SwiGLU
    epilogue (two weight tiles each), else 16 (benchmarks/decode_linear_bench.py, H200)."""
    del n, k
    return {"BLOCK_M": MAX_ROWS, "BLOCK_N": 32 if epilogue == EPI_SWIGLU else 16, "BLOCK_K": 128}


@memoized
def gemv_key(
    arch: str, *, n: int, k: int, dtype: str, epilogue: int = EPI_NONE, aligned: Sequence[bool] | None = None
) -> KernelKey:
    """The kernel for an (n, k) weight in `dtype` (n: the output width; the stacked weight of the SwiGLU
    epilogue has 2n rows). aligned: X, W, BIAS."""
    return make_key(
        GEMV.op,
        arch,
        N=int(n),
        K=int(k),
        EPI=int(epilogue),
        dtype=dtype_name(dtype),
        align=GEMV.align(aligned),
        num_warps=4,
        num_stages=4,
        **tiles(n=n, k=k, epilogue=epilogue),
    )


def supported(k: int) -> bool:
    """Shapes the kernel takes: K a multiple of 16 (the dot's smallest K)."""
    return k % 16 == 0


def serves(rows: int, k: int, epilogue: int) -> bool:
    """Where the engine's step uses this kernel instead of cuBLAS (measured): buckets of at most 16 rows,
    the gate/up product with its SwiGLU at any width, a plain product of at most 1024 inputs (o_proj)."""
    return rows <= MAX_ROWS and supported(k) and (epilogue == EPI_SWIGLU or k <= 1024)


# -- registered description ---------------------------------------------------------------------
def _warm(key: KernelKey, device: Any) -> tuple:
    """Two rows, aligned as `key` says, through the launcher."""
    al = [c == "A" for c in str(key["align"])]
    n, k, epi, dt = int(key["N"]), int(key["K"]), int(key["EPI"]), key["dtype"]
    x = tensor((2, k), dt, device, al[0])
    w = tensor((2 * n if epi == EPI_SWIGLU else n, k), dt, device, al[1])
    bias = tensor((n,), dt, device, al[2]) if epi == EPI_BIAS else None
    return launch(key, x, w, bias)


def plan(arch: str, *, grad: bool, hidden: int, q_size: int, intermediate: int, dtype: str) -> set[KernelKey]:
    """Keys of the decode step's products this kernel serves (one key per product: every bucket of at
    most 16 rows launches the same binary, and an engine of any batch size decodes a few prompts in
    such a bucket)."""
    del grad
    out: set[KernelKey] = set()
    if serves(1, hidden, EPI_SWIGLU):
        out.add(gemv_key(arch, n=intermediate, k=hidden, dtype=dtype, epilogue=EPI_SWIGLU))
    if serves(1, q_size, EPI_NONE):
        out.add(gemv_key(arch, n=hidden, k=q_size, dtype=dtype, epilogue=EPI_NONE))
    return out


GEMV = Kernel(
    "decode_gemv",
    decode_gemv_kernel,
    gemv_key,
    _warm,
    {"X": "dtype", "W": "dtype", "BIAS": "dtype", "Y": "dtype"},
    outputs=("Y",),
)
SPEC = KernelSpec(name="decode_gemv", kernels=(GEMV,), tiles=tiles, plan=plan)
