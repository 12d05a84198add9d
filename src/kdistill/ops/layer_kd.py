"""Intermediate-layer distillation losses: hidden states and attention maps at mapped layers.

    loss = hidden_state_loss(s, t, valid, "mse")          # s, t (B, T, H) (s already projected to t's width)
    loss = attention_map_loss(qs, ks, qt, kt, valid)      # q (B, Hq, T, D), k (B, Hkv, T, D) of each model

Hidden states (per mapped pair; `valid` (B, T) bool marks the tokens with a label)::

    mse     L = sum_{valid i} mean_d (s_id - t_id)^2 / n_valid
    cosine  L = sum_{valid i} (1 - cos(s_i, t_i)) / n_valid

Attention maps: each model's head-averaged causal attention distribution per query,
A = mean_h softmax(q_h k_h^T / sqrt(D) + causal mask) (B, T, T), then

    L = sum_{valid i} KL(A_t[i] || A_s[i]) / n_valid

Head counts may differ between teacher and student (averaging over heads removes them), as may head_dim.
This materialises (B, Hq, T, T) scores, so runs refuse it above config.ATTENTION_MAX_SEQ_LEN.
All-invalid batches give 0. PyTorch only.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def hidden_state_loss(s: torch.Tensor, t: torch.Tensor, valid: torch.Tensor, kind: str) -> torch.Tensor:
    """Mean over valid tokens of the MSE (mean over features) or 1 - cosine between s and t (B, T, H)."""
    s, t = s.float(), t.float()
    if kind == "mse":
        rows = (s - t).pow(2).mean(-1)  # (B, T)
    elif kind == "cosine":
        rows = 1 - F.cosine_similarity(s, t, dim=-1, eps=1e-8)
    else:
        raise ValueError(f"hidden_state_loss: kind is '{kind}', expected mse or cosine")
    v = valid.to(rows.dtype)
    return (rows * v).sum() / v.sum().clamp_min(1)


def attention_logprobs(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """log of the head-averaged attention distribution (B, T, T) from q (B, Hq, T, D), k (B, Hkv, T, D).
    mask: (B, 1, T, T) bool (True: may attend), None: causal."""
    q, k = q.float(), k.float()
    if k.shape[1] != q.shape[1]:  # grouped-query attention: each kv head serves Hq / Hkv query heads
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    t = q.shape[2]
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # (B, H, T, T)
    if mask is None:
        mask = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    logp = torch.log_softmax(scores, dim=-1)
    # rows with no key (padding in packed rows) are all -inf: keep them finite (they are not valid)
    logp = torch.nan_to_num(logp, nan=0.0, neginf=-1e4)
    return torch.logsumexp(logp, dim=1) - math.log(q.shape[1])  # (B, T, T): log mean_h A_h


def attention_map_loss(
    qs: torch.Tensor,
    ks: torch.Tensor,
    qt: torch.Tensor,
    kt: torch.Tensor,
    valid: torch.Tensor,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean over valid query tokens of KL(teacher's head-averaged attention || student's)."""
    log_s = attention_logprobs(qs, ks, mask)
    with torch.no_grad():
        log_t = attention_logprobs(qt, kt, mask)
    p_t = log_t.exp()
    rows = (p_t * (log_t - log_s)).sum(-1)  # (B, T)
    v = valid.to(rows.dtype)
    return (rows * v).sum() / v.sum().clamp_min(1)
