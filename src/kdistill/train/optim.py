"""Optimizer and learning-rate schedule: AdamW, linear warmup, cosine decay to min_lr_ratio * lr.

Norm weights and biases get no weight decay.
"""

from __future__ import annotations

import math

import torch

from kdistill.config import OptimConfig


def make_optimizer(model: torch.nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    """AdamW over the trainable parameters; decay only on matrices (ndim >= 2); fused on a GPU."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # One fused kernel for the whole update on a GPU, FSDP2's sharded parameters (DTensors) included:
    # its `found_inf` flag lets a non-finite step be skipped without the host waiting for the GPU
    # (train.step). The CPU keeps the multi-tensor path, whose results the tests and the demo pin down.
    params = decay + no_decay
    fused = bool(params) and all(p.is_cuda for p in params)
    return torch.optim.AdamW(
        groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=True if fused else None
    )


def lr_at(step: int, total_steps: int, cfg: OptimConfig) -> float:
    """Learning rate for optimizer step `step` (0-based): warmup, then cosine to min_lr_ratio * lr."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    cosine = 0.5 * (1 + math.cos(math.pi * progress))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)
