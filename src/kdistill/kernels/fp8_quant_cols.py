"""Triton column-wise FP8 quantisation written transposed (an FP8 student's backward GEMM inputs).

For x (R, C) row-major, one scale per column and the quantised transpose:

    s_j = max(max_i |x_ij|, tiny) * fp32(1/448)           (fp32, (C,): one scale per column)
    qt_ji = e4m3(clamp(x_ij * (1 / s_j), -448, 448))      (float8_e4m3fn, (C, R) row-major)

so that x^T ~ qt * s[:, None]: the row-wise-scaled operand `torch._scaled_mm` takes when a GEMM
reduces over x's rows. The FP8 student (kdistill.models.fp8_train) needs it three times per linear:
x^T (M, K) -> (K, M) and gy^T (M, N) -> (N, M) for grad_W = gy^T x, and W^T (N, K) -> (K, N) for
grad_x = gy W. Same math as kernels/fp8_quant.py (row-wise), on columns.

Two kernels, both over a grid of (column block of BLOCK_C, row span of SPAN rows), so that a narrow x
with many rows (the token count) still fills the GPU:
1. fp8_quant_cols_amax: each program writes its span's column |max| into P (cdiv(R, SPAN), C) fp32;
2. fp8_quant_cols: each program reduces its columns' partial maxima from P (a few KB, from L2),
   computes the scales (the programs of span 0 store S), and writes its span quantised and
   transposed: consecutive rows of x are consecutive bytes of a row of QT.
A maximum is exact in any order, so the bytes are the reference's. x is read twice (2 + 2 bytes an
element) and written once (1 byte). QT's rows are written 16 bytes at a time: when R is not a
multiple of 16 the kernel writes a QT padded to the next one and `run` returns a contiguous
copy (odd token counts only; the FP8 GEMMs need multiples of 16 anyway). R is a runtime int (not specialised: the token count may change
between calls without a new compile); the number of spans follows from it and SPAN.

The file reads top to bottom: kernels, launchers, reference, key functions and tile policy, then the
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
def fp8_quant_cols_amax_kernel(
    X, P, R, C: tl.constexpr, SPAN: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr
):
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)  # (BC,)
    cmask = cols < C
    span = tl.program_id(1)
    r_start = span.to(tl.int64) * SPAN
    rows = tl.arange(0, BLOCK_R)  # (BR,)
    # elementwise maxima over the span, one cross-thread reduction at the end
    acc = tl.zeros((BLOCK_R, BLOCK_C), dtype=tl.float32)
    for r0 in range(0, SPAN, BLOCK_R):
        r = r_start + r0 + rows
        m = (r[:, None] < R) & cmask[None, :]
        x = tl.load(X + r[:, None] * C + cols[None, :], mask=m, other=0.0).to(tl.float32)  # (BR, BC)
        acc = tl.maximum(acc, tl.abs(x))
    tl.store(P + span.to(tl.int64) * C + cols, tl.max(acc, axis=0), mask=cmask)


@jit(do_not_specialize=["R", "SQ"])
def fp8_quant_cols_kernel(
    X,
    P,
    QT,
    S,
    R,
    SQ,
    C: tl.constexpr,
    SPAN: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)  # (BC,)
    cmask = cols < C
    cols64 = cols.to(tl.int64)
    span = tl.program_id(1)
    n_spans = (R + SPAN - 1) // SPAN
    # the columns' maxima: P (n_spans, C), BLOCK_P spans at a time
    parts = tl.arange(0, BLOCK_P)  # (BP,)
    acc = tl.zeros((BLOCK_P, BLOCK_C), dtype=tl.float32)
    for p0 in range(0, n_spans, BLOCK_P):
        p = p0 + parts
        pm = (p[:, None] < n_spans) & cmask[None, :]
        acc = tl.maximum(acc, tl.load(P + p[:, None].to(tl.int64) * C + cols[None, :], mask=pm, other=0.0))
    amax = tl.max(acc, axis=0)  # (BC,)
    # As fp8_quant: a product with the fp32 constant 1/448 and an IEEE-rounded reciprocal, so the
    # kernel and the reference write the same bytes.
    scale = tl.maximum(amax, 1e-12) * 0.0022321429569274187  # TINY, INV_FP8_MAX (exact in fp32)
    if span == 0:
        tl.store(S + cols, scale, mask=cmask)
    inv = tl.math.div_rn(tl.full((BLOCK_C,), 1.0, tl.float32), scale)
    # QT's row stride SQ is R rounded up to a multiple of 16 (the launcher pads QT when R is not one);
    # written as SQ // 16 * 16 it is provably one, so that with the mask on SQ the transposed stores
    # go 16 bytes at a time (the padding gets zeros)
    sq = SQ // 16 * 16
    r_start = span.to(tl.int64) * SPAN
    rows = tl.arange(0, BLOCK_R)
    for r0 in range(0, SPAN, BLOCK_R):
        r = r_start + r0 + rows  # (BR,)
        m = (r[:, None] < R) & cmask[None, :]
        x = tl.load(X + r[:, None] * C + cols64[None, :], mask=m, other=0.0).to(tl.float32)  # (BR, BC)
        q = tl.clamp(x * inv[None, :], -448.0, 448.0).to(QT.dtype.element_ty)
        qt = tl.trans(q)  # (BC, BR): a row of QT holds consecutive rows of x
        mt = cmask[:, None] & (r[None, :] < sq)
        tl.store(QT + cols64[:, None] * sq + r[None, :], qt, mask=mt)


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    if x2.shape[0] > INT32_MAX - 2048:  # R, R rounded up to 16 and to a span stay 32-bit ints
        raise KernelError(f"fp8_quant_cols: {x2.shape[0]} rows exceed a 32-bit int")
    return x2


def partials(key: KernelKey, x: torch.Tensor) -> torch.Tensor:
    """An empty P (cdiv(R, SPAN), C) fp32 for x (R, C): one column maximum per span of rows."""
    x2 = _rows(x)
    spans = max(1, -(-x2.shape[0] // key["SPAN"]))
    return torch.empty((spans, x2.shape[1]), dtype=torch.float32, device=x.device)


def _grid(key: KernelKey, p: torch.Tensor) -> tuple[int, int]:
    return (-(-p.shape[1] // key["BLOCK_C"]), p.shape[0])


def amax_launch(key: KernelKey, x: torch.Tensor):
    """(kernel, grid, args, kwargs, p) for x (R, C) row-major: p (cdiv(R, SPAN), C) the spans' maxima."""
    x2 = _rows(x)
    p = partials(key, x2)
    kwargs = dict(
        C=x2.shape[1], SPAN=key["SPAN"], BLOCK_R=key["BLOCK_R"], BLOCK_C=key["BLOCK_C"], **launch_options(key)
    )
    return fp8_quant_cols_amax_kernel, _grid(key, p), (x2, p, x2.shape[0]), kwargs, p


def launch(key: KernelKey, x: torch.Tensor, p: torch.Tensor):
    """(kernel, grid, args, kwargs, (qt, scale)) for x (R, C) row-major and its spans' maxima p (from
    amax_launch): qt (C, R) (a view of the padded buffer the kernel writes when R is not a multiple of
    16: `run` makes it contiguous), scale (C,)."""
    x2 = _rows(x)
    rows, c = x2.shape
    sq = -(-rows // 16) * 16  # QT's row stride: R padded to 16 bytes (see the kernel)
    qt = torch.empty((c, sq), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((c,), dtype=torch.float32, device=x.device)
    kwargs = dict(
        C=c,
        SPAN=key["SPAN"],
        BLOCK_R=key["BLOCK_R"],
        BLOCK_C=key["BLOCK_C"],
        BLOCK_P=key["BLOCK_P"],
        **launch_options(key),
    )
    return fp8_quant_cols_kernel, _grid(key, p), (x2, p, qt, s, rows, sq), kwargs, (qt[:, :rows], s)


def run(spec) -> Any:
    """Launch; a padded QT (R not a multiple of 16) is returned as a contiguous copy."""
    kernel, grid, args, kwargs, outs = spec
    kernel[grid](*args, **kwargs)
    if isinstance(outs, tuple):
        return tuple(o if o.is_contiguous() else o.contiguous() for o in outs)
    return outs


def reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(qt (C, R) float8_e4m3fn, scale (C,) fp32) for x (..., C): the kernel's math with PyTorch ops."""
    xt = x.reshape(-1, x.shape[-1]).float().t()  # (C, R)
    scale = xt.abs().amax(dim=-1).clamp_min(TINY) * INV_FP8_MAX
    q = (xt * torch.reciprocal(scale)[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.contiguous(), scale


# -- tile policy and key functions ----------------------------------------------------------------
def tiles(c: int) -> dict[str, int]:
    """Spans of 1024 rows in tiles of 128 rows by 64 columns (fewer for a narrower x): 128 bytes of a
    row of QT per tile row. At 32768 tokens that is 32 spans, so even 896 columns make 448 programs."""
    return {"SPAN": 1024, "BLOCK_R": 128, "BLOCK_C": min(64, next_pow2(c)), "num_warps": 4, "num_stages": 1}


@memoized
def amax_key(arch: str, *, c: int, dtype: str, aligned: Sequence[bool] | None = None) -> KernelKey:
    """The spans' column maxima of (rows, c) inputs in `dtype` (the first kernel). aligned: X."""
    return make_key(AMAX.op, arch, C=int(c), dtype=dtype_name(dtype), align=AMAX.align(aligned), **tiles(c))


@memoized
def key(arch: str, *, c: int, dtype: str, aligned: Sequence[bool] | None = None) -> KernelKey:
    """Column-wise FP8 quantisation of (rows, c) inputs in `dtype`, written transposed, from the spans'
    maxima (the second kernel). aligned: X."""
    return make_key(
        QUANT_COLS.op,
        arch,
        C=int(c),
        dtype=dtype_name(dtype),
        align=QUANT_COLS.align(aligned),
        BLOCK_P=16,
        **tiles(c),
    )


# -- registered description -----------------------------------------------------------------------
def _warm_amax(key: KernelKey, device: Any) -> tuple:
    """(3, C) input aligned as `key` says (R is not specialised: any row count compiles the same)."""
    al = str(key["align"])[0] == "A"
    return amax_launch(key, tensor((3, key["C"]), key["dtype"], device, al))


def _warm(key: KernelKey, device: Any) -> tuple:
    """(3, C) input aligned as `key` says, and its one span's maxima."""
    al = str(key["align"])[0] == "A"
    x = tensor((3, key["C"]), key["dtype"], device, al)
    return launch(key, x, partials(key, x).zero_())


def plan(arch: str, *, grad: bool, c: int, dtype: str) -> set[KernelKey]:
    """The keys of one transposed GEMM input of width c (an FP8 student's backward): both kernels."""
    del grad
    return {amax_key(arch, c=c, dtype=dtype), key(arch, c=c, dtype=dtype)}


AMAX = Kernel(
    "fp8_quant_cols_amax",
    fp8_quant_cols_amax_kernel,
    amax_key,
    _warm_amax,
    {"X": "dtype", "P": "fp32"},
    ("P",),
)
# P is read here but always a fresh allocation (16-byte aligned), as the outputs are
QUANT_COLS = Kernel(
    "fp8_quant_cols",
    fp8_quant_cols_kernel,
    key,
    _warm,
    {"X": "dtype", "P": "fp32", "QT": "fp8e4nv", "S": "fp32"},
    ("P", "QT", "S"),
)
SPEC = KernelSpec(name="fp8_quant_cols", kernels=(AMAX, QUANT_COLS), tiles=tiles, plan=plan)
