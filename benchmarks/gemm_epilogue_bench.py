"""Gate/up GEMM with a SwiGLU epilogue (persistent Triton GEMM, TMA) against cuBLAS + kdistill's SwiGLU.

    PYTHONPATH=src python3 benchmarks/gemm_epilogue_bench.py \
        --json benchmarks/results/gemm_epilogue_<date>_h100.json   # one GPU, about 2 minutes
    TRITON_INTERPRET=1 PYTHONPATH=src python3 benchmarks/gemm_epilogue_bench.py --interpret-check
    TRITON_INTERPRET=1 PYTHONPATH=src python3 benchmarks/gemm_epilogue_bench.py --smoke   # CPU, ~2 min

`--interpret-check` runs the kernel under Triton's interpreter at a tiny ragged shape against the
PyTorch reference; `--smoke` runs this whole script's GPU path (autotuning, checks, table, JSON) on the
CPU under the interpreter at tiny shapes, its numbers meaningless: a check of the script itself. On
the GPU most of the time is the first shape's compiles (30 kernel variants, each once: 10 configs x 3
epilogues); `--models`, `--batches` narrow the run.

A measurement before anything replaces cuBLAS in the training step (benchmarks/NOTES.md, "Fused GEMM
epilogues: prediction"). The MLP of a Qwen2.5 block computes, per layer and micro-batch,

    gu = x @ W_gu^T        x (M, K) bf16, W_gu = [W_gate; W_up] (2I, K)  ->  gu (M, 2I)   (cuBLAS)
    h  = silu(g) * u       g, u the two halves of gu                     ->  h  (M, I)    (SwiGLU kernel)

with M = batch x 2048 tokens; the student (Qwen2.5-0.5B) has K = 896, I = 4864, 24 layers; the teacher
(Qwen2.5-1.5B) K = 1536, I = 8960, 28 layers. The fused kernel computes both halves of one output
tile in its main loop (two accumulators, (BLOCK_M, BLOCK_N) each, for the same columns of W_gate and
W_up) and writes h from its epilogue, so the (M, 2I) intermediate is neither written nor read back:
2 * M * 2I * 2 bytes less traffic per layer.

Providers, on the same random bf16 inputs (timed in the same process, interleaved rounds):
  cublas_gemm      torch.mm(x, W_gu^T) alone: cuBLAS's rate at this shape
  swiglu           kdistill's SwiGLU kernel through the dispatcher, reading the halves of gu in place
                   (what the step runs: `dispatch.swiglu`, as the teacher and `swiglu_down` call it)
  baseline         cublas_gemm + swiglu: the step's current forward of the gate/up half of the MLP
  triton_gemm      the Triton kernel writing gu (no epilogue math): does Triton reach cuBLAS here?
  fused            the Triton kernel writing h only: the frozen teacher's forward
  fused_save       the Triton kernel writing h and gu: the student's forward (see "backward" below)

What the student's backward needs. The SwiGLU backward is d g = dh * u * s * (1 + g (1 - s)),
d u = dh * silu(g) (s = sigmoid(g)): it needs g and u (M, 2I), and the down projection's weight
gradient needs h, which kdistill's `swiglu_down` already recomputes from gu in the backward. So a
fused forward of the student must still write gu (M, 2I) for the backward (`fused_save`): it saves
only the SwiGLU kernel's read of gu (M * 2I * 2 bytes) and its launch, not the write. The alternative,
writing h only and recomputing gu in the backward, repeats the gate/up GEMM (2 * M * K * 2I FLOPs:
0.57 TFLOP per student layer at batch 16, ~0.7 ms) to save 0.2 ms of traffic: it never pays. A
frozen teacher has no backward, so `fused` is its whole forward and saves the write and the read.

Notes on the method:
- TMA through host descriptors (`triton.tools.tensor_descriptor.TensorDescriptor`, in Triton 3.6 and
  later, also under the interpreter); the block shapes are set per config by the autotuner's pre-hook.
  W_gate and W_up, and the two halves of gu, are separate descriptors (views of one tensor), so tiles
  at the right edge of I are clipped by the hardware instead of spilling into the other half.
- Autotuning over a small config set is for this measurement only; a kernel in the training step
  would take fixed configs from the kernel plan (one key per shape, as every kdistill kernel does).
- The persistent grid is min(#SMs x programs per SM, #tiles) programs walking the tiles in a grouped
  order (GROUP_M row blocks share the weight columns in L2). Every config of `configs()` was compiled
  for sm_90a with Triton 3.6 without a GPU (Triton's JIT aimed at that target, then `ptxas -v`): wgmma
  and TMA instructions, no register spills, shared memory within the H100's.
- Under the interpreter (`--interpret-check`, `--smoke`) the dots take exact fp32 upcasts of their
  bf16 tiles (`DOT_F32`): the interpreter of Triton 3.6 and 3.9 returns garbage for a dot of bf16
  blocks. Triton 3.6's interpreter also cannot take a loop bound that comes from `program_id` with
  NumPy 2.4 (it converts a one-element array with `int()`); it runs with NumPy 2.2, and 3.9's with both.
- No L2 flush between calls: every operand but the weights (17 / 55 MB) is far larger than L2.
- The fused kernel rounds g and u to bf16 before the SwiGLU math, exactly as the unfused path does (the
  GEMM writes bf16, the SwiGLU kernel reads it), so the outputs agree to the GEMMs' summation order.
"""

from __future__ import annotations

import os
import sys

INTERPRET_FLAGS = ("--interpret-check", "--smoke")
if any(flag in sys.argv for flag in INTERPRET_FLAGS):  # chosen before any kernel is defined
    os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse  # noqa: E402
import datetime  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

from kdistill.ops.swiglu import swiglu_reference  # noqa: E402

MODELS = {  # name: (K = hidden size, I = intermediate size, layers), Qwen2.5 presets
    "student": (896, 4864, 24),  # Qwen2.5-0.5B
    "teacher": (1536, 8960, 28),  # Qwen2.5-1.5B
}
SMOKE_MODELS = {"student": (64, 64, 24), "teacher": (96, 96, 28)}  # --smoke: tiny, same layers
ASSUMED_BW = 3.0e12  # H100 SXM HBM3, achievable (benchmarks/NOTES.md); the run also measures a copy
EPILOGUES = {"triton_gemm": 0, "fused": 1, "fused_save": 2}
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"


# -- the kernel ------------------------------------------------------------------------------------
@triton.jit
def _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """(row block, column block) of a tile: GROUP_M row blocks walk the column blocks together, so
    the weight tiles they share stay in L2."""
    per_group = GROUP_M * num_pid_n
    first_m = (tile_id // per_group) * GROUP_M
    size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (tile_id % per_group) % size_m
    pid_n = (tile_id % per_group) // size_m
    return pid_m, pid_n


@triton.jit
def gate_up_kernel(
    x_desc,  # (M, K), block (BLOCK_M, BLOCK_K)
    wg_desc,  # W_gate (I, K), block (BLOCK_N, BLOCK_K); read when not ONE_DOT
    wu_desc,  # W_up (I, K), block (BLOCK_N, BLOCK_K); read when not ONE_DOT
    wi_desc,  # W_gate and W_up interleaved by BLOCK_N rows, block (2 BLOCK_N, BLOCK_K); ONE_DOT
    h_desc,  # h (M, I), block (BLOCK_M, BLOCK_N); written when EPILOGUE is 1 or 2
    g_desc,  # gu[:, :I] (M, I) row stride 2I; written when EPILOGUE is 0 or 2
    u_desc,  # gu[:, I:] (M, I) row stride 2I; written when EPILOGUE is 0 or 2
    M,
    I,
    K,
    EPILOGUE: tl.constexpr,  # 0: gu only (plain GEMM), 1: h only, 2: h and gu
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    NUM_SMS: tl.constexpr,
    OCCUPANCY: tl.constexpr,  # programs per SM: the grid is min(NUM_SMS x OCCUPANCY, tiles)
    ONE_DOT: tl.constexpr,  # one (BLOCK_M, 2 BLOCK_N) dot on wi instead of two (BLOCK_M, BLOCK_N)
    DOT_F32: tl.constexpr = False,  # interpreter runs only: fp32 operands for the dots
):
    """Persistent gate/up GEMM; each tile accumulates x @ W_gate^T and x @ W_up^T for the same
    (BLOCK_M, BLOCK_N) output block, in fp32, and the epilogue writes gu and/or h = silu(g) * u.

    Two ways to the same sums: two dots per K step sharing the x tile (W_gate and W_up as they are),
    or one dot twice as wide on a weight whose rows alternate BLOCK_N rows of W_gate and of W_up
    (wider wgmma instructions, the x tile read from shared memory once), its accumulator split in two
    in the epilogue."""
    dtype = x_desc.dtype
    start = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(I, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    k_tiles = tl.cdiv(K, BLOCK_K)
    for tile_id in tl.range(start, num_tiles, NUM_SMS * OCCUPANCY):
        pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        if ONE_DOT:
            acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
            for ki in range(k_tiles):
                off_k = ki * BLOCK_K
                a = x_desc.load([off_m, off_k])  # (BLOCK_M, BLOCK_K)
                b = wi_desc.load([2 * off_n, off_k])  # (2 BLOCK_N, BLOCK_K): gate rows, then up rows
                if DOT_F32:  # exact upcasts: the same fp32 sums, for an interpreter without bf16 dots
                    a, b = a.to(tl.float32), b.to(tl.float32)
                acc = tl.dot(a, b.T, acc)
            acc_g, acc_u = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N)), (0, 2, 1)))
        else:
            acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for ki in range(k_tiles):
                off_k = ki * BLOCK_K
                a = x_desc.load([off_m, off_k])  # (BLOCK_M, BLOCK_K)
                bg = wg_desc.load([off_n, off_k])  # (BLOCK_N, BLOCK_K)
                bu = wu_desc.load([off_n, off_k])
                if DOT_F32:
                    a, bg, bu = a.to(tl.float32), bg.to(tl.float32), bu.to(tl.float32)
                acc_g = tl.dot(a, bg.T, acc_g)
                acc_u = tl.dot(a, bu.T, acc_u)

        g = acc_g.to(dtype)  # rounded as the unfused GEMM's output is
        u = acc_u.to(dtype)
        if EPILOGUE != 1:
            g_desc.store([off_m, off_n], g)
            u_desc.store([off_m, off_n], u)
        if EPILOGUE != 0:
            gf = g.to(tl.float32)
            act = (gf * tl.sigmoid(gf)).to(dtype).to(tl.float32)  # as kernels/swiglu.py rounds it
            h_desc.store([off_m, off_n], (act * u.to(tl.float32)).to(dtype))


def set_block_shapes(nargs: dict) -> None:
    """Autotuner pre-hook: give the host TMA descriptors the block shapes of the config being run."""
    bm, bn, bk = nargs["BLOCK_M"], nargs["BLOCK_N"], nargs["BLOCK_K"]
    nargs["x_desc"].block_shape = [bm, bk]
    nargs["wg_desc"].block_shape = [bn, bk]
    nargs["wu_desc"].block_shape = [bn, bk]
    wi = nargs["wi_desc"]  # the interleaving follows BLOCK_N: that config's copy of the weight
    wi.base = wi.by_block_n[bn]
    wi.shape = list(wi.base.shape)
    wi.block_shape = [2 * bn, bk]
    for name in ("h_desc", "g_desc", "u_desc"):
        nargs[name].block_shape = [bm, bn]


def configs() -> list:
    """A small set for Hopper: (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps, programs per SM). BLOCK_N
    is per half, so a tile computes BLOCK_M x 2 BLOCK_N outputs; shared memory per stage is
    (BLOCK_M + 2 BLOCK_N) x BLOCK_K x 2 bytes (48 KB for 128 / 128 / 64), plus the epilogue's output
    tile. One program per SM cannot overlap a tile's epilogue with the next tile's loads (the loop
    over K is pipelined, the loop over tiles is not, and K is only 896 or 1536 here); two programs
    per SM, each in under half the shared memory, can. Each config compiles for sm_90a with Triton
    3.6 within the H100's shared memory (227 KB a block, about 113 KB each for two) and without
    register spills. Triton 3.6's Hopper warp specialization (`warp_specialize=True` on either
    loop) left this kernel unchanged at 8 warps and failed to compile at 4, so it is not used.
    A flattened tile loop
    (`tl.range(..., flatten=True)`) is left out: there ptxas serializes the wgmma instructions
    (warning C7515: the accumulator's zeroing sits inside the pipelined loop)."""
    table = [  # BLOCK_M, BLOCK_N, BLOCK_K, stages, warps, programs per SM, one dot
        (128, 128, 64, 3, 8, 1, False),
        (128, 64, 64, 4, 4, 1, False),
        (128, 64, 64, 3, 4, 2, False),
        (128, 128, 64, 3, 8, 1, True),
        (128, 128, 64, 4, 8, 1, True),
        (128, 128, 128, 2, 8, 1, True),
        (128, 64, 64, 4, 4, 1, True),
        (64, 128, 64, 4, 4, 1, True),
        (128, 64, 64, 3, 4, 2, True),
        (64, 128, 64, 2, 4, 2, True),
    ]
    return [
        triton.Config(
            {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8, "OCCUPANCY": occ, "ONE_DOT": one},
            num_stages=st,
            num_warps=w,
            pre_hook=set_block_shapes,
        )
        for bm, bn, bk, st, w, occ, one in table
    ]


def _quick_bench(fn: Callable, quantiles=None):
    """The autotuner's timer: shorter than Triton's default (10 + 40 ms per config); on the CPU
    (--smoke) two timed calls."""
    if DEVICE == "cuda":
        return triton.testing.do_bench(fn, warmup=10, rep=40, quantiles=quantiles)
    ms = statistics.median(_cpu_ms(fn) for _ in range(2))
    return [ms] * len(quantiles) if quantiles else ms


def _cpu_ms(fn: Callable) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


_TUNED = None


def tuned_kernel():
    """gate_up_kernel autotuned per (M, I, K, EPILOGUE), made on first use (never by --interpret-check)."""
    global _TUNED
    if _TUNED is None:
        _TUNED = triton.autotune(configs(), key=["M", "I", "K", "EPILOGUE"], do_bench=_quick_bench)(
            gate_up_kernel
        )
    return _TUNED


def interleave(w_gu: torch.Tensor, block_n: int) -> torch.Tensor:
    """[W_gate; W_up] (2I, K) -> (2 nb BLOCK_N, K), nb = ceil(I / BLOCK_N): row block j of W_gate, then
    row block j of W_up, for every j (zero rows pad I up to nb BLOCK_N). A one-time copy of the weights,
    as the step's `torch.cat([W_gate, W_up])` already is."""
    i, k = w_gu.shape[0] // 2, w_gu.shape[1]
    nb = triton.cdiv(i, block_n)
    out = torch.zeros((nb, 2, block_n, k), dtype=w_gu.dtype, device=w_gu.device)
    g = torch.zeros((nb * block_n, k), dtype=w_gu.dtype, device=w_gu.device)
    u = torch.zeros_like(g)
    g[:i], u[:i] = w_gu[:i], w_gu[i:]
    out[:, 0], out[:, 1] = g.view(nb, block_n, k), u.view(nb, block_n, k)
    return out.view(2 * nb * block_n, k)


class GateUp:
    """The fused kernel's launcher for one (x, W_gu) pair: descriptors and outputs made once.

    x (M, K), w_gu (2I, K) = [W_gate; W_up]. Outputs: gu (M, 2I) and h (M, I), bf16."""

    def __init__(
        self, x: torch.Tensor, w_gu: torch.Tensor, num_sms: int, block_ns: tuple[int, ...] = (64, 128)
    ) -> None:
        m, k = x.shape
        i = w_gu.shape[0] // 2
        if k % 8 or i % 8:  # TMA: every row stride a multiple of 16 bytes, both halves aligned
            raise ValueError(f"K={k} and I={i} must be multiples of 8 for TMA descriptors")
        self.m, self.k, self.i, self.num_sms = m, k, i, num_sms
        self.gu = torch.empty((m, 2 * i), dtype=x.dtype, device=x.device)
        self.h = torch.empty((m, i), dtype=x.dtype, device=x.device)
        blk = [16, 16]  # replaced by set_block_shapes before every launch
        self.x_desc = TensorDescriptor(x, [m, k], [k, 1], blk)
        self.wg_desc = TensorDescriptor(w_gu[:i], [i, k], [k, 1], blk)
        self.wu_desc = TensorDescriptor(w_gu[i:], [i, k], [k, 1], blk)
        by_block_n = {bn: interleave(w_gu, bn) for bn in block_ns}  # for ONE_DOT configs
        first = by_block_n[block_ns[0]]
        self.wi_desc = TensorDescriptor(first, list(first.shape), [k, 1], blk)
        self.wi_desc.by_block_n = by_block_n  # set_block_shapes picks the config's BLOCK_N
        self.h_desc = TensorDescriptor(self.h, [m, i], [i, 1], blk)
        self.g_desc = TensorDescriptor(self.gu[:, :i], [m, i], [2 * i, 1], blk)
        self.u_desc = TensorDescriptor(self.gu[:, i:], [m, i], [2 * i, 1], blk)

    def _args(self) -> tuple:
        d = (self.x_desc, self.wg_desc, self.wu_desc, self.wi_desc, self.h_desc, self.g_desc, self.u_desc)
        return (*d, self.m, self.i, self.k)

    def _grid(self, meta: dict) -> tuple[int]:
        tiles = triton.cdiv(self.m, meta["BLOCK_M"]) * triton.cdiv(self.i, meta["BLOCK_N"])
        return (min(self.num_sms * meta["OCCUPANCY"], tiles),)

    def run(self, epilogue: int) -> None:
        """Autotuned launch (under the interpreter, --smoke, with the dots' fp32 operands)."""
        tuned_kernel()[self._grid](*self._args(), EPILOGUE=epilogue, NUM_SMS=self.num_sms, DOT_F32=INTERPRET)

    def run_fixed(self, epilogue: int, config: dict, num_warps: int = 4, num_stages: int = 2) -> None:
        """Launch with one given config (the interpreter check; no autotuning)."""
        meta = dict(config, EPILOGUE=epilogue, NUM_SMS=self.num_sms)
        args = self._args()
        set_block_shapes(dict(zip(gate_up_kernel.arg_names, args, strict=False), **meta))
        gate_up_kernel[self._grid(meta)](*args, **meta, num_warps=num_warps, num_stages=num_stages)


# -- references and checks -------------------------------------------------------------------------
def reference_gu_h(x: torch.Tensor, w_gu: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gu and h as the unfused path defines them: fp32 products rounded to bf16, then kdistill's
    SwiGLU reference on the two halves (fp32 math inside silu * up, rounded to bf16)."""
    gu = (x.float() @ w_gu.float().t()).to(x.dtype)
    i = w_gu.shape[0] // 2
    return gu, swiglu_reference(gu[:, :i], gu[:, i:])


def agreement(out: torch.Tensor, ref: torch.Tensor) -> dict:
    """Max abs error, max error relative to max |ref|, and whether every element is within a few bf16
    ulps of ref (rtol 2^-5, atol 2^-7 x rms(ref): the GEMMs' different summation orders may flip a
    rounding of g or u, which silu can amplify where |g| is large and h is small)."""
    o, r = out.float(), ref.float()
    diff = (o - r).abs()
    rms = r.pow(2).mean().sqrt().item()
    ok = bool(torch.all(diff <= 2**-5 * r.abs() + 2**-7 * rms).item()) and bool(
        torch.isfinite(o).all().item()
    )
    ref_max = r.abs().max().item()
    max_abs = diff.max().item()
    return {"max_abs": max_abs, "max_rel": max_abs / ref_max if ref_max else 0.0, "ok": ok}


def interpret_check() -> int:
    """The kernel under Triton's interpreter on the CPU at a tiny, ragged shape (M, K, I not multiples
    of the blocks; more tiles than programs), every epilogue and both dot forms against the PyTorch
    reference. The interpreter truncates fp32 -> bf16 casts where the GPU rounds to nearest even, so
    its outputs sit up to a few bf16 ulps from the reference (within `agreement`'s tolerance); a wrong
    tile, half or edge is off by O(1), and outputs start as NaN so that an unwritten element fails."""
    if not INTERPRET:
        print("--interpret-check needs TRITON_INTERPRET=1 set before Triton is imported")
        return 2
    torch.manual_seed(0)
    m, k, i = 70, 40, 40
    x = torch.randn(m, k).to(torch.bfloat16)
    w_gu = (torch.randn(2 * i, k) / k**0.5).to(torch.bfloat16)
    gu_ref, h_ref = reference_gu_h(x, w_gu)
    # DOT_F32: Triton's interpreter (3.6 and 3.9) returns garbage for a dot of bf16 blocks, so the
    # check feeds the dots exact fp32 upcasts of the same tiles; everything else is the GPU's code
    config = {"BLOCK_M": 32, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 2, "OCCUPANCY": 1, "DOT_F32": True}
    failures = 0
    for (name, epi), one_dot in itertools.product(EPILOGUES.items(), (False, True)):
        op = GateUp(x, w_gu, num_sms=3, block_ns=(16,))  # 3 x 3 tiles, 3 programs: three tiles each
        op.gu.fill_(float("nan"))  # every element must be written, none outside the tensors
        op.h.fill_(float("nan"))
        op.run_fixed(epi, dict(config, ONE_DOT=one_dot))
        checks = {}
        if epi != 1:
            checks["gu"] = agreement(op.gu, gu_ref)
        if epi != 0:
            checks["h"] = agreement(op.h, h_ref)
        for out, res in checks.items():
            failures += not res["ok"]
            status = "ok" if res["ok"] else "FAILED"
            print(
                f"interpreter {name:<11} {'one dot ' if one_dot else 'two dots'} {out:<2} M={m} K={k} I={i}: "
                f"max abs {res['max_abs']:.3g}, "
                f"max rel {res['max_rel']:.3g} {status}"
            )
    print(f"triton {triton.__version__}, torch {torch.__version__}: {'FAILED' if failures else 'passed'}")
    return 1 if failures else 0


# -- the measurement ------------------------------------------------------------------------------
def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def time_ms(fns: dict[str, Callable[[], object]], iters: int, rounds: int) -> dict[str, float]:
    """Median ms per call of each fn, `rounds` interleaved rounds of `iters` calls each (one CUDA
    event pair per call; the providers alternate so that drift of the card's clock hits all alike)."""
    for fn in fns.values():  # warm-up: compiles, autotuning, cuBLAS heuristics
        fn()
        fn()
    _sync()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            if DEVICE != "cuda":
                samples[name] += [_cpu_ms(fn) for _ in range(iters)]
                continue
            ev = [
                (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                for _ in range(iters)
            ]
            for a, b in ev:
                a.record()
                fn()
                b.record()
            torch.cuda.synchronize()
            samples[name] += [a.elapsed_time(b) for a, b in ev]
    return {name: statistics.median(v) for name, v in samples.items()}


def copy_bandwidth(nbytes: int) -> float:
    """Device-to-device copy rate in bytes/s (read + write), the achievable HBM rate of this card."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    ms = time_ms({"copy": lambda: dst.copy_(src)}, iters=10, rounds=2)["copy"]
    return 2 * nbytes / (ms * 1e-3)


def matmul_rate(n: int) -> float:
    """cuBLAS bf16 TFLOP/s on n x n x n, the reference rate of NOTES.md's FLOP floors."""
    a = torch.randn(n, n, device=DEVICE, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=DEVICE, dtype=torch.bfloat16)
    ms = time_ms({"mm": lambda: a @ b}, iters=10, rounds=2)["mm"]
    return 2 * n**3 / (ms * 1e-3) / 1e12


def check_against_truth(op: GateUp, base_h: torch.Tensor, x, w_gu, rows: int = 4096) -> dict:
    """The fused h against the baseline's h (all rows: the check that counts) and, for information,
    both against an fp32 truth (silu(g) * u with no bf16 rounding of g or u) on the first and last
    `rows` rows: the two paths' errors against it should be alike (their `ok` is not asked for)."""
    out = {"fused_vs_baseline": agreement(op.h, base_h)}
    i, rows = op.i, min(rows, op.m // 2)
    idx = torch.cat([torch.arange(0, rows), torch.arange(op.m - rows, op.m)]).to(x.device)
    gu = x[idx].float() @ w_gu.float().t()  # (2 x rows, 2I) fp32, TF32 off
    truth = torch.nn.functional.silu(gu[:, :i]) * gu[:, i:]
    out["fused_vs_fp32"] = agreement(op.h[idx], truth)
    out["baseline_vs_fp32"] = agreement(base_h[idx], truth)
    return out


def _config_record(cfg) -> dict:
    return {**cfg.kwargs, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}


def run_shape(model: str, batch: int, args, num_sms: int, bw: float) -> dict:
    """Autotune, check and time every provider at one (model, batch); the row of the table and JSON."""
    from kdistill import dispatch

    k, i, layers = (SMOKE_MODELS if args.smoke else MODELS)[model]
    m = batch * args.seq
    torch.manual_seed(0)
    x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
    w_gu = (torch.randn(2 * i, k, device=DEVICE) / k**0.5).to(torch.bfloat16)  # g, u ~ N(0, 1)
    gu = torch.empty(m, 2 * i, device=DEVICE, dtype=torch.bfloat16)
    op = GateUp(x, w_gu, num_sms)
    halves = (gu[:, :i], gu[:, i:])

    def cublas_gemm():
        torch.mm(x, w_gu.t(), out=gu)

    def swiglu():
        return dispatch.swiglu(*halves)

    def baseline():
        torch.mm(x, w_gu.t(), out=gu)
        return dispatch.swiglu(*halves)

    best, tuning = {}, {}
    for name, epi in EPILOGUES.items():  # autotune each epilogue now, outside the timed rounds
        op.run(epi)
        tuner = tuned_kernel()
        best[name] = _config_record(tuner.best_config)
        # every config's median ms at this shape: which tile form and occupancy the rate comes from
        tuning[name] = [
            {**_config_record(c), "ms": t[0] if isinstance(t, list) else t}
            for c, t in getattr(tuner, "configs_timings", {}).items()
        ]
    _sync()

    with torch.no_grad():
        base_h = baseline()
        op.run(EPILOGUES["fused"])
        _sync()
        checks = check_against_truth(op, base_h, x, w_gu)
        op.run(EPILOGUES["fused_save"])  # its h and gu against the baseline's
        checks["fused_save_h_vs_baseline"] = agreement(op.h, base_h)
        checks["fused_save_gu_vs_cublas"] = agreement(op.gu, gu)
        del base_h
        fns = {
            "cublas_gemm": cublas_gemm,
            "swiglu": swiglu,
            "baseline": baseline,
            **{name: (lambda e=epi: op.run(e)) for name, epi in EPILOGUES.items()},
        }
        ms = time_ms(fns, args.iters, args.rounds)

    flop = 2 * m * k * 2 * i
    inter = m * 2 * i * 2  # bytes of the (M, 2I) bf16 intermediate
    h_bytes = m * i * 2
    row = {
        "model": model,
        "batch": batch,
        "M": m,
        "K": k,
        "I": i,
        "layers": layers,
        "gemm_tflop": flop / 1e12,
        "ms": ms,
        "tflops": {n: flop / (ms[n] * 1e-3) / 1e12 for n in ("cublas_gemm", "baseline", *EPILOGUES)},
        "triton_gemm_vs_cublas": ms["cublas_gemm"] / ms["triton_gemm"],
        "speedup_fused": ms["baseline"] / ms["fused"],
        "speedup_fused_save": ms["baseline"] / ms["fused_save"],
        "floor": {
            "intermediate_gb": inter / 1e9,
            # h only: the intermediate is neither written nor read
            "saving_fused_ms": 2 * inter / bw * 1e3,
            "saving_fused_ms_at_3tbs": 2 * inter / ASSUMED_BW * 1e3,
            # h and gu: only the SwiGLU kernel's read of the intermediate goes
            "saving_fused_save_ms": inter / bw * 1e3,
            "swiglu_kernel_floor_ms": (inter + h_bytes) / bw * 1e3,
        },
        "measured_saving_ms": {
            "fused": ms["baseline"] - ms["fused"],
            "fused_save": ms["baseline"] - ms["fused_save"],
        },
        "best_config": best,
        "autotune_ms": tuning,
        "checks": checks,
    }
    # per micro-batch of the training step: every layer's forward; the teacher runs `fused`, the
    # student `fused_save` (its backward needs gu)
    variant = "fused" if model == "teacher" else "fused_save"
    row["step_saving_ms"] = {"variant": variant, "ms": layers * row["measured_saving_ms"][variant]}
    return row


def print_row(r: dict) -> None:
    ms, tf = r["ms"], r["tflops"]
    print(
        f"{r['model']:<8}{r['batch']:>3}{r['M']:>7}{r['K']:>6}{r['I']:>6} | "
        f"{ms['cublas_gemm']:7.3f} ({tf['cublas_gemm']:4.0f}) {ms['swiglu']:7.3f} {ms['baseline']:7.3f} | "
        f"{ms['triton_gemm']:7.3f} ({tf['triton_gemm']:4.0f}, {r['triton_gemm_vs_cublas']:5.1%}) "
        f"{ms['fused']:7.3f} {ms['fused_save']:7.3f} | "
        f"{r['speedup_fused']:5.3f}x {r['speedup_fused_save']:5.3f}x | "
        f"{r['floor']['saving_fused_ms']:6.3f} {r['measured_saving_ms']['fused']:7.3f} "
        f"{r['step_saving_ms']['ms']:7.2f}"
    )


def _argv_for_record() -> str:
    """The command line as run, the output file named by its base name only (as the other benchmarks
    record it)."""
    args = list(sys.argv[1:])
    for n, arg in enumerate(args[:-1]):
        if arg == "--json":
            args[n + 1] = "benchmarks/results/" + os.path.basename(args[n + 1])
    return " ".join(args)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--batches", nargs="+", type=int, default=[4, 8, 16])
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=10, help="calls per provider per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--interpret-check", action="store_true", help="the kernel at a tiny shape, interpreted")
    ap.add_argument("--smoke", action="store_true", help="this script's whole path on the CPU, interpreted")
    args = ap.parse_args()
    if args.interpret_check:
        return interpret_check()
    if args.smoke:
        if not INTERPRET:
            print("--smoke needs TRITON_INTERPRET=1 set before Triton is imported")
            return 2
        args.batches, args.seq, args.iters, args.rounds = [1], 80, 1, 1
    elif DEVICE != "cuda" or not torch.cuda.is_available():
        print("no CUDA device (or TRITON_INTERPRET=1): the measurement needs a GPU; see --smoke")
        return 2

    from kdistill import dispatch

    dispatch.configure(
        kernels="triton", strict=True, arch="auto" if DEVICE == "cuda" else "sm_90", device=DEVICE
    )
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 truth of the checks
    if DEVICE == "cuda":
        num_sms = torch.cuda.get_device_properties(0).multi_processor_count
        device_name = torch.cuda.get_device_name()
        bw, peak = copy_bandwidth(2**30), matmul_rate(8192)
    else:
        num_sms, device_name = 2, f"CPU ({platform.machine()}, interpreter smoke run)"
        bw, peak = copy_bandwidth(2**20), matmul_rate(64)
    print(
        f"{device_name}: {num_sms} SMs, copy {bw / 1e12:.2f} TB/s, bf16 mm 8192^3 {peak:.0f} TFLOP/s; "
        f"torch {torch.__version__}, triton {triton.__version__}"
    )
    print(
        "model     b      M     K     I |  cuBLAS ms (TF/s)  swiglu    base | triton gemm ms (TF/s, "
        "vs cuBLAS)   fused  f+save | speedup f, f+save | floor  saved  step"
    )
    rows = []
    for model in args.models:
        for batch in args.batches:
            r = run_shape(model, batch, args, num_sms, bw)
            if DEVICE == "cuda":
                torch.cuda.empty_cache()  # the shape's tensors are gone; the next shape starts clean
            print_row(r)
            rows.append(r)
    failed = [
        f"{r['model']} b{r['batch']} {name}"
        for r in rows
        for name in ("fused_vs_baseline", "fused_save_h_vs_baseline", "fused_save_gu_vs_cublas")
        if not r["checks"][name]["ok"]
    ]
    for r in rows:
        c = r["checks"]
        print(
            f"check {r['model']} b{r['batch']}: fused vs baseline max abs "
            f"{c['fused_vs_baseline']['max_abs']:.3g}; vs fp32 truth: fused "
            f"{c['fused_vs_fp32']['max_abs']:.3g}, baseline {c['baseline_vs_fp32']['max_abs']:.3g}; best "
            + ", ".join(
                f"{n}: {b['BLOCK_M']}x{b['BLOCK_N']}x{b['BLOCK_K']} s{b['num_stages']} w{b['num_warps']}"
                f" x{b['OCCUPANCY']}{' one-dot' if b['ONE_DOT'] else ''}"
                for n, b in r["best_config"].items()
            )
        )
    for r in rows:  # which tile form and occupancy the rates come from (best ms of each, per variant)
        parts = []
        for name, runs in r["autotune_ms"].items():
            best_of = {
                label: min((t["ms"] for t in runs if t[key] == value), default=float("nan"))
                for label, key, value in (
                    ("two dots", "ONE_DOT", False),
                    ("one dot", "ONE_DOT", True),
                    ("1/SM", "OCCUPANCY", 1),
                    ("2/SM", "OCCUPANCY", 2),
                )
            }
            parts.append(f"{name} " + " ".join(f"{k} {v:.3f}" for k, v in best_of.items()))
        print(f"autotune {r['model']} b{r['batch']} (best ms): " + "; ".join(parts))
    verdict = "FAILED " + "; ".join(failed) if failed else "every fused output within tolerance"
    print(f"correctness: {verdict}")
    step = {}
    for batch in args.batches:
        step[batch] = sum(r["step_saving_ms"]["ms"] for r in rows if r["batch"] == batch)
        print(
            f"batch {batch}: measured saving per step, all layers' forwards (teacher fused, student "
            f"fused_save): {step[batch]:.1f} ms"
        )
    if args.json:
        record = {
            "bench": "gemm_epilogue_bench",
            "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "command": "python3 benchmarks/gemm_epilogue_bench.py " + _argv_for_record(),
            "device": device_name,
            "num_sms": num_sms,
            "torch": torch.__version__,
            "triton": triton.__version__,
            "copy_bandwidth_tbs": bw / 1e12,
            "matmul_8192_tflops": peak,
            "rows": rows,
            "step_saving_ms_by_batch": step,
            "correct": not failed,
        }
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
        print(f"wrote {args.json}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
