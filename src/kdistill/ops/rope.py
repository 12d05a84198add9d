"""Rotary position embedding (RoPE) applied to q and k, in the half-rotation layout of Llama/Qwen.

    rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2])
    q' = q * cos + rotate_half(q) * sin

Shapes: q (B, Hq, T, D), k (B, Hkv, T, D); cos, sin (T, D) in fp32, built by `kdistill.models.decoder.rope_tables`.

Reference math only (PyTorch); kdistill.dispatch picks it or the Triton kernel in kernels/rope.py.
"""

from __future__ import annotations

import torch


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def rope_reference(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k. cos/sin are cast to q's dtype first, as transformers does."""
    c, s = cos.to(q.dtype), sin.to(q.dtype)
    return q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s
