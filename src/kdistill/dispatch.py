"""The one place that chooses, per call, a Triton kernel or the PyTorch reference, and records keys.

    from kdistill import dispatch
    y = dispatch.rmsnorm(x, w, eps)                         # x (..., H), w (H,)
    y, s = dispatch.add_rmsnorm(x, residual, w, eps)        # s = x + residual
    q, k = dispatch.apply_rope(q, k, cos, sin)              # (B, H, T, D), tables (T, D) or (B, T, D)
    y = dispatch.swiglu(gate, up)                           # (..., I)
    o = dispatch.attention(q, k, v)                         # SDPA (a library key is recorded)
    o = dispatch.attention(q, k, v, mask)                   # packed documents: (B, 1, T, T) bool mask
    o = dispatch.decode_attention(q, k_cache, v_cache, pos) # one token per row over a static cache
    o = dispatch.decode_attention_multi(q, k_cache, v_cache, start, k, v)  # T tokens per row: (B, Hq, T, D)
    dispatch.decode_sample(logits, u, sampling, rows)      # next tokens and every row's bookkeeping (ops.sample.Rows)
    q, s = dispatch.quantize_rows(x)                        # FP8 GEMM input: (rows, K) e4m3, (rows,) fp32
    qt, s = dispatch.quantize_cols(x)                       # x^T's: (K, rows) e4m3, (K,) fp32
    r = dispatch.kd_loss(h, W, ht, Wt, labels, alpha=0.5, temperature=2.0, divergence="jsd", chunk_size=1024)

Per call: compute the kernel key (the kernel file's key function), then
- triton mode, CUDA tensors (or Triton's interpreter), key not failed before: launch the kernel's
  autograd Function, recording the key; a failure warns once per key and runs the reference
  (KernelError in strict mode);
- otherwise run the reference from kdistill.ops and record the key it WOULD launch; when recording,
  a gradient hook on the outputs records the backward key. The hook observes only: the reference's
  graph and values are the same with and without a recorder.

State (mode, arch, strict, recorder) lives in kernels/runtime.py; `configure`, `using`, `recording`,
`current` and `aligned` are re-exported here for callers outside kernels/.
"""

from __future__ import annotations

import functools

import torch

from kdistill.kernels import decode_attention as decode_kernel
from kdistill.kernels import decode_gemv, library
from kdistill.kernels import decode_sample as sample_kernel
from kdistill.kernels import fp8_quant as fp8_kernel
from kdistill.kernels import fp8_quant_cols as fp8_cols_kernel
from kdistill.kernels import kd_loss as kd_kernel
from kdistill.kernels import rmsnorm as norm_kernel
from kdistill.kernels import rope as rope_kernel
from kdistill.kernels import swiglu as swiglu_kernel
from kdistill.kernels.runtime import (
    KernelFallbackWarning,
    Recorder,
    aligned,
    chained,
    current,
    recording,
    triton_available,
    using,
)
from kdistill.kernels.seal import configure
from kdistill.ops import kd_loss as kd_ops
from kdistill.ops.attention import (
    attention_reference,
    decode_attention_multi_reference,
    decode_attention_reference,
)
from kdistill.ops.kd_loss import KDLossResult
from kdistill.ops.rmsnorm import add_rmsnorm_reference, rmsnorm_reference
from kdistill.ops.rope import rope_reference
from kdistill.ops.sample import Rows, sample_append
from kdistill.ops.swiglu import swiglu_reference

__all__ = [
    "KDLossResult",
    "KernelFallbackWarning",
    "Recorder",
    "add_rmsnorm",
    "aligned",
    "apply_rope",
    "attention",
    "chained",
    "configure",
    "current",
    "decode_attention",
    "decode_attention_multi",
    "decode_linear",
    "decode_linear_add_rmsnorm",
    "decode_sample",
    "embed_rmsnorm",
    "kd_loss",
    "quantize_cols",
    "quantize_rows",
    "recording",
    "rmsnorm",
    "swiglu",
    "swiglu_halves",
    "triton_available",
    "using",
]


def _rows(t: torch.Tensor) -> torch.Tensor:
    """The (rows, last) row-major tensor a kernel receives (a copy only when t is not row-major)."""
    if t.dim() == 2 and t.is_contiguous():
        return t
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.is_contiguous() else t2.contiguous()


def _wants_grad(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd must see this call: grad mode on and an input that requires a gradient. When
    not (a frozen teacher's forward), the kernel is launched without its autograd Function."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


# -- RMSNorm ------------------------------------------------------------------------------------------
def _norm_fwd_key(arch, x2, r2, weight, eps, y_dtype, chained=False):
    return norm_kernel.fwd_key(
        arch,
        hidden=x2.shape[-1],
        eps=eps,
        dtype=x2.dtype,
        w_dtype=weight.dtype,
        residual=r2 is not None,
        r_dtype=r2.dtype if r2 is not None else None,
        y_dtype=y_dtype,
        chained=chained,
        aligned=aligned(x2, r2 if r2 is not None else x2, weight),
    )


def _norm_bwd_key(arch, dy2, x2, weight, rstd, ds2):
    return norm_kernel.bwd_key(
        arch,
        hidden=x2.shape[-1],
        dtype=x2.dtype,
        w_dtype=weight.dtype,
        has_dres=ds2 is not None,
        y_dtype=dy2.dtype,
        aligned=aligned(dy2, x2, weight, rstd, ds2 if ds2 is not None else dy2),
    )


def _gemm_dtype(s_dtype: torch.dtype, w_dtype: torch.dtype, device_type: str) -> torch.dtype:
    """The dtype a norm writes when its output feeds GEMMs only: under autocast, the autocast dtype
    where the promotion would be wider (autocast casts it there before every GEMM anyway, and its
    gradient comes back in that dtype); otherwise the promotion of the normed input and the weight."""
    y = torch.promote_types(s_dtype, w_dtype)
    if torch.is_autocast_enabled(device_type):
        low = torch.get_autocast_dtype(device_type)
        if torch.finfo(low).bits < torch.finfo(y).bits:
            return low
    return y


def _norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, to_gemm: bool = False
):
    rt = current()
    x2 = _rows(x)
    r2 = _rows(residual) if residual is not None else None
    y_dtype = None  # the promotion of the normed input and the weight
    if to_gemm:
        s_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
        y_dtype = _gemm_dtype(s_dtype, weight.dtype, x.device.type)
    key = _norm_fwd_key(rt.arch, x2, r2, weight, eps, y_dtype, rt.chained)

    def bwd_key_fn(dy, normed, w, rstd, ds):
        k = _norm_bwd_key(rt.arch, _rows(dy), _rows(normed), w, rstd, _rows(ds) if ds is not None else None)
        rt.record(k, "bwd", lambda: norm_kernel.bwd_launch(k, dy, normed, w, rstd, ds))
        return k

    if rt.use_kernel(key, x, weight):
        try:
            if not _wants_grad(x, residual, weight):
                run = lambda: norm_kernel.forward_only(key, x, residual, weight, eps)  # noqa: E731
            else:  # x as given: the Function takes its rows inside (no view nodes in the graph)
                run = lambda: norm_kernel.RMSNormFunction.apply(  # noqa: E731
                    x, residual, weight, eps, key, bwd_key_fn, rt.kernel_failed
                )
            return rt.launch(key, run, lambda: norm_kernel.fwd_launch(key, x2, r2, weight, eps))
        except Exception as e:
            rt.kernel_failed(key, e)
    rt.record(key, "fwd", lambda: norm_kernel.fwd_launch(key, x2, r2, weight, eps))
    if residual is None:
        y, s = rmsnorm_reference(x, weight, eps), None
    else:
        y, summed = add_rmsnorm_reference(x, residual, weight, eps)
        # The returned sum is a view (same values, no copy) so that its later uses have their own
        # graph edge: the gradient the hook below sees on it is exactly the kernel's DS input (None
        # when nothing after this call uses it), not what flows back through the norm. The same graph
        # with or without a recorder.
        s = summed.view_as(summed)

    def record_bwd(grads):
        dy = grads[0] if grads[0] is not None else torch.zeros_like(y)
        ds = grads[1] if len(grads) > 1 else None
        normed = s if s is not None else x
        rstd = torch.empty(normed.numel() // normed.shape[-1], dtype=torch.float32, device=normed.device)
        bwd_key_fn(
            dy.detach(), normed.detach(), weight.detach(), rstd, ds.detach() if ds is not None else None
        )

    if y_dtype is not None and y.dtype != y_dtype:
        y = y.to(y_dtype)  # after the hook's reference point: dy arrives in y_dtype, as for the kernel
    rt.on_backward([y] if s is None else [y, s], record_bwd)
    return y if residual is None else (y, s)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, to_gemm: bool = False) -> torch.Tensor:
    """RMSNorm of x (..., H) with weight (H,). to_gemm: the output feeds GEMMs only, so under autocast
    it is written in the autocast dtype (the values the GEMMs would see after autocast's cast)."""
    return _norm(x, None, weight, eps, to_gemm)


def add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *, to_gemm: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(x + residual), x + residual): the residual add fused into the norm (to_gemm: as rmsnorm)."""
    return _norm(x, residual, weight, eps, to_gemm)


# -- RoPE ---------------------------------------------------------------------------------------------
def embed_rmsnorm(
    ids: torch.Tensor, table: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(table[ids]) * weight, table[ids]) for a decode step's token ids (B,) int64 and an
    embedding table (V, H), no gradient: the lookup and the first block's norm in one launch
    (kernels/rmsnorm.py, its GATHER), chained where the step is (runtime.chained); or F.embedding then
    the norm's reference, the same values."""
    rt = current()
    ids = ids.contiguous()
    key = norm_kernel.fwd_key(
        rt.arch,
        hidden=table.shape[-1],
        eps=eps,
        dtype=table.dtype,
        w_dtype=weight.dtype,
        residual=False,
        chained=rt.chained,
        gather=True,
        aligned=aligned(table, table, weight),
    )
    spec = lambda: norm_kernel.fwd_launch(key, table, None, weight, eps, ids)  # noqa: E731
    if (
        ids.dtype == torch.int64
        and ids.dim() == 1
        and table.is_contiguous()
        and rt.use_kernel(key, table, weight)
    ):
        try:
            return rt.launch(key, lambda: norm_kernel.gather_forward(key, table, ids, weight, eps), spec)
        except Exception as e:
            rt.kernel_failed(key, e)
    rt.record(key, "fwd", spec)
    delta = torch.nn.functional.embedding(ids, table)
    return rmsnorm_reference(delta, weight, eps), delta


def _heads(t: torch.Tensor) -> torch.Tensor:
    """What the kernel receives for q/k (or their grads): any strides with a contiguous last dim."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _table(t: torch.Tensor) -> torch.Tensor:
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.dtype == torch.float32 and t2.is_contiguous() else t2.float().contiguous()


def _rope_key(arch, q, k, cos, sin, backward: bool):
    fn = rope_kernel.bwd_key if backward else rope_kernel.fwd_key
    return fn(
        arch,
        head_dim=q.shape[-1],
        q_heads=q.shape[1],
        kv_heads=k.shape[1],
        dtype=q.dtype,
        aligned=aligned(_heads(q), _heads(k), _table(cos), _table(sin)),
    )


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE on q (B, Hq, T, D) and k (B, Hkv, T, D) with fp32 cos/sin tables (T, D), or per-token
    tables (B, T, D) (positions that restart per packed conversation): then the batch is rotated as
    one sequence of B*T positions, the same kernel and key, one table row per token."""
    if cos.dim() == 3:
        b, hq, t, d = q.shape
        hk = k.shape[1]
        qf = q.transpose(1, 2).reshape(1, b * t, hq, d).transpose(1, 2)  # (1, Hq, B*T, D)
        kf = k.transpose(1, 2).reshape(1, b * t, hk, d).transpose(1, 2)
        qo, ko = _apply_rope(qf, kf, cos.reshape(b * t, d), sin.reshape(b * t, d))
        qo = qo.transpose(1, 2).reshape(b, t, hq, d).transpose(1, 2)
        return qo, ko.transpose(1, 2).reshape(b, t, hk, d).transpose(1, 2)
    return _apply_rope(q, k, cos, sin)


def _apply_rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    rt = current()
    key = _rope_key(rt.arch, q, k, cos, sin, backward=False)

    def bwd_key_fn(dq, dk, c, s):
        kb = _rope_key(rt.arch, dq, dk, c, s, backward=True)
        rt.record(kb, "bwd", lambda: rope_kernel.launch(kb, dq, dk, c, s, inverse=True))
        return kb

    if rt.use_kernel(key, q, k):
        try:
            if not _wants_grad(q, k):
                run = lambda: rope_kernel.forward_only(key, q, k, cos, sin)  # noqa: E731
            else:
                run = lambda: rope_kernel.RopeFunction.apply(  # noqa: E731
                    q, k, cos, sin, key, bwd_key_fn, rt.kernel_failed
                )
            return rt.launch(key, run, lambda: rope_kernel.launch(key, q, k, cos, sin, inverse=False))
        except Exception as e:
            rt.kernel_failed(key, e)
    rt.record(key, "fwd", lambda: rope_kernel.launch(key, q, k, cos, sin, inverse=False))
    qo, ko = rope_reference(q, k, cos, sin)

    def record_bwd(grads):
        dq = grads[0] if grads[0] is not None else torch.zeros_like(qo)
        dk = grads[1] if grads[1] is not None else torch.zeros_like(ko)
        bwd_key_fn(dq.detach(), dk.detach(), cos, sin)

    rt.on_backward([qo, ko], record_bwd)
    return qo, ko


# -- SwiGLU -------------------------------------------------------------------------------------------
def _swiglu_key(arch, gate, up, dy=None):
    g2, u2, sx = swiglu_kernel.pair(gate, up)  # views: the halves of the fused gate/up output stay so
    fused = sx != gate.shape[-1]
    if dy is None:
        return swiglu_kernel.fwd_key(
            arch, inter=gate.shape[-1], dtype=gate.dtype, fused=fused, aligned=aligned(g2, u2)
        )
    return swiglu_kernel.bwd_key(
        arch, inter=gate.shape[-1], dtype=gate.dtype, fused=fused, aligned=aligned(_rows(dy), g2, u2)
    )


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, gate and up (..., I) (separate tensors, or the halves of one (..., 2I))."""
    rt = current()
    key = _swiglu_key(rt.arch, gate, up)

    def bwd_key_fn(dy, g, u):
        kb = _swiglu_key(rt.arch, g, u, dy)
        rt.record(kb, "bwd", lambda: swiglu_kernel.bwd_launch(kb, dy, g, u))
        return kb

    if rt.use_kernel(key, gate, up):
        try:
            if not _wants_grad(gate, up):
                run = lambda: swiglu_kernel.forward_only(key, gate, up)  # noqa: E731
            else:
                run = lambda: swiglu_kernel.SwiGLUFunction.apply(  # noqa: E731
                    gate, up, key, bwd_key_fn, rt.kernel_failed
                )
            return rt.launch(key, run, lambda: swiglu_kernel.fwd_launch(key, gate, up))
        except Exception as e:
            rt.kernel_failed(key, e)
    rt.record(key, "fwd", lambda: swiglu_kernel.fwd_launch(key, gate, up))
    y = swiglu_reference(gate, up)
    rt.on_backward([y], lambda grads: bwd_key_fn(grads[0].detach(), gate.detach(), up.detach()))
    return y


def _swiglu_grad(dy: torch.Tensor, gu: torch.Tensor) -> torch.Tensor:
    """d gu (..., 2I) of y = swiglu(*halves(gu)) for dy (..., I): the SwiGLU backward on its kernel
    (writing d gate and d up as the halves of one tensor) or its reference; records the key."""
    rt = current()
    gate, up = swiglu_kernel.halves(gu)
    key = _swiglu_key(rt.arch, gate, up, dy)
    if rt.use_kernel(key, gu):
        try:
            args = lambda: swiglu_kernel.bwd_launch(key, dy, gate, up)  # noqa: E731
            dg, du = rt.launch(key, lambda: swiglu_kernel.run(args()), args, phase="bwd")
            if dg.stride(0) == gu.shape[-1]:  # the halves of one (rows, 2I) gradient (see bwd_launch)
                return dg.as_strided((dg.shape[0], gu.shape[-1]), (gu.shape[-1], 1)).view(gu.shape)
            return torch.cat([dg, du], dim=-1).view(gu.shape)
        except Exception as e:
            rt.kernel_failed(key, e)
    rt.record(key, "bwd", lambda: swiglu_kernel.bwd_launch(key, dy, gate, up))
    with torch.enable_grad():
        g, u = gate.detach().requires_grad_(True), up.detach().requires_grad_(True)
        dg, du = torch.autograd.grad(swiglu_reference(g, u), (g, u), dy)
    return torch.cat([dg, du], dim=-1)


class _SwiGLUHalves(torch.autograd.Function):
    """y = swiglu(*halves(gu)) for gu (..., 2I), whose gradient comes back as one (..., 2I) tensor.

    `swiglu(*gu.chunk(2, -1))` gives the same values, but autograd's backward of `chunk` then
    concatenates d gate and d up into a new (..., 2I) tensor: at 8 x 2048 tokens and I = 8960 a
    587 MB copy per layer. Here the SwiGLU backward writes them as the halves of one gradient
    (`_swiglu_grad`), which the fused gate/up GEMM's backward reads as it is."""

    @staticmethod
    def forward(ctx, gu: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            y = swiglu(*swiglu_kernel.halves(gu))  # (..., I)
        ctx.save_for_backward(gu)
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> torch.Tensor:
        (gu,) = ctx.saved_tensors
        return _swiglu_grad(dy.to(gu.dtype), gu)


def swiglu_halves(gu: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gu = [gate, up] (..., 2I) (a fused gate/up GEMM's output) -> (..., I); its
    gradient is written as one (..., 2I) tensor (no concatenation in backward). Used where the SwiGLU
    output must exist anyway (an FP8 down_proj quantises it in forward and keeps only its fp8 copy)."""
    if torch.is_grad_enabled() and gu.requires_grad:
        return _SwiGLUHalves.apply(gu)
    return swiglu(*swiglu_kernel.halves(gu))


class _SwiGLUDown(torch.autograd.Function):
    """y = swiglu(*halves(gu)) @ weight^T that does not keep the SwiGLU output for backward.

    gu (..., 2I) is the fused gate/up GEMM's output. A plain `down_proj(swiglu(gate, up))` stores the
    (N, I) SwiGLU output for the weight gradient, on top of gate and up that the SwiGLU backward
    stores anyway. Here backward recomputes it from gu (one elementwise pass through the same swiglu
    op and key), runs the same two GEMMs a Linear would (d weight = dy^T h, d h = dy weight), and the
    SwiGLU backward writes d gate and d up straight into one (..., 2I) gradient for the fused GEMM.
    Under autocast the weight is used in the autocast dtype and its gradient returned in the weight's
    own dtype, as autocast's linear does.
    """

    @staticmethod
    def forward(ctx, gu: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            h = swiglu(*swiglu_kernel.halves(gu))  # (..., I)
        ctx.save_for_backward(gu, weight)
        return torch.nn.functional.linear(h, weight.to(h.dtype))

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        gu, weight = ctx.saved_tensors
        w = weight.to(gu.dtype)
        dy = dy.to(gu.dtype)
        dh = dy @ w  # (..., I)
        if not ctx.needs_input_grad[1]:  # a frozen down_proj (LoRA): no weight gradient, nothing recomputed
            return _swiglu_grad(dh, gu), None
        with torch.no_grad():
            h = swiglu(*swiglu_kernel.halves(gu))  # recomputed: (..., I)
        dw = dy.reshape(-1, dy.shape[-1]).t() @ h.reshape(-1, h.shape[-1])  # (H, I)
        return _swiglu_grad(dh, gu), dw.to(weight.dtype)


def swiglu_down(gu: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The MLP's `down_proj(silu(gate) * up)` for gu = [gate, up] (..., 2I) (the fused gate/up GEMM's
    output) and weight (H, I), recomputing the SwiGLU output in backward instead of storing it: the
    same values, I elements per token less kept for backward."""
    if torch.is_autocast_enabled(gu.device.type):
        # the custom Function sees autocast's output dtype for gu; keep the GEMM in that dtype
        with torch.autocast(gu.device.type, enabled=False):
            return _SwiGLUDown.apply(gu, weight)
    return _SwiGLUDown.apply(gu, weight)


# -- attention (a library call: recorded so that prewarm runs SDPA at this shape) ---------------------
def _record_sdpa(q: torch.Tensor, k: torch.Tensor, *, grad: bool, masked: bool, **extra: int) -> None:
    """Record the SDPA library key of this call's shape (prewarm runs SDPA once at every planned one)."""
    rt = current()
    b, hq, t, d = q.shape
    key = library.sdpa_key(
        rt.arch, batch=b, q_heads=hq, kv_heads=k.shape[1], seq=t, head_dim=d, dtype=q.dtype, grad=grad,
        masked=masked, **extra,
    )  # fmt: skip
    rt.record(key, "fwd")


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Causal softmax(q k^T / sqrt(D)) v; q (B, Hq, T, D), k and v (B, Hkv, T, D) -> (B, Hq, T, D).
    mask: None (plain causal) or a (B, 1, T, T) document mask, bool or additive
    (kdistill.ops.attention.document_mask, document_bias)."""
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    _record_sdpa(q, k, grad=grad, masked=mask is not None)
    return attention_reference(q, k, v, mask)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pos: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
) -> torch.Tensor:
    """One new token per row over a static KV cache (kdistill.decode): q (B, Hq, D), caches (B, Hkv, M, D)
    contiguous, pos (B,) int64 each row's newest slot, k_new and v_new (B, Hkv, D) the step's key and
    value, written into slot pos[b] -> (B, Hq, D), attending slots 0..pos[b] only. With cos and sin (the
    fp32 (M', D) RoPE tables), q and k_new arrive unrotated and are rotated at position pos[b] first. The
    split kernel (which also rotates, writes the new key and value, and whose last split per row and kv
    head combines the parts; kernels/decode_attention.py), or the reference."""
    rt = current()
    d, hq, hkv, m = q.shape[-1], q.shape[1], k_cache.shape[1], k_cache.shape[2]
    rope = cos is not None and sin is not None
    kernel_ok = decode_kernel.supported(d, hq, hkv) and (not rope or decode_kernel.rope_supported(d))
    if not kernel_ok or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        return decode_attention_reference(q, k_cache, v_cache, pos, k_new, v_new, cos, sin)
    q, k_new, v_new = (
        t if t.stride(-1) == 1 and t.stride(1) == d else t.contiguous() for t in (q, k_new, v_new)
    )
    key = decode_kernel.split_key(
        rt.arch,
        head_dim=d,
        q_heads=hq,
        kv_heads=hkv,
        dtype=q.dtype,
        max_len=m,
        rope=rope,
        chained=rt.chained,
        split_min=decode_kernel.min_split(q.shape[0]),
        aligned=aligned(q, k_cache, v_cache, pos, k_new, v_new, cos, sin),
    )
    split = lambda: decode_kernel.launch(key, q, k_cache, v_cache, pos, k_new, v_new, cos, sin)  # noqa: E731
    if rt.use_kernel(key, q, k_cache, v_cache):
        try:
            return rt.launch(key, lambda: decode_kernel.run(split()), split)[0]
        except Exception as e:
            rt.kernel_failed(key, e)
    rt.record(key, "fwd", split)
    return decode_attention_reference(q, k_cache, v_cache, pos, k_new, v_new, cos, sin)


def decode_attention_multi(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    start: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
) -> torch.Tensor:
    """T new tokens per row over a static KV cache (DecodeEngine.forward_at: speculative decoding's draft
    and verify steps): q (B, Hq, T, D), caches (B, Hkv, M, D) contiguous, start (B,) int64 >= 0, k_new
    and v_new (B, Hkv, T, D) -> (B, Hq, T, D). Token j's key and value go into slot min(start[b] + j,
    M - 1), and it attends the slots before that one and its own: the same as T decode_attention calls
    in order. With cos and sin (fp32 (M', D) tables), q and k_new arrive unrotated. One launch of the
    T-token split kernel per chunk of decode_kernel.token_chunks (one up to 36 tokens at 7 q heads per
    kv head) and the combine kernel over B * T rows; or the reference."""
    rt = current()
    b, hq, t, d = q.shape
    hkv, m = k_cache.shape[1], k_cache.shape[2]
    rope = cos is not None and sin is not None
    kernel_ok = decode_kernel.supported(d, hq, hkv) and (not rope or decode_kernel.rope_supported(d))
    if not kernel_ok or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        return decode_attention_multi_reference(q, k_cache, v_cache, start, k_new, v_new, cos, sin)
    q, k_new, v_new = (  # heads of D contiguous elements; other layouts are copied to (B, T, H, D)
        x if x.stride(-1) == 1 and x.stride(1) == d else x.transpose(1, 2).contiguous().transpose(1, 2)
        for x in (q, k_new, v_new)
    )
    ckey = decode_kernel.combine_key(rt.arch, head_dim=d, q_heads=hq, dtype=q.dtype, max_len=m)
    calls, at = [], 0
    for n in decode_kernel.token_chunks(t, hq, hkv):  # in order: a chunk's tokens see the earlier ones
        qc, kc, vc = q[:, :, at : at + n], k_new[:, :, at : at + n], v_new[:, :, at : at + n]
        sc = start + at if at else start
        key = decode_kernel.multi_split_key(
            rt.arch, head_dim=d, q_heads=hq, kv_heads=hkv, tokens=n, dtype=q.dtype, max_len=m, rope=rope,
            aligned=aligned(qc, k_cache, v_cache, sc, kc, vc, cos, sin),
        )  # fmt: skip
        split = functools.partial(decode_kernel.multi_launch, key, qc, k_cache, v_cache, sc, kc, vc, cos, sin)
        calls.append((key, n, split))
        at += n
    if all(rt.use_kernel(key, q, k_cache, v_cache) for key, _, _ in calls):
        key, outs = calls[0][0], []
        try:
            for key, n, split in calls:
                parts, lse = rt.launch(key, lambda split=split: decode_kernel.run(split()), split)
                comb = functools.partial(
                    decode_kernel.combine_launch, ckey, parts.flatten(0, 1), lse.flatten(0, 1), q.dtype
                )
                o = rt.launch(ckey, lambda comb=comb: decode_kernel.run(comb()), comb)[0]
                outs.append(o.view(b, n, hq, d))  # the combine's rows are (row, token)
            return (outs[0] if len(outs) == 1 else torch.cat(outs, 1)).transpose(1, 2)  # (B, Hq, T, D)
        except Exception as e:
            rt.kernel_failed(key, e)
    for key, _, split in calls:
        rt.record(key, "fwd", split)
    empty = decode_kernel.empty_parts
    rt.record(
        ckey, "fwd", lambda: decode_kernel.combine_launch(ckey, *empty(calls[0][0], q[:, :, 0], m), q.dtype)
    )
    return decode_attention_multi_reference(q, k_cache, v_cache, start, k_new, v_new, cos, sin)


def decode_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, gate_up: bool = False
) -> torch.Tensor:
    """A decode step's linear on x (B, K) -> (B, N): F.linear (+ bias), or with gate_up the stacked
    gate/up product's SwiGLU (weight (2N, K)). Where decode_gemv.serves (buckets of at most 16 rows, a
    narrow product's up to 64) the matrix-vector kernel (kernels/decode_gemv.py: a tile of 16, 32 or 64
    rows); else cuBLAS and the SwiGLU kernel, as the prefill runs them."""
    rt = current()
    rows, k = x.shape
    plain = decode_gemv.EPI_BIAS if bias is not None else decode_gemv.EPI_NONE
    epi = decode_gemv.EPI_SWIGLU if gate_up else plain
    n = weight.shape[0] // 2 if gate_up else weight.shape[0]
    if not decode_gemv.serves(rows, k, epi, n):
        y = torch.nn.functional.linear(x, weight, bias)
        return swiglu(*y.chunk(2, dim=-1)) if gate_up else y
    x = x.contiguous()
    key = decode_gemv.gemv_key(
        rt.arch, n=n, k=k, dtype=x.dtype, epilogue=epi, rows=rows, aligned=aligned(x, weight, bias)
    )
    spec = lambda: decode_gemv.launch(key, x, weight, bias)  # noqa: E731
    if rt.use_kernel(key, x, weight):
        try:
            return rt.launch(key, lambda: decode_gemv.run(spec()), spec)[0]
        except Exception as e:
            rt.kernel_failed(key, e)
    rt.record(key, "fwd", spec)
    return decode_gemv.decode_gemv_reference(x, weight, bias, gate_up)


def folds(rows: int, n: int, k: int, consumer_n: int, consumer_epilogue: int) -> bool:
    """Whether a decode step folds the norm after a product of n outputs and k inputs (o_proj, down) into
    it and the product after the norm (consumer_n outputs of n inputs with decode_gemv's epilogue
    consumer_epilogue: gate/up, q/k/v): the bucket chains (runtime.chained) and the matrix-vector kernel
    serves both, in a bucket of at most decode_gemv.FOLD_ROWS rows."""
    return (
        current().chained
        and rows <= decode_gemv.FOLD_ROWS
        and decode_gemv.serves(rows, k, decode_gemv.EPI_NONE, n)
        and decode_gemv.serves(rows, n, consumer_epilogue, consumer_n)
    )


def decode_linear_add_stats(
    x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode step's o_proj or down with the residual add of the norm after it: x (B, K), weight (N, K), the
    residual's B rows of N -> (x @ weight^T + residual (B, N), its sums of squares per row over each
    column block of the product (column blocks, B) fp32), from which the next product (decode_linear_scaled)
    computes each row's rstd: the norm has no launch of its own. The matrix-vector kernel's ADD key (a
    split product's last program adds), or the reference."""
    rt = current()
    rows, k = x.shape
    n = weight.shape[0]
    x, r2 = x.contiguous(), residual.reshape(rows, n).contiguous()
    key = decode_gemv.gemv_key(
        rt.arch, n=n, k=k, dtype=x.dtype, rows=rows, aligned=aligned(x, weight, None), add=True
    )
    spec = lambda: decode_gemv.launch(key, x, weight, None, r2)  # noqa: E731
    if rt.use_kernel(key, x, weight, r2):
        try:
            return rt.launch(key, lambda: decode_gemv.run(spec()), spec)
        except Exception as e:
            rt.kernel_failed(key, e)
    rt.record(key, "fwd", spec)
    return decode_gemv.add_stats_reference(x, weight, r2, int(key["BLOCK_N"]))


def decode_linear_scaled(
    x: torch.Tensor,
    weight: torch.Tensor,
    ss: torch.Tensor,
    eps: float,
    bias: torch.Tensor | None = None,
    *,
    gate_up: bool = False,
) -> torch.Tensor:
    """decode_linear of rmsnorm(x) without its weight, for x (B, K) un-normed and ss (parts, B) the sums
    of squares decode_linear_add_stats wrote: the weight holds the norm's weight folded into its inputs
    (DecodeWeights), each row's products are scaled by rsqrt(sum(ss) / K + eps). The matrix-vector
    kernel's RSTD key, or the reference."""
    rt = current()
    rows, k = x.shape
    plain = decode_gemv.EPI_BIAS if bias is not None else decode_gemv.EPI_NONE
    epi = decode_gemv.EPI_SWIGLU if gate_up else plain
    n = weight.shape[0] // 2 if gate_up else weight.shape[0]
    x, ss = x.contiguous(), ss.contiguous()
    key = decode_gemv.gemv_key(
        rt.arch,
        n=n,
        k=k,
        dtype=x.dtype,
        epilogue=epi,
        rows=rows,
        aligned=aligned(x, weight, bias),
        rstd=ss.shape[0],
        eps=eps,
    )
    spec = lambda: decode_gemv.launch(key, x, weight, bias, None, ss)  # noqa: E731
    if rt.use_kernel(key, x, weight, ss):
        try:
            return rt.launch(key, lambda: decode_gemv.run(spec()), spec)[0]
        except Exception as e:
            rt.kernel_failed(key, e)
    rt.record(key, "fwd", spec)
    return decode_gemv.scaled_reference(x, weight, ss, eps, bias, gate_up)


def decode_linear_add_rmsnorm(
    x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """add_rmsnorm(decode_linear(x, weight), residual, norm_weight, eps) for a decode step's o_proj or
    down (x (B, K), weight (N, K), no bias; residual of B rows of N) -> (y, x @ weight^T + residual),
    each shaped as the residual. In a small bucket's step (runtime.chained) whose product the
    matrix-vector kernel splits over K, the product's fp32 partials go to the norm kernel, which sums them
    in split order and rounds the sum as the product's own combine does (the same values): the product's
    last-arriving program, and its round trip through L2, leave the step's chain of launches."""
    rt = current()
    rows, k = x.shape
    n = weight.shape[0]
    served = decode_gemv.serves(rows, k, decode_gemv.EPI_NONE, n)
    split = decode_gemv.split(n, k) if served else 1
    if not rt.chained or split == 1 or residual.dtype != x.dtype or residual.numel() != rows * n:
        delta = decode_linear(x, weight).view(residual.shape)
        return add_rmsnorm(delta, residual, norm_weight, eps)
    x = x.contiguous()
    r2 = _rows(residual)
    gkey = decode_gemv.gemv_key(
        rt.arch, n=n, k=k, dtype=x.dtype, combine=False, rows=rows, aligned=aligned(x, weight, None)
    )
    nkey = norm_kernel.fwd_key(
        rt.arch,
        hidden=n,
        eps=eps,
        dtype=x.dtype,
        w_dtype=norm_weight.dtype,
        residual=True,
        r_dtype=residual.dtype,
        chained=True,
        parts=split,
        aligned=(True, *aligned(r2, norm_weight)),  # the partials: a fresh allocation
    )
    gspec = lambda: decode_gemv.launch(gkey, x, weight)  # noqa: E731

    def nspec(parts: torch.Tensor | None = None) -> tuple:
        parts = (
            torch.empty((split, rows, n), dtype=torch.float32, device=x.device) if parts is None else parts
        )
        return norm_kernel.fwd_launch(nkey, parts, r2, norm_weight, eps)

    if rt.use_kernel(gkey, x, weight) and rt.use_kernel(nkey, r2, norm_weight):
        try:
            parts = rt.launch(gkey, lambda: decode_gemv.run(gspec()), gspec)[0]
            y, summed, _ = rt.launch(nkey, lambda: norm_kernel._run(nspec(parts)), nspec)
            return y.view(residual.shape), summed.view(residual.shape)
        except Exception as e:
            rt.kernel_failed(gkey, e)
            rt.kernel_failed(nkey, e)
    rt.record(gkey, "fwd", gspec)
    rt.record(nkey, "fwd", nspec)
    delta = decode_gemv.decode_gemv_reference(x, weight).view(residual.shape)
    return add_rmsnorm_reference(delta, residual, norm_weight, eps)


def decode_sample(logits: torch.Tensor, u: torch.Tensor, sampling, rows: Rows) -> None:
    """A decode step's sampler and bookkeeping for every row, in place (ops/sample.py says what):
    logits (B, V), u (B,) fp32 uniforms (unused when greedy), the rows' state `rows`. The kernel
    (kernels/decode_sample.py: greedy, or a temperature without top-k and top-p), or the reference."""
    rt = current()
    v = logits.shape[-1]
    if not sample_kernel.serves(sampling.top_k, sampling.top_p, v) or logits.stride(-1) != 1:
        sample_append(logits, u, sampling, rows)
        return
    key = sample_kernel.sample_key(
        rt.arch, vocab=v, dtype=logits.dtype, greedy=sampling.greedy, aligned=aligned(logits, u, *rows[:7])
    )
    spec = lambda: sample_kernel.launch(key, logits, u, sampling.temperature, rows)  # noqa: E731
    if rt.use_kernel(key, logits):
        try:
            rt.launch(key, lambda: sample_kernel.run(spec()), spec)
            return
        except Exception as e:
            rt.kernel_failed(key, e)
    rt.record(key, "fwd", spec)
    sample_append(logits, u, sampling, rows)


# -- FP8 GEMM inputs (an FP8 teacher or student) ---------------------------------------------------
def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q (rows, K) float8_e4m3fn, scale (rows,) fp32) with x (..., K) ~ q * scale[:, None] row by
    row: the input of a row-wise scaled FP8 GEMM. No gradient (the FP8 teacher is frozen)."""
    rt = current()
    x2 = _rows(x)
    key = fp8_kernel.key(rt.arch, k=x2.shape[-1], dtype=x2.dtype, aligned=aligned(x2))
    if rt.use_kernel(key, x2):
        try:
            args = lambda: fp8_kernel.launch(key, x2)  # noqa: E731
            return rt.launch(key, lambda: fp8_kernel.run(args()), args)
        except Exception as e:
            rt.kernel_failed(key, e)
    rt.record(key, "fwd", lambda: fp8_kernel.launch(key, x2))
    return fp8_kernel.reference(x2)


def quantize_cols(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(qt (K, rows) float8_e4m3fn, scale (K,) fp32) with x (..., K) ~ (qt * scale[:, None])^T column by
    column: x^T as the row-wise scaled input of an FP8 GEMM that reduces over x's rows (an FP8
    student's backward, kdistill.models.fp8_train). Two kernels: the column maxima of each span of
    rows, then the scales and the transposed copy. No gradient."""
    rt = current()
    x2 = _rows(x)
    c, al = x2.shape[-1], aligned(x2)
    akey = fp8_cols_kernel.amax_key(rt.arch, c=c, dtype=x2.dtype, aligned=al)
    key = fp8_cols_kernel.key(rt.arch, c=c, dtype=x2.dtype, aligned=al)
    if rt.use_kernel(key, x2):
        try:
            part = lambda: fp8_cols_kernel.amax_launch(akey, x2)  # noqa: E731
            p = rt.launch(akey, lambda: fp8_cols_kernel.run(part()), part)
            args = lambda: fp8_cols_kernel.launch(key, x2, p)  # noqa: E731
            return rt.launch(key, lambda: fp8_cols_kernel.run(args()), args)
        except Exception as e:
            rt.kernel_failed(key, e)  # the pair falls back together: use_kernel asks for `key`
    rt.record(akey, "fwd", lambda: fp8_cols_kernel.amax_launch(akey, x2))
    rt.record(key, "fwd", lambda: fp8_cols_kernel.launch(key, x2, fp8_cols_kernel.partials(key, x2)))
    return fp8_cols_kernel.reference(x2)


# -- the KD head --------------------------------------------------------------------------------------
def _kd_chunk(
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
):
    """One chunk of the KD head on its kernel or its reference (same contract as
    `kdistill.ops.kd_loss.chunk_divergence_reference`)."""
    kw = dict(
        alpha=alpha,
        temperature=temperature,
        divergence=divergence,
        beta=beta,
        ignore_index=ignore_index,
        grad_scale=grad_scale,
        need_grad=need_grad,
        grad_dtype=grad_dtype,
    )
    rt = current()
    key = kd_kernel.key(
        rt.arch,
        vocab_size=s_logits.shape[1],
        divergence=divergence,
        logits_dtype=s_logits.dtype,
        has_kd=alpha > 0,
        need_grad=need_grad,
        grad_dtype=grad_dtype if need_grad else None,
        unit_t=float(temperature) == 1.0,
    )
    if rt.use_kernel(key, s_logits):
        try:
            # the kernel may write the gradient over s_logits: the chunk loop drops them right after
            return rt.launch(key, lambda: kd_kernel.kd_loss_chunk_triton(s_logits, t_logits, labels, **kw))
        except Exception as e:
            rt.kernel_failed(key, e)
    rt.record(key, "fwd", lambda: kd_kernel.launch_args(s_logits.detach().clone(), t_logits, labels, **kw))
    return kd_ops.chunk_divergence_reference(s_logits, t_logits, labels, **kw)


def kd_loss(
    s_hidden: torch.Tensor,
    s_weight: torch.Tensor,
    t_hidden: torch.Tensor | None,
    t_weight: torch.Tensor | None,
    labels: torch.Tensor,
    *,
    alpha: float,
    temperature: float,
    divergence: str,
    beta: float = 0.5,
    ignore_index: int = -100,
    chunk_size: int,
    teacher_logprobs: torch.Tensor | None = None,
    teacher_mixture: list[tuple[torch.Tensor, torch.Tensor, float]] | None = None,
    n_tokens: int | None = None,
    logits_dtype: str = "float32",
    rows: int | None = None,
) -> KDLossResult:
    """(1 - alpha) CE + alpha T^2 D(teacher_T || student_T), chunked through the lm_heads (see
    kdistill.ops.kd_loss), each chunk on the KD head kernel or its reference. With teacher_logprobs
    (N, Vt) (a teacher cache) the chunk's teacher logits are those rows instead of t_hidden x t_weight;
    the KD head kernel takes teacher logits either way, so the kernel and its key are the same; so
    with teacher_mixture [(t_hidden_i, t_weight_i, weight_i), ...] (several teachers: each chunk's
    teacher logits are T log of their mixture in probability space). n_tokens: the labels' count
    from their host copy (kdistill.ops.kd_loss.label_count), so that nothing here waits for the GPU.
    logits_dtype: "float32" or "compute" (kd.logits_dtype: the chunk logits in the operands' dtype).
    rows: the head's fixed row count instead of n_tokens (a captured generated step; see kd_ops.kd_loss)."""
    return kd_ops.kd_loss(
        s_hidden,
        s_weight,
        t_hidden,
        t_weight,
        labels,
        alpha=alpha,
        temperature=temperature,
        divergence=divergence,
        beta=beta,
        ignore_index=ignore_index,
        chunk_size=chunk_size,
        chunk_fn=_kd_chunk,
        teacher_logprobs=teacher_logprobs,
        teacher_mixture=teacher_mixture,
        n_tokens=n_tokens,
        logits_dtype=logits_dtype,
        rows=rows,
    )
