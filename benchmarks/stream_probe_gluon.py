"""One matrix-vector product as a Gluon kernel (sm_90 and newer): each program streams an even share of
the weight's (column block, K chunk) items through a ring of shared-memory stages filled by TMA copies
behind mbarriers, and multiplies each chunk on the tensor cores (warpgroup MMA, the weight chunk as the
left operand: y^T = W x^T), its partial sums added to an fp32 output at a block's last chunk or at the
end of its share. `MMA=False` streams the same copies and computes nothing: the copy rate alone.

Used by `stream_probe.py` (provider `gluon`, `gluon-copy`); `build_sm90()` compiles the kernel for sm_90
without a GPU (a check of the source against the installed Triton's Gluon).
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

# Triton 3.6's name for a TMA load; later releases call it async_load
tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared

ROWS = 16  # the activation's rows (an MMA's N); fewer rows are zero-padded by the caller


@gluon.jit
def _issue(w_desc, x_desc, bar, w_buf, x_buf, item, KT, ok):
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = w_desc.block_type.shape[1]
    mbarrier.expect(bar, w_desc.block_type.nbytes + x_desc.block_type.nbytes, pred=ok)
    k0 = (item % KT) * BLOCK_K
    tma_load(w_desc, [(item // KT) * BLOCK_N, k0], bar, w_buf, pred=ok)
    tma_load(x_desc, [0, k0], bar, x_buf, pred=ok)


@gluon.jit
def gluon_stream_kernel(
    w_desc,
    x_desc,
    Y,
    M,
    N,
    K,
    PROGS: gl.constexpr,
    STAGES: gl.constexpr,
    MMA: gl.constexpr,
    num_warps: gl.constexpr,
):
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = w_desc.block_type.shape[1]
    R: gl.constexpr = x_desc.block_type.shape[0]
    pid = gl.program_id(0)
    KT = K // BLOCK_K
    items = (N // BLOCK_N) * KT
    start = pid * items // PROGS
    total = (pid + 1) * items // PROGS - start

    w_smem = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], w_desc.layout)
    x_smem = gl.allocate_shared_memory(x_desc.dtype, [STAGES, R, BLOCK_K], x_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(bars.index(s), count=1)
    for s in gl.static_range(STAGES):  # the ring filled before the first wait
        _issue(w_desc, x_desc, bars.index(s), w_smem.index(s), x_smem.index(s), start + s, KT, s < total)

    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, R, 16]
    )
    acc = gl.zeros((BLOCK_N, R), gl.float32, acc_layout)
    cols0 = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, acc_layout))
    rows = gl.arange(0, R, layout=gl.SliceLayout(0, acc_layout))
    for i in range(total):
        st = i % STAGES
        item = start + i
        kk = item % KT
        mbarrier.wait(bars.index(st), (i // STAGES) & 1)
        if MMA:
            acc = warpgroup_mma(
                w_smem.index(st), x_smem.index(st).permute((1, 0)), acc, use_acc=kk != 0, is_async=True
            )
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        # the stage is free again: its next chunk, STAGES ahead
        _issue(
            w_desc, x_desc, bars.index(st), w_smem.index(st), x_smem.index(st), item + STAGES, KT,
            i + STAGES < total,
        )  # fmt: skip
        if MMA:
            if (kk == KT - 1) | (i == total - 1):
                cols = (item // KT) * BLOCK_N + cols0
                ptrs = Y + rows[None, :] * N + cols[:, None]
                mask = (rows[None, :] < M) & (cols[:, None] < N)
                gl.atomic_add(ptrs, acc, mask=mask, sem="relaxed")  # acq_rel would serialise them
    for j in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(j))


def _descs(x: torch.Tensor, w: torch.Tensor, block_n: int, block_k: int):
    wl = gl.NVMMASharedLayout.get_default_for([block_n, block_k], gl.bfloat16)
    xl = gl.NVMMASharedLayout.get_default_for([ROWS, block_k], gl.bfloat16)
    wd = TensorDescriptor(w, list(w.shape), list(w.stride()), [block_n, block_k], wl)
    xd = TensorDescriptor(x, list(x.shape), list(x.stride()), [ROWS, block_k], xl)
    return wd, xd


def smem_bytes(stages: int, block_n: int, block_k: int) -> int:
    """Shared memory a program holds: the ring of weight and activation chunks (bf16)."""
    return stages * (block_n + ROWS) * block_k * 2


def launch_gluon(
    x: torch.Tensor,
    w: torch.Tensor,
    progs: int,
    stages: int,
    block_n: int,
    block_k: int,
    mma: bool = True,
    y: torch.Tensor | None = None,
) -> torch.Tensor:
    """y (16, N) fp32 += x (16, K) w (N, K)^T; bf16 inputs, N and K whole tiles. Returns y."""
    m, k = x.shape
    n = w.shape[0]
    if m != ROWS or n % block_n or k % block_k:
        raise ValueError(
            f"stream_probe_gluon: ({n}, {k}) is not whole {block_n} x {block_k} tiles, or {m} != {ROWS} rows"
        )
    if y is None:
        y = torch.zeros((m, n), dtype=torch.float32, device=x.device)
    wd, xd = _descs(x, w, block_n, block_k)
    items = (n // block_n) * (k // block_k)
    p = min(progs, items)
    gluon_stream_kernel[(p,)](wd, xd, y, m, n, k, PROGS=p, STAGES=stages, MMA=mma, num_warps=4)
    return y


def build_sm90(n: int = 1024, k: int = 896, block_n: int = 64, block_k: int = 128, stages: int = 4):
    """Compile the kernel for sm_90 (no GPU needed); returns the compiled kernel (its `asm` holds PTX)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    x = torch.empty((ROWS, k), dtype=torch.bfloat16)
    w = torch.empty((n, k), dtype=torch.bfloat16)
    wd, xd = _descs(x, w, block_n, block_k)
    names = gluon_stream_kernel.arg_names
    sig = {
        "w_desc": mangle_type(wd), "x_desc": mangle_type(xd), "Y": "*fp32", "M": "i32", "N": "i32",
        "K": "i32", "PROGS": "constexpr", "STAGES": "constexpr", "MMA": "constexpr",
        "num_warps": "constexpr",
    }  # fmt: skip
    consts = {"PROGS": 132, "STAGES": stages, "MMA": True, "num_warps": 4}
    src = GluonASTSource(
        gluon_stream_kernel,
        {name: sig[name] for name in names},
        {(names.index(key),): value for key, value in consts.items()},
    )
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})


if __name__ == "__main__":
    kernel = build_sm90()
    ptx = kernel.asm["ptx"]
    print(
        "sm_90:",
        ptx.count("cp.async.bulk.tensor"), "TMA copies,",
        ptx.count("wgmma.mma_async"), "wgmma,",
        kernel.metadata.shared, "bytes of shared memory",
    )  # fmt: skip
