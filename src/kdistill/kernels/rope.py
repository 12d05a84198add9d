"""Triton RoPE on q and k (half-rotation layout) from cos/sin tables: kernels, launchers, autograd.

    forward:  o1 = x1 cos1 - x2 sin1,   o2 = x2 cos2 + x1 sin2        (x1, x2: the two halves of a head)
    backward: d1 = g1 cos1 + g2 sin2,   d2 = g2 cos2 - g1 sin1        (the transposed rotation)

One program per (batch, position) rotates every q head and every k head there. q (B, Hq, T, D) and
k (B, Hkv, T, D) may be strided views (the decoder's transposed projections); the last dim must be
contiguous. The outputs are written with their own strides, in the (B, T, H, D) layout (`out_like`). cos and sin are fp32 (T', D) tables with T' >= T; they are cast to q's dtype before use,
as the reference does. The tables are runtime inputs: one binary serves every rope theta and scaling.

The file reads top to bottom: kernels, launcher, autograd Function, key functions and tile policy,
then the registered KernelSpec.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kdistill.errors import KernelError
from kdistill.kernels._triton import jit, tl
from kdistill.kernels.keys import KernelKey, dtype_name, launch_options, make_key, memoized, next_pow2
from kdistill.kernels.spec import Kernel, KernelSpec, tensor
from kdistill.ops.rope import rope_reference

INT32_MAX = 2**31 - 1


@jit
def _rotate(
    X,
    O,
    base,
    sh,
    obase,
    osh,
    COS,
    SIN,
    t,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NH: tl.constexpr,
    BLOCK_H: tl.constexpr,
    INVERSE: tl.constexpr,
):
    half: tl.constexpr = D // 2
    d = tl.arange(0, BLOCK_D)
    dmask = d < half
    trow = t.to(tl.int64) * D
    c1 = tl.load(COS + trow + d, mask=dmask, other=0.0).to(X.dtype.element_ty).to(tl.float32)
    c2 = tl.load(COS + trow + half + d, mask=dmask, other=0.0).to(X.dtype.element_ty).to(tl.float32)
    s1 = tl.load(SIN + trow + d, mask=dmask, other=0.0).to(X.dtype.element_ty).to(tl.float32)
    s2 = tl.load(SIN + trow + half + d, mask=dmask, other=0.0).to(X.dtype.element_ty).to(tl.float32)
    h = tl.arange(0, BLOCK_H)
    mask = (h < NH)[:, None] & dmask[None, :]
    offs = base + h.to(tl.int64)[:, None] * sh + d[None, :]
    x1 = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(X + offs + half, mask=mask, other=0.0).to(tl.float32)
    ooffs = obase + h.to(tl.int64)[:, None] * osh + d[None, :]
    if INVERSE:
        o1 = x1 * c1[None, :] + x2 * s2[None, :]
        o2 = x2 * c2[None, :] - x1 * s1[None, :]
    else:
        o1 = x1 * c1[None, :] - x2 * s1[None, :]
        o2 = x2 * c2[None, :] + x1 * s2[None, :]
    tl.store(O + ooffs, o1.to(O.dtype.element_ty), mask=mask)
    tl.store(O + ooffs + half, o2.to(O.dtype.element_ty), mask=mask)


# The sequence length and every stride are runtime ints, not specialised on:
# one compiled variant serves any T and any layout of q, k, the output and the position tables.
RUNTIME_INTS = ["T", "sqb", "sqh", "sqt", "skb", "skh", "skt", "sob", "soh", "sot", "spb", "sph", "spt"]


@jit(do_not_specialize=RUNTIME_INTS)
def rope_fwd_kernel(
    Q,
    K,
    COS,
    SIN,
    QO,
    KO,
    T,
    sqb,
    sqh,
    sqt,
    skb,
    skh,
    skt,
    sob,
    soh,
    sot,
    spb,
    sph,
    spt,
    D: tl.constexpr,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HKV: tl.constexpr,
):
    pid = tl.program_id(0)
    b = (pid // T).to(tl.int64)
    t = pid % T
    t64 = t.to(tl.int64)
    _rotate(
        Q,
        QO,
        b * sqb + t64 * sqt,
        sqh,
        b * sob + t64 * sot,
        soh,
        COS,
        SIN,
        t,
        D,
        BLOCK_D,
        HQ,
        BLOCK_HQ,
        False,
    )
    _rotate(
        K,
        KO,
        b * skb + t64 * skt,
        skh,
        b * spb + t64 * spt,
        sph,
        COS,
        SIN,
        t,
        D,
        BLOCK_D,
        HKV,
        BLOCK_HKV,
        False,
    )


@jit(do_not_specialize=RUNTIME_INTS)
def rope_bwd_kernel(
    Q,
    K,
    COS,
    SIN,
    QO,
    KO,
    T,
    sqb,
    sqh,
    sqt,
    skb,
    skh,
    skt,
    sob,
    soh,
    sot,
    spb,
    sph,
    spt,
    D: tl.constexpr,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HKV: tl.constexpr,
):
    pid = tl.program_id(0)
    b = (pid // T).to(tl.int64)
    t = pid % T
    t64 = t.to(tl.int64)
    _rotate(
        Q, QO, b * sqb + t64 * sqt, sqh, b * sob + t64 * sot, soh, COS, SIN, t, D, BLOCK_D, HQ, BLOCK_HQ, True
    )
    _rotate(
        K,
        KO,
        b * skb + t64 * skt,
        skh,
        b * spb + t64 * spt,
        sph,
        COS,
        SIN,
        t,
        D,
        BLOCK_D,
        HKV,
        BLOCK_HKV,
        True,
    )


def out_like(x: torch.Tensor) -> torch.Tensor:
    """The rotated output for x (B, H, T, D): a (B, T, H, D) buffer seen as (B, H, T, D).

    That is the layout the projections produce and SDPA's fused backends keep: attention then
    allocates its output (and, in backward, the q/k/v gradients) in it too, so the transposes around
    attention are views, not copies."""
    b, h, t, d = x.shape
    return torch.empty((b, t, h, d), dtype=x.dtype, device=x.device).transpose(1, 2)


def _prep(x: torch.Tensor) -> torch.Tensor:
    if x.stride(-1) != 1:
        x = x.contiguous()
    return x


def _table(c: torch.Tensor, t: int, d: int) -> torch.Tensor:
    c = c.reshape(-1, c.shape[-1])
    if c.dtype != torch.float32 or not c.is_contiguous():
        c = c.float().contiguous()
    if c.shape[0] < t or c.shape[1] != d:
        raise KernelError(f"rope: cos/sin table {tuple(c.shape)} does not cover (T={t}, D={d})")
    return c


def launch(
    key: KernelKey,
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    inverse: bool,
):
    """(kernel, grid, args, kwargs, (q_out, k_out)). q (B, Hq, T, D), k (B, Hkv, T, D), any dense strides."""
    q, k = _prep(q), _prep(k)
    b, hq, t, d = q.shape
    hkv = k.shape[1]
    cos, sin = _table(cos, t, d), _table(sin, t, d)
    qo, ko = out_like(q), out_like(k)
    ints = (t, *q.stride()[:3], *k.stride()[:3], *qo.stride()[:3], *ko.stride()[:3])
    if max(ints) > INT32_MAX or b * t > INT32_MAX:
        raise KernelError("rope: strides exceed int32")
    kwargs = dict(
        D=d,
        HQ=hq,
        HKV=hkv,
        BLOCK_D=key["BLOCK_D"],
        BLOCK_HQ=key["BLOCK_HQ"],
        BLOCK_HKV=key["BLOCK_HKV"],
        **launch_options(key),
    )
    kernel = rope_bwd_kernel if inverse else rope_fwd_kernel
    return kernel, (b * t,), (q, k, cos, sin, qo, ko, *ints), kwargs, (qo, ko)


def _run(spec) -> tuple:
    kernel, grid, args, kwargs, outs = spec
    kernel[grid](*args, **kwargs)
    return outs


def forward_only(key: KernelKey, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """The forward when no gradient is wanted (a frozen teacher), without the autograd Function."""
    return _run(launch(key, q, k, cos, sin, inverse=False))


class RopeFunction(torch.autograd.Function):
    """(q', k') = rope(q, k, cos, sin). `bwd_key_fn(dq, dk, cos, sin)` computes and records the backward
    key; `on_bwd_failure(key, exc)` warns once (raises in strict mode) before the reference backward."""

    @staticmethod
    def forward(ctx, q, k, cos, sin, fwd_key, bwd_key_fn, on_bwd_failure):
        qo, ko = _run(launch(fwd_key, q, k, cos, sin, inverse=False))
        ctx.save_for_backward(cos, sin)
        ctx.bwd_key_fn, ctx.on_bwd_failure = bwd_key_fn, on_bwd_failure
        ctx.set_materialize_grads(True)
        return qo, ko

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin = ctx.saved_tensors
        key = ctx.bwd_key_fn(dq, dk, cos, sin)
        try:
            gq, gk = _run(launch(key, dq, dk, cos, sin, inverse=True))
        except Exception as e:  # a kernel problem never kills a run: reference backward
            ctx.on_bwd_failure(key, e)
            gq, gk = reference_backward(dq, dk, cos, sin)
        return gq, gk, None, None, None, None, None


def reference_backward(dq, dk, cos, sin):
    """The transposed rotation with PyTorch ops (the reference is linear in q and k)."""
    with torch.enable_grad():
        q = torch.zeros_like(dq, requires_grad=True)
        k = torch.zeros_like(dk, requires_grad=True)
        qo, ko = rope_reference(q, k, cos, sin)
        return torch.autograd.grad((qo, ko), (q, k), (dq, dk))


# -- tile policy and key functions ----------------------------------------------------------------
def tiles(head_dim: int, q_heads: int, kv_heads: int) -> dict[str, int]:
    """One program per (batch, position): all q and k heads, the two halves of each head."""
    block_d = next_pow2(head_dim // 2)
    block_hq, block_hkv = next_pow2(q_heads), next_pow2(kv_heads)
    warps = 4 if block_hq * block_d <= 2048 else 8
    return {
        "BLOCK_D": block_d,
        "BLOCK_HQ": block_hq,
        "BLOCK_HKV": block_hkv,
        "num_warps": warps,
        "num_stages": 1,
    }


def _key(
    kernel: Kernel,
    arch: str,
    head_dim: int,
    q_heads: int,
    kv_heads: int,
    dtype: str,
    aligned: Sequence[bool] | None,
) -> KernelKey:
    return make_key(
        kernel.op,
        arch,
        D=int(head_dim),
        HQ=int(q_heads),
        HKV=int(kv_heads),
        dtype=dtype_name(dtype),
        align=kernel.align(aligned),
        **tiles(head_dim, q_heads, kv_heads),
    )


@memoized
def fwd_key(
    arch: str,
    *,
    head_dim: int,
    q_heads: int,
    kv_heads: int,
    dtype: str,
    aligned: Sequence[bool] | None = None,
) -> KernelKey:
    """Rotation of q and k with cos/sin tables. aligned: Q, K, COS, SIN."""
    return _key(FWD, arch, head_dim, q_heads, kv_heads, dtype, aligned)


@memoized
def bwd_key(
    arch: str,
    *,
    head_dim: int,
    q_heads: int,
    kv_heads: int,
    dtype: str,
    aligned: Sequence[bool] | None = None,
) -> KernelKey:
    """The inverse rotation of dq and dk. aligned: DQ, DK, COS, SIN."""
    return _key(BWD, arch, head_dim, q_heads, kv_heads, dtype, aligned)


# -- registered description -----------------------------------------------------------------------
def _warm(key: KernelKey, device: Any) -> tuple:
    """q (1, HQ, 2, D), k (1, HKV, 2, D) and (2, D) tables, aligned as `key` says."""
    al, d = [c == "A" for c in str(key["align"])], key["D"]
    q = tensor((1, key["HQ"], 2, d), key["dtype"], device, al[0])
    k = tensor((1, key["HKV"], 2, d), key["dtype"], device, al[1])
    cos, sin = tensor((2, d), "fp32", device, al[2]), tensor((2, d), "fp32", device, al[3])
    return launch(key, q, k, cos, sin, inverse=key.op == "rope_bwd")


def plan(arch: str, *, grad: bool, head_dim: int, q_heads: int, kv_heads: int, dtype: str) -> set[KernelKey]:
    """Keys of one apply_rope call: the rotation, and when grad its inverse."""
    kw = dict(head_dim=head_dim, q_heads=q_heads, kv_heads=kv_heads, dtype=dtype)
    return {fwd_key(arch, **kw)} | ({bwd_key(arch, **kw)} if grad else set())


_POINTERS = {"Q": "dtype", "K": "dtype", "COS": "fp32", "SIN": "fp32", "QO": "dtype", "KO": "dtype"}
FWD = Kernel("rope_fwd", rope_fwd_kernel, fwd_key, _warm, _POINTERS, outputs=("QO", "KO"))
BWD = Kernel("rope_bwd", rope_bwd_kernel, bwd_key, _warm, _POINTERS, outputs=("QO", "KO"))
SPEC = KernelSpec(name="rope", kernels=(FWD, BWD), tiles=tiles, plan=plan)
