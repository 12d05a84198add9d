"""How fast a matrix-vector product streams its weights when each SM holds one or two programs: plain
loads against TMA loads (a host tensor descriptor, which Triton's pipeline stages through shared memory
behind mbarriers), both in one flat persistent loop over (column block, K chunk) with the epilogue at a
block's last chunk (the loop shape of round fourteen's one-launch block, NOTES.md).

The question it answers before a block without kernel boundaries is built: can one program per SM
stream near the card's bandwidth? Round fourteen's one-launch block streamed 1.5 TB/s with plain loads
and one program per SM, where the matrix-vector kernel with several programs per SM reached 2.3.

    python3 benchmarks/stream_probe.py --json benchmarks/results/stream_probe.json
    TRITON_INTERPRET=1 python3 benchmarks/stream_probe.py --device cpu --tiny   # a CPU check of the kernel

y (M, N) = x (M, K) W^T at 16 rows for the presets' gate/up and down weights; each config is 50
launches captured in a CUDA graph, replayed, each over one of several copies of the weight that together
span 256 MB (so no launch finds its weight in L2): TB/s = the weight's bytes over a launch's time, the output
checked against torch's product; torch's product (cuBLAS) timed the same way beside them.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from importlib.metadata import version
from pathlib import Path

import torch
import triton
import triton.language as tl

try:  # run as a script (benchmarks/ on the path) or as a module
    from cuda_timing import median_seconds
except ImportError:
    from benchmarks.cuda_timing import median_seconds

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # a Triton without host tensor descriptors: plain loads only
    TensorDescriptor = None

try:  # the Gluon kernel (Triton with triton.experimental.gluon; runs on sm_90 and newer)
    try:
        import stream_probe_gluon as gluon_probe
    except ImportError:
        from benchmarks import stream_probe_gluon as gluon_probe
except Exception:  # a Triton without Gluon, or one whose Gluon API this kernel does not match
    gluon_probe = None

L2_SPAN = 256 << 20  # bytes of weight copies a launch cycles through: several times an L2

SHAPES = {  # name: (N, K) of the weight
    "0.5b_gate_up": (2 * 4864, 896),
    "0.5b_down": (896, 4864),
    "1.5b_gate_up": (2 * 8960, 1536),
    "1.5b_down": (1536, 8960),
}


@triton.jit
def stream_kernel(
    X,
    W,
    w_desc,
    Y,
    M,
    N: tl.constexpr,
    K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PROGS: tl.constexpr,
    STAGES: tl.constexpr,
    TMA: tl.constexpr,
):
    pid = tl.program_id(0)
    KT: tl.constexpr = K // BLOCK_K
    TILES: tl.constexpr = N // BLOCK_N
    mine = (TILES - pid + PROGS - 1) // PROGS  # this program's column blocks: pid, pid + PROGS, ...
    rows = tl.arange(0, BLOCK_M)
    rmask = rows < M
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for i in tl.range(0, mine * KT, num_stages=STAGES):
        t = pid + (i // KT) * PROGS
        k0 = (i % KT) * BLOCK_K
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(X + rows[:, None] * K + ks[None, :], mask=rmask[:, None], other=0.0)
        if TMA:
            w = w_desc.load([t * BLOCK_N, k0])
        else:
            cols = t * BLOCK_N + tl.arange(0, BLOCK_N)
            w = tl.load(W + cols[:, None] * K + ks[None, :])
        acc = tl.dot(x, tl.trans(w), acc)
        if i % KT == KT - 1:  # the block's last chunk: its output, then the next block from zero
            cols = t * BLOCK_N + tl.arange(0, BLOCK_N)
            tl.store(Y + rows[:, None] * N + cols[None, :], acc.to(Y.dtype.element_ty), mask=rmask[:, None])
            acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)


def launch(
    x: torch.Tensor, w: torch.Tensor, progs: int, stages: int, block_k: int, tma: bool, block_n: int = 16
):
    """The kernel over x (M <= 16, K) and w (N, K), both contiguous; N and K whole tiles."""
    m, k = x.shape
    n = w.shape[0]
    if n % block_n or k % block_k or m > 16:
        raise ValueError(
            f"stream_probe: ({n}, {k}) is not whole {block_n} x {block_k} tiles, or {m} > 16 rows"
        )
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    desc = TensorDescriptor.from_tensor(w, [block_n, block_k]) if tma else w
    grid = (min(progs, n // block_n),)
    stream_kernel[grid](
        x, w, desc, y, m, N=n, K=k, BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, PROGS=grid[0],
        STAGES=stages, TMA=tma,
    )  # fmt: skip
    return y


def graph_us(fn, copies: int, launches: int = 50, replays: int = 5) -> float:
    """µs of one call of fn(i), from `launches` calls captured in a CUDA graph and replayed (median);
    call i reads weight copy i % copies, so that a copy is out of L2 by the time it is read again."""
    fn(0)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(launches):
            fn(i % copies)
    return median_seconds(g.replay, replays, warmup=0) * 1e6 / launches


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--per-sm", default="1,2", help="programs per SM, comma-separated")
    ap.add_argument("--stages", default="4,8")
    ap.add_argument("--block-k", default="64,128")
    ap.add_argument(
        "--providers",
        default="plain,tma,gluon,gluon-copy",
        help="plain / tma: the Triton loop; gluon: TMA ring + warpgroup MMA; gluon-copy: its copies alone",
    )
    ap.add_argument(
        "--gluon-tiles", default="64x128,128x64,128x128", help="BLOCK_NxBLOCK_K of the Gluon kernel"
    )
    ap.add_argument("--device", default="cuda")
    ap.add_argument(
        "--tiny", action="store_true", help="small weights (a CPU check under TRITON_INTERPRET=1)"
    )
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    dev = torch.device(a.device)
    gpu = dev.type == "cuda"
    sms = torch.cuda.get_device_properties(dev).multi_processor_count if gpu else 4
    dtype = torch.bfloat16 if gpu else torch.float32
    shapes = {"tiny": (64, 256)} if a.tiny else {s: SHAPES[s] for s in a.shapes.split(",")}
    providers = a.providers.split(",")
    variants = [v for v, name in ((False, "plain"), (True, "tma")) if name in providers]
    if TensorDescriptor is None:
        variants = [v for v in variants if not v]
    gluon_runs = [p for p in ("gluon", "gluon-copy") if p in providers]
    if gluon_runs and (gluon_probe is None or not gpu):
        print("stream_probe: the Gluon kernel needs a GPU of sm_90 or newer and Triton's Gluon: skipped")
        gluon_runs = []
    out: dict = {
        "argv": " ".join(["python3", "benchmarks/stream_probe.py", *sys.argv[1:]]),
        "device": torch.cuda.get_device_name(dev) if gpu else "cpu",
        "sms": sms,
        "versions": {"torch": torch.__version__, "triton": version("triton")},
        "rows": [],
    }
    g = torch.Generator().manual_seed(0)
    for name, (n, k) in shapes.items():
        x = torch.randn((a.rows, k), generator=g).to(dev, dtype)
        w = (torch.randn((n, k), generator=g) / k**0.5).to(dev, dtype)
        nbytes = w.numel() * w.element_size()
        # copies of the weight beyond the L2 (H100/H200: 50 MB): every launch streams from HBM
        ws = [w] + [w.clone() for _ in range(-(-L2_SPAN // nbytes) - 1)] if gpu else [w]
        want = (x.float() @ w.float().t()).to(dtype)
        if gpu:
            us = graph_us(lambda i, x=x, ws=ws: x @ ws[i].t(), len(ws))
            out["rows"].append({"shape": name, "provider": "torch", "us": us, "tb_s": nbytes / us / 1e6})
            print(
                f"{name:14s} torch                         {us:7.2f} us  {nbytes / us / 1e6:5.2f} TB/s",
                flush=True,
            )
        for per_sm, stages, block_k, tma in itertools.product(
            (int(v) for v in a.per_sm.split(",")),
            (int(v) for v in a.stages.split(",")),
            (int(v) for v in a.block_k.split(",")),
            variants,
        ):
            cfg = dict(progs=per_sm * sms, stages=stages, block_k=min(block_k, k), tma=tma)
            row = {"shape": name, "provider": "tma" if tma else "plain", "per_sm": per_sm, **cfg}
            try:
                y = launch(x, w, **cfg)
                err = ((y.float() - want.float()).norm() / want.float().norm()).item()
                row["rel_err"] = err
                if err > 2e-2:
                    raise RuntimeError(f"relative error {err:.3g}")
                if gpu:
                    row["us"] = graph_us(lambda i, x=x, ws=ws, cfg=cfg: launch(x, ws[i], **cfg), len(ws))
                    row["tb_s"] = nbytes / row["us"] / 1e6
            except Exception as e:  # a config the compiler or the card refuses: recorded, the sweep goes on
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            out["rows"].append(row)
            took = f"{row['us']:7.2f} us  {row['tb_s']:5.2f} TB/s" if "us" in row else row.get("error", "ok")
            print(
                f"{name:14s} {row['provider']:5s} {per_sm}/SM stages {stages} BLOCK_K {block_k:3d}  {took}",
                flush=True,
            )
        for prov, per_sm, stages, tile in itertools.product(
            gluon_runs,
            (int(v) for v in a.per_sm.split(",")),
            (int(v) for v in a.stages.split(",")),
            a.gluon_tiles.split(","),
        ):
            block_n, block_k = (int(v) for v in tile.split("x"))
            block_k = min(block_k, k)
            mma = prov == "gluon"
            cfg = dict(progs=per_sm * sms, stages=stages, block_n=block_n, block_k=block_k, mma=mma)
            row = {"shape": name, "provider": prov, "per_sm": per_sm, **cfg}
            row["smem"] = gluon_probe.smem_bytes(stages, block_n, block_k)
            if row["smem"] * per_sm > 220 * 1024:
                row["error"] = f"{row['smem']} bytes of shared memory a program: over the SM's"
            else:
                try:
                    if mma:
                        y = gluon_probe.launch_gluon(x, w, **cfg)
                        err = ((y - want.float()).norm() / want.float().norm()).item()
                        row["rel_err"] = err
                        if err > 2e-2:
                            raise RuntimeError(f"relative error {err:.3g}")
                    ybuf = torch.zeros((a.rows, n), dtype=torch.float32, device=dev)
                    row["us"] = graph_us(
                        lambda i, x=x, ws=ws, cfg=cfg, ybuf=ybuf: gluon_probe.launch_gluon(
                            x, ws[i], y=ybuf, **cfg
                        ),
                        len(ws),
                    )
                    row["tb_s"] = nbytes / row["us"] / 1e6
                except Exception as e:  # recorded, the sweep goes on
                    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            out["rows"].append(row)
            took = f"{row['us']:7.2f} us  {row['tb_s']:5.2f} TB/s" if "us" in row else row.get("error", "ok")
            print(f"{name:14s} {prov:10s} {per_sm}/SM stages {stages} tile {tile:8s} {took}", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
