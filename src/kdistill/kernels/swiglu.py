"""Triton SwiGLU: y = silu(gate) * up, and its backward; kernels, launchers, autograd Function.

    forward:  y  = (g * sigmoid(g)).to(dtype) * u                      (fp32 math, rounded like the reference)
    backward: dg = dy * u * sigmoid(g) * (1 + g * (1 - sigmoid(g))),   du = dy * silu(g)

gate and up are (..., I) row-major; one program per (row, BLOCK columns). I is a constexpr (aligned
rows vectorize); the block size and warps come from the kernel key (`tiles` below).

The file reads top to bottom: kernels, launchers, autograd Function, key functions and tile policy,
then the registered KernelSpec.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kdistill.errors import KernelError
from kdistill.kernels._triton import cdiv, jit, tl
from kdistill.kernels.keys import KernelKey, dtype_name, launch_options, make_key, next_pow2
from kdistill.kernels.spec import Kernel, KernelSpec, tensor
from kdistill.ops.swiglu import swiglu_reference

INT32_MAX = 2**31 - 1


@jit
def swiglu_fwd_kernel(G, U, Y, I: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    offs = row * I + cols
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    act = (g * tl.sigmoid(g)).to(G.dtype.element_ty).to(tl.float32)
    tl.store(Y + offs, (act * u).to(Y.dtype.element_ty), mask=mask)


@jit
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
    return (rows, cdiv(inter, key["BLOCK"]))


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
    """d gate, d up through the PyTorch reference."""
    with torch.enable_grad():
        g, u = gate.detach().requires_grad_(True), up.detach().requires_grad_(True)
        return torch.autograd.grad(swiglu_reference(g, u), (g, u), dy)


# -- tile policy and key functions ----------------------------------------------------------------
def tiles(inter: int) -> dict[str, int]:
    """One program per (row, column block) of the intermediate activations."""
    block = min(1024, next_pow2(inter))
    return {"BLOCK": block, "num_warps": 4 if block <= 512 else 8, "num_stages": 1}


def fwd_key(arch: str, *, inter: int, dtype: str, aligned: Sequence[bool] | None = None) -> KernelKey:
    """silu(gate) * up over rows of `inter` elements. aligned: G, U."""
    return make_key(
        "swiglu_fwd", arch, I=int(inter), dtype=dtype_name(dtype), align=FWD.align(aligned), **tiles(inter)
    )


def bwd_key(arch: str, *, inter: int, dtype: str, aligned: Sequence[bool] | None = None) -> KernelKey:
    """d gate, d up. aligned: DY, G, U."""
    return make_key(
        "swiglu_bwd", arch, I=int(inter), dtype=dtype_name(dtype), align=BWD.align(aligned), **tiles(inter)
    )


# -- registered description -----------------------------------------------------------------------
def _warm(key: KernelKey, device: Any) -> tuple:
    """(2, I) inputs aligned as `key` says."""
    al = [c == "A" for c in str(key["align"])]
    n_in = 2 if key.op == "swiglu_fwd" else 3
    ts = [tensor((2, key["I"]), key["dtype"], device, a) for a in al[:n_in]]
    return fwd_launch(key, *ts) if key.op == "swiglu_fwd" else bwd_launch(key, *ts)


def plan(arch: str, *, grad: bool, inter: int, dtype: str) -> set[KernelKey]:
    """Keys of one swiglu call: forward, and when grad backward."""
    return {fwd_key(arch, inter=inter, dtype=dtype)} | (
        {bwd_key(arch, inter=inter, dtype=dtype)} if grad else set()
    )


FWD = Kernel(
    "swiglu_fwd", swiglu_fwd_kernel, fwd_key, _warm, {"G": "dtype", "U": "dtype", "Y": "dtype"}, ("Y",)
)
BWD = Kernel(
    "swiglu_bwd",
    swiglu_bwd_kernel,
    bwd_key,
    _warm,
    {"DY": "dtype", "G": "dtype", "U": "dtype", "DG": "dtype", "DU": "dtype"},
    ("DG", "DU"),
)
SPEC = KernelSpec(name="swiglu", kernels=(FWD, BWD), tiles=tiles, plan=plan)
