"""GPU tests of runtime.precision=fp8 (run on a GPU with `-m gpu`): the transposed quantisation kernel
against its reference bit for bit; an FP8 student layer at Qwen2.5-0.5B shapes against the dequantised
product and the bf16 path, forward and both gradients; a strict prewarmed training run that compiles
nothing after the seal; and the demo (real text) trained with and without FP8, held-out KL and CE
within 1%.

    PYTHONPATH=src:. python3 -m pytest -m gpu tests/gpu/test_fp8_student_gpu.py -q
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
        reason="needs a CUDA GPU with FP8 (compute capability 8.9+)",
    ),
]

ROOT = Path(__file__).resolve().parents[2]
DEMO = str(ROOT / "src" / "kdistill" / "demo" / "demo.yaml")


@pytest.mark.parametrize(
    "rows,cols,dtype",
    [
        (32768, 896, torch.bfloat16),  # 16 x 2048 tokens: x^T of q/k/v, gate/up; gy^T of o_proj, down
        (32768, 4864, torch.bfloat16),  # x^T of down_proj
        (32768, 9728, torch.bfloat16),  # gy^T of gate/up
        (4096, 896, torch.bfloat16),
        (4095, 9728, torch.bfloat16),  # rows not a multiple of 16: the padded copy
        (4864, 896, torch.float32),  # fp32: a master weight's W^T
        (33, 200, torch.float32),
    ],
)
def test_transposed_quant_kernel_is_bit_identical_to_its_reference(rows, cols, dtype):
    """Both kernels (the spans' column maxima, then the scales and the transposed copy) against the
    reference at the student's real widths and token counts, the largest value of a column in the
    last span of rows."""
    from kdistill import dispatch
    from kdistill.kernels import fp8_quant_cols, runtime

    g = torch.Generator(device="cuda").manual_seed(cols)
    x = torch.randn((rows, cols), device="cuda", generator=g) * torch.logspace(-2, 2, cols, device="cuda")
    x = x.to(dtype)
    x[:, 5] = 0
    x[rows - 1, 6] = 2 * x[:, 6].abs().max()
    with runtime.using(mode="triton", strict=True):
        qt, s = dispatch.quantize_cols(x)
    rq, rs = fp8_quant_cols.reference(x)
    assert qt.shape == (cols, rows) and qt.is_contiguous()
    assert torch.equal(s, rs)
    assert torch.equal(qt.view(torch.uint8), rq.view(torch.uint8))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm())


@pytest.mark.parametrize("n,k", [(9728, 896), (896, 4864), (1152, 896)])  # gate/up, down, q/k/v
def test_fp8_layer_against_the_dequantised_product_and_the_bf16_path(n, k):
    """One FP8 linear at the student's real shapes (4096 tokens): torch._scaled_mm's values equal the
    dequantised product's up to bf16 rounding, and the FP8 layer stays within a few percent of the
    bf16 path (the autocast F.linear the student runs with runtime.precision=auto)."""
    from kdistill import dispatch
    from kdistill.kernels import runtime
    from kdistill.models.fp8_train import dequantized_mm, fp8_train_linear

    g = torch.Generator(device="cuda").manual_seed(n + k)
    m = 4096
    w = (torch.randn((n, k), device="cuda", generator=g) * 0.02).requires_grad_(True)  # fp32 master
    x = torch.randn((m, k), device="cuda", generator=g).to(torch.bfloat16).requires_grad_(True)
    gy = (torch.randn((m, n), device="cuda", generator=g) * 1e-3).to(torch.bfloat16)
    amp = torch.autocast("cuda", dtype=torch.bfloat16)
    with runtime.using(mode="triton", strict=True):
        with amp:
            y = fp8_train_linear(x, w)
        y.backward(gy)
        with torch.no_grad():  # the same three products on dequantised operands, fp32 accumulation
            want_y = dequantized_mm(*dispatch.quantize_rows(x), *dispatch.quantize_rows(w), torch.float32)
            want_gx = dequantized_mm(*dispatch.quantize_rows(gy), *dispatch.quantize_cols(w), torch.float32)
            want_gw = dequantized_mm(*dispatch.quantize_cols(gy), *dispatch.quantize_cols(x), torch.float32)
    assert y.dtype == torch.bfloat16 and x.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.float32
    for got, want in ((y, want_y), (x.grad, want_gx), (w.grad, want_gw)):
        assert _rel(got, want) < 5e-3, _rel(got, want)  # bf16 output rounding only
    xb, wb = x.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    with amp:
        yb = torch.nn.functional.linear(xb, wb)
    yb.backward(gy)
    errs = {"y": _rel(y, yb), "grad_x": _rel(x.grad, xb.grad), "grad_W": _rel(w.grad, wb.grad)}
    # two e4m3 operands (3 mantissa bits, each off by at most 2^-4 of itself): a few percent
    assert max(errs.values()) < 0.06, errs


def test_fp8_student_prewarmed_and_sealed():
    """A strict run of three training steps and an eval forward at runtime.precision=fp8 (an FP8 teacher
    too): every kernel the FP8 student launches was planned and compiled before the seal."""
    from kdistill.config import load_config
    from kdistill.kernels import seal
    from kdistill.models.decoder import build_decoder
    from kdistill.models.fp8 import convert_to_fp8
    from kdistill.models.fp8_train import FP8TrainLinear, convert_student_to_fp8
    from kdistill.models.spec import load_spec
    from kdistill.train.optim import make_optimizer
    from kdistill.train.step import compute_loss

    t_spec = dataclasses.replace(load_spec("qwen2.5-1.5b"), num_layers=4)
    s_spec = dataclasses.replace(load_spec("qwen2.5-0.5b"), num_layers=4)
    cfg = load_config(
        None,
        [
            "teacher.path=qwen2.5-1.5b",
            "student.path=qwen2.5-0.5b",
            "teacher.precision=fp8",
            "runtime.precision=fp8",
            "data.seq_len=512",
            "schedule.batch_size=2",
            "runtime.strict_kernels=true",
        ],
    ).validate()
    dev = torch.device("cuda")
    sess = seal.start(cfg, t_spec, s_spec, dev, torch.bfloat16, quiet=True)
    teacher = build_decoder(t_spec, device=dev, dtype=torch.bfloat16, seed=1).eval().requires_grad_(False)
    convert_to_fp8(teacher)
    student = build_decoder(s_spec, device=dev, dtype=torch.float32, seed=2)
    assert convert_student_to_fp8(student) == 7 * s_spec.num_layers
    assert isinstance(student.model.layers[0].mlp.down_proj, FP8TrainLinear)
    opt = make_optimizer(student, cfg.optim)
    amp = torch.autocast("cuda", dtype=torch.bfloat16)
    g = torch.Generator(device=dev).manual_seed(0)
    before = student.model.layers[0].self_attn.q_proj.weight.detach().clone()
    for _ in range(3):
        ids = torch.randint(0, 1000, (2, 512), device=dev, generator=g)
        labels = torch.randint(0, 1000, (2, 512), device=dev, generator=g)
        opt.zero_grad(set_to_none=True)
        r = compute_loss(student, teacher, ids, labels, cfg, amp)
        r.loss.backward()
        opt.step()
        assert torch.isfinite(r.loss)
    with torch.no_grad(), amp:
        h = student(ids)
    torch.cuda.synchronize()
    assert torch.isfinite(h).all()
    assert not torch.equal(before, student.model.layers[0].self_attn.q_proj.weight)
    assert sess.jit_after_prewarm() == 0
    seal.unseal()


def _demo(run_dir: Path, cache: Path, *overrides: str) -> dict:
    env = {**os.environ, "KDISTILL_CACHE_DIR": str(cache), "PYTHONPATH": str(ROOT / "src")}
    cmd = [
        sys.executable,
        "-m",
        "kdistill",
        "run",
        DEMO,
        "runtime.device=cuda",
        "runtime.strict_kernels=true",
        f"output.dir={run_dir}",
        *overrides,
        "--quiet",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads((run_dir / "summary.json").read_text())


def assert_heldout_within_one_percent(run: dict, base: dict) -> None:
    """A demo run's summary against a baseline's: nothing compiled after the seal, no kernel fell back,
    held-out KL to the teacher and CE within 1%."""
    assert run["jit_after_prewarm"] == 0 and run["kernels"]["fallbacks"] == [], run["kernels"]
    for key in ("kl_to_teacher", "student_loss"):
        a, b = run["heldout"][key], base["heldout"][key]
        assert abs(a - b) <= 0.01 * abs(b), (key, a, b)


def test_fp8_student_on_the_demo_within_one_percent_of_bf16(tmp_path):
    """The demo pair on its real text (the stdlib corpus), 250 steps each, same seed and batches: the
    FP8 student's held-out KL to the teacher and CE within 1% of the bf16 student's."""
    bf16 = _demo(tmp_path / "bf16", tmp_path / "cache")
    fp8 = _demo(tmp_path / "fp8", tmp_path / "cache", "runtime.precision=fp8")
    assert_heldout_within_one_percent(fp8, bf16)
