"""The sampled reverse KL: a policy-gradient loss on the student's own samples, graded token by token.

For N sampled tokens y_i (labels, (N,) int64; `ignore_index` marks prompt and padding positions), the
student's log-prob of each at temperature T, log q_i = log softmax(s_i / T)[y_i], and the teacher's,
log p_i = log softmax(t_i / T)[y_i] (for several teachers log sum_j w_j softmax(t_ij / T)[y_i])::

    A_i    = log q_i - log p_i            the per-token reverse KL of the sampled token (no gradient)
    loss   = sum_i A_i log q_i / n        n = tokens whose label is not ignore_index
    kd     = sum_i A_i / n                a one-sample estimate of KL(q_T || p_T) per token

Since the y_i are drawn from q_T, E[A_i d log q_i] = d KL(q_T || p_T) (the score-function identity:
E_q[d log q] = 0, so the KL's own d log q term vanishes), so the loss's gradient is an unbiased
estimate of the reverse KL's: the advantage of a REINFORCE update with reward log p - log q, as the
on-policy recipes of recent reasoning models use. Only the teacher's log-prob of the sampled token is
needed. `ce` is the student's CE on its samples at T = 1 (reported, not trained).

Chunked like kdistill.ops.kd_loss: per chunk of `chunk_size` rows the (c, V) logits are computed and
dropped, the student's chunk recomputed in backward (activation checkpointing), so no (N, V) tensor
is held. The teacher's rows past the student's vocabulary are padding and ignored.
"""

from __future__ import annotations

import math

import torch
from torch.utils.checkpoint import checkpoint

from kdistill.ops.kd_loss import KDLossResult


def _teacher_logp(
    t_hidden: torch.Tensor | None,
    t_weight: torch.Tensor | None,
    mixture: list[tuple[torch.Tensor, torch.Tensor, float]] | None,
    lo: int,
    hi: int,
    y: torch.Tensor,
    vocab: int,
    temperature: float,
) -> torch.Tensor:
    """log p_T(y) of rows lo:hi (c,) fp32, from one teacher or a mixture in probability space."""
    parts = mixture if mixture is not None else [(t_hidden, t_weight, 1.0)]
    out = None
    for h, w, weight in parts:
        assert h is not None and w is not None
        logits = (h[lo:hi] @ w[:vocab].t()).float() / temperature  # (c, V)
        lp = logits.log_softmax(-1).gather(1, y[:, None]).squeeze(1) + math.log(weight)
        out = lp if out is None else torch.logaddexp(out, lp)
    assert out is not None
    return out


def _chunk(
    h: torch.Tensor,
    w: torch.Tensor,
    y: torch.Tensor,
    t_logp: torch.Tensor,
    valid: torch.Tensor,
    temperature: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sum A log q, sum A, sum CE) over a chunk's valid rows; only the first carries a gradient."""
    logits = (h @ w.t()).float()  # (c, V)
    logq = (logits / temperature).log_softmax(-1).gather(1, y[:, None]).squeeze(1)  # (c,)
    adv = (logq.detach() - t_logp) * valid
    ce = -(logits.detach().log_softmax(-1).gather(1, y[:, None]).squeeze(1)) * valid
    return (adv * logq).sum(), adv.sum(), ce.sum()


def sampled_reverse_kl(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_hidden: torch.Tensor | None,
    teacher_weight: torch.Tensor | None,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    ignore_index: int = -100,
    chunk_size: int = 1024,
    teacher_mixture: list[tuple[torch.Tensor, torch.Tensor, float]] | None = None,
    n_tokens: int | None = None,
) -> KDLossResult:
    """The policy-gradient reverse-KL loss on sampled tokens (see the module docstring).

    Args:
        student_hidden: (N, Hs); student_weight: (V, Hs); labels: (N,) the sampled tokens.
        teacher_hidden: (N, Ht), teacher_weight: (Vt >= V, Ht); or teacher_mixture
            [(hidden (N, Ht_i), lm_head (Vt_i, Ht_i), weight), ...] with weights summing to 1.
        n_tokens: the labels' count from their host copy (None: counted here).

    Returns:
        KDLossResult(loss, ce, kd, tokens): loss differentiable w.r.t. the student's operands.
    """
    if teacher_mixture is None and (teacher_hidden is None or teacher_weight is None):
        raise ValueError("sampled_reverse_kl needs the teacher's hidden states and lm_head, or a mixture")
    vocab = student_weight.shape[0]
    valid_all = labels != ignore_index
    n = int(valid_all.sum()) if n_tokens is None else int(n_tokens)
    y_all = labels.clamp(min=0)
    loss = torch.zeros((), dtype=torch.float32, device=student_hidden.device)
    kd = torch.zeros((), dtype=torch.float32, device=student_hidden.device)
    ce = torch.zeros((), dtype=torch.float32, device=student_hidden.device)
    for lo in range(0, labels.shape[0], chunk_size):
        hi = min(lo + chunk_size, labels.shape[0])
        y, valid = y_all[lo:hi], valid_all[lo:hi].float()
        with torch.no_grad():
            t_logp = _teacher_logp(
                teacher_hidden, teacher_weight, teacher_mixture, lo, hi, y, vocab, temperature
            )
        part, adv, part_ce = checkpoint(
            _chunk, student_hidden[lo:hi], student_weight, y, t_logp, valid, temperature, use_reentrant=False
        )
        loss, kd, ce = loss + part, kd + adv.detach(), ce + part_ce.detach()
    denom = max(n, 1)
    return KDLossResult(loss / denom, ce / denom, kd / denom, n)
