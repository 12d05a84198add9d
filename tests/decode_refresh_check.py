"""Refreshes the decode engine's weights from an FSDP2-sharded student (a helper that
tests/test_decode_refresh.py launches under torchrun; not a test module).

    torchrun --nproc_per_node=2 --standalone tests/decode_refresh_check.py OUT.json

For a tied and an untied student (q/k/v biases, q/k norms, a vocabulary and widths that split unevenly
over the processes), in the model's dtype and in bf16: the sharded student's weights are changed in
place (as an optimizer step changes its shards), the engine refreshed, and its tensors compared with
those of an engine built from a whole copy changed the same way. Counts the collectives a refresh
issues (all-gathers of flat buckets; per-parameter DTensor gathers), and those a greedy generation
issues. Rank 0 writes the results as JSON.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import sys

import torch
import torch.distributed as tdist
from torch.distributed.fsdp._fully_shard import _fsdp_param_group as param_group
from torch.distributed.tensor import DTensor

from kdistill.decode import DecodeEngine, DecodeWeights, Sampling
from kdistill.models.decoder import build_decoder
from kdistill.train import distributed as dist
from kdistill.train.step import compute_loss
from tests.test_contract import make_run, make_spec


class Counter:
    """Counts flat all-gathers and DTensor.full_tensor calls while active."""

    def __init__(self) -> None:
        self.flat = self.per_tensor = 0

    def __enter__(self) -> Counter:
        self._name = "all_gather_single" if hasattr(tdist, "all_gather_single") else "all_gather_into_tensor"
        self._gather, self._full = getattr(tdist, self._name), DTensor.full_tensor

        def gather(*args, **kwargs):
            self.flat += 1
            return self._gather(*args, **kwargs)

        def full(t, *args, **kwargs):
            self.per_tensor += 1
            return self._full(t, *args, **kwargs)

        setattr(tdist, self._name, gather)
        DTensor.full_tensor = full
        return self

    def __exit__(self, *exc) -> None:
        setattr(tdist, self._name, self._gather)
        DTensor.full_tensor = self._full


def _tensors(w: DecodeWeights) -> list[torch.Tensor]:
    return [w.embed, w.lm_head, w.norm] + [
        t for layer in w.layers for t in dataclasses.astuple(layer) if t is not None
    ]


@torch.no_grad()
def _change(model: torch.nn.Module, sharded: bool) -> None:
    """The same elementwise change of every weight, whole or through this process's shards."""
    for p in model.parameters():
        t = p.to_local() if sharded else p
        t.mul_(1.5).add_(0.25)


def one(tied: bool, dtype: torch.dtype | None) -> dict:
    spec = make_spec(hidden=24, inter=40, layers=2, vocab=41, tied=tied, bias=True, arch="qwen3")
    student = build_decoder(spec, seed=3)
    whole = copy.deepcopy(student)
    dist.shard_student(student)
    engine = DecodeEngine(student, batch_size=2, max_len=24, cuda_graphs="off", dtype=dtype)
    _change(student, sharded=True)
    _change(whole, sharded=False)
    with Counter() as refresh:
        engine.refresh(student)
    expected = DecodeWeights(whole, engine.dtype, torch.device("cpu"))
    equal = all(torch.equal(a, b) for a, b in zip(_tensors(engine.weights), _tensors(expected)))
    # each process its own prompts and number of rows: a generation waits for nobody
    rank = dist.info().rank
    prompts = [[1, 2, 3], [4, 5]][: rank + 1]
    engine.sampling = Sampling(max_new_tokens=4 + 3 * rank)
    with Counter() as generation:
        new = engine.generate(prompts)
    reference = DecodeEngine(whole, batch_size=2, max_len=24, cuda_graphs="off", dtype=dtype)
    reference.sampling = engine.sampling
    return {
        "equal": equal,
        "flat_gathers": refresh.flat,
        "per_tensor_gathers": refresh.per_tensor,
        "parameters": len(list(student.parameters())),
        "generation_collectives": generation.flat + generation.per_tensor,
        "same_tokens": new == reference.generate(prompts),
    }


def _step(student: torch.nn.Module, teacher: torch.nn.Module) -> dict[str, torch.Tensor]:
    """One forward and backward of the KD loss; the student's local gradients by name."""
    g = torch.Generator().manual_seed(dist.info().rank)
    ids = torch.randint(0, 41, (2, 8), generator=g)
    labels = torch.randint(0, 41, (16,), generator=g)
    r = compute_loss(
        student, teacher, ids, labels, make_run(batch=2, seq=8, chunk=4), torch.autocast("cpu", enabled=False)
    )
    r.loss.backward()
    return {n: p.grad.to_local().clone() for n, p in student.named_parameters()}


def shared(dtype: torch.dtype | None) -> dict:
    """A student kept gathered from forward to backward, gathered once (dist.unshard) before it writes,
    as an on-policy step does: the engine built from the gathered student keeps its weights once FSDP
    frees them after the backward; at the next step the refresh gathers nothing more, the update's
    forward and backward gather nothing, and its gradients are those of a step that gathers for itself."""
    spec = make_spec(hidden=24, inter=40, layers=2, vocab=41, tied=False, bias=True)
    teacher = build_decoder(make_spec(hidden=32, layers=2, vocab=41), seed=0).eval().requires_grad_(False)
    student, twin = build_decoder(spec, seed=3), build_decoder(spec, seed=3)
    whole = copy.deepcopy(student)
    for model in (student, twin):
        dist.shard_student(model, keep_gathered=True)
    # the first step: the engine built from the gathered student, then the update
    dist.unshard(student)
    engine = DecodeEngine(student, batch_size=2, max_len=24, cuda_graphs="off", dtype=dtype)
    _step(student, teacher)
    _step(twin, teacher)
    first = DecodeWeights(whole, engine.dtype, torch.device("cpu"))
    kept = all(torch.equal(a, b) for a, b in zip(_tensors(engine.weights), _tensors(first)))
    # the weights change (as an optimizer step changes them), then the next step
    for model in (student, twin):
        model.zero_grad(set_to_none=True)
        _change(model, sharded=True)
    _change(whole, sharded=False)
    gathers = {"n": 0}
    unshard = param_group.FSDPParamGroup.unshard

    def counted(self, *args, **kwargs):  # a real all-gather: not gathered yet, none in flight
        if not self.is_unsharded and getattr(self, "_all_gather_result", None) is None:
            gathers["n"] += 1
        return unshard(self, *args, **kwargs)

    param_group.FSDPParamGroup.unshard = counted
    try:
        dist.unshard(student)
        before = gathers["n"]
        with Counter() as refresh:
            engine.refresh(student)
        after_refresh = gathers["n"]
        grads = _step(student, teacher)
        in_step = gathers["n"] - after_refresh
    finally:
        param_group.FSDPParamGroup.unshard = unshard
    expected = _step(twin, teacher)
    final = DecodeWeights(whole, engine.dtype, torch.device("cpu"))
    return {
        "unshard_gathers": before,
        "refresh_gathers": refresh.flat + refresh.per_tensor + after_refresh - before,
        "step_gathers": in_step,
        "same_gradients": all(torch.equal(grads[n], expected[n]) for n in expected),
        "engine_kept": kept
        and all(torch.equal(a, b) for a, b in zip(_tensors(engine.weights), _tensors(final))),
    }


def main(out: str) -> None:
    dist.init_from_env("cpu")
    results = {
        f"{'tied' if tied else 'untied'}_{name}": one(tied, dtype)
        for tied in (True, False)
        for name, dtype in (("model_dtype", None), ("bf16", torch.bfloat16))
    }
    results["shared"] = shared(None)
    everyone = dist.all_gather_object(results)
    if dist.is_main():
        with open(out, "w", encoding="utf-8") as f:
            json.dump(everyone, f)
    dist.destroy()


if __name__ == "__main__":
    main(sys.argv[1])
    dist.leave(0)  # no interpreter finalisation after a process group (see dist.leave)
