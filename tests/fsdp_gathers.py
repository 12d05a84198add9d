"""Counts FSDP2's all-gathers in one training step of a sharded tiny student (a helper that
tests/test_distributed.py launches under torchrun; not a test module).

    torchrun --nproc_per_node=2 --standalone tests/fsdp_gathers.py OUT.json

Writes {"regathered": {"root": n, "blocks": [n, ...]}, "kept": {...}, "units": {...}} from rank 0: the
all-gathers each FSDP unit issued during a forward, the chunked KD loss (many chunks) and the backward,
with activation checkpointing on, the student's blocks resharded after forward (FSDP2's default) or kept
gathered until their backward; and a kept student of 8 blocks in units of several blocks (kept_in_units).
"""

from __future__ import annotations

import json
import sys

import torch
from torch.distributed.fsdp._fully_shard import _fsdp_param_group as param_group

from kdistill.models.decoder import build_decoder
from kdistill.train import distributed as dist
from kdistill.train.step import compute_loss
from tests.test_contract import make_run, make_spec


def _counted_step(student, teacher) -> tuple[dict, float]:
    """One step (forward, the chunked KD loss, backward) of a sharded student -> (the all-gathers each of
    its FSDP param groups issued, keyed by the group, the loss)."""
    gathered: dict = {}
    unshard = param_group.FSDPParamGroup.unshard

    def counted(self, *args, **kwargs):  # a real all-gather: not gathered yet, none in flight
        if not self.is_unsharded and getattr(self, "_all_gather_result", None) is None:
            if any(m is student or m in student.model.layers for m in self.modules):
                gathered[self] = gathered.get(self, 0) + 1
        return unshard(self, *args, **kwargs)

    param_group.FSDPParamGroup.unshard = counted
    try:
        run = make_run(batch=2, seq=8, chunk=2)  # 8 chunks of the KD head per process
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, 40, (2, 8), generator=g)
        labels = torch.randint(0, 40, (16,), generator=g)
        r = compute_loss(student, teacher, ids, labels, run, torch.autocast("cpu", enabled=False))
        r.loss.backward()
        dist.reshard(teacher)
    finally:
        param_group.FSDPParamGroup.unshard = unshard
    return gathered, float(r.loss.detach())


def _models(layers: int):
    teacher = build_decoder(make_spec(hidden=32, layers=3), seed=0).eval().requires_grad_(False)
    return teacher, build_decoder(make_spec(hidden=24, inter=40, layers=layers), seed=1)


def count_gathers(keep_gathered: bool) -> dict:
    """All-gathers per unit of the student in one step: {"root": n, "blocks": [n, ...]}."""
    teacher, student = _models(3)
    student.checkpoint_blocks(True)
    dist.shard_student(student, keep_gathered=keep_gathered)
    dist.shard_teacher(teacher)
    gathered, _ = _counted_step(student, teacher)
    counts = {group._module_fqn or "root": n for group, n in gathered.items()}
    return {"root": counts.get("root", 0), "blocks": [counts.get(f"model.layers.{i}", 0) for i in range(3)]}


def _kept_step(per: int | None) -> tuple[dict, list[torch.Tensor]]:
    """One step of a kept student of 8 blocks sharded `per` blocks a unit (None: the policy) -> ({units
    that gathered, all-gathers, loss}, this process's gradient shards)."""
    teacher, student = _models(8)
    dist.shard_student(student, keep_gathered=True, unit_blocks=per)
    dist.shard_teacher(teacher)
    gathered, loss = _counted_step(student, teacher)
    counts = {"units": len(gathered), "gathers": sum(gathered.values()), "loss": loss}
    return counts, [p.grad.to_local().clone() for p in student.parameters()]


def kept_in_units() -> dict:
    """A kept student of 8 blocks sharded as the policy says (memory.student_unit_blocks: 2 blocks a
    unit) against one block a unit: the units that gathered in one step and how often, and whether the
    loss and every process's gradient shards are the same."""
    policy, g_policy = _kept_step(None)
    blocks, g_blocks = _kept_step(1)
    same = all(torch.equal(a, b) for a, b in zip(g_policy, g_blocks))
    return {"policy": policy, "blocks": blocks, "same_grads": same}


def check() -> dict:
    """The check, in a process group already joined (tests/fsdp_checks.py runs it beside the others)."""
    return {"regathered": count_gathers(False), "kept": count_gathers(True), "units": kept_in_units()}


def main(out: str) -> None:
    dist.init_from_env("cpu")
    result = check()
    if dist.is_main():
        with open(out, "w") as f:
            json.dump(result, f)
    dist.destroy()


if __name__ == "__main__":
    main(sys.argv[1])
    dist.leave(0)  # no interpreter finalisation after a process group (see dist.leave)
