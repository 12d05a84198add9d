"""Where one fused decode block's time goes (kernels/decode_block.py): each phase launched alone, and the
whole block (every phase, grid-wide barriers between them), at a model's shapes with random weights.

    PYTHONPATH=src python3 benchmarks/decode_block_phases.py --models qwen2.5-0.5b --rows 1,16 \
        --variants 128x4x3,256x4x3 --json benchmarks/results/decode_block_phases.json

A variant is BLOCK_K x num_warps x num_stages (the product tiles' K chunk, the programs' warps, the
loops' pipeline depth), then '@P' for P programs per SM (256x4x3@2). Each launch is
captured 20 times in one CUDA graph and the graph replayed; the time per launch is the median of the
replays over 20. `barriers_us` = the whole block minus the sum of its phases alone (the barriers, and
whatever the phases gain or lose from running back to back). The floor is the block's weight bytes over
the copy bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from kdistill.kernels import decode_block as db
from kdistill.kernels.keys import KernelKey
from kdistill.models.spec import load_spec

try:
    from generate_bench import copy_bandwidth
    from kd_throughput import _argv_for_record
    from kd_throughput import _version as version
except ImportError:  # pragma: no cover
    from benchmarks.generate_bench import copy_bandwidth
    from benchmarks.kd_throughput import _argv_for_record
    from benchmarks.kd_throughput import _version as version


def variant(key: KernelKey, text: str, phase: int, hidden: int, intermediate: int) -> tuple[KernelKey, int]:
    """(`key` with the variant's tiles, programs per SM): BLOCK_K x num_warps x num_stages, then '@P'
    for P programs per SM (default 1)."""
    text, _, per_sm = text.partition("@")
    block_k, warps, stages = (int(t) for t in text.split("x"))
    change = {
        "BLOCK_K": block_k,
        "num_warps": warps,
        "PHASE": phase,
        "SPLITK": db.split_k(hidden, intermediate, int(key["BLOCK_N"]), block_k),
        "num_stages": stages,
    }
    params = tuple((n, change.get(n, v)) for n, v in key.params)
    return KernelKey(key.op, key.arch, params), int(per_sm or 1)


def launch_us(fn, reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        with torch.cuda.graph(g):
            for _ in range(20):
                fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000 / 20)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="qwen2.5-0.5b")
    ap.add_argument("--rows", default="1,16")
    ap.add_argument("--variants", default="128x4x3,256x4x3")
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    programs = torch.cuda.get_device_properties(dev).multi_processor_count
    bw = copy_bandwidth()
    out = {
        "device": torch.cuda.get_device_name(),
        "versions": {"torch": torch.__version__, "triton": version("triton")},
        "argv": _argv_for_record(),
        "rows": [],
    }
    out["copy_bandwidth_GBps"] = bw / 1e9
    for name in args.models.split(","):
        spec = load_spec(name)
        h, hq, hkv, d, inter = (
            spec.hidden_size,
            spec.num_heads,
            spec.num_kv_heads,
            spec.head_dim,
            spec.intermediate_size,
        )
        nqkv, m = (hq + 2 * hkv) * d, args.max_len
        g = torch.Generator(device=dev).manual_seed(0)

        def rnd(*shape, scale=0.02, g=g):
            return (torch.randn(shape, generator=g, device=dev) * scale).bfloat16()

        w = db.BlockWeights(
            ln1=1 + rnd(h), qkv=rnd(nqkv, h), qkv_bias=rnd(nqkv) if spec.attention_bias else None,
            o=rnd(h, hq * d), ln2=1 + rnd(h), gate_up=rnd(2 * inter, h), down=rnd(h, inter),
        )  # fmt: skip
        weight_bytes = sum(t.numel() * 2 for t in (w.qkv, w.o, w.gate_up, w.down))
        cos, sin = torch.randn(m, d, device=dev), torch.randn(m, d, device=dev)
        for rows in [int(r) for r in args.rows.split(",")]:
            kc, vc = rnd(rows, hkv, m, d), rnd(rows, hkv, m, d)
            pos = torch.full((rows,), m // 2, device=dev, dtype=torch.int64)
            sc = db.Scratch.empty(
                hidden=h, q_size=hq * d, kv_size=hkv * d, intermediate=inter, q_heads=hq, head_dim=d,
                max_len=m, dtype=torch.bfloat16, device=dev,
            )  # fmt: skip
            x = rnd(rows, h, scale=1.0)
            base = db.block_key(
                "sm_90", hidden=h, q_heads=hq, kv_heads=hkv, head_dim=d, intermediate=inter, dtype="bf16",
                max_len=m, bias=spec.attention_bias, first=False,
            )  # fmt: skip
            for v in args.variants.split(","):
                row = {"model": name, "rows": rows, "variant": v, "phases_us": {}}
                for p in range(0, db.PHASES + 1):
                    key, per_sm = variant(base, v, p, h, inter)
                    spec_ = db.launch(key, x, w, kc, vc, pos, cos, sin, sc, programs * per_sm, spec.rms_eps)
                    row["phases_us"][p] = launch_us(lambda s=spec_: db.run(s))
                block = row["phases_us"].pop(0)
                row["block_us"] = block
                row["barriers_us"] = block - sum(row["phases_us"].values())
                row["floor_us"] = weight_bytes / bw * 1e6
                out["rows"].append(row)
                ph = " ".join(f"{p}:{t:.1f}" for p, t in row["phases_us"].items())
                print(
                    f"{name} rows {rows} {v}: block {block:.1f} us (floor {row['floor_us']:.1f}) phases {ph} "
                    f"barriers+ {row['barriers_us']:.1f}",
                    flush=True,
                )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
