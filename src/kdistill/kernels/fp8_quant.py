"""Triton row-wise FP8 quantisation of GEMM inputs (an FP8 teacher's activations): kernel, launcher.

    s_i = max(max_j |x_ij|, tiny) * fp32(1/448)      (fp32, one scale per row: per token)
    q_ij = e4m3(clamp(x_ij * (1 / s_i), -448, 448))  (float8_e4m3fn, round to nearest even; the
                                                       reciprocal IEEE-rounded)

so that x ~ q * s[:, None]; the FP8 GEMM (`torch._scaled_mm` with row-wise scales) takes q and s
directly. One program per row: a row of up to BLOCK elements is read once and kept in registers;
a wider one is read twice, a first pass finding its absolute maximum and a second writing q (the
row re-read from L2). Reads 2 bytes and writes 1 per element (plus 4 per row), against the
6 of an extra bf16 pass. The teacher is frozen: there is no backward.

The file reads top to bottom: kernel, launcher, key function and tile policy, then the registered
KernelSpec.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kdistill.errors import KernelError
from kdistill.kernels._triton import jit, tl
from kdistill.kernels.keys import KernelKey, dtype_name, launch_options, make_key, memoized, next_pow2
from kdistill.kernels.spec import Kernel, KernelSpec, tensor

INT32_MAX = 2**31 - 1
FP8_MAX = 448.0  # largest finite float8_e4m3fn
TINY = 1e-12  # an all-zero row gets this amax (its q is all zeros either way)
INV_FP8_MAX = float(torch.tensor(1.0 / FP8_MAX, dtype=torch.float32))  # 1/448 rounded to fp32


@jit
def fp8_quant_rows_kernel(X, Q, S, K: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = row * K
    cols = tl.arange(0, BLOCK)
    if K <= BLOCK:
        # the whole row in one block (the usual widths): one read, kept in registers
        x = tl.load(X + base + cols, mask=cols < K, other=0.0).to(tl.float32)
        # The scale is a product with the fp32 constant 1/448 and the reciprocal an IEEE-rounded
        # division (`/` on fp32 is the approximate one on the GPU), as in the reference, so the same
        # bytes come out.
        scale = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-12) * 0.0022321429569274187  # TINY, INV_FP8_MAX
        tl.store(S + row, scale)
        q = tl.clamp(x * tl.math.div_rn(1.0, scale), -448.0, 448.0)
        tl.store(Q + base + cols, q.to(Q.dtype.element_ty), mask=cols < K)
    else:
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK):
            c = k0 + cols
            x = tl.load(X + base + c, mask=c < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.maximum(tl.max(amax, axis=0), 1e-12) * 0.0022321429569274187  # as above
        tl.store(S + row, scale)
        inv = tl.math.div_rn(1.0, scale)
        for k0 in range(0, K, BLOCK):  # the row again, from L2
            c = k0 + cols
            x = tl.load(X + base + c, mask=c < K, other=0.0).to(tl.float32)
            q = tl.clamp(x * inv, -448.0, 448.0)
            tl.store(Q + base + c, q.to(Q.dtype.element_ty), mask=c < K)


def launch(key: KernelKey, x: torch.Tensor):
    """(kernel, grid, args, kwargs, (q, scale)) for x (rows, K) row-major."""
    x2 = x.reshape(-1, x.shape[-1])
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    rows, k = x2.shape
    if rows > INT32_MAX:
        raise KernelError(f"fp8_quant: {rows} rows exceed the grid")
    q = torch.empty((rows, k), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((rows,), dtype=torch.float32, device=x.device)
    kwargs = dict(K=k, BLOCK=key["BLOCK"], **launch_options(key))
    return fp8_quant_rows_kernel, (rows,), (x2, q, s), kwargs, (q, s)


def run(spec) -> tuple:
    kernel, grid, args, kwargs, outs = spec
    kernel[grid](*args, **kwargs)
    return outs


def reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q (rows, K) float8_e4m3fn, scale (rows,) fp32): the kernel's math with PyTorch ops."""
    x2 = x.reshape(-1, x.shape[-1]).float()
    scale = x2.abs().amax(dim=-1).clamp_min(TINY) * INV_FP8_MAX
    q = (x2 * torch.reciprocal(scale)[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


# -- tile policy and key function -----------------------------------------------------------------
def tiles(k: int) -> dict[str, int]:
    """One program per row, in blocks of up to 2048 columns."""
    block = min(2048, next_pow2(k))
    return {"BLOCK": block, "num_warps": 4 if block <= 1024 else 8, "num_stages": 1}


@memoized
def key(arch: str, *, k: int, dtype: str, aligned: Sequence[bool] | None = None) -> KernelKey:
    """Row-wise FP8 quantisation of (rows, k) inputs in `dtype`. aligned: X."""
    return make_key(
        "fp8_quant", arch, K=int(k), dtype=dtype_name(dtype), align=QUANT.align(aligned), **tiles(k)
    )


# -- registered description -----------------------------------------------------------------------
def _warm(key: KernelKey, device: Any) -> tuple:
    """(2, K) input aligned as `key` says."""
    al = str(key["align"])[0] == "A"
    return launch(key, tensor((2, key["K"]), key["dtype"], device, al))


def plan(arch: str, *, grad: bool, k: int, dtype: str) -> set[KernelKey]:
    """The key of one FP8 GEMM input of width k (no backward: FP8 is for the frozen teacher)."""
    del grad
    return {key(arch, k=k, dtype=dtype)}


QUANT = Kernel(
    "fp8_quant", fp8_quant_rows_kernel, key, _warm, {"X": "dtype", "Q": "fp8e4nv", "S": "fp32"}, ("Q", "S")
)
SPEC = KernelSpec(name="fp8_quant", kernels=(QUANT,), tiles=tiles, plan=plan)
