"""The KD head with precomputed teacher log-probabilities (a teacher cache) instead of the teacher's
hidden states and lm_head: the same losses and gradients as the live teacher, exactly for fp32
log-probs and to bf16 rounding for bf16 ones (the `exact` cache mode), for every divergence, with a
padded teacher vocabulary and ignored tokens, through the reference (fp64) and kdistill.dispatch (fp32).
"""

from __future__ import annotations

import pytest
import torch

from kdistill import dispatch
from kdistill.config import DIVERGENCES
from kdistill.ops import kd_loss as kd_ops

N, HS, HT, V, PAD = 37, 16, 24, 53, 5


def _case(seed=0):
    g = torch.Generator().manual_seed(seed)
    sh = torch.randn(N, HS, generator=g, dtype=torch.float64)
    sw = torch.randn(V, HS, generator=g, dtype=torch.float64) * 0.3
    th = torch.randn(N, HT, generator=g, dtype=torch.float64)
    tw = torch.randn(V + PAD, HT, generator=g, dtype=torch.float64) * 0.3  # padded teacher rows
    labels = torch.randint(0, V, (N,), generator=g)
    labels[::4] = -100
    return sh, sw, th, tw, labels


def _run(fn, sh, sw, labels, divergence, **teacher):
    h, w = sh.clone().requires_grad_(True), sw.clone().requires_grad_(True)
    r = fn(h, w, labels=labels, alpha=0.6, temperature=2.0, divergence=divergence, chunk_size=8, **teacher)
    (r.loss * 1.7).backward()
    return torch.stack([r.loss.detach(), r.ce, r.kd]), h.grad, w.grad


@pytest.mark.parametrize("divergence", DIVERGENCES)
@pytest.mark.parametrize("path", ["reference", "dispatch"])
def test_cached_logprobs_give_the_live_teachers_loss(divergence, path):
    sh, sw, th, tw, labels = _case()
    tol = 1e-10
    if path == "dispatch":  # the dispatcher's keys know fp32, bf16 and fp16
        sh, sw, th, tw = (t.float() for t in (sh, sw, th, tw))
        tol = 1e-5

    def fn(h, w, *, labels, t_hidden=None, t_weight=None, teacher_logprobs=None, **kw):
        if path == "reference":
            return kd_ops.kd_loss(h, w, t_hidden, t_weight, labels, teacher_logprobs=teacher_logprobs, **kw)
        return dispatch.kd_loss(h, w, t_hidden, t_weight, labels, teacher_logprobs=teacher_logprobs, **kw)

    live = _run(fn, sh, sw, labels, divergence, t_hidden=th, t_weight=tw)
    logp = torch.log_softmax(th @ tw.t(), dim=-1)  # (N, V + PAD): as a cache stores them
    exact = _run(fn, sh, sw, labels, divergence, teacher_logprobs=logp)
    for a, b in zip(live, exact):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol)
    rounded = _run(fn, sh, sw, labels, divergence, teacher_logprobs=logp.to(torch.bfloat16))
    for a, b in zip(live, rounded):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)
    assert not torch.equal(live[0], rounded[0])  # the bf16 rows were really used


def test_cached_logprobs_of_the_wrong_shape_are_refused():
    sh, sw, th, tw, labels = _case()
    with pytest.raises(ValueError, match="teacher_logprobs"):
        kd_ops.kd_loss(
            sh, sw, None, None, labels, alpha=0.5, temperature=1.0, divergence="forward_kl",
            teacher_logprobs=torch.zeros(N - 1, V),
        )  # fmt: skip
