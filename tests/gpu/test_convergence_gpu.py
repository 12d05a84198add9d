"""Convergence on a GPU: the same tiny teacher/student pair trained with kdistill's Triton kernels and
with the PyTorch reference path, from the same weights on the same batches, loss compared at every step.

    PYTHONPATH=src:. python3 -m pytest -m gpu tests/gpu/test_convergence_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from kdistill.config import RunConfig
from kdistill.kernels import runtime, seal
from kdistill.models.decoder import build_decoder
from kdistill.models.spec import spec_from_hf_config
from kdistill.train.optim import make_optimizer
from kdistill.train.step import compute_loss

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _spec(model_type: str, hidden: int, layers: int, heads: int, kv: int, inter: int, vocab: int = 1000):
    return spec_from_hf_config(
        {
            "model_type": model_type,
            "vocab_size": vocab,
            "hidden_size": hidden,
            "intermediate_size": inter,
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "num_key_value_heads": kv,
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            "max_position_embeddings": 512,
            "tie_word_embeddings": True,
        }
    )


def _train(mode: str, teacher_spec, student_spec, batches, divergence: str, dtype: str) -> list[float]:
    run = RunConfig()
    run.runtime.kernels, run.runtime.dtype, run.runtime.strict_kernels = mode, dtype, True
    run.kd.divergence, run.kd.alpha, run.kd.temperature, run.kd.chunk_size = divergence, 0.7, 2.0, 256
    run.schedule.batch_size, run.data.seq_len = batches[0][0].shape
    dev = torch.device("cuda")
    tdt = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    sess = seal.start(run, teacher_spec, student_spec, dev, tdt, quiet=True)
    teacher = build_decoder(teacher_spec, device=dev, dtype=tdt, seed=1).eval().requires_grad_(False)
    student = build_decoder(student_spec, device=dev, dtype=torch.float32, seed=2)
    run.optim.lr, run.optim.warmup_steps = 3e-3, 0
    opt = make_optimizer(student, run.optim)
    amp = torch.autocast("cuda", dtype=tdt, enabled=tdt != torch.float32)
    losses = []
    for ids, labels in batches:
        opt.zero_grad(set_to_none=True)
        loss = compute_loss(student, teacher, ids, labels, run, amp).loss
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert sess.jit_after_prewarm() == 0
    seal.unseal()
    runtime.configure(run, device="cpu")
    return losses


def _learnable_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """30 batches of 4 x 64 learnable sequences (each token a fixed function of the previous one, from
    random starts), so both paths must actually train, not just agree on noise."""
    g = torch.Generator(device="cuda").manual_seed(0)
    steps = torch.arange(65, device="cuda")
    batches = []
    for _ in range(30):
        start = torch.randint(0, 1000, (4, 1), device="cuda", generator=g)
        x = (start * 7 + steps * 13) % 1000
        batches.append((x[:, :-1].contiguous(), x[:, 1:].contiguous()))
    return batches


@pytest.mark.parametrize("dtype,tol", [("float32", 2e-3), ("bfloat16", 3e-2)])
@pytest.mark.parametrize("divergence", ["forward_kl", "jsd"])
def test_kernels_track_reference_every_step(dtype: str, tol: float, divergence: str) -> None:
    teacher = _spec("qwen2", 128, 3, 4, 2, 256)
    student = _spec("qwen2", 64, 2, 4, 2, 160)
    batches = _learnable_batches()
    ref = _train("reference", teacher, student, batches, divergence, dtype)
    ker = _train("triton", teacher, student, batches, divergence, dtype)
    rel = [abs(a - b) / abs(b) for a, b in zip(ker, ref)]
    trace = " ".join(f"{r:.1e}" for r in rel)
    assert max(rel) < tol, (
        f"max relative loss difference {max(rel):.2e} at step {rel.index(max(rel)) + 1}: {trace}"
    )
    assert ref[-1] < 0.9 * ref[0] and ker[-1] < 0.9 * ker[0]


class _Feed:
    """The training step's batcher over the test's batches (host copies)."""

    def __init__(self, batches: list) -> None:
        self.batches, self.i, self.last_indices = [(a.cpu(), b.cpu()) for a, b in batches], 0, None

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.i += 1
        return self.batches[self.i - 1]


def _train_run_step(
    mode: str, teacher_spec, student_spec, batches, precision: str, graphs: str
) -> list[float]:
    """The run's own step (kdistill.train.step: clipping, the non-finite test, fused AdamW), captured as a
    CUDA graph after two eager steps when `graphs` is on; runtime.precision `precision`."""
    from kdistill.models.fp8_train import convert_student_to_fp8
    from kdistill.train.graph import StepGraph
    from kdistill.train.step import StepContext, _graphed

    run = RunConfig()
    run.runtime.kernels, run.runtime.dtype, run.runtime.strict_kernels = mode, "bfloat16", True
    run.runtime.precision, run.runtime.cuda_graphs = precision, graphs
    run.kd.divergence, run.kd.alpha, run.kd.temperature, run.kd.chunk_size = "forward_kl", 0.7, 2.0, 256
    run.schedule.batch_size, run.data.seq_len = batches[0][0].shape
    run.schedule.steps = len(batches)
    run.optim.lr, run.optim.warmup_steps = 3e-3, 0
    dev = torch.device("cuda")
    sess = seal.start(run, teacher_spec, student_spec, dev, torch.bfloat16, quiet=True)
    teacher = (
        build_decoder(teacher_spec, device=dev, dtype=torch.bfloat16, seed=1).eval().requires_grad_(False)
    )
    student = build_decoder(student_spec, device=dev, dtype=torch.float32, seed=2)
    if precision == "fp8":
        convert_student_to_fp8(student)
    opt = make_optimizer(student, run.optim)
    ctx = StepContext(run, student, teacher, opt, dev, torch.autocast("cuda", dtype=torch.bfloat16), None)
    graph = StepGraph(dev)
    if graphs == "off":
        graph.capture_now = lambda sig: False  # type: ignore[method-assign]
    feed, counters, losses = _Feed(batches), {"degenerate_batches": 0}, []
    for step in range(len(batches)):
        assert ctx.lr_device is not None
        ctx.lr_device.fill_(run.optim.lr)
        packed, _, _ = _graphed(ctx, graph, feed, step, counters)
        losses.append(float(packed[0]))
    assert sess.jit_after_prewarm() == 0
    assert graph.counts["captures"] == (1 if graphs == "on" else 0)
    seal.unseal()
    runtime.configure(run, device="cpu")
    return losses


@pytest.mark.parametrize("precision,graphs", [("auto", "on"), ("fp8", "on"), ("fp8", "off")])
def test_kernels_track_reference_in_each_step_mode(precision: str, graphs: str) -> None:
    """The captured step and the FP8 student: Triton kernels against the reference ops (the same mode),
    every step within the bf16 tolerance, and both train."""
    teacher = _spec("qwen2", 128, 3, 4, 2, 256)
    student = _spec("qwen2", 64, 2, 4, 2, 160)
    batches = _learnable_batches()
    ref = _train_run_step("reference", teacher, student, batches, precision, graphs)
    ker = _train_run_step("triton", teacher, student, batches, precision, graphs)
    rel = [abs(a - b) / abs(b) for a, b in zip(ker, ref)]
    trace = " ".join(f"{r:.1e}" for r in rel)
    assert max(rel) < 3e-2, (
        f"max relative loss difference {max(rel):.2e} at step {rel.index(max(rel)) + 1}: {trace}"
    )
    assert ref[-1] < 0.9 * ref[0] and ker[-1] < 0.9 * ker[0]
