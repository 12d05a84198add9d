"""The frozen teacher's forward, whole or a few sequences at a time: does keeping each layer's
intermediates in L2 pay for the smaller GEMMs?

    PYTHONPATH=src python3 benchmarks/teacher_chunk_bench.py --json benchmarks/results/teacher_chunk_<date>_h100.json

The teacher runs forward only, so nothing it computes inside a block is kept: at 16 x 2048 tokens its
gate/up GEMM writes a (32768, 2 x 8960) bf16 output (1.17 GB per layer) that the SwiGLU kernel reads
back from HBM, and every norm, RoPE and residual pass streams (32768, 1536) tensors through HBM. Run one
sequence (2048 tokens) at a time and the gate/up output is 73 MB, the hidden states 6 MB: the elementwise
passes read what the GEMM before them just wrote, largely from the 50 MB L2. The GEMMs get 16x fewer rows
(M = 2048 instead of 32768), which costs them some of their rate. This script times both at Qwen2.5-1.5B
shapes (random weights, kdistill's kernels, bf16, and the FP8 teacher) and prints the difference per
training step; CUDA events, median of --reps after warm-up, every variant in the same process.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

try:  # run as a script (benchmarks/ on sys.path) or as a module
    from cuda_timing import median_seconds
except ImportError:  # pragma: no cover
    from benchmarks.cuda_timing import median_seconds
from kdistill.kernels import runtime
from kdistill.models.decoder import build_decoder
from kdistill.models.fp8 import convert_to_fp8
from kdistill.models.spec import load_spec


def forward_rows(teacher, ids: torch.Tensor, rows: int, out: torch.Tensor) -> torch.Tensor:
    """teacher(ids) (B, T, H) computed `rows` sequences at a time into `out`."""
    for i in range(0, ids.shape[0], rows):
        out[i : i + rows] = teacher(ids[i : i + rows])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-1.5b")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--rows", default="16,8,4,2,1", help="sequences per forward (16: the whole batch)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("teacher_chunk_bench.py needs a CUDA GPU")
    spec = load_spec(a.model)
    dev = torch.device("cuda")
    runtime.configure(kernels="triton", device=dev)
    g = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(0, spec.vocab_size, (a.batch, a.seq_len), device=dev, generator=g)
    out = torch.empty((a.batch, a.seq_len, spec.hidden_size), device=dev, dtype=torch.bfloat16)
    results = []
    for precision in ("bf16", "fp8"):
        teacher = build_decoder(spec, device=dev, dtype=torch.bfloat16, seed=1).eval().requires_grad_(False)
        if precision == "fp8":
            convert_to_fp8(teacher)
        with torch.no_grad():
            ref = teacher(ids).float()
            for rows in [int(r) for r in a.rows.split(",")]:
                t0 = time.perf_counter()
                sec = median_seconds(lambda r=rows, m=teacher: forward_rows(m, ids, r, out), a.reps, a.warmup)
                err = float((out.float() - ref).abs().max() / ref.abs().max())
                row = dict(precision=precision, rows=rows, ms=sec * 1e3, max_rel_diff=err)
                row["wall_s"] = time.perf_counter() - t0
                results.append(row)
                print(
                    f"{precision:5s} rows {rows:3d}: {sec * 1e3:8.2f} ms  (max rel diff to whole {err:.1e})"
                )
        teacher = None
        torch.cuda.empty_cache()
    if a.json:
        doc = dict(
            device=torch.cuda.get_device_name(),
            torch=torch.__version__,
            model=a.model,
            batch=a.batch,
            seq_len=a.seq_len,
            date=time.strftime("%Y-%m-%d"),
            command="python3 benchmarks/teacher_chunk_bench.py "
            + " ".join(
                f"--{k.replace('_', '-')} {v}" for k, v in vars(a).items() if v is not None and k != "json"
            ),
            results=results,
        )
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
