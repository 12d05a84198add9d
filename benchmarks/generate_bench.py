"""Generation throughput: kdistill's decoder with its KV cache (what `kdistill generate` runs) beside
transformers' `generate`, greedy, same weights, same prompts, same card.

    python benchmarks/generate_bench.py                               # qwen2.5-0.5b shapes, batch 1 and 32, GPU
    python benchmarks/generate_bench.py --model path/to/model --batch 1,32 --json out.json
    python benchmarks/generate_bench.py --device cpu --tiny           # a smoke check on the CPU

Random weights at a preset's shapes (kdistill.models.presets) unless --model is given, saved once by
transformers and loaded by both sides. Prompts are random ids of one length (no padding); every row
makes exactly --new-tokens tokens (no stop token), so tokens/s = batch x new tokens / seconds, prefill
included. kdistill prewarms and seals its kernels for the decode shapes first (outside the timing), as
the command does; each side runs once untimed before the timed run. Also reported: how many of the
first row's greedy tokens the two sides agree on (bf16 on a GPU: ties may flip late tokens).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from kdistill.generate import Sampling, generate_ids, prepare_kernels
from kdistill.kernels import seal
from kdistill.models.hf_io import load_model
from kdistill.models.presets import PRESETS

TINY = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
)


def build_model_dir(preset: str, tiny: bool, out: Path) -> Path:
    """A transformers model at the preset's shapes (random weights), saved with save_pretrained."""
    import transformers

    raw = dict(PRESETS[preset])
    for k in ("architectures", "torch_dtype", "layer_types", "max_window_layers"):
        raw.pop(k, None)
    if tiny:
        raw.update(TINY, head_dim=TINY["hidden_size"] // TINY["num_attention_heads"], vocab_size=1024)
    kind = {"qwen2": "Qwen2Config", "qwen3": "Qwen3Config", "llama": "LlamaConfig"}[raw["model_type"]]
    cfg = getattr(transformers, kind)(**raw)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(out)
    return out


def timed(fn, device: torch.device) -> tuple[float, object]:
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    result = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0, result


def bench(model_dir: Path, device: torch.device, batch: int, prompt_len: int, new: int) -> dict:
    import transformers

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    ours = load_model(model_dir, device, dtype).eval()
    vocab = ours.spec.vocab_size
    g = torch.Generator().manual_seed(batch)
    ids = torch.randint(1, vocab, (batch, prompt_len), generator=g)
    prompts = ids.tolist()
    seal.unseal()
    kernels = prepare_kernels(ours, batch, prompt_len, prompt_len + new)
    sampling = Sampling(max_new_tokens=new)
    run_ours = lambda: generate_ids(ours, prompts, sampling, ())  # noqa: E731
    run_ours()
    t_ours, got = timed(run_ours, device)
    jit = seal.jit_after_prewarm()
    ours = None  # free its memory before transformers' copy is loaded
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa")
    hf = hf.to(device).eval()
    ids_d = ids.to(device)
    mask = torch.ones_like(ids_d)

    def run_hf():
        return hf.generate(
            input_ids=ids_d,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=new,
            min_new_tokens=new,
            eos_token_id=None,
            pad_token_id=0,
        )

    with torch.no_grad():
        run_hf()
        t_hf, out = timed(run_hf, device)
    want = out[0, prompt_len:].tolist()
    agree = next((i for i, (a, b) in enumerate(zip(got[0], want)) if a != b), len(want))
    hf = None
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {
        "batch": batch,
        "prompt_len": prompt_len,
        "new_tokens": new,
        "kdistill_tokens_per_s": batch * new / t_ours,
        "transformers_tokens_per_s": batch * new / t_hf,
        "speedup": t_hf / t_ours,
        "first_row_tokens_agreeing": agree,
        "kernels": kernels.get("mode"),
        "jit_after_prewarm": jit,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a Hugging Face model directory (default: random weights)")
    ap.add_argument(
        "--preset", default="qwen2.5-0.5b", help="shapes of the random model (default: %(default)s)"
    )
    ap.add_argument(
        "--tiny", action="store_true", help="a tiny model of the preset's family (CPU smoke check)"
    )
    ap.add_argument("--batch", default="1,32", help="comma-separated batch sizes (default: %(default)s)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json", default=None, help="write the results here too")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA GPU: pass --device cpu for a smoke check")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = (
            Path(args.model) if args.model else build_model_dir(args.preset, args.tiny, Path(tmp) / "m")
        )
        rows = [
            bench(model_dir, device, int(b), args.prompt_len, args.new_tokens) for b in args.batch.split(",")
        ]
    meta = {
        "model": args.model or f"{args.preset} shapes{' (tiny)' if args.tiny else ''}, random weights",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
    }
    for r in rows:
        print(
            f"batch {r['batch']:>3}: kdistill {r['kdistill_tokens_per_s']:9.1f} tok/s   transformers "
            f"{r['transformers_tokens_per_s']:9.1f} tok/s   x{r['speedup']:.2f}   first row agrees on "
            f"{r['first_row_tokens_agreeing']}/{r['new_tokens']} tokens   jit_after_prewarm {r['jit_after_prewarm']}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "results": rows}, indent=2))


if __name__ == "__main__":
    main()
