"""Speculative decoding against the decode engine alone, on one card, with pairs whose agreement is known.

    PYTHONPATH=src python3 benchmarks/speculative_bench.py --model qwen2.5-7b --draft-layers 2 \
        --draft-tokens 4 --batch 1,8 --prompt 128 --new 256 --json benchmarks/results/speculative.json

Random-weight models accept almost nothing of each other, so the pairs are built (on the device, bf16,
greedy, no stop token: every row runs to --new tokens):

  target  the preset's shapes (a Qwen2.5-7B by default), random weights; its blocks past the first
          --draft-layers have their o_proj and down_proj set to eps x a random matrix of the init's scale
  draft   the target's first --draft-layers blocks, its embedding, final norm and lm_head (same width)

With eps = 0 the later blocks add nothing to the residual stream: the draft computes the target's own
logits (alpha = 1 up to rounding, the mechanism's ceiling). A larger eps moves the target away from the
draft; eps is searched (bisection on log eps, greedy alpha measured on --calib-prompts prompts) for each
alpha of --alphas. For each pair and batch size: the engine alone (one-token step as a CUDA graph) and
the speculative decoder (the whole draft-verify-commit round as one CUDA graph), tokens/s end to end
(prefill included), the measured alpha and tokens per verify step, and the speed-up the cost model
predicts from the step costs measured in the same process (SpeculativeDecoder.step_costs):

    predicted = E[tokens per verify] / (K c_draft + c_verify)       (c: in target one-token steps)
    E[tokens per verify] = (1 - alpha^(K+1)) / (1 - alpha)          (kdistill.acceptance.speedup)

`predicted_measured_tpv` uses the measured tokens per verify instead of the i.i.d. formula. Every kernel
is planned and prewarmed first and the cache sealed strictly: `jit_after_prewarm` must be 0.
Batch 1 runs its prompts one after another (--prompts-b1 of them); batch 8 runs 8 at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

import torch

from kdistill.acceptance import speedup
from kdistill.decode import DecodeEngine, Sampling
from kdistill.kernels import seal
from kdistill.models.decoder import Decoder, build_decoder
from kdistill.models.presets import PRESETS
from kdistill.models.spec import spec_from_hf_config
from kdistill.speculative import SpeculativeDecoder, prepare_speculative_kernels

try:  # run as a script (benchmarks/ on sys.path) or as a module
    from kd_throughput import _argv_for_record
    from kd_throughput import _version as version
except ImportError:  # pragma: no cover
    from benchmarks.kd_throughput import _argv_for_record
    from benchmarks.kd_throughput import _version as version

TINY = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2
)
STD = 0.02  # the init's scale (Decoder.init_weights)


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


@torch.no_grad()
def init_random(model: Decoder, seed: int) -> None:
    """Decoder.init_weights' distribution (normal(0, STD) matrices, ones for norms, zero biases), drawn on
    the model's device (a 7B model's 7.6e9 numbers drawn on a CPU would take minutes)."""
    g = torch.Generator(device=model.lm_head_weight.device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name.endswith(".bias"):
            p.zero_()
        else:
            p.normal_(0.0, STD, generator=g)


def build_pair(preset: str, draft_layers: int, dev: torch.device, tiny: bool) -> tuple[Decoder, Decoder]:
    raw = dict(PRESETS[preset])
    if tiny:
        raw.update(TINY, vocab_size=1024, head_dim=16)
    spec = dataclasses.replace(spec_from_hf_config(raw, preset), name=preset)
    if not 0 < draft_layers < spec.num_layers:
        sys.exit(f"--draft-layers is {draft_layers}, expected 1 to {spec.num_layers - 1}")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    target = build_decoder(spec, dev, dtype, seed=None).eval()
    init_random(target, 0)
    draft = build_decoder(dataclasses.replace(spec, num_layers=draft_layers), dev, dtype, seed=None).eval()
    missing, unexpected = draft.load_state_dict(target.state_dict(), strict=False)
    assert not missing and all(".layers." in k for k in unexpected), (missing, unexpected[:3])
    return target, draft


@torch.no_grad()
def perturb(target: Decoder, draft_layers: int, eps: float, seed: int = 7) -> None:
    """The target's blocks past the draft's: o_proj and down_proj = eps x normal(0, STD)."""
    g = torch.Generator(device=target.lm_head_weight.device).manual_seed(seed)
    for block in target.model.layers[draft_layers:]:
        for w in (block.self_attn.o_proj.weight, block.mlp.down_proj.weight):
            w.normal_(0.0, STD, generator=g).mul_(eps)


def greedy_alpha(dec: SpeculativeDecoder, prompts: list[list[int]]) -> tuple[float, float]:
    """(alpha, tokens per verify step) of a generate over the prompts."""
    dec.generate(prompts)
    acc = sum(a for a, _ in dec.stats)
    rounds = sum(r for _, r in dec.stats)
    return acc / max(1, dec.k * rounds), acc / max(1, rounds) + 1


def calibrate(
    target: Decoder, dec: SpeculativeDecoder, draft_layers: int, want: float, prompts, iters: int
) -> tuple[float, float]:
    """eps whose greedy alpha is closest to `want` (bisection on log10 eps in [-4, 1])."""
    lo, hi = -4.0, 1.0
    best = (math.inf, 0.0, 1.0)
    for _ in range(iters):
        mid = (lo + hi) / 2
        perturb(target, draft_layers, 10**mid)
        dec.target.refresh(target)
        alpha, _ = greedy_alpha(dec, prompts)
        print(f"  calibrate alpha {want}: eps 10^{mid:.2f} -> alpha {alpha:.3f}", flush=True)
        if abs(alpha - want) < best[0]:
            best = (abs(alpha - want), 10**mid, alpha)
        if alpha > want:
            lo = mid  # more noise
        else:
            hi = mid
    return best[1], best[2]


def run_batches(gen, prompts_by_batch: dict[int, list[list[int]]], new: int, dev: torch.device) -> dict:
    """Tokens/s of gen.generate per batch size (batch 1: its prompts one after another)."""
    out = {}
    for b, prompts in prompts_by_batch.items():
        groups = [prompts[i : i + b] for i in range(0, len(prompts), b)]
        gen.generate(groups[0])  # capture this bucket, load its kernels
        stats: list[tuple[int, int]] = []
        sync(dev)
        t = time.perf_counter()
        for g in groups:
            rows = gen.generate(g)
            assert all(len(r) == new for r in rows), [len(r) for r in rows]
            stats += getattr(gen, "stats", [])
        sync(dev)
        sec = time.perf_counter() - t
        row = {"batch": b, "prompts": len(prompts), "seconds": sec, "tokens_per_s": len(prompts) * new / sec}
        if isinstance(gen, SpeculativeDecoder):
            acc, rounds = sum(a for a, _ in stats), sum(r for _, r in stats)
            row.update(
                alpha=acc / max(1, gen.k * rounds),
                tokens_per_verify=acc / max(1, rounds) + 1,
                verify_steps=rounds,
                **gen.step_costs(),
            )
        out[b] = row
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen2.5-7b")
    p.add_argument("--draft-layers", type=int, default=2)
    p.add_argument("--draft-tokens", type=int, default=4)
    p.add_argument("--batch", default="1,8")
    p.add_argument("--prompts-b1", type=int, default=4)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=256)
    p.add_argument("--alphas", default="1,0.8,0.6", help="1: eps = 0; others searched")
    p.add_argument("--calib-prompts", type=int, default=16)
    p.add_argument("--calib-iters", type=int, default=8)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="a 6-layer stand-in (CPU smoke run)")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    dev = torch.device(a.device)
    k = a.draft_tokens
    batches = [int(b) for b in a.batch.split(",")]
    t0 = time.perf_counter()
    target, draft = build_pair(a.model, a.draft_layers, dev, a.tiny)
    spec = target.spec
    print(f"built {a.model} target and {a.draft_layers}-layer draft in {time.perf_counter() - t0:.1f} s")
    max_len = a.prompt + a.new
    info = prepare_speculative_kernels(target, draft, max(batches), a.prompt, max_len + k + 1, k)
    seal.seal(strict=dev.type == "cuda")
    print("kernels:", info, flush=True)
    g = torch.Generator().manual_seed(1)

    def rand_prompts(n: int) -> list[list[int]]:
        return torch.randint(100, spec.vocab_size - 100, (n, a.prompt), generator=g).tolist()

    by_batch = {b: rand_prompts(a.prompts_b1 if b == 1 else b) for b in batches}
    calib = rand_prompts(a.calib_prompts)
    s = Sampling(max_new_tokens=a.new)
    # the engine alone (the target's weights do not change its speed: measured once, with eps = 0)
    perturb(target, a.draft_layers, 0.0)
    alone = DecodeEngine(target, batch_size=max(batches), max_len=max_len + k + 1, sampling=s)
    base = run_batches(alone, by_batch, a.new, dev)
    del alone
    print("engine alone:", json.dumps(base), flush=True)
    dec = SpeculativeDecoder(
        target, draft, draft_tokens=k, batch_size=max(batches), max_len=max_len, sampling=s
    )
    cal = SpeculativeDecoder(
        target,
        draft,
        draft_tokens=k,
        batch_size=max(batches),
        max_len=max_len,
        sampling=Sampling(max_new_tokens=min(96, a.new)),
    )
    rows = []
    for want in (float(x) for x in a.alphas.split(",")):
        if want >= 1:
            eps, calib_alpha = 0.0, None
            perturb(target, a.draft_layers, 0.0)
        else:
            eps, calib_alpha = calibrate(target, cal, a.draft_layers, want, calib, a.calib_iters)
            perturb(target, a.draft_layers, eps)
        dec.target.refresh(target)
        for b, r in run_batches(dec, by_batch, a.new, dev).items():
            c_d = r["draft_step_s"] / r["target_step_s"]
            c_v = r["verify_step_s"] / r["target_step_s"]
            pred = speedup(min(r["alpha"], 1.0), k, c_d, c_v)
            meas = r["tokens_per_s"] / base[b]["tokens_per_s"]
            row = {
                "alpha_wanted": want,
                "eps": eps,
                "calibration_alpha": calib_alpha,
                **r,
                "engine_tokens_per_s": base[b]["tokens_per_s"],
                "c_draft": c_d,
                "c_verify": c_v,
                "speedup": meas,
                "predicted": pred,
                "predicted_measured_tpv": r["tokens_per_verify"] / (k * c_d + c_v),
                "measured_over_predicted": meas / pred,
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    result = {
        "command": "python3 benchmarks/speculative_bench.py " + _argv_for_record(),
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "triton": version("triton"),
        "model": a.model,
        "draft_layers": a.draft_layers,
        "draft_tokens": k,
        "prompt": a.prompt,
        "new": a.new,
        "engine_alone": list(base.values()),
        "rows": rows,
        "jit_after_prewarm": seal.jit_after_prewarm(),
        "kernels": info,
    }
    print(
        f"jit_after_prewarm {result['jit_after_prewarm']}; "
        + "; ".join(
            f"alpha {r['alpha']:.2f} b{r['batch']}: {r['speedup']:.2f}x (predicted {r['predicted']:.2f}x)"
            for r in rows
        )
    )
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
