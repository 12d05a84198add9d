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
    # FSDP2's sharded parameters: the same fused kernel on their local shards (ShardedAdamW)
    cls = ShardedAdamW if fused and any(_is_dtensor(p) for p in params) else torch.optim.AdamW
    return cls(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=True if fused else None)


def _is_dtensor(t: torch.Tensor) -> bool:
    return hasattr(t, "to_local") and hasattr(t, "placements")


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a plain tensor sharing its storage), or t itself."""
    return t.to_local() if _is_dtensor(t) else t


class ShardedAdamW(torch.optim.AdamW):
    """torch's fused AdamW for FSDP2's sharded (DTensor) parameters, run on their local shards.

    AdamW is elementwise, so each process updating its own shards is the whole update; calling the
    fused kernel on the shards' plain tensors skips DTensor's dispatch, which for one call over every
    parameter, gradient and moment of a model costs milliseconds of host time per step. The state is
    AdamW's own (DTensor moments, a device step count per parameter), so state_dict, sharded
    checkpoints and resume are unchanged; `found_inf` (set by the training step) skips the update in the
    kernel and leaves the step counts as they were, as AdamW's fused path does, and `grad_scale` divides the
    gradients as the kernel reads them (the step's clip). Only what kdistill uses:
    fused, no amsgrad, no maximize, no closure."""

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]
        if closure is not None:
            raise ValueError("ShardedAdamW.step takes no closure")
        found_inf = getattr(self, "found_inf", None)
        grad_scale = getattr(self, "grad_scale", None)  # the training step's clip (train.step.clip_divisor)
        for group in self.param_groups:
            if group["amsgrad"] or group["maximize"] or not group["fused"]:
                raise ValueError("ShardedAdamW runs the fused update only (no amsgrad, no maximize)")
            lists: list[list[torch.Tensor]] = [[], [], [], [], []]  # params, grads, m, v, steps
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:  # as AdamW's lazy init for the fused path
                    state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                for dst, t in zip(lists, (p, p.grad, state["exp_avg"], state["exp_avg_sq"])):
                    dst.append(_local(t))
                lists[4].append(state["step"])
            if not lists[0]:
                continue
            beta1, beta2 = group["betas"]
            grouped = torch.optim.Optimizer._group_tensors_by_device_and_dtype(lists)  # type: ignore[arg-type]
            for (params, grads, exp_avgs, exp_avg_sqs, steps), _ in grouped.values():
                torch._foreach_add_(steps, 1)
                torch._fused_adamw_(
                    params,
                    grads,
                    exp_avgs,
                    exp_avg_sqs,
                    [],
                    steps,
                    amsgrad=False,
                    lr=group["lr"],
                    beta1=beta1,
                    beta2=beta2,
                    weight_decay=group["weight_decay"],
                    eps=group["eps"],
                    maximize=False,
                    grad_scale=grad_scale,
                    found_inf=found_inf,
                )
                if found_inf is not None:
                    torch._foreach_sub_(steps, [found_inf] * len(steps))


def lr_at(step: int, total_steps: int, cfg: OptimConfig) -> float:
    """Learning rate for optimizer step `step` (0-based): warmup, then cosine to min_lr_ratio * lr."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    cosine = 0.5 * (1 + math.cos(math.pi * progress))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)
