"""A decode step's products in one launch (Gluon, sm_90): do grid barriers between them cost less than
kernel boundaries, and does issuing the next product's first weight chunks before the barrier hide the
wait?

Every block of Qwen2.5-0.5B has four products at 16 rows (q/k/v 1,152 x 896, o_proj 896 x 896, gate/up
9,728 x 896, down 896 x 4,864); a step runs 24 blocks. Three ways to run those 96 products, each captured
in a CUDA graph and replayed, µs a block:

    launches   one launch a product (stream_probe_gluon's kernel: a TMA ring, warpgroup MMA, one program
               per SM), 96 launches a step
    barrier    one launch for the whole step: one program per SM walks the 96 products, a grid barrier
               between two products (an acquire-release count), each product's chunks issued after it
    prefetch   the same, each product's first STAGES weight chunks issued before the barrier (weights do
               not depend on the previous product; its input rows are issued after the barrier, into the
               same stage, counted by the same mbarrier)

The products here do not feed each other (each reads an input buffer of its own after the barrier, and
adds its partial sums to an fp32 output with relaxed atomics): the probe times the launches, barriers and
streams a step of such a block would pay, not its arithmetic. Weights are the model's size (24 blocks,
~0.9 GB), so every chunk comes from HBM. The barrier needs every program resident at once: one per SM.

    python3 benchmarks/block_probe_gluon.py --json benchmarks/results/block_probe.json
    python3 benchmarks/block_probe_gluon.py --build      # compile for sm_90 without a GPU (no timing)
"""

from __future__ import annotations

import argparse
import json
import sys
from importlib.metadata import version
from pathlib import Path

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

try:  # run as a script (benchmarks/ on the path) or as a module
    from stream_probe import graph_us
    from stream_probe_gluon import tma_load
except ImportError:
    from benchmarks.stream_probe import graph_us
    from benchmarks.stream_probe_gluon import tma_load

_HIDDEN, _INTER, _QKV = 896, 4864, 1152  # Qwen2.5-0.5B
_A_ROWS = _QKV + _HIDDEN + 2 * _INTER  # W_a's rows a block: q/k/v, o_proj, gate/up (the 896-input ones)
LAYERS = 24
# the kernel's constants (a Gluon kernel reads only constexpr globals)
ROWS, BLOCK_N, BLOCK_K = gl.constexpr(16), gl.constexpr(64), gl.constexpr(128)
HIDDEN, INTER, A_ROWS = gl.constexpr(_HIDDEN), gl.constexpr(_INTER), gl.constexpr(_A_ROWS)
A_ROW0 = gl.constexpr([0, _QKV, _QKV + _HIDDEN])  # where each 896-input product starts in W_a's block
A_N = gl.constexpr([_QKV, _HIDDEN, 2 * _INTER])


@gluon.jit
def _issue(w_desc, x_desc, bar, w_buf, x_buf, w_row, k0, ok, WEIGHT: gl.constexpr, INPUT: gl.constexpr):
    """Into one stage: the chunk's weight (WEIGHT) and/or its input rows (INPUT); the stage's mbarrier
    expects both when the weight is issued (a chunk whose weight went first gets its rows later)."""
    if WEIGHT:
        mbarrier.expect(bar, w_desc.block_type.nbytes + x_desc.block_type.nbytes, pred=ok)
        tma_load(w_desc, [w_row, k0], bar, w_buf, pred=ok)
    if INPUT:
        tma_load(x_desc, [0, k0], bar, x_buf, pred=ok)


@gluon.jit
def _product(
    w_desc, x_desc, Y, bars, w_smem, x_smem, acc, n_done, pid, w_row0,
    N: gl.constexpr, K: gl.constexpr, PROGS: gl.constexpr, STAGES: gl.constexpr, AHEAD: gl.constexpr,
    cols0, rows,
):  # fmt: skip
    """One product's share for this program: its chunks through the ring (stage and parity continue from
    n_done, the chunks this program consumed so far). AHEAD: its first chunks' weights were issued before
    the barrier (only the rows are left to issue). Returns the new n_done."""
    KT: gl.constexpr = K // BLOCK_K
    ITEMS: gl.constexpr = (N // BLOCK_N) * KT
    start = pid * ITEMS // PROGS
    total = (pid + 1) * ITEMS // PROGS - start
    for s in gl.static_range(STAGES):  # the ring's first fill (its rows only, where AHEAD)
        st = (n_done + s) % STAGES
        item = start + s
        _issue(
            w_desc, x_desc, bars.index(st), w_smem.index(st), x_smem.index(st),
            w_row0 + (item // KT) * BLOCK_N, (item % KT) * BLOCK_K, s < total, not AHEAD, True,
        )  # fmt: skip
    for i in range(total):
        c = n_done + i
        st = c % STAGES
        item = start + i
        kk = item % KT
        mbarrier.wait(bars.index(st), (c // STAGES) & 1)
        acc = warpgroup_mma(
            w_smem.index(st), x_smem.index(st).permute((1, 0)), acc, use_acc=kk != 0, is_async=True
        )
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        nxt = item + STAGES
        _issue(
            w_desc, x_desc, bars.index(st), w_smem.index(st), x_smem.index(st),
            w_row0 + (nxt // KT) * BLOCK_N, (nxt % KT) * BLOCK_K, i + STAGES < total, True, True,
        )  # fmt: skip
        if (kk == KT - 1) | (i == total - 1):
            cols = (item // KT) * BLOCK_N + cols0
            gl.atomic_add(Y + rows[None, :] * N + cols[:, None], acc, sem="relaxed")
    return n_done + total


@gluon.jit
def _ahead(w_desc, x_desc, bars, w_smem, x_smem, n_done, pid, w_row0,
           N: gl.constexpr, K: gl.constexpr, PROGS: gl.constexpr, STAGES: gl.constexpr, live=True):  # fmt: skip
    """The next product's first STAGES weight chunks of this program, issued before the barrier (live
    False: there is no next product)."""
    KT: gl.constexpr = K // BLOCK_K
    ITEMS: gl.constexpr = (N // BLOCK_N) * KT
    start = pid * ITEMS // PROGS
    total = (pid + 1) * ITEMS // PROGS - start
    for s in gl.static_range(STAGES):
        st = (n_done + s) % STAGES
        item = start + s
        _issue(
            w_desc, x_desc, bars.index(st), w_smem.index(st), x_smem.index(st),
            w_row0 + (item // KT) * BLOCK_N, (item % KT) * BLOCK_K, (s < total) & live, True, False,
        )  # fmt: skip


@gluon.jit
def _grid_barrier(BAR, target):
    """Every program arrives (release), then waits until all have (acquire): target = arrivals so far."""
    gl.atomic_add(BAR, 1, sem="acq_rel", scope="gpu")
    seen = gl.atomic_add(BAR, 0, sem="acquire", scope="gpu")
    while seen < target:
        seen = gl.atomic_add(BAR, 0, sem="acquire", scope="gpu")


@gluon.jit
def block_probe_kernel(
    wa_desc, wb_desc, xa_desc, xb_desc, Y, BAR, LAYER,
    LAYERS_RUN: gl.constexpr, PROGS: gl.constexpr, STAGES: gl.constexpr, AHEAD: gl.constexpr,
    ONE: gl.constexpr, ONE_AT: gl.constexpr,
):  # fmt: skip
    """ONE: a single product (ONE_AT: 0-3 of block LAYER's, no barrier; the `launches` way); else
    LAYERS_RUN blocks' products with a grid barrier between two (AHEAD: the next one's weights first)."""
    pid = gl.program_id(0)
    w_smem = gl.allocate_shared_memory(wa_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], wa_desc.layout)
    x_smem = gl.allocate_shared_memory(xa_desc.dtype, [STAGES, ROWS, BLOCK_K], xa_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(bars.index(s), count=1)
    layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, ROWS, 16]
    )
    acc = gl.zeros((BLOCK_N, ROWS), gl.float32, layout)
    cols0 = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
    rows = gl.arange(0, ROWS, layout=gl.SliceLayout(0, layout))
    n_done = pid * 0  # chunks this program consumed: the ring's stage and parity
    if ONE:
        if ONE_AT == 3:
            n_done = _product(wb_desc, xb_desc, Y, bars, w_smem, x_smem, acc, n_done, pid, LAYER * HIDDEN,
                              HIDDEN, INTER, PROGS, STAGES, False, cols0, rows)  # fmt: skip
        else:
            n_done = _product(wa_desc, xa_desc, Y, bars, w_smem, x_smem, acc, n_done, pid,
                              LAYER * A_ROWS + A_ROW0[ONE_AT], A_N[ONE_AT], HIDDEN, PROGS, STAGES, False,
                              cols0, rows)  # fmt: skip
    else:
        arrived = pid * 0
        if AHEAD:  # the first product's weights, as every later one's go before its barrier
            _ahead(
                wa_desc, xa_desc, bars, w_smem, x_smem, n_done, pid, A_ROW0[0], A_N[0], HIDDEN, PROGS, STAGES
            )
        for layer in range(LAYERS_RUN):
            base = layer * A_ROWS
            for p in gl.static_range(4):
                if p == 3:
                    n_done = _product(wb_desc, xb_desc, Y, bars, w_smem, x_smem, acc, n_done, pid, layer * HIDDEN,
                                      HIDDEN, INTER, PROGS, STAGES, AHEAD, cols0, rows)  # fmt: skip
                else:
                    n_done = _product(wa_desc, xa_desc, Y, bars, w_smem, x_smem, acc, n_done, pid,
                                      base + A_ROW0[p], A_N[p], HIDDEN, PROGS, STAGES, AHEAD, cols0, rows)  # fmt: skip
                if AHEAD:  # the next product's weights, then the barrier
                    if p == 2:
                        _ahead(wb_desc, xb_desc, bars, w_smem, x_smem, n_done, pid, layer * HIDDEN,
                               HIDDEN, INTER, PROGS, STAGES)  # fmt: skip
                    elif p == 3:  # the next block's q/k/v, if there is one
                        _ahead(wa_desc, xa_desc, bars, w_smem, x_smem, n_done, pid, base + A_ROWS,
                               A_N[0], HIDDEN, PROGS, STAGES, layer + 1 < LAYERS_RUN)  # fmt: skip
                    else:
                        _ahead(wa_desc, xa_desc, bars, w_smem, x_smem, n_done, pid, base + A_ROW0[p + 1],
                               A_N[p + 1], HIDDEN, PROGS, STAGES)  # fmt: skip
                arrived += PROGS
                _grid_barrier(BAR, arrived)
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(s))


def _layout(block):
    return gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16)


def _desc(t, block):
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block, _layout(block))


def _descs(bufs):
    wa, wb, xa, xb = bufs[:4]
    w, x = [64, 128], [16, 128]
    return _desc(wa, w), _desc(wb, w), _desc(xa, x), _desc(xb, x)


def launch(bufs, progs, stages, mode, layers=LAYERS, one_at=0, layer=0):
    """mode: 'barrier', 'prefetch' (one launch, `layers` blocks) or 'one' (product `one_at` of block
    `layer`). The barrier's count must be zero at a launch of the first two."""
    block_probe_kernel[(progs,)](
        *_descs(bufs), bufs[4], bufs[5], layer, LAYERS_RUN=layers, PROGS=progs, STAGES=stages,
        AHEAD=mode == "prefetch", ONE=mode == "one", ONE_AT=one_at, num_warps=4,
    )  # fmt: skip


def buffers(device, layers=LAYERS):
    g = torch.Generator().manual_seed(0)

    def rnd(*shape):
        return (torch.randn(shape, generator=g) * 0.02).to(device, torch.bfloat16)

    wa, wb = rnd(layers * _A_ROWS, _HIDDEN), rnd(layers * _HIDDEN, _INTER)
    xa, xb = rnd(16, _HIDDEN), rnd(16, _INTER)
    y = torch.zeros((16 * 2 * _INTER,), dtype=torch.float32, device=device)
    bar = torch.zeros((1,), dtype=torch.int32, device=device)
    return wa, wb, xa, xb, y, bar


def build(stages: int = 4) -> dict:
    """Compile the three ways for sm_90 without a GPU: (way -> (TMA copies, wgmma, shared bytes))."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    names = block_probe_kernel.arg_names
    sig = {n: mangle_type(d) for n, d in zip(names[:4], _descs(buffers("cpu", layers=1)))}
    sig.update({"Y": "*fp32", "BAR": "*i32", "LAYER": "i32"})
    out = {}
    for way in ("one", "barrier", "prefetch"):
        consts = {"LAYERS_RUN": LAYERS, "PROGS": 132, "STAGES": stages, "AHEAD": way == "prefetch",
                  "ONE": way == "one", "ONE_AT": 2}  # fmt: skip
        sig.update({k: "constexpr" for k in consts})
        src = GluonASTSource(
            block_probe_kernel, {n: sig[n] for n in names}, {(names.index(k),): v for k, v in consts.items()}
        )
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        ptx = k.asm["ptx"]
        out[way] = (ptx.count("cp.async.bulk.tensor"), ptx.count("wgmma.mma_async"), k.metadata.shared)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", default="3,4")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--build", action="store_true", help="compile for sm_90 without a GPU and stop")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if a.build:
        for way, (copies, mmas, smem) in build().items():
            print(f"{way:9s} sm_90: {copies} TMA copies, {mmas} wgmma, {smem} bytes of shared memory")
        return
    dev = torch.device("cuda")
    progs = torch.cuda.get_device_properties(dev).multi_processor_count
    bufs = buffers(dev)
    bar = bufs[5]
    out = {
        "argv": " ".join(["python3", "benchmarks/block_probe_gluon.py", *sys.argv[1:]]),
        "device": torch.cuda.get_device_name(dev),
        "versions": {"torch": torch.__version__, "triton": version("triton")},
        "programs": progs,
        "rows": [],
    }
    for stages in (int(s) for s in a.stages.split(",")):
        ways = {
            "launches": lambda st=stages: [
                launch(bufs, progs, st, "one", one_at=p, layer=layer)
                for layer in range(LAYERS)
                for p in range(4)
            ],  # 96 launches
            "barrier": lambda st=stages: (bar.zero_(), launch(bufs, progs, st, "barrier")),
            "prefetch": lambda st=stages: (bar.zero_(), launch(bufs, progs, st, "prefetch")),
        }
        for way, fn in ways.items():
            us = graph_us(lambda i, fn=fn: fn(), 1, launches=1, replays=a.reps) / LAYERS
            out["rows"].append({"way": way, "stages": stages, "us_per_block": us})
            print(f"stages {stages} {way:9s} {us:7.2f} us a block", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
