"""Rotary position embedding (RoPE) applied to q and k, in the half-rotation layout of Llama/Qwen.

    rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2])
    q' = q * cos + rotate_half(q) * sin

Shapes: q (B, Hq, T, D), k (B, Hkv, T, D); cos, sin (T, D) in fp32, built by `rope_tables`.
"""

from __future__ import annotations

import torch

from kdistill.models.spec import ModelSpec, rope_inv_freq


def rope_tables(
    spec: ModelSpec, seq_len: int, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables (T, D) in fp32 for positions 0..T-1, llama3 scaling included."""
    inv = torch.tensor(rope_inv_freq(spec), dtype=torch.float32, device=device)
    pos = torch.arange(seq_len, dtype=torch.float32, device=device)
    freqs = torch.outer(pos, inv)  # (T, D/2)
    emb = torch.cat([freqs, freqs], dim=-1)  # (T, D)
    return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def rope_reference(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k. cos/sin are cast to q's dtype first, as transformers does."""
    c, s = cos.to(q.dtype), sin.to(q.dtype)
    return q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE on q (B, Hq, T, D) and k (B, Hkv, T, D). `theta` identifies the tables (kernel key)."""
    return rope_reference(q, k, cos, sin)
