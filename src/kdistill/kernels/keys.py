"""Kernel keys: what names one compiled kernel binary, with exact float bits and normalised archs.

A `KernelKey` names one compiled kernel binary: op (kernel) name, GPU arch, and every parameter the
compiled code depends on: constexpr sizes, eps as exact float64 bit patterns, pointer dtypes, pointer
alignment (Triton specializes a pointer on 16-byte alignment), block sizes, num_warps and num_stages.
Forward and backward are separate kernels with separate keys.

    key = rmsnorm.fwd_key("sm_90", hidden=896, eps=1e-6, dtype="bf16", w_dtype="bf16", residual=True)
    str(key)   # 'rmsnorm_fwd[sm_90](BLOCK_H=1024,BLOCK_M=2,EPS=f64:3eb0c6f7a0b5ed8d,...)'

Each kernel's key function lives in the kernel's own file (kernels/rmsnorm.py, ...) and is registered
in kernels/registry.py; what Triton compiles for a key is derived from the jit function's own
signature in kernels/spec.py. Dtype names come from the one table in kdistill.dtypes.

Runtime integers (row counts, strides, sequence length) are declared `do_not_specialize` in the
kernels, so Triton derives no `==1` or divisible-by-16 variant from them: one binary serves every
batch size and sequence length, and the key does not depend on them. They must fit in int32 (Triton
would otherwise pick an i64 variant); the launchers refuse larger values with a KernelError.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import struct
import types
from collections.abc import Callable, Mapping
from typing import Any

from kdistill.dtypes import SHORT_NAMES, dtype_name, promote

Param = str | int | bool | None

DTYPES = SHORT_NAMES  # ("fp32", "bf16", "fp16"): the dtypes kernels take
ARCHS = ("sm_80", "sm_89", "sm_90", "sm_100", "sm_120")  # what `kdistill kernels build` targets by default
DEFAULT_ARCH = "sm_90"  # keys are computed for this arch when there is no GPU and runtime.arch is auto

# Library keys: not Triton kernels; prewarm runs them once at these shapes (cuBLAS / SDPA plans).
LIBRARY_OPS = ("sdpa", "gemm", "gemm_fp8")

__all__ = [
    "ARCHS",
    "DEFAULT_ARCH",
    "DTYPES",
    "KernelKey",
    "arch_capability",
    "constexpr_value",
    "dtype_name",
    "f64_bits",
    "f64_value",
    "launch_options",
    "make_key",
    "next_pow2",
    "normalize_arch",
    "pdl",
    "pdl_constexpr",
    "promote",
]


# -- the key type ---------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, order=True)
class KernelKey:
    """One compiled kernel: op, arch and every specialization parameter (sorted name=value pairs)."""

    op: str
    arch: str
    params: tuple[tuple[str, Param], ...]
    # Read on every launch (the host's critical path): the parameters by name and the hash, built once.
    _index: dict[str, Param] = dataclasses.field(init=False, repr=False, compare=False)
    _hash: int = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if list(self.params) != sorted(self.params, key=lambda p: p[0]):
            object.__setattr__(self, "params", tuple(sorted(self.params, key=lambda p: p[0])))
        object.__setattr__(self, "_index", dict(self.params))
        object.__setattr__(self, "_hash", hash((self.op, self.arch, self.params)))

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self) -> tuple:
        return (KernelKey, (self.op, self.arch, self.params))  # the hash is per process: rebuilt

    def __str__(self) -> str:
        inner = ",".join(f"{k}={_fmt(v)}" for k, v in self.params)
        return f"{self.op}[{self.arch}]({inner})"

    def get(self, name: str, default: Any = None) -> Any:
        return self._index.get(name, default)

    def __getitem__(self, name: str) -> Any:
        try:
            return self._index[name]
        except KeyError:
            raise KeyError(f"kernel key {self} has no parameter '{name}'") from None

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


def memoized(fn: Callable[..., KernelKey]) -> Callable[..., KernelKey]:
    """A key function that remembers its keys: key functions are pure, and the dispatcher calls them
    for every launch, on the host's critical path (a key takes tens of microseconds to build, a
    dictionary lookup well under one). List arguments count as tuples; unhashable calls are computed."""
    cache: dict[tuple, KernelKey] = {}

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> KernelKey:
        try:
            k = (args, tuple((n, tuple(v) if isinstance(v, list) else v) for n, v in kwargs.items()))
            return cache[k]
        except KeyError:
            pass
        except TypeError:  # an unhashable argument
            return fn(*args, **kwargs)
        if len(cache) >= 4096:
            cache.clear()
        out = cache[k] = fn(*args, **kwargs)
        return out

    # a policy constant changed (experiments, tests): the keys computed under the old one go
    wrapper.cache_clear = cache.clear  # type: ignore[attr-defined]
    return wrapper


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


def pdl(arch: str) -> bool:
    """Whether kernels for `arch` launch with programmatic dependent launch (sm_90 and newer): the next
    kernel's programs may start while this one finishes, and wait (griddepcontrol.wait) before they
    read what it wrote. A key parameter: launch_pdl is a compile option of the binary."""
    try:
        return arch_capability(arch) >= 90
    except ValueError:  # "cpu"
        return False


def pdl_constexpr(key: KernelKey) -> bool:
    """The PDL constexpr a launcher passes for `key`: the key's flag, off under Triton's interpreter
    (which has no grid dependency control; the CPU runs programs one after another anyway)."""
    return bool(key.get("PDL")) and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")


def next_pow2(n: int) -> int:
    """The smallest power of two >= n."""
    return 1 << max(0, int(n) - 1).bit_length()


def step_bucket(n: int, batch: int) -> int:
    """Rows a decode engine of `batch` rows runs at once for n prompts: the smallest power of two >= n,
    at most batch (DecodeEngine.bucket; the plans hold every bucket an engine may run, `step_buckets`)."""
    return min(int(batch), next_pow2(n))


def step_buckets(batch: int) -> list[int]:
    """Every bucket an engine of `batch` rows may run, smallest first."""
    return sorted({step_bucket(n, batch) for n in range(1, max(1, int(batch)) + 1)})


def constexpr_value(v: Param) -> Any:
    """A key parameter as the constexpr value the kernel receives (f64 bit patterns -> float)."""
    if isinstance(v, str) and v.startswith("f64:"):
        return f64_value(v)
    return v


@functools.lru_cache(maxsize=4096)
def launch_options(key: KernelKey) -> Mapping[str, Any]:
    """Launch/compile options for the kernel of `key` (the same for JIT launch, warmup and build);
    computed once per key (read-only)."""
    opts: dict[str, Any] = {"num_warps": int(key["num_warps"])}
    if key.get("num_stages") is not None:  # the KD head's key leaves num_stages at Triton's default
        opts["num_stages"] = int(key["num_stages"])
    if key.get("PDL"):  # programmatic dependent launch (see pdl())
        opts["launch_pdl"] = True
    return types.MappingProxyType(opts)
