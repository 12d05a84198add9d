"""Rotary position embedding (RoPE) applied to q and k, in the half-rotation layout of Llama/Qwen.

    rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2])
    q' = q * cos + rotate_half(q) * sin

Shapes: q (B, Hq, T, D), k (B, Hkv, T, D); cos, sin (T, D) in fp32, built by `rope_tables`.

The file reads top to bottom: reference math, kernel key, dispatch (kernels/runtime.py) to the Triton
kernel in kernels/triton/rope.py or to the reference.
"""

from __future__ import annotations

import torch

from kdistill.kernels import keys, runtime


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def rope_reference(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k. cos/sin are cast to q's dtype first, as transformers does."""
    c, s = cos.to(q.dtype), sin.to(q.dtype)
    return q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s


# -- keys ---------------------------------------------------------------------------------------------
def _heads(t: torch.Tensor) -> torch.Tensor:
    """What the kernel receives for q/k (or their grads): any strides with a contiguous last dim."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _table(t: torch.Tensor) -> torch.Tensor:
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.dtype == torch.float32 and t2.is_contiguous() else t2.float().contiguous()


def rope_key(
    arch: str,
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    backward: bool,
) -> keys.KernelKey:
    fn = keys.rope_bwd_key if backward else keys.rope_fwd_key
    return fn(
        arch,
        head_dim=q.shape[-1],
        q_heads=q.shape[1],
        kv_heads=k.shape[1],
        dtype=q.dtype,
        aligned=runtime.aligned(_heads(q), _heads(k), _table(cos), _table(sin)),
    )


# -- dispatch -----------------------------------------------------------------------------------------
def _triton():
    from kdistill.kernels.triton import rope as kernel

    return kernel


def apply_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE on q (B, Hq, T, D) and k (B, Hkv, T, D). `theta` identifies the tables (kernel key)."""
    rt = runtime.current()
    key = rope_key(rt.arch, q, k, cos, sin, backward=False)

    def bwd_key_fn(dq, dk, c, s):
        kb = rope_key(rt.arch, dq, dk, c, s, backward=True)
        rt.record(kb, "bwd", lambda: _triton().launch(kb, dq, dk, c, s, inverse=True))
        return kb

    if rt.use_kernel(key, q, k):
        try:
            return rt.launch(
                key,
                lambda: _triton().RopeFunction.apply(q, k, cos, sin, key, bwd_key_fn, rt.kernel_failed),
                lambda: _triton().launch(key, q, k, cos, sin, inverse=False),
            )
        except Exception as e:
            rt.kernel_failed(key, e)
    rt.record(key, "fwd", lambda: _triton().launch(key, q, k, cos, sin, inverse=False))
    qo, ko = rope_reference(q, k, cos, sin)

    def record_bwd(grads):
        dq = grads[0] if grads[0] is not None else torch.zeros_like(qo)
        dk = grads[1] if grads[1] is not None else torch.zeros_like(ko)
        bwd_key_fn(dq.detach(), dk.detach(), cos, sin)

    rt.on_backward([qo, ko], record_bwd)
    return qo, ko
