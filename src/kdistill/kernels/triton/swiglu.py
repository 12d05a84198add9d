"""Triton SwiGLU: y = silu(gate) * up, and its backward; kernels, launchers, autograd Function.

    forward:  y  = (g * sigmoid(g)).to(dtype) * u                      (fp32 math, rounded like the reference)
    backward: dg = dy * u * sigmoid(g) * (1 + g * (1 - sigmoid(g))),   du = dy * silu(g)

gate and up are (..., I) row-major; one program per (row, BLOCK columns). I is a constexpr (aligned
rows vectorize); the block size and warps come from the kernel key (kernels/keys.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kdistill.errors import KernelError
from kdistill.kernels.keys import KernelKey, launch_options

INT32_MAX = 2**31 - 1


@triton.jit
def swiglu_fwd_kernel(G, U, Y, I: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    offs = row * I + cols
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    act = (g * tl.sigmoid(g)).to(G.dtype.element_ty).to(tl.float32)
    tl.store(Y + offs, (act * u).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def swiglu_bwd_kernel(DY, G, U, DG, DU, I: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    offs = row * I + cols
    dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    act = g * sig
    tl.store(DU + offs, (dy * act).to(DU.dtype.element_ty), mask=mask)
    tl.store(DG + offs, (dy * u * sig * (1.0 + g * (1.0 - sig))).to(DG.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.is_contiguous() else x2.contiguous()


def _grid(key: KernelKey, rows: int, inter: int) -> tuple[int, int]:
    if rows > INT32_MAX:
        raise KernelError(f"swiglu: {rows} rows exceed the grid")
    return (rows, triton.cdiv(inter, key["BLOCK"]))


def fwd_launch(key: KernelKey, gate: torch.Tensor, up: torch.Tensor):
    """(kernel, grid, args, kwargs, (y,)) for the forward of `key`."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise KernelError(
            f"swiglu: gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} {up.dtype} differ"
        )
    g2, u2 = _rows(gate), _rows(up)
    y = torch.empty_like(g2)
    kwargs = dict(I=g2.shape[1], BLOCK=key["BLOCK"], **launch_options(key))
    return swiglu_fwd_kernel, _grid(key, *g2.shape), (g2, u2, y), kwargs, (y,)


def bwd_launch(key: KernelKey, dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor):
    """(kernel, grid, args, kwargs, (dgate, dup)) for the backward of `key`."""
    dy2, g2, u2 = _rows(dy), _rows(gate), _rows(up)
    dg, du = torch.empty_like(g2), torch.empty_like(u2)
    kwargs = dict(I=g2.shape[1], BLOCK=key["BLOCK"], **launch_options(key))
    return swiglu_bwd_kernel, _grid(key, *g2.shape), (dy2, g2, u2, dg, du), kwargs, (dg, du)


def _run(spec) -> tuple:
    kernel, grid, args, kwargs, outs = spec
    kernel[grid](*args, **kwargs)
    return outs


class SwiGLUFunction(torch.autograd.Function):
    """y = silu(gate) * up. `bwd_key_fn(dy, gate, up)` computes and records the backward key;
    `on_bwd_failure(key, exc)` warns once (raises in strict mode) before the reference backward."""

    @staticmethod
    def forward(ctx, gate, up, fwd_key, bwd_key_fn, on_bwd_failure):
        (y,) = _run(fwd_launch(fwd_key, gate, up))
        ctx.save_for_backward(gate, up)
        ctx.bwd_key_fn, ctx.on_bwd_failure = bwd_key_fn, on_bwd_failure
        return y.view(gate.shape)

    @staticmethod
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        key = ctx.bwd_key_fn(dy, gate, up)
        try:
            dg, du = _run(bwd_launch(key, dy, gate, up))
        except Exception as e:  # a kernel problem never kills a run: reference backward
            ctx.on_bwd_failure(key, e)
            dg, du = reference_backward(dy, gate, up)
        return dg.view(gate.shape), du.view(up.shape), None, None, None


def reference_backward(dy, gate, up):
    from kdistill.ops.swiglu import swiglu_reference

    with torch.enable_grad():
        g, u = gate.detach().requires_grad_(True), up.detach().requires_grad_(True)
        return torch.autograd.grad(swiglu_reference(g, u), (g, u), dy)
