"""KD loss head alone (lm_heads + divergence + CE, forward and backward): speed and peak memory.

    PYTHONPATH=src python3 benchmarks/kd_loss_bench.py                      # Qwen2.5 shapes, bf16
    PYTHONPATH=src python3 benchmarks/kd_loss_bench.py --tokens 8192 --divergence forward_kl jsd \
        --chunk-size 1024 --json benchmarks/results/kd_loss_bench.json

Providers, on the same inputs (random bf16 hidden states and lm_heads at the real shapes):
  triton     kd_loss, chunked, cuBLAS GEMMs + the Triton divergence kernel per chunk
  reference  kd_loss, chunked, cuBLAS GEMMs + torch ops per chunk (chunk_divergence_reference)
  dense      the obvious code: full [N x V] logits for student and teacher, log_softmax, KL, CE, autograd
Shapes (student <- teacher): H=896 <- Ht=1536 (Qwen2.5-0.5B <- 1.5B), H=1536 <- Ht=3584 (1.5B <- 7B,
whose lm_head is padded to 152064 rows). Reports median ms of forward+backward, peak extra memory,
and the two floors of benchmarks/NOTES.md (GEMM FLOPs / 790 TFLOP/s; logits bytes / 3 TB/s).
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

try:  # run as a script (benchmarks/ on sys.path) or as a module
    from cuda_timing import median_seconds
except ImportError:  # pragma: no cover
    from benchmarks.cuda_timing import median_seconds
from kdistill.ops.kd_loss import chunk_divergence_reference, kd_loss

V = 151936
PAIRS = {"0.5b<-1.5b": (896, 1536, 151936), "1.5b<-7b": (1536, 3584, 152064)}  # H, Ht, Vt
PEAK_FLOPS = 790e12  # H100 SXM dense bf16, what cuBLAS reaches on large GEMMs (~989 spec)
PEAK_BW = 3.0e12  # H100 SXM HBM3, achievable (~3.35 spec)


def floors(n: int, h: int, ht: int, divergence: str, chunk: int) -> dict:
    """Lower bounds for the loss head, in ms.

    gemm: student logits (2NVH), teacher logits (2NVHt), grad_h and grad_W (2 x 2NVH) at PEAK_FLOPS.
    bytes_min: what any implementation must move: weights, hidden states, grads (logits never in HBM).
    bytes_logits: this design's logits traffic per token: GEMMs write s, t (fp32), the kernel reads
    them once per pass (2 passes for the KLs, 3 otherwise) and writes the bf16 gradient, which the two
    backward GEMMs read.
    """
    flops = 2 * n * V * (3 * h + ht)
    b_min = 2 * (V * h + V * ht + n * h + n * ht) + 4 * V * h + 2 * n * h
    passes = 2 if divergence in ("forward_kl", "reverse_kl") else 3
    b_logits = n * V * (4 + 4 + passes * 8 + 2 + 2 * 2)
    return {
        "gemm_ms": flops / PEAK_FLOPS * 1e3,
        "bytes_min_ms": b_min / PEAK_BW * 1e3,
        "bytes_logits_ms": (b_min + b_logits) / PEAK_BW * 1e3,
        "tflop": flops / 1e12,
        "logits_gb": b_logits / 1e9,
    }


def dense_loss(h, w, th, tw, y, alpha, temperature):
    """Forward KL + CE on full [N x V] fp32 logits (what one writes without a fused head)."""
    s = (h @ w.T).float()
    t = (th @ tw[: w.shape[0]].T).float()
    ce = F.cross_entropy(s, y, ignore_index=-100)
    keep = y != -100
    logq = F.log_softmax(s[keep] / temperature, -1)
    logp = F.log_softmax(t[keep] / temperature, -1)
    kl = F.kl_div(logq, logp, log_target=True, reduction="batchmean") * temperature**2
    return (1 - alpha) * ce + alpha * kl


def bench(fn, warmup: int, iters: int) -> tuple[float, float]:
    """(median ms, peak extra MiB) of fn() (forward + backward)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    seconds = median_seconds(fn, iters, warmup=0)
    return seconds * 1e3, (torch.cuda.max_memory_allocated() - base) / 2**20


def run_pair(pair: str, args, kd_loss_chunk_triton) -> list[dict]:
    """Every divergence and provider on one student <- teacher shape."""
    n, (h_dim, ht_dim, vt) = args.tokens, PAIRS[pair]
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    h = torch.randn(n, h_dim, generator=g, device=dev, dtype=torch.bfloat16).requires_grad_()
    sw = (torch.randn(V, h_dim, generator=g, device=dev) * 0.05).bfloat16().requires_grad_()
    th = torch.randn(n, ht_dim, generator=g, device=dev, dtype=torch.bfloat16)
    tw = (torch.randn(vt, ht_dim, generator=g, device=dev) * 0.05).bfloat16()
    y = torch.randint(0, V, (n,), generator=g, device=dev)
    rows = []
    for div in args.divergence:
        fl = floors(n, h_dim, ht_dim, div, args.chunk_size)
        for prov in args.providers:
            if prov == "dense" and div != "forward_kl":
                continue  # the dense baseline is written for forward KL only

            def step(prov=prov, div=div):
                h.grad = sw.grad = None
                if prov == "dense":
                    loss = dense_loss(h, sw, th, tw, y, 0.5, 2.0)
                else:
                    fn = kd_loss_chunk_triton if prov == "triton" else chunk_divergence_reference
                    loss = kd_loss(h, sw, th, tw, y, alpha=0.5, temperature=2.0, divergence=div,
                                   chunk_size=args.chunk_size, chunk_fn=fn).loss  # fmt: skip
                loss.backward()

            try:
                ms, mib = bench(step, args.warmup, args.iters)
            except torch.OutOfMemoryError:
                ms, mib = float("nan"), float("nan")
                torch.cuda.empty_cache()
            rows.append(dict(pair=pair, divergence=div, provider=prov, ms=round(ms, 2), peak_mib=round(mib),
                             floor_gemm_ms=round(fl["gemm_ms"], 2),
                             floor_logits_bytes_ms=round(fl["bytes_logits_ms"], 2),
                             floor_min_bytes_ms=round(fl["bytes_min_ms"], 3)))  # fmt: skip
            print(
                f"{pair:11s} {div:16s} {prov:9s} {ms:9.2f} ms  peak {mib:8.0f} MiB   "
                f"floors: gemm {fl['gemm_ms']:.1f} ms, logits bytes {fl['bytes_logits_ms']:.1f} ms"
            )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--pairs", nargs="+", default=list(PAIRS), choices=list(PAIRS))
    ap.add_argument("--divergence", nargs="+", default=["forward_kl", "jsd"])
    ap.add_argument("--providers", nargs="+", default=["triton", "reference", "dense"])
    ap.add_argument("--chunk-size", type=int, default=1024)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    assert torch.cuda.is_available(), "this benchmark needs a CUDA GPU"
    from kdistill.kernels.kd_loss import kd_loss_chunk_triton

    card = torch.cuda.get_device_name()
    print(f"# {card}, torch {torch.__version__}, N={args.tokens}, V={V}, chunk={args.chunk_size}, bf16")
    rows = []
    for pair in args.pairs:
        rows += run_pair(pair, args, kd_loss_chunk_triton)
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"card": card, "torch": torch.__version__, "tokens": args.tokens, "rows": rows}, f, indent=1
            )


if __name__ == "__main__":
    main()
