"""The fused AdamW on FSDP2's local shards (kdistill.train.optim.ShardedAdamW) against torch's fused
AdamW on the DTensor parameters (a helper that tests/test_distributed.py launches under torchrun; not a
test module).

    torchrun --nproc_per_node=2 --standalone tests/fsdp_adamw.py OUT.json

Two copies of a sharded tiny student, the same gradients, four steps (the second skipped through
`found_inf`, the fourth's gradients divided through `grad_scale`, the step's clip); rank 0 writes whether parameters, moments and step counts are identical after each step.
"""

from __future__ import annotations

import json
import sys

import torch

from kdistill.models.decoder import build_decoder
from kdistill.train import distributed as dist
from kdistill.train.optim import ShardedAdamW
from tests.test_contract import make_spec


def _groups(model: torch.nn.Module) -> list[dict]:
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]


def check() -> dict:
    """The check, in a process group already joined (tests/fsdp_checks.py runs it beside the others)."""
    models = []
    for _ in range(2):
        m = build_decoder(make_spec(hidden=24, inter=40, layers=3), seed=1)
        dist.shard_student(m)
        models.append(m)
    ours = ShardedAdamW(_groups(models[0]), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, fused=True)
    ref = torch.optim.AdamW(_groups(models[1]), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, fused=True)
    same = []
    for step in range(4):
        ids = torch.randint(0, 40, (2, 8), generator=torch.Generator().manual_seed(step))
        for model, opt in zip(models, (ours, ref), strict=True):
            opt.zero_grad(set_to_none=True)
            model(ids).float().square().mean().backward()
            opt.found_inf = torch.full((), 1.0 if step == 1 else 0.0)
            opt.grad_scale = torch.full((), 2.5) if step == 3 else None
            opt.step()
        ok = all(
            torch.equal(a.full_tensor(), b.full_tensor())
            for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True)
        )
        for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
            sa, sb = ours.state[a], ref.state[b]
            ok &= torch.equal(sa["step"], sb["step"])
            ok &= torch.equal(sa["exp_avg"].full_tensor(), sb["exp_avg"].full_tensor())
            ok &= torch.equal(sa["exp_avg_sq"].full_tensor(), sb["exp_avg_sq"].full_tensor())
        same.append(bool(ok))
    steps = sorted({float(s["step"]) for s in ours.state.values()})
    moved = not torch.equal(next(models[0].parameters()).full_tensor(), next(iter(_fresh())).full_tensor())
    return {"same": same, "steps": steps, "moved": moved}


def main(out: str) -> None:
    dist.init_from_env("cpu")
    result = check()
    if dist.is_main():
        with open(out, "w") as f:
            json.dump(result, f)
    dist.destroy()


def _fresh():
    m = build_decoder(make_spec(hidden=24, inter=40, layers=3), seed=1)
    dist.shard_student(m)
    return m.parameters()


if __name__ == "__main__":
    main(sys.argv[1])
    dist.leave(0)  # no interpreter finalisation after a process group (see dist.leave)
