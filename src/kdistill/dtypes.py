"""Dtype names: the one table that maps between torch dtypes, config names, kernel-key names and
safetensors header names.

    dtype_name(torch.bfloat16) == dtype_name("bfloat16") == dtype_name("bf16") == "bf16"
    torch_dtype("bf16") is torch.bfloat16
    long_name("bf16") == "bfloat16"        # config.json / runtime.dtype spelling
    SAFETENSORS["BF16"] == "bf16"
"""

from __future__ import annotations

from typing import Any

import torch

# short name -> (torch dtype, long name)
_TABLE: dict[str, tuple[torch.dtype, str]] = {
    "fp32": (torch.float32, "float32"),
    "bf16": (torch.bfloat16, "bfloat16"),
    "fp16": (torch.float16, "float16"),
}
SHORT_NAMES: tuple[str, ...] = tuple(_TABLE)  # ("fp32", "bf16", "fp16")
LONG_NAMES: tuple[str, ...] = tuple(v[1] for v in _TABLE.values())  # ("float32", "bfloat16", "float16")
_ALIASES = {
    **{k: k for k in _TABLE},
    **{v[1]: k for k, v in _TABLE.items()},
    "float": "fp32",
    "half": "fp16",
}
# safetensors header dtype -> short name (the float types a checkpoint may hold)
SAFETENSORS: dict[str, str] = {"F32": "fp32", "F16": "fp16", "BF16": "bf16"}


def dtype_name(dtype: Any) -> str:
    """torch.bfloat16 / 'bfloat16' / 'bf16' / 'torch.bfloat16' -> 'bf16'. ValueError for others."""
    s = str(dtype).replace("torch.", "")
    if s not in _ALIASES:
        raise ValueError(f"dtype {dtype} is not one of float32, bfloat16 or float16")
    return _ALIASES[s]


def torch_dtype(dtype: Any) -> torch.dtype:
    """'bf16' / 'bfloat16' / torch.bfloat16 -> torch.bfloat16."""
    return _TABLE[dtype_name(dtype)][0]


def long_name(dtype: Any) -> str:
    """'bf16' / torch.bfloat16 -> 'bfloat16'."""
    return _TABLE[dtype_name(dtype)][1]


def promote(a: str, b: str) -> str:
    """torch.promote_types on short names (the two half types promote to fp32)."""
    a, b = dtype_name(a), dtype_name(b)
    return a if a == b else "fp32"
