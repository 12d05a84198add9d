"""Library calls prewarm runs once at the planned shapes (cuBLAS GEMMs, SDPA): keys, no Triton.

sdpa_key("sm_90", batch=8, q_heads=14, kv_heads=2, seq=2048, head_dim=64, dtype="bf16", grad=True)
sdpa_key(..., masked=True)      # packed conversations: SDPA with a (B, 1, T, T) document mask
gemm_key("sm_90", m=16384, n=896, k=4864, dtype="bf16", grad=True)
fp8_gemm_key("sm_90", m=16384, n=2048, k=1536, dtype="bf16")   # an FP8 teacher's row-wise scaled GEMM
"""

from __future__ import annotations

from typing import Any

import torch

from kdistill.dtypes import torch_dtype
from kdistill.kernels.keys import KernelKey, dtype_name, make_key
from kdistill.kernels.spec import LibraryOp
from kdistill.ops.attention import attention_reference, document_bias


def sdpa_key(
    arch: str,
    *,
    batch: int,
    q_heads: int,
    kv_heads: int,
    seq: int,
    head_dim: int,
    dtype: str,
    grad: bool,
    masked: bool = False,
) -> KernelKey:
    """Causal SDPA at this shape (prewarm runs it once, forward and, if grad, backward). `masked`: with
    a boolean document mask instead of is_causal (another SDPA backend); the flag is in the key only
    when set, so the keys of unmasked attention are unchanged."""
    extra: dict[str, Any] = {"masked": True} if masked else {}
    return make_key(
        "sdpa",
        arch,
        B=int(batch),
        HQ=int(q_heads),
        HKV=int(kv_heads),
        T=int(seq),
        D=int(head_dim),
        dtype=dtype_name(dtype),
        grad=bool(grad),
        **extra,
    )


def gemm_key(arch: str, *, m: int, n: int, k: int, dtype: str, grad: bool) -> KernelKey:
    """An (m x k) @ (k x n) cuBLAS GEMM (prewarm runs it, and its two backward GEMMs if grad)."""
    return make_key("gemm", arch, M=int(m), N=int(n), K=int(k), dtype=dtype_name(dtype), grad=bool(grad))


def _run_sdpa(key: KernelKey, device: Any) -> None:
    tdt, grad = torch_dtype(key["dtype"]), bool(key["grad"])
    b, t, d = key["B"], key["T"], key["D"]
    with torch.enable_grad() if grad else torch.no_grad():
        q = torch.zeros((b, key["HQ"], t, d), dtype=tdt, device=device, requires_grad=grad)  # (B, Hq, T, D)
        kv = [
            torch.zeros((b, key["HKV"], t, d), dtype=tdt, device=device, requires_grad=grad) for _ in range(2)
        ]
        mask = None
        if key.get("masked", False):  # two documents per row, as packed conversations have
            doc = (torch.arange(t, device=device) >= t // 2).to(torch.int32).expand(b, t)
            mask = document_bias(doc, tdt)  # as the decoder passes it
        y = attention_reference(q, *kv, mask=mask)
        if grad:
            y.backward(torch.ones_like(y))


def _run_gemm(key: KernelKey, device: Any) -> None:
    tdt, grad = torch_dtype(key["dtype"]), bool(key["grad"])
    with torch.enable_grad() if grad else torch.no_grad():
        a = torch.zeros((key["M"], key["K"]), dtype=tdt, device=device, requires_grad=grad)
        w = torch.zeros((key["N"], key["K"]), dtype=tdt, device=device, requires_grad=grad)
        y = torch.nn.functional.linear(a, w)
        if grad:
            y.backward(torch.ones_like(y))


def fp8_gemm_key(arch: str, *, m: int, n: int, k: int, dtype: str) -> KernelKey:
    """An (m x k) @ (k x n) row-wise scaled FP8 GEMM (torch._scaled_mm) writing `dtype`; no grad."""
    return make_key("gemm_fp8", arch, M=int(m), N=int(n), K=int(k), dtype=dtype_name(dtype))


def _run_fp8_gemm(key: KernelKey, device: Any) -> None:
    if torch.device(device).type != "cuda" or key["K"] % 16 or key["N"] % 16:
        return  # the dequantised reference runs instead (kdistill.models.fp8): nothing to warm
    a = torch.zeros((key["M"], key["K"]), device=device).to(torch.float8_e4m3fn)
    b = torch.zeros((key["N"], key["K"]), device=device).to(torch.float8_e4m3fn)
    sa = torch.ones((key["M"], 1), device=device)
    sb = torch.ones((1, key["N"]), device=device)
    torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch_dtype(key["dtype"]))


SDPA = LibraryOp("sdpa", sdpa_key, _run_sdpa)
FP8_GEMM = LibraryOp("gemm_fp8", fp8_gemm_key, _run_fp8_gemm)
GEMM = LibraryOp("gemm", gemm_key, _run_gemm)
