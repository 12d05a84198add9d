"""An FP8 student (`runtime.precision=fp8`): its decoder linears train through row-wise scaled FP8 GEMMs.

    n = convert_student_to_fp8(student)   # q/k/v/o, gate/up/down of every block: FP8TrainLinear, in place
    y = fp8_train_linear(x, w, bias)      # x (..., K), w (N, K) fp32 master weight -> (..., N)

The parameters stay the fp32 masters the optimizer updates (FP8TrainLinear is an nn.Linear: same
names, same state dict, same export); every call quantises from them. Each of the three GEMMs of a
linear layer runs as one `torch._scaled_mm` on float8_e4m3fn operands with fp32 row-wise scales and
a bf16 output (fp32 accumulation inside):

    forward   y      = x  @ W^T    a = xq    (M, K) per token,           b = Wq^T  (K, N), per out channel
    backward  grad_x = gy @ W      a = gyq   (M, N) per token,           b = (W^T)q^T  (N, K), per in channel
              grad_W = gy^T @ x    a = gy^Tq (N, M) per out channel,     b = (x^T)q^T  (M, K), per in channel

Row-wise operands come from the fp8_quant kernel (dispatch.quantize_rows); operands scaled per column
of the original tensor (W^T, gy^T, x^T) from fp8_quant_cols (dispatch.quantize_cols), which writes the
transposed fp8 copy row-major with its scales. Each kernel writes its GEMM input and its scales in
one pass. For backward the layer keeps x^T in fp8 (1 byte per element, plus K scales) instead of x in
the compute dtype; for W, the parameter itself (no copy), or, for the stacked q/k/v and gate/up
weights (a concatenation made at each call), their fp8 W^T (1 byte per weight instead of 4).

`torch._scaled_mm`'s rules on a GPU: a row-major, b column-major (here: the transpose of a row-major
fp8 tensor), the reduction and the output's columns multiples of 16, scales (rows of a, 1) and (1, columns of b) fp32, a
bf16 output. A GEMM whose shapes break them (tiny test models, an odd token count in grad_W's
reduction) runs on the dequantised operands instead (`dequantized_mm`): the same values, at the
compute dtype's speed. On the CPU `torch._scaled_mm` takes any shape and writes fp32, so the CPU run
is the FP8 emulation the tests check. FP8 pays only on compute capability 8.9 or newer (Ada, Hopper,
Blackwell); kdistill.models.fp8.check_device refuses older GPUs.

The lm_head (the KD head's GEMMs), embeddings and norms stay as they are.
"""

from __future__ import annotations

import torch
from torch import nn

from kdistill import dispatch


def _scaled_mm_ok(a: torch.Tensor, b: torch.Tensor) -> bool:
    """a (M, R) and b (N, R), both row-major fp8: whether torch._scaled_mm takes a @ b^T. On a GPU the
    reduction R and the output's columns N must be multiples of 16 (M is free); the CPU's
    implementation takes any shape."""
    if not a.is_cuda:
        return True
    return a.shape[1] % 16 == 0 and b.shape[0] % 16 == 0


def dequantized_mm(
    a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """(a * a_scale[:, None]) @ (b * b_scale[:, None])^T in fp32: the value of the scaled FP8 GEMM on
    dequantised operands, (M, N) in out_dtype."""
    return ((a.float() * a_scale[:, None]) @ (b.float() * b_scale[:, None]).t()).to(out_dtype)


def scaled_mm(
    a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """a (M, R) fp8 with a_scale (M,), b (N, R) fp8 with b_scale (N,), both row-major -> a @ b^T (M, N)
    in out_dtype, scales applied in the GEMM's epilogue."""
    with torch.autocast(a.device.type, enabled=False):  # fp8 operands: no autocast rule applies
        if not _scaled_mm_ok(a, b):
            return dequantized_mm(a, a_scale, b, b_scale, out_dtype)
        # On a GPU row-wise scaling writes bf16 only; the CPU writes the dtype asked for.
        mm_dtype = torch.bfloat16 if a.is_cuda else out_dtype
        y = torch._scaled_mm(a, b.t(), scale_a=a_scale[:, None], scale_b=b_scale[None, :], out_dtype=mm_dtype)
        return y if y.dtype == out_dtype else y.to(out_dtype)


class FP8LinearFunction(torch.autograd.Function):
    """y = x @ W^T (+ bias) with the three GEMMs in FP8 (see the module docstring). x (M, K) in the
    compute dtype, W (N, K) (fp32 masters), bias (N,) or None; y (M, N) in out_dtype."""

    @staticmethod
    def forward(ctx, x, w, bias, out_dtype):  # type: ignore[override]
        xq, xs = dispatch.quantize_rows(x)  # (M, K), (M,)
        wq, ws = dispatch.quantize_rows(w)  # (N, K), (N,)
        y = scaled_mm(xq, xs, wq, ws, out_dtype)  # (M, N)
        if bias is not None:
            y = y + bias.to(out_dtype)
        ctx.x_dtype, ctx.w_dtype, ctx.has_bias = x.dtype, w.dtype, bias is not None
        saved: list[torch.Tensor] = []
        ctx.w_leaf = w.is_leaf
        if ctx.needs_input_grad[0]:
            # W^T for grad_x: a parameter is kept as is (no copy) and quantised in backward; a stacked
            # weight (q/k/v, gate/up: a fresh fp32 concatenation) is quantised now and kept in fp8
            # (1 byte per weight instead of 4)
            saved += [w] if ctx.w_leaf else list(dispatch.quantize_cols(w))  # (K, N), (K,)
        if ctx.needs_input_grad[1]:
            saved += list(dispatch.quantize_cols(x))  # (K, M), (K,): x^T for grad_W, kept instead of x
        ctx.save_for_backward(*saved)
        return y

    @staticmethod
    def backward(ctx, gy):  # type: ignore[override]
        saved = list(ctx.saved_tensors)
        gy = gy.contiguous()  # (M, N)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            gq, gs = dispatch.quantize_rows(gy)  # (M, N), (M,)
            if ctx.w_leaf:
                wtq, wts = dispatch.quantize_cols(saved.pop(0))  # (K, N), (K,)
            else:
                wtq, wts = saved.pop(0), saved.pop(0)
            grad_x = scaled_mm(gq, gs, wtq, wts, ctx.x_dtype)  # (M, K)
        if ctx.needs_input_grad[1]:
            xtq, xts = saved
            gtq, gts = dispatch.quantize_cols(gy)  # (N, M), (N,)
            grad_w = scaled_mm(gtq, gts, xtq, xts, ctx.w_dtype)  # (N, K)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = gy.float().sum(0)  # (N,), cast to the bias's dtype by autograd
        return grad_x, grad_w, grad_b, None


def linear_dtype(x: torch.Tensor, w: torch.Tensor) -> torch.dtype:
    """The dtype F.linear would compute in: the autocast dtype under autocast, else the promotion."""
    dev = x.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return torch.promote_types(x.dtype, w.dtype)


def fp8_train_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., K) -> (..., N) through FP8LinearFunction, in the dtype nn.Linear would give (the autocast
    dtype under autocast). x is cast to that dtype first, as autocast casts a linear's input."""
    dtype = linear_dtype(x, w)
    x2 = x.reshape(-1, x.shape[-1])
    if x2.dtype != dtype:
        x2 = x2.to(dtype)
    y = FP8LinearFunction.apply(x2, w, bias, dtype)
    return y.view(*x.shape[:-1], w.shape[0])


class FP8TrainLinear(nn.Linear):
    """An nn.Linear (fp32 master weight and bias, same state dict) whose forward and backward GEMMs run
    in FP8 (fp8_train_linear). Made from an nn.Linear in place by convert_student_to_fp8."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_train_linear(x, self.weight, self.bias)


PROJECTIONS = (
    ("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
    ("mlp", ("gate_proj", "up_proj", "down_proj")),
)


def convert_student_to_fp8(model: nn.Module) -> int:
    """Every decoder block's plain nn.Linear projections become FP8TrainLinear, in place (the module's
    class changes; its parameters, their optimizer state and hooks are the same objects); returns
    how many. The lm_head, embeddings and norms are left alone."""
    n = 0
    for block in model.model.layers:  # type: ignore[union-attr]
        for part, names in PROJECTIONS:
            parent = getattr(block, part)
            for name in names:
                lin = getattr(parent, name, None)
                if type(lin) is nn.Linear:
                    lin.__class__ = FP8TrainLinear
                    n += 1
    return n
