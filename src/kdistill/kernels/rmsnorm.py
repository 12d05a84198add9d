"""Triton RMSNorm fused with the residual add: kernels, launchers and the autograd Function.

    s = x + residual            (HAS_RESIDUAL; stored, rounded to x's dtype like the reference)
    y = (s * rstd).to(dtype) * w,   rstd = 1 / sqrt(mean(s^2) + eps)   (fp32 statistics)

Forward: each program normalizes a (BLOCK_M x BLOCK_H) tile of rows and saves rstd (fp32 per row).
Backward: programs stride over row blocks, write dx (+ the gradient that reached s) and accumulate a
per-program fp32 partial of dw; the partials are summed by torch. In a small bucket's decode step
(runtime.chained) on sm_90 and newer the forward launches with programmatic dependent launch (keys.pdl):
it loads w, then waits for the previous kernel. There, after a product split over K (o_proj, down;
kernels/decode_gemv.py), x may arrive as the product's PARTS fp32 partials: summed in split order and
rounded to the product's dtype, the values its own combine would have written. Qwen3's per-head q/k norm
is the same kernel with H = head_dim. Tile sizes and warps come from the kernel key (`tiles` below).

The file reads top to bottom: kernels, launchers, autograd Function, key functions and tile policy,
then the registered KernelSpec (tiny warm launches and the keys of one call site).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kdistill.dtypes import torch_dtype
from kdistill.errors import KernelError
from kdistill.kernels._triton import cdiv, jit, pdl_release, pdl_wait, tl
from kdistill.kernels.keys import (
    KernelKey,
    dtype_name,
    f64_bits,
    f64_value,
    launch_options,
    make_key,
    memoized,
    next_pow2,
    pdl,
    pdl_constexpr,
    promote,
)
from kdistill.kernels.spec import Kernel, KernelSpec, tensor
from kdistill.ops.rmsnorm import rmsnorm_reference

MAX_BWD_PROGRAMS = 1024  # partial dw rows; not a specialization (a runtime grid size)
INT32_MAX = 2**31 - 1


@jit(do_not_specialize=["n_rows"], do_not_specialize_on_alignment=["IDS"])
def rmsnorm_fwd_kernel(
    X,
    IDS,
    R,
    W,
    Y,
    S,
    RSTD,
    n_rows,
    H: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_M: tl.constexpr,
    EPS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    PDL: tl.constexpr,
    PARTS: tl.constexpr,
    GATHER: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_H)
    rmask = rows < n_rows
    cmask = cols < H
    mask = rmask[:, None] & cmask[None, :]
    offs = rows.to(tl.int64)[:, None] * H + cols[None, :]
    pdl_release(PDL)
    w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)  # a weight: before the wait
    pdl_wait(PDL)
    if GATHER:  # x's rows are the table X's rows IDS[row] (an embedding), written to S as they are
        src = tl.load(IDS + rows, mask=rmask, other=0).to(tl.int64)
        xs = tl.load(X + src[:, None] * H + cols[None, :], mask=mask, other=0.0)
        tl.store(S + offs, xs, mask=mask)
        xf = xs.to(tl.float32)
    elif PARTS == 0:
        xf = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    else:  # x is a split product's PARTS fp32 partials: summed in split order, rounded as its output
        xf = tl.zeros((BLOCK_M, BLOCK_H), tl.float32)
        for p in tl.static_range(PARTS):
            xf += tl.load(X + p * n_rows * H + offs, mask=mask, other=0.0, cache_modifier=".cg")
        xf = xf.to(S.dtype.element_ty).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(R + offs, mask=mask, other=0.0).to(tl.float32)
        s = (xf + r).to(S.dtype.element_ty)  # rounded to the sum's dtype, as the reference's x + residual
        tl.store(S + offs, s, mask=mask)
        xf = s.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=1) / H + EPS)  # (BLOCK_M,)
    tl.store(RSTD + rows, rstd, mask=rmask)
    if HAS_RESIDUAL:
        n = (xf * rstd[:, None]).to(S.dtype.element_ty).to(tl.float32)
    else:
        n = (xf * rstd[:, None]).to(X.dtype.element_ty).to(tl.float32)
    tl.store(Y + offs, (n * w[None, :]).to(Y.dtype.element_ty), mask=mask)


@jit(do_not_specialize=["n_rows"])
def rmsnorm_bwd_kernel(
    DY,
    X,
    W,
    RSTD,
    DS,
    DX,
    DW,
    n_rows,
    H: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HAS_DRES: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_H)
    cmask = cols < H
    w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for start in range(pid * BLOCK_M, n_rows, nprog * BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        rmask = rows < n_rows
        mask = rmask[:, None] & cmask[None, :]
        offs = rows.to(tl.int64)[:, None] * H + cols[None, :]
        x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=rmask, other=0.0)
        n = x * rstd[:, None]
        dn = dy * w[None, :]
        c = tl.sum(dn * n, axis=1) / H
        dx = rstd[:, None] * (dn - n * c[:, None])
        if HAS_DRES:
            dx += tl.load(DS + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=mask)
        dw += tl.sum(dy * n.to(X.dtype.element_ty).to(tl.float32), axis=0)
    tl.store(DW + pid.to(tl.int64) * H + cols, dw, mask=cmask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    if x.dim() == 2 and x.is_contiguous():
        x2 = x
    else:
        x2 = x.reshape(-1, x.shape[-1])
        if not x2.is_contiguous():
            x2 = x2.contiguous()
    if x2.numel() > INT32_MAX:
        raise KernelError(f"rmsnorm: {x2.numel()} elements exceed int32 indexing of rows")
    return x2


def fwd_launch(
    key: KernelKey,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    ids: torch.Tensor | None = None,
):
    """(kernel, grid, args, kwargs, outputs) for the forward of `key`; problem constants come from the
    call (x, eps, residual), tiles and warps from the key. With the key's PARTS, x is a split
    product's fp32 partials (PARTS, rows, H), contiguous: their sum, rounded to the residual's dtype, is
    what is added to the residual. With the key's GATHER, x is a table (V, H) and ids (rows,) int64 the
    table rows to norm (an embedding lookup): the second output holds those rows as they are."""
    parts = int(key["PARTS"])
    gather = bool(key["GATHER"])
    if gather:
        if ids is None or residual is not None or x.dim() != 2 or not x.is_contiguous():
            raise KernelError(f"rmsnorm: a gather takes a contiguous table and ids (table {tuple(x.shape)})")
        if ids.dtype != torch.int64 or ids.dim() != 1 or not ids.is_contiguous():
            raise KernelError(
                f"rmsnorm: a gather's ids must be contiguous int64 (rows,), got {tuple(ids.shape)}"
            )
        x2, r2 = x, x
        s_dtype = x.dtype
        n_rows, h = ids.shape[0], x.shape[1]
    elif parts:
        if residual is None or x.dim() != 3 or x.shape[0] != parts or not x.is_contiguous():
            raise KernelError(f"rmsnorm: partials {tuple(x.shape)} do not fit the key ({parts} parts)")
        x2 = x
        r2 = _rows(residual)
        if r2.shape != x.shape[1:]:
            raise KernelError(f"rmsnorm: partials {tuple(x.shape)} against a residual {tuple(r2.shape)}")
        s_dtype = residual.dtype
        n_rows, h = r2.shape
    else:
        x2 = _rows(x)
        r2 = _rows(residual) if residual is not None else x2
        s_dtype = torch.promote_types(x.dtype, residual.dtype) if residual is not None else x.dtype
        n_rows, h = x2.shape
    y = torch.empty((n_rows, h), dtype=torch_dtype(key["y_dtype"]), device=x.device)
    kept = residual is not None or gather  # S is an output of its own; else it aliases Y
    s = torch.empty((n_rows, h), dtype=s_dtype, device=x.device) if kept else y
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    grid = (cdiv(n_rows, key["BLOCK_M"]),)
    args = (x2, ids if gather else x2, r2, weight, y, s, rstd, n_rows)  # IDS: unread unless gathering
    kwargs = dict(
        H=h,
        BLOCK_H=key["BLOCK_H"],
        BLOCK_M=key["BLOCK_M"],
        EPS=float(eps),
        HAS_RESIDUAL=residual is not None,
        PDL=pdl_constexpr(key),
        PARTS=parts,
        GATHER=gather,
        **launch_options(key),
    )
    return rmsnorm_fwd_kernel, grid, args, kwargs, (y, s, rstd)


def bwd_launch(
    key: KernelKey,
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    ds: torch.Tensor | None,
):
    """(kernel, grid, args, kwargs, (dx, dw_partial)) for the backward of `key`. x is the normalized
    input (x + residual when fused)."""
    dy2, x2 = _rows(dy), _rows(x)
    ds2 = _rows(ds) if ds is not None else dy2
    n_rows, h = x2.shape
    nprog = max(1, min(cdiv(n_rows, key["BLOCK_M"]), MAX_BWD_PROGRAMS))
    dx = torch.empty_like(x2)
    dw = torch.empty((nprog, h), dtype=torch.float32, device=x.device)
    args = (dy2, x2, weight, rstd, ds2, dx, dw, n_rows)
    kwargs = dict(
        H=h, BLOCK_H=key["BLOCK_H"], BLOCK_M=key["BLOCK_M"], HAS_DRES=ds is not None, **launch_options(key)
    )
    return rmsnorm_bwd_kernel, (nprog,), args, kwargs, (dx, dw)


def _run(launch) -> tuple:
    kernel, grid, args, kwargs, outs = launch
    kernel[grid](*args, **kwargs)
    return outs


def forward_only(
    key: KernelKey, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
):
    """The forward when no gradient is wanted (a frozen teacher): y, or (y, x + residual), with none of
    the autograd Function's work on the host."""
    y, s, _ = _run(fwd_launch(key, x, residual, weight, eps))
    y = y.view(*x.shape[:-1], y.shape[-1])
    return y if residual is None else (y, s.view(x.shape))


def gather_forward(key: KernelKey, table: torch.Tensor, ids: torch.Tensor, weight: torch.Tensor, eps: float):
    """(rmsnorm(table[ids]) * weight, table[ids]) for ids (rows,) by a GATHER key: an embedding lookup
    and the first norm in one launch (no gradient)."""
    y, s, _ = _run(fwd_launch(key, table, None, weight, eps, ids))
    return y, s


class RMSNormFunction(torch.autograd.Function):
    """(y, s) = add_rmsnorm(x, residual, w, eps), or y alone when residual is None. The forward key is
    given; `bwd_key_fn(dy, normed, weight, rstd, ds)` (the dispatcher) computes and records the backward
    key; `on_bwd_failure(key, exc)` warns once (raises in strict mode) before the reference backward."""

    @staticmethod
    def forward(ctx, x, residual, weight, eps, fwd_key, bwd_key_fn, on_bwd_failure):
        y, s, rstd = _run(fwd_launch(fwd_key, x, residual, weight, eps))
        ctx.set_materialize_grads(False)
        ctx.has_residual = residual is not None
        ctx.y_dtype = y.dtype
        ctx.shape, ctx.eps = x.shape, eps
        ctx.bwd_key_fn, ctx.on_bwd_failure = bwd_key_fn, on_bwd_failure
        normed = s if residual is not None else _rows(x)
        ctx.save_for_backward(normed, weight, rstd)
        y = y.view(*x.shape[:-1], y.shape[-1])
        if residual is None:
            return y
        return y, s.view(x.shape)

    @staticmethod
    def backward(ctx, *grads):
        dy, ds = grads[0], (grads[1] if ctx.has_residual else None)
        normed, weight, rstd = ctx.saved_tensors
        if dy is None and ds is None:
            return None, None, None, None, None, None, None
        if dy is None:
            dy = torch.zeros(normed.shape, dtype=ctx.y_dtype, device=normed.device)
        dy = _rows(dy)  # rows once, for the key and the launch
        ds = _rows(ds) if ds is not None else None
        key = ctx.bwd_key_fn(dy, normed, weight, rstd, ds)
        try:
            dx, dw = _run(bwd_launch(key, dy, normed, weight, rstd, ds))
            dw = dw.sum(0).to(weight.dtype)
        except Exception as e:  # a kernel problem never kills a run: reference backward
            ctx.on_bwd_failure(key, e)
            dx, dw = reference_backward(dy, normed, weight, ctx.eps, ds)
        dx = dx.view(ctx.shape)
        return dx, (dx if ctx.has_residual else None), dw, None, None, None, None


def reference_backward(dy, normed, weight, eps, ds):
    """Backward through the PyTorch reference (recomputes the forward from the saved input)."""
    with torch.enable_grad():
        xs = normed.detach().reshape(-1, normed.shape[-1]).requires_grad_(True)
        ws = weight.detach().requires_grad_(True)
        y = rmsnorm_reference(xs, ws, eps)
        dx, dw = torch.autograd.grad(y, (xs, ws), dy.reshape(y.shape))
    if ds is not None:
        dx = dx + ds.reshape(dx.shape)
    return dx, dw


# -- tile policy and key functions ----------------------------------------------------------------
def tiles(hidden: int) -> dict[str, int]:
    """Rows of `hidden` elements: a (BLOCK_M x BLOCK_H) tile per program, ~4K elements at least."""
    block_h = next_pow2(hidden)
    block_m = max(1, min(64, 4096 // block_h))
    warps = 4 if block_h * block_m <= 4096 else (8 if block_h <= 8192 else 16)
    return {"BLOCK_H": block_h, "BLOCK_M": block_m, "num_warps": warps, "num_stages": 1}


@memoized
def fwd_key(
    arch: str,
    *,
    hidden: int,
    eps: float,
    dtype: str,
    w_dtype: str,
    residual: bool,
    r_dtype: str | None = None,
    y_dtype: str | None = None,
    chained: bool = False,
    parts: int = 0,
    gather: bool = False,
    aligned: Sequence[bool] | None = None,
) -> KernelKey:
    """y = rmsnorm(x [+ residual]) * w. dtype: x's; r_dtype: the residual's (default x's; the sum s has
    their promotion); y_dtype: y's (default promote(s, w); a norm whose output feeds GEMMs only writes
    it in the autocast dtype). chained: inside a small bucket's decode step (runtime.chained), launched
    with programmatic dependent launch where the arch has it. parts: x is the fp32 partials of a split
    product whose output would be in `dtype` (a decode step's o_proj or down, kernels/decode_gemv.py),
    summed here; the residual then has that dtype. gather: x's rows are rows of a table in `dtype`
    picked by int64 ids (a decode step's embedding lookup, fwd_launch), kept as the second output.
    aligned: X, R, W (R is X when there is no residual)."""
    dtype, w_dtype = dtype_name(dtype), dtype_name(w_dtype)
    r_dtype = dtype_name(r_dtype) if (residual and r_dtype is not None) else dtype
    if parts and (not residual or r_dtype != dtype):
        raise KernelError("rmsnorm: partials are summed only beside a residual of the product's dtype")
    if gather and (residual or parts):
        raise KernelError("rmsnorm: a gathered norm has no residual and no partials")
    s_dtype = promote(dtype, r_dtype)
    y_dtype = dtype_name(y_dtype) if y_dtype is not None else promote(s_dtype, w_dtype)
    return make_key(
        "rmsnorm_fwd",
        arch,
        H=int(hidden),
        EPS=f64_bits(eps),
        HAS_RESIDUAL=bool(residual),
        dtype=dtype,
        r_dtype=r_dtype,
        w_dtype=w_dtype,
        y_dtype=y_dtype,
        # without residual S aliases Y (unused), except a gather's: the table's rows
        s_dtype=s_dtype if residual else (dtype if gather else y_dtype),
        align=FWD.align(aligned),
        PDL=bool(chained) and pdl(arch),
        PARTS=int(parts),
        GATHER=bool(gather),
        **({"x_dtype": "fp32"} if parts else {}),  # X holds the product's fp32 partials
        **({"ids_dtype": "i64"} if gather else {}),  # IDS: the table rows (else unread, typed as X)
        **tiles(hidden),
    )


@memoized
def bwd_key(
    arch: str,
    *,
    hidden: int,
    dtype: str,
    w_dtype: str,
    has_dres: bool,
    y_dtype: str | None = None,
    aligned: Sequence[bool] | None = None,
) -> KernelKey:
    """dx, dw of rmsnorm (eps is not needed: rstd is saved). dtype: the normalized input's (x + residual
    when fused); y_dtype: the output's, which its gradient dy has (default promote(dtype, w)).
    has_dres: a gradient reaches x + residual. aligned: DY, X, W, RSTD, DS (DS is DY when has_dres is
    false)."""
    dtype, w_dtype = dtype_name(dtype), dtype_name(w_dtype)
    y_dtype = dtype_name(y_dtype) if y_dtype is not None else promote(dtype, w_dtype)
    return make_key(
        "rmsnorm_bwd",
        arch,
        H=int(hidden),
        HAS_DRES=bool(has_dres),
        dtype=dtype,
        w_dtype=w_dtype,
        y_dtype=y_dtype,
        ds_dtype=dtype if has_dres else y_dtype,
        align=BWD.align(aligned),
        **tiles(hidden),
    )


# -- registered description -----------------------------------------------------------------------
def _align_flags(key: KernelKey) -> list[bool]:
    return [c == "A" for c in str(key["align"])]


def warm_fwd(key: KernelKey, device: Any) -> tuple:
    """A 2-row launch that specializes as `key` (dtypes, alignment, H, EPS, residual, partials)."""
    al, h = _align_flags(key), key["H"]
    parts = int(key["PARTS"])
    if key["GATHER"]:
        table, w = tensor((4, h), key["dtype"], device, al[0]), tensor((h,), key["w_dtype"], device, al[2])
        ids = torch.zeros(2, dtype=torch.int64, device=device)
        return fwd_launch(key, table, None, w, f64_value(key["EPS"]), ids)
    x = tensor((parts, 2, h), "fp32", device, al[0]) if parts else tensor((2, h), key["dtype"], device, al[0])
    r = tensor((2, h), key["r_dtype"], device, al[1]) if key["HAS_RESIDUAL"] else None
    w = tensor((h,), key["w_dtype"], device, al[2])
    return fwd_launch(key, x, r, w, f64_value(key["EPS"]))


def warm_bwd(key: KernelKey, device: Any) -> tuple:
    al, h = _align_flags(key), key["H"]
    dy = tensor((2, h), key["y_dtype"], device, al[0])
    x = tensor((2, h), key["dtype"], device, al[1])
    w = tensor((h,), key["w_dtype"], device, al[2])
    rstd = tensor((2,), "fp32", device, al[3])
    ds = tensor((2, h), key["ds_dtype"], device, al[4]) if key["HAS_DRES"] else None
    return bwd_launch(key, dy, x, w, rstd, ds)


def plan(
    arch: str,
    *,
    grad: bool,
    hidden: int,
    eps: float,
    dtype: str,
    w_dtype: str,
    r_dtype: str | None = None,
    y_dtype: str | None = None,
    chained: bool = False,
    parts: int = 0,
    gather: bool = False,
) -> set[KernelKey]:
    """Keys of one call rmsnorm(x) (r_dtype None) or add_rmsnorm(x, residual): the forward, and when
    grad the backward with and (if fused) without a gradient reaching the returned sum. y_dtype: the
    output's dtype when it is not the promotion (see fwd_key); chained: a small bucket's decode step;
    parts: x as a split product's partials; gather: x as a table's rows picked by ids (fwd_key)."""
    residual = r_dtype is not None
    keys = {
        fwd_key(
            arch,
            hidden=hidden,
            eps=eps,
            dtype=dtype,
            w_dtype=w_dtype,
            residual=residual,
            r_dtype=r_dtype,
            y_dtype=y_dtype,
            chained=chained,
            parts=parts,
            gather=gather,
        )
    }
    if grad and not gather:
        s_dtype = promote(dtype, r_dtype) if residual else dtype_name(dtype)
        for has_dres in (False, True) if residual else (False,):
            keys.add(
                bwd_key(
                    arch, hidden=hidden, dtype=s_dtype, w_dtype=w_dtype, has_dres=has_dres, y_dtype=y_dtype
                )
            )
    return keys


FWD = Kernel(
    op="rmsnorm_fwd",
    fn=rmsnorm_fwd_kernel,
    key=fwd_key,
    launch=warm_fwd,
    pointers={
        "X": ("x_dtype", "dtype"),
        "IDS": ("ids_dtype", "x_dtype", "dtype"),
        "R": "r_dtype",
        "W": "w_dtype",
        "Y": "y_dtype",
        "S": "s_dtype",
        "RSTD": "fp32",
    },
    outputs=("Y", "S", "RSTD"),
)
BWD = Kernel(
    op="rmsnorm_bwd",
    fn=rmsnorm_bwd_kernel,
    key=bwd_key,
    launch=warm_bwd,
    pointers={
        "DY": "y_dtype",
        "X": "dtype",
        "W": "w_dtype",
        "RSTD": "fp32",
        "DS": "ds_dtype",
        "DX": "dtype",
        "DW": "fp32",
    },
    outputs=("DX", "DW"),
)
SPEC = KernelSpec(name="rmsnorm", kernels=(FWD, BWD), tiles=tiles, plan=plan)
