"""Triton kernel for one chunk of the KD loss: divergence + CE + gradient w.r.t. the student logits.

The chunk loop in `kdistill.ops.kd_loss` computes the (c, V) student and teacher logits with cuBLAS
GEMMs and calls a chunk function; `kd_loss_chunk_triton` here is a drop-in replacement for
`chunk_divergence_reference` (same arguments, same return value)::

    kd_loss(h, W, ht, Wt, labels, alpha=..., temperature=..., divergence=...,
            chunk_fn=kd_loss_chunk_triton)

One program per row (token). All arithmetic is fp32 whatever the logits' dtype (fp32 or bf16).

Passes over the row's vocabulary (each reads V student and V teacher logits):

1. Online softmax statistics: running max and rescaled sum-exp of s (for CE, temperature 1), a = s/T
   and b = t/T. forward_kl and reverse_kl get their value in this pass too, as a rescaled weighted
   sum: KL(p||q) = sum e^(b - m_b) (b - a) / z_b - lse_b + lse_a, and symmetrically for KL(q||p).
   At temperature 1 a is s: the UNIT_T variant (forward KL and JSD, UNIT_T_DIVERGENCES) takes a's
   statistics from the CE's, and pass 3's softmax(s) is q.
2. Only for jsd, tvd, skew_kl and skew_reverse_kl: with the row's log-normalisers known, one pass
   for the value D and the row constant <q, g> of the gradient (module docstring of ops/kd_loss.py).
   These need the *normalised* probabilities (log m = log(beta p + (1 - beta) q) of the p and q the
   pass computes anyway: one log, not a log-sum-exp's two more exponentials; sign(q - p); p / r),
   which an online pass cannot rescale after the fact, so a second reduction pass is unavoidable.
3. The gradient pass (skipped when NEED_GRAD is false): writes
   grad_scale * [(1 - alpha)(softmax(s) - onehot(y)) + alpha T dD/da] per element, over the student
   logits buffer (in place) or into a separate buffer of another dtype; at alpha = 1 (on-policy's
   pure KD) the CE term and its exponential are skipped (a runtime branch: the key is unchanged).

The kernel is bound by its arithmetic more than by its bytes at bf16 logits (about a dozen
exponentials and logs a logit over the three passes for jsd before the mixture's single log, nine
with it at alpha = 1), so a pass computes no transcendental it can derive from values it already
holds. It is as sensitive to its registers: sums kept per lane (reduced once after a pass) and runtime
branches taking temperature 1's a-statistics from the CE's both measured slower on every path; as a
constexpr of the key (UNIT_T) the same reuse is faster for forward KL and JSD and slower for reverse KL
(benchmarks/NOTES.md, round thirty).

A row whose label is ignore_index does no pass: it writes a zero gradient and zero losses.

Specialization: BLOCK_V, DIVERGENCE (id), HAS_KD, NEED_GRAD, UNIT_T are constexprs; V (the row
stride too: buffers are contiguous) is a runtime int that Triton specializes on divisibility by 16, so the key
holds the vocabulary size; the logits and gradient dtypes come from the pointers. ignore_index is
`do_not_specialize`; the labels and per-row output pointers are `do_not_specialize_on_alignment`
(the loop passes slices of one labels tensor at any row offset); the logits and gradient buffers
are made 16-byte aligned by the launcher (fresh GEMM outputs always are); temperature, alpha, beta and grad_scale are runtime
floats. So the compiled variant depends only on what `kd_loss_kernel_key` names.
"""

from __future__ import annotations

from typing import Any

import torch

from kdistill.dtypes import long_name, torch_dtype
from kdistill.kernels._triton import jit, tl
from kdistill.kernels.keys import KernelKey, make_key, memoized, next_pow2
from kdistill.kernels.spec import Kernel, KernelSpec
from kdistill.ops.kd_loss import DIVERGENCE_IDS

_FWD, _REV, _JSD, _TVD, _SKEW, _SKEW_REV = (
    DIVERGENCE_IDS[k] for k in ("forward_kl", "reverse_kl", "jsd", "tvd", "skew_kl", "skew_reverse_kl")
)


@jit
def _log_mix(x, y, beta):
    """log(beta x + (1 - beta) y) of two probabilities already computed (the mixture of JSD and the
    skew divergences): one log where a log-sum-exp of their logs takes two more exponentials. Where
    both underflow the mixture is floored at fp32's smallest normal: the terms it enters are then x
    or y (zero or that small) times a bounded log."""
    return tl.log(tl.maximum(beta * x + (1.0 - beta) * y, 1.1754943508222875e-38))


@jit(
    do_not_specialize=["ignore_index"],
    # labels: a slice of the batch's labels at any row offset; loss/ce/kd: rows of one (3, c) buffer,
    # whose alignment would depend on c. Scalar accesses, so alignment buys nothing there.
    do_not_specialize_on_alignment=["labels_ptr", "loss_ptr", "ce_ptr", "kd_ptr"],
)
def _kd_loss_rows_kernel(
    s_ptr,  # (c, V) student logits, fp32 or bf16, contiguous
    t_ptr,  # (c, V) teacher logits, same dtype (unused when HAS_KD is false)
    g_ptr,  # (c, V) gradient out: s_ptr itself (in place) or another contiguous buffer
    labels_ptr,  # (c,) int64
    loss_ptr,  # (c,) fp32 per-row (1 - alpha) CE + alpha KD
    ce_ptr,  # (c,) fp32 per-row CE
    kd_ptr,  # (c,) fp32 per-row T^2 D
    V,
    ignore_index,
    temperature,
    alpha,
    beta,
    grad_scale,
    DIVERGENCE: tl.constexpr,
    HAS_KD: tl.constexpr,
    NEED_GRAD: tl.constexpr,
    BLOCK_V: tl.constexpr,
    UNIT_T: tl.constexpr,
):
    """One program per row: CE, the divergence and (NEED_GRAD) the logits gradient of one token.

    Long on purpose (about 170 lines): the three passes over the row (online max/sum-exp, the
    divergence's second pass, the gradient) share per-row statistics in registers; split into separate
    kernels they would re-read the (c, V) logits from memory each time, and as @triton.jit helper
    functions they would need a dozen scalars threaded through every call for no gain in clarity."""
    row = tl.program_id(0).to(tl.int64)
    s_row = s_ptr + row * V
    t_row = t_ptr + row * V
    g_row = g_ptr + row * V
    cols = tl.arange(0, BLOCK_V)
    y = tl.load(labels_ptr + row)
    if y == ignore_index:
        if NEED_GRAD:
            for off in range(0, V, BLOCK_V):
                idx = off + cols
                tl.store(g_row + idx, tl.zeros([BLOCK_V], dtype=g_ptr.dtype.element_ty), mask=idx < V)
        tl.store(loss_ptr + row, 0.0)
        tl.store(ce_ptr + row, 0.0)
        tl.store(kd_ptr + row, 0.0)
    else:
        inv_t = 1.0 / temperature
        neg_inf = float("-inf")
        # Pass 1: online max / sum-exp of s, a = s/T, b = t/T (+ the KL value sums).
        m_s = tl.full([], neg_inf, tl.float32)
        z_s = tl.zeros([], tl.float32)
        m_a = tl.full([], neg_inf, tl.float32)
        z_a = tl.zeros([], tl.float32)
        m_b = tl.full([], neg_inf, tl.float32)
        z_b = tl.zeros([], tl.float32)
        w_kl = tl.zeros([], tl.float32)  # sum e^(b - m_b)(b - a) (forward) or e^(a - m_a)(a - b) (reverse)
        for off in range(0, V, BLOCK_V):
            idx = off + cols
            mask = idx < V
            s0 = tl.load(s_row + idx, mask=mask, other=0.0).to(tl.float32)
            s = tl.where(mask, s0, neg_inf)  # padding lanes: -inf for max / sum-exp
            m_new = tl.maximum(m_s, tl.max(s, 0))
            es = tl.exp(s - m_new)
            sum_s = tl.sum(es, 0)
            z_s = z_s * tl.exp(m_s - m_new) + sum_s
            m_s = m_new
            if HAS_KD:
                t0 = tl.load(t_row + idx, mask=mask, other=0.0).to(tl.float32)
                b = tl.where(mask, t0, neg_inf) * inv_t
                if UNIT_T:  # a is s: the CE's statistics, bit for bit
                    ma_new = m_new
                    ea = es
                    z_a = z_a * tl.exp(m_a - ma_new) + sum_s
                else:
                    a = s * inv_t
                    ma_new = tl.maximum(m_a, tl.max(a, 0))
                    ea = tl.exp(a - ma_new)  # 0 on padding lanes
                    z_a = z_a * tl.exp(m_a - ma_new) + tl.sum(ea, 0)
                mb_new = tl.maximum(m_b, tl.max(b, 0))
                eb = tl.exp(b - mb_new)
                z_b = z_b * tl.exp(m_b - mb_new) + tl.sum(eb, 0)
                diff = (t0 - s0) * inv_t  # b - a, finite (0) on padding lanes
                if DIVERGENCE == 0:
                    w_kl = w_kl * tl.exp(m_b - mb_new) + tl.sum(eb * diff, 0)
                if DIVERGENCE == 1:
                    w_kl = w_kl * tl.exp(m_a - ma_new) - tl.sum(ea * diff, 0)
                m_a = ma_new
                m_b = mb_new
        lse_s = m_s + tl.log(z_s)
        ce = lse_s - tl.load(s_row + y).to(tl.float32)
        kd = tl.zeros([], tl.float32)
        d = tl.zeros([], tl.float32)  # D, the divergence value
        c = tl.zeros([], tl.float32)  # the row constant of the gradient (<q, .> sums)
        lse_a = tl.zeros([], tl.float32)
        lse_b = tl.zeros([], tl.float32)
        if HAS_KD:
            lse_a = m_a + tl.log(z_a)
            lse_b = m_b + tl.log(z_b)
            if DIVERGENCE == 0:
                d = w_kl / z_b - lse_b + lse_a
            if DIVERGENCE == 1:
                d = w_kl / z_a - lse_a + lse_b
            if DIVERGENCE >= 2:
                # Pass 2: D and the gradient's row constant, from normalised probabilities.
                d2 = tl.zeros([], tl.float32)
                for off in range(0, V, BLOCK_V):
                    idx = off + cols
                    mask = idx < V
                    s = tl.load(s_row + idx, mask=mask, other=0.0).to(tl.float32)
                    t = tl.load(t_row + idx, mask=mask, other=0.0).to(tl.float32)
                    logq = s * inv_t - lse_a
                    logp = t * inv_t - lse_b
                    q = tl.exp(logq)
                    p = tl.exp(logp)
                    if DIVERGENCE == 2:  # jsd: d2 = KL(p||m), c = KL(q||m)
                        logm = _log_mix(p, q, beta)
                        d2 += tl.sum(tl.where(mask, p * (logp - logm), 0.0), 0)
                        c += tl.sum(tl.where(mask, q * (logq - logm), 0.0), 0)
                    if DIVERGENCE == 3:  # tvd: d2 = sum |q - p|, c = <q, sign(q - p)>
                        sgn = tl.where(q > p, 1.0, tl.where(q < p, -1.0, 0.0))
                        d2 += tl.sum(tl.where(mask, tl.abs(q - p), 0.0), 0)
                        c += tl.sum(tl.where(mask, q * sgn, 0.0), 0)
                    if DIVERGENCE == 4:  # skew_kl: d2 = KL(p||r), c = <q, p/r>
                        logr = _log_mix(p, q, beta)
                        d2 += tl.sum(tl.where(mask, p * (logp - logr), 0.0), 0)
                        c += tl.sum(tl.where(mask, q * tl.exp(logp - logr), 0.0), 0)
                    if DIVERGENCE == 5:  # skew_reverse_kl: d2 = KL(q||r'), c = <q, q/r'>
                        logr = _log_mix(q, p, beta)
                        d2 += tl.sum(tl.where(mask, q * (logq - logr), 0.0), 0)
                        c += tl.sum(tl.where(mask, q * tl.exp(logq - logr), 0.0), 0)
                if DIVERGENCE == 2:
                    d = beta * d2 + (1.0 - beta) * c
                if DIVERGENCE == 3:
                    d = 0.5 * d2
                if DIVERGENCE >= 4:
                    d = d2
            kd = temperature * temperature * d
        tl.store(loss_ptr + row, (1.0 - alpha) * ce + alpha * kd)
        tl.store(ce_ptr + row, ce)
        tl.store(kd_ptr + row, kd)
        if NEED_GRAD:
            # Pass 3: dL/ds = scale [(1 - alpha)(softmax(s) - onehot(y)) + alpha T dD/da].
            w_ce = (1.0 - alpha) * grad_scale
            w_kd = alpha * temperature * grad_scale
            for off in range(0, V, BLOCK_V):
                idx = off + cols
                mask = idx < V
                s = tl.load(s_row + idx, mask=mask, other=0.0).to(tl.float32)
                g = tl.zeros([BLOCK_V], tl.float32)
                if not UNIT_T:
                    if w_ce != 0.0:  # alpha = 1 (pure KD): the CE term's exponentials are skipped
                        g = w_ce * (tl.exp(s - lse_s) - tl.where(idx == y, 1.0, 0.0))
                if HAS_KD:
                    t = tl.load(t_row + idx, mask=mask, other=0.0).to(tl.float32)
                    logq = s * inv_t - lse_a
                    logp = t * inv_t - lse_b
                    q = tl.exp(logq)
                    if UNIT_T:  # softmax(s) is q (lse_a is lse_s)
                        if w_ce != 0.0:
                            g = w_ce * (q - tl.where(idx == y, 1.0, 0.0))
                    if DIVERGENCE == 0:
                        dd = q - tl.exp(logp)
                    if DIVERGENCE == 1:
                        dd = q * (logq - logp - d)
                    if DIVERGENCE == 2:
                        logm = _log_mix(tl.exp(logp), q, beta)
                        dd = (1.0 - beta) * q * (logq - logm - c)
                    if DIVERGENCE == 3:
                        p = tl.exp(logp)
                        sgn = tl.where(q > p, 1.0, tl.where(q < p, -1.0, 0.0))
                        dd = 0.5 * q * (sgn - c)
                    if DIVERGENCE == 4:
                        logr = _log_mix(tl.exp(logp), q, beta)
                        dd = -(1.0 - beta) * q * (tl.exp(logp - logr) - c)
                    if DIVERGENCE == 5:
                        logr = _log_mix(q, tl.exp(logp), beta)
                        dd = q * (logq - logr - d - beta * (tl.exp(logq - logr) - c))
                    g += w_kd * dd
                tl.store(g_row + idx, g.to(g_ptr.dtype.element_ty), mask=mask)


def kd_loss_chunk_triton(
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
    block_v: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Drop-in for `chunk_divergence_reference` on the GPU (or Triton's interpreter on a CPU).

    s_logits, t_logits (c, V) fp32 or bf16 (teacher cast to the student's dtype if they differ),
    labels (c,) int64. The gradient is written over s_logits when grad_dtype is None or equals its
    dtype (s_logits is consumed: do not reuse it); else into a new (c, V) buffer of grad_dtype.
    block_v overrides the block size (tests); it is part of the key.
    Returns (loss_sum, ce_sum, kd_sum, grad_logits or None), sums fp32 0-dim.
    """
    kernel, grid, args, kwargs, (g, rows) = launch_args(
        s_logits, t_logits, labels, alpha=alpha, temperature=temperature, divergence=divergence, beta=beta,
        ignore_index=ignore_index, grad_scale=grad_scale, need_grad=need_grad, grad_dtype=grad_dtype,
        block_v=block_v,
    )  # fmt: skip
    if grid[0] > 0:
        kernel[grid](*args, **kwargs)
    sums = rows.sum(dim=1)
    return sums[0], sums[1], sums[2], (g if need_grad else None)


def _aligned(x: torch.Tensor) -> torch.Tensor:
    """x, contiguous and 16-byte aligned (the key assumes it; a view at an odd offset is copied)."""
    x = x.contiguous()
    return x if x.data_ptr() % 16 == 0 else x.clone()


def launch_args(
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
    block_v: int | None = None,
) -> tuple:
    """(kernel, grid, args, kwargs, (grad, rows)) of the launch `kd_loss_chunk_triton` makes; the
    contract checks ask Triton's binder how it specializes exactly these arguments."""
    has_kd = alpha > 0
    if has_kd and t_logits is None:
        raise ValueError("kd_loss_chunk_triton: alpha > 0 needs teacher logits")
    s = _aligned(s_logits)
    n_rows, vocab = s.shape
    t = s
    if has_kd:
        t = _aligned(t_logits if t_logits.dtype == s.dtype else t_logits.to(s.dtype))
        if t.shape != s.shape:
            raise ValueError(
                f"kd_loss_chunk_triton: teacher logits {tuple(t.shape)} != student {tuple(s.shape)}"
            )
    labels = labels.contiguous()
    if not need_grad or grad_dtype is None or grad_dtype == s.dtype:
        g = s  # in place (or never written)
    else:
        g = torch.empty(s.shape, dtype=grad_dtype, device=s.device)
    rows = torch.empty((3, n_rows), dtype=torch.float32, device=s.device)  # loss, ce, kd per row
    args = (s, t, g, labels, rows[0], rows[1], rows[2],
            vocab, ignore_index, float(temperature), float(alpha), float(beta), float(grad_scale))  # fmt: skip
    kwargs = tiles(vocab, divergence, has_kd, need_grad, block_v, unit_t=float(temperature) == 1.0)
    return _kd_loss_rows_kernel, (n_rows,), args, kwargs, (g, rows)


# -- tile policy and key function -----------------------------------------------------------------
# The divergences whose temperature-1 variant (UNIT_T) is compiled: measured on an H200 at one 1,024-row
# chunk of 151,936 bf16 logits (benchmarks/NOTES.md, round thirty), forward KL 0.579 -> 0.49 ms and JSD
# 1.036 -> 0.995; reverse KL 0.52 -> 0.67 (slower: it keeps the general variant); the others unmeasured.
UNIT_T_DIVERGENCES = ("forward_kl", "jsd")


def tiles(
    vocab_size: int,
    divergence: str,
    has_kd: bool,
    need_grad: bool,
    block_v: int | None = None,
    unit_t: bool = False,
) -> dict:
    """The constexprs and launch options of one variant; the launcher and the key both use this.
    unit_t: KD at temperature 1, where the student's tempered statistics are the CE's: UNIT_T for the
    divergences in UNIT_T_DIVERGENCES (False without KD, where the temperature is never read)."""
    bv = block_v or min(4096, next_pow2(vocab_size))
    return {
        "BLOCK_V": bv,
        "num_warps": 8 if bv >= 2048 else 4,
        # Without KD the kernel never reads DIVERGENCE: pin it to 0 so no-KD runs share one variant.
        "DIVERGENCE": DIVERGENCE_IDS[divergence] if has_kd else 0,
        "HAS_KD": bool(has_kd),
        "NEED_GRAD": bool(need_grad),
        "UNIT_T": bool(has_kd and unit_t and divergence in UNIT_T_DIVERGENCES),
    }


@memoized
def key(
    arch: str,
    *,
    vocab_size: int,
    divergence: str,
    logits_dtype: torch.dtype | str,
    has_kd: bool = True,
    need_grad: bool = True,
    grad_dtype: torch.dtype | str | None = None,
    block_v: int | None = None,
    unit_t: bool = False,
) -> KernelKey:
    """Every parameter the compiled `_kd_loss_rows_kernel` depends on.

    vocab_size: the student vocabulary V (row length and stride; Triton specializes it on
    divisibility by 16, and BLOCK_V derives from it). divergence: a name of `DIVERGENCE_IDS`.
    logits_dtype: the student (and teacher) logits' dtype. has_kd: alpha > 0 with a teacher.
    need_grad: False under no_grad (eval). grad_dtype: dtype of the written gradient (None:
    logits_dtype, in place; the chunk loop passes the lm_head weight's dtype). Dtypes appear in the
    key by their long names (float32, bfloat16). unit_t: KD at temperature 1 (kd.temperature == 1;
    the held-out eval's KL is at temperature 1).
    """
    ld = long_name(logits_dtype)
    gd = (long_name(grad_dtype) if grad_dtype is not None else ld) if need_grad else None
    return make_key(
        "kd_loss",
        arch,
        vocab_size=int(vocab_size),
        logits_dtype=ld,
        grad_dtype=gd,
        **tiles(vocab_size, divergence, has_kd, need_grad, block_v, unit_t),
    )


# -- registered description -----------------------------------------------------------------------
def _warm(k: KernelKey, device: Any) -> tuple:
    """The launch of a 1-row chunk that specializes as `k`."""
    s = torch.zeros((1, k["vocab_size"]), dtype=torch_dtype(k["logits_dtype"]), device=device)
    t = s.clone() if k["HAS_KD"] else None
    div = {i: n for n, i in DIVERGENCE_IDS.items()}[k["DIVERGENCE"]]
    return launch_args(
        s,
        t,
        torch.zeros(1, dtype=torch.int64, device=device),
        alpha=0.5 if k["HAS_KD"] else 0.0,
        temperature=1.0 if k["UNIT_T"] or not k["HAS_KD"] else 2.0,
        divergence=div,
        need_grad=k["NEED_GRAD"],
        grad_dtype=torch_dtype(k["grad_dtype"]) if k["grad_dtype"] else None,
        block_v=k["BLOCK_V"],
    )


def plan(
    arch: str,
    *,
    grad: bool,
    vocab_size: int,
    divergence: str,
    logits_dtype: str,
    has_kd: bool,
    grad_dtype: str | None = None,
    unit_t: bool = False,
) -> set[KernelKey]:
    """The key of one chunked KD head call (every chunk launches the same variant); unit_t: at
    temperature 1."""
    return {
        key(
            arch,
            vocab_size=vocab_size,
            divergence=divergence,
            logits_dtype=logits_dtype,
            has_kd=has_kd,
            need_grad=grad,
            grad_dtype=grad_dtype if grad else None,
            unit_t=unit_t,
        )
    }


FWD = Kernel(
    op="kd_loss",
    fn=_kd_loss_rows_kernel,
    key=key,
    launch=_warm,
    # the logits and gradient buffers are made 16-byte aligned by the launcher; the rest are
    # do_not_specialize_on_alignment in the jit decorator
    pointers={
        "s_ptr": "logits_dtype",
        "t_ptr": "logits_dtype",
        "g_ptr": ("grad_dtype", "logits_dtype"),
        "labels_ptr": "i64",
        "loss_ptr": "fp32",
        "ce_ptr": "fp32",
        "kd_ptr": "fp32",
    },
    ints={"V": "vocab_size"},
)
SPEC = KernelSpec(name="kd_loss", kernels=(FWD,), tiles=tiles, plan=plan)
