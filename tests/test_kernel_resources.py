"""benchmarks/kernel_resources.py: the programs an SM holds follow CUDA's occupancy rules (registers
allocated per warp in units of 256, shared memory with the system's 1 KB a program, warps), and a key
cross-built without a GPU reports its registers: a matrix-vector key prefetching fewer inputs before its
wait holds fewer registers a thread."""

from __future__ import annotations

import sys

import pytest

from tests.test_train_kit import REPO


def _module():
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import kernel_resources
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    return kernel_resources


@pytest.mark.parametrize(
    "registers,shared,warps,held",
    [
        (186, 40960, 4, 2),  # 6,144 registers a warp: 24,576 a program, two in 64K
        (127, 40960, 4, 4),  # 4,096 a warp: four
        (78, 40960, 4, 5),  # registers would allow six: shared memory (41 KB a program) five
        (32, 0, 4, 16),  # warps: 64 an SM
        (16, 0, 1, 32),  # programs: 32 an SM
    ],
)
def test_programs_an_sm_holds(registers, shared, warps, held):
    assert _module().per_sm(registers, shared, warps) == held


def test_a_cross_built_keys_registers_fall_with_its_prefetch():
    pytest.importorskip("triton")
    from kdistill.kernels import decode_gemv
    from kdistill.kernels.keys import make_key
    from kdistill.kernels.pack import jit_compile

    res = _module()
    base = decode_gemv.gemv_key("sm_90", n=256, k=1536, dtype="bf16", epilogue=decode_gemv.EPI_SWIGLU, rows=4)
    regs = {}
    for depth in (512, 128):
        key = make_key(base.op, base.arch, **{**dict(base.params), "PRE_K": depth})
        regs[depth] = res.registers(jit_compile(key).asm["cubin"])
    assert 0 < regs[128] < regs[512] <= 255, regs
