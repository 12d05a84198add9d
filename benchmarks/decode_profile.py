"""Where a decode step's time goes: kernels per step, their durations, and the gaps between them.

    PYTHONPATH=src python3 benchmarks/decode_profile.py --models qwen2.5-0.5b,qwen2.5-1.5b \
        --batch 1,16,128 --json benchmarks/results/decode_profile.json

For each model and batch size: the decode engine's captured step (random weights at the preset's
shapes, bf16, prewarmed and sealed) is replayed alone (greedy, or sampled at --temperature), timed with
CUDA events (`step_ms`), then replayed under the profiler: every kernel of one step with its duration.
`kernel_ms` is the sum of the kernels' durations per step and `gap_ms` = step_ms - kernel_ms the time
between them (launch bubbles inside the graph; negative: kernels overlap under programmatic dependent
launch). `timeline` places each launch of a block on the step's critical path (what its end adds after
the previous launch's end; --timeline prints it). The floor is the step's bytes (every weight once, each
row's cache up to its context) over the copy bandwidth measured in the same run. Kernels are grouped by
name with their count and time per step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from collections import defaultdict
from pathlib import Path

import torch

from kdistill import decode as _decode
from kdistill.decode import DecodeEngine, Sampling
from kdistill.kernels import decode_attention, decode_gemv, seal
from kdistill.kernels._triton import cdiv
from kdistill.kernels.keys import make_key
from kdistill.models.hf_io import load_model

try:  # run as a script (benchmarks/ on sys.path) or as a module
    from generate_bench import build, copy_bandwidth, kv_bytes
    from kd_throughput import _argv_for_record
    from kd_throughput import _version as version
except ImportError:  # pragma: no cover
    from benchmarks.generate_bench import build, copy_bandwidth, kv_bytes
    from benchmarks.kd_throughput import _argv_for_record
    from benchmarks.kd_throughput import _version as version

from kdistill.generate import prepare_kernels

try:
    import l2_prefetch
except ImportError:  # pragma: no cover
    from benchmarks import l2_prefetch


def replay_ms(graph, reps: int) -> float:
    """Median ms of one replay over reps, timed with CUDA events around each replay."""
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        graph.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)


def _fold_name() -> str | int:
    """decode_gemv.FOLD_NORM as --fold-norm names it."""
    return "policy" if decode_gemv.FOLD_NORM is None else decode_gemv.FOLD_NORM


def burst_ms(graph, replays: int = 200) -> float:
    """Mean ms of a replay over `replays` back to back between two CUDA events: the steps' throughput as
    generation sees it (no host round trip between them, so no launch latency in it)."""
    graph.replay()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(replays):
        graph.replay()
    e.record()
    e.synchronize()
    return s.elapsed_time(e) / replays


def kernels_of(graph, steps: int) -> list[tuple[str, float, float, float]]:
    """(name, µs, start µs, end µs) of every kernel the profiler saw over `steps` replays, in the order
    they started."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            graph.replay()
        torch.cuda.synchronize()
    out = []
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and ev.device_time > 0:
            out.append((ev.name, float(ev.device_time), float(ev.time_range.start), float(ev.time_range.end)))
    out.sort(key=lambda k: k[2])
    return out


def timeline(ks: list[tuple[str, float, float, float]], steps: int, marker: str = "decode_attn") -> dict:
    """Each launch's place on the step's critical path, from the profiler's start and end times: a
    chained kernel may start before the previous one ends (programmatic dependent launch) but ends
    after it, so `delta` = its end - the previous kernel's end is what it adds to the step, and `placed` =
    its start - the previous kernel's end (negative: placed early). Averaged over the blocks between
    the first and last quarter of the step (a block: the launches from one `marker` kernel to the next)
    and over the replays: one row per launch of a block, in order."""
    per = len(ks) // steps
    rows: dict[int, dict[str, list[float]]] = {}
    names: dict[int, str] = {}
    for s in range(steps):
        step = ks[s * per : (s + 1) * per]
        marks = [i for i, k in enumerate(step) if marker in k[0]]
        if len(marks) < 4:
            return {}
        period = marks[1] - marks[0]
        lo, hi = marks[len(marks) // 4], marks[3 * len(marks) // 4]
        for i in range(lo, hi):
            pos = (i - marks[0]) % period
            name, dur, start, end = step[i]
            prev_end = step[i - 1][3]
            r = rows.setdefault(pos, {"duration": [], "placed": [], "delta": []})
            r["duration"].append(dur)
            r["placed"].append(start - prev_end)
            r["delta"].append(end - prev_end)
            names[pos] = name
    table = [
        {"launch": short(names[p]), **{k: statistics.mean(v) for k, v in rows[p].items()}}
        for p in sorted(rows)
    ]
    return {"block_us": sum(r["delta"] for r in table), "launches": table}


def short(name: str) -> str:
    return name if len(name) <= 60 else name[:57] + "..."


_FORWARD = _decode.forward_tokens  # the engine's forward, restored by --l2-prefetch off
_ENGINE_STEP = DecodeEngine._decode_step


def interleaved_step(groups: int):
    """An experiment in place of DecodeEngine._decode_step: the bucket's rows in `groups` equal groups,
    each group's blocks (DecodeEngine._step_hidden) launched on a stream of its own (forked from and
    joined to the step's stream, so one captured graph holds them all) so one group's latency-bound
    launches overlap another's, then the lm_head and the sampler over every row as the engine's step
    does. Each group runs the kernels of a bucket of batch / groups rows (chained as such a bucket is),
    which the plan of an engine of `batch` rows already holds."""
    import torch.nn.functional as F

    from kdistill import dispatch

    def step(self, st, u=None) -> None:
        if groups == 1 or st.batch % groups:
            return _ENGINE_STEP(self, st, u)
        n = st.batch // groups
        main = torch.cuda.current_stream(self.device)
        if getattr(self, "_group_streams", None) is None:
            self._group_streams = [torch.cuda.Stream(self.device) for _ in range(groups - 1)]
        streams = [main, *self._group_streams]
        for side in streams[1:]:
            side.wait_stream(main)  # the sampled tokens and lengths of the previous step
        parts = []
        for g, stream in enumerate(streams):
            with torch.cuda.stream(stream):
                parts.append(self._step_hidden(st, g * n, (g + 1) * n))
        for side in streams[1:]:
            main.wait_stream(side)
        h = torch.cat(parts)
        u = st.u if u is None else u
        dispatch.decode_sample(F.linear(h, self.weights.lm_head), u, self.sampling, self._rows(st))

    return step


def l2_probe(model, preset: str, batches: list[int]) -> list[dict]:
    """The mechanism alone (benchmarks/l2_prefetch.py): layer 0's gate/up and down products at each batch's
    rows, cold, prefetched and warm."""
    from kdistill import dispatch

    l2_prefetch.BLOCK = 32
    l2_prefetch.prefetch(torch.zeros(64, dtype=torch.uint8, device="cuda"))  # compiled before any capture
    eng = DecodeEngine(model, batch_size=1, max_len=8, sampling=Sampling(max_new_tokens=1))
    layer = eng.weights.layers[0]
    spec = model.spec
    out = []
    for b in batches:
        x = torch.randn((b, spec.hidden_size), device="cuda", dtype=torch.bfloat16)
        a = torch.randn((b, spec.intermediate_size), device="cuda", dtype=torch.bfloat16)
        for name, w, fn in (
            ("gate_up", layer.gate_up, lambda x=x: dispatch.decode_linear(x, layer.gate_up, gate_up=True)),
            ("down", layer.down, lambda a=a: dispatch.decode_linear(a, layer.down)),
        ):
            try:
                r = {"model": preset, "batch": b, "product": name, **l2_prefetch.probe(fn, w)}
            except Exception as e:  # an experiment: report and go on
                r = {"model": preset, "batch": b, "product": name, "error": f"{type(e).__name__}: {e}"}
            print(f"l2 probe: {r}", flush=True)
            out.append(r)
    del eng
    return out


def profile_one(engine: DecodeEngine, prompts: list[list[int]], reps: int) -> dict:
    engine.generate(prompts)  # capture and warm
    st = engine.slots
    assert st is not None and st.graph is not None, "the step was not captured"
    step = replay_ms(st.graph, reps)
    burst = burst_ms(st.graph)
    steps = 5
    ks = kernels_of(st.graph, steps)
    groups: dict[str, list[float]] = defaultdict(list)
    for name, us, _, _ in ks:
        groups[name].append(us)
    table = sorted(
        ({"kernel": n, "per_step": len(v) / steps, "us_per_step": sum(v) / steps} for n, v in groups.items()),
        key=lambda r: -r["us_per_step"],
    )
    kernel_ms = sum(k[1] for k in ks) / steps / 1e3
    return {
        "step_ms": step,
        "burst_ms": burst,
        "kernels_per_step": len(ks) / steps,
        "kernel_ms": kernel_ms,
        "gap_ms": step - kernel_ms,
        "kernels": table,
        "timeline": timeline(ks, steps),
    }


def tiles_key(
    base,
    *,
    pre_k: int | None = None,
    split: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    stages: int | None = None,
    warps: int | None = None,
    block_m: int | None = None,
    **params,
):
    """The matrix-vector kernel's key `base` with its tiles overridden (None: base's): K split over `split`
    programs (K_SPLIT rounded up to BLOCK_K), PRE_K at most the split's length rounded up to a power of
    two; `params` set as given (benchmarks/decode_products.py's variants too)."""
    p = dict(base.params)
    for name, v in (("BLOCK_N", block_n), ("BLOCK_K", block_k), ("BLOCK_M", block_m)):
        if v:
            p[name] = v
    if split:
        p["K_SPLIT"] = cdiv(cdiv(int(p["K"]), split), p["BLOCK_K"]) * p["BLOCK_K"]
        p["SPLIT"] = cdiv(int(p["K"]), p["K_SPLIT"])
    if pre_k or split:
        p["PRE_K"] = min(pre_k or p["PRE_K"], 1 << max(0, p["K_SPLIT"] - 1).bit_length())
    if stages:
        p["num_stages"] = stages
    if warps:
        p["num_warps"] = warps
    return make_key(base.op, base.arch, **{**p, **params})


_GEMV_KEY = decode_gemv.gemv_key
_GEMV_SPLIT = decode_gemv.split
_MAX_LONG_K = decode_gemv.MAX_LONG_K
# the policy's bucket limits (--narrow's defaults)
_LIMITS = (decode_gemv.NARROW, decode_gemv.LONG_ROWS, decode_gemv.WIDE_SWIGLU_ROWS, decode_gemv.NARROW_32)


def product_tiles(value: str, spec) -> None:
    """Put a block's products on the matrix-vector kernel at the tiles `value` names ('policy': the
    policy's and its cuBLAS limit), as PRODUCT=PRE_K:SPLIT:BLOCK_N[:BLOCK_K:num_stages:num_warps] joined
    by '+', PRODUCT one of qkv, o_proj, down, gate_up (at any width up to 16 rows: MAX_LONG_K lifted), through
    the key function every launch, the plan and the prewarm call."""
    decode_gemv.gemv_key, decode_gemv.split = _GEMV_KEY, _GEMV_SPLIT
    decode_gemv.MAX_LONG_K = _MAX_LONG_K
    if value == "policy":
        return
    shapes = {  # product -> (n, k) of a plain or biased product, or of the SwiGLU's (gate_up)
        "qkv": (spec.q_size + 2 * spec.kv_size, spec.hidden_size),
        "o_proj": (spec.hidden_size, spec.q_size),
        "down": (spec.hidden_size, spec.intermediate_size),
        "gate_up": (spec.intermediate_size, spec.hidden_size),
    }
    over: dict[tuple[int, int], list[int]] = {}
    for item in value.split("+"):
        name, tiles = item.split("=")
        pre, split, bn, *rest = (int(v) for v in tiles.split(":"))
        over[shapes[name]] = [pre, split, bn, *(rest + [128, 3, 4][len(rest) :])[:3]]
    decode_gemv.MAX_LONG_K = 1 << 30  # every plain product served up to 16 rows

    def key(arch, *, n, k, dtype, epilogue=decode_gemv.EPI_NONE, combine=True, rows=1, aligned=None, **fold):
        base = _GEMV_KEY(
            arch,
            n=n,
            k=k,
            dtype=dtype,
            epilogue=epilogue,
            combine=combine,
            rows=rows,
            aligned=aligned,
            **fold,
        )
        swiglu = epilogue == decode_gemv.EPI_SWIGLU
        if (n, k) not in over or swiglu != ((n, k) == shapes["gate_up"]) or fold:
            return base
        pre, split, bn, bk, stages, warps = over[(n, k)]
        return tiles_key(base, pre_k=pre, split=split, block_n=bn, block_k=bk, stages=stages, warps=warps)

    def split_of(n: int, k: int) -> int:  # the dispatcher's and the plan's: partials to the norm where split
        return key("sm_90", n=n, k=k, dtype="bf16")["SPLIT"] if (n, k) in over else _GEMV_SPLIT(n, k)

    decode_gemv.gemv_key, decode_gemv.split = key, split_of


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="qwen2.5-0.5b,qwen2.5-1.5b")
    ap.add_argument("--batch", default="1,16,128")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument(
        "--temperature", type=float, default=0.0, help="sample at this temperature (0: greedy, the default)"
    )
    ap.add_argument("--top", type=int, default=12, help="kernel groups printed per row")
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--gemv-tiles",
        default=None,
        help="tile experiment: PROGRAMS,PRE_K_PLAIN,PRE_K_SWIGLU[,MAX_PLAIN_K] overriding kernels/decode_gemv.py's "
        "policy for the 16-row tile (the plan, prewarm and launches all take it): the inputs loaded before the wait "
        "(PRE_K_SWIGLU at every width, PRE_K_WIDE_SWIGLU too); MAX_PLAIN_K: plain products of more inputs on cuBLAS "
        "(raise it to put a wide down product on the kernel)",
    )
    ap.add_argument(
        "--no-pdl",
        action="store_true",
        help="launch every kernel without programmatic dependent launch (each kernel's own duration)",
    )
    ap.add_argument(
        "--timeline",
        action="store_true",
        help="print each launch of a block with its duration, when it was placed and what it adds to the step",
    )
    ap.add_argument(
        "--attn-split",
        default=None,
        help="SPLIT[,BLOCK_N]: attention experiment, the keys a split of a step of at most WIDE_ROWS rows takes "
        "(kernels/decode_attention.py's split_len) and its tile's keys (default: the policy's for that split); a "
        "split holding the whole cache writes its output directly",
    )
    ap.add_argument(
        "--interleave",
        default=None,
        help="G[,G...]: experiment, each batch once per value: the step's rows in G groups whose blocks run on "
        "G streams of one graph (1: the engine's step); reports whether the greedy tokens equal the engine's",
    )
    ap.add_argument(
        "--attn-lanes",
        default=None,
        help="N[,N...]: attention experiment, each batch once per value: the parts the split kernel's combine "
        "reads back per round trip (key LANES; the policy: kernels/decode_attention.py's combine_lanes)",
    )
    ap.add_argument(
        "--l2-prefetch",
        default=None,
        help="V[,V...] with V off, mlp or all[@BLOCK]: experiment (benchmarks/l2_prefetch.py), each batch once per value: at "
        "each layer's attention a side stream of the captured step issues L2 prefetches over the layer's gate/up and "
        "down (mlp), also its o_proj and the next layer's q/k/v (all), BLOCK requests a program; first the mechanism alone (a product cold, "
        "prefetched, warm)",
    )
    ap.add_argument(
        "--attn-wide",
        default=None,
        help="SPLIT,BLOCK_N,STAGES: attention experiment, the tiles of a wide step's split (more than WIDE_ROWS "
        "rows; the policy: WIDE_SPLIT keys or the cache's own split if longer, 64-key tiles, three stages over "
        "caches of at most SHORT_CACHE slots, else two); '-' keeps a field's policy",
    )
    ap.add_argument(
        "--gemv-products",
        default=None,
        help="V[;V...]: block products' tiles on the matrix-vector kernel, each V 'policy' or "
        "PRODUCT=PRE_K:SPLIT:BLOCK_N[:BLOCK_K:num_stages:num_warps] joined by '+' (PRODUCT: qkv, o_proj, down; "
        "at any width up to 16 rows: MAX_LONG_K lifted); several: each batch size runs once per value, one after the other "
        "(an A/B in one process)",
    )
    ap.add_argument(
        "--fold-norm",
        default=None,
        help="V[,V...]: kernels/decode_gemv.py's FOLD_NORM (policy: the norms whose product before them is "
        "not split, 0: no norm folded into the products, 1: the norm after o_proj, 2: also the norm after the "
        "down); several: each batch size runs once per value, one after the other (an A/B in one process)",
    )
    ap.add_argument(
        "--narrow",
        default=None,
        help="V[,V...] with V NARROW[:LONG_ROWS[:WIDE_SWIGLU_ROWS[:NARROW_32]]][@PRODUCTS]: kernels/decode_gemv.py's "
        "NARROW (buckets of 17 to 64 rows on the matrix-vector kernel, and chained, where a product has a side of at "
        "most NARROW), LONG_ROWS (buckets up to which the long-K tile serves), WIDE_SWIGLU_ROWS (buckets up to which "
        "a SwiGLU of more than WIDE_SWIGLU_K inputs is served), NARROW_32 (the side up to which buckets of 17 to 32 "
        "rows are served; 0: none beyond NARROW) and --gemv-products' tiles (a field left out: the policy's); "
        "several: each batch size runs once per value (an A/B in one process; replaces --gemv-products and "
        "--fold-norm)",
    )
    ap.add_argument(
        "--row-tiles",
        default=None,
        help="V[,V...] with V MAX[:PRE_SWIGLU[:PRE_PLAIN]][@PRODUCTS]: kernels/decode_gemv.py's largest row tile "
        "(64: the policy; 128: buckets of 65 to 128 rows of a narrow model's products on the matrix-vector kernel "
        "in one tile, its step chained), the inputs loaded before the wait in tiles past 64 rows by the SwiGLU "
        "(default 64) and the plain products (default 128: a 128-row tile of 1,024 takes 396 KB of shared memory) "
        "and --gemv-products' tiles; several: each batch size runs once per value (an A/B in one process)",
    )
    a = ap.parse_args()
    if a.no_pdl:
        from kdistill.kernels import rmsnorm

        for mod in (decode_attention, decode_gemv, rmsnorm):
            mod.pdl = lambda arch: False
    if a.attn_split:
        split, *block_n = (int(v) for v in a.attn_split.split(","))
        policy = decode_attention.tiles

        def tiles(head_dim, q_heads, kv_heads, max_len=256, split_min=0):
            t = policy(head_dim, q_heads, kv_heads, max_len, split_min)
            if split_min < decode_attention.WIDE_SPLIT:  # a step of at most WIDE_ROWS rows
                t["SPLIT"] = split
                one_tile = split == 128 and head_dim <= decode_attention.ONE_TILE_HEAD  # the policy's rule
                t["BLOCK_N"] = block_n[0] if block_n else (128 if one_tile else 64)
            return t

        decode_attention.tiles = tiles
    if a.attn_wide:
        fields = [None if v == "-" else int(v) for v in a.attn_wide.split(",")]
        fields += [None] * (3 - len(fields))
        wide_policy = decode_attention.tiles

        def wide_tiles(head_dim, q_heads, kv_heads, max_len=256, split_min=0):
            t = wide_policy(head_dim, q_heads, kv_heads, max_len, split_min)
            if split_min >= decode_attention.WIDE_SPLIT:  # a wide step
                for name, v in zip(("SPLIT", "BLOCK_N", "num_stages"), fields, strict=True):
                    if v is not None:
                        t[name] = v
            return t

        decode_attention.tiles = wide_tiles
    if a.gemv_tiles:
        programs, pre_plain, pre_swiglu, *max_k = (int(v) for v in a.gemv_tiles.split(","))
        decode_gemv.PROGRAMS = programs
        decode_gemv.PRE_K.update({0: pre_plain, 1: pre_plain, 2: pre_swiglu})  # the 16-row tile's
        decode_gemv.PRE_K_WIDE_SWIGLU = pre_swiglu
        if max_k:
            decode_gemv.MAX_PLAIN_K = max_k[0]
    dev = torch.device("cuda")
    bw = copy_bandwidth()
    result = {
        "argv": _argv_for_record(),
        "device": torch.cuda.get_device_name(),
        "versions": {
            "torch": torch.__version__,
            "triton": version("triton"),
            "transformers": version("transformers"),
        },
        "copy_bandwidth_tb_s": bw / 1e12,
        "rows": [],
    }
    for preset in a.models.split(","):
        tmp = Path(tempfile.mkdtemp())
        d = build(preset, tmp / preset, False, dev)
        model = load_model(d, dev, torch.bfloat16).eval()
        spec = model.spec
        batches = [int(b) for b in a.batch.split(",")]
        max_len = a.prompt + a.new
        info = prepare_kernels(model, max(batches), a.prompt, max_len)
        print(f"{preset}: {info.get('prewarm', info)}", flush=True)
        g = torch.Generator().manual_seed(1)
        variants = [None] if a.gemv_products is None else a.gemv_products.split(";")
        if a.fold_norm is not None:  # each products value once per FOLD_NORM value
            levels = [None if f == "policy" else int(f) for f in a.fold_norm.split(",")]
            variants = [(t, f) for t in variants for f in levels]
        if a.narrow is not None:  # each batch once per bucket-limits value
            variants = [("narrow", v) for v in a.narrow.split(",")]
        if a.row_tiles is not None:  # each batch once per largest row tile
            variants = [("rowtiles", v) for v in a.row_tiles.split(",")]
        if a.interleave is not None:  # each batch once per number of groups
            variants = [("interleave", int(v)) for v in a.interleave.split(",")]
        if a.attn_lanes is not None:  # each batch once per number of lanes
            variants = [("lanes", int(v)) for v in a.attn_lanes.split(",")]
        if a.l2_prefetch is not None:  # each batch once per prefetch value, after the mechanism alone
            variants = [("l2", v) for v in a.l2_prefetch.split(",")]
            result.setdefault("l2_probe", []).extend(l2_probe(model, preset, batches))
        for b in batches:
            prompts = torch.randint(100, spec.vocab_size - 100, (b, a.prompt), generator=g).tolist()
            for tiles in variants:
                if isinstance(tiles, tuple) and tiles[0] == "lanes":
                    decode_attention.combine_lanes = lambda *_, n=tiles[1]: n
                    decode_attention.split_key.cache_clear()
                    tiles = f"lanes {tiles[1]}"
                    info = prepare_kernels(model, max(batches), a.prompt, max_len)
                    print(f"{preset} ({tiles}): {info.get('prewarm', info)}", flush=True)
                elif isinstance(tiles, tuple) and tiles[0] == "l2":
                    which, _, block = tiles[1].partition("@")
                    l2_prefetch.BLOCK = int(block or 32)
                    _decode.forward_tokens = (
                        _FORWARD if which == "off" else l2_prefetch.SidePrefetch(which).wrap(_FORWARD)
                    )
                    tiles = f"l2 {tiles[1]}"
                elif isinstance(tiles, tuple) and tiles[0] == "interleave":
                    DecodeEngine._decode_step = interleaved_step(tiles[1])
                    tiles = f"interleave {tiles[1]}"
                elif isinstance(tiles, tuple) and tiles[0] == "rowtiles":
                    limits, _, prods = tiles[1].partition("@")
                    vals = [int(v) for v in limits.split(":")]
                    top, pre_swiglu, pre_plain = vals + [64, 128][len(vals) - 1 :]
                    decode_gemv.ROW_TILES = tuple(t for t in (16, 32, 64, 128, 256) if t <= top)
                    decode_gemv.MAX_ROWS = top
                    for t in decode_gemv.ROW_TILES[3:]:  # past 64 rows: both prefetch depths as given
                        decode_gemv.PRE_K_TILE[t] = {0: pre_plain, 1: pre_plain, 2: pre_swiglu}
                    product_tiles(prods or "policy", spec)
                    _GEMV_KEY.cache_clear()
                    tiles = f"row tiles {tiles[1]}"
                    info = prepare_kernels(model, max(batches), a.prompt, max_len)
                    print(f"{preset} ({tiles}): {info.get('prewarm', info)}", flush=True)
                elif isinstance(tiles, tuple) and tiles[0] == "narrow":
                    limits, _, prods = tiles[1].partition("@")
                    given = [int(v) for v in limits.split(":")]
                    (
                        decode_gemv.NARROW,
                        decode_gemv.LONG_ROWS,
                        decode_gemv.WIDE_SWIGLU_ROWS,
                        decode_gemv.NARROW_32,
                    ) = given + list(_LIMITS[len(given) :])
                    product_tiles(prods or "policy", spec)
                    tiles = f"narrow {tiles[1]}"
                    info = prepare_kernels(model, max(batches), a.prompt, max_len)
                    print(f"{preset} ({tiles}): {info.get('prewarm', info)}", flush=True)
                elif isinstance(tiles, tuple):
                    tiles, decode_gemv.FOLD_NORM = tiles
                    product_tiles(tiles or "policy", spec)
                    info = prepare_kernels(model, max(batches), a.prompt, max_len)
                    print(f"{preset} (fold {_fold_name()}): {info.get('prewarm', info)}", flush=True)
                elif tiles is not None:  # other keys: plan, prewarm, seal again
                    product_tiles(tiles, spec)
                    info = prepare_kernels(model, max(batches), a.prompt, max_len)
                    print(f"{preset} ({tiles}): {info.get('prewarm', info)}", flush=True)
                s = Sampling(max_new_tokens=a.new, temperature=a.temperature)
                eng = DecodeEngine(model, batch_size=b, max_len=max_len, sampling=s)
                row = {
                    "model": preset,
                    "batch": b,
                    "temperature": a.temperature,
                    **({} if tiles is None else {"products": tiles}),
                    **({} if a.fold_norm is None else {"fold_norm": _fold_name()}),
                    **profile_one(eng, prompts, a.reps),
                }
                floor = (eng.weights.nbytes() + kv_bytes(spec, b, a.prompt + a.new)) / bw
                row["floor_ms"] = floor * 1e3
                row["floor_fraction"] = floor * 1e3 / row["step_ms"]
                row["jit_after_prewarm"] = seal.jit_after_prewarm()
                if a.interleave is not None:  # its tokens against the engine's own step (both captured)
                    got = eng.generate(prompts)
                    DecodeEngine._decode_step = _ENGINE_STEP
                    want = DecodeEngine(model, batch_size=b, max_len=max_len, sampling=s).generate(prompts)
                    row["same_tokens_as_engine"] = got == want
                    print(
                        f"{preset} batch {b} ({tiles}): tokens equal the engine's: {got == want}", flush=True
                    )
                result["rows"].append(row)
                print(
                    f"\n{preset} batch {b}{'' if tiles is None else f' ({tiles})'}"
                    f"{'' if a.fold_norm is None else f' (fold {_fold_name()})'}: step {row['step_ms']:.3f} ms, floor {row['floor_ms']:.3f} ms "
                    f"({row['floor_fraction']:.0%}), back to back {row['burst_ms']:.3f} ms, {row['kernels_per_step']:.0f} kernels, "
                    f"kernels {row['kernel_ms']:.3f} ms, gaps {row['gap_ms']:.3f} ms, "
                    f"jit_after_prewarm {row['jit_after_prewarm']}",
                    flush=True,
                )
                for k in row["kernels"][: a.top]:
                    print(f"  {k['per_step']:6.1f} x  {k['us_per_step']:8.1f} us  {short(k['kernel'])}")
                tl_ = row["timeline"]
                if a.timeline and tl_:
                    print(
                        f"  a block on the critical path: {tl_['block_us']:.2f} us (duration / placed / delta, us)"
                    )
                    for r in tl_["launches"]:
                        print(f"    {r['duration']:7.2f} {r['placed']:7.2f} {r['delta']:7.2f}  {r['launch']}")
                del eng
                torch.cuda.empty_cache()
        del model
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
