"""The cost of a grid-wide barrier inside one persistent Triton kernel (an atomic counter at gpu scope),
and a check that it orders memory: each program writes, waits at the barrier, then reads its neighbour's
write. Two ways to wait: acquire reads of the counter (atomic adds of 0), or volatile loads; the second
is not an acquire, and the neighbour check counts what it misses.

    python3 benchmarks/grid_barrier.py benchmarks/results/grid_barrier.json

Each launch runs 2, 32 or 128 barriers on as many programs as the card has SMs (and half as many),
captured 10 times in a CUDA graph and replayed 20 times: microseconds per launch.
"""

import functools
import json
import sys

import torch
import triton
import triton.language as tl


@triton.jit
def grid_sync(cnt, target):
    tl.debug_barrier()
    tl.atomic_add(cnt, 1, sem="release", scope="gpu")
    c = tl.atomic_add(cnt, 0, sem="acquire", scope="gpu")
    while c < target:
        c = tl.atomic_add(cnt, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def grid_sync_vol(cnt, target):
    tl.debug_barrier()
    tl.atomic_add(cnt, 1, sem="release", scope="gpu")
    c = tl.load(cnt, volatile=True)
    while c < target:
        c = tl.load(cnt, volatile=True)
    tl.atomic_add(cnt, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def probe(cnt, out, err, G, NB: tl.constexpr, VOL: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    e = tl.zeros((BLOCK,), tl.int32)
    for i in range(NB):
        tl.store(out + pid * BLOCK + offs, i + offs * 0)
        if VOL:
            grid_sync_vol(cnt, G * (2 * i + 1))
        else:
            grid_sync(cnt, G * (2 * i + 1))
        nb = (pid + 1) % G
        v = tl.load(out + nb * BLOCK + offs)
        e += (v != i).to(tl.int32)
        if VOL:
            grid_sync_vol(cnt, G * (2 * i + 2))
        else:
            grid_sync(cnt, G * (2 * i + 2))
    tl.atomic_add(err, tl.sum(e))
    x = tl.atomic_add(cnt + 1, 1, sem="acq_rel", scope="gpu")
    if x == G - 1:
        tl.store(cnt, 0)
        tl.store(cnt + 1, 0)


def launch(cnt, out, err, G, NB, vol):
    probe[(G,)](cnt, out, err, G, NB=NB, VOL=vol, BLOCK=128, num_warps=4)


def main():
    dev = "cuda"
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    res = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "sms": sms,
        "argv": " ".join(sys.argv[1:]),
        "rows": [],
    }
    for vol in (0, 1):
        for G in (sms, sms // 2):
            for NB in (1, 16, 64):
                cnt = torch.zeros(2, dtype=torch.int32, device=dev)
                out = torch.zeros(G * 128, dtype=torch.int32, device=dev)
                err = torch.zeros(1, dtype=torch.int32, device=dev)
                f = functools.partial(launch, cnt, out, err, G, NB, vol)
                f()
                torch.cuda.synchronize()
                s = torch.cuda.Stream()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.stream(s):
                    f()
                    torch.cuda.synchronize()
                    with torch.cuda.graph(g):
                        for _ in range(10):
                            f()
                torch.cuda.synchronize()
                g.replay()
                torch.cuda.synchronize()
                err.zero_()
                t0 = torch.cuda.Event(enable_timing=True)
                t1 = torch.cuda.Event(enable_timing=True)
                t0.record()
                for _ in range(20):
                    g.replay()
                t1.record()
                torch.cuda.synchronize()
                us = t0.elapsed_time(t1) * 1000 / 200
                row = dict(volatile=vol, G=G, barriers=2 * NB, us_per_launch=us, errors=int(err.item()))
                res["rows"].append(row)
                print(row, flush=True)
    json.dump(res, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
