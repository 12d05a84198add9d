"""The KD loss head through the dispatcher: a chunk function for `kdistill.ops.kd_loss.kd_loss`.

    from kdistill.kernels.kd import kd_chunk
    kd_loss(h, W, ht, Wt, labels, ..., chunk_fn=kd_chunk)

Per chunk it computes the key with `kd_loss_kernel_key` (kernels/triton/kd_loss.py, wrapped by
keys.kd_loss_key), records it, and runs `kd_loss_chunk_triton` on a GPU in triton mode, else
`chunk_divergence_reference` (one warning per key on a kernel failure; KernelError in strict mode).
"""

from __future__ import annotations

import torch

from kdistill.kernels import keys, runtime


def kd_chunk_key(
    arch: str,
    s_logits: torch.Tensor,
    *,
    alpha: float,
    divergence: str,
    need_grad: bool,
    grad_dtype: torch.dtype | None,
) -> keys.KernelKey:
    return keys.kd_loss_key(
        arch,
        vocab_size=s_logits.shape[1],
        divergence=divergence,
        logits_dtype=s_logits.dtype,
        has_kd=alpha > 0,
        need_grad=need_grad,
        grad_dtype=grad_dtype if need_grad else None,
    )


def kd_chunk(
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
    """Same signature and contract as `chunk_divergence_reference`."""
    from kdistill.ops.kd_loss import chunk_divergence_reference

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
    rt = runtime.current()
    key = kd_chunk_key(
        rt.arch, s_logits, alpha=alpha, divergence=divergence, need_grad=need_grad, grad_dtype=grad_dtype
    )
    if rt.use_kernel(key, s_logits):
        try:
            from kdistill.kernels.triton.kd_loss import kd_loss_chunk_triton

            # the kernel may write the gradient over s_logits: the chunk loop drops them right after
            return rt.launch(key, lambda: kd_loss_chunk_triton(s_logits, t_logits, labels, **kw))
        except Exception as e:
            rt.kernel_failed(key, e)
    rt.record(key, "fwd", lambda: _launch_args(s_logits, t_logits, labels, kw))
    return chunk_divergence_reference(s_logits, t_logits, labels, **kw)


def _launch_args(s_logits, t_logits, labels, kw):
    from kdistill.kernels.triton.kd_loss import launch_args

    return launch_args(s_logits.detach().clone(), t_logits, labels, **kw)
