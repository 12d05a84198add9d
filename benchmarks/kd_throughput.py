"""KD training-step throughput, kdistill side by side with what people use instead, on one card.

    PYTHONPATH=src python3 benchmarks/kd_throughput.py --pair qwen2.5-1.5b:qwen2.5-0.5b --seq-len 2048 \
        --batch 4,8,16 --providers triton,hf,liger,liger-bf16 --json benchmarks/results/kd_throughput.json
    PYTHONPATH=src python3 benchmarks/kd_throughput.py --quick      # batch 8, 4 providers, < 5 minutes

One process, one card, random weights at the presets' real shapes, the same batches for every provider.
Each step: teacher forward (no grad), student forward, loss, backward, AdamW step.

  triton      kdistill: its kernels (prewarmed and sealed first), chunked KD loss head
  triton-fp8  the same with teacher.precision=fp8: the teacher's linears as row-wise scaled FP8 GEMMs
  triton-fp8-student   teacher.precision=fp8 and runtime.precision=fp8: the student's linears train
              through FP8 GEMMs too (forward and both backward GEMMs, fp32 master weights)
  PROVIDER-step   a kdistill provider through the training run's own step (kdistill.train.step: the
              loss of each micro-batch, gradient clipping, the non-finite test, fused AdamW), eager
  PROVIDER-graph  the same step captured as a CUDA graph after two eager steps and replayed
              (runtime.cuda_graphs); e.g. triton-graph, triton-fp8-student-graph
  ...-bf16logits-...  a triton provider with kd.logits_dtype=compute: the KD head's lm_head GEMMs write
              bf16 logits (as Liger-Kernel's do); e.g. triton-bf16logits-graph, triton-fp8-bf16logits
  triton-lora[-step|-graph]   student.lora: rank-16 adapters on q/k/v/o (dropout 0.05), base frozen
  ...-recompute-...   runtime.activation_checkpointing=swiglu: the student's SwiGLU outputs recomputed in
              backward; without it the providers resolve `auto` against the free memory as a run does
              (e.g. triton-bf16logits-recompute-graph)
  reference   kdistill's PyTorch reference ops, chunked KD loss head
  dense       kdistill's decoder with reference ops and the KD loss written the obvious way (full
              [tokens x vocab] logits, log-softmax, KL)
  hf, liger, liger-bf16   transformers models, alone or with Liger-Kernel (benchmarks/hf_providers.py)

Timing: CUDA events around each step, the median after warm-up steps. MFU: the step's model FLOPs
(kdistill's planner: teacher forward + 3x student forward) over the step time, against the bf16 matmul
rate measured in the same run (an 8192^3 GEMM). Peak memory: torch.cuda.max_memory_allocated per
provider. An out-of-memory provider is reported as OOM, not as a crash.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib.metadata
import json
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kdistill.commands.plan import make_plan
from kdistill.config import load_config
from kdistill.kernels import seal
from kdistill.memory import Layout, choose_layout, estimate_memory
from kdistill.models.decoder import build_decoder
from kdistill.models.fp8 import convert_to_fp8
from kdistill.models.fp8_train import convert_student_to_fp8
from kdistill.models.lora import apply_lora
from kdistill.models.spec import load_spec
from kdistill.ops.kd_loss import label_count
from kdistill.train.optim import make_optimizer
from kdistill.train.targets import MicroBatch, batch_loss, target_source

try:  # run as a script (benchmarks/ on sys.path) or as a module
    from hf_providers import HF_PROVIDERS, make_provider
except ImportError:  # pragma: no cover
    from benchmarks.hf_providers import HF_PROVIDERS, make_provider

KDISTILL_BASE = ("triton", "triton-fp8", "triton-fp8-student", "reference", "dense")
_TRITON = ("triton", "triton-fp8", "triton-fp8-student")
_MODIFIERS = ("-bf16logits", "-recompute", "-bf16logits-recompute", "-lora")
_TRITON_ALL = _TRITON + tuple(f"{p}{m}" for p in _TRITON for m in _MODIFIERS)
KDISTILL_PROVIDERS = (
    KDISTILL_BASE
    + _TRITON_ALL[len(_TRITON) :]
    + tuple(f"{p}-{mode}" for p in _TRITON_ALL for mode in ("step", "graph"))
)


def matmul_tflops(n: int = 8192, reps: int = 20) -> float:
    """The card's bf16 matmul rate, measured now: an n x n x n GEMM, median of `reps`."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        a @ b
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    del a, b
    return 2 * n**3 / statistics.median(times) / 1e12


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


def provider_cfg(provider: str, cfg):
    """The run config a kdistill provider stands for (kernels, teacher precision, CUDA graphs)."""
    base = provider.rsplit("-", 1)[0] if provider.endswith(("-step", "-graph")) else provider
    graphs = "on" if provider.endswith("-graph") else "off"
    kernels = "reference" if base in ("reference", "dense") else "triton"
    cfg = dataclasses.replace(
        cfg, runtime=dataclasses.replace(cfg.runtime, kernels=kernels, cuda_graphs=graphs)
    )
    if base.endswith("-lora"):  # student.lora: rank-16 adapters (dropout 0.05) on q/k/v/o, the base frozen
        base = base.removesuffix("-lora")
        lora = dataclasses.replace(cfg.student.lora, rank=16, alpha=32, dropout=0.05)
        cfg = dataclasses.replace(cfg, student=dataclasses.replace(cfg.student, lora=lora))
    if base.endswith("-recompute"):  # runtime.activation_checkpointing=swiglu
        base = base.removesuffix("-recompute")
        cfg = dataclasses.replace(
            cfg, runtime=dataclasses.replace(cfg.runtime, activation_checkpointing="swiglu")
        )
    if base.endswith("-bf16logits"):  # kd.logits_dtype=compute
        base = base.removesuffix("-bf16logits")
        cfg = dataclasses.replace(cfg, kd=dataclasses.replace(cfg.kd, logits_dtype="compute"))
    if base in ("triton-fp8", "triton-fp8-student"):  # teacher.precision=fp8
        cfg = dataclasses.replace(cfg, teacher=dataclasses.replace(cfg.teacher, precision="fp8"))
    if base == "triton-fp8-student":  # runtime.precision=fp8: the student's linears as FP8 GEMMs too
        cfg = dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, precision="fp8"))
    if cfg.runtime.activation_checkpointing == "auto":  # resolved against the free memory, as a run does
        free, _ = torch.cuda.mem_get_info()
        layout = choose_layout(
            load_spec(cfg.teacher.path), load_spec(cfg.student.path), cfg, int(free * 0.95)
        )
        choice = "blocks" if layout.checkpointing else ("none" if layout.swiglu_kept else "swiglu")
        cfg = dataclasses.replace(
            cfg, runtime=dataclasses.replace(cfg.runtime, activation_checkpointing=choice)
        )
    return cfg


def build_pair(cfg, t_spec, s_spec, dev: torch.device):
    """Seal the provider's kernels, then (session, bf16 teacher, fp32 student, AdamW, autocast); the
    teacher's and student's linears as FP8 GEMMs where the config says so."""
    sess = seal.start(cfg, t_spec, s_spec, dev, torch.bfloat16, quiet=True)
    teacher = build_decoder(t_spec, device=dev, dtype=torch.bfloat16, seed=1).eval().requires_grad_(False)
    if cfg.teacher.precision == "fp8":
        convert_to_fp8(teacher)
    student = build_decoder(s_spec, device=dev, dtype=torch.float32, seed=2)
    if cfg.runtime.precision == "fp8":
        convert_student_to_fp8(student)
    lo = cfg.student.lora
    if lo.enabled:
        apply_lora(student, rank=lo.rank, alpha=lo.alpha, dropout=lo.dropout, targets=lo.targets, seed=2)
    layout = Layout.of(cfg.runtime.activation_checkpointing)  # resolved by provider_cfg, as a run does
    student.checkpoint_blocks(layout.checkpointing)
    student.keep_swiglu(layout.swiglu_kept)
    opt = make_optimizer(student, cfg.optim)
    return sess, teacher, student, opt, torch.autocast("cuda", dtype=torch.bfloat16)


def kdistill_step(provider: str, cfg, t_spec, s_spec) -> tuple[Callable, Callable[[], int]]:
    """(step(ids, labels) -> loss, jit_after_prewarm) for one of kdistill's providers."""
    if provider.endswith(("-step", "-graph")):
        base = provider.rsplit("-", 1)[0]
        return run_step(base, provider.endswith("-graph"), cfg, t_spec, s_spec)
    dev = torch.device("cuda")
    cfg = provider_cfg(provider, cfg)
    sess, teacher, student, opt, amp = build_pair(cfg, t_spec, s_spec, dev)

    counts: dict[int, int] = {}
    source = target_source(teacher)

    def step(ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        if provider == "dense":
            loss = dense_loss(student, teacher, ids, labels, cfg.kd.alpha, cfg.kd.temperature)
        else:
            # The training loop counts the scored labels on the batch's host copy before the forward
            # (no wait for the GPU inside the step); these batches live on the GPU, so count each once.
            n = counts.get(id(labels))
            if n is None:
                n = counts[id(labels)] = label_count(labels.cpu().flatten(), s_spec.vocab_size)
            loss = batch_loss(student, MicroBatch(ids, labels, n_tokens=n), source, cfg, amp).loss
        loss.backward()
        opt.step()
        return loss.detach()

    return step, sess.jit_after_prewarm


class _Feed:
    """The training step's batcher for one batch already on the host."""

    def __init__(self, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.batch, self.last_indices = batch, None

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.batch


def run_step(base: str, graphs: bool, cfg, t_spec, s_spec) -> tuple[Callable, Callable[[], int]]:
    """The run's own training step (kdistill.train.step: micro-batch loss, clipping, the non-finite
    test, fused AdamW with its device learning rate), captured as a CUDA graph or eager. The step is
    timed without its read-back of the logged values (one small copy the run adds), so the host time
    is the time to queue the step."""
    from kdistill.train.graph import StepGraph
    from kdistill.train.step import StepContext, _graphed

    dev = torch.device("cuda")
    cfg = provider_cfg(f"{base}-{'graph' if graphs else 'step'}", cfg)
    sess, teacher, student, opt, amp = build_pair(cfg, t_spec, s_spec, dev)
    ctx = StepContext(cfg, student, teacher, opt, dev, amp, None)
    graph = StepGraph(dev)
    if not graphs:
        graph.capture_now = lambda sig: False  # type: ignore[method-assign]  # the same step, never captured
    counters = {"degenerate_batches": 0}
    host: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    done = [0]
    assert ctx.lr_device is not None

    def step(ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        batch = host.get(id(labels))
        if batch is None:
            batch = host[id(labels)] = (ids.cpu().pin_memory(), labels.cpu().pin_memory())
        for g in opt.param_groups:
            g["lr"] = cfg.optim.lr
        ctx.lr_device.fill_(cfg.optim.lr)
        packed, _, _ = _graphed(ctx, graph, _Feed(batch), done[0], counters)
        done[0] += 1
        return packed[0]

    return step, sess.jit_after_prewarm


def time_steps(
    step: Callable, batches: list, steps: int, warmup: int
) -> tuple[list[float], list[float], float]:
    """Per-step seconds (CUDA events) of `steps` steps after `warmup` untimed ones, the host seconds
    each step took to return (close to the step time: the host, not the GPU, sets the pace), and the
    last loss."""
    times, host = [], []
    loss = torch.zeros(())
    for i in range(warmup + steps):
        ids, labels = batches[i % len(batches)]
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        t0 = time.perf_counter()
        loss = step(ids, labels)
        t1 = time.perf_counter()
        e.record()
        e.synchronize()
        if i >= warmup:
            times.append(s.elapsed_time(e) / 1e3)
            host.append(t1 - t0)
    return times, host, float(loss)


def _kernel_group(name: str) -> str:
    """A coarse class of a CUDA kernel's name, for the profile's summary by group."""
    n = name.lower()
    if "nccl" in n:
        return "collectives"
    if any(k in n for k in ("gemm", "sm90_xmma", "cutlass", "cublas", "nvjet", "matmul")):
        return "GEMM"
    if any(k in n for k in ("flash", "fmha", "cudnn", "attention", "sdpa")):
        return "attention"
    if "_kernel" in n and not n.startswith("void at::"):
        return "kdistill/Triton: " + name.split("_kernel")[0][:40]
    if "adam" in n or "foreach" in n:
        return "optimizer"
    if any(k in n for k in ("copy", "cast", "fill", "elementwise", "vectorized", "reduce", "index")):
        return "elementwise/copy/reduce"
    return "other"


def profile_steps(step: Callable, batches: list, provider: str) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        for ids, labels in batches[:2]:
            step(ids, labels)
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    by_shape = [
        e
        for e in prof.key_averages(group_by_input_shape=True)
        if e.key.startswith("aten::")
        and e.key not in ("aten::mm", "aten::addmm", "aten::matmul", "aten::linear")
    ]
    by_shape.sort(key=lambda e: -e.self_device_time_total)
    print(f"--- {provider}: PyTorch ops by the CUDA time they launch (2 steps), with input shapes")
    for e in by_shape[:30]:
        print(
            f"{e.self_device_time_total / 1e3:9.2f} ms {e.count:6d}x  {e.key:28s} {str(e.input_shapes)[:150]}"
        )
    avg = [e for e in prof.key_averages() if not e.key.startswith("aten::") and e.device_type.name == "CUDA"]
    print(f"--- {provider}: top CUDA kernels over 2 steps")
    avg.sort(key=lambda e: -e.self_device_time_total)
    for e in avg[:40]:
        print(f"{e.self_device_time_total / 1e3:9.2f} ms {e.count:6d}x  {e.key[:150]}")
    groups: dict[str, list[float]] = {}
    for e in avg:
        t = e.self_device_time_total
        if t <= 0:
            continue
        g = groups.setdefault(_kernel_group(e.key), [0.0, 0])
        g[0] += t / 1e3 / 2  # ms per step
        g[1] += e.count / 2
    total = sum(v[0] for v in groups.values())
    print(f"--- {provider}: per step, by group (kernel time {total:.1f} ms, wall {wall / 2 * 1e3:.1f} ms)")
    for k, (ms, n) in sorted(groups.items(), key=lambda kv: -kv[1][0]):
        print(f"{k:>52} {ms:>8.1f} ms {n:>7.0f} launches")


def bench(provider: str, cfg, t_spec, s_spec, pair: tuple[str, str], batches, a) -> dict:
    """One provider at one batch size: build, warm up, time, free."""
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    jit: Callable[[], int | None] = lambda: None  # noqa: E731
    planned = None
    choice = None
    if provider in KDISTILL_PROVIDERS:
        pcfg = provider_cfg(provider, cfg)  # auto choices resolved once, for the step and the plan
        choice = pcfg.runtime.activation_checkpointing
        step, jit = kdistill_step(provider, pcfg, t_spec, s_spec)
        planned = estimate_memory(t_spec, s_spec, pcfg)["total"] / 2**30
    else:
        seal.unseal()  # the seal guards kdistill's kernels; the baselines JIT-compile their own
        step = make_provider(
            provider, pair[0], pair[1], alpha=cfg.kd.alpha, temperature=cfg.kd.temperature
        ).step
    setup_s = time.perf_counter() - t0
    times, host, loss = time_steps(step, batches, a.steps, a.warmup)
    if a.profile:
        profile_steps(step, batches, provider)
    tokens = batches[0][0].numel()
    med = statistics.median(times)
    out = {
        "provider": provider,
        "median_step_s": med,
        "tokens_per_s": tokens / med,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30,  # CUDA-graph pools included
        "planned_gib": planned,  # kdistill's memory plan for this provider's config
        "activation_checkpointing": choice,  # what the run's auto choice gave (none: nothing recomputed)
        "final_loss": loss,
        "setup_s": setup_s,
        "jit_after_prewarm": jit(),
        "step_times_s": times,
        "host_median_s": statistics.median(host),
    }
    del step
    gc.collect()
    torch.cuda.empty_cache()
    return out


def make_batches(vocab: int, batch: int, seq_len: int, n: int = 3) -> list:
    g = torch.Generator(device="cuda").manual_seed(0)
    out = []
    for _ in range(n):
        x = torch.randint(0, vocab, (batch, seq_len + 1), device="cuda", generator=g)
        out.append((x[:, :-1].contiguous(), x[:, 1:].contiguous()))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", default="qwen2.5-1.5b:qwen2.5-0.5b")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch", default="4,8,16", help="comma-separated batch sizes")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--providers", default="triton,triton-graph,hf,liger,liger-bf16")
    ap.add_argument("--chunk-size", type=int, default=None, help="kd.chunk_size (default: the config's)")
    ap.add_argument("--quick", action="store_true", help="batch 8, 5 timed steps (under 5 minutes)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--profile", action="store_true", help="print the top CUDA kernels of two steps")
    a = ap.parse_args()
    if a.quick:
        a.batch, a.steps, a.warmup = "8", 5, 2
    t_name, s_name = a.pair.split(":")
    providers = a.providers.split(",")
    unknown = [p for p in providers if p not in KDISTILL_PROVIDERS + HF_PROVIDERS]
    if unknown:
        raise SystemExit(f"unknown providers {unknown}; choose from {KDISTILL_PROVIDERS + HF_PROVIDERS}")
    name = torch.cuda.get_device_name()
    peak = matmul_tflops()
    t_spec, s_spec = load_spec(t_name), load_spec(s_name)
    result = {
        "device": name,
        "torch": torch.__version__,
        "triton": _version("triton"),
        "transformers": _version("transformers"),
        "liger_kernel": _version("liger-kernel"),
        "pair": a.pair,
        "seq_len": a.seq_len,
        "matmul_tflops_measured": peak,
        "date": time.strftime("%Y-%m-%d"),
        "command": "python3 benchmarks/kd_throughput.py " + _argv_for_record(),
        "runs": [],
    }
    print(f"{name}: bf16 matmul {peak:.0f} TFLOP/s (8192^3, measured now)")
    for batch in [int(b) for b in a.batch.split(",")]:
        cfg = load_config(
            None,
            [
                f"teacher.path={t_name}",
                f"student.path={s_name}",
                f"data.seq_len={a.seq_len}",
                f"schedule.batch_size={batch}",
                *([f"kd.chunk_size={a.chunk_size}"] if a.chunk_size else []),
            ],
        ).validate()
        plan = make_plan(cfg, t_spec, s_spec)
        floor_s = plan["flops_per_step"] / (peak * 1e12)
        batches = make_batches(s_spec.vocab_size, batch, a.seq_len)
        rows = []
        for p in providers:
            try:
                row = bench(p, cfg, t_spec, s_spec, (t_name, s_name), batches, a)
                row["mfu"] = floor_s / row["median_step_s"]
            except torch.OutOfMemoryError:
                row = {"provider": p, "error": "OOM"}
            except ImportError as e:  # a baseline whose package is not installed here
                row = {"provider": p, "error": f"not installed ({e.name})"}
            rows.append(row)
            gc.collect()
            torch.cuda.empty_cache()
        result["runs"].append(
            {
                "batch": batch,
                "tokens_per_step": batch * a.seq_len,
                "flops_per_step": plan["flops_per_step"],
                "kd_chunk_size": cfg.kd.chunk_size,
                "flop_floor_s": floor_s,
                "rows": rows,
            }
        )
        print_table(name, a.pair, batch, a.seq_len, floor_s, rows, flush=True)
        if a.json:  # after every batch size: a run cut short keeps what it measured
            with open(a.json, "w") as f:
                json.dump(result, f, indent=2)


def print_table(
    name: str, pair: str, batch: int, seq: int, floor_s: float, rows: list[dict], flush: bool = False
) -> None:
    print(f"\n{name}, {pair}, batch {batch} x seq {seq}; FLOP floor {floor_s * 1e3:.1f} ms/step")
    print(
        f"{'provider':>18} {'ms/step':>9} {'tokens/s':>10} {'peak GiB':>9} {'resv GiB':>9} {'plan GiB':>9}"
        f" {'MFU':>6} {'loss':>8} {'jit':>4} {'host ms':>8}"
    )
    for r in rows:
        if "error" in r:
            print(f"{r['provider']:>18} {r['error']}")
            continue
        jit = "-" if r["jit_after_prewarm"] is None else str(r["jit_after_prewarm"])
        plan = "-" if r.get("planned_gib") is None else f"{r['planned_gib']:.2f}"
        print(
            f"{r['provider']:>18} {r['median_step_s'] * 1e3:>9.1f} {r['tokens_per_s']:>10.0f} "
            f"{r['peak_gib']:>9.2f} {r['peak_reserved_gib']:>9.2f} {plan:>9} {r['mfu']:>6.1%}"
            f" {r['final_loss']:>8.3f} {jit:>4} {r['host_median_s'] * 1e3:>8.1f}"
        )
    if flush:
        sys.stdout.flush()


def _version(dist_name: str) -> str | None:
    """An installed distribution's version (liger-kernel has no __version__ attribute)."""
    try:
        return importlib.metadata.version(dist_name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _argv_for_record() -> str:
    """The command line as run, with the output file named by its base name only."""
    args = list(sys.argv[1:])
    for i, arg in enumerate(args[:-1]):
        if arg == "--json":
            args[i + 1] = "benchmarks/results/" + args[i + 1].rsplit("/", 1)[-1]
    return " ".join(args)


if __name__ == "__main__":
    main()
