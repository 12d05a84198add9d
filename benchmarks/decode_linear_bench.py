"""The decode step's block linears: a fused Triton kernel (defined here) against the unfused path of
kdistill.decode (norm kernels, cuBLAS, SwiGLU), over tile choices, on one card. An experiment, measured
and not taken into the engine (benchmarks/NOTES.md, round nine: it loses wherever it fuses a norm).

    PYTHONPATH=src python3 benchmarks/decode_linear_bench.py --models qwen2.5-0.5b,qwen2.5-1.5b \
        --rows 1,16,128 --json benchmarks/results/decode_linear.json

Each launch runs over as many distinct weights as the model has blocks (so the weights stream from
memory as in a real step, not from L2), captured in one CUDA graph; the time is the replay's median over
the blocks. Unfused: what kdistill.decode's eager forward launches for the same work (add + RMSNorm
kernel, cuBLAS linear with bias, SwiGLU kernel). Each fused result is checked against the reference
(relative error printed). `bytes/s` counts the weight bytes only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton import jit

from kdistill import dispatch
from kdistill.kernels.runtime import configure
from kdistill.models.presets import PRESETS

EPI_NONE, EPI_BIAS, EPI_SWIGLU = 0, 1, 2


@jit(do_not_specialize=["M"])
def decode_linear_kernel(
    X,
    DELTA,
    LN,
    W,
    BIAS,
    Y,
    XO,
    M,
    N: tl.constexpr,
    K: tl.constexpr,
    NDELTA: tl.constexpr,
    NORM: tl.constexpr,
    EPS: tl.constexpr,
    EPI: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    TWO_PASS: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < M
    cmask = cols < N
    rows64 = rows.to(tl.int64)
    cols64 = cols.to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    acc2 = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    sumsq = tl.zeros((BLOCK_M,), tl.float32)
    KS: tl.constexpr = K // SPLIT_K
    k_lo = pid_k * KS
    if TWO_PASS:  # the prologue's statistics and the new residual first (x is small: from L2), then a
        # main loop of loads and dots alone, which the compiler can pipeline
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            xmask = rmask[:, None] & (kk < K)[None, :]
            xoffs = rows64[:, None] * K + kk[None, :]
            x = tl.load(X + xoffs, mask=xmask, other=0.0).to(tl.float32)
            for s in tl.static_range(NDELTA):
                x += tl.load(DELTA + s * M * K + xoffs, mask=xmask, other=0.0).to(tl.float32)
            if NDELTA > 0:
                if pid_n == 0:
                    tl.store(XO + xoffs, x.to(XO.dtype.element_ty), mask=xmask)
            sumsq += tl.sum(x * x, axis=1)
    for k0 in range(0, KS, BLOCK_K):
        kk = k_lo + k0 + tl.arange(0, BLOCK_K)
        kmask = kk < k_lo + KS
        xmask = rmask[:, None] & kmask[None, :]
        xoffs = rows64[:, None] * K + kk[None, :]
        x = tl.load(X + xoffs, mask=xmask, other=0.0).to(tl.float32)  # (BLOCK_M, BLOCK_K)
        if NDELTA > 0:
            for s in tl.static_range(NDELTA):
                x += tl.load(DELTA + s * M * K + xoffs, mask=xmask, other=0.0).to(tl.float32)
            if not TWO_PASS:
                if pid_n == 0:  # the new residual, once per row
                    tl.store(XO + xoffs, x.to(XO.dtype.element_ty), mask=xmask)
        if NORM:
            if not TWO_PASS:
                sumsq += tl.sum(x * x, axis=1)
            x = x * tl.load(LN + kk, mask=kmask, other=0.0).to(tl.float32)[None, :]
        xb = x.to(W.dtype.element_ty)
        wmask = cmask[:, None] & kmask[None, :]
        w = tl.load(W + cols64[:, None] * K + kk[None, :], mask=wmask, other=0.0)  # (BLOCK_N, BLOCK_K)
        acc = tl.dot(xb, tl.trans(w), acc)
        if EPI == 2:
            w2 = tl.load(W + (cols64 + N)[:, None] * K + kk[None, :], mask=wmask, other=0.0)
            acc2 = tl.dot(xb, tl.trans(w2), acc2)
    if NORM:
        rstd = tl.rsqrt(sumsq / K + EPS)
        acc = acc * rstd[:, None]
        if EPI == 2:
            acc2 = acc2 * rstd[:, None]
    if EPI == 1:
        # once over the splits: the first part carries the bias
        acc += tl.load(BIAS + cols, mask=cmask & (pid_k == 0), other=0.0).to(tl.float32)[None, :]
    if EPI == 2:
        # rounded as the unfused path rounds: gate and up to the weights' dtype, silu(gate) likewise
        g = acc.to(W.dtype.element_ty).to(tl.float32)
        u = acc2.to(W.dtype.element_ty).to(tl.float32)
        act = (g * tl.sigmoid(g)).to(W.dtype.element_ty).to(tl.float32)
        acc = act * u
    ymask = rmask[:, None] & cmask[None, :]
    yoffs = (pid_k * M + rows64)[:, None] * N + cols64[None, :]
    tl.store(Y + yoffs, acc.to(Y.dtype.element_ty), mask=ymask)


def launch(t: dict, x, weight, *, delta=None, ln=None, bias=None, out=None, x_out=None):
    """Launch the kernel with the tiles and flags of `t` (N, K, NDELTA, NORM, EPS, EPI, SPLIT_K, BLOCK_M,
    BLOCK_N, BLOCK_K, num_warps, num_stages) -> (y, x_out); unused pointers get the weight (never read)."""
    m, k = x.shape
    n, split, nd = t["N"], t["SPLIT_K"], t["NDELTA"]
    if out is None:
        shape = (split, m, n) if split > 1 else (m, n)
        out = torch.empty(shape, dtype=torch.float32 if split > 1 else x.dtype, device=x.device)
    args = (
        x,
        delta if nd else weight,
        ln if t["NORM"] else weight,
        weight,
        bias if t["EPI"] == EPI_BIAS else weight,
        out,
        x_out if nd else weight,
        m,
    )
    grid = (triton.cdiv(n, t["BLOCK_N"]), triton.cdiv(m, t["BLOCK_M"]), split)
    decode_linear_kernel[grid](*args, K=k, **t)
    return out, x_out


def policy(*, n: int, k: int, rows: int, ndelta: int, norm: bool, eps: float, epilogue: int) -> dict:
    """The tiles first tried (the sweep varies BLOCK_N, BLOCK_K, SPLIT_K and the stages around them)."""
    return dict(
        N=n, NDELTA=ndelta, NORM=norm, EPS=eps, EPI=epilogue, SPLIT_K=1,
        BLOCK_M=min(64, max(16, triton.next_power_of_2(rows))), BLOCK_N=16, BLOCK_K=128, num_warps=4, num_stages=4, TWO_PASS=False,
    )  # fmt: skip


def decode_linear_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    delta: torch.Tensor | None = None,
    ln: torch.Tensor | None = None,
    eps: float = 1e-6,
    bias: torch.Tensor | None = None,
    swiglu: bool = False,
    split_k: int = 1,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's function in PyTorch: (y, x) with x the summed residual (x itself without delta).
    y is (M, N), or (split_k, M, N) fp32 partials whose sum is the product (the first holds it all)."""
    xs = x.float()
    if delta is not None:
        xs = xs + delta.float().sum(0)
    new_x = xs.to(x.dtype)
    h = xs
    if ln is not None:
        h = xs * torch.rsqrt(xs.pow(2).mean(-1, keepdim=True) + eps) * ln.float()
    h = h.to(weight.dtype)
    if swiglu:
        gu = torch.nn.functional.linear(h, weight).float()
        g, u = gu.chunk(2, dim=-1)
        g = g.to(weight.dtype).float()
        act = (g * torch.sigmoid(g)).to(weight.dtype).float()
        y = act * u.to(weight.dtype).float()
    else:
        y = torch.nn.functional.linear(h, weight).float()
        if bias is not None:
            y = y + bias.float()
    if split_k > 1:
        parts = torch.zeros((split_k, *y.shape), dtype=torch.float32, device=y.device)
        parts[0] = y
        return parts, new_x
    return y.to(out_dtype or x.dtype), new_x


def graph_ms(fn, reps: int = 30) -> float:
    """Median ms of one replay of fn captured as a CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def variants(base: dict, kind: str, k: int) -> list[dict]:
    """Tile choices around the policy's."""
    out = [base]
    for bn in (16, 32, 64):
        for bk in (64, 128, 256):
            for split in (1, 2, 4) if kind in ("o", "down", "qkv_plain") else (1,):
                for stages in (3, 4):
                    for two in (False, True) if base["NORM"] else (False,):
                        t = {**base, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split, "num_stages": stages}
                        t["TWO_PASS"] = two
                        if k % (split * bk) == 0 and t not in out:
                            out.append(t)
    return out


def bench_shape(preset: str, kind: str, rows: int, layers: int, tune: bool) -> list[dict]:
    cfg = PRESETS[preset]
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    eps = cfg.get("rms_norm_eps", 1e-6)
    bias = cfg["model_type"] == "qwen2"
    dev, dt = "cuda", torch.bfloat16
    n, k, wn = {
        "qkv": (q + 2 * kv, h, q + 2 * kv),
        "qkv_plain": (q + 2 * kv, h, q + 2 * kv),
        "gate_up_plain": (inter, h, 2 * inter),
        "o": (h, q, h),
        "gate_up": (inter, h, 2 * inter),
        "down": (h, inter, h),
    }[kind]
    ws = [torch.randn(wn, k, device=dev, dtype=dt) / k**0.5 for _ in range(layers)]
    x = torch.randn(rows, k, device=dev, dtype=dt)
    res = torch.randn(rows, k, device=dev, dtype=dt)
    ln = (torch.rand(k, device=dev) + 0.5).to(dt)
    b = torch.randn(n, device=dev, dtype=dt) if (kind.startswith("qkv") and bias) else None
    norm = kind in ("qkv", "gate_up")

    def unfused():
        for w in ws:
            if norm:
                hh, _ = dispatch.add_rmsnorm(x, res, ln, eps)
            else:
                hh = x
            y = F.linear(hh, w, b)
            if kind.startswith("gate_up"):
                g, u = y.chunk(2, dim=-1)
                dispatch.swiglu(g, u)

    results = [{"provider": "unfused", "ms": graph_ms(unfused) / layers}]
    epi = EPI_SWIGLU if kind.startswith("gate_up") else (EPI_BIAS if b is not None else EPI_NONE)
    nd = 1 if norm else 0
    base = policy(n=n, k=k, rows=rows, ndelta=nd, norm=norm, eps=eps, epilogue=epi)
    ref, _ = decode_linear_reference(
        x, ws[0], delta=res[None] if nd else None, ln=ln if norm else None, eps=eps, bias=b, swiglu=epi == 2
    )
    xo = torch.empty_like(x)
    for key in variants(base, kind, k) if tune else [base]:
        outs = torch.empty(
            (key["SPLIT_K"], rows, n) if key["SPLIT_K"] > 1 else (rows, n),
            device=dev,
            dtype=torch.float32 if key["SPLIT_K"] > 1 else dt,
        )
        kw = dict(
            delta=res[None] if nd else None,
            ln=ln if norm else None,
            bias=b,
            out=outs,
            x_out=xo if nd else None,
        )
        try:
            y, _ = launch(key, x, ws[0], **kw)
            torch.cuda.synchronize()
        except Exception as e:  # a tile the card cannot run (shared memory): reported, skipped
            results.append({"provider": "fused", "tiles": _tiles(key), "error": str(e)[:120]})
            continue
        y = y.float().sum(0) if key["SPLIT_K"] > 1 else y.float()
        err = ((y - ref.float()).norm() / ref.float().norm()).item()

        def fused(key=key, kw=kw):
            for w in ws:
                launch(key, x, w, **kw)

        results.append(
            {
                "provider": "fused",
                "tiles": _tiles(key),
                "ms": graph_ms(fused) / layers,
                "rel_err": err,
                "policy": key == base,
            }
        )
    wbytes = wn * k * 2
    for r in results:
        if "ms" in r:
            r["weight_tb_s"] = wbytes / (r["ms"] * 1e-3) / 1e12
        r.update(model=preset, kind=kind, rows=rows, n=n, k=k)
    return results


def _tiles(key: dict) -> str:
    two = "/2pass" if key.get("TWO_PASS") else ""
    return (
        f"N{key['BLOCK_N']}/K{key['BLOCK_K']}/S{key['SPLIT_K']}/st{key['num_stages']}/M{key['BLOCK_M']}{two}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="qwen2.5-0.5b,qwen2.5-1.5b")
    ap.add_argument("--rows", default="1,16,128")
    ap.add_argument("--kinds", default="qkv,o,gate_up,down")
    ap.add_argument("--tune", action="store_true", help="sweep tiles around the policy's")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    configure(kernels="auto", device=torch.device("cuda"))
    out = {
        "card": torch.cuda.get_device_name(),
        "date": time.strftime("%Y-%m-%d"),
        "versions": {"torch": torch.__version__, "triton": triton.__version__},
        "command": "python3 benchmarks/decode_linear_bench.py " + " ".join(sys.argv[1:]),
        "rows": [],
    }
    for preset in a.models.split(","):
        layers = PRESETS[preset]["num_hidden_layers"]
        for kind in a.kinds.split(","):
            for rows in (int(r) for r in a.rows.split(",")):
                res = bench_shape(preset, kind, rows, layers, a.tune)
                out["rows"].extend(res)
                unf = res[0]["ms"]
                ok = [r for r in res[1:] if "ms" in r]
                best = min(ok, key=lambda r: r["ms"])
                pol = next(r for r in ok if r["policy"])
                print(
                    f"{preset:13} {kind:8} rows {rows:4}: unfused {unf * 1e3:6.1f} us | policy {pol['tiles']:22} "
                    f"{pol['ms'] * 1e3:6.1f} us ({pol['weight_tb_s']:.2f} TB/s, err {pol['rel_err']:.1e}) | "
                    f"best {best['tiles']:22} {best['ms'] * 1e3:6.1f} us",
                    flush=True,
                )
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
