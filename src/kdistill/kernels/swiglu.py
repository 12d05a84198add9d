"""Triton SwiGLU: y = silu(gate) * up, and its backward; kernels, launchers, autograd Function.

    forward:  y  = (g * sigmoid(g)).to(dtype) * u                      (fp32 math, rounded like the reference)
    backward: dg = dy * u * sigmoid(g) * (1 + g * (1 - sigmoid(g))),   du = dy * silu(g)

gate and up are (..., I) rows with a row stride SX (a constexpr, so that aligned rows vectorize): I
when they are separate tensors, 2I when they are the two halves of one (..., 2I) tensor, the output
of the MLP's fused gate/up GEMM (`halves`). The backward writes d gate and d up with the same row
stride, so for the fused GEMM they land in one (..., 2I) gradient and no concatenation follows. One
program per (row, BLOCK columns); the block size and warps come from the kernel key (`tiles` below).

The file reads top to bottom: kernels, launchers, autograd Function, key functions and tile policy,
then the registered KernelSpec.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kdistill.dtypes import torch_dtype
from kdistill.errors import KernelError
from kdistill.kernels._triton import cdiv, jit, tl
from kdistill.kernels.keys import KernelKey, dtype_name, launch_options, make_key, memoized, next_pow2
from kdistill.kernels.spec import Kernel, KernelSpec, tensor
from kdistill.ops.swiglu import swiglu_reference

INT32_MAX = 2**31 - 1


@jit
def swiglu_fwd_kernel(G, U, Y, I: tl.constexpr, SX: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    offs = row * SX + cols
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    act = (g * tl.sigmoid(g)).to(G.dtype.element_ty).to(tl.float32)
    tl.store(Y + row * I + cols, (act * u).to(Y.dtype.element_ty), mask=mask)


@jit
def swiglu_bwd_kernel(DY, G, U, DG, DU, I: tl.constexpr, SX: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    offs = row * SX + cols
    dy = tl.load(DY + row * I + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    act = g * sig
    tl.store(DU + offs, (dy * act).to(DU.dtype.element_ty), mask=mask)
    tl.store(DG + offs, (dy * u * sig * (1.0 + g * (1.0 - sig))).to(DG.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.is_contiguous() else x2.contiguous()


def halves(gu: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate, up): the two (..., I) halves of the fused gate/up GEMM's output gu (..., 2I), as views."""
    i = gu.shape[-1] // 2
    return gu[..., :i], gu[..., i:]


def pair(gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(gate, up) as (rows, I) views with one row stride SX, and SX: the halves of one row-major
    (rows, 2I) tensor keep SX = 2I where up (and d up, written the same way) starts 16-byte aligned
    (I * itemsize a multiple of 16: every real model); anything else is made row-major (SX = I)."""
    i = gate.shape[-1]
    g2, u2 = gate.reshape(-1, i), up.reshape(-1, i)
    adjacent = (
        g2.shape == u2.shape
        and (i * g2.element_size()) % 16 == 0
        and g2.stride(-1) == 1
        and u2.stride(-1) == 1
        and u2.data_ptr() == g2.data_ptr() + i * g2.element_size()
    )
    if adjacent and (g2.shape[0] == 1 or g2.stride(0) == u2.stride(0) == 2 * i):
        return g2, u2, 2 * i
    if u2.data_ptr() == g2.data_ptr() + i * g2.element_size():  # unaligned halves: fresh copies
        fresh = torch.contiguous_format
        return g2.clone(memory_format=fresh), u2.clone(memory_format=fresh), i
    return _rows(gate), _rows(up), i


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
    g2, u2, sx = pair(gate, up)
    rows, i = g2.shape
    y = torch.empty((rows, i), dtype=gate.dtype, device=gate.device)
    kwargs = dict(I=i, SX=sx, BLOCK=key["BLOCK"], **launch_options(key))
    return swiglu_fwd_kernel, _grid(key, rows, i), (g2, u2, y), kwargs, (y,)


def bwd_launch(key: KernelKey, dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor):
    """(kernel, grid, args, kwargs, (dgate, dup)) for the backward of `key`: (rows, I) each, written
    with the inputs' row stride (for the halves of one (rows, 2I) input: the halves of one (rows, 2I)
    gradient, `dgate.data_ptr()` its start)."""
    g2, u2, sx = pair(gate, up)
    rows, i = g2.shape
    dy2 = _rows(dy)
    if sx == 2 * i:
        dg, du = halves(torch.empty((rows, 2 * i), dtype=gate.dtype, device=gate.device))
    else:
        dg = torch.empty((rows, i), dtype=gate.dtype, device=gate.device)
        du = torch.empty((rows, i), dtype=gate.dtype, device=gate.device)
    kwargs = dict(I=i, SX=sx, BLOCK=key["BLOCK"], **launch_options(key))
    return swiglu_bwd_kernel, _grid(key, rows, i), (dy2, g2, u2, dg, du), kwargs, (dg, du)


def run(spec) -> tuple:
    kernel, grid, args, kwargs, outs = spec
    kernel[grid](*args, **kwargs)
    return outs


def forward_only(key: KernelKey, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The forward when no gradient is wanted (a frozen teacher), without the autograd Function."""
    (y,) = run(fwd_launch(key, gate, up))
    return y.view(gate.shape)


class SwiGLUFunction(torch.autograd.Function):
    """y = silu(gate) * up. `bwd_key_fn(dy, gate, up)` computes and records the backward key;
    `on_bwd_failure(key, exc)` warns once (raises in strict mode) before the reference backward."""

    @staticmethod
    def forward(ctx, gate, up, fwd_key, bwd_key_fn, on_bwd_failure):
        (y,) = run(fwd_launch(fwd_key, gate, up))
        ctx.save_for_backward(gate, up)
        ctx.bwd_key_fn, ctx.on_bwd_failure = bwd_key_fn, on_bwd_failure
        return y.view(gate.shape)

    @staticmethod
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        key = ctx.bwd_key_fn(dy, gate, up)
        try:
            dg, du = run(bwd_launch(key, dy, gate, up))
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


def _key(
    kernel: Kernel, arch: str, inter: int, dtype: str, fused: bool, aligned: Sequence[bool] | None
) -> KernelKey:
    return make_key(
        kernel.op,
        arch,
        I=int(inter),
        SX=int(inter) * (2 if fused else 1),
        dtype=dtype_name(dtype),
        align=kernel.align(aligned),
        **tiles(inter),
    )


@memoized
def fwd_key(
    arch: str, *, inter: int, dtype: str, fused: bool = False, aligned: Sequence[bool] | None = None
) -> KernelKey:
    """silu(gate) * up over rows of `inter` elements; fused: gate and up are the halves of one
    (rows, 2 inter) tensor (row stride 2 inter). aligned: G, U."""
    return _key(FWD, arch, inter, dtype, fused, aligned)


@memoized
def bwd_key(
    arch: str, *, inter: int, dtype: str, fused: bool = False, aligned: Sequence[bool] | None = None
) -> KernelKey:
    """d gate, d up (fused: as fwd_key). aligned: DY, G, U."""
    return _key(BWD, arch, inter, dtype, fused, aligned)


# -- registered description -----------------------------------------------------------------------
def _warm(key: KernelKey, device: Any) -> tuple:
    """(2, I) inputs aligned as `key` says; gate and up as the halves of one (2, 2I) tensor when the
    key's row stride SX is 2I (up's alignment then follows from gate's)."""
    al = [c == "A" for c in str(key["align"])]
    i, dt = key["I"], key["dtype"]
    ins = al if key.op == "swiglu_fwd" else al[1:]  # G, U
    if key["SX"] == 2 * i:
        gate, up = halves(tensor((2, 2 * i), dt, device, ins[0]))
    else:
        gate, up = (tensor((2, i), dt, device, a) for a in ins[:2])
    if key.op == "swiglu_fwd":
        return fwd_launch(key, gate, up)
    return bwd_launch(key, tensor((2, i), dt, device, al[0]), gate, up)


def plan(arch: str, *, grad: bool, inter: int, dtype: str) -> set[KernelKey]:
    """Keys of one swiglu call, forward and (when grad) backward, for gate and up as separate tensors
    and as the halves of the fused gate/up GEMM's output (the MLP fuses them unless adapters wrap
    its projections)."""
    out = set()
    halves_kept = (inter * torch_dtype(dtype).itemsize) % 16 == 0  # see pair()
    for fused in (False, True) if halves_kept else (False,):
        out.add(fwd_key(arch, inter=inter, dtype=dtype, fused=fused))
        if grad:
            out.add(bwd_key(arch, inter=inter, dtype=dtype, fused=fused))
    return out


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
