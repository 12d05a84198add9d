"""The KD loss head on a GPU at full size: the Triton kernel against the references, and memory.

Run on the device: .venv/bin/python -m pytest tests/gpu/test_kd_loss_gpu.py -q -m gpu
(Qwen2.5-0.5B shapes: N = 4096 tokens, H = 896, V = 151936.)
"""

from __future__ import annotations

import pytest
import torch

from kdistill.config import DIVERGENCES
from kdistill.ops.kd_loss import chunk_divergence_reference, kd_loss, kd_loss_dense

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

N, H, V, HT, VT = 4096, 896, 151936, 1536, 152064  # teacher: Qwen2.5-1.5B-like, padded vocab
IGNORE = -100


def _kernel():
    from kdistill.kernels.kd_loss import kd_loss_chunk_triton

    return kd_loss_chunk_triton


def _close(a, e, rel, what):
    a, e = a.double(), e.double()
    assert torch.isfinite(a).all(), f"{what}: non-finite"
    err, ref = float((a - e).abs().max()), float(e.abs().max())
    assert err <= rel * ref + 1e-7, f"{what}: max abs error {err:.3e} > {rel:.1e} * {ref:.3e}"


def _inputs(dtype, n=N, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    sh = torch.randn(n, H, generator=g, device="cuda").to(dtype)
    sw = (torch.randn(V, H, generator=g, device="cuda") * 0.05).to(dtype)
    th = torch.randn(n, HT, generator=g, device="cuda").to(dtype)
    tw = (torch.randn(VT, HT, generator=g, device="cuda") * 0.05).to(dtype)
    y = torch.randint(0, V, (n,), generator=g, device="cuda")
    y[::7] = IGNORE
    return sh, sw, th, tw, y


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_kernel_chunk_matches_fp64_reference_full_vocab(divergence, dtype):
    """One 256-row chunk of real-vocab logits: the kernel vs the reference in fp64 on the same logits."""
    g = torch.Generator(device="cuda").manual_seed(1)
    s = (torch.randn(256, V, generator=g, device="cuda") * 4).to(dtype)
    t = (torch.randn(256, V, generator=g, device="cuda") * 4).to(dtype)
    y = torch.randint(0, V, (256,), generator=g, device="cuda")
    y[::5] = IGNORE
    kw = dict(
        alpha=0.5, temperature=2.0, divergence=divergence, beta=0.3, ignore_index=IGNORE, grad_scale=0.01
    )
    ref = chunk_divergence_reference(s.double(), t.double(), y, **kw)
    got = _kernel()(s.clone(), t, y, **kw)
    for what, a, e in zip(("loss", "ce", "kd"), got[:3], ref[:3]):
        _close(a, e, 1e-5, what)
    _close(got[3], ref[3], 2e-5 if dtype == torch.float32 else 1e-2, "grad_logits")
    assert float(got[3][y == IGNORE].abs().max()) == 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("divergence", ["forward_kl", "jsd", "skew_reverse_kl"])
def test_kd_loss_kernel_loop_matches_reference_loop(divergence, dtype):
    """N = 4096, V = 151936, H = 896: the chunk loop with the kernel vs with the torch reference."""
    sh, sw, th, tw, y = _inputs(dtype)
    out = {}
    for name, fn in (("ref", None), ("triton", _kernel())):
        h, w = sh.clone().requires_grad_(), sw.clone().requires_grad_()
        r = kd_loss(h, w, th, tw, y, alpha=0.5, temperature=2.0, divergence=divergence, chunk_size=1024,
                    chunk_fn=fn)  # fmt: skip
        (r.loss * 1.5).backward()
        out[name] = (r.loss.detach(), r.ce, r.kd, h.grad, w.grad)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for what, a, e in zip(("loss", "ce", "kd", "grad_h", "grad_w"), out["triton"], out["ref"]):
        _close(a, e, tol, what)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_kd_loss_kernel_loop_matches_dense_fp64(dtype):
    """An independent oracle for the whole loop on the GPU (fp32 logits GEMMs, fp32 grad_W
    accumulation through addmm(out_dtype)): the dense fp64 formulas on the same inputs, N = 512."""
    sh, sw, th, tw, y = _inputs(dtype, n=512, seed=3)
    h, w = sh.clone().requires_grad_(), sw.clone().requires_grad_()
    r = kd_loss(h, w, th, tw, y, alpha=0.5, temperature=2.0, divergence="forward_kl", chunk_size=128,
                chunk_fn=_kernel())  # fmt: skip
    r.loss.backward()
    hd, wd = sh.double().requires_grad_(), sw.double().requires_grad_()
    d = kd_loss_dense(hd @ wd.T, th.double() @ tw.double()[:V].T, y, alpha=0.5, temperature=2.0,
                      divergence="forward_kl")  # fmt: skip
    d.loss.backward()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    _close(r.loss.detach(), d.loss.detach(), tol, "loss")
    _close(h.grad, hd.grad, tol, "grad_h")
    _close(w.grad, wd.grad, tol, "grad_w")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_all_ignored_on_gpu(dtype):
    sh, sw, th, tw, y = _inputs(dtype, n=300)
    y[:] = IGNORE
    h = sh.clone().requires_grad_()
    r = kd_loss(h, sw, th, tw, y, alpha=0.5, temperature=2.0, divergence="tvd", chunk_fn=_kernel())
    r.loss.backward()
    assert r.tokens == 0 and float(r.loss) == 0.0 and float(h.grad.abs().max()) == 0.0


def test_peak_memory_far_below_dense_logits():
    """bf16 weights, N = 4096, chunk 256: peak extra GPU memory of forward + backward."""
    sh, sw, th, tw, y = _inputs(torch.bfloat16)
    h, w = sh.clone().requires_grad_(), sw.clone().requires_grad_()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    r = kd_loss(h, w, th, tw, y, alpha=0.5, temperature=2.0, divergence="jsd", chunk_size=256,
                chunk_fn=_kernel())  # fmt: skip
    r.loss.backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    dense = N * V * 4  # one fp32 [N x V] logits tensor: 2.5 GB
    saved = V * H * 4 + N * H * 2  # the fp32 grad_W accumulator and grad_h, kept for backward
    chunk = 256 * V * 4
    assert peak < dense / 2, f"peak {peak / 2**20:.0f} MiB vs dense logits {dense / 2**20:.0f} MiB"
    # s and t fp32, the bf16 gradient, and backward's cast copies of grad_W / grad_h
    assert peak - saved < 4 * chunk + V * H * 2 + N * H * 2, f"peak {peak / 2**20:.0f} MiB"


def test_compute_dtype_logits_at_full_size_close_to_fp32_logits():
    """kd.logits_dtype=compute at Qwen2.5 shapes on the Triton kernel: bf16 logits give the loss within
    0.5% and the gradients within 2% (of their largest value) of the fp32-logits head."""
    sh, sw, th, tw, labels = _inputs(torch.bfloat16)
    kw = dict(alpha=0.5, temperature=2.0, divergence="forward_kl", chunk_size=2048, chunk_fn=_kernel())
    grads = []
    results = []
    for logits in ("float32", "compute"):
        h, w = sh.detach().clone().requires_grad_(), sw.detach().clone().requires_grad_()
        r = kd_loss(h, w, th, tw, labels, logits_dtype=logits, **kw)
        r.loss.backward()
        results.append(r)
        grads.append((h.grad, w.grad))
    assert abs(float(results[1].loss) - float(results[0].loss)) <= 5e-3 * abs(float(results[0].loss))
    _close(grads[1][0], grads[0][0], 2e-2, "grad hidden")
    _close(grads[1][1], grads[0][1], 2e-2, "grad weight")


def test_compute_dtype_logits_on_the_demo_within_one_percent(tmp_path):
    """The demo pair on its real text, same seed and batches: with kd.logits_dtype=compute the held-out
    KL to the teacher and the CE within 1% of the fp32-logits run's, nothing compiled after the seal."""
    from tests.gpu.test_fp8_student_gpu import _demo, assert_heldout_within_one_percent

    base = _demo(tmp_path / "fp32", tmp_path / "cache")
    low = _demo(tmp_path / "bf16", tmp_path / "cache", "kd.logits_dtype=compute")
    assert_heldout_within_one_percent(low, base)
