"""Experiment: a layer's weights pulled into L2 on a side stream while the decode step's latency-bound
phases run (benchmarks/decode_profile.py --l2-prefetch; NOTES.md, round twenty-eight).

A decode block at 16-128 rows runs six or seven dependent phases; the attention, the norms and the small
products pay ~1.5-3 µs of latency each while the memory system idles, and the large products (gate/up and
the down: 26 MB of the 0.5B's 30 MB a layer) then stream their weights from HBM. Here one program of one
warp issues Hopper's bulk L2 prefetch (`cp.async.bulk.prefetch.L2.global`, fire and forget: no registers,
no shared memory, the program ends once the requests are issued) over a layer's product weights, on a
stream forked from the step's at the layer's attention, so that the products may read them from L2.

`probe(weight, x)` measures the mechanism alone: one product's time with its weights evicted from L2,
after the prefetch (synchronized), and after the product itself ran (the L2-warm bound)."""

from __future__ import annotations

import statistics

import torch
import triton
import triton.language as tl

CHUNK = 16384  # bytes one prefetch request covers (a multiple of 16, as the instruction requires)
BLOCK = 32  # requests a program issues (one a lane): one program of 1,024 issued ~160 GB/s (H200)


@triton.jit
def l2_prefetch_kernel(base, nbytes, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    off = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64) * CHUNK
    size = tl.minimum(nbytes - off, CHUNK).to(tl.int32)  # the tail's request, <= 0 past the end
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r",
        [base + off, size],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


def prefetch(t: torch.Tensor) -> None:
    """Issue L2 prefetches over t's bytes (contiguous, 16-byte aligned, a multiple of 16 bytes)."""
    nbytes = t.numel() * t.element_size()
    assert t.is_contiguous() and t.data_ptr() % 16 == 0 and nbytes % 16 == 0
    flat = t.view(torch.uint8).view(-1)
    grid = (triton.cdiv(nbytes, CHUNK * BLOCK),)
    l2_prefetch_kernel[grid](flat, nbytes, CHUNK=CHUNK, BLOCK=BLOCK, num_warps=1)


def _flush(buf: torch.Tensor) -> None:
    buf.add_(1)  # reads and writes 4x the L2: every line of the weights is evicted


def probe(product, weight: torch.Tensor, reps: int = 30) -> dict:
    """µs of `product()` (a launch reading `weight`): cold (L2 flushed), after prefetch(weight) and a
    synchronization, and warm (right after the same product); the prefetch kernel's own µs."""
    buf = torch.empty(256 << 20, dtype=torch.uint8, device=weight.device)

    def timed(before) -> float:
        out = []
        for _ in range(reps):
            _flush(buf)
            before()
            torch.cuda.synchronize()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(400_000)  # the GPU busy while the host launches: the events time the kernel
            s.record()
            product()
            e.record()
            e.synchronize()
            out.append(s.elapsed_time(e) * 1e3)
        return statistics.median(out)

    def issue() -> float:
        out = []
        for _ in range(reps):
            _flush(buf)
            torch.cuda.synchronize()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(400_000)
            s.record()
            prefetch(weight)
            e.record()
            e.synchronize()
            out.append(s.elapsed_time(e) * 1e3)
        return statistics.median(out)

    return {
        "mb": weight.numel() * weight.element_size() / 1e6,
        "cold_us": timed(lambda: None),
        "prefetched_us": timed(lambda: prefetch(weight)),
        "warm_us": timed(product),
        "prefetch_kernel_us": issue(),
    }


class SidePrefetch:
    """Wraps kdistill.decode.forward_tokens for the decode step: at layer i's attention, a stream forked
    from the step's issues prefetches over the weights `which` names ("mlp": layer i's gate/up and down;
    "all": also its o_proj and layer i + 1's q/k/v); the side stream joins the step's after the blocks,
    so one captured graph holds both."""

    def __init__(self, which: str):
        self.which = which
        self.stream: torch.cuda.Stream | None = None

    def tensors(self, weights, i: int) -> list[torch.Tensor]:
        layer = weights.layers[i]
        out = [layer.gate_up, layer.down]
        if self.which == "all":
            out.insert(0, layer.o)
            if i + 1 < len(weights.layers):
                out.append(weights.layers[i + 1].qkv)
        return out

    def wrap(self, forward_tokens):
        def forward(weights, ids, cos, sin, attend, step=False):
            if not step:
                return forward_tokens(weights, ids, cos, sin, attend, step=step)
            main = torch.cuda.current_stream()
            if self.stream is None:
                self.stream = torch.cuda.Stream()
            side = self.stream

            def attend_(i, q, k, v):
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    for t in self.tensors(weights, i):
                        prefetch(t)
                return attend(i, q, k, v)

            out = forward_tokens(weights, ids, cos, sin, attend_, step=step)
            main.wait_stream(side)
            return out

        return forward
