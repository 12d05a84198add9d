"""Causal grouped-query attention through PyTorch SDPA (flash / cuDNN / math backends).

Shapes: q (B, Hq, T, D), k and v (B, Hkv, T, D) with Hq a multiple of Hkv -> (B, Hq, T, D).
No hand-written kernel: SDPA picks the fastest backend for the device. The dispatcher still records a
library key (shape, dtype, grad) so that prewarm runs SDPA once at the real shapes before training.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kdistill.kernels import keys, runtime


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal softmax(q k^T / sqrt(D)) v with k/v heads shared by groups of q heads."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def attention_key(arch: str, q: torch.Tensor, k: torch.Tensor, grad: bool) -> keys.KernelKey:
    b, hq, t, d = q.shape
    return keys.sdpa_key(
        arch, batch=b, q_heads=hq, kv_heads=k.shape[1], seq=t, head_dim=d, dtype=q.dtype, grad=grad
    )


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal softmax(q k^T / sqrt(D)) v with k/v heads shared by groups of q heads."""
    rt = runtime.current()
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    rt.record(attention_key(rt.arch, q, k, grad), "fwd")
    return attention_reference(q, k, v)
