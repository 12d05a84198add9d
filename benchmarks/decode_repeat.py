"""Does a decode step's time depend on where its engine's tensors land? One engine shape built again and
again in one process, each time its captured step timed twice.

    PYTHONPATH=src:. python3 benchmarks/decode_repeat.py --json benchmarks/results/decode_repeat.json

For each (model, batch): --trials engines one after the other (every second one after a pad tensor of
1-300 MiB that moves where the engine's weights, cache and graph pool are allocated), each generating
128 new tokens after a 128-token prompt (capturing its step), then its step replayed and timed with CUDA
events twice (the median of --reps replays each), with the offsets of its stacked weights and caches
within 2 MiB pages. The spread across engines says whether one decode_profile row per engine is a
comparison; the spread within one engine is the timing's own noise.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
from pathlib import Path

import torch

from kdistill.decode import DecodeEngine, Sampling
from kdistill.generate import prepare_kernels
from kdistill.models.hf_io import load_model

try:  # run as a script (benchmarks/ on sys.path) or as a module
    from decode_profile import replay_ms
    from generate_bench import build
    from kd_throughput import _argv_for_record
except ImportError:  # pragma: no cover
    from benchmarks.decode_profile import replay_ms
    from benchmarks.generate_bench import build
    from benchmarks.kd_throughput import _argv_for_record

PAGE = 2 << 20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--shapes", default="qwen2.5-0.5b:1,qwen2.5-0.5b:16,qwen2.5-1.5b:4", help="MODEL:BATCH,..."
    )
    ap.add_argument("--trials", type=int, default=8)
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    dev = torch.device("cuda")
    rng = random.Random(0)
    rows = []
    shapes = [(s.split(":")[0], int(s.split(":")[1])) for s in a.shapes.split(",")]
    for preset in dict.fromkeys(m for m, _ in shapes):
        model = load_model(
            build(preset, Path(tempfile.mkdtemp()) / preset, False, dev), dev, torch.bfloat16
        ).eval()
        prepare_kernels(model, max(b for m, b in shapes if m == preset), 128, 256)
        g = torch.Generator().manual_seed(1)
        for b in (b for m, b in shapes if m == preset):
            prompts = torch.randint(100, model.spec.vocab_size - 100, (b, 128), generator=g).tolist()
            for trial in range(a.trials):
                pad = (
                    torch.empty(rng.randint(1, 300) << 20, dtype=torch.uint8, device=dev)
                    if trial % 2
                    else None
                )
                eng = DecodeEngine(model, batch_size=b, max_len=256, sampling=Sampling(max_new_tokens=128))
                eng.generate(prompts)  # captures the step
                st = eng.slots
                row = {
                    "model": preset,
                    "batch": b,
                    "trial": trial,
                    "pad_mib": 0 if pad is None else pad.numel() >> 20,
                    "ms": [replay_ms(st.graph, a.reps), replay_ms(st.graph, a.reps)],
                    "gate_up_mod2m": [w.gate_up.data_ptr() % PAGE for w in eng.weights.layers[:3]],
                    "qkv_mod2m": [w.qkv.data_ptr() % PAGE for w in eng.weights.layers[:3]],
                    "k_mod2m": [t.data_ptr() % PAGE for t in st.k[:3]],
                    "gate_up_ptr": [w.gate_up.data_ptr() for w in eng.weights.layers[:2]],
                }
                print(json.dumps(row), flush=True)
                rows.append(row)
                del eng, st, pad
                torch.cuda.empty_cache()
        del model
    if a.json:
        result = {"argv": _argv_for_record(), "device": torch.cuda.get_device_name(), "rows": rows}
        Path(a.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
