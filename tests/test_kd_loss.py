"""The chunked KD loss (`kdistill.ops.kd_loss`) against its dense fp64 formulas, and its memory bound.

Run: .venv/bin/python -m pytest tests/test_kd_loss.py -q
"""

from __future__ import annotations

import json
import math
import tempfile

import pytest
import torch
import torch.nn.functional as F

from kdistill.config import DIVERGENCES
from kdistill.errors import UserError
from kdistill.ops.kd_loss import (
    chunk_divergence_reference,
    divergence_rows,
    kd_loss,
    kd_loss_dense,
)

# The odd shape of the style guide: N tokens, H hidden, V vocab; the teacher has its own hidden size
# and a padded vocabulary (Vt > V). CHUNK does not divide N.
N, H, V, HT, VT, CHUNK = 41, 40, 1271, 24, 1300, 16
IGNORE = -100
TOL = {torch.float64: 1e-9, torch.float32: 2e-5, torch.bfloat16: 4e-2}  # relative to the oracle's max


def make_inputs(dtype=torch.float64, n=N, h=H, v=V, ht=HT, vt=VT, seed=0, scale=1.0, ignored=(0, 5, 17, 40)):
    g = torch.Generator().manual_seed(seed)
    sh = torch.randn(n, h, generator=g, dtype=torch.float64)
    sw = torch.randn(v, h, generator=g, dtype=torch.float64) * (0.3 * scale)
    th = torch.randn(n, ht, generator=g, dtype=torch.float64)
    tw = torch.randn(vt, ht, generator=g, dtype=torch.float64) * (0.4 * scale)
    labels = torch.randint(0, v, (n,), generator=g)
    labels[[i for i in ignored if i < n]] = IGNORE
    sh, sw, th, tw = (x.to(dtype) for x in (sh, sw, th, tw))
    return sh.requires_grad_(), sw.requires_grad_(), th, tw, labels


def close(actual: torch.Tensor, expected: torch.Tensor, rel: float, what: str) -> None:
    a, e = actual.double(), expected.double()
    assert torch.isfinite(a).all(), f"{what}: non-finite values"
    err = float((a - e).abs().max())
    ref = float(e.abs().max())
    assert err <= rel * ref + 1e-12, f"{what}: max abs error {err:.3e} > {rel:.1e} * {ref:.3e}"


def oracle(sh, sw, th, tw, labels, grad_out=1.0, **kw):
    """Dense fp64 loss on the same (possibly rounded) inputs, and its gradients by autograd."""
    h = sh.detach().double().requires_grad_()
    w = sw.detach().double().requires_grad_()
    t_logits = th.double() @ tw.double().T if th is not None else None
    r = kd_loss_dense(h @ w.T, t_logits, labels, **kw)
    gh, gw = torch.autograd.grad(r.loss, (h, w), grad_outputs=torch.tensor(grad_out, dtype=torch.float64))
    return r, gh, gw


def check(dtype, grad_out=2.5, chunk_size=CHUNK, inputs=None, logits_dtype="float32", **kw):
    sh, sw, th, tw, labels = inputs or make_inputs(dtype)
    r = kd_loss(sh, sw, th, tw, labels, chunk_size=chunk_size, logits_dtype=logits_dtype, **kw)
    gh, gw = torch.autograd.grad(r.loss, (sh, sw), grad_outputs=torch.tensor(grad_out, dtype=r.loss.dtype))
    ro, gho, gwo = oracle(sh, sw, th, tw, labels, grad_out=grad_out, **kw)
    tol = TOL[dtype]
    assert r.tokens == ro.tokens
    assert gh.dtype == sh.dtype and gw.dtype == sw.dtype
    close(r.loss.detach(), ro.loss.detach(), tol, "loss")
    close(r.ce, ro.ce, tol, "ce")
    close(r.kd, ro.kd, tol, "kd")
    close(gh, gho, tol, "grad hidden")
    close(gw, gwo, tol, "grad weight")
    return r


# Every divergence at temperatures != 1 (and 1), alpha 0.3 and 1, fp64: values and gradients.
@pytest.mark.parametrize("alpha", [0.3, 1.0])
@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0, 4.0])
@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_matches_dense_fp64(divergence, temperature, alpha):
    check(torch.float64, alpha=alpha, temperature=temperature, divergence=divergence, beta=0.3)


@pytest.mark.parametrize("temperature", [0.5, 2.0])
@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_matches_dense_fp32(divergence, temperature):
    check(torch.float32, alpha=0.3, temperature=temperature, divergence=divergence)


@pytest.mark.parametrize("divergence", ["forward_kl", "jsd", "tvd", "skew_reverse_kl"])
def test_matches_dense_bf16(divergence):
    # bf16 weights and hidden states; on the CPU the GEMM rounds logits to bf16, hence the tolerance.
    check(torch.bfloat16, alpha=0.5, temperature=2.0, divergence=divergence)


@pytest.mark.parametrize("divergence", ["forward_kl", "reverse_kl", "jsd"])
def test_compute_dtype_logits_reach_the_chunk_function_and_match(divergence):
    """logits_dtype="compute": bf16 operands give the chunk function bf16 student and teacher logits
    (float32: fp32 ones); the loss and gradients stay within bf16's tolerance of the dense oracle,
    and fp32 operands give the same bits either way."""
    seen: list[tuple[torch.dtype, torch.dtype]] = []

    def spy(s, t, labels, **kw):
        seen.append((s.dtype, t.dtype))
        return chunk_divergence_reference(s, t, labels, **kw)

    kw = dict(alpha=0.5, temperature=2.0, divergence=divergence)
    inputs = make_inputs(torch.bfloat16)
    check(torch.bfloat16, inputs=inputs, logits_dtype="compute", **kw)
    sh, sw, th, tw, labels = inputs
    kd_loss(sh, sw, th, tw, labels, chunk_size=CHUNK, chunk_fn=spy, logits_dtype="compute", **kw)
    assert seen and set(seen) == {(torch.bfloat16, torch.bfloat16)}
    seen.clear()
    kd_loss(sh, sw, th, tw, labels, chunk_size=CHUNK, chunk_fn=spy, **kw)
    assert set(seen) == {(torch.float32, torch.float32)}

    sh, sw, th, tw, labels = make_inputs(torch.float32)
    a = kd_loss(sh, sw, th, tw, labels, chunk_size=CHUNK, logits_dtype="compute", **kw)
    b = kd_loss(sh, sw, th, tw, labels, chunk_size=CHUNK, **kw)
    ga = torch.autograd.grad(a.loss, (sh, sw))
    gb = torch.autograd.grad(b.loss, (sh, sw))
    assert torch.equal(a.loss, b.loss) and all(torch.equal(x, y) for x, y in zip(ga, gb, strict=True))


def test_compute_dtype_logits_cast_a_teacher_cache_and_a_mixture():
    """The teacher cache's log-prob rows and a mixture's target reach the chunk function in the
    student logits' dtype path: cached rows as bf16, the mixture's fp32 target as it is."""
    seen: list[tuple[torch.dtype, torch.dtype]] = []

    def spy(s, t, labels, **kw):
        seen.append((s.dtype, t.dtype))
        return chunk_divergence_reference(s, t, labels, **kw)

    sh, sw, th, tw, labels = make_inputs(torch.bfloat16)
    logprobs = torch.log_softmax((th @ tw.T).float(), dim=-1)  # (N, Vt) fp32, as a cache holds them
    kw = dict(alpha=0.5, temperature=2.0, divergence="forward_kl", chunk_size=CHUNK, chunk_fn=spy)
    kd_loss(sh, sw, None, None, labels, teacher_logprobs=logprobs, logits_dtype="compute", **kw)
    assert set(seen) == {(torch.bfloat16, torch.bfloat16)}
    seen.clear()
    kd_loss(sh, sw, None, None, labels, teacher_mixture=[(th, tw, 1.0)], logits_dtype="compute", **kw)
    assert set(seen) == {(torch.bfloat16, torch.float32)}
    with pytest.raises(UserError, match="kd.logits_dtype"):
        kd_loss(sh, sw, th, tw, labels, logits_dtype="bf16", **kw)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 4.0])
def test_alpha_zero_is_cross_entropy_and_needs_no_teacher(temperature):
    sh, sw, th, tw, labels = make_inputs(torch.float64)
    r = check(torch.float64, inputs=(sh, sw, None, None, labels), alpha=0.0, temperature=temperature,
              divergence="jsd")  # fmt: skip
    expected = F.cross_entropy(sh.detach() @ sw.detach().T, labels, ignore_index=IGNORE)
    close(r.loss.detach(), expected, 1e-12, "alpha=0 loss vs F.cross_entropy")
    assert float(r.kd) == 0.0
    # Teacher tensors on the meta device: any teacher GEMM would fail, so none runs.
    meta_t = torch.empty(N, HT, device="meta"), torch.empty(VT, HT, device="meta")
    r2 = kd_loss(sh, sw, *meta_t, labels, alpha=0.0, temperature=temperature, divergence="forward_kl",
                 chunk_size=CHUNK)  # fmt: skip
    close(r2.loss.detach(), r.loss.detach(), 1e-12, "alpha=0 with a meta teacher")


def test_forward_kl_and_ce_match_torch_functional():
    sh, sw, th, tw, labels = make_inputs(torch.float64)
    T, alpha = 2.0, 0.4
    r = kd_loss(sh, sw, th, tw, labels, alpha=alpha, temperature=T, divergence="forward_kl", chunk_size=CHUNK)
    s, t = (sh @ sw.T).detach(), th @ tw[:V].T
    keep = labels != IGNORE
    ce = F.cross_entropy(s, labels, ignore_index=IGNORE)
    kl = F.kl_div(F.log_softmax(s[keep] / T, -1), F.log_softmax(t[keep] / T, -1), log_target=True,
                  reduction="batchmean") * T**2  # fmt: skip
    close(r.ce, ce, 1e-12, "ce")
    close(r.kd, kl, 1e-12, "kd")
    close(r.loss.detach(), (1 - alpha) * ce + alpha * kl, 1e-12, "loss")


@pytest.mark.parametrize("chunk_size", [1, 7, 41, 64, 4096])
def test_chunk_size_does_not_change_result(chunk_size):
    check(torch.float64, chunk_size=chunk_size, alpha=0.5, temperature=2.0, divergence="skew_kl")


@pytest.mark.parametrize("grad_out", [1.0, -0.75, 0.0])
def test_grad_output_scales_gradients(grad_out):
    check(torch.float64, grad_out=grad_out, alpha=0.5, temperature=2.0, divergence="reverse_kl")


def test_backward_through_loss_expression():
    """The loss inside a larger graph: (3 * loss + 1).backward() gives 3x the gradients."""
    sh, sw, th, tw, labels = make_inputs(torch.float64)
    r = kd_loss(sh, sw, th, tw, labels, alpha=0.5, temperature=2.0, divergence="tvd", chunk_size=CHUNK)
    (3 * r.loss + 1).backward()
    _, gho, gwo = oracle(sh, sw, th, tw, labels, grad_out=3.0, alpha=0.5, temperature=2.0, divergence="tvd")
    close(sh.grad, gho, 1e-9, "grad hidden")
    close(sw.grad, gwo, 1e-9, "grad weight")


@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_extreme_logits_stay_finite_and_exact(divergence):
    """Logits with a spread of hundreds: probabilities underflow; log-domain formulas stay exact."""
    inputs = make_inputs(torch.float64, scale=30.0)
    check(torch.float64, inputs=inputs, alpha=0.7, temperature=1.0, divergence=divergence)
    inputs32 = make_inputs(torch.float32, scale=30.0)
    r = kd_loss(*inputs32, alpha=0.7, temperature=1.0, divergence=divergence, chunk_size=CHUNK)
    r.loss.backward()
    assert (
        torch.isfinite(r.loss)
        and torch.isfinite(inputs32[0].grad).all()
        and torch.isfinite(inputs32[1].grad).all()
    )


@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_all_ignored_batch_is_zero_without_nan(divergence):
    sh, sw, th, tw, labels = make_inputs(torch.float32)
    labels[:] = IGNORE
    r = kd_loss(sh, sw, th, tw, labels, alpha=0.5, temperature=2.0, divergence=divergence, chunk_size=CHUNK)
    assert r.tokens == 0
    assert r.loss.item() == 0.0 and float(r.ce) == 0.0 and float(r.kd) == 0.0
    r.loss.backward()
    assert sh.grad is not None and sw.grad is not None
    assert float(sh.grad.abs().max()) == 0.0 and float(sw.grad.abs().max()) == 0.0
    with torch.no_grad():
        r2 = kd_loss(sh, sw, th, tw, labels, alpha=0.5, temperature=2.0, divergence=divergence)
    assert float(r2.loss) == 0.0


def test_ignored_rows_do_not_matter():
    """Changing the hidden states of ignored tokens changes nothing, and their gradient is zero."""
    sh, sw, th, tw, labels = make_inputs(torch.float64)
    kw = dict(alpha=0.5, temperature=2.0, divergence="jsd", chunk_size=CHUNK)
    r1 = kd_loss(sh, sw, th, tw, labels, **kw)
    r1.loss.backward()
    ign = labels == IGNORE
    assert float(sh.grad[ign].abs().max()) == 0.0
    sh2 = sh.detach().clone()
    sh2[ign] += 5.0
    th2 = th.clone()
    th2[ign] -= 3.0
    r2 = kd_loss(sh2, sw.detach(), th2, tw, labels, **kw)
    assert r1.loss.item() == r2.loss.item()


def test_no_grad_gives_same_values():
    sh, sw, th, tw, labels = make_inputs(torch.float64)
    kw = dict(alpha=0.5, temperature=2.0, divergence="skew_reverse_kl", chunk_size=CHUNK)
    r = kd_loss(sh, sw, th, tw, labels, **kw)
    with torch.no_grad():
        r2 = kd_loss(sh, sw, th, tw, labels, **kw)
    r3 = kd_loss(sh.detach(), sw.detach(), th, tw, labels, **kw)
    assert not r2.loss.requires_grad and not r3.loss.requires_grad
    assert r.loss.item() == r2.loss.item() == r3.loss.item()


def test_only_weight_or_only_hidden_requires_grad():
    sh, sw, th, tw, labels = make_inputs(torch.float64)
    kw = dict(alpha=0.5, temperature=2.0, divergence="forward_kl")
    _, gho, gwo = oracle(sh, sw, th, tw, labels, **kw)
    r = kd_loss(sh.detach(), sw, th, tw, labels, chunk_size=CHUNK, **kw)
    r.loss.backward()
    close(sw.grad, gwo, 1e-9, "grad weight alone")
    r = kd_loss(sh, sw.detach(), th, tw, labels, chunk_size=CHUNK, **kw)
    r.loss.backward()
    close(sh.grad, gho, 1e-9, "grad hidden alone")


def test_padded_teacher_vocab_rows_are_ignored():
    sh, sw, th, tw, labels = make_inputs(torch.float64)
    kw = dict(alpha=0.6, temperature=2.0, divergence="forward_kl", chunk_size=CHUNK)
    r1 = kd_loss(sh, sw, th, tw, labels, **kw)
    tw2 = tw.clone()
    tw2[V:] = 1e4  # huge padding logits: would dominate the teacher softmax if used
    r2 = kd_loss(sh, sw, th, tw2, labels, **kw)
    r3 = kd_loss(sh, sw, th, tw[:V], labels, **kw)
    assert r1.loss.item() == r2.loss.item() == r3.loss.item()


def test_chunk_function_gradient_is_autograd_gradient():
    """chunk_divergence_reference's closed-form dL/ds equals autograd through the dense formulas."""
    g = torch.Generator().manual_seed(3)
    s = torch.randn(9, 257, generator=g, dtype=torch.float64) * 3
    t = torch.randn(9, 257, generator=g, dtype=torch.float64) * 3
    y = torch.randint(0, 257, (9,), generator=g)
    y[4] = IGNORE
    for div in DIVERGENCES:
        kw = dict(alpha=0.4, temperature=1.5, divergence=div, beta=0.7, ignore_index=IGNORE)
        loss, ce, kd, grad = chunk_divergence_reference(s.clone(), t.clone(), y, grad_scale=0.25, **kw)
        sd = s.clone().requires_grad_()
        dense = kd_loss_dense(sd, t, y, **kw)
        (dense.loss * dense.tokens * 0.25).backward()
        close(grad, sd.grad, 1e-10, f"{div} grad_logits")
        close(loss, dense.loss.detach() * dense.tokens, 1e-12, f"{div} loss_sum")
        close(ce, dense.ce * dense.tokens, 1e-12, f"{div} ce_sum")
        close(kd, dense.kd * dense.tokens, 1e-12, f"{div} kd_sum")
        assert float(grad[4].abs().max()) == 0.0
        *_, none = chunk_divergence_reference(s.clone(), t.clone(), y, need_grad=False, **kw)
        assert none is None


@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_divergence_properties(divergence):
    """D(p || p) = 0 with zero gradient; D >= 0; TVD <= 1; JSD(0.5) <= log 2."""
    g = torch.Generator().manual_seed(1)
    logp = torch.log_softmax(torch.randn(7, 300, generator=g, dtype=torch.float64) * 2, -1)
    logq = torch.log_softmax(torch.randn(7, 300, generator=g, dtype=torch.float64) * 2, -1)
    d_same, g_same = divergence_rows(logp, logp.clone(), divergence, 0.5, True)
    assert float(d_same.abs().max()) < 1e-12
    assert float(g_same.abs().max()) < 1e-12
    d, _ = divergence_rows(logp, logq, divergence, 0.5, False)
    assert (d > 0).all()
    if divergence == "tvd":
        assert (d <= 1).all()
    if divergence == "jsd":
        assert (d <= math.log(2)).all()


def test_errors_are_one_line_user_errors():
    sh, sw, th, tw, labels = make_inputs(torch.float32)
    kw = dict(alpha=0.5, temperature=2.0, divergence="forward_kl")
    cases = [
        (dict(kw, divergence="kl"), "kd.divergence"),
        (dict(kw, temperature=0.0), "kd.temperature"),
        (dict(kw, alpha=1.5), "kd.alpha"),
        (dict(kw, beta=1.0), "kd.beta"),
        (dict(kw, chunk_size=0), "kd.chunk_size"),
    ]
    for bad, field in cases:
        with pytest.raises(UserError, match=field):
            kd_loss(sh, sw, th, tw, labels, **bad)
    with pytest.raises(UserError, match="teacher"):
        kd_loss(sh, sw, None, None, labels, **kw)
    with pytest.raises(UserError, match="vocabulary size 1271"):
        kd_loss(sh, sw, th, tw[: V - 1], labels, **kw)
    bad_labels = labels.clone()
    bad_labels[3] = V
    with pytest.raises(UserError, match="token id 1271 outside the student vocabulary") as e:
        kd_loss(sh, sw, th, tw, bad_labels, **kw)
    assert "\n" not in str(e.value)


# ---------------------------------------------------------------------------------------------
# Peak memory. torch's CPU allocator reports every allocation and free to the profiler when
# profile_memory=True; the chrome trace's "[memory]" events carry the signed byte count of each.
# Their running sum over the profiled region is the memory allocated since it began, so its maximum
# is the loss's true peak extra memory (inputs excluded), temporaries inside autograd included.
# test_memory_probe_sees_dense_logits checks that the probe does see an [N x V] tensor.
# ---------------------------------------------------------------------------------------------


def peak_extra_bytes(fn) -> int:
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
    ) as prof:
        fn()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.load(open(f.name))["traceEvents"]
    mem = [e for e in events if e.get("name") == "[memory]" and e["args"].get("Device Type") == 0]
    mem.sort(key=lambda e: (e["ts"], e["args"].get("Ev Idx", 0)))
    live = peak = 0
    for e in mem:
        live += e["args"]["Bytes"]
        peak = max(peak, live)
    return peak


def test_memory_probe_sees_dense_logits():
    n, v = 512, 8192
    sh, sw, th, tw, labels = make_inputs(torch.float32, n=n, h=32, v=v, ht=32, vt=v, ignored=())

    def dense():
        r = kd_loss_dense(sh @ sw.T, th @ tw.T, labels, alpha=0.5, temperature=2.0, divergence="forward_kl")
        r.loss.backward()

    assert peak_extra_bytes(dense) >= n * v * 4


def _chunked_peak(n, h, v, chunk, divergence):
    sh, sw, th, tw, labels = make_inputs(torch.float32, n=n, h=h, v=v, ht=h, vt=v, ignored=(1, 2, 3))
    rows_seen = []

    def spy(s, t, y, **kw):
        rows_seen.append(s.shape[0])
        return chunk_divergence_reference(s, t, y, **kw)

    def run():
        r = kd_loss(sh, sw, th, tw, labels, alpha=0.5, temperature=2.0, divergence=divergence,
                    chunk_size=chunk, chunk_fn=spy)  # fmt: skip
        r.loss.backward()

    peak = peak_extra_bytes(run)
    # rows with no target are skipped: only the scored rows reach the head
    assert max(rows_seen) == chunk and sum(rows_seen) == int((labels != IGNORE).sum())
    assert sw.grad is not None and torch.isfinite(sw.grad).all()
    return peak


def test_chunked_loss_peak_memory_far_below_dense_logits():
    """Large vocab, 64 chunks: the peak is a few chunk-sized tensors, and does not grow with N.

    (Sizes kept small enough for a 2-core CPU; the probe counts bytes, so size does not matter.)
    """
    n, h, v, chunk = 4096, 32, 8192, 64
    divergence = "skew_reverse_kl"  # the divergence with the most temporaries in the reference
    peak = _chunked_peak(n, h, v, chunk, divergence)
    dense_logits = n * v * 4  # one fp32 [N x V] tensor: 128 MiB
    chunk_logits = chunk * v * 4  # one fp32 [chunk x V] tensor: 2 MiB
    mib = 2**20
    # Measured: ~7.3 chunk-sized fp32 tensors (s, t, grad, log-probs, temporaries) + grad_h + grad_W.
    assert peak < 10 * chunk_logits, f"peak {peak / mib:.1f} MiB vs chunk logits {chunk_logits / mib:.1f} MiB"
    assert peak < dense_logits / 6, (
        f"peak {peak / mib:.1f} MiB vs [N x V] logits {dense_logits / mib:.1f} MiB"
    )
    # Four times fewer tokens: the same peak, up to O(N x H): grad_h, and with ignored labels the
    # gathered scored rows, their gradient and its scatter back (3 N x H fp32), plus the row indices.
    small = _chunked_peak(n // 4, h, v, chunk, divergence)
    assert abs(peak - small) <= (n - n // 4) * (3 * h * 4 + 16) + 64 * 1024, (peak, small)


# -- every divergence against its textbook formula, written here in fp64 ------------------------------
def _formula_loss(sh, sw, th, tw, labels, alpha, temperature, divergence, beta):
    """(1 - alpha) CE + alpha T^2 D(p || q), mean over non-ignored tokens, from the definitions:
    p = softmax(teacher / T), q = softmax(student / T), m = beta p + (1 - beta) q."""
    s = sh @ sw.T  # (N, V) student logits
    t = (th @ tw[: sw.shape[0]].T).detach()  # (N, V) teacher logits, padded rows dropped
    keep = labels != IGNORE
    s, t, y = s[keep], t[keep], labels[keep]
    p = torch.exp(t / temperature) / torch.exp(t / temperature).sum(-1, keepdim=True)
    q = torch.exp(s / temperature) / torch.exp(s / temperature).sum(-1, keepdim=True)
    if divergence == "forward_kl":
        d = (p * torch.log(p / q)).sum(-1)
    elif divergence == "reverse_kl":
        d = (q * torch.log(q / p)).sum(-1)
    elif divergence == "jsd":
        m = beta * p + (1 - beta) * q
        d = beta * (p * torch.log(p / m)).sum(-1) + (1 - beta) * (q * torch.log(q / m)).sum(-1)
    elif divergence == "tvd":
        d = 0.5 * (p - q).abs().sum(-1)
    elif divergence == "skew_kl":
        d = (p * torch.log(p / (beta * p + (1 - beta) * q))).sum(-1)
    elif divergence == "skew_reverse_kl":
        d = (q * torch.log(q / (beta * q + (1 - beta) * p))).sum(-1)
    else:
        raise AssertionError(divergence)
    ce = torch.logsumexp(s, -1) - s.gather(1, y[:, None]).squeeze(1)
    return ((1 - alpha) * ce + alpha * temperature**2 * d).mean()


@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_every_divergence_matches_its_formula_in_fp64(divergence):
    sh, sw, th, tw, labels = make_inputs(torch.float64, n=13, h=8, v=37, ht=6, vt=40)
    kw = dict(alpha=0.7, temperature=1.7, divergence=divergence, beta=0.3)
    r = kd_loss(sh, sw, th, tw, labels, chunk_size=5, **kw)
    gh, gw = torch.autograd.grad(r.loss, (sh, sw))
    h, w = sh.detach().clone().requires_grad_(), sw.detach().clone().requires_grad_()
    want = _formula_loss(h, w, th, tw, labels, **kw)
    wh, ww = torch.autograd.grad(want, (h, w))
    assert want.item() > 0.0
    close(r.loss.detach(), want.detach(), 1e-10, f"{divergence} loss")
    close(gh, wh, 1e-9, f"{divergence} d/d student hidden")
    close(gw, ww, 1e-9, f"{divergence} d/d student lm_head")


# A fixed row count (a captured generated step's head): the labelled rows, then row 0 again with its
# label ignored; the sums divided by the count on the device. Same values as the counted form.
@pytest.mark.parametrize(
    "rows", [37, 41, 60]
)  # above the count (37 labelled of 41), the whole batch, beyond it
@pytest.mark.parametrize("divergence", ["forward_kl", "jsd"])
def test_a_fixed_row_count_gives_the_counted_loss_and_gradients(rows, divergence):
    kw = dict(alpha=0.7, temperature=2.0, divergence=divergence, chunk_size=CHUNK)
    counted = make_inputs(torch.float64)
    fixed = tuple(x.detach().clone().requires_grad_(x.requires_grad) for x in counted)
    r = kd_loss(*counted, **kw)
    f = kd_loss(*fixed, rows=rows, **kw)
    assert r.tokens == 37 and f.tokens == rows  # the head's rows, not the count
    r.loss.backward()
    (f.loss * 1.0).backward()
    close(f.loss.detach(), r.loss.detach(), 1e-12, "loss")
    close(f.ce, r.ce, 1e-12, "ce")
    close(f.kd, r.kd, 1e-12, "kd")
    close(fixed[0].grad, counted[0].grad, 1e-12, "grad hidden")
    close(fixed[1].grad, counted[1].grad, 1e-12, "grad weight")


def test_a_fixed_row_count_needs_no_host_count_and_is_zero_on_no_labels(monkeypatch):
    import kdistill.ops.kd_loss as ops

    def no_count(*a, **k):
        raise AssertionError("the fixed-row head counted the labels on the host")

    monkeypatch.setattr(ops, "label_count", no_count)
    sh, sw, th, tw, labels = make_inputs(torch.float32)
    labels[:] = IGNORE
    r = kd_loss(
        sh, sw, th, tw, labels, alpha=1.0, temperature=1.0, divergence="jsd", chunk_size=CHUNK, rows=8
    )
    assert r.loss.item() == 0.0 and float(r.kd) == 0.0 and math.isfinite(float(r.ce))
    r.loss.backward()
    assert float(sh.grad.abs().max()) == 0.0 and float(sw.grad.abs().max()) == 0.0
    with pytest.raises(ValueError, match="rows"):
        kd_loss(sh, sw, th, tw, labels, alpha=1.0, temperature=1.0, divergence="jsd", n_tokens=3, rows=8)
