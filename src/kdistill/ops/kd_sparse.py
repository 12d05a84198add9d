"""The KD head against sparse cached teacher targets (`topk` and `sampled` teacher caches).

A cache row holds, per token, k teacher token ids, k values and one extra scalar, packed as one
(N, 2k + 1) fp32 tensor `targets` = [ids (as floats, exact below 2^24) | values | extra]:

    topk     values = log p_T(id_j), the teacher's log-probs at the run's temperature T on its top-k
             ids; extra = log(1 - sum_j p_T(id_j)), the log of the remaining mass (-inf if none).
             The divergence is computed between the (k + 1)-bucket distributions
                 P = (p_T(id_1), ..., p_T(id_k), rest_p),  Q = (q_T(id_1), ..., q_T(id_k), rest_q)
             with rest_q = 1 - sum_j q_T(id_j) (a logsumexp over the student's other logits). This is
             an approximation of D(p_T || q_T): exact when the top-k hold all the mass; otherwise the
             student's distribution inside the remainder is left free (biased, never unbiased).
    sampled  values = w_j, importance weights (1/k for k i.i.d. draws from p_T); extra unused (0).
             Only forward KL: KD_i = T^2 * sum_j w_j (log p_T(id_j) - log q_T(id_j)) needs log p_T,
             so `values` are w_j and the log-probs follow in a second block: targets is then
             (N, 3k + 1) = [ids | w | log p_T(ids) | 0]. E[sum_j w_j f(id_j)] = sum_v p_T(v) f(v) for
             any f, so the loss is an unbiased estimate of T^2 KL(p_T || q_T) and its gradient
             dKD/ds = T (q_T - sum_j w_j onehot(id_j)) an unbiased estimate of T (q_T - p_T).

The chunk loop, memory bound and autograd Function are those of kdistill.ops.kd_loss (no [N x V]
tensor); only the per-chunk function differs: the divergence on the sparse support, differentiated
by autograd inside the chunk.
"""

from __future__ import annotations

import math

import torch

from kdistill.errors import UserError
from kdistill.ops.kd_loss import KDLossResult, _chunk_loop, _ChunkedKDLoss

SPARSE_MODES = ("topk", "sampled")


def _bucket_divergence(logp: torch.Tensor, logq: torch.Tensor, divergence: str, beta: float) -> torch.Tensor:
    """D(P || Q) per row for (c, K) log-probability rows (the topk buckets), differentiable in logq."""
    p, q = logp.exp(), logq.exp()

    def xlogy_ratio(a: torch.Tensor, loga: torch.Tensor, logb: torch.Tensor) -> torch.Tensor:
        return torch.where(a > 0, a * (loga - logb), torch.zeros_like(a)).sum(-1)

    if divergence == "forward_kl":
        return xlogy_ratio(p, logp, logq)
    if divergence == "reverse_kl":
        return xlogy_ratio(q, logq, logp)
    if divergence == "jsd":
        logm = torch.logaddexp(logp + math.log(beta), logq + math.log(1 - beta))
        return beta * xlogy_ratio(p, logp, logm) + (1 - beta) * xlogy_ratio(q, logq, logm)
    if divergence == "tvd":
        return 0.5 * (p - q).abs().sum(-1)
    if divergence == "skew_kl":
        logr = torch.logaddexp(logp + math.log(beta), logq + math.log(1 - beta))
        return xlogy_ratio(p, logp, logr)
    if divergence == "skew_reverse_kl":
        logr = torch.logaddexp(logq + math.log(beta), logp + math.log(1 - beta))
        return xlogy_ratio(q, logq, logr)
    raise UserError(f"kd.divergence is '{divergence}', expected a known divergence")


def sparse_chunk(
    s_logits: torch.Tensor,
    targets: torch.Tensor | None,
    labels: torch.Tensor,
    *,
    alpha: float,
    temperature: float,
    divergence: str,
    mode: str,
    k: int,
    beta: float = 0.5,
    ignore_index: int = -100,
    grad_scale: float = 1.0,
    need_grad: bool = True,
    grad_dtype: torch.dtype | None = None,
):
    """Loss sums and dL/ds of one chunk (the contract of chunk_divergence_reference) against sparse
    targets (c, 2k + 1) or (c, 3k + 1) fp32 (see the module docstring)."""
    cdt = torch.float64 if s_logits.dtype == torch.float64 else torch.float32
    valid = labels != ignore_index
    vf = valid.to(cdt)
    safe = torch.where(valid, labels, torch.zeros_like(labels)).unsqueeze(1)
    with torch.enable_grad():
        s = s_logits.detach().to(cdt).requires_grad_(need_grad)  # (c, V)
        ce_rows = (torch.logsumexp(s, -1) - s.gather(1, safe).squeeze(1)) * vf
        kd_rows = torch.zeros_like(ce_rows)
        if alpha > 0:
            t = targets.to(cdt)
            ids = t[:, :k].long()  # (c, k)
            a = s / temperature
            lse = torch.logsumexp(a, -1, keepdim=True)
            logq_ids = a.gather(1, ids) - lse  # (c, k)
            if mode == "topk":
                logp = torch.cat([t[:, k : 2 * k], t[:, 2 * k :]], dim=1)  # (c, k + 1)
                rest = a.scatter(1, ids, float("-inf"))
                logq_rest = torch.logsumexp(rest, -1, keepdim=True) - lse
                logq = torch.cat([logq_ids, logq_rest], dim=1)
                d = _bucket_divergence(logp, logq, divergence, beta)
            else:  # sampled: importance-weighted forward KL
                w, logp_ids = t[:, k : 2 * k], t[:, 2 * k : 3 * k]
                d = (w * (logp_ids - logq_ids)).sum(-1)
            kd_rows = temperature**2 * d * vf
        loss_rows = (1 - alpha) * ce_rows + alpha * kd_rows
        grad = None
        if need_grad:
            (grad,) = torch.autograd.grad(loss_rows.sum() * grad_scale, s)
            if grad_dtype is not None:
                grad = grad.to(grad_dtype)
    return loss_rows.sum().detach(), ce_rows.sum().detach(), kd_rows.sum().detach(), grad


def kd_loss_sparse(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    targets: torch.Tensor,
    labels: torch.Tensor,
    *,
    mode: str,
    k: int,
    alpha: float,
    temperature: float,
    divergence: str,
    beta: float = 0.5,
    ignore_index: int = -100,
    chunk_size: int = 1024,
) -> KDLossResult:
    """(1 - alpha) CE + alpha KD against sparse teacher targets, chunked through the student lm_head.

    Args:
        student_hidden: (N, Hs); student_weight: (V, Hs); labels: (N,) int64.
        targets: (N, 2k + 1) for mode "topk", (N, 3k + 1) for "sampled" (see the module docstring).
        mode, k: the cache's mode and k. The other arguments as kdistill.ops.kd_loss.kd_loss.

    Returns:
        KDLossResult(loss, ce, kd, tokens), differentiable w.r.t. student_hidden and student_weight.
    """
    if mode not in SPARSE_MODES:
        raise ValueError(f"kd_loss_sparse: mode {mode!r}, expected one of {SPARSE_MODES}")
    if mode == "sampled" and alpha > 0 and divergence != "forward_kl":
        raise UserError(
            f"kd.divergence is '{divergence}' but a sampled teacher cache is an unbiased estimate of "
            "forward_kl only (use kd.divergence=forward_kl, or a topk or exact cache)"
        )
    width = (2 if mode == "topk" else 3) * k + 1
    if targets.dim() != 2 or targets.shape != (student_hidden.shape[0], width):
        raise ValueError(
            f"kd_loss_sparse: targets {tuple(targets.shape)}, expected ({student_hidden.shape[0]}, {width})"
        )
    valid = labels != ignore_index
    n_tokens = int(valid.sum())
    th = targets.detach().float() if targets.dtype != torch.float64 else targets.detach()
    if 0 < n_tokens < labels.shape[0]:
        rows = valid.nonzero().squeeze(1)
        student_hidden, labels, th = (t.index_select(0, rows) for t in (student_hidden, labels, th))
    h = (
        student_hidden
        if student_hidden.dtype == student_weight.dtype
        else student_hidden.to(student_weight.dtype)
    )
    opts = dict(
        alpha=alpha, temperature=temperature, divergence=divergence, beta=beta, ignore_index=ignore_index,
        mode=mode, k=k,
    )  # fmt: skip
    if torch.is_grad_enabled() and (h.requires_grad or student_weight.requires_grad):
        loss, ce, kd = _ChunkedKDLoss.apply(
            h, student_weight, th, None, labels, n_tokens, opts, chunk_size, sparse_chunk
        )
    elif n_tokens == 0:
        loss = torch.zeros((), dtype=torch.promote_types(h.dtype, torch.float32), device=h.device)
        ce, kd = loss.clone(), loss.clone()
    else:
        loss, ce, kd, _, _ = _chunk_loop(
            h.detach(), student_weight.detach(), th, None, labels, n_tokens, opts, chunk_size, sparse_chunk,
            False, False,
        )  # fmt: skip
    return KDLossResult(loss, ce.detach(), kd.detach(), n_tokens)
