"""The decode step's products one by one: cuBLAS beside kdistill's matrix-vector kernel over tile choices.

    PYTHONPATH=src python3 benchmarks/decode_products.py --models qwen2.5-0.5b,qwen2.5-1.5b --rows 1,16 \
        --json benchmarks/results/decode_products.json

For each preset, bucket size and product of a block (q/k/v with its bias, o_proj, gate/up with its
SwiGLU, down), as many distinct weights as the model has blocks (so that they stream from memory as in a
real step) are launched one after another, captured in one CUDA graph; the time is the replay's median
over the blocks: one product's cost inside a chain of launches. `cublas` is F.linear (+ the SwiGLU kernel
for gate/up), as the prefill runs them; `gemv` variants are kernels/decode_gemv.py at the tiles named
(PRE_K: inputs whose weights are loaded before the wait for the previous kernel, SPLIT: programs a
column block's K is split over (with gate/up the last of them applies the SwiGLU), BLOCK_N: columns a
program, BLOCK_K: inputs an iteration of the K loop, then Triton's num_stages and num_warps, and
BLOCK_M: rows a program, at least the bucket's), with
programmatic dependent launch (`pdl`) or without. Each variant is checked against the reference (relative error printed). Bytes/s
counts the weight bytes.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from kdistill import dispatch
from kdistill.kernels import decode_gemv
from kdistill.kernels.runtime import configure
from kdistill.models.presets import PRESETS

try:  # run as a script (benchmarks/ on sys.path) or as a module
    from decode_profile import replay_ms, tiles_key
    from kd_throughput import _argv_for_record
    from kd_throughput import _version as version
except ImportError:  # pragma: no cover
    from benchmarks.decode_profile import replay_ms, tiles_key
    from benchmarks.kd_throughput import _argv_for_record
    from benchmarks.kd_throughput import _version as version


def products(preset: str) -> dict[str, tuple[int, int, int]]:
    """name -> (n, k, epilogue) of one block's products."""
    c = PRESETS[preset]
    h, i = c["hidden_size"], c["intermediate_size"]
    d = c.get("head_dim") or h // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    bias = (
        decode_gemv.EPI_BIAS if c.get("attention_bias", c["model_type"] == "qwen2") else decode_gemv.EPI_NONE
    )
    return {
        "qkv": (q + 2 * kv, h, bias),
        "o_proj": (h, q, decode_gemv.EPI_NONE),
        "gate_up": (i, h, decode_gemv.EPI_SWIGLU),
        "down": (h, i, decode_gemv.EPI_NONE),
    }


def variant_key(
    n: int,
    k: int,
    epi: int,
    pre_k: int | None,
    split: int | None,
    block_n: int | None,
    pdl: bool,
    block_k: int | None = None,
    stages: int | None = None,
    warps: int | None = None,
    block_m: int | None = None,
):
    """The engine's key for the product with the tiles overridden (None: the policy's)."""
    base = decode_gemv.gemv_key("sm_90", n=n, k=k, dtype="bf16", epilogue=epi)
    return tiles_key(
        base,
        pre_k=pre_k,
        split=split,
        block_n=block_n,
        block_k=block_k,
        stages=stages,
        warps=warps,
        block_m=block_m,
        PDL=pdl,
    )


def parse_variants(text: str) -> list[tuple]:
    """'name:A:B:C[:D:E:F:G],...' -> [(name, A, B, C, D, E, F, G), ...], '-' or a field left out as
    None (the policy's value)."""
    out = []
    for item in text.split(","):
        name, *vals = item.split(":")
        vals = [None if v == "-" else int(v) for v in vals] + [None] * (7 - len(vals))
        out.append((name, *vals))
    return out


def record() -> dict:
    """The JSON record's header (command, card, versions) with no rows yet."""
    return {
        "argv": _argv_for_record(),
        "device": torch.cuda.get_device_name(),
        "versions": {"torch": torch.__version__, "triton": version("triton")},
        "rows": [],
    }


def chain_us(launches, reps: int) -> float:
    """Median µs of one launch in a captured chain of launches (replayed reps times)."""
    for fn in launches:  # eager once: compiles, allocates
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for fn in launches:
            fn()
    return replay_ms(g, reps) * 1e3 / len(launches)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="qwen2.5-0.5b,qwen2.5-1.5b")
    ap.add_argument("--rows", default="1,16")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument(
        "--variants",
        default="policy:-:-:-,pre128:128:-:-,pre256:256:-:-,pre512:512:-:-,split1:-:1:-,split2:-:2:-,split4:-:4:-",
        help="name:PRE_K:SPLIT:BLOCK_N[:BLOCK_K:num_stages:num_warps:BLOCK_M],... ('-': the policy's)",
    )
    ap.add_argument("--products", default="qkv,o_proj,gate_up,down", help="which of a block's products")
    ap.add_argument("--pdl", default="on,off", help="on, off or both: with programmatic dependent launch")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    configure(kernels="triton", strict=False)
    variants = parse_variants(a.variants)
    out = record()
    gen = torch.Generator(device="cuda").manual_seed(0)
    for preset in a.models.split(","):
        layers = PRESETS[preset]["num_hidden_layers"]
        for name, (n, k, epi) in products(preset).items():
            if name not in a.products.split(","):
                continue
            wn = 2 * n if epi == decode_gemv.EPI_SWIGLU else n
            ws = [
                torch.randn((wn, k), generator=gen, device="cuda").div_(k**0.5).bfloat16()
                for _ in range(layers)
            ]
            bias = (
                torch.randn(n, generator=gen, device="cuda").bfloat16()
                if epi == decode_gemv.EPI_BIAS
                else None
            )
            nbytes = wn * k * 2
            for rows in (int(r) for r in a.rows.split(",")):
                x = torch.randn((rows, k), generator=gen, device="cuda").bfloat16()
                ref = F.linear(x.double(), ws[0].double(), None if bias is None else bias.double())
                if epi == decode_gemv.EPI_SWIGLU:
                    g_, u_ = ref.chunk(2, dim=-1)
                    ref = F.silu(g_) * u_

                def cublas(w, x=x, bias=bias, epi=epi):
                    y = F.linear(x, w, bias)
                    return dispatch.swiglu(*y.chunk(2, dim=-1)) if epi == decode_gemv.EPI_SWIGLU else y

                results = {"cublas": chain_us([lambda w=w: cublas(w) for w in ws], a.reps)}
                errs = {"cublas": ((cublas(ws[0]).double() - ref).norm() / ref.norm()).item()}
                for vname, pre, split, bn, bk, stages, warps, bm in variants:
                    for pdl in [p == "on" for p in a.pdl.split(",")]:
                        try:
                            key = variant_key(n, k, epi, pre, split, bn, pdl, bk, stages, warps, bm)
                        except Exception as e:  # a tile the key refuses: reported, not fatal
                            results[vname], errs[vname] = None, f"{e.__class__.__name__}: {str(e)[:200]}"
                            continue
                        tag = f"{vname}{'' if pdl else '-nopdl'}"

                        def gemv(w, key=key, x=x, bias=bias):
                            return decode_gemv.run(decode_gemv.launch(key, x, w, bias))[0]

                        try:
                            results[tag] = chain_us([lambda w=w: gemv(w) for w in ws], a.reps)
                            errs[tag] = ((gemv(ws[0]).double() - ref).norm() / ref.norm()).item()
                        except Exception as e:  # a tile Triton cannot build: reported, not fatal
                            results[tag], errs[tag] = None, f"{e.__class__.__name__}: {str(e)[:200]}"
                best = min((v, t) for t, v in results.items() if v is not None)
                row = {
                    "model": preset,
                    "product": name,
                    "rows": rows,
                    "n": n,
                    "k": k,
                    "weight_mb": nbytes / 1e6,
                    "us": results,
                    "rel_err": errs,
                    "best": best[1],
                }
                out["rows"].append(row)
                cells = "  ".join(f"{t} {v:.2f}" for t, v in results.items() if v is not None)
                print(
                    f"{preset} {name:7s} rows {rows:2d} ({nbytes / 1e6:.1f} MB): {cells}  | best {best[1]} "
                    f"({nbytes / best[0] / 1e6:.2f} TB/s)",
                    flush=True,
                )
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
