"""The KD head against sparse cached teacher targets (kdistill.ops.kd_sparse): `topk` equals the
divergence between the (k + 1)-bucket distributions written densely here (values and gradients, every
divergence), is exact when the top-k hold the whole vocabulary's mass, and `sampled` is an unbiased
estimate of the forward-KL gradient: the mean of many independent draws of the sampled gradient
matches the exact gradient within a tolerance derived from the number of draws.
"""

from __future__ import annotations

import math

import pytest
import torch

from kdistill.config import DIVERGENCES
from kdistill.ops import kd_loss as kd_ops
from kdistill.ops.kd_sparse import kd_loss_sparse

N, H, V, K, T = 13, 8, 11, 4, 2.0


def _case(seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, H, generator=g, dtype=torch.float64)
    w = torch.randn(V, H, generator=g, dtype=torch.float64) * 0.5
    t_logits = torch.randn(N, V, generator=g, dtype=torch.float64) * 2
    labels = torch.randint(0, V, (N,), generator=g)
    labels[::5] = -100
    return h, w, t_logits, labels


def _topk_targets(t_logits, k):
    logp = torch.log_softmax(t_logits / T, -1)
    vals, ids = logp.topk(k, -1)
    rest = torch.logsumexp(logp.scatter(1, ids, float("-inf")), -1, keepdim=True)
    return torch.cat([ids.double(), vals, rest], 1), ids, vals, rest


def _dense_bucket(h, w, ids, vals, rest, labels, divergence, alpha, beta=0.5):
    s = h @ w.t()
    logq = torch.log_softmax(s / T, -1)
    q_ids = logq.gather(1, ids).exp()
    bq = torch.cat([q_ids, (1 - q_ids.sum(1, keepdim=True))], 1)  # (N, k + 1) buckets of the student
    bp = torch.cat([vals.exp(), rest.exp()], 1)
    lp, lq = bp.log(), bq.log()
    if divergence == "forward_kl":
        d = (bp * (lp - lq)).sum(-1)
    elif divergence == "reverse_kl":
        d = (bq * (lq - lp)).sum(-1)
    elif divergence == "jsd":
        m = beta * bp + (1 - beta) * bq
        d = beta * (bp * (lp - m.log())).sum(-1) + (1 - beta) * (bq * (lq - m.log())).sum(-1)
    elif divergence == "tvd":
        d = 0.5 * (bp - bq).abs().sum(-1)
    elif divergence == "skew_kl":
        d = (bp * (lp - (beta * bp + (1 - beta) * bq).log())).sum(-1)
    else:
        d = (bq * (lq - (beta * bq + (1 - beta) * bp).log())).sum(-1)
    ce = torch.nn.functional.cross_entropy(s, labels, reduction="none", ignore_index=-100)
    valid = (labels != -100).double()
    return ((1 - alpha) * ce + alpha * T**2 * d * valid).sum() / valid.sum()


@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_topk_equals_the_bucket_divergence(divergence):
    h, w, t_logits, labels = _case()
    targets, ids, vals, rest = _topk_targets(t_logits, K)
    h1, w1 = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    r = kd_loss_sparse(h1, w1, targets, labels, mode="topk", k=K, alpha=0.6, temperature=T,
                       divergence=divergence, chunk_size=5)  # fmt: skip
    (r.loss * 1.3).backward()
    h2, w2 = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    dense = _dense_bucket(h2, w2, ids, vals, rest, labels, divergence, alpha=0.6)
    (dense * 1.3).backward()
    torch.testing.assert_close(r.loss, dense, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(h1.grad, h2.grad, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(w1.grad, w2.grad, atol=1e-10, rtol=1e-10)


def test_topk_with_the_whole_vocabulary_is_exact():
    h, w, t_logits, labels = _case(1)
    targets, *_ = _topk_targets(t_logits, V - 1)  # the remainder bucket holds the last token exactly
    r = kd_loss_sparse(h, w, targets, labels, mode="topk", k=V - 1, alpha=0.5, temperature=T,
                       divergence="forward_kl", chunk_size=4)  # fmt: skip
    live = kd_ops.kd_loss(h, w, None, None, labels, alpha=0.5, temperature=T, divergence="forward_kl",
                          teacher_logprobs=torch.log_softmax(t_logits, -1), chunk_size=4)  # fmt: skip
    torch.testing.assert_close(r.loss, live.loss, atol=1e-10, rtol=1e-10)


def test_sampled_gradient_is_unbiased():
    """M independent draws of k tokens per row: the mean sampled gradient of the student logits vs the
    exact T (q - p) / n. Per logit the sampled part is T/n * (p_v - mean of M*k one-hot draws), whose
    standard deviation is T/n * sqrt(p_v (1 - p_v) / (M k)); the tolerance is 5 of them (+1e-12)."""
    g = torch.Generator().manual_seed(7)
    n, m, k = 6, 4000, 3
    s = torch.randn(n, V, generator=g, dtype=torch.float64)
    t_logits = torch.randn(n, V, generator=g, dtype=torch.float64) * 1.5
    labels = torch.randint(0, V, (n,), generator=g)
    eye = torch.eye(V, dtype=torch.float64)  # W = I: the gradient of the hidden states is that of the logits

    logp_t = torch.log_softmax(t_logits / T, -1)
    exact_h = s.clone().requires_grad_(True)
    kd_ops.kd_loss(exact_h, eye, None, None, labels, alpha=1.0, temperature=T, divergence="forward_kl",
                   teacher_logprobs=torch.log_softmax(t_logits, -1), chunk_size=64).loss.backward()  # fmt: skip

    ids = torch.multinomial(logp_t.exp().repeat(m, 1), k, replacement=True, generator=g)  # (m n, k)
    rep = logp_t.repeat(m, 1)
    targets = torch.cat([ids.double(), torch.full((m * n, k), 1.0 / k, dtype=torch.float64),
                         rep.gather(1, ids), torch.zeros(m * n, 1, dtype=torch.float64)], 1)  # fmt: skip
    hs = s.repeat(m, 1).requires_grad_(True)
    r = kd_loss_sparse(hs, eye, targets, labels.repeat(m), mode="sampled", k=k, alpha=1.0, temperature=T,
                       divergence="forward_kl", chunk_size=4096)  # fmt: skip
    r.loss.backward()
    mean_grad = hs.grad.reshape(m, n, V).sum(0)  # each copy carries 1 / (m n): their sum is the mean draw
    p = logp_t.exp()
    sigma = T / n * torch.sqrt(p * (1 - p) / (m * k))
    err = (mean_grad - exact_h.grad).abs()
    assert bool((err <= 5 * sigma + 1e-12).all()), float((err / (sigma + 1e-30)).max())
    # and the loss is an unbiased estimate of T^2 KL too (same reasoning, looser: a scalar over n rows)
    exact_kl = (T**2 * (p * (logp_t - torch.log_softmax(s / T, -1))).sum(-1)).mean()
    assert math.isclose(float(r.kd), float(exact_kl), rel_tol=0.05)


def test_sampled_refuses_other_divergences():
    from kdistill.errors import UserError

    h, w, t_logits, labels = _case()
    targets = torch.zeros(N, 3 * K + 1, dtype=torch.float64)
    with pytest.raises(UserError, match="forward_kl"):
        kd_loss_sparse(h, w, targets, labels, mode="sampled", k=K, alpha=0.5, temperature=T, divergence="jsd")
