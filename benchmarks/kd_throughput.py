"""KD training-step throughput: our Triton kernels vs our PyTorch reference vs a dense-logits baseline.

    PYTHONPATH=src python3 benchmarks/kd_throughput.py --pair qwen2.5-1.5b:qwen2.5-0.5b --seq-len 2048 \
        --batch 4 --steps 10 --json $OUT/kd_throughput.json

One process, one card, random weights at the presets' real shapes, the same batches for every provider:
  triton     kdistill's kernels (prewarmed and sealed first), chunked KD loss head
  reference  kdistill's PyTorch reference ops, chunked KD loss head
  dense      reference ops, and the KD loss written the obvious way: full [tokens x vocab] logits for
             teacher and student, log-softmax, KL (what a user would write without kdistill)
Each step: teacher forward (no grad), student forward, loss, backward, AdamW. Reports median step
time, tokens/s, peak memory, and the FLOP floor (FLOPs per step over the card's bf16 matmul rate).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import torch
import torch.nn.functional as F

from kdistill.commands.plan import make_plan
from kdistill.config import load_config
from kdistill.kernels import runtime, seal
from kdistill.models.decoder import build_decoder
from kdistill.models.spec import load_spec
from kdistill.train.optim import make_optimizer
from kdistill.train.step import compute_loss

PEAK_BF16_TFLOPS = {"H100": 790.0, "H200": 790.0}  # measured here: ~780-800 TFLOP/s (8192^3 bf16 GEMM)


def dense_loss(student, teacher, ids, labels, alpha, T):
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        t_logits = teacher(ids) @ teacher.lm_head_weight.t()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        s_logits = student(ids) @ student.lm_head_weight.t()
    s = s_logits.float().flatten(0, 1)
    t = t_logits.float().flatten(0, 1)
    ce = F.cross_entropy(s, labels.flatten())
    kl = F.kl_div(F.log_softmax(s / T, -1), F.log_softmax(t / T, -1), log_target=True, reduction="batchmean")
    return (1 - alpha) * ce + alpha * T * T * kl


def bench(provider: str, cfg, t_spec, s_spec, batches, steps: int, profile: bool = False) -> dict:
    dev = torch.device("cuda")
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    kernels = "reference" if provider in ("reference", "dense") else "triton"
    cfg = dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, kernels=kernels))
    t0 = time.time()
    sess = seal.start(cfg, t_spec, s_spec, dev, torch.bfloat16, quiet=True)
    prewarm_s = time.time() - t0
    teacher = build_decoder(t_spec, device=dev, dtype=torch.bfloat16, seed=1).eval().requires_grad_(False)
    student = build_decoder(s_spec, device=dev, dtype=torch.float32, seed=2)
    opt = make_optimizer(student, cfg.optim)
    amp = torch.autocast("cuda", dtype=torch.bfloat16)
    times = []
    for i in range(steps + 2):
        ids, labels = batches[i % len(batches)]
        torch.cuda.synchronize()
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        if provider == "dense":
            loss = dense_loss(student, teacher, ids, labels, cfg.kd.alpha, cfg.kd.temperature)
        else:
            loss = compute_loss(student, teacher, ids, labels, cfg, amp).loss
        loss.backward()
        opt.step()
        torch.cuda.synchronize()
        if i >= 2:  # two warm-up steps
            times.append(time.perf_counter() - start)
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            for ids, labels in batches[:2]:
                opt.zero_grad(set_to_none=True)
                if provider == "dense":
                    loss = dense_loss(student, teacher, ids, labels, cfg.kd.alpha, cfg.kd.temperature)
                else:
                    loss = compute_loss(student, teacher, ids, labels, cfg, amp).loss
                loss.backward()
                opt.step()
            torch.cuda.synchronize()
        print(f"--- {provider}: top CUDA kernels over 2 steps")
        print(
            prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=18, max_name_column_width=70)
        )
    tokens = batches[0][0].numel()
    med = statistics.median(times)
    out = {
        "provider": provider,
        "median_step_s": med,
        "tokens_per_s": tokens / med,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "final_loss": float(loss.detach()),
        "prewarm_s": prewarm_s,
        "jit_after_prewarm": sess.jit_after_prewarm(),
        "spread_s": max(times) - min(times),
    }
    del teacher, student, opt
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", default="qwen2.5-1.5b:qwen2.5-0.5b")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--providers", default="triton,reference,dense")
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--profile", action="store_true", help="print the top CUDA kernels of two steps per provider"
    )
    a = ap.parse_args()
    t_name, s_name = a.pair.split(":")
    cfg = load_config(
        None,
        [
            f"teacher.path={t_name}",
            f"student.path={s_name}",
            f"data.seq_len={a.seq_len}",
            f"schedule.batch_size={a.batch}",
            "kd.chunk_size=4096",
        ],
    ).validate()
    t_spec, s_spec = load_spec(t_name), load_spec(s_name)
    g = torch.Generator(device="cuda").manual_seed(0)
    batches = []
    for _ in range(3):
        x = torch.randint(0, s_spec.vocab_size, (a.batch, a.seq_len + 1), device="cuda", generator=g)
        batches.append((x[:, :-1].contiguous(), x[:, 1:].contiguous()))
    plan = make_plan(cfg, t_spec, s_spec)
    name = torch.cuda.get_device_name()
    peak = next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), 790.0)
    floor_s = plan["flops_per_step"] / (peak * 1e12)
    rows = []
    for p in a.providers.split(","):
        try:
            rows.append(bench(p, cfg, t_spec, s_spec, batches, a.steps, a.profile))
        except torch.OutOfMemoryError:
            rows.append({"provider": p, "error": "out of memory"})
            torch.cuda.empty_cache()
        runtime.configure(cfg, device="cuda")
    result = {
        "device": name,
        "torch": torch.__version__,
        "pair": a.pair,
        "seq_len": a.seq_len,
        "batch": a.batch,
        "tokens_per_step": a.batch * a.seq_len,
        "flops_per_step": plan["flops_per_step"],
        "flop_floor_s": floor_s,
        "date": time.strftime("%Y-%m-%d"),
        "rows": rows,
    }
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=2)
    print(
        f"{name}, {a.pair}, batch {a.batch} x seq {a.seq_len}; FLOP floor {floor_s * 1e3:.1f} ms/step "
        f"({plan['flops_per_step'] / 1e12:.1f} TFLOP at {peak:.0f} TFLOP/s)"
    )
    print(
        f"{'provider':>10} {'ms/step':>9} {'tokens/s':>10} {'peak GiB':>9} {'x floor':>8} {'loss':>8} {'jit':>4}"
    )
    for r in rows:
        if "error" in r:
            print(f"{r['provider']:>10} {r['error']}")
            continue
        print(
            f"{r['provider']:>10} {r['median_step_s'] * 1e3:>9.1f} {r['tokens_per_s']:>10.0f} {r['peak_gib']:>9.2f} "
            f"{r['median_step_s'] / floor_s:>8.2f} {r['final_loss']:>8.3f} {r['jit_after_prewarm']:>4}"
        )


if __name__ == "__main__":
    main()
