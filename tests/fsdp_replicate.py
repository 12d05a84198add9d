"""A replicated student's gradient average against FSDP2's reduce-scatter and one process (a check that
tests/fsdp_checks.py runs under torchrun for tests/test_distributed.py; not a test module).

Each process takes its own rows of one batch: a plain copy of the student averages its gradients with
distributed.GradAverage (fp32 and bf16 buffers), a sharded copy through FSDP2, and one process's
gradient over every row is computed beside them on each process; `check` returns the largest differences.
"""

from __future__ import annotations

import copy

import torch

from kdistill.models.decoder import build_decoder
from kdistill.train import distributed as dist
from tests.test_contract import make_spec


def check() -> dict:
    """The check, in a process group already joined (tests/fsdp_checks.py runs it beside the others)."""
    base = build_decoder(make_spec(hidden=24, inter=40, layers=3), seed=2)
    ids = torch.randint(0, 40, (4, 8), generator=torch.Generator().manual_seed(1))
    mine = ids[dist.batch_slice(4)]

    def loss(model: torch.nn.Module, rows: torch.Tensor) -> torch.Tensor:
        return model(rows).float().square().mean()

    whole = copy.deepcopy(base)
    loss(whole, ids).backward()  # one process over every row (each process's rows: equal halves)
    sharded = dist.shard_student(copy.deepcopy(base))
    loss(sharded, mine).backward()
    diffs: dict[str, float | str] = {"scale": max(float(p.grad.abs().max()) for p in whole.parameters())}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        plain = copy.deepcopy(base)
        loss(plain, mine).backward()
        before = {n: p.grad.clone() for n, p in plain.named_parameters()}
        average = dist.GradAverage(dtype)
        average(plain)
        diffs[f"{name}_vs_one"] = max(
            float((p.grad - q.grad).abs().max())
            for p, q in zip(plain.parameters(), whole.parameters(), strict=True)
        )
        diffs[f"{name}_vs_fsdp"] = max(
            float((p.grad - q.grad.full_tensor()).abs().max())
            for p, q in zip(plain.parameters(), sharded.parameters(), strict=True)
        )
        diffs[f"{name}_moved"] = max(
            float((plain.get_parameter(n).grad - g).abs().max()) for n, g in before.items()
        )
        diffs[f"{name}_buffer_dtype"] = str(average.flat.dtype)  # type: ignore[union-attr]
    return diffs
