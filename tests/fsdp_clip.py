"""Gradient clipping of a sharded student against torch's clip_grad_norm_ on an unsharded copy (a helper
that tests/test_distributed.py launches under torchrun; not a test module).

    torchrun --nproc_per_node=2 --standalone tests/fsdp_clip.py OUT.json

Both copies get the same gradients (one process's full batch on each process, so FSDP's averaging keeps
them); rank 0 writes {"norm": [sharded, plain], "max_abs_diff": d} for a clip far below the norm.
"""

from __future__ import annotations

import copy
import json
import sys

import torch

from kdistill.models.decoder import build_decoder
from kdistill.train import distributed as dist
from kdistill.train.step import clip_gradients
from tests.test_contract import make_spec


def check() -> dict:
    """The check, in a process group already joined (tests/fsdp_checks.py runs it beside the others)."""
    student = build_decoder(make_spec(hidden=24, inter=40, layers=3), seed=1)
    plain = copy.deepcopy(student)
    dist.shard_student(student)
    ids = torch.randint(0, 40, (2, 8), generator=torch.Generator().manual_seed(0))
    for model in (student, plain):
        model(ids).float().square().mean().backward()
    max_norm = 1e-3
    sharded_norm = clip_gradients(student, max_norm)
    plain_norm = torch.nn.utils.clip_grad_norm_(
        [p for p in plain.parameters() if p.grad is not None], max_norm
    )
    diff = 0.0
    for p, q in zip(student.parameters(), plain.parameters(), strict=True):
        full = p.grad.full_tensor()
        diff = max(diff, float((full - q.grad).abs().max()))
    return {"norm": [float(sharded_norm), float(plain_norm)], "max_abs_diff": diff}


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
