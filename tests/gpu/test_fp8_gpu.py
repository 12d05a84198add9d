"""GPU tests of teacher.precision=fp8 (run on a GPU with `-m gpu`): the row-wise quantisation kernel
against PyTorch's own conversion, bit for bit; the FP8 GEMM against the dequantised product; an FP8
teacher prewarmed and sealed, then run, with nothing compiled after the seal.

    pytest -m gpu tests/gpu/test_fp8_gpu.py -q
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
        reason="needs a CUDA GPU with FP8 (compute capability 8.9+)",
    ),
]


@pytest.mark.parametrize("k", [896, 1536, 8960, 200])
def test_quant_kernel_is_bit_identical_to_torch(k):
    from kdistill import dispatch
    from kdistill.kernels import fp8_quant, runtime

    g = torch.Generator(device="cuda").manual_seed(k)
    x = torch.randn((4096, k), device="cuda", generator=g, dtype=torch.float32)
    x = (x * torch.logspace(-2, 2, 4096, device="cuda")[:, None]).to(torch.bfloat16)
    x[7] = 0
    with runtime.using(mode="triton", strict=True):
        q, s = dispatch.quantize_rows(x)
    rq, rs = fp8_quant.reference(x)
    assert torch.equal(s, rs)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))


def test_fp8_linear_matches_the_dequantised_product():
    from kdistill.kernels import runtime
    from kdistill.models.fp8 import FP8Linear, fp8_linear_reference

    g = torch.Generator(device="cuda").manual_seed(0)
    lin = torch.nn.Linear(1536, 8960, bias=False, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.normal_(0, 0.02, generator=g)
    f = FP8Linear.from_linear(lin)
    x = torch.randn((2, 1024, 1536), device="cuda", generator=g, dtype=torch.bfloat16)
    with runtime.using(mode="triton", strict=True), torch.no_grad():
        y = f(x)
        from kdistill import dispatch

        xq, xs = dispatch.quantize_rows(x)
    want = fp8_linear_reference(xq, xs, f.weight, f.weight_scale, torch.float32)
    torch.testing.assert_close(y.float().reshape(-1, 8960), want, rtol=2e-2, atol=2e-3)
    exact = lin(x).float()
    assert float((y.float() - exact).norm() / exact.norm()) < 0.05


def test_fp8_teacher_prewarmed_and_sealed():
    from kdistill.config import load_config
    from kdistill.kernels import seal
    from kdistill.models.decoder import build_decoder
    from kdistill.models.fp8 import convert_to_fp8
    from kdistill.models.spec import load_spec
    from kdistill.train.step import compute_loss

    t_spec, s_spec = load_spec("qwen2.5-1.5b"), load_spec("qwen2.5-0.5b")
    cfg = load_config(
        None,
        [
            "teacher.path=qwen2.5-1.5b",
            "student.path=qwen2.5-0.5b",
            "teacher.precision=fp8",
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
    ids = torch.randint(0, 1000, (2, 512), device=dev)
    labels = torch.randint(0, 1000, (2, 512), device=dev)
    r = compute_loss(student, teacher, ids, labels, cfg, torch.autocast("cuda", dtype=torch.bfloat16))
    r.loss.backward()
    torch.cuda.synchronize()
    assert torch.isfinite(r.loss)
    assert sess.jit_after_prewarm() == 0
