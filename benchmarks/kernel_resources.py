"""Registers and shared memory of a decode step's matrix-vector and attention kernels, and how many of
their programs an SM holds at once: no GPU needed.

    PYTHONPATH=src python3 benchmarks/kernel_resources.py --models qwen2.5-0.5b,qwen2.5-1.5b --rows 16 \
        --pre-k 512,256,128 --json benchmarks/results/kernel_resources.json

Each `decode_gemv` key of the model's generation plan (an engine of --rows rows, --arch), and its step's
attention split kernel (its programs counted over --filled of --max-len slots), is cross-built as
`kdistill kernels build` builds it, and its binary's registers read with the `cuobjdump -res-usage` that
Triton ships; --pre-k adds each key built with those prefetch depths instead of the policy's (PRE_K:
the inputs whose weights a program loads before waiting for the previous kernel). Per key: its product
(N, K, epilogue), programs (column blocks × K splits), registers a thread, shared memory a program, the
programs an SM holds (the least of what its registers, its shared memory and its warps allow) and the
waves its programs take over --sms SMs (132: an H100 or H200 SXM). A product whose programs take more
than one wave runs its last ones after the others (NOTES.md, round nineteen).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

# Per SM on sm_90 (CUDA's occupancy rules): 64K registers allocated per warp in units of 256, 228 KB of
# shared memory of which each resident program also takes 1 KB the system reserves, 64 warps, 32 programs.
SM_REGISTERS = 65536
REGISTER_UNIT = 256
SM_SHARED = 233472
SHARED_RESERVED = 1024
SM_WARPS = 64
SM_PROGRAMS = 32


def per_sm(registers: int, shared: int, warps: int) -> int:
    """Programs of `warps` warps, each thread `registers` registers and each program `shared` bytes of
    shared memory, that one SM holds at once."""
    per_warp = -(-registers * 32 // REGISTER_UNIT) * REGISTER_UNIT
    by_regs = SM_REGISTERS // max(1, per_warp * warps)
    by_shared = SM_SHARED // (shared + SHARED_RESERVED)
    return max(0, min(by_regs, by_shared, SM_WARPS // warps, SM_PROGRAMS))


def registers(cubin: bytes) -> int:
    """Registers a thread of the kernel in `cubin`, as cuobjdump -res-usage reports them."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True, check=True)
    found = re.findall(r"REG:(\d+)", out.stdout)
    if not found:
        raise RuntimeError(f"cuobjdump reported no registers: {out.stdout[-300:]}")
    return int(found[-1])


def resources(key, programs: int, sms: int) -> dict:
    """`key` cross-built: its registers a thread, shared memory and warps a program, the programs an SM
    holds and the waves `programs` of them take over `sms` SMs."""
    from kdistill.kernels.pack import jit_compile

    compiled = jit_compile(key)
    regs, warps = registers(compiled.asm["cubin"]), int(key["num_warps"])
    shared = int(compiled.metadata.shared)
    held = per_sm(regs, shared, warps)
    return {
        "programs": programs,
        "registers": regs,
        "shared_bytes": shared,
        "warps": warps,
        "per_sm": held,
        "waves": round(programs / max(1, held * sms), 2),
    }


def summary(r: dict) -> str:
    return (
        f"{r['programs']:4d} programs, {r['registers']:3d} registers, {r['shared_bytes'] // 1024:3d} KB shared: "
        f"{r['per_sm']} an SM, {r['waves']:.2f} waves"
    )


def attention_row(preset: str, key, batch: int, filled: int, sms: int) -> dict:
    """The one-token attention's split kernel for `batch` rows over `filled` slots: a program per row,
    kv head and split of key["SPLIT"] keys."""
    programs = batch * int(key["HKV"]) * -(-filled // int(key["SPLIT"]))
    row = {
        "kernel": "decode_attn_split",
        "model": preset,
        "rows": batch,
        "filled": filled,
        "SPLIT": int(key["SPLIT"]),
        "BLOCK_N": int(key["BLOCK_N"]),
        "PDL": bool(key["PDL"]),
        **resources(key, programs, sms),
    }
    print(
        f"{preset:13s} attention, {batch} rows over {filled} slots, splits of {row['SPLIT']}: {summary(row)}"
    )
    return row


def main() -> None:
    from kdistill.kernels import decode_gemv
    from kdistill.kernels.keys import make_key
    from kdistill.kernels.plan import generation_kernels
    from kdistill.kernels.seal import setup_cache_dir
    from kdistill.models.presets import PRESETS
    from kdistill.models.spec import spec_from_hf_config

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="qwen2.5-0.5b,qwen2.5-1.5b")
    ap.add_argument("--rows", type=int, default=16, help="the engine's rows (its largest bucket)")
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument(
        "--pre-k", default="", help="prefetch depths to build each key with too, e.g. 512,256,128"
    )
    ap.add_argument(
        "--max-len",
        type=int,
        default=256,
        help="the engine's cache slots; the attention's programs are counted over --filled of them",
    )
    ap.add_argument("--filled", type=int, default=0, help="slots filled (default: all of --max-len)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    setup_cache_dir()
    epilogues = {
        decode_gemv.EPI_NONE: "plain",
        decode_gemv.EPI_BIAS: "bias",
        decode_gemv.EPI_SWIGLU: "swiglu",
    }
    rows = []
    for preset in a.models.split(","):
        spec = spec_from_hf_config(PRESETS[preset])
        plan = generation_kernels(spec, a.arch, "bf16", batch=a.rows, prompt_len=8, max_len=a.max_len)
        filled = a.filled or a.max_len
        chained = a.rows <= decode_gemv.step_rows(spec.hidden_size)
        for key in sorted((k for k in plan if k.op == "decode_attn_split" and k["PDL"] == chained), key=str):
            rows.append(attention_row(preset, key, a.rows, filled, a.sms))
        gemv = sorted((k for k in plan if k.op == "decode_gemv"), key=str)
        for base in gemv:
            depths = [int(base["PRE_K"])] + [
                int(p) for p in a.pre_k.split(",") if p and int(p) != base["PRE_K"]
            ]
            for depth in depths:
                key = make_key(base.op, base.arch, **{**dict(base.params), "PRE_K": depth})
                programs = -(-int(key["N"]) // int(key["BLOCK_N"])) * int(key["SPLIT"])
                row = {
                    "kernel": "decode_gemv",
                    "model": preset,
                    "N": int(key["N"]),
                    "K": int(key["K"]),
                    "epilogue": epilogues[int(key["EPI"])],
                    "BLOCK_M": int(key["BLOCK_M"]),
                    "BLOCK_N": int(key["BLOCK_N"]),
                    "SPLIT": int(key["SPLIT"]),
                    "COMBINE": bool(key.get("COMBINE", True)),  # False: the norm after it sums the partials
                    "PRE_K": depth,
                    "policy": depth == base["PRE_K"],
                    **resources(key, programs, a.sms),
                }
                rows.append(row)
                print(
                    f"{preset:13s} {row['N']:6d} x {row['K']:5d} {row['epilogue']:6s} rows {row['BLOCK_M']:2d} "
                    f"split {row['SPLIT']} PRE_K {depth:4d}{' (policy)' if row['policy'] else '         '} "
                    f"{summary(row)}",
                    flush=True,
                )
    if a.json:
        import datetime

        import triton

        out = {"command": " ".join(["python3", "benchmarks/kernel_resources.py", *sys.argv[1:]]), "arch": a.arch,
               "sms": a.sms, "triton": triton.__version__,
               "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d"), "rows": rows}  # fmt: skip
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
