"""SwiGLU activation of the Llama/Qwen MLP: silu(gate) * up.

Shapes: gate, up (..., I) -> (..., I). The MLP is down(swiglu(gate(x), up(x))).

The file reads top to bottom: reference math, kernel key, dispatch (kernels/runtime.py) to the Triton
kernel in kernels/triton/swiglu.py or to the reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kdistill.kernels import keys, runtime


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, in the inputs' dtype (as transformers computes it)."""
    return F.silu(gate) * up


# -- keys ---------------------------------------------------------------------------------------------
def _rows(t: torch.Tensor) -> torch.Tensor:
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.is_contiguous() else t2.contiguous()


def fwd_key(arch: str, gate: torch.Tensor, up: torch.Tensor) -> keys.KernelKey:
    return keys.swiglu_fwd_key(
        arch, inter=gate.shape[-1], dtype=gate.dtype, aligned=runtime.aligned(_rows(gate), _rows(up))
    )


def bwd_key(arch: str, dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> keys.KernelKey:
    return keys.swiglu_bwd_key(
        arch,
        inter=gate.shape[-1],
        dtype=gate.dtype,
        aligned=runtime.aligned(_rows(dy), _rows(gate), _rows(up)),
    )


# -- dispatch -----------------------------------------------------------------------------------------
def _triton():
    from kdistill.kernels.triton import swiglu as kernel

    return kernel


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up."""
    rt = runtime.current()
    key = fwd_key(rt.arch, gate, up)

    def bwd_key_fn(dy, g, u):
        kb = bwd_key(rt.arch, dy, g, u)
        rt.record(kb, "bwd", lambda: _triton().bwd_launch(kb, dy, g, u))
        return kb

    if rt.use_kernel(key, gate, up):
        try:
            return rt.launch(
                key,
                lambda: _triton().SwiGLUFunction.apply(gate, up, key, bwd_key_fn, rt.kernel_failed),
                lambda: _triton().fwd_launch(key, gate, up),
            )
        except Exception as e:
            rt.kernel_failed(key, e)
    rt.record(key, "fwd", lambda: _triton().fwd_launch(key, gate, up))
    y = swiglu_reference(gate, up)
    rt.on_backward([y], lambda grads: bwd_key_fn(grads[0].detach(), gate.detach(), up.detach()))
    return y
