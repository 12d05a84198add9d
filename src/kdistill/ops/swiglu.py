"""SwiGLU activation of the Llama/Qwen MLP: silu(gate) * up.

Shapes: gate, up (..., I) -> (..., I). The MLP is down(swiglu(gate(x), up(x))).

Reference math only (PyTorch); kdistill.dispatch picks it or the Triton kernel in kernels/swiglu.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, in the inputs' dtype (as transformers computes it)."""
    return F.silu(gate) * up
