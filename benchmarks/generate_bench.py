"""Generation throughput: kdistill's decode engine beside transformers' `generate`, on one card.

    PYTHONPATH=src python3 benchmarks/generate_bench.py --models qwen2.5-0.5b,qwen2.5-1.5b \
        --batch 1,32,128 --prompt 128 --new 128 --ragged 1000 --json benchmarks/results/generate.json

One process, one card, random weights at the presets' real shapes (built by transformers, saved, and
loaded by both sides: the same weights), bf16, greedy, every row forced to its full length (no stop
token) except in the ragged run. Providers:

  kdistill        the decode engine: static KV cache, the step replayed as a CUDA graph (prewarmed and
                  sealed first: `jit_after_prewarm` is reported and must be 0)
  kdistill-eager  the same engine and kernels with the step run eagerly (the graph path's reference)
  hf              transformers `generate` (dynamic cache, do_sample=False, min_new_tokens = new)

Ragged run: --ragged N prompts of 16..512 tokens (uniform, seeded), up to --new new tokens, stopping
at the model's EOS, at --ragged-batch rows with slot refill; tokens/s end to end (prefills included),
the median of --ragged-reps runs after two untimed ones (which capture the step and the prefills'
shapes), their spread and whether their tokens agree reported.

Floor: a decode step must read every weight once and each row's cached keys and values; those bytes
over the copy bandwidth measured in the same run (a large device-to-device copy) give the step's
memory floor, and `floor fraction` = floor / measured step. The graph path and the eager path must
produce identical greedy tokens for every row of a ragged batch: checked and reported (`identical`).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from kdistill.decode import DecodeEngine, Sampling
from kdistill.generate import prepare_kernels
from kdistill.kernels import seal
from kdistill.models.hf_io import load_model
from kdistill.models.presets import PRESETS

try:  # run as a script (benchmarks/ on sys.path) or as a module
    from kd_throughput import _argv_for_record
    from kd_throughput import _version as version
except ImportError:  # pragma: no cover
    from benchmarks.kd_throughput import _argv_for_record
    from benchmarks.kd_throughput import _version as version


def copy_bandwidth(nbytes: int = 2 << 30, reps: int = 10) -> float:
    """Bytes per second of a device-to-device copy (bytes read + bytes written), median of reps."""
    a = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    times = []
    for _ in range(reps + 2):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    return nbytes / statistics.median(times[2:])


TINY = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
)


def build(preset: str, where: Path, tiny: bool, device: torch.device) -> Path:
    """A random-weight transformers model at the preset's shapes (--tiny: a 2-layer stand-in for a CPU
    smoke run), saved to `where` and loaded by both sides."""
    import transformers

    raw = dict(PRESETS[preset])
    for k in ("architectures", "torch_dtype", "layer_types", "max_window_layers"):
        raw.pop(k, None)
    if tiny:
        raw.update(TINY, head_dim=16, vocab_size=1024)
    kind = {"qwen2": "Qwen2Config", "qwen3": "Qwen3Config", "llama": "LlamaConfig"}[raw["model_type"]]
    cfg = getattr(transformers, kind)(**raw)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with device:
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.save_pretrained(where)
    del model
    empty_cache()
    return where


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def empty_cache() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_gib() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0


def timed(fn, reps: int, warmup: int = 1) -> tuple[float, object]:
    """Median seconds of fn() over reps (after `warmup` untimed calls), and the last result."""
    for _ in range(warmup):
        out = fn()
    times = []
    for _ in range(reps):
        sync()
        t = time.perf_counter()
        out = fn()
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def kv_bytes(spec, batch: int, context: float) -> float:
    return 2 * spec.num_layers * batch * spec.num_kv_heads * context * spec.head_dim * 2


def bench_model(preset: str, a, bw: float) -> dict:
    tmp = Path(tempfile.mkdtemp())
    dev = torch.device(a.device)
    d = build(preset, tmp / preset, a.tiny, dev)
    model = load_model(d, dev, torch.bfloat16 if dev.type == "cuda" else torch.float32).eval()
    spec = model.spec
    eos = PRESETS[preset].get("eos_token_id", 0)
    batches = [int(b) for b in a.batch.split(",")]
    max_len = a.prompt + a.new
    rng = random.Random(0)
    ragged_lens = [rng.randint(16, 512) for _ in range(a.ragged)]
    # One plan for every batch and both prompt buckets (fixed and ragged), then the seal.
    planned = max(max_len, 512 + a.new)  # the identity check and the ragged run take this cache length
    # the ragged run's engine too: a plan for fewer rows lacks its wide steps' kernels
    info = prepare_kernels(model, max(batches + ([a.ragged_batch] if a.ragged else [])), a.prompt, planned)
    print(f"{preset}: {info.get('prewarm', info)}", flush=True)
    rows = []
    g = torch.Generator().manual_seed(1)
    for b in batches:
        prompts = torch.randint(100, spec.vocab_size - 100, (b, a.prompt), generator=g).tolist()
        s = Sampling(max_new_tokens=a.new, temperature=a.temperature)
        row: dict = {
            "model": preset,
            "batch": b,
            "prompt": a.prompt,
            "new": a.new,
            "temperature": a.temperature,
        }
        for provider in a.providers.split(","):
            if provider.startswith("kdistill"):
                graphs = "off" if provider == "kdistill-eager" else "auto"
                eng = DecodeEngine(model, batch_size=b, max_len=max_len, sampling=s, cuda_graphs=graphs)
                # two warm-up calls: the engine captures a prefill shape on its second sighting, so
                # every timed call replays it (one warm-up would time the capture in the first rep)
                sec, out = timed(lambda eng=eng, p=prompts: eng.generate(p), a.reps, warmup=2)
                assert all(len(r) == a.new for r in out)
                step = sec / a.new
                floor = (eng.weights.nbytes() + kv_bytes(spec, b, a.prompt + a.new / 2)) / bw
                row[provider] = {
                    "seconds": sec,
                    "tokens_per_s": b * a.new / sec,
                    "ms_per_step": step * 1e3,
                    "floor_ms_per_step": floor * 1e3,
                    "floor_fraction": floor / step,
                    "peak_gib": peak_gib(),
                }
                del eng
            elif provider == "hf":
                row["hf"] = bench_hf(d, prompts, a)
            empty_cache()
            print(json.dumps(row), flush=True)
        for p in ("kdistill", "kdistill-eager"):
            if p in row and "hf" in row:
                row[p]["vs_hf"] = row[p]["tokens_per_s"] / row["hf"]["tokens_per_s"]
        rows.append(row)
    # The graph path against the eager one: greedy tokens of a ragged batch, row by row.
    ragged = [
        torch.randint(100, spec.vocab_size - 100, (n,), generator=g).tolist()
        for n in (17, 130, 64, 300, 5, 77, 250, 33)
    ]
    s = Sampling(max_new_tokens=64)
    outs = {}
    for graphs in ("auto", "off"):
        # the planned cache length: a plan past 1,024 slots holds longer splits than a shorter cache's
        eng = DecodeEngine(
            model, batch_size=4, max_len=planned, sampling=s, stop_ids={eos}, cuda_graphs=graphs
        )
        outs[graphs] = eng.generate(ragged)
        del eng
    identical = outs["auto"] == outs["off"]
    # A file of ragged prompts with slot refill, end to end.
    ragged_row = None
    if a.ragged:
        prompts = [torch.randint(100, spec.vocab_size - 100, (n,), generator=g).tolist() for n in ragged_lens]
        eng = DecodeEngine(
            model,
            batch_size=a.ragged_batch,
            max_len=planned,
            sampling=Sampling(max_new_tokens=a.new),
            stop_ids={eos},
        )
        for _ in range(
            2
        ):  # the step's capture, then every prefill shape's (a shape is captured when seen twice)
            eng.generate(prompts)
        runs, outs, steps = [], [], []
        for _ in range(max(1, a.ragged_reps)):  # one run's prefills and refills vary: the median of several
            sync()
            before = eng.steps
            t = time.perf_counter()
            outs.append(eng.generate(prompts))
            sync()
            runs.append(time.perf_counter() - t)
            steps.append(eng.steps - before)
        sec, out = statistics.median(runs), outs[0]
        new = sum(len(r) for r in out)
        ragged_row = {
            "model": preset,
            "prompts": a.ragged,
            "batch": a.ragged_batch,
            "prompt_tokens": sum(ragged_lens),
            "new_tokens": new,
            "mean_new": new / a.ragged,
            "stopped_at_eos": sum(1 for r in out if r and r[-1] == eos) / a.ragged,
            "seconds": sec,
            "new_tokens_per_s": new / sec,
            "runs_seconds": runs,
            "spread": (max(runs) - min(runs)) / sec,  # (slowest - fastest) / median
            "identical_across_runs": all(o == out for o in outs),
            "steps": steps[0],
        }
        print(json.dumps(ragged_row), flush=True)
        del eng
    del model
    empty_cache()
    return {
        "rows": rows,
        "identical_graph_vs_eager": identical,
        "ragged": ragged_row,
        "jit_after_prewarm": seal.jit_after_prewarm(),
    }


def bench_hf(d: Path, prompts: list[list[int]], a) -> dict:
    from transformers import AutoModelForCausalLM

    dev = torch.device(a.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=dtype).to(dev).eval()
    ids = torch.tensor(prompts, device=dev)
    mask = torch.ones_like(ids)

    def run():
        with torch.no_grad():
            return hf.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=a.new,
                min_new_tokens=a.new,
                pad_token_id=0,
            )

    sec, out = timed(run, max(1, a.reps - 1))
    b = len(prompts)
    res = {
        "seconds": sec,
        "tokens_per_s": b * a.new / sec,
        "peak_gib": peak_gib(),
    }
    hf = None  # free it before the next provider
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="qwen2.5-0.5b,qwen2.5-1.5b")
    ap.add_argument("--batch", default="1,32,128")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--providers", default="kdistill,kdistill-eager,hf")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="kdistill's timed rows sample at this temperature (0: greedy; the identity check stays greedy)",
    )
    ap.add_argument("--ragged", type=int, default=1000)
    ap.add_argument("--ragged-batch", type=int, default=128)
    ap.add_argument("--ragged-reps", type=int, default=3, help="ragged runs timed (their median is reported)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="2-layer stand-ins of the presets (a CPU smoke run)")
    a = ap.parse_args()
    bw = copy_bandwidth() if a.device.startswith("cuda") else 1e11
    print(f"copy bandwidth: {bw / 1e12:.2f} TB/s", flush=True)
    result = {
        "card": torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu",
        "date": time.strftime("%Y-%m-%d"),
        "versions": {
            "torch": torch.__version__,
            "triton": version("triton"),
            "transformers": version("transformers"),
            "python": sys.version.split()[0],
        },
        "command": "python3 benchmarks/generate_bench.py " + _argv_for_record(),
        "copy_bandwidth_bytes_per_s": bw,
        "models": {},
    }
    for preset in a.models.split(","):
        result["models"][preset] = bench_model(preset, a, bw)
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=2))
    print_table(result)


def print_table(result: dict) -> None:
    print(f"\n{result['card']}  torch {result['versions']['torch']}  triton {result['versions']['triton']}")
    print("model          batch  kdistill tok/s  eager tok/s  hf tok/s   vs hf  ms/step  floor ms  floor%")
    for preset, m in result["models"].items():
        for r in m["rows"]:
            k, e, h = r.get("kdistill", {}), r.get("kdistill-eager", {}), r.get("hf", {})
            print(
                f"{preset:14s} {r['batch']:5d}  {k.get('tokens_per_s', 0):14,.0f}  {e.get('tokens_per_s', 0):11,.0f}"
                f"  {h.get('tokens_per_s', 0):8,.0f}  {k.get('vs_hf', 0):5.1f}x  {k.get('ms_per_step', 0):7.2f}"
                f"  {k.get('floor_ms_per_step', 0):8.3f}  {100 * k.get('floor_fraction', 0):5.1f}"
            )
        rg = m.get("ragged")
        if rg:
            print(
                f"{preset:14s} ragged {rg['prompts']} prompts at batch {rg['batch']}: "
                f"{rg['new_tokens_per_s']:,.0f} new tokens/s end to end (median of {len(rg['runs_seconds'])},"
                f" spread {100 * rg['spread']:.1f}%), mean {rg['mean_new']:.1f} new"
            )
        print(
            f"{preset:14s} identical graph vs eager: {m['identical_graph_vs_eager']}  "
            f"jit_after_prewarm: {m['jit_after_prewarm']}"
        )


if __name__ == "__main__":
    main()
