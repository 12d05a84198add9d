"""RMSNorm, optionally fused with the residual add that precedes it.

    s = x + residual                       (when residual is given)
    y = s / sqrt(mean(s^2, -1) + eps) * weight

Shapes: x, residual (..., H); weight (H,). Statistics are computed in fp32 and the result is cast
back to x's dtype, as Hugging Face's Llama/Qwen RMSNorm does.

The file reads top to bottom: reference math, kernel key, dispatch (kernels/runtime.py) to the Triton
kernel in kernels/triton/rmsnorm.py or to the reference.
"""

from __future__ import annotations

import torch

from kdistill.kernels import keys, runtime


def rmsnorm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = x / rms(x) * weight, statistics in fp32. x (..., H), weight (H,)."""
    dtype = x.dtype
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(dtype)


def add_rmsnorm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rmsnorm(x + residual), x + residual)."""
    s = x + residual
    return rmsnorm_reference(s, weight, eps), s


# -- keys ---------------------------------------------------------------------------------------------
def _rows(t: torch.Tensor) -> torch.Tensor:
    """The (rows, H) row-major tensor the kernel receives (a copy only when t is not row-major)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.is_contiguous() else t2.contiguous()


def fwd_key(
    arch: str, x2: torch.Tensor, r2: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> keys.KernelKey:
    return keys.rmsnorm_fwd_key(
        arch,
        hidden=x2.shape[-1],
        eps=eps,
        dtype=x2.dtype,
        w_dtype=weight.dtype,
        residual=r2 is not None,
        r_dtype=r2.dtype if r2 is not None else None,
        aligned=runtime.aligned(x2, r2 if r2 is not None else x2, weight),
    )


def bwd_key(
    arch: str,
    dy2: torch.Tensor,
    x2: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor | None,
    ds2: torch.Tensor | None,
) -> keys.KernelKey:
    return keys.rmsnorm_bwd_key(
        arch,
        hidden=x2.shape[-1],
        dtype=x2.dtype,
        w_dtype=weight.dtype,
        has_dres=ds2 is not None,
        aligned=runtime.aligned(dy2, x2, weight, rstd, ds2 if ds2 is not None else dy2),
    )


# -- dispatch -----------------------------------------------------------------------------------------
def _dispatch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    rt = runtime.current()
    x2 = _rows(x)
    r2 = _rows(residual) if residual is not None else None
    key = fwd_key(rt.arch, x2, r2, weight, eps)

    def bwd_key_fn(dy, normed, w, rstd, ds):
        k = bwd_key(rt.arch, _rows(dy), _rows(normed), w, rstd, _rows(ds) if ds is not None else None)
        rt.record(k, "bwd", lambda: _triton().bwd_launch(k, dy, normed, w, rstd, ds))
        return k

    if rt.use_kernel(key, x, weight):
        try:
            return rt.launch(
                key,
                lambda: _triton().RMSNormFunction.apply(
                    x2.view(x.shape),
                    r2.view(x.shape) if r2 is not None else None,
                    weight,
                    eps,
                    key,
                    bwd_key_fn,
                    rt.kernel_failed,
                ),
                lambda: _triton().fwd_launch(key, x2, r2, weight, eps),
            )
        except Exception as e:
            rt.kernel_failed(key, e)
    rt.record(key, "fwd", lambda: _triton().fwd_launch(key, x2, r2, weight, eps))
    if residual is None:
        y, s = rmsnorm_reference(x, weight, eps), None
    elif rt.recorder is not None and torch.is_grad_enabled():
        # The returned sum is computed apart from the one the norm reads, so that its gradient (seen by
        # the backward hook) is only what flows from later uses: exactly the kernel's DS input.
        y, s = rmsnorm_reference(x + residual, weight, eps), x + residual
    else:
        y, s = add_rmsnorm_reference(x, residual, weight, eps)

    def record_bwd(grads):
        dy = grads[0] if grads[0] is not None else torch.zeros_like(y)
        ds = grads[1] if len(grads) > 1 else None
        normed = s if s is not None else x
        rstd = torch.empty(normed.numel() // normed.shape[-1], dtype=torch.float32, device=normed.device)
        bwd_key_fn(
            dy.detach(), normed.detach(), weight.detach(), rstd, ds.detach() if ds is not None else None
        )

    rt.on_backward([y] if s is None else [y, s], record_bwd)
    return y if residual is None else (y, s)


def _triton():
    from kdistill.kernels.triton import rmsnorm as kernel

    return kernel


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x (..., H) with weight (H,)."""
    return _dispatch(x, None, weight, eps)


def add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(x + residual), x + residual): the residual add fused into the norm."""
    return _dispatch(x, residual, weight, eps)
