"""An FP8 teacher (`teacher.precision=fp8`): its decoder linears as row-wise scaled FP8 GEMMs.

    n = convert_to_fp8(teacher)          # every q/k/v/o/gate/up/down linear of every block, in place
    y = layer(x)                         # FP8Linear: quantise x per row, one FP8 GEMM, bf16 out

The frozen teacher's weights are quantised once, at load, per output channel: W ~ Wq * w_scale[:, None]
with Wq float8_e4m3fn. Each GEMM input is quantised per row (token) by the fp8_quant kernel
(kdistill.dispatch.quantize_rows, one pass over x), and the product runs as
`torch._scaled_mm(xq, Wq^T, scale_a=x_scale[:, None], scale_b=w_scale[None, :])`, which applies both
scales in its epilogue and writes bf16:

    y_ij = x_scale_i * w_scale_j * sum_k xq_ik Wq_jk     (fp32 accumulation)

Embeddings, norms and the lm_head stay in the compute dtype: the lm_head's logits are the KD target,
and the KD head already reads them chunk by chunk in fp32. Where the GEMM's dimensions are not
multiples of 16 (tiny test models) or there is no GPU, the same product runs on dequantised operands
(`fp8_linear_reference`): the values FP8 gives, at matmul speed in the compute dtype.

FP8 GEMMs need compute capability 8.9 or newer (Ada, Hopper, Blackwell); `check_device` refuses others
with one line. The q/k/v and gate/up projections run as one GEMM each (decoder.Attention.project_qkv,
decoder.MLP): their FP8 weights are concatenated as the bf16 ones are.
"""

from __future__ import annotations

import torch
from torch import nn

from kdistill import dispatch
from kdistill.errors import UserError
from kdistill.kernels import fp8_quant

MIN_CAPABILITY = (8, 9)


class FP8Linear(nn.Module):
    """A frozen linear layer in FP8: weight (N, K) float8_e4m3fn, weight_scale (N,) fp32, bias (N,) or
    None in the compute dtype. Built from an nn.Linear by `from_linear`."""

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.register_buffer("weight", weight)
        self.register_buffer("weight_scale", weight_scale)
        self.register_buffer("bias", bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> FP8Linear:
        q, s = quantize_weight(linear.weight.detach())
        bias = linear.bias.detach().clone() if linear.bias is not None else None
        return cls(q, s, bias)

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.weight_scale, self.bias)


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(Wq (N, K) float8_e4m3fn, scale (N,) fp32) per output channel (row), once at load."""
    return fp8_quant.reference(w)


def _stacked(parts: list[torch.Tensor]) -> torch.Tensor:
    """The parts stacked along dim 0: a view when they are consecutive rows of one buffer (as
    convert_to_fp8 lays them out), else a concatenation."""
    first = parts[0]
    rows = sum(p.shape[0] for p in parts)
    shape = (rows, *first.shape[1:])
    offset = first.storage_offset()
    for p in parts:
        if not p.is_contiguous() or p.untyped_storage().data_ptr() != first.untyped_storage().data_ptr():
            break
        if p.storage_offset() != offset:
            break
        offset += p.numel()
    else:
        return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), shape)
    with torch.autocast(first.device.type, enabled=False):  # autocast has no rule for fp8 tensors
        return torch.cat(parts)


def fused(layers: list[FP8Linear]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The weights, scales and biases of several FP8 layers that read the same input, stacked by
    output channel: one GEMM computes all their outputs (q/k/v, gate/up). No copy for layers that
    convert_to_fp8 made together."""
    biases = [m.bias for m in layers]
    b = _stacked(biases) if all(x is not None for x in biases) else None
    return _stacked([m.weight for m in layers]), _stacked([m.weight_scale for m in layers]), b


def _scaled_mm_ok(xq: torch.Tensor, wq: torch.Tensor) -> bool:
    return xq.is_cuda and xq.shape[1] % 16 == 0 and wq.shape[0] % 16 == 0


def fp8_linear(
    x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x (..., K) in the compute dtype -> (..., N) in x's dtype through one row-wise scaled FP8 GEMM."""
    out_dtype = x.dtype if x.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
    xq, x_scale = dispatch.quantize_rows(x)  # (M, K), (M,)
    if _scaled_mm_ok(xq, wq):
        y = torch._scaled_mm(
            xq, wq.t(), scale_a=x_scale[:, None], scale_b=w_scale[None, :].float(), out_dtype=out_dtype
        )
    else:
        y = fp8_linear_reference(xq, x_scale, wq, w_scale, x.dtype)
    if bias is not None:
        y = y + bias.to(y.dtype)
    y = y.to(x.dtype) if x.dtype != y.dtype else y
    return y.view(*x.shape[:-1], wq.shape[0])


def fp8_linear_reference(
    xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """The FP8 GEMM's value on dequantised operands, fp32 accumulation: (M, N) in out_dtype."""
    a = xq.float() * x_scale[:, None].float()
    b = wq.float() * w_scale[:, None].float()
    return (a @ b.t()).to(out_dtype)


# Linears that read the same input and run as one GEMM: quantised into one buffer, so that the
# decoder's stacked weights are views (`fused`), then the others one by one.
GROUPS = (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj")))
SINGLES = (("self_attn", "o_proj"), ("mlp", "down_proj"))


def _convert_group(parent: nn.Module, names: tuple[str, ...]) -> int:
    lins = [getattr(parent, n, None) for n in names]
    if not all(isinstance(lin, nn.Linear) for lin in lins):
        return 0
    q, s = quantize_weight(torch.cat([lin.weight.detach() for lin in lins]))  # (sum N, K), (sum N,)
    has_bias = all(lin.bias is not None for lin in lins)
    b = torch.cat([lin.bias.detach() for lin in lins]) if has_bias else None
    start = 0
    for name, lin in zip(names, lins):
        end = start + lin.out_features
        bias = (
            b[start:end] if b is not None else (lin.bias.detach().clone() if lin.bias is not None else None)
        )
        setattr(parent, name, FP8Linear(q[start:end], s[start:end], bias))
        start = end
    return len(names)


def convert_to_fp8(model: nn.Module) -> int:
    """Replace every decoder block's linears (`model.layers.N.{self_attn,mlp}.*_proj`) of a frozen
    model by FP8Linear, in place, freeing the bf16 weights; returns how many were replaced."""
    n = 0
    for block in model.model.layers:  # type: ignore[union-attr]
        for part, names in GROUPS:
            n += _convert_group(getattr(block, part), names)
        for part, name in SINGLES:
            parent = getattr(block, part)
            lin = getattr(parent, name, None)
            if isinstance(lin, nn.Linear):
                setattr(parent, name, FP8Linear.from_linear(lin))
                n += 1
    return n


def check_device(device: torch.device, field: str = "teacher.precision") -> None:
    """A one-line UserError naming `field` (teacher.precision or runtime.precision) for a GPU without
    FP8 GEMMs (compute capability below 8.9). The CPU runs the FP8 emulation (the values FP8 gives,
    for tests), so it is let through."""
    if device.type != "cuda":
        return
    cc = torch.cuda.get_device_capability(device)
    if cc < MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        raise UserError(
            f"{field}=fp8 needs FP8 matrix units (compute capability 8.9 or newer: Ada, Hopper, "
            f"Blackwell); {name} is sm_{cc[0]}{cc[1]}: use {field}=auto"
        )
