"""The KD head's rows kernel at one chunk of real-vocabulary logits, over its tile choices.

    PYTHONPATH=src python3 benchmarks/kd_rows_tiles.py --json benchmarks/results/kd_rows_tiles_<date>_h100.json

One chunk as the training step launches it (kd.chunk_size rows of Qwen2.5's 151,936-entry vocabulary,
forward KL with CE by default, gradient written over the student's logits), for bf16 and fp32 logits, at
each BLOCK_V x num_warps pair: milliseconds (CUDA events, median), and the bandwidth the kernel reaches on
its bytes (two passes reading both logits, one gradient write: 10 bytes a logit in bf16, 20 in fp32; three
passes for jsd, tvd and the skew divergences: 14 and 28). `kernels/kd_loss.py`'s `tiles` picks BLOCK_V =
4096 and 8 warps at this vocabulary. On-policy's loss (JSD at alpha 1, temperature 0.9, bf16 at the
planned tiles):

    PYTHONPATH=src python3 benchmarks/kd_rows_tiles.py --divergence jsd --alpha 1 --temperature 0.9 \
        --dtypes bf16 --planned
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

try:  # run as a script (benchmarks/ on sys.path) or as a module
    from cuda_timing import median_seconds
except ImportError:  # pragma: no cover
    from benchmarks.cuda_timing import median_seconds
from kdistill.kernels import kd_loss as kd_kernel


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--divergence", default="forward_kl")
    ap.add_argument("--alpha", type=float, default=0.5)
    ap.add_argument("--temperature", type=float, default=2.0)
    ap.add_argument("--dtypes", default="bf16,fp32")
    ap.add_argument("--planned", action="store_true", help="only the tiles kernels/kd_loss.py plans")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    labels = torch.randint(0, a.vocab, (a.rows,), device="cuda", generator=g)
    results = []
    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32}
    passes = 2 if a.divergence in ("forward_kl", "reverse_kl") else 3
    chosen = kd_kernel.tiles(a.vocab, a.divergence, True, True)
    for dtype in (dtypes[d] for d in a.dtypes.split(",")):
        s0 = (torch.randn(a.rows, a.vocab, device="cuda", generator=g) * 4).to(dtype)
        t = (torch.randn(a.rows, a.vocab, device="cuda", generator=g) * 4).to(dtype)
        s = s0.clone()
        width = 2 if dtype == torch.bfloat16 else 4
        per_logit = 2 * width * passes + 2  # bf16 gradient either way (the chunk loop's)
        pairs = [(bv, w) for bv in (2048, 4096, 8192, 16384) for w in (4, 8, 16)]
        if a.planned:
            pairs = [(chosen["BLOCK_V"], chosen["num_warps"])]
        for bv, warps in pairs:
            kernel, grid, args, kwargs, _ = kd_kernel.launch_args(
                s, t, labels, alpha=a.alpha, temperature=a.temperature, divergence=a.divergence,
                grad_scale=1e-3, grad_dtype=torch.bfloat16, block_v=bv,
            )  # fmt: skip
            kwargs = {**kwargs, "num_warps": warps}

            def run(kernel=kernel, grid=grid, args=args, kwargs=kwargs, s=s, s0=s0):
                s.copy_(s0)  # the kernel writes over the student's logits
                kernel[grid](*args, **kwargs)

            copy = median_seconds(lambda s=s, s0=s0: s.copy_(s0), a.reps)
            sec = median_seconds(run, a.reps) - copy
            gbs = a.rows * a.vocab * per_logit / sec / 1e9
            mark = " (tiles)" if (bv, warps) == (chosen["BLOCK_V"], chosen["num_warps"]) else ""
            print(
                f"{str(dtype)[6:]:8s} BLOCK_V {bv:6d} warps {warps:2d}: {sec * 1e3:7.3f} ms  {gbs:7.0f} GB/s{mark}"
            )
            results.append(dict(dtype=str(dtype)[6:], block_v=bv, num_warps=warps, ms=sec * 1e3, gb_s=gbs))
    if a.json:
        doc = dict(
            device=torch.cuda.get_device_name(),
            torch=torch.__version__,
            date=time.strftime("%Y-%m-%d"),
            command="python3 benchmarks/kd_rows_tiles.py " + " ".join(sys.argv[1:]),
            divergence=a.divergence,
            alpha=a.alpha,
            temperature=a.temperature,
            results=results,
        )
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
