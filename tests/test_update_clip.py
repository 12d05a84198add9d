"""The training step's update with a fused AdamW (the GPU's optimizer; torch has the same kernel on the
CPU): gradient clipping is the optimizer's `grad_scale`, a divisor the kernel applies as it reads each
gradient, not a pass of its own over the gradients. The result is clip_grad_norm_ then AdamW's step (to
rounding where the clip bites, bit for bit where it does not), and a skipped step changes nothing."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

from kdistill.config import RunConfig
from kdistill.models.decoder import build_decoder
from kdistill.train import step as step_mod
from kdistill.train.step import StepContext, clip_divisor, gradient_norm
from tests.test_contract import make_spec

CPU = torch.device("cpu")


def _student_with_grads(seed: int = 1) -> torch.nn.Module:
    model = build_decoder(make_spec(hidden=24, inter=40, layers=2), seed=seed)
    ids = torch.randint(0, 40, (2, 8), generator=torch.Generator().manual_seed(0))
    model(ids).float().square().mean().backward()
    return model


def _groups(model: torch.nn.Module) -> list[dict]:
    return [{"params": list(model.parameters()), "weight_decay": 0.1}]


def _update(model: torch.nn.Module, clip: float, loss: float = 1.0) -> tuple[torch.optim.AdamW, list]:
    cfg = RunConfig()
    cfg.optim.grad_clip = clip
    opt = torch.optim.AdamW(_groups(model), lr=1e-2, fused=True)
    ctx = StepContext(cfg, model, None, opt, CPU, contextlib.nullcontext(), None, source=object())  # type: ignore[arg-type]
    ctx.lr_device.fill_(1e-2)  # type: ignore[union-attr]
    means = torch.tensor([[loss, loss, 0.0]], dtype=torch.float64)
    return opt, step_mod._update(ctx, means)


def _reference(model: torch.nn.Module, clip: float) -> torch.Tensor:
    opt = torch.optim.AdamW(_groups(model), lr=1e-2, fused=True)
    norm = torch.nn.utils.clip_grad_norm_(list(model.parameters()), clip if clip > 0 else float("inf"))
    opt.step()
    return norm


@pytest.mark.parametrize("clip", [1e-3, 1e6, 0.0], ids=["clip bites", "clip far above", "no clip"])
def test_a_fused_update_clips_through_grad_scale_as_clip_grad_norm_then_step(monkeypatch, clip):
    ours, ref = _student_with_grads(), _student_with_grads()
    raw = [p.grad.clone() for p in ours.parameters()]
    norm_ref = _reference(ref, clip)
    seen = []  # the gradients as the optimizer's kernel receives them
    real_step = torch.optim.AdamW.step
    monkeypatch.setattr(
        torch.optim.AdamW,
        "step",
        lambda o: seen.append([p.grad.clone() for p in ours.parameters()]) or real_step(o),
    )
    opt, parts = _update(ours, clip)
    assert len(seen) == 1 and all(
        torch.equal(g, r) for g, r in zip(seen[0], raw, strict=True)
    )  # not clipped before
    assert float(parts[1]) == pytest.approx(float(norm_ref), rel=1e-6)
    if clip == 1e-3:
        assert float(opt.grad_scale) == pytest.approx(float(norm_ref) / clip, rel=1e-5)
        for p, q in zip(ours.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    else:  # a divisor of 1 (or none) changes no bit
        assert (opt.grad_scale is None) == (clip == 0.0)
        for p, q in zip(ours.parameters(), ref.parameters(), strict=True):
            assert torch.equal(p, q)


def test_a_nonfinite_loss_skips_the_fused_update_with_its_divisor_set():
    model = _student_with_grads()
    before = copy.deepcopy(model.state_dict())
    opt, parts = _update(model, 1e-3, loss=float("nan"))
    assert opt.grad_scale is not None and float(opt.found_inf) == 1.0
    assert parts[2].tolist() == [0.0, 0.0]
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_the_divisor_is_one_within_the_clip_and_none_without_one():
    norm = torch.tensor(2.0)
    assert float(clip_divisor(norm, 4.0)) == 1.0
    assert float(clip_divisor(norm, 0.5)) == pytest.approx(4.0, rel=1e-5)
    assert clip_divisor(norm, float("inf")) is None
    assert clip_divisor(norm, 0.5).dtype == torch.float32  # the fused kernel reads a float32 scalar


def test_gradient_norm_is_the_norm_of_every_gradient():
    model = _student_with_grads()
    expected = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert float(gradient_norm(model)) == pytest.approx(float(expected), rel=1e-5)
    model.zero_grad(set_to_none=True)
    assert float(gradient_norm(model)) == 0.0
