"""Where a generate call's time goes outside the decode steps: the prefill, host or device.

    PYTHONPATH=src:. python3 benchmarks/generate_phases.py --models qwen2.5-0.5b --batch 1,8,16 \
        --json benchmarks/results/generate_phases.json

For each preset and batch (prompts of --prompt random tokens, greedy, a decode engine planned and sealed
as generate_bench's), the median of --reps calls (after one warm-up) of:

- `prefill_ms`: DecodeEngine.write_prompts alone (the prompts' forward into the cache), host wall time
  with a synchronisation before and after; `prefill_host_ms`: the same call's time on the host until it
  returns, without waiting for the device (when it is close to prefill_ms, the host paces the prefill);
- `first_token_ms`: write_prompts, the lm_head and the first token's sampling and bookkeeping (the
  engine's _prefill), synchronised;
- `generate_1_ms` / `generate_n_ms`: a whole generate of 1 and of --new new tokens;
- `steps_1` / `steps_n`: the decode steps each of those runs (the engine's count);
- `step_ms`: (generate_n_ms - generate_1_ms) / (steps_n - steps_1), a decode step inside a generate.

Plus, from torch.profiler over one prefill: the CUDA kernels it launched, their summed device time, and
the host ops with the most self CPU time. Random weights at the presets' shapes; a CUDA device.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from kdistill.decode import DecodeEngine, Sampling
from kdistill.generate import prepare_kernels
from kdistill.models.hf_io import load_model

try:  # run as a script (benchmarks/ on sys.path) or as a module
    from generate_bench import build
    from kd_throughput import _argv_for_record
    from kd_throughput import _version as version
except ImportError:  # pragma: no cover
    from benchmarks.generate_bench import build
    from benchmarks.kd_throughput import _argv_for_record
    from benchmarks.kd_throughput import _version as version


def median_ms(fn, reps: int, wait: bool = True) -> float:
    """Median milliseconds of fn() over reps after one warm-up call; wait=False: until fn returns on the
    host (the device synchronised before each call only)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if wait:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)


def profile_prefill(fn) -> dict:
    """Kernels, their device time and the top host ops (self CPU time) of one call of fn."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = [
        e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time > 0
    ]
    host = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:15]
    return {
        "kernels": len(kernels),
        "kernel_ms": sum(e.device_time for e in kernels) / 1e3,
        "top_host_ops": [
            {"op": e.key[:80], "calls": e.count, "self_cpu_ms": e.self_cpu_time_total / 1e3} for e in host
        ],
    }


@torch.no_grad()
def generate_ms(model, prompts: list[list[int]], new: int, reps: int, max_len: int) -> tuple[float, float]:
    """A whole generate of `new` tokens per prompt, on an engine of its own -> (ms, decode steps a call)."""
    eng = DecodeEngine(model, batch_size=len(prompts), max_len=max_len, sampling=Sampling(max_new_tokens=new))
    ms = median_ms(lambda: eng.generate(prompts), reps)
    return ms, eng.steps / (reps + 1)


@torch.no_grad()
def prefill_phases(model, prompts: list[list[int]], reps: int, max_len: int) -> dict:
    """The prefill alone, on the host and synchronised, with its first token, and its profile."""
    b = len(prompts)
    eng = DecodeEngine(model, batch_size=b, max_len=max_len, sampling=Sampling(max_new_tokens=1))
    st = eng._slots_for(eng.bucket(b))
    slots = list(range(b))

    def prefill():
        return eng.write_prompts(st, slots, prompts)

    def first():
        return eng._prefill(st, slots, prompts, [1] * b)

    return {
        "prefill_ms": median_ms(prefill, reps),
        "prefill_host_ms": median_ms(prefill, reps, wait=False),
        "first_token_ms": median_ms(first, reps),
        "prefill_profile": profile_prefill(prefill),
    }


def measure(model, prompts: list[list[int]], a, max_len: int) -> dict:
    """The phases of one batch of prompts (the module's docstring)."""
    (g1, s1), (gn, sn) = (generate_ms(model, prompts, n, a.reps, max_len) for n in (1, a.new))
    row = {
        "generate_1_ms": g1,
        "generate_n_ms": gn,
        "steps_1": s1,
        "steps_n": sn,
        **prefill_phases(model, prompts, a.reps, max_len),
    }
    torch.cuda.empty_cache()
    row["step_ms"] = (gn - g1) / (sn - s1)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="qwen2.5-0.5b")
    ap.add_argument("--batch", default="1,8,16")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    out = {
        "argv": _argv_for_record(),
        "device": torch.cuda.get_device_name(),
        "versions": {"torch": torch.__version__, "triton": version("triton")},
        "rows": [],
    }
    dev = torch.device("cuda")
    for preset in a.models.split(","):
        tmp = Path(tempfile.mkdtemp())
        model = load_model(build(preset, tmp / preset, False, dev), dev, torch.bfloat16).eval()
        batches = [int(b) for b in a.batch.split(",")]
        max_len = a.prompt + a.new
        prepare_kernels(model, max(batches), a.prompt, max_len)
        g = torch.Generator().manual_seed(1)
        for b in batches:
            prompts = torch.randint(100, model.spec.vocab_size - 100, (b, a.prompt), generator=g).tolist()
            row = measure(model, prompts, a, max_len)
            row = {"model": preset, "batch": b, "prompt": a.prompt, "new": a.new, **row}
            out["rows"].append(row)
            p = row["prefill_profile"]
            print(
                f"{preset} batch {b}: generate 1 {row['generate_1_ms']:.2f} ms, {a.new} {row['generate_n_ms']:.2f} ms "
                f"({row['steps_n']:.0f} steps, {row['step_ms']:.3f} ms each); prefill {row['prefill_ms']:.2f} ms (host "
                f"{row['prefill_host_ms']:.2f}; {p['kernels']} kernels, {p['kernel_ms']:.2f} ms on the device), "
                f"with the first token {row['first_token_ms']:.2f} ms",
                flush=True,
            )
            for h in p["top_host_ops"][:8]:
                print(f"    {h['op']:60s} {h['calls']:5d} calls {h['self_cpu_ms']:8.2f} ms", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
