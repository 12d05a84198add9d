"""What does a decode step cost at its edges? The engine replays one captured graph a step, after one launch
that draws the sampler's uniforms (DecodeEngine._step). Between two steps the GPU goes from one graph to a
kernel and to the next graph; inside a graph, kernels start back to back (and the chained ones early). This
probe times the same step four ways at one engine shape, so the edges' share is a difference of two numbers
on one card in one process:

    PYTHONPATH=src:. python3 benchmarks/step_boundaries.py --json benchmarks/results/step_boundaries.json

- `graph`: the captured step replayed back to back (decode_profile's burst): graph after graph;
- `engine`: the engine's own step, the uniforms' launch then the replay, back to back (what generation runs);
- `k_graph`: K steps captured in one graph, replayed back to back, divided by K: no edge between the K steps
  (the K steps read one draw of uniforms: a timing, not a sampler);
- `k_engine`: the same K-step graph after one draw of (K, rows) uniforms;
- `round`: the engine's own round of K steps (DecodeEngine._run: one draw, then its round graph), where
  the engine captures one (its sync_every is K).

Per shape: µs a step each way, the edges between graphs (graph - k_graph) and the uniforms' launch (engine -
graph). Shapes are MODEL:ROWS:SLOTS (the engine's batch and cache slots, a 128-token prompt, the rest new
tokens; the step runs at the cache's end after one generation). The default shapes are the on-policy rows'
students: the long row's (Qwen2.5-0.5B, 16 rows, 1,152 slots) and the 7B row's (Qwen2.5-1.5B, 4 rows, 384).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from kdistill.decode import DecodeEngine, Sampling
from kdistill.generate import prepare_kernels
from kdistill.models.hf_io import load_model

try:  # run as a script (benchmarks/ on sys.path) or as a module
    from generate_bench import build
    from kd_throughput import _argv_for_record
except ImportError:  # pragma: no cover
    from benchmarks.generate_bench import build
    from benchmarks.kd_throughput import _argv_for_record

PROMPT = 128


def parse_shapes(text: str) -> list[tuple[str, int, int]]:
    """'MODEL:ROWS:SLOTS,...' -> [(model, rows, slots)]; slots must leave room for new tokens after the prompt."""
    out = []
    for item in text.split(","):
        parts = item.strip().split(":")
        if len(parts) != 3 or not parts[1].isdigit() or not parts[2].isdigit():
            raise SystemExit(f"--shapes: {item!r} is not MODEL:ROWS:SLOTS")
        model, rows, slots = parts[0], int(parts[1]), int(parts[2])
        if rows < 1 or slots <= PROMPT:
            raise SystemExit(f"--shapes: {item!r}: expected rows >= 1 and slots > {PROMPT}")
        out.append((model, rows, slots))
    return out


def summarise(us: dict[str, float]) -> dict[str, float]:
    """The edges from the four ways' µs a step: between graphs (graph - k_graph), the uniforms' launch with
    its edges (engine - graph), all of the engine's edges (engine - k_engine) and, with the engine's round
    measured, what the round saves a step (engine - round)."""
    out = {
        "between_graphs_us": us["graph"] - us["k_graph"],
        "uniforms_launch_us": us["engine"] - us["graph"],
        "engine_edges_us": us["engine"] - us["k_engine"],
        "edges_share_of_step": (us["engine"] - us["k_engine"]) / us["engine"],
    }
    if "round" in us:  # what the engine's round saves against its single steps
        out["round_saves_us"] = us["engine"] - us["round"]
    return out


def _burst_us(run, calls: int, per_call: int) -> float:
    """µs a step: `calls` runs back to back between two CUDA events, each `per_call` steps."""
    run()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(calls):
        run()
    e.record()
    e.synchronize()
    return s.elapsed_time(e) * 1000.0 / (calls * per_call)


def measure(eng: DecodeEngine, k: int, steps: int) -> dict[str, float]:
    st = eng.slots
    assert st is not None and st.graph is not None, "generate once first: it captures the step"
    gen = eng.generator
    many = torch.zeros((k, st.batch), dtype=torch.float32, device=st.u.device)

    def engine_step() -> None:
        eng._step(st)

    k_graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(k_graph):
        for _ in range(k):
            eng._decode_step(st)
    torch.cuda.synchronize()

    def k_engine() -> None:
        many.uniform_(generator=gen)
        k_graph.replay()

    us = {}
    for _ in range(2):  # the second pass is kept: clocks and caches settled by the first
        us = {
            "graph": _burst_us(st.graph.replay, steps, 1),
            "engine": _burst_us(engine_step, steps, 1),
            "k_graph": _burst_us(k_graph.replay, steps // k, k),
            "k_engine": _burst_us(k_engine, steps // k, k),
        }
        if st.round_graph is not None and st.uk.shape[0] == k:
            us["round"] = _burst_us(lambda: eng._run(st, k), steps // k, k)
    k_graph.reset()
    return us


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--shapes", default="qwen2.5-0.5b:16:1152,qwen2.5-1.5b:4:384", help="MODEL:ROWS:SLOTS,..."
    )
    ap.add_argument("--temperature", type=float, default=0.9, help="sampled, as the on-policy rows")
    ap.add_argument("--k", type=int, default=8, help="steps in one graph (the engine's sync_every)")
    ap.add_argument("--steps", type=int, default=800, help="steps timed each way")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    shapes = parse_shapes(a.shapes)
    dev = torch.device("cuda")
    rows = []
    for preset in dict.fromkeys(m for m, _, _ in shapes):
        model = load_model(build(preset, Path(tempfile.mkdtemp()) / preset, False, dev), dev, torch.bfloat16)
        model.eval()
        mine = [(r, s) for m, r, s in shapes if m == preset]
        prepare_kernels(model, max(r for r, _ in mine), PROMPT, max(s for _, s in mine))
        g = torch.Generator().manual_seed(1)
        for r, slots in mine:
            prompts = torch.randint(100, model.spec.vocab_size - 100, (r, PROMPT), generator=g).tolist()
            sampling = Sampling(max_new_tokens=slots - PROMPT, temperature=a.temperature)
            eng = DecodeEngine(model, batch_size=r, max_len=slots, sampling=sampling)
            eng.generate(prompts)  # captures the step; the cache ends full
            us = measure(eng, a.k, a.steps)
            row = {"model": preset, "rows": r, "slots": slots, "k": a.k, "us_per_step": us, **summarise(us)}
            print(json.dumps(row), flush=True)
            rows.append(row)
            del eng
            torch.cuda.empty_cache()
        del model
    if a.json:
        result = {
            "argv": _argv_for_record(),
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "rows": rows,
        }
        Path(a.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
