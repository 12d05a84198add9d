"""Kernel keys: the ONE place where a kernel's specialization is spelled.

A `KernelKey` names one compiled kernel binary: op (kernel) name, GPU arch, and every parameter the
compiled code depends on — constexpr sizes, eps and rope theta as exact float64 bit patterns, pointer
dtypes, pointer alignment (Triton specializes a pointer on 16-byte alignment), block sizes, num_warps
and num_stages. Forward and backward are separate kernels with separate keys.

    key = rmsnorm_fwd_key("sm_90", hidden=896, eps=1e-6, dtype="bf16", w_dtype="bf16", residual=True)
    str(key)   # 'rmsnorm_fwd[sm_90](BLOCK_H=1024,BLOCK_M=2,EPS=f64:3eb0c6f7a0b5ed8d,...)'
    source_spec(key)   # the (signature, constexprs, attrs, options) Triton compiles for this key

The dispatcher (kernels/runtime.py) calls these functions for every launch, the planner
(kernels/plan.py) calls them for the spec, prewarm and the cross-arch build compile `source_spec(key)`.
Block sizes and warps are chosen here (the `*_config` functions) and nowhere else.

Runtime integers (row counts, strides, sequence length) are declared `do_not_specialize` in the
kernels, so Triton derives no `==1` or divisible-by-16 variant from them: one binary serves every
batch size and sequence length, and the key does not depend on them. They must fit in int32 (Triton
would otherwise pick an i64 variant); the launchers refuse larger values with a KernelError.
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Sequence
from typing import Any

Param = str | int | bool | None

DTYPES = ("fp32", "bf16", "fp16")
ARCHS = ("sm_80", "sm_89", "sm_90", "sm_100", "sm_120")  # what `kdistill kernels build` targets by default
DEFAULT_ARCH = "sm_90"  # keys are computed for this arch when there is no GPU and runtime.arch is auto

# Kernel signatures, in argument order: (name, kind). kind is "*<dtype param>" or "*fp32" for a
# pointer ("in" pointers have caller-given alignment, "out" pointers are fresh allocations), "i32"
# for a do_not_specialize runtime integer, "constexpr" for a compile-time constant taken from the key.
SIGNATURES: dict[str, tuple[tuple[str, str, str], ...]] = {
    "rmsnorm_fwd": (
        ("X", "*dtype", "in"),
        ("R", "*r_dtype", "in"),
        ("W", "*w_dtype", "in"),
        ("Y", "*y_dtype", "out"),
        ("S", "*s_dtype", "out"),
        ("RSTD", "*fp32", "out"),
        ("n_rows", "i32", ""),
        ("H", "constexpr", ""),
        ("BLOCK_H", "constexpr", ""),
        ("BLOCK_M", "constexpr", ""),
        ("EPS", "constexpr", ""),
        ("HAS_RESIDUAL", "constexpr", ""),
    ),
    "rmsnorm_bwd": (
        ("DY", "*y_dtype", "in"),
        ("X", "*dtype", "in"),
        ("W", "*w_dtype", "in"),
        ("RSTD", "*fp32", "in"),
        ("DS", "*ds_dtype", "in"),
        ("DX", "*dtype", "out"),
        ("DW", "*fp32", "out"),
        ("n_rows", "i32", ""),
        ("H", "constexpr", ""),
        ("BLOCK_H", "constexpr", ""),
        ("BLOCK_M", "constexpr", ""),
        ("HAS_DRES", "constexpr", ""),
    ),
    "rope_fwd": (
        ("Q", "*dtype", "in"),
        ("K", "*dtype", "in"),
        ("COS", "*fp32", "in"),
        ("SIN", "*fp32", "in"),
        ("QO", "*dtype", "out"),
        ("KO", "*dtype", "out"),
        ("T", "i32", ""),
        ("sqb", "i32", ""),
        ("sqh", "i32", ""),
        ("sqt", "i32", ""),
        ("skb", "i32", ""),
        ("skh", "i32", ""),
        ("skt", "i32", ""),
        ("D", "constexpr", ""),
        ("HQ", "constexpr", ""),
        ("HKV", "constexpr", ""),
        ("BLOCK_D", "constexpr", ""),
        ("BLOCK_HQ", "constexpr", ""),
        ("BLOCK_HKV", "constexpr", ""),
    ),
    "swiglu_fwd": (
        ("G", "*dtype", "in"),
        ("U", "*dtype", "in"),
        ("Y", "*dtype", "out"),
        ("I", "constexpr", ""),
        ("BLOCK", "constexpr", ""),
    ),
    "swiglu_bwd": (
        ("DY", "*dtype", "in"),
        ("G", "*dtype", "in"),
        ("U", "*dtype", "in"),
        ("DG", "*dtype", "out"),
        ("DU", "*dtype", "out"),
        ("I", "constexpr", ""),
        ("BLOCK", "constexpr", ""),
    ),
}
SIGNATURES["rope_bwd"] = SIGNATURES["rope_fwd"]  # same arguments, the inverse rotation

# Library keys: not Triton kernels; prewarm runs them once at these shapes (cuBLAS / SDPA plans).
LIBRARY_OPS = ("sdpa", "gemm")
# Kernels owned elsewhere whose key comes from their own key function (wrapped into a KernelKey).
FOREIGN_OPS = ("kd_loss",)


# -- the key type ---------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, order=True)
class KernelKey:
    """One compiled kernel: op, arch and every specialization parameter (sorted name=value pairs)."""

    op: str
    arch: str
    params: tuple[tuple[str, Param], ...]

    def __post_init__(self) -> None:
        if list(self.params) != sorted(self.params, key=lambda p: p[0]):
            object.__setattr__(self, "params", tuple(sorted(self.params, key=lambda p: p[0])))

    def __str__(self) -> str:
        inner = ",".join(f"{k}={_fmt(v)}" for k, v in self.params)
        return f"{self.op}[{self.arch}]({inner})"

    def get(self, name: str, default: Any = None) -> Any:
        for k, v in self.params:
            if k == name:
                return v
        return default

    def __getitem__(self, name: str) -> Any:
        for k, v in self.params:
            if k == name:
                return v
        raise KeyError(f"kernel key {self} has no parameter '{name}'")

    @property
    def is_library(self) -> bool:
        return self.op in LIBRARY_OPS

    @classmethod
    def parse(cls, text: str) -> KernelKey:
        """Inverse of str(key)."""
        head, _, rest = text.partition("(")
        op, _, arch = head.partition("[")
        params: list[tuple[str, Param]] = []
        body = rest[:-1]
        for item in body.split(",") if body else []:
            k, _, v = item.partition("=")
            params.append((k, _unfmt(v)))
        return cls(op, arch.rstrip("]"), tuple(params))


def _fmt(v: Param) -> str:
    return str(v)


def _unfmt(v: str) -> Param:
    if v == "None":
        return None
    if v in ("True", "False"):
        return v == "True"
    try:
        return int(v)
    except ValueError:
        return v


def make_key(op: str, arch: str, **params: Param) -> KernelKey:
    for k, v in params.items():
        if v is not None and not isinstance(v, str | int | bool):
            raise TypeError(
                f"kernel key {op}: parameter {k}={v!r} must be str, int or bool (floats: f64_bits)"
            )
    return KernelKey(op, normalize_arch(arch), tuple(sorted(params.items())))


# -- exact encodings ------------------------------------------------------------------------------
def f64_bits(x: float) -> str:
    """A float as the hex of its IEEE float64 bit pattern: 'f64:3eb0c6f7a0b5ed8d' for 1e-6."""
    return "f64:" + struct.pack(">d", float(x)).hex()


def f64_value(bits: str) -> float:
    if not isinstance(bits, str) or not bits.startswith("f64:"):
        raise ValueError(f"not an f64 bit pattern: {bits!r}")
    return struct.unpack(">d", bytes.fromhex(bits[4:]))[0]


def normalize_arch(arch: str) -> str:
    """'sm_90', 'sm90', '90', '9.0' -> 'sm_90'."""
    a = str(arch).strip().lower().replace("sm_", "").replace("sm", "")
    if "." in a:
        major, minor = a.split(".", 1)
        a = f"{major}{minor}"
    if not a.isdigit():
        raise ValueError(f"GPU arch '{arch}' is not of the form sm_90")
    return f"sm_{a}"


def arch_capability(arch: str) -> int:
    """'sm_90' -> 90 (Triton's GPUTarget capability)."""
    return int(normalize_arch(arch)[3:])


def dtype_name(dtype: Any) -> str:
    """torch.bfloat16 / 'bfloat16' / 'bf16' -> 'bf16'."""
    s = str(dtype).replace("torch.", "")
    table = {
        "float32": "fp32",
        "fp32": "fp32",
        "float": "fp32",
        "bfloat16": "bf16",
        "bf16": "bf16",
        "float16": "fp16",
        "fp16": "fp16",
        "half": "fp16",
    }
    if s not in table:
        raise ValueError(f"dtype {dtype} has no kernel (expected float32, bfloat16 or float16)")
    return table[s]


def promote(a: str, b: str) -> str:
    """torch.promote_types on our dtype names."""
    return a if a == b else "fp32"


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _align(op: str, aligned: Sequence[bool] | None) -> str:
    """Alignment flags of every pointer argument, 'A' (16-byte aligned) or 'u': caller-given for
    inputs, 'A' for fresh outputs (torch allocations are aligned)."""
    ins = [a for a in SIGNATURES[op] if a[1].startswith("*") and a[2] == "in"]
    given = [True] * len(ins) if aligned is None else [bool(a) for a in aligned]
    if len(given) != len(ins):
        raise ValueError(f"{op}: {len(given)} alignment flags for {len(ins)} input pointers")
    it = iter(given)
    return "".join(
        ("A" if next(it) else "u") if a[2] == "in" else "A" for a in SIGNATURES[op] if a[1].startswith("*")
    )


# -- block sizes and warps: chosen here only -------------------------------------------------------
def rmsnorm_config(hidden: int) -> dict[str, int]:
    """Rows of `hidden` elements: a (BLOCK_M x BLOCK_H) tile per program, ~4K elements at least."""
    block_h = next_pow2(hidden)
    block_m = max(1, min(64, 4096 // block_h))
    warps = 4 if block_h * block_m <= 4096 else (8 if block_h <= 8192 else 16)
    return {"BLOCK_H": block_h, "BLOCK_M": block_m, "num_warps": warps, "num_stages": 1}


def rope_config(head_dim: int, q_heads: int, kv_heads: int) -> dict[str, int]:
    """One program per (batch, position): all q and k heads, the two halves of each head."""
    block_d = next_pow2(head_dim // 2)
    block_hq, block_hkv = next_pow2(q_heads), next_pow2(kv_heads)
    warps = 4 if block_hq * block_d <= 2048 else 8
    return {
        "BLOCK_D": block_d,
        "BLOCK_HQ": block_hq,
        "BLOCK_HKV": block_hkv,
        "num_warps": warps,
        "num_stages": 1,
    }


def swiglu_config(inter: int) -> dict[str, int]:
    """One program per (row, column block) of the intermediate activations."""
    block = min(1024, next_pow2(inter))
    return {"BLOCK": block, "num_warps": 4 if block <= 512 else 8, "num_stages": 1}


# -- one key function per kernel --------------------------------------------------------------------
def rmsnorm_fwd_key(
    arch: str,
    *,
    hidden: int,
    eps: float,
    dtype: str,
    w_dtype: str,
    residual: bool,
    r_dtype: str | None = None,
    aligned: Sequence[bool] | None = None,
) -> KernelKey:
    """y = rmsnorm(x [+ residual]) * w. dtype: x's; r_dtype: the residual's (default x's; the sum s has
    their promotion, y has promote(s, w)). aligned: X, R, W (R is X when there is no residual)."""
    dtype, w_dtype = dtype_name(dtype), dtype_name(w_dtype)
    r_dtype = dtype_name(r_dtype) if (residual and r_dtype is not None) else dtype
    s_dtype = promote(dtype, r_dtype)
    y_dtype = promote(s_dtype, w_dtype)
    return make_key(
        "rmsnorm_fwd",
        arch,
        H=int(hidden),
        EPS=f64_bits(eps),
        HAS_RESIDUAL=bool(residual),
        dtype=dtype,
        r_dtype=r_dtype,
        w_dtype=w_dtype,
        y_dtype=y_dtype,
        s_dtype=s_dtype if residual else y_dtype,  # without residual S aliases Y (unused)
        align=_align("rmsnorm_fwd", aligned),
        **rmsnorm_config(hidden),
    )


def rmsnorm_bwd_key(
    arch: str, *, hidden: int, dtype: str, w_dtype: str, has_dres: bool, aligned: Sequence[bool] | None = None
) -> KernelKey:
    """dx, dw of rmsnorm (eps is not needed: rstd is saved). dtype: the normalized input's (x + residual
    when fused). has_dres: a gradient reaches x + residual. aligned: DY, X, W, RSTD, DS (DS is DY when
    has_dres is false)."""
    dtype, w_dtype = dtype_name(dtype), dtype_name(w_dtype)
    y_dtype = promote(dtype, w_dtype)
    return make_key(
        "rmsnorm_bwd",
        arch,
        H=int(hidden),
        HAS_DRES=bool(has_dres),
        dtype=dtype,
        w_dtype=w_dtype,
        y_dtype=y_dtype,
        ds_dtype=dtype if has_dres else y_dtype,
        align=_align("rmsnorm_bwd", aligned),
        **rmsnorm_config(hidden),
    )


def _rope_key(
    op: str,
    arch: str,
    head_dim: int,
    q_heads: int,
    kv_heads: int,
    dtype: str,
    aligned: Sequence[bool] | None,
) -> KernelKey:
    return make_key(
        op,
        arch,
        D=int(head_dim),
        HQ=int(q_heads),
        HKV=int(kv_heads),
        dtype=dtype_name(dtype),
        align=_align(op, aligned),
        **rope_config(head_dim, q_heads, kv_heads),
    )


def rope_fwd_key(
    arch: str,
    *,
    head_dim: int,
    q_heads: int,
    kv_heads: int,
    dtype: str,
    aligned: Sequence[bool] | None = None,
) -> KernelKey:
    """Rotation of q and k with cos/sin tables. THETA identifies the tables. aligned: Q, K, COS, SIN."""
    return _rope_key("rope_fwd", arch, head_dim, q_heads, kv_heads, dtype, aligned)


def rope_bwd_key(
    arch: str,
    *,
    head_dim: int,
    q_heads: int,
    kv_heads: int,
    dtype: str,
    aligned: Sequence[bool] | None = None,
) -> KernelKey:
    """The inverse rotation of dq and dk. aligned: DQ, DK, COS, SIN."""
    return _rope_key("rope_bwd", arch, head_dim, q_heads, kv_heads, dtype, aligned)


def swiglu_fwd_key(arch: str, *, inter: int, dtype: str, aligned: Sequence[bool] | None = None) -> KernelKey:
    """silu(gate) * up over rows of `inter` elements. aligned: G, U."""
    return make_key(
        "swiglu_fwd",
        arch,
        I=int(inter),
        dtype=dtype_name(dtype),
        align=_align("swiglu_fwd", aligned),
        **swiglu_config(inter),
    )


def swiglu_bwd_key(arch: str, *, inter: int, dtype: str, aligned: Sequence[bool] | None = None) -> KernelKey:
    """d gate, d up. aligned: DY, G, U."""
    return make_key(
        "swiglu_bwd",
        arch,
        I=int(inter),
        dtype=dtype_name(dtype),
        align=_align("swiglu_bwd", aligned),
        **swiglu_config(inter),
    )


def sdpa_key(
    arch: str, *, batch: int, q_heads: int, kv_heads: int, seq: int, head_dim: int, dtype: str, grad: bool
) -> KernelKey:
    """Library: causal SDPA at this shape (prewarm runs it once, forward and, if grad, backward)."""
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
    )


def kd_loss_key(
    arch: str,
    *,
    vocab_size: int,
    divergence: str,
    logits_dtype: str,
    has_kd: bool,
    need_grad: bool,
    grad_dtype: str | None,
) -> KernelKey:
    """The KD loss head kernel (kernels/triton/kd_loss.py): its own `kd_loss_kernel_key`, as a KernelKey."""
    from kdistill.kernels.triton.kd_loss import kd_loss_kernel_key

    raw = kd_loss_kernel_key(
        vocab_size,
        divergence,
        _torch_dtype_name(logits_dtype),
        normalize_arch(arch),
        has_kd=has_kd,
        need_grad=need_grad,
        grad_dtype=_torch_dtype_name(grad_dtype) if grad_dtype is not None else None,
    )
    params = {k: v for k, v in raw if k not in ("op", "arch")}
    return make_key(dict(raw).get("op", "kd_loss"), arch, **params)


def kd_loss_raw_key(key: KernelKey) -> tuple:
    """Back to kd_loss_kernel_key's tuple form (for its build_source)."""
    return (("op", key.op), *key.params, ("arch", key.arch))


def _torch_dtype_name(d: Any) -> str:
    return {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[dtype_name(d)]


def gemm_key(arch: str, *, m: int, n: int, k: int, dtype: str, grad: bool) -> KernelKey:
    """Library: an (m x k) @ (k x n) cuBLAS GEMM (prewarm runs it, and its two backward GEMMs if grad)."""
    return make_key("gemm", arch, M=int(m), N=int(n), K=int(k), dtype=dtype_name(dtype), grad=bool(grad))


# -- what Triton compiles for a key -----------------------------------------------------------------
def constexpr_value(v: Param) -> Any:
    """A key parameter as the constexpr value the kernel receives (f64 bit patterns -> float)."""
    if isinstance(v, str) and v.startswith("f64:"):
        return f64_value(v)
    return v


def source_spec(key: KernelKey) -> dict[str, Any]:
    """The compiled specialization for `key`, in Triton's terms:

    signature {arg: '*bf16' | 'i32' | 'constexpr'}, constexprs {arg: value}, attrs {(index,): [['tt.divisibility', 16]]}
    for 16-byte-aligned pointers, options {num_warps, num_stages}. Derived from the key alone, so a key
    that lacks a parameter yields a specialization that differs from what its launch compiles.
    """
    if key.op not in SIGNATURES:
        raise ValueError(f"{key.op} is not a Triton kernel")
    sig: dict[str, str] = {}
    constexprs: dict[str, Any] = {}
    attrs: dict[tuple[int, ...], list[list[Any]]] = {}
    align = str(key.get("align", ""))
    ptr = 0
    for i, (name, kind, _) in enumerate(SIGNATURES[key.op]):
        if kind.startswith("*"):
            dt = kind[1:] if kind[1:] in DTYPES else key.get(kind[1:], "?")
            sig[name] = f"*{dt}"
            if ptr < len(align) and align[ptr] == "A":
                attrs[(i,)] = [["tt.divisibility", 16]]
            ptr += 1
        elif kind == "i32":
            sig[name] = "i32"
        else:
            sig[name] = "constexpr"
            if key.get(name) is not None:
                constexprs[name] = constexpr_value(key[name])
    options = {"num_warps": int(key.get("num_warps", 4)), "num_stages": int(key.get("num_stages", 3))}
    return {"signature": sig, "constexprs": constexprs, "attrs": attrs, "options": options}


def specialization_of(key: KernelKey) -> tuple:
    """A hashable, comparable form of source_spec(key): one entry per argument, then the options."""
    spec = source_spec(key)
    out = []
    for i, (name, _kind, _) in enumerate(SIGNATURES[key.op]):
        t = spec["signature"][name]
        if t == "constexpr":
            out.append((name, "constexpr", spec["constexprs"].get(name, "<missing>")))
        elif t.startswith("*"):
            out.append((name, t, "D" if (i,) in spec["attrs"] else ""))
        else:
            out.append((name, t, None))
    return (key.op, tuple(out), tuple(sorted(spec["options"].items())))


def launch_options(key: KernelKey) -> dict[str, Any]:
    """Launch/compile options for the kernel of `key` (the same for JIT launch, warmup and build)."""
    return {"num_warps": int(key["num_warps"]), "num_stages": int(key["num_stages"])}
