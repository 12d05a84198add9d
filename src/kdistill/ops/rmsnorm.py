"""RMSNorm, optionally fused with the residual add that precedes it.

    s = x + residual                       (when residual is given)
    y = s / sqrt(mean(s^2, -1) + eps) * weight

Shapes: x, residual (..., H); weight (H,). Statistics are computed in fp32 and the result is cast
back to x's dtype, as Hugging Face's Llama/Qwen RMSNorm does.

Reference math only (PyTorch); kdistill.dispatch picks it or the Triton kernel in kernels/rmsnorm.py.
"""

from __future__ import annotations

import torch


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
