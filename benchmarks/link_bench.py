"""The link between a host's GPUs as FSDP2 uses it: all-gather and reduce-scatter bandwidth by dtype and size.

    python3 -m torch.distributed.run --nproc_per_node=2 --standalone benchmarks/link_bench.py \
        --json benchmarks/results/link.json

Per (collective, dtype, bytes per rank of the full tensor): the median time of --reps calls after two
warm-ups, the algorithm bandwidth (full tensor bytes / time) and NCCL's bus bandwidth ((world - 1) / world
of that, the bytes each link carries). The sizes default to one decoder block of Qwen2.5-0.5B (14.9 M
parameters: the unit FSDP2 gathers and reduces), one of Qwen2.5-1.5B (46.8 M) and 1 GiB. Rank 0 writes the
JSON with the NCCL settings seen in the environment and `nvidia-smi topo -m` (how the GPUs are connected).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
from pathlib import Path

import torch
import torch.distributed as dist

SIZES = {"0.5b_block": 14_912_384, "1.5b_block": 46_797_824, "1GiB_fp32": 2**28}


def timed(fn, reps: int) -> float:
    times = []
    for i in range(reps + 2):
        dist.barrier()
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        if i >= 2:
            times.append(s.elapsed_time(e) / 1e3)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    rows = []
    for name, numel in SIZES.items():
        numel -= numel % world
        for dtype in (torch.bfloat16, torch.float32):
            full = torch.randn(numel, device="cuda").to(dtype)
            shard = torch.empty(numel // world, device="cuda", dtype=dtype)
            nbytes = full.numel() * full.element_size()
            for op, fn in (
                ("all_gather", lambda f=full, s=shard: dist.all_gather_into_tensor(f, s)),
                ("reduce_scatter", lambda f=full, s=shard: dist.reduce_scatter_tensor(s, f)),
            ):
                sec = timed(fn, a.reps)
                row = {
                    "op": op,
                    "size": name,
                    "dtype": str(dtype).removeprefix("torch."),
                    "bytes": nbytes,
                    "ms": sec * 1e3,
                    "algbw_GBps": nbytes / sec / 1e9,
                    "busbw_GBps": nbytes / sec / 1e9 * (world - 1) / world,
                }
                rows.append(row)
                if rank == 0:
                    print(json.dumps(row), flush=True)
            del full, shard
    if rank == 0:
        try:
            topo = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True).stdout
        except OSError:
            topo = None
        tail = f" --json benchmarks/results/{Path(a.json).name}" if a.json else ""
        out = {
            "command": f"python3 -m torch.distributed.run --nproc_per_node={world} --standalone "
            f"benchmarks/link_bench.py{tail}",
            "device": torch.cuda.get_device_name(),
            "world": world,
            "torch": torch.__version__,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())),
            "nccl_env": {k: v for k, v in os.environ.items() if k.startswith("NCCL_")},
            "topology": topo,
            "rows": rows,
        }
        print(topo)
        if a.json:
            Path(a.json).write_text(json.dumps(out, indent=1) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
