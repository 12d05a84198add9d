"""The one place that chooses, per call, a Triton kernel or the PyTorch reference, and records keys.

    from kdistill import dispatch
    y = dispatch.rmsnorm(x, w, eps)
    r = dispatch.kd_loss(h, W, ht, Wt, labels, alpha=0.5, temperature=2.0, divergence="jsd", chunk_size=1024)

Callers outside kernels/ (the decoder, the training step) use only this module.
"""

from __future__ import annotations

from kdistill.kernels.kd import kd_chunk
from kdistill.kernels.runtime import aligned, configure, current, recording, using
from kdistill.ops.attention import attention
from kdistill.ops.kd_loss import KDLossResult
from kdistill.ops.kd_loss import kd_loss as _kd_loss
from kdistill.ops.rmsnorm import add_rmsnorm, rmsnorm
from kdistill.ops.rope import apply_rope
from kdistill.ops.swiglu import swiglu

__all__ = [
    "KDLossResult",
    "add_rmsnorm",
    "aligned",
    "apply_rope",
    "attention",
    "configure",
    "current",
    "kd_loss",
    "recording",
    "rmsnorm",
    "swiglu",
    "using",
]


def kd_loss(
    s_hidden,
    s_weight,
    t_hidden,
    t_weight,
    labels,
    *,
    alpha: float,
    temperature: float,
    divergence: str,
    beta: float = 0.5,
    ignore_index: int = -100,
    chunk_size: int,
) -> KDLossResult:
    """The chunked KD head (kdistill.ops.kd_loss.kd_loss) with each chunk on the kernel or reference."""
    return _kd_loss(
        s_hidden,
        s_weight,
        t_hidden,
        t_weight,
        labels,
        alpha=alpha,
        temperature=temperature,
        divergence=divergence,
        beta=beta,
        ignore_index=ignore_index,
        chunk_size=chunk_size,
        chunk_fn=kd_chunk,
    )
