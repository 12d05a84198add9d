"""Where a decode step's time goes: kernels per step, their durations, and the gaps between them.

    PYTHONPATH=src python3 benchmarks/decode_profile.py --models qwen2.5-0.5b,qwen2.5-1.5b \
        --batch 1,16,128 --json benchmarks/results/decode_profile.json

For each model and batch size: the decode engine's captured step (random weights at the preset's
shapes, bf16, prewarmed and sealed) is replayed alone (greedy, or sampled at --temperature), timed with CUDA events (`step_ms`), then replayed
under the profiler: every kernel of one step with its duration. `kernel_ms` is the sum of the kernels'
durations per step and `gap_ms` = step_ms - kernel_ms the time between them (launch bubbles inside the
graph). The floor is the step's bytes (every weight once, each row's cache up to its context) over the
copy bandwidth measured in the same run. Kernels are grouped by name with their count and time per step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from collections import defaultdict
from pathlib import Path

import torch

from kdistill.decode import DecodeEngine, Sampling
from kdistill.kernels import seal
from kdistill.models.hf_io import load_model

try:  # run as a script (benchmarks/ on sys.path) or as a module
    from generate_bench import build, copy_bandwidth, kv_bytes
    from kd_throughput import _argv_for_record
    from kd_throughput import _version as version
except ImportError:  # pragma: no cover
    from benchmarks.generate_bench import build, copy_bandwidth, kv_bytes
    from benchmarks.kd_throughput import _argv_for_record
    from benchmarks.kd_throughput import _version as version

from kdistill.generate import prepare_kernels


def replay_ms(graph, reps: int) -> float:
    """Median ms of one replay over reps, timed with CUDA events around each replay."""
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        graph.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)


def kernels_of(graph, steps: int) -> list[tuple[str, float]]:
    """(name, µs) of every kernel the profiler saw over `steps` replays."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            graph.replay()
        torch.cuda.synchronize()
    out = []
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and ev.device_time > 0:
            out.append((ev.name, float(ev.device_time)))
    return out


def short(name: str) -> str:
    return name if len(name) <= 60 else name[:57] + "..."


def profile_one(engine: DecodeEngine, prompts: list[list[int]], reps: int) -> dict:
    engine.generate(prompts)  # capture and warm
    st = engine.slots
    assert st is not None and st.graph is not None, "the step was not captured"
    step = replay_ms(st.graph, reps)
    steps = 5
    ks = kernels_of(st.graph, steps)
    groups: dict[str, list[float]] = defaultdict(list)
    for name, us in ks:
        groups[name].append(us)
    table = sorted(
        ({"kernel": n, "per_step": len(v) / steps, "us_per_step": sum(v) / steps} for n, v in groups.items()),
        key=lambda r: -r["us_per_step"],
    )
    kernel_ms = sum(us for _, us in ks) / steps / 1e3
    return {
        "step_ms": step,
        "kernels_per_step": len(ks) / steps,
        "kernel_ms": kernel_ms,
        "gap_ms": step - kernel_ms,
        "kernels": table,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="qwen2.5-0.5b,qwen2.5-1.5b")
    ap.add_argument("--batch", default="1,16,128")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument(
        "--temperature", type=float, default=0.0, help="sample at this temperature (0: greedy, the default)"
    )
    ap.add_argument("--top", type=int, default=12, help="kernel groups printed per row")
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--gemv-tiles",
        default=None,
        help="tile experiment: PROGRAMS,PRE_K_PLAIN,PRE_K_SWIGLU[,MAX_PLAIN_K] overriding kernels/decode_gemv.py's "
        "policy for the 16-row tile (the plan, prewarm and launches all take it): the inputs loaded before the wait "
        "(PRE_K_SWIGLU at every width, PRE_K_WIDE_SWIGLU too); MAX_PLAIN_K: plain products of more inputs on cuBLAS "
        "(raise it to put a wide down product on the kernel)",
    )
    ap.add_argument(
        "--no-pdl",
        action="store_true",
        help="launch every kernel without programmatic dependent launch (each kernel's own duration)",
    )
    a = ap.parse_args()
    if a.no_pdl:
        from kdistill.kernels import decode_attention, decode_gemv, rmsnorm

        for mod in (decode_attention, decode_gemv, rmsnorm):
            mod.pdl = lambda arch: False
    if a.gemv_tiles:
        from kdistill.kernels import decode_gemv

        programs, pre_plain, pre_swiglu, *max_k = (int(v) for v in a.gemv_tiles.split(","))
        decode_gemv.PROGRAMS = programs
        decode_gemv.PRE_K.update({0: pre_plain, 1: pre_plain, 2: pre_swiglu})  # the 16-row tile's
        decode_gemv.PRE_K_WIDE_SWIGLU = pre_swiglu
        if max_k:
            decode_gemv.MAX_PLAIN_K = max_k[0]
    dev = torch.device("cuda")
    bw = copy_bandwidth()
    result = {
        "argv": _argv_for_record(),
        "device": torch.cuda.get_device_name(),
        "versions": {
            "torch": torch.__version__,
            "triton": version("triton"),
            "transformers": version("transformers"),
        },
        "copy_bandwidth_tb_s": bw / 1e12,
        "rows": [],
    }
    for preset in a.models.split(","):
        tmp = Path(tempfile.mkdtemp())
        d = build(preset, tmp / preset, False, dev)
        model = load_model(d, dev, torch.bfloat16).eval()
        spec = model.spec
        batches = [int(b) for b in a.batch.split(",")]
        max_len = a.prompt + a.new
        info = prepare_kernels(model, max(batches), a.prompt, max_len)
        print(f"{preset}: {info.get('prewarm', info)}", flush=True)
        g = torch.Generator().manual_seed(1)
        for b in batches:
            prompts = torch.randint(100, spec.vocab_size - 100, (b, a.prompt), generator=g).tolist()
            s = Sampling(max_new_tokens=a.new, temperature=a.temperature)
            eng = DecodeEngine(model, batch_size=b, max_len=max_len, sampling=s)
            row = {
                "model": preset,
                "batch": b,
                "temperature": a.temperature,
                **profile_one(eng, prompts, a.reps),
            }
            floor = (eng.weights.nbytes() + kv_bytes(spec, b, a.prompt + a.new)) / bw
            row["floor_ms"] = floor * 1e3
            row["floor_fraction"] = floor * 1e3 / row["step_ms"]
            row["jit_after_prewarm"] = seal.jit_after_prewarm()
            result["rows"].append(row)
            print(
                f"\n{preset} batch {b}: step {row['step_ms']:.3f} ms, floor {row['floor_ms']:.3f} ms "
                f"({row['floor_fraction']:.0%}), {row['kernels_per_step']:.0f} kernels, "
                f"kernels {row['kernel_ms']:.3f} ms, gaps {row['gap_ms']:.3f} ms, "
                f"jit_after_prewarm {row['jit_after_prewarm']}",
                flush=True,
            )
            for k in row["kernels"][: a.top]:
                print(f"  {k['per_step']:6.1f} x  {k['us_per_step']:8.1f} us  {short(k['kernel'])}")
            del eng
            torch.cuda.empty_cache()
        del model
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
