"""Several teachers: the chunked KD head with `teacher_mixture` against a dense fp64 formula written
here (the weighted mixture of the teachers' tempered distributions, in probability space), values and
gradients w.r.t. the student's hidden states and lm_head.

Run: .venv/bin/python -m pytest tests/test_kd_mixture.py -q
"""

from __future__ import annotations

import pytest
import torch

from kdistill.errors import UserError
from kdistill.ops.kd_loss import kd_loss

N, H, V, CHUNK, IGNORE = 37, 24, 301, 8, -100
TEACHERS = [(16, 310, 0.7), (32, 301, 0.3)]  # (hidden, vocab rows incl. padding, weight)


def inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    sh = torch.randn(N, H, generator=g, dtype=torch.float64).requires_grad_()
    sw = (0.3 * torch.randn(V, H, generator=g, dtype=torch.float64)).requires_grad_()
    teachers = [
        (
            torch.randn(N, ht, generator=g, dtype=torch.float64),
            0.4 * torch.randn(vt, ht, generator=g, dtype=torch.float64),
            w,
        )
        for ht, vt, w in TEACHERS
    ]
    labels = torch.randint(0, V, (N,), generator=g)
    labels[[0, 3, 20]] = IGNORE
    return sh, sw, teachers, labels


def dense(sh, sw, teachers, labels, alpha, temperature, divergence):
    """(1 - alpha) CE + alpha T^2 D(p || q), p = sum_i w_i softmax(t_i / T) / sum_i w_i, dense fp64."""
    s = sh @ sw.T  # (N, V)
    total = sum(w for _, _, w in teachers)
    p = sum(w / total * torch.softmax(th @ tw[:V].T / temperature, -1) for th, tw, w in teachers)
    logq = torch.log_softmax(s / temperature, -1)
    q = logq.exp()
    if divergence == "forward_kl":
        d = (p * (p.log() - logq)).sum(-1)
    elif divergence == "reverse_kl":
        d = (q * (logq - p.log())).sum(-1)
    else:  # jsd, beta = 0.5
        m = 0.5 * p + 0.5 * q
        d = 0.5 * (p * (p.log() - m.log())).sum(-1) + 0.5 * (q * (logq - m.log())).sum(-1)
    valid = labels != IGNORE
    ce = torch.nn.functional.cross_entropy(s[valid], labels[valid], reduction="none")
    rows = (1 - alpha) * ce + alpha * temperature**2 * d[valid]
    return rows.mean()


@pytest.mark.parametrize("divergence", ["forward_kl", "reverse_kl", "jsd"])
@pytest.mark.parametrize("temperature", [1.0, 2.5])
def test_mixture_matches_dense_formula(divergence, temperature):
    sh, sw, teachers, labels = inputs()
    alpha = 0.6
    r = kd_loss(
        sh, sw, None, None, labels, alpha=alpha, temperature=temperature, divergence=divergence,
        chunk_size=CHUNK, teacher_mixture=teachers,
    )  # fmt: skip
    gh, gw = torch.autograd.grad(r.loss, (sh, sw))
    expected = dense(sh, sw, teachers, labels, alpha, temperature, divergence)
    eh, ew = torch.autograd.grad(expected, (sh, sw))
    assert abs(float(r.loss.detach()) - float(expected.detach())) < 1e-10
    assert torch.allclose(gh, eh, atol=1e-11) and torch.allclose(gw, ew, atol=1e-11)
    assert r.tokens == N - 3


def test_one_teacher_of_any_weight_is_the_single_teacher_loss():
    sh, sw, teachers, labels = inputs(1)
    th, tw, _ = teachers[0]
    kw = dict(alpha=0.5, temperature=2.0, divergence="forward_kl", chunk_size=CHUNK)
    single = kd_loss(sh, sw, th, tw, labels, **kw)
    mixed = kd_loss(sh, sw, None, None, labels, teacher_mixture=[(th, tw, 3.0)], **kw)
    assert abs(float(single.loss) - float(mixed.loss)) < 1e-12
    assert abs(float(single.kd) - float(mixed.kd)) < 1e-12


def test_mixture_weights_are_checked():
    sh, sw, teachers, labels = inputs()
    bad = [(teachers[0][0], teachers[0][1], 0.0)]
    with pytest.raises(UserError, match=r"teachers\[0\]\.weight"):
        kd_loss(sh, sw, None, None, labels, alpha=0.5, temperature=1.0, divergence="forward_kl",
                teacher_mixture=bad)  # fmt: skip
    short = [(teachers[0][0], teachers[0][1][: V - 1], 1.0)]
    with pytest.raises(UserError, match="lm_head has"):
        kd_loss(sh, sw, None, None, labels, alpha=0.5, temperature=1.0, divergence="forward_kl",
                teacher_mixture=short)  # fmt: skip
