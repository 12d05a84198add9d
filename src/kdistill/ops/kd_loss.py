"""The KD loss head: lm_head + divergence to the teacher + cross-entropy, chunked over tokens.

Loss
----
For N tokens with student hidden states h (N, Hs), student lm_head W (V, Hs), teacher hidden states
h_t (N, Ht), teacher lm_head W_t (Vt, Ht) with Vt >= V (rows past V are vocabulary padding and are
ignored: W_t[:V]) and labels y (N,) int64::

    s = h W^T (student logits),  t = h_t W_t[:V]^T (teacher logits)     both (N, V), fp32 accumulation
    q = softmax(s / T)  (student),  p = softmax(t / T)  (teacher)           "temperature T"
    CE_i = logsumexp(s_i) - s_i[y_i]                                         (temperature 1)
    KD_i = T^2 * D(p_i || q_i)
    loss = sum_{i: y_i != ignore_index} [(1 - alpha) * CE_i + alpha * KD_i] / n_tokens

`n_tokens` counts the tokens whose label is not `ignore_index`; with none, loss = 0 and every
gradient is 0 (never NaN). `KDLossResult.ce` and `.kd` are the means of CE_i and KD_i (KD includes
the T^2), so loss = (1 - alpha) * ce + alpha * kd. With alpha == 0 the teacher may be None and no
teacher GEMM or softmax runs.

Divergences (all on the temperature-scaled distributions, beta in (0, 1))::

    forward_kl       D = KL(p || q)            = sum p (log p - log q)
    reverse_kl       D = KL(q || p)            = sum q (log q - log p)
    jsd              D = beta KL(p || m) + (1 - beta) KL(q || m),  m = beta p + (1 - beta) q
                     (the generalized JSD of GKD / TRL: beta weighs the teacher; beta = 0.5 is the
                     symmetric Jensen-Shannon divergence, bounded by log 2)
    tvd              D = 1/2 sum |p - q|
    skew_kl          D = KL(p || r),  r = beta p + (1 - beta) q           (DistiLLM's skew KL)
    skew_reverse_kl  D = KL(q || r'), r' = beta q + (1 - beta) p          (DistiLLM's skew reverse KL)

Closed-form gradients w.r.t. the student logits
-----------------------------------------------
Per row, write a = s / T and g = dD/dq. Since q = softmax(a), dq_k/da_j = q_k (delta_kj - q_j), so
for any D(q)::

    dD/da_j = q_j (g_j - <q, g>)             with <q, g> = sum_k q_k g_k

and dKD/ds = T^2 * (1/T) * dD/da = T * dD/da. Working each divergence out (log m, log r are computed
as logaddexp of log-probabilities so that nothing underflows to log 0):

    forward_kl       g = -p / q                          dD/da = q - p
    reverse_kl       g = log q - log p + 1               dD/da = q (log q - log p - D)
    jsd              g = (1 - beta)(log q - log m)       dD/da = (1 - beta) q (log(q/m) - KL(q || m))
                     (the terms from dm/dq cancel: beta p/m + (1 - beta) q/m = 1)
    tvd              g = 1/2 sign(q - p)                 dD/da = 1/2 q (sign(q - p) - <q, sign(q - p)>)
                     (subgradient sign(0) = 0, as torch.abs's backward)
    skew_kl          g = -(1 - beta) p / r               dD/da = -(1 - beta) q (p/r - <q, p/r>)
    skew_reverse_kl  g = log(q/r') + 1 - beta q/r'       dD/da = q (log(q/r') - D - beta (q/r' - <q, q/r'>))

and dCE/ds = softmax(s) - onehot(y). The gradient of the summed loss w.r.t. one row of logits is
therefore::

    dL/ds_i = [(1 - alpha)(softmax(s_i) - onehot(y_i)) + alpha T dD/da_i] / n_tokens   (0 if ignored)

Every quantity needs only per-row statistics (logsumexp of s, s/T, t/T) and, for jsd, tvd and the
skew divergences, one more per-row sum (<q, g> and D) that needs the normalised probabilities.

Several teachers (a mixture in probability space)
--------------------------------------------------
With `teacher_mixture=[(h_1, W_1, w_1), ...]` the target is the weighted mixture of the teachers'
distributions, each softened at T first (weights normalised to sum to 1)::

    p = sum_i w_i softmax(t_i / T),    t_i = h_i W_i[:V]^T
    KD_i = T^2 * D(p || q),            q = softmax(s / T)     (the same T^2 as one teacher)

Per chunk the mixture is handed to the chunk function as teacher logits t = T log p (so that
softmax(t / T) = p exactly), computed teacher by teacher with a running logaddexp: a few (c, V)
buffers, never an (N, V) tensor. One teacher of weight 1 gives exactly the single-teacher loss.

Chunking (no [N x V] tensor)
----------------------------
`kd_loss` walks the tokens in chunks of `chunk_size` rows. Per chunk it computes the (c, V) logits
with a GEMM (fp32 accumulation, upcast to fp32), calls `chunk_fn` (default
`chunk_divergence_reference`; kdistill.dispatch.kd_loss passes one that runs the Triton kernel
`kdistill.kernels.kd_loss.kd_loss_chunk_triton`, which has the same signature) for the loss sums and dL/ds of the chunk, and at once turns that into
grad_h[chunk] = dL/ds @ W and grad_W += dL/ds^T @ h[chunk]. The chunk's logits are then dropped.
The autograd Function keeps only grad_h (N, Hs) and grad_W (V, Hs) (the idea of Liger-Kernel's fused
linear cross entropy); its backward scales them by grad_output. Peak extra memory is a few
(chunk_size, V) fp32 tensors plus grad_h and grad_W, instead of several (N, V) ones. grad_W is
accumulated in fp32 also for bf16/fp16 weights (on CUDA by cuBLAS straight into the fp32 buffer),
then cast to the weight's dtype in backward: V * Hs * 4 bytes (545 MB for Qwen2.5-0.5B's lm_head).
On CUDA with bf16/fp16 weights the logits GEMMs write fp32 directly (torch.mm(..., out_dtype=fp32)),
and the chunk's gradient is produced in the weight's dtype for the two backward GEMMs.

Example::

    >>> h, W = torch.randn(6, 8, requires_grad=True), torch.randn(11, 8, requires_grad=True)
    >>> ht, Wt = torch.randn(6, 4), torch.randn(13, 4)          # teacher vocab padded to 13 rows
    >>> y = torch.tensor([1, 2, -100, 4, 5, 6])
    >>> r = kd_loss(h, W, ht, Wt, y, alpha=0.5, temperature=2.0, divergence="forward_kl", chunk_size=4)
    >>> r.loss.backward(); r.tokens
    5
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from kdistill.config import DIVERGENCES
from kdistill.errors import UserError

# The divergence id the Triton kernel specializes on (a constexpr); order is part of the kernel key.
DIVERGENCE_IDS = {name: i for i, name in enumerate(DIVERGENCES)}
# The held-out eval's KL and CE (train/step.py heldout_eval, scoring.py evaluate) are at this temperature; the
# kernel plan names the KD head's variant for it (kernels/plan.py kd_kernels).
HELDOUT_TEMPERATURE = 1.0


class KDLossResult(NamedTuple):
    """loss: scalar with grad; ce, kd: detached means (kd includes T^2); tokens: non-ignored count."""

    loss: torch.Tensor
    ce: torch.Tensor
    kd: torch.Tensor
    tokens: int


ChunkFn = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None"]]


# ---------------------------------------------------------------------------------------------
# Dense oracle: the formulas written directly, differentiated by autograd. Tests only.
# ---------------------------------------------------------------------------------------------


def kd_loss_dense(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor | None,
    labels: torch.Tensor,
    *,
    alpha: float,
    temperature: float,
    divergence: str,
    beta: float = 0.5,
    ignore_index: int = -100,
) -> KDLossResult:
    """The loss on full (N, V) logits, in fp64, by the textbook formulas; autograd gives gradients.

    student_logits (N, V), teacher_logits (N, Vt >= V) or None when alpha == 0, labels (N,).
    Materialises several (N, V) tensors: the test oracle, not for training.
    """
    s = student_logits.double()
    valid = labels != ignore_index
    n = int(valid.sum())
    log_s1 = torch.log_softmax(s, dim=-1)
    ce_rows = -log_s1.gather(1, labels.clamp(min=0).unsqueeze(1)).squeeze(1)
    kd_rows = torch.zeros_like(ce_rows)
    if alpha > 0:
        t = teacher_logits[:, : s.shape[1]].double()
        logq = torch.log_softmax(s / temperature, dim=-1)
        logp = torch.log_softmax(t / temperature, dim=-1)
        q, p = logq.exp(), logp.exp()
        if divergence == "forward_kl":
            d = (p * (logp - logq)).sum(-1)
        elif divergence == "reverse_kl":
            d = (q * (logq - logp)).sum(-1)
        elif divergence == "jsd":
            m = beta * p + (1 - beta) * q
            d = beta * (p * (logp - m.log())).sum(-1) + (1 - beta) * (q * (logq - m.log())).sum(-1)
        elif divergence == "tvd":
            d = 0.5 * (p - q).abs().sum(-1)
        elif divergence == "skew_kl":
            d = (p * (logp - (beta * p + (1 - beta) * q).log())).sum(-1)
        elif divergence == "skew_reverse_kl":
            d = (q * (logq - (beta * q + (1 - beta) * p).log())).sum(-1)
        else:
            raise UserError(f"kd.divergence is '{divergence}', expected one of: {', '.join(DIVERGENCES)}")
        kd_rows = temperature**2 * d
    vf = valid.double()
    denom = max(n, 1)
    ce = (ce_rows * vf).sum() / denom
    kd = (kd_rows * vf).sum() / denom
    loss = (1 - alpha) * ce + alpha * kd
    return KDLossResult(loss, ce.detach(), kd.detach(), n)


# ---------------------------------------------------------------------------------------------
# One chunk: loss sums and the closed-form gradient w.r.t. the student logits.
# ---------------------------------------------------------------------------------------------


def _rowdot(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """sum_j x_ij y_ij per row, (c, V) x (c, V) -> (c,), without a (c, V) product temporary."""
    return torch.einsum("ij,ij->i", x, y)


def _log_mix(x: torch.Tensor, log_wx: float, y: torch.Tensor, log_wy: float) -> torch.Tensor:
    """log(wx e^x + wy e^y), stable: the log of the mixtures m, r, r'."""
    return torch.logaddexp(x + log_wx, y + log_wy)


def divergence_rows(
    logp: torch.Tensor, logq: torch.Tensor, divergence: str, beta: float, need_grad: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-row D(p || q) (c,) and dD/da (c, V) from teacher/student log-probabilities (c, V).

    a = student logits / T; see the module docstring for the formulas. Inputs are not modified;
    temporaries are freed as soon as possible (this is the CPU training path too).
    """
    lb, l1b = math.log(beta), math.log1p(-beta)
    grad = None
    if divergence == "forward_kl":
        p = logp.exp()
        d = _rowdot(p, logp - logq)
        if need_grad:
            grad = logq.exp().sub_(p)  # q - p
    elif divergence == "reverse_kl":
        q = logq.exp()
        diff = logq - logp
        d = _rowdot(q, diff)
        if need_grad:
            grad = diff.sub_(d[:, None]).mul_(q)  # q (log q - log p - D)
    elif divergence == "jsd":
        logm = _log_mix(logp, lb, logq, l1b)
        kl_pm = _rowdot(logp.exp(), logp - logm)
        q = logq.exp()
        diff = logq.sub(logm)  # log(q / m)
        del logm
        kl_qm = _rowdot(q, diff)
        d = beta * kl_pm + (1 - beta) * kl_qm
        if need_grad:
            grad = diff.sub_(kl_qm[:, None]).mul_(q).mul_(1 - beta)  # (1-b) q (log(q/m) - KL(q||m))
    elif divergence == "tvd":
        q = logq.exp()
        diff = q - logp.exp()  # q - p
        d = 0.5 * diff.abs().sum(-1)
        if need_grad:
            sgn = diff.sign_()
            grad = sgn.sub_(_rowdot(q, sgn)[:, None]).mul_(q).mul_(0.5)  # q/2 (sgn - <q, sgn>)
    elif divergence == "skew_kl":
        logr = _log_mix(logp, lb, logq, l1b)
        d = _rowdot(logp.exp(), logp - logr)
        if need_grad:
            q = logq.exp()
            ratio = logp.sub(logr).exp_()  # p / r <= 1 / beta
            grad = ratio.sub_(_rowdot(q, ratio)[:, None]).mul_(q).mul_(-(1 - beta))
    elif divergence == "skew_reverse_kl":
        q = logq.exp()
        diff = logq.sub(_log_mix(logq, lb, logp, l1b))  # log(q / r')
        d = _rowdot(q, diff)
        if need_grad:
            ratio = diff.exp()  # q / r' <= 1 / beta
            c = _rowdot(q, ratio)
            # q (log(q/r') - D - beta (q/r' - <q, q/r'>))
            grad = diff.sub_(d[:, None]).sub_(ratio.sub_(c[:, None]).mul_(beta)).mul_(q)
    else:
        raise UserError(f"kd.divergence is '{divergence}', expected one of: {', '.join(DIVERGENCES)}")
    return d, grad


def chunk_divergence_reference(
    s_logits: torch.Tensor,
    t_logits: torch.Tensor | None,
    labels: torch.Tensor,
    *,
    alpha: float,
    temperature: float,
    divergence: str,
    beta: float = 0.5,
    ignore_index: int = -100,
    grad_scale: float = 1.0,
    need_grad: bool = True,
    grad_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Loss sums and gradient of one chunk of rows, in torch ops (fp32, or fp64 for fp64 input).

    Args:
        s_logits: (c, V) student logits (any float dtype). t_logits: (c, V) teacher logits, or None
            (then no KD term: alpha must be 0). labels: (c,) int64. Both logits tensors are consumed:
            they may be overwritten (as the Triton launcher does), so pass copies to keep them.
        grad_scale: multiplies the returned gradient (the loop passes 1 / n_tokens).
        need_grad: False skips the gradient (returns None). grad_dtype: dtype of the gradient
            (default: the compute dtype).

    Returns:
        (loss_sum, ce_sum, kd_sum, grad_logits): 0-dim sums over non-ignored rows of
        (1 - alpha) CE_i + alpha KD_i, CE_i and KD_i (= T^2 D_i); grad_logits (c, V) =
        grad_scale * d loss_sum / d s_logits, zero on ignored rows. The Triton launcher
        `kd_loss_chunk_triton` has this exact signature and contract.
    """
    cdt = torch.float64 if s_logits.dtype == torch.float64 else torch.float32
    s = s_logits.to(cdt)  # (c, V), no copy when already fp32
    valid = labels != ignore_index
    vf = valid.to(cdt)  # (c,)
    safe = torch.where(valid, labels, torch.zeros_like(labels)).unsqueeze(1)  # (c, 1)
    lse = torch.logsumexp(s, dim=-1)  # (c,)
    ce_rows = (lse - s.gather(1, safe).squeeze(1)) * vf
    grad = None
    if need_grad:  # the CE part first, while s still holds the logits
        grad = (s - lse[:, None]).exp_().scatter_add_(1, safe, torch.full_like(s[:, :1], -1.0))
        grad.mul_(1 - alpha)  # (1 - alpha)(softmax(s) - onehot(y))
    kd_rows = torch.zeros_like(ce_rows)
    if alpha > 0:
        if t_logits is None:
            raise ValueError("chunk_divergence_reference: alpha > 0 needs teacher logits")
        logq = s.div_(temperature)  # s is consumed from here on
        logq -= torch.logsumexp(logq, dim=-1, keepdim=True)
        logp = t_logits.to(cdt).div_(temperature)
        logp -= torch.logsumexp(logp, dim=-1, keepdim=True)
        del s
        d, dd = divergence_rows(logp, logq, divergence, beta, need_grad)
        del logq, logp
        kd_rows = temperature**2 * d * vf
        if need_grad:
            grad.add_(dd, alpha=alpha * temperature)
            del dd
    loss_rows = (1 - alpha) * ce_rows + alpha * kd_rows
    if need_grad:
        grad.mul_((vf * grad_scale)[:, None])
        if grad_dtype is not None:
            grad = grad.to(grad_dtype)
    return loss_rows.sum(), ce_rows.sum(), kd_rows.sum(), grad


# ---------------------------------------------------------------------------------------------
# The chunk loop and its autograd Function.
# ---------------------------------------------------------------------------------------------

# torch.mm / torch.addmm with out_dtype=fp32 for bf16/fp16 inputs (CUDA only); switched off on the first
# failure, then the plain GEMM + upcast is used.
_OUT_DTYPE_OK = {"mm": True, "addmm": True}


def _logits(h: torch.Tensor, w: torch.Tensor, compute: bool = False) -> torch.Tensor:
    """(c, H) @ (V, H)^T -> (c, V) in at least fp32 (cuBLAS accumulates in fp32 either way); with
    `compute`, in the operands' dtype (bf16 operands: bf16 logits, half the bytes to write and read)."""
    if compute:
        return torch.mm(h, w.t())
    if h.dtype in (torch.bfloat16, torch.float16) and h.is_cuda and _OUT_DTYPE_OK["mm"]:
        try:
            # fp32 output straight from the fp32 accumulator: no rounding of logits to bf16.
            return torch.mm(h, w.t(), out_dtype=torch.float32)
        except (RuntimeError, TypeError):
            _OUT_DTYPE_OK["mm"] = False
    return torch.mm(h, w.t()).to(torch.promote_types(h.dtype, torch.float32))


def _accumulate(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b, acc fp32 (or fp64) also for bf16/fp16 a, b."""
    if acc.dtype == a.dtype:
        acc.addmm_(a, b)
        return
    if a.is_cuda and _OUT_DTYPE_OK["addmm"]:
        try:
            # cuBLAS accumulates into the fp32 buffer itself: no (V, H) temporary.
            torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
            return
        except (RuntimeError, TypeError):
            _OUT_DTYPE_OK["addmm"] = False
    acc.add_(torch.mm(a, b))  # a (V, H) temporary, rounded once per chunk, summed in fp32


def _chunk_loop(
    h: torch.Tensor,
    w: torch.Tensor,
    th: torch.Tensor | None,
    tw: torch.Tensor | None,
    labels: torch.Tensor,
    n_tokens: int,
    opts: dict,
    chunk_size: int,
    chunk_fn: ChunkFn,
    need_h: bool,
    need_w: bool,
    target_fn: Callable[[int, int], torch.Tensor] | None = None,
    compute_logits: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Sums over chunks; grad_h (N, Hs) in h's dtype and grad_W (V, Hs) (fp32 for half weights).
    target_fn(start, end): the chunk's (c, V) teacher logits (a mixture of teachers) instead of th, tw.
    compute_logits: the lm_head GEMMs write logits in the operands' dtype (`kd_loss`'s logits_dtype)."""
    n = h.shape[0]
    need_grad = need_h or need_w
    acc_dtype = torch.promote_types(h.dtype, torch.float32)
    grad_h = torch.empty_like(h) if need_h else None
    low = w.dtype in (torch.bfloat16, torch.float16)
    grad_w = (
        torch.zeros(w.shape, dtype=torch.float32 if low else w.dtype, device=w.device) if need_w else None
    )
    sums = torch.zeros(3, dtype=acc_dtype, device=h.device)  # loss, ce, kd
    for start in range(0, n, chunk_size):
        end = min(start + chunk_size, n)
        hc = h[start:end]  # (c, Hs)
        s = _logits(hc, w, compute_logits)  # (c, V)
        if target_fn is not None:
            t = target_fn(start, end)  # (c, V), a fresh buffer
        elif th is None:
            t = None
        elif tw is None:  # precomputed teacher log-probs: a copy, since chunk_fn may overwrite it
            t = th[start:end].to(s.dtype if compute_logits else acc_dtype, copy=True)  # (c, V)
        else:
            t = _logits(th[start:end], tw, compute_logits)  # (c, V)
        loss_s, ce_s, kd_s, g = chunk_fn(
            s,
            t,
            labels[start:end],
            grad_scale=1.0 / n_tokens,
            need_grad=need_grad,
            grad_dtype=w.dtype if need_grad else None,
            **opts,
        )
        del s, t
        sums += torch.stack([loss_s, ce_s, kd_s]).to(acc_dtype)
        if need_grad:
            g = g.to(w.dtype)  # (c, V)
            if need_h:
                if grad_h.dtype == w.dtype:
                    torch.mm(g, w, out=grad_h[start:end])
                else:
                    grad_h[start:end] = torch.mm(g, w)
            if need_w:
                _accumulate(grad_w, g.t(), hc)
            del g
    sums /= n_tokens
    return sums[0], sums[1], sums[2], grad_h, grad_w


class _ChunkedKDLoss(torch.autograd.Function):
    """forward runs the chunk loop and keeps grad_h, grad_W; backward scales them by grad_output."""

    @staticmethod
    def forward(
        ctx, h, w, th, tw, labels, n_tokens, opts, chunk_size, chunk_fn, target_fn=None, compute=False
    ):
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        ctx.h_dtype, ctx.w_dtype = h.dtype, w.dtype
        ctx.h_shape, ctx.w_shape = h.shape, w.shape
        if n_tokens == 0:  # all ignored: loss 0, gradients 0
            ctx.save_for_backward(None, None)
            z = torch.zeros((), dtype=torch.promote_types(h.dtype, torch.float32), device=h.device)
            ce, kd = z.clone(), z.clone()
            ctx.mark_non_differentiable(ce, kd)
            return z, ce, kd
        loss, ce, kd, grad_h, grad_w = _chunk_loop(
            h, w, th, tw, labels, n_tokens, opts, chunk_size, chunk_fn, need_h, need_w, target_fn, compute
        )
        ctx.save_for_backward(grad_h, grad_w)
        ctx.mark_non_differentiable(ce, kd)
        return loss, ce, kd

    @staticmethod
    def backward(ctx, grad_loss, _grad_ce, _grad_kd):
        grad_h, grad_w = ctx.saved_tensors
        dev = grad_loss.device
        gh = gw = None
        if ctx.needs_input_grad[0]:
            gh = _scaled(grad_h, grad_loss, ctx.h_dtype, ctx.h_shape, dev)
        if ctx.needs_input_grad[1]:
            gw = _scaled(grad_w, grad_loss, ctx.w_dtype, ctx.w_shape, dev)
        return gh, gw, None, None, None, None, None, None, None, None, None


def _scaled(saved, grad_out, dtype, shape, device) -> torch.Tensor:
    """saved * grad_out in `dtype`, leaving `saved` intact (backward may run again with retain_graph).
    A cast to a narrower dtype happens first, so the only temporary is the result itself."""
    if saved is None:  # all tokens ignored
        return torch.zeros(shape, dtype=dtype, device=device)
    if saved.dtype == dtype:
        return saved * grad_out.to(dtype)
    return saved.to(dtype).mul_(grad_out.to(dtype))


def _validate(
    student_hidden,
    student_weight,
    teacher_hidden,
    teacher_weight,
    labels,
    alpha,
    temperature,
    divergence,
    beta,
    chunk_size,
    teacher_logprobs=None,
    teacher_mixture=None,
) -> bool:
    """Checks arguments; returns whether the KD term (and so the teacher) is active."""
    if divergence not in DIVERGENCES:
        raise UserError(f"kd.divergence is '{divergence}', expected one of: {', '.join(DIVERGENCES)}")
    if not 0 <= alpha <= 1:
        raise UserError(f"kd.alpha is {alpha}, expected a number in [0, 1]")
    if not temperature > 0:
        raise UserError(f"kd.temperature is {temperature}, expected a positive number")
    if not 0 < beta < 1:
        raise UserError(f"kd.beta is {beta}, expected a number in (0, 1)")
    if not (isinstance(chunk_size, int) and chunk_size > 0):
        raise UserError(f"kd.chunk_size is {chunk_size}, expected a positive integer")
    if (
        student_hidden.dim() != 2
        or student_weight.dim() != 2
        or student_hidden.shape[1] != student_weight.shape[1]
    ):
        raise ValueError(
            f"kd_loss: student_hidden {tuple(student_hidden.shape)} and student_weight "
            f"{tuple(student_weight.shape)} must be (N, H) and (V, H)"
        )
    if labels.shape != (student_hidden.shape[0],) or labels.dtype != torch.int64:
        raise ValueError(
            f"kd_loss: labels must be int64 of shape ({student_hidden.shape[0]},), "
            f"got {labels.dtype} {tuple(labels.shape)}"
        )
    has_kd = alpha > 0
    if has_kd and teacher_mixture is not None:
        _validate_mixture(student_hidden, student_weight, teacher_hidden, teacher_logprobs, teacher_mixture)
    elif has_kd and teacher_logprobs is not None:
        if (
            teacher_hidden is not None
            or teacher_logprobs.dim() != 2
            or teacher_logprobs.shape[0] != student_hidden.shape[0]
            or teacher_logprobs.shape[1] < student_weight.shape[0]
        ):
            raise ValueError(
                f"kd_loss: teacher_logprobs {tuple(teacher_logprobs.shape)} must be (N, Vt) with N = "
                f"{student_hidden.shape[0]} and Vt >= {student_weight.shape[0]}, and no teacher_hidden"
            )
    elif has_kd:
        if teacher_hidden is None or teacher_weight is None:
            raise UserError(f"kd.alpha is {alpha} > 0 but no teacher logits are available (teacher missing)")
        if (
            teacher_hidden.dim() != 2
            or teacher_weight.dim() != 2
            or teacher_hidden.shape[1] != teacher_weight.shape[1]
            or teacher_hidden.shape[0] != student_hidden.shape[0]
        ):
            raise ValueError(
                f"kd_loss: teacher_hidden {tuple(teacher_hidden.shape)} and teacher_weight "
                f"{tuple(teacher_weight.shape)} must be (N, Ht) and (Vt, Ht) with N = "
                f"{student_hidden.shape[0]}"
            )
        if teacher_weight.shape[0] < student_weight.shape[0]:
            raise UserError(
                f"teacher lm_head has {teacher_weight.shape[0]} rows, expected at least the "
                f"student's vocabulary size {student_weight.shape[0]}"
            )
    return has_kd


def _validate_mixture(student_hidden, student_weight, teacher_hidden, teacher_logprobs, mixture) -> None:
    """Checks `teacher_mixture`: (hidden (N, Ht_i), weight (Vt_i >= V, Ht_i), mixture weight > 0) each."""
    if teacher_hidden is not None or teacher_logprobs is not None or not mixture:
        raise ValueError(
            "kd_loss: teacher_mixture needs at least one teacher, and no teacher_hidden/logprobs"
        )
    n, v = student_hidden.shape[0], student_weight.shape[0]
    for i, (th, tw, wt) in enumerate(mixture):
        if th.dim() != 2 or tw.dim() != 2 or th.shape[1] != tw.shape[1] or th.shape[0] != n:
            raise ValueError(
                f"kd_loss: teacher_mixture[{i}] hidden {tuple(th.shape)} and weight {tuple(tw.shape)} must "
                f"be (N, Ht) and (Vt, Ht) with N = {n}"
            )
        if tw.shape[0] < v:
            raise UserError(
                f"teachers[{i}] lm_head has {tw.shape[0]} rows, expected at least the student's "
                f"vocabulary size {v}"
            )
        if not (math.isfinite(wt) and wt > 0):
            raise UserError(f"teachers[{i}].weight is {wt}, expected a positive number")


class MixtureTarget:
    """Per-chunk teacher logits of a mixture of teachers: rows start:end of T log sum_i w_i
    softmax(h_i W_i^T / T), (c, V) in at least fp32. softmax(result / T) is the mixture itself, so the
    chunk functions (reference and kernel) take it as ordinary teacher logits."""

    def __init__(self, parts: list[tuple[torch.Tensor, torch.Tensor, float]], temperature: float) -> None:
        total = sum(w for _, _, w in parts)
        self.parts = [(h, w, math.log(wt / total)) for h, w, wt in parts]  # (N, Ht), (V, Ht), log w
        self.temperature = temperature

    def __call__(self, start: int, end: int) -> torch.Tensor:
        acc = None
        for h, w, log_w in self.parts:
            a = _logits(h[start:end], w).div_(self.temperature)  # (c, V), fresh
            a -= torch.logsumexp(a, dim=-1, keepdim=True) - log_w  # log(w_i p_i)
            acc = a if acc is None else torch.logaddexp(acc, a, out=acc)
            del a
        return acc.mul_(self.temperature)


def _nonzero(mask: torch.Tensor, count: int) -> torch.Tensor:
    """Indices of the True entries of the 1-D mask, `count` of them: with the count known, no wait
    for the device (nonzero_static), where this torch has it."""
    if hasattr(torch, "nonzero_static"):
        return torch.nonzero_static(mask, size=count).squeeze(1)
    return mask.nonzero().squeeze(1)


def label_count(labels: torch.Tensor, vocab: int, ignore_index: int = -100) -> int:
    """The labels that are not `ignore_index`, after checking each is a token id of the student's
    vocabulary [0, vocab) (a UserError otherwise). On a GPU tensor this waits for the device."""
    valid = labels != ignore_index
    bad = valid & ((labels < 0) | (labels >= vocab))
    n_tokens, n_bad = (int(x) for x in torch.stack([valid.sum(), bad.sum()]).tolist())
    if n_bad:
        first = int(labels[bad][0])
        raise UserError(
            f"labels hold token id {first} outside the student vocabulary [0, {vocab}) ({n_bad} such tokens)"
        )
    return n_tokens


def check_token_ids(batches: Any, vocab: int, ignore_index: int = -100, where: str = "held-out data") -> None:
    """Every batch's input ids and labels (batch[0], batch[1]: host tensors or arrays) are token ids of
    the model's vocabulary [0, vocab): the check the training step makes with `label_count`, for the
    eval paths, before any embedding lookup (an IndexError there otherwise)."""
    for batch in batches:
        ids = torch.as_tensor(batch[0]).long()  # uint16/uint32 token files: no min/max for those dtypes
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= vocab:
            raise UserError(
                f"{where}: input holds token id {lo if lo < 0 else hi} outside the model's vocabulary "
                f"[0, {vocab})"
            )
        if len(batch) > 1:
            try:
                label_count(torch.as_tensor(batch[1]).long().flatten(), vocab, ignore_index)
            except UserError as e:
                raise UserError(f"{where}: {e}") from None


def kd_loss(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_hidden: torch.Tensor | None,
    teacher_weight: torch.Tensor | None,
    labels: torch.Tensor,
    *,
    alpha: float,
    temperature: float,
    divergence: str,
    beta: float = 0.5,
    ignore_index: int = -100,
    chunk_size: int = 1024,
    chunk_fn: ChunkFn | None = None,
    teacher_logprobs: torch.Tensor | None = None,
    teacher_mixture: list[tuple[torch.Tensor, torch.Tensor, float]] | None = None,
    n_tokens: int | None = None,
    logits_dtype: str = "float32",
    rows: int | None = None,
) -> KDLossResult:
    """(1 - alpha) CE + alpha T^2 D(teacher_T || student_T), chunked through the lm_heads.

    Args:
        student_hidden: (N, Hs) final hidden states of the student (after its final norm).
        student_weight: (V, Hs) student lm_head (may be the tied embedding).
        teacher_hidden: (N, Ht) teacher hidden states, or None when alpha == 0.
        teacher_weight: (Vt, Ht), Vt >= V; rows past V are padding and ignored. None when alpha == 0.
        labels: (N,) int64 next-token targets; `ignore_index` marks tokens left out of every term.
        alpha, temperature, divergence, beta: see the module docstring.
        chunk_size: tokens per lm_head chunk; bounds the loss's memory to a few (chunk_size, V) tensors.
        chunk_fn: per-chunk function with `chunk_divergence_reference`'s signature (default: that
            one; the Triton launcher `kd_loss_chunk_triton` on a GPU).
        teacher_logprobs: (N, Vt) precomputed teacher log-probabilities at T = 1 (any float dtype,
            e.g. bf16 from a teacher cache) instead of teacher_hidden x teacher_weight. Each chunk's
            rows are renormalised after the temperature (log_softmax(log p / T) = log_softmax(z / T)),
            so they give the live teacher's loss; columns past V are dropped as padding is.
        teacher_mixture: several teachers [(hidden (N, Ht_i), lm_head (Vt_i, Ht_i), weight > 0), ...]
            instead of teacher_hidden x teacher_weight: the target is their weighted mixture in
            probability space, each softened at T (see "Several teachers" in the module docstring).
        n_tokens: the number of labels that are not `ignore_index`, from `label_count` on the labels'
            host copy (the training step counts before the forward). None: counted here, which
            waits for the GPU: the host then cannot queue the backward while the forward runs.
        logits_dtype: "float32" (each chunk's logits written from the GEMM's fp32 accumulator) or
            "compute" (in the operands' dtype: bf16 operands write bf16 logits, as Liger-Kernel and
            transformers do; 18 instead of 30 bytes per logit through the head on a GPU). The loss
            and its gradient are computed in fp32 either way; the gradient is then written over the
            student's logits. A teacher cache's rows and a mixture's target are cast likewise.

    Returns:
        KDLossResult(loss, ce, kd, tokens): loss differentiable w.r.t. student_hidden and
        student_weight (never the teacher); ce and kd detached means; tokens the non-ignored count.
    """
    has_kd = _validate(
        student_hidden,
        student_weight,
        teacher_hidden,
        teacher_weight,
        labels,
        alpha,
        temperature,
        divergence,
        beta,
        chunk_size,
        teacher_logprobs,
        teacher_mixture,
    )
    if logits_dtype not in ("float32", "compute"):
        raise UserError(f"kd.logits_dtype is '{logits_dtype}', expected float32 or compute")
    compute = logits_dtype == "compute"
    vocab = student_weight.shape[0]
    valid = labels != ignore_index
    count = None  # rows: the labels' count, on the device
    if rows is not None:
        if n_tokens is not None or rows < 1:
            raise ValueError("kd_loss: rows (>= 1) is given instead of n_tokens, not with it")
        count = valid.sum()
        n_tokens = rows
    elif n_tokens is None or labels.device.type == "cpu":
        n_tokens = label_count(labels, vocab, ignore_index)  # on a GPU: one host sync
    th = tw = None
    parts: list = []
    if has_kd and teacher_mixture is not None:
        parts = [(h.detach(), w.detach()[:vocab], float(wt)) for h, w, wt in teacher_mixture]
    elif has_kd and teacher_logprobs is not None:
        th = teacher_logprobs.detach()[:, :vocab]  # (N, V); tw stays None: the chunk loop slices th
    elif has_kd:
        th = teacher_hidden.detach()
        tw = teacher_weight.detach()[:vocab]  # (V, Ht): padded teacher vocab trimmed
    if 0 < n_tokens < labels.shape[0]:
        # Rows with no target (masked prompts, padding) are skipped, not computed and zeroed: gather
        # the scored rows once; autograd scatters their gradient back into the (N, H) input.
        if count is None:
            take = _nonzero(valid, n_tokens)  # (n_tokens,)
            labels = labels.index_select(0, take)
        else:  # the labelled rows, then row 0 again with its label ignored up to `rows`
            take = torch.nonzero_static(valid, size=n_tokens, fill_value=0).squeeze(1)
            kept = torch.arange(n_tokens, device=labels.device) < count
            labels = torch.where(kept, labels.index_select(0, take), ignore_index)
        student_hidden = student_hidden.index_select(0, take)
        if th is not None:
            th = th.index_select(0, take)
        parts = [(h.index_select(0, take), w, wt) for h, w, wt in parts]
    if tw is not None and th.dtype != tw.dtype:
        th = th.to(tw.dtype)
    parts = [(h if h.dtype == w.dtype else h.to(w.dtype), w, wt) for h, w, wt in parts]
    target_fn = MixtureTarget(parts, temperature) if parts else None
    h = student_hidden
    if h.dtype != student_weight.dtype:
        h = h.to(student_weight.dtype)
    opts = dict(
        alpha=alpha, temperature=temperature, divergence=divergence, beta=beta, ignore_index=ignore_index
    )
    chunk_fn = chunk_fn or chunk_divergence_reference
    if torch.is_grad_enabled() and (h.requires_grad or student_weight.requires_grad):
        loss, ce, kd = _ChunkedKDLoss.apply(
            h, student_weight, th, tw, labels, n_tokens, opts, chunk_size, chunk_fn, target_fn, compute
        )
    elif n_tokens == 0:
        loss = torch.zeros((), dtype=torch.promote_types(h.dtype, torch.float32), device=h.device)
        ce, kd = loss.clone(), loss.clone()
    else:
        loss, ce, kd, _, _ = _chunk_loop(
            h.detach(),
            student_weight.detach(),
            th,
            tw,
            labels,
            n_tokens,
            opts,
            chunk_size,
            chunk_fn,
            False,
            False,
            target_fn,
            compute,
        )
    if count is not None:  # the sums were divided by `rows`: by the count instead (0 labels: loss 0)
        scale = n_tokens / count.clamp(min=1).to(loss.dtype)
        loss, ce, kd = loss * scale, ce * scale, kd * scale
    return KDLossResult(loss, ce.detach(), kd.detach(), int(n_tokens))
