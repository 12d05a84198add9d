"""Triton column-wise FP8 quantisation written transposed (an FP8 student's backward GEMM inputs).

For x (R, C) row-major, one scale per column and the quantised transpose:

    s_j = max(max_i |x_ij|, tiny) * fp32(1/448)           (fp32, (C,): one scale per column)
    qt_ji = e4m3(clamp(x_ij * (1 / s_j), -448, 448))      (float8_e4m3fn, (C, R) row-major)

so that x^T ~ qt * s[:, None]: the row-wise-scaled operand `torch._scaled_mm` takes when a GEMM
reduces over x's rows. The FP8 student (kdistill.models.fp8_train) needs it three times per linear:
x^T (M, K) -> (K, M) and gy^T (M, N) -> (N, M) for grad_W = gy^T x, and W^T (N, K) -> (K, N) for
grad_x = gy W. Same math as kernels/fp8_quant.py (row-wise), on columns.

One program per block of BLOCK_C columns: a first pass over all R rows finds the columns' absolute
maxima, a second writes the transposed tile (the block is re-read from L2). R is a runtime int (not
specialised: the token count may change between calls without a new compile). With few columns (a
narrow x) there are few programs; a split over rows would fill a large GPU better.

The file reads top to bottom: kernel, launcher, reference, key function and tile policy, then the
registered KernelSpec.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kdistill.errors import KernelError
from kdistill.kernels._triton import jit, tl
from kdistill.kernels.fp8_quant import FP8_MAX, INT32_MAX, INV_FP8_MAX, TINY
from kdistill.kernels.keys import KernelKey, dtype_name, launch_options, make_key, memoized, next_pow2
from kdistill.kernels.spec import Kernel, KernelSpec, tensor


@jit(do_not_specialize=["R"])
def fp8_quant_cols_kernel(X, QT, S, R, C: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)  # (BC,)
    cmask = cols < C
    cols64 = cols.to(tl.int64)
    rows = tl.arange(0, BLOCK_R)  # (BR,)
    amax = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        r = (r0 + rows).to(tl.int64)
        m = (r[:, None] < R) & cmask[None, :]
        x = tl.load(X + r[:, None] * C + cols64[None, :], mask=m, other=0.0).to(tl.float32)  # (BR, BC)
        amax = tl.maximum(amax, tl.max(tl.abs(x), axis=0))
    # As fp8_quant: a product with the fp32 constant 1/448 and an IEEE-rounded reciprocal, so the
    # kernel and the reference write the same bytes.
    scale = tl.maximum(amax, 1e-12) * 0.0022321429569274187  # TINY, INV_FP8_MAX (exact in fp32)
    tl.store(S + cols, scale, mask=cmask)
    inv = tl.math.div_rn(tl.full((BLOCK_C,), 1.0, tl.float32), scale)
    for r0 in range(0, R, BLOCK_R):
        r = (r0 + rows).to(tl.int64)
        m = (r[:, None] < R) & cmask[None, :]
        x = tl.load(X + r[:, None] * C + cols64[None, :], mask=m, other=0.0).to(tl.float32)
        # transposed tile (BC, BR), in fp32 (the fp8 conversion after): consecutive rows of x are
        # consecutive elements of a row of QT
        qt = tl.trans(tl.clamp(x * inv[None, :], -448.0, 448.0))
        mt = (r[None, :] < R) & cmask[:, None]
        tl.store(QT + cols64[:, None] * R + r[None, :], qt.to(QT.dtype.element_ty), mask=mt)


def launch(key: KernelKey, x: torch.Tensor):
    """(kernel, grid, args, kwargs, (qt, scale)) for x (R, C) row-major: qt (C, R), scale (C,)."""
    x2 = x.reshape(-1, x.shape[-1])
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    rows, c = x2.shape
    if rows > INT32_MAX:
        raise KernelError(f"fp8_quant_cols: {rows} rows exceed a 32-bit int")
    qt = torch.empty((c, rows), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((c,), dtype=torch.float32, device=x.device)
    grid = ((c + key["BLOCK_C"] - 1) // key["BLOCK_C"],)
    kwargs = dict(C=c, BLOCK_R=key["BLOCK_R"], BLOCK_C=key["BLOCK_C"], **launch_options(key))
    return fp8_quant_cols_kernel, grid, (x2, qt, s, rows), kwargs, (qt, s)


def run(spec) -> tuple:
    kernel, grid, args, kwargs, outs = spec
    kernel[grid](*args, **kwargs)
    return outs


def reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(qt (C, R) float8_e4m3fn, scale (C,) fp32) for x (..., C): the kernel's math with PyTorch ops."""
    xt = x.reshape(-1, x.shape[-1]).float().t()  # (C, R)
    scale = xt.abs().amax(dim=-1).clamp_min(TINY) * INV_FP8_MAX
    q = (xt * torch.reciprocal(scale)[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.contiguous(), scale


# -- tile policy and key function -----------------------------------------------------------------
def tiles(c: int) -> dict[str, int]:
    """Blocks of 32 columns (fewer for a narrower x) by 64 rows."""
    return {"BLOCK_R": 64, "BLOCK_C": min(32, next_pow2(c)), "num_warps": 4, "num_stages": 1}


@memoized
def key(arch: str, *, c: int, dtype: str, aligned: Sequence[bool] | None = None) -> KernelKey:
    """Column-wise FP8 quantisation of (rows, c) inputs in `dtype`, written transposed. aligned: X."""
    return make_key(
        "fp8_quant_cols", arch, C=int(c), dtype=dtype_name(dtype), align=QUANT_COLS.align(aligned), **tiles(c)
    )


# -- registered description -----------------------------------------------------------------------
def _warm(key: KernelKey, device: Any) -> tuple:
    """(3, C) input aligned as `key` says (R is not specialised: any row count compiles the same)."""
    al = str(key["align"])[0] == "A"
    return launch(key, tensor((3, key["C"]), key["dtype"], device, al))


def plan(arch: str, *, grad: bool, c: int, dtype: str) -> set[KernelKey]:
    """The key of one transposed GEMM input of width c (an FP8 student's backward)."""
    del grad
    return {key(arch, c=c, dtype=dtype)}


QUANT_COLS = Kernel(
    "fp8_quant_cols",
    fp8_quant_cols_kernel,
    key,
    _warm,
    {"X": "dtype", "QT": "fp8e4nv", "S": "fp32"},
    ("QT", "S"),
)
SPEC = KernelSpec(name="fp8_quant_cols", kernels=(QUANT_COLS,), tiles=tiles, plan=plan)
