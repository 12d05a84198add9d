"""The attention of a T-token decode step (speculative decoding's draft and verify steps): T launches of
the one-token kernel in order against one launch of the T-token kernel, per layer, on one card.

    PYTHONPATH=src python3 benchmarks/decode_attention_tokens.py --tokens 1,2,5,9,17 --batch 1,8 \
        --context 512,4096 --json benchmarks/results/decode_attention_tokens.json

A Qwen2.5-7B-shaped layer by default (28 q heads over 4 kv heads of 128, bf16), RoPE inside the kernel,
q/k/v as views of one (B, T, q/k/v) GEMM output as the engine hands them over. Each variant runs over
`--layers` distinct caches (as a step walks its layers: the caches stream from memory, not from L2),
captured in one CUDA graph; the time is the replay's median divided by the layers (µs per layer, the
launch bubbles inside the graph included). The T-token output is checked against the T one-token
launches' (relative error printed): they write the same slots and must agree.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import sys
import time
from pathlib import Path

import torch

from kdistill import dispatch

try:  # run as a script (benchmarks/ on sys.path) or as a module
    from cuda_timing import median_seconds
except ImportError:  # pragma: no cover
    from benchmarks.cuda_timing import median_seconds


def captured(fn, layers: int) -> torch.cuda.CUDAGraph:
    """fn(layer) for every layer, captured once after two eager passes (which compile and load)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            for i in range(layers):
                fn(i)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(layers):
            fn(i)
    torch.cuda.synchronize()
    return graph


def measure(b: int, t: int, ctx: int, a: argparse.Namespace) -> dict:
    hq, hkv, d, layers = a.q_heads, a.kv_heads, a.head_dim, a.layers
    m = ctx + t + 1
    g = torch.Generator(device="cuda").manual_seed(b * t + ctx)
    w = (hq + 2 * hkv) * d
    qkv = torch.randn((b, t, w), generator=g, device="cuda", dtype=torch.bfloat16)
    q = qkv[..., : hq * d].view(b, t, hq, d).transpose(1, 2)  # (B, Hq, T, D)
    kn = qkv[..., hq * d : (hq + hkv) * d].view(b, t, hkv, d).transpose(1, 2)
    vn = qkv[..., (hq + hkv) * d :].view(b, t, hkv, d).transpose(1, 2)
    ks = [
        torch.randn((b, hkv, m, d), generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(layers)
    ]
    vs = [
        torch.randn((b, hkv, m, d), generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(layers)
    ]
    angles = torch.rand((m, d // 2), generator=g, device="cuda").repeat(1, 2)
    cos, sin = angles.cos(), angles.sin()
    start = torch.full((b,), ctx, dtype=torch.int64, device="cuda")
    pos = [(start + j).clamp(max=m - 1) for j in range(t)]
    outs: dict[str, torch.Tensor] = {}

    def one_token(i: int) -> None:
        o = [
            dispatch.decode_attention(q[:, :, j], ks[i], vs[i], pos[j], kn[:, :, j], vn[:, :, j], cos, sin)
            for j in range(t)
        ]
        outs["one"] = torch.stack(o, 2)

    def multi(i: int) -> None:
        outs["multi"] = dispatch.decode_attention_multi(q, ks[i], vs[i], start, kn, vn, cos, sin)

    row = {"batch": b, "tokens": t, "context": ctx}
    with dispatch.using(mode="triton", arch=a.arch, strict=True):
        for name, fn in (("one_token_x_T", one_token), ("t_token", multi)):
            graph = captured(fn, layers)
            row[f"{name}_us"] = round(median_seconds(graph.replay, a.reps) / layers * 1e6, 2)
    ref = outs["one"].double()
    row["rel_err"] = float((outs["multi"].double() - ref).norm() / ref.norm())
    row["speedup"] = round(row["one_token_x_T_us"] / row["t_token_us"], 3)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="1,2,5,9,17")
    p.add_argument("--batch", default="1,8")
    p.add_argument("--context", default="512,4096", help="filled slots before the step's first token")
    p.add_argument("--q-heads", type=int, default=28)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    cap = torch.cuda.get_device_capability()
    a.arch = f"sm_{cap[0]}{cap[1]}"  # the kernel keys' arch: this card's
    record = {
        "card": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": importlib.metadata.version("triton"),
        "date": time.strftime("%Y-%m-%d"),
        "command": "python3 benchmarks/decode_attention_tokens.py " + " ".join(sys.argv[1:]),
        "shape": {"q_heads": a.q_heads, "kv_heads": a.kv_heads, "head_dim": a.head_dim, "layers": a.layers},
        "runs": [],
    }
    for b in [int(x) for x in a.batch.split(",")]:
        for ctx in [int(x) for x in a.context.split(",")]:
            for t in [int(x) for x in a.tokens.split(",")]:
                row = measure(b, t, ctx, a)
                print(json.dumps(row), flush=True)
                record["runs"].append(row)
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
