"""Causal grouped-query attention through PyTorch SDPA (flash / cuDNN / math backends).

Shapes: q (B, Hq, T, D), k and v (B, Hkv, T, D) with Hq a multiple of Hkv -> (B, Hq, T, D).
No hand-written kernel: SDPA picks the fastest backend for the device. kdistill.dispatch records a
library key (shape, dtype, grad) so that prewarm runs SDPA once at the real shapes before training.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal softmax(q k^T / sqrt(D)) v with k/v heads shared by groups of q heads.

    SDPA's own grouped-query support (`enable_gqa`) reads each k/v head for its group of q heads, so
    no (B, Hq, T, D) copies of k and v are made, stored for backward, or reduced in backward."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
