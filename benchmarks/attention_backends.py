"""SDPA's backends at the training step's attention shapes: is cuDNN the fastest one here?

The step calls `F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)` and lets
PyTorch pick the backend (cuDNN on Hopper). This times each backend that accepts the call, at the
shapes of a Qwen2.5-1.5B -> 0.5B step (seq 2048): the teacher's forward (12 q heads, 2 k/v heads,
head dim 128, no grad) and the student's forward and backward (14 q heads, 2 k/v heads, head dim 64).
q, k and v are laid out as the step lays them out: (B, T, H, D) memory seen as (B, H, T, D), the
layout RoPE writes. A backend that refuses the call (or GQA) is reported with its one-line reason,
and is also timed with k/v repeated to the q heads (what it would need, copies included).

FLOPs of causal attention: forward 2 * B * Hq * T^2 * D (two GEMMs over half the T x T square),
backward 2.5 times that (five GEMMs).

    PYTHONPATH=src:. python3 benchmarks/attention_backends.py --batch 16 --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

try:  # run as a script (benchmarks/ on sys.path) or as a module
    from cuda_timing import median_seconds
except ImportError:  # pragma: no cover
    from benchmarks.cuda_timing import median_seconds

BACKENDS = {
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
}
# name, q heads, k/v heads, head dim, with backward
SHAPES = [("teacher forward", 12, 2, 128, False), ("student forward+backward", 14, 2, 64, True)]


def _inputs(b: int, t: int, hq: int, hkv: int, d: int, grad: bool) -> tuple[torch.Tensor, ...]:
    def one(h: int) -> torch.Tensor:
        x = torch.randn(b, t, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        return x.requires_grad_(grad)

    return one(hq), one(hkv), one(hkv)


def _case(backend: SDPBackend, q, k, v, grad: bool, repeat: bool):
    g = torch.randn_like(q)

    def fn():
        kk, vv = k, v
        if repeat:
            r = q.shape[1] // k.shape[1]
            kk, vv = k.repeat_interleave(r, dim=1), v.repeat_interleave(r, dim=1)
        with sdpa_kernel([backend]):
            o = F.scaled_dot_product_attention(q, kk, vv, is_causal=True, enable_gqa=not repeat)
        if grad:
            o.backward(g)
            q.grad = k.grad = v.grad = None

    return fn


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json", help="write the rows here")
    a = ap.parse_args(argv)
    warnings.simplefilter("ignore")  # SDPA warns for every backend that declines a call
    rows = []
    b, t = a.batch, a.seq_len
    print(f"{torch.cuda.get_device_name()}: torch {torch.__version__}, batch {b}, seq {t}")
    for name, hq, hkv, d, grad in SHAPES:
        flops = 2 * b * hq * t * t * d * (3.5 if grad else 1.0)
        for bname, backend in BACKENDS.items():
            for repeat in (False, True):
                q, k, v = _inputs(b, t, hq, hkv, d, grad)
                row = {"shape": name, "backend": bname, "kv": "repeated" if repeat else "gqa"}
                try:
                    s = median_seconds(_case(backend, q, k, v, grad, repeat), a.reps, warmup=2)
                except RuntimeError as e:
                    row["refused"] = str(e).splitlines()[0][:160]
                    print(f"  {name:26s} {bname:9s} {row['kv']:8s} refused: {row['refused']}")
                else:
                    row |= {"ms": s * 1e3, "tflops": flops / s / 1e12}
                    print(
                        f"  {name:26s} {bname:9s} {row['kv']:8s} {s * 1e3:8.3f} ms  {flops / s / 1e12:6.1f} TFLOP/s"
                    )
                rows.append(row)
                del q, k, v
                torch.cuda.empty_cache()
    if a.json:
        meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "batch": b, "seq_len": t}
        with open(a.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
