"""The registry: every kernel file's KernelSpec, and the library calls prewarm runs.

Adding a kernel is one new file (jit function, launcher, autograd Function, key function, tiles,
warm launch, `SPEC = KernelSpec(...)`) and one line in KERNELS below. Plan, prewarm, the cross-arch
build and the contract check find a key's kernel here by its op name.
"""

from __future__ import annotations

from kdistill.kernels import (
    decode_attention,
    decode_gemv,
    decode_sample,
    fp8_quant,
    fp8_quant_cols,
    kd_loss,
    library,
    rmsnorm,
    rope,
    swiglu,
)
from kdistill.kernels.keys import KernelKey
from kdistill.kernels.spec import Kernel, KernelSpec, LibraryOp

KERNELS: tuple[KernelSpec, ...] = (
    rmsnorm.SPEC,
    rope.SPEC,
    swiglu.SPEC,
    kd_loss.SPEC,
    fp8_quant.SPEC,
    fp8_quant_cols.SPEC,
    decode_attention.SPEC,
    decode_gemv.SPEC,
    decode_sample.SPEC,
)
LIBRARY: tuple[LibraryOp, ...] = (library.SDPA, library.GEMM, library.FP8_GEMM)


def by_name(name: str) -> KernelSpec:
    """The KernelSpec registered as `name` ('rmsnorm', 'kd_loss', ...)."""
    for spec in KERNELS:
        if spec.name == name:
            return spec
    raise KeyError(f"no kernel named {name} is registered")


def kernel_of(key: KernelKey) -> Kernel | LibraryOp:
    """The jit Kernel (or library call) a key names, by its op."""
    for spec in KERNELS:
        for kernel in spec.kernels:
            if kernel.op == key.op:
                return kernel
    for op in LIBRARY:
        if op.op == key.op:
            return op
    raise ValueError(f"{key.op} is not a registered kernel")
