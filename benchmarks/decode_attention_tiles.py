"""The decode step's attention alone: the split kernel over split lengths, warps and launch modes.

    PYTHONPATH=src python3 benchmarks/decode_attention_tiles.py --models qwen2.5-0.5b,qwen2.5-1.5b \
        --batch 1,16,32,128 --context 192:256,1024:1152 --json benchmarks/results/decode_attention_tiles.json

For each preset, batch and context (FILLED:SLOTS: each row's newest slot is FILLED - 1 of a cache of SLOTS),
as many distinct caches as the model has blocks are attended one after another (each launch the step's
split kernel: RoPE, the cache write, the last split of each (row, kv head) combining the parts), captured
in one CUDA graph; the time is the replay's median over the blocks: one attention's cost inside a chain of
launches. Variants: `policy` (the engine's key for that cache), and SPLIT:WARPS:STAGES overrides (SPLIT:
cached slots a program takes; the parts a row combines are SLOTS / SPLIT; BLOCK_N: the keys of one tile). `-pdl` variants launch with
programmatic dependent launch and read their first tile before the wait, as a small bucket's step does.
Each variant is checked against the reference (relative error). Bytes/s counts the cached keys and values
read (FILLED slots of every row and kv head).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from kdistill.kernels import decode_attention as attn
from kdistill.kernels.keys import make_key
from kdistill.kernels.runtime import configure
from kdistill.models.presets import PRESETS
from kdistill.ops.attention import decode_attention_reference

try:  # run as a script (benchmarks/ on sys.path) or as a module
    from decode_products import chain_us, parse_variants, record
except ImportError:  # pragma: no cover
    from benchmarks.decode_products import chain_us, parse_variants, record


def heads(preset: str) -> tuple[int, int, int]:
    """(head_dim, q heads, kv heads) of a preset."""
    c = PRESETS[preset]
    d = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return d, c["num_attention_heads"], c["num_key_value_heads"]


def variant_key(
    preset: str,
    slots: int,
    split: int | None,
    warps: int | None,
    stages: int | None,
    pdl: bool,
    block_n: int | None = None,
    rows: int = 1,
):
    """The engine's split key for the cache and a step of `rows` rows with the tiles overridden (None: the
    policy's)."""
    d, hq, hkv = heads(preset)
    base = attn.split_key(
        "sm_90",
        head_dim=d,
        q_heads=hq,
        kv_heads=hkv,
        dtype="bf16",
        max_len=slots,
        rope=True,
        split_min=attn.min_split(rows),
    )
    p = dict(base.params)
    if split:
        p["SPLIT"] = split
    if warps:
        p["num_warps"] = warps
    if stages:
        p["num_stages"] = stages
    if block_n:
        p["BLOCK_N"] = block_n
    p["PDL"] = p["PRELOAD"] = pdl
    return make_key(base.op, base.arch, **p)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="qwen2.5-0.5b,qwen2.5-1.5b")
    ap.add_argument("--batch", default="1,16,32,128")
    ap.add_argument("--context", default="192:256,1024:1152", help="FILLED:SLOTS,...")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument(
        "--variants",
        default="policy:-:-:-,s128:128:-:-,s256:256:-:-,s512:512:-:-,s1024:1024:-:-,"
        "s256w8:256:8:-,s256st3:256:-:3,s1024st3:1024:-:3",
        help="name:SPLIT:WARPS:STAGES[:BLOCK_N],... ('-': the policy's); a SPLIT past SLOTS is skipped",
    )
    ap.add_argument("--pdl-batch", type=int, default=16, help="batches up to this also run -pdl variants")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    configure(kernels="triton", strict=False)
    variants = parse_variants(a.variants)
    out = record()
    gen = torch.Generator(device="cuda").manual_seed(0)
    for preset in a.models.split(","):
        d, hq, hkv = heads(preset)
        layers = PRESETS[preset]["num_hidden_layers"]
        for ctx in a.context.split(","):
            filled, slots = (int(v) for v in ctx.split(":"))
            ang = torch.randn((slots, d // 2), generator=gen, device="cuda").repeat(1, 2)
            cos, sin = ang.cos(), ang.sin()
            for b in (int(x) for x in a.batch.split(",")):
                shape = (b, hkv, slots, d)
                caches = [
                    (
                        torch.randn(shape, generator=gen, device="cuda").bfloat16(),
                        torch.randn(shape, generator=gen, device="cuda").bfloat16(),
                    )
                    for _ in range(layers)
                ]
                qkv = torch.randn((b, (hq + 2 * hkv) * d), generator=gen, device="cuda").bfloat16()
                q = qkv[:, : hq * d].view(b, hq, d)
                kn = qkv[:, hq * d : (hq + hkv) * d].view(b, hkv, d)
                vn = qkv[:, (hq + hkv) * d :].view(b, hkv, d)
                pos = torch.full((b,), filled - 1, dtype=torch.int64, device="cuda")
                k0, v0 = (t.float().clone() for t in caches[0])
                ref = decode_attention_reference(
                    q.float(), k0, v0, pos, kn.float(), vn.float(), cos, sin
                ).double()
                kv_mb = b * hkv * filled * d * 2 * 2 / 1e6
                results, errs = {}, {}
                for vname, split, warps, stages, block_n, *_ in variants:
                    if split and split > slots:
                        continue
                    for pdl in (False, True) if b <= a.pdl_batch else (False,):
                        key = variant_key(preset, slots, split, warps, stages, pdl, block_n, rows=b)
                        tag = f"{vname}{'-pdl' if pdl else ''}"

                        def one(kc, key=key, x=(q, pos, kn, vn, cos, sin)):
                            q_, pos_, kn_, vn_, cos_, sin_ = x
                            return attn.run(attn.launch(key, q_, kc[0], kc[1], pos_, kn_, vn_, cos_, sin_))[0]

                        try:
                            results[tag] = chain_us([lambda kc=kc: one(kc) for kc in caches], a.reps)
                            errs[tag] = ((one(caches[0]).double() - ref).norm() / ref.norm()).item()
                        except Exception as e:  # a tile Triton cannot build: reported, not fatal
                            results[tag], errs[tag] = None, f"{e.__class__.__name__}: {str(e)[:200]}"
                best = min((v, t) for t, v in results.items() if v is not None)
                out["rows"].append(
                    {
                        "model": preset,
                        "batch": b,
                        "filled": filled,
                        "slots": slots,
                        "kv_mb": kv_mb,
                        "us": results,
                        "rel_err": errs,
                        "best": best[1],
                    }
                )
                cells = "  ".join(f"{t} {v:.2f}" for t, v in results.items() if v is not None)
                print(
                    f"{preset} b{b:3d} {filled}/{slots} ({kv_mb:.1f} MB): {cells}  | best {best[1]} "
                    f"({kv_mb / best[0]:.2f} TB/s)",
                    flush=True,
                )
                del caches
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
