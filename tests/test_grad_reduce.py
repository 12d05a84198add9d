"""runtime.grad_reduce: the dtype a sharded student's gradients are reduce-scattered in (fp32, or the
dtype its parameters are gathered in), given to FSDP2's mixed-precision policy of every unit; a value
that is not one of the choices is one line."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from kdistill.models.decoder import build_decoder
from kdistill.models.spec import load_spec
from kdistill.train import distributed as kdist
from tests.test_train_kit import run_cli


@pytest.fixture
def one_process_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("reduce", [torch.float32, torch.bfloat16])
def test_every_unit_of_the_sharded_student_reduces_in_the_chosen_dtype(one_process_group, reduce):
    spec = dataclasses.replace(
        load_spec("qwen2.5-0.5b"), num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4,
        num_kv_heads=2, head_dim=16, vocab_size=256,
    )  # fmt: skip
    model = build_decoder(spec)
    kdist.shard_student(model, torch.bfloat16, reduce_dtype=reduce)
    units = [*model.model.layers, model]
    policies = [u._get_fsdp_state()._mp_policy for u in units]  # FSDP2 keeps no public getter
    assert all(p.param_dtype == torch.bfloat16 and p.reduce_dtype == reduce for p in policies)
    # and the step still trains: fp32 masters, gradients of their dtype after the reduce
    ids = torch.randint(0, 256, (2, 8))
    model(ids).float().pow(2).mean().backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(g.dtype == torch.float32 for g in grads)


def test_grad_reduce_must_be_one_of_the_choices(capsys):
    rc, _, err = run_cli(capsys, "plan", "qwen2.5-1.5b:qwen2.5-0.5b", "runtime.grad_reduce=bf16")
    assert rc == 2
    assert err.strip().splitlines()[-1] == (
        "kdistill: error: runtime.grad_reduce is 'bf16', expected one of: fp32, compute"
    )
