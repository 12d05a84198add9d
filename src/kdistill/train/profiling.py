"""runtime.profile_steps: torch.profiler over a few training steps, summarised per process.

    prof = StepProfiler(window=range(3, 5), device=device, out_dir=run_dir / "profile", rank=0, world=1)
    prof.begin(step + 1)               # starts the profiler before the window's first step
    ...train one step...
    prof.end(step, seconds)            # True for a profiled step; after the last one: write the files
    prof.close()                       # the loop ended (an interrupted window is dropped, nothing written)

Every process (every torchrun rank) writes `profile/rank{R}.txt` and `profile/rank{R}.json` into the run
directory: wall time per profiled step, device time per step, kernel groups, the top kernels and the
exposed collective time. No Chrome trace is written: N steps of a sharded run make a trace of tens to
hundreds of MB per rank, and the tables hold what the profile is for.

The pure parts take kernels as (name, start_us, end_us) tuples, so they are tested without a GPU:

    kernel_group("ncclDevKernel_AllGather_RING_LL")               # "collectives"
    exposed_collective_us([("nccl_x", 0, 10), ("gemm", 2, 5)])    # 7.0
"""

from __future__ import annotations

import dataclasses
import heapq
import logging
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from kdistill.fileio import atomic_write_json, atomic_write_text

log = logging.getLogger("kdistill")

Kernel = tuple[str, float, float]  # (name, start_us, end_us) of one device event

# Kernel groups in table order; the first group whose rule matches a name wins (attention before GEMM:
# flash and fmha kernels carry cutlass in their names; collectives first: NCCL's names say nothing else).
GROUPS = ("collectives", "attention", "GEMM", "optimizer", "Triton kernels", "copy/elementwise", "other")
_GROUP_WORDS: dict[str, tuple[str, ...]] = {
    "collectives": ("nccl",),
    "attention": ("flash", "fmha", "cudnn", "sdpa", "attention"),
    "GEMM": ("gemm", "nvjet", "cutlass", "xmma", "cublas", "matmul"),
    "optimizer": ("adam", "foreach", "multi_tensor"),
}
_COPY_WORDS = ("elementwise", "copy", "reduce", "fill", "cat")
# Device activities that are work on the GPU; others (gpu_user_annotation spans that record_function,
# FSDP among them, puts on the device timeline) are left out.
_DEVICE_WORK = ("kernel", "gpu_memcpy", "gpu_memset")
TOP_KERNELS = 30
TOP_CPU_OPS = 15
IDLE_GAP_US = 10.0  # a stretch of at least this long with no device work counts as an idle gap
TOP_IDLE = 15  # rows of the idle table: (phase, host op) pairs by idle time
TOP_LAUNCHERS = 3  # host chains listed under each top kernel (the ones that launched most of its time)
# The training loop's phases as record_function ranges (on-policy steps: generate, score, update); a gap
# is charged to the phase range that holds its midpoint.
PHASE_PREFIX = "kdistill."
HostSpan = tuple[str, float, float]  # (name, start_us, end_us) of one host op or annotation


def kernel_group(name: str) -> str:
    """The group a device kernel's name falls in (one of GROUPS)."""
    low = name.lower()
    for group, words in _GROUP_WORDS.items():
        if any(w in low for w in words):
            return group
    if low.endswith("_kernel") and not low.startswith("void at::"):
        return "Triton kernels"
    if low.startswith(("memcpy", "memset")) or ("at::native" in low and any(w in low for w in _COPY_WORDS)):
        return "copy/elementwise"
    return "other"


def _is_copy_engine(name: str) -> bool:
    """A memcpy or memset: it runs on a copy engine beside the SMs, so it hides no collective."""
    return name.lower().startswith(("memcpy", "memset"))


def merge_intervals(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of [start, end) intervals as sorted, disjoint intervals (empty ones dropped)."""
    out: list[tuple[float, float]] = []
    for start, end in sorted((s, e) for s, e in intervals if e > s):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def union_length(intervals: Iterable[tuple[float, float]]) -> float:
    """Total length covered by the intervals, overlaps counted once."""
    return sum(e - s for s, e in merge_intervals(intervals))


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length of the intersection of two merged (sorted, disjoint) interval lists."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            total += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def exposed_collective_us(kernels: Iterable[Kernel]) -> float:
    """Time (µs) in which a collective kernel runs and no other kernel runs, for kernels of one device.

    The union of the collectives' intervals minus the union of every other kernel's intervals (memcpy
    and memset excluded: they do not occupy the SMs). A collective that overlaps compute on another
    stream is hidden; one that runs alone, or waits alone for a slower rank, is exposed.
    """
    coll: list[tuple[float, float]] = []
    comp: list[tuple[float, float]] = []
    for name, start, end in kernels:
        if kernel_group(name) == "collectives":
            coll.append((start, end))
        elif not _is_copy_engine(name):
            comp.append((start, end))
    merged = merge_intervals(coll)
    return sum(e - s for s, e in merged) - _overlap(merged, merge_intervals(comp))


def idle_gaps(kernels: Iterable[Kernel], min_us: float = IDLE_GAP_US) -> list[tuple[float, float]]:
    """The stretches of at least `min_us` between one device's work (kernels, memcpys, memsets) in which
    none runs, as sorted [start, end) intervals; before the first and after the last are not counted."""
    merged = merge_intervals((s, e) for _, s, e in kernels)
    return [(a[1], b[0]) for a, b in zip(merged, merged[1:]) if b[0] - a[1] >= min_us]


@dataclasses.dataclass(frozen=True)
class GapHost:
    """What the host was doing at an idle gap's midpoint: the innermost PHASE_PREFIX range that holds it
    (its name without the prefix, "-" where none) and how far into that range and into the outermost
    such range (the step) the gap began, in µs; the outermost and innermost other host spans that hold
    it ("-" where none: the host ran Python between ops)."""

    phase: str = "-"
    outer: str = "-"
    inner: str = "-"
    into_phase_us: float = 0.0
    into_step_us: float = 0.0


def host_at(gaps: Sequence[tuple[float, float]], spans: Iterable[HostSpan]) -> list[GapHost]:
    """For each gap, the host at its midpoint (GapHost). One sweep over the spans sorted by start."""
    order = sorted(spans, key=lambda sp: sp[1])
    mids = sorted(range(len(gaps)), key=lambda i: gaps[i][0] + gaps[i][1])
    out = [GapHost()] * len(gaps)
    live: list[tuple[float, int]] = []  # (end, index into order) of the spans started by now
    j = 0
    for i in mids:
        t = (gaps[i][0] + gaps[i][1]) / 2
        while j < len(order) and order[j][1] <= t:
            heapq.heappush(live, (order[j][2], j))
            j += 1
        while live and live[0][0] < t:
            heapq.heappop(live)
        holding = sorted((order[k] for _, k in live), key=lambda sp: sp[2] - sp[1])  # innermost first
        phases = [sp for sp in holding if sp[0].startswith(PHASE_PREFIX)]
        ops = [sp for sp in holding if not sp[0].startswith(PHASE_PREFIX)]
        if not phases and not ops:
            continue
        out[i] = GapHost(
            phase=phases[0][0][len(PHASE_PREFIX) :] if phases else "-",
            outer=ops[-1][0] if ops else "-",
            inner=ops[0][0] if ops else "-",
            into_phase_us=gaps[i][0] - phases[0][1] if phases else 0.0,
            into_step_us=gaps[i][0] - phases[-1][1] if phases else 0.0,
        )
    return out


Launcher = tuple[str, str, str, str]  # (phase, outer op, inner op, the inner op's input shapes or "")
# Launches per kernel name: host chain -> [device µs, launches]
Launches = dict[str, dict[Launcher, list[float]]]


def _is_runtime(name: str) -> bool:
    """A CUDA runtime or driver call (cudaLaunchKernel, cudaGraphLaunch, cuLaunchKernelEx, ...): `cuda`
    then a capital, or `cu` then a capital."""
    return name[4:5].isupper() if name.startswith("cuda") else name.startswith("cu") and name[2:3].isupper()


def launcher_of(event: Any) -> Launcher:
    """The host chain of an event that launched device work (a runtime call, through its cpu_parent
    links): the innermost PHASE_PREFIX range (without the prefix; "-" where none), the outermost op and
    the innermost op that is not a runtime call (the call itself where there is none), and that op's
    input shapes where the profiler recorded them."""
    chain = []
    e = event
    while e is not None:
        chain.append(e)
        e = getattr(e, "cpu_parent", None)
    phases = [c.name for c in chain if c.name.startswith(PHASE_PREFIX)]
    ops = [c for c in chain if not c.name.startswith(PHASE_PREFIX)]
    named = [c for c in ops if not _is_runtime(c.name)] or ops[:1]
    inner = named[0] if named else None
    shapes = getattr(inner, "input_shapes", None) or []
    return (
        phases[0][len(PHASE_PREFIX) :] if phases else "-",
        named[-1].name if named else "-",
        inner.name if inner is not None else "-",
        str([list(x) if isinstance(x, (list, tuple)) else x for x in shapes]) if any(shapes) else "",
    )


def kernel_launches(events: Iterable[Any], device_index: int | None = None) -> Launches:
    """For every kernel name, the host chains (launcher_of) that launched it with their device time and
    launch counts, from the host events that carry their kernels (a profiler's FunctionEvents: a runtime
    call's `kernels`, each (name, device, duration_us)), on `device_index` when given."""
    out: Launches = {}
    for e in events:
        if getattr(e, "device_type", None) != DeviceType.CPU or not getattr(e, "kernels", None):
            continue
        where: Launcher | None = None
        for k in e.kernels:
            if device_index is not None and k.device != device_index:
                continue
            where = where or launcher_of(e)
            r = out.setdefault(k.name, {}).setdefault(where, [0.0, 0])
            r[0] += float(k.duration)
            r[1] += 1
    return out


def idle_table(
    kernels: Sequence[Kernel], spans: Iterable[HostSpan], n_steps: int, min_us: float = IDLE_GAP_US
) -> dict[str, Any]:
    """Where the device waited for the host over the window, per step: the idle gaps' count and time,
    their time by phase, and the TOP_IDLE (phase, outer op, inner op) rows by idle time."""
    gaps = idle_gaps(kernels, min_us)
    ms = 1e-3 / max(n_steps, 1)
    by_phase: dict[str, float] = {}
    rows: dict[tuple[str, str, str], list[float]] = {}
    hosts = host_at(gaps, spans)
    for (start, end), h in zip(gaps, hosts):
        by_phase[h.phase] = by_phase.get(h.phase, 0.0) + (end - start)
        r = rows.setdefault((h.phase, h.outer, h.inner), [0.0, 0, 0.0])
        r[0] += end - start
        r[1] += 1
        r[2] = max(r[2], end - start)
    top = sorted(rows.items(), key=lambda kv: -kv[1][0])[:TOP_IDLE]
    longest = sorted(range(len(gaps)), key=lambda i: gaps[i][0] - gaps[i][1])[:TOP_IDLE]
    return {
        "min_gap_us": min_us,
        "gaps_per_step": round(len(gaps) / max(n_steps, 1), 2),
        "idle_ms_per_step": round(sum(e - s for s, e in gaps) * ms, 3),
        "by_phase_ms_per_step": {
            k: round(v * ms, 3) for k, v in sorted(by_phase.items(), key=lambda kv: -kv[1])
        },
        "top": [
            {
                "phase": phase,
                "host_outer": outer,
                "host_inner": inner,
                "ms_per_step": round(t * ms, 3),
                "gaps_per_step": round(c / max(n_steps, 1), 2),
                "longest_us": round(worst, 1),
            }
            for (phase, outer, inner), (t, c, worst) in top
        ],
        "longest": [  # the window's longest gaps one by one, each placed in its phase and step
            {
                "us": round(gaps[i][1] - gaps[i][0], 1),
                "phase": hosts[i].phase,
                "host_outer": hosts[i].outer,
                "host_inner": hosts[i].inner,
                "into_phase_ms": round(hosts[i].into_phase_us / 1e3, 3),
                "into_step_ms": round(hosts[i].into_step_us / 1e3, 3),
            }
            for i in longest
        ],
    }


def summarize(
    kernels: Sequence[Kernel],
    step_seconds: Sequence[float],
    steps: Sequence[int],
    cpu_ops: Sequence[tuple[str, float, int]] = (),
    meta: dict[str, Any] | None = None,
    host_spans: Iterable[HostSpan] = (),
    launches: Launches | None = None,
) -> dict[str, Any]:
    """The profile report (rank{R}.json) from one device's kernels over the profiled steps.

    Args:
        kernels: (name, start_us, end_us) of every device kernel, memcpy and memset of the window.
        step_seconds: wall time of each profiled step (synchronised at its end on a GPU).
        steps: the profiled steps' numbers (1-based, as in metrics.jsonl).
        cpu_ops: (name, self CPU µs, calls) over the window, for the top CPU ops table.
        meta: added first (rank, world, device, versions).
        host_spans: (name, start_us, end_us) of the host's ops and annotations over the window, on the
            kernels' clock: the idle table's (`idle_table`) host side.
        launches: which host chains launched each kernel (kernel_launches): the top kernels list the
            TOP_LAUNCHERS chains with most of their time.

    Per-step numbers are means over the window: totals divided by the number of steps.
    """
    n = max(len(steps), 1)
    ms = 1e-3 / n  # µs over the window -> ms per step
    groups = {g: [0.0, 0] for g in GROUPS}
    by_name: dict[str, list[float]] = {}
    for name, start, end in kernels:
        dur = max(end - start, 0.0)
        g = groups[kernel_group(name)]
        g[0] += dur
        g[1] += 1
        k = by_name.setdefault(name, [0.0, 0])
        k[0] += dur
        k[1] += 1
    device_us = sum(g[0] for g in groups.values())
    coll_us = groups["collectives"][0]
    exposed_us = exposed_collective_us(kernels)
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:TOP_KERNELS]
    wall = [s * 1e3 for s in step_seconds]
    report: dict[str, Any] = dict(meta or {})
    report.update(
        {
            "steps": list(steps),
            "step_ms": [round(x, 3) for x in wall],
            "step_ms_mean": round(sum(wall) / len(wall), 3) if wall else None,
            "kernel_ms_per_step": round(device_us * ms, 3),
            "device_busy_ms_per_step": round(union_length((s, e) for _, s, e in kernels) * ms, 3),
            "collective_ms_per_step": round(coll_us * ms, 3),
            "exposed_collective_ms_per_step": round(exposed_us * ms, 3),
            "groups": [
                {
                    "group": g,
                    "ms_per_step": round(t * ms, 3),
                    "launches_per_step": round(c / n, 2),
                    "share": round(t / device_us, 4) if device_us else 0.0,
                }
                for g, (t, c) in groups.items()
            ],
            "top_kernels": [
                {
                    "name": name,
                    "group": kernel_group(name),
                    "ms_per_step": round(t * ms, 3),
                    "launches_per_step": round(c / n, 2),
                    "mean_us": round(t / c, 2) if c else 0.0,
                    **(_launched_by(launches.get(name, {}), t, ms, n) if launches else {}),
                }
                for name, (t, c) in top
            ],
            "top_cpu_ops": [
                {"name": name, "self_ms_per_step": round(us * ms, 3), "calls_per_step": round(c / n, 2)}
                for name, us, c in sorted(cpu_ops, key=lambda o: -o[1])[:TOP_CPU_OPS]
            ],
            "idle": idle_table(kernels, host_spans, n),
        }
    )
    return report


def _launched_by(chains: dict[Launcher, list[float]], total_us: float, ms: float, n: int) -> dict[str, Any]:
    """A top kernel's TOP_LAUNCHERS host chains by device time, per step, and its time linked to no host
    call (`unlinked_ms_per_step`: the profiler links a CUDA graph's replayed kernels to none)."""
    rows = sorted(chains.items(), key=lambda kv: -kv[1][0])[:TOP_LAUNCHERS]
    linked = sum(t for t, _ in chains.values())
    return {
        "launched_by": [
            {
                "phase": phase,
                "host_outer": outer,
                "host_inner": inner,
                **({"shapes": shapes} if shapes else {}),
                "ms_per_step": round(t * ms, 3),
                "launches_per_step": round(c / n, 2),
            }
            for (phase, outer, inner, shapes), (t, c) in rows
        ],
        "unlinked_ms_per_step": round(max(total_us - linked, 0.0) * ms, 3),
    }


def _cut(name: str, width: int) -> str:
    return name if len(name) <= width else name[: width - 3] + "..."


def render_text(report: dict[str, Any]) -> str:
    """rank{R}.txt: the report as tables for reading."""
    steps = report["steps"]
    span = f"steps {steps[0]}-{steps[-1]}" if len(steps) > 1 else f"step {steps[0]}"
    walls = ", ".join(f"{x:.1f}" for x in report["step_ms"])
    lines = [
        f"kdistill profile: rank {report.get('rank', 0)} of {report.get('world', 1)}, "
        f"{report.get('device', '?')}, {span}, torch {report.get('torch', '?')}",
        "per-step numbers are means over the profiled steps; device times are this process's GPU"
        + ("" if report["top_kernels"] else " (none here: a CPU run)"),
        "",
        f"wall time per step            {report['step_ms_mean']:10.3f} ms   (each step: {walls})",
        f"device time per step          {report['kernel_ms_per_step']:10.3f} ms   (kernels, memcpy, memset: summed)",
        f"device busy per step          {report['device_busy_ms_per_step']:10.3f} ms   (some kernel or copy running)",
        f"collectives per step          {report['collective_ms_per_step']:10.3f} ms",
        f"exposed collectives per step  {report['exposed_collective_ms_per_step']:10.3f} ms   "
        "(a collective running and no other kernel)",
        "",
        f"{'kernel group':<18} {'ms/step':>10} {'launches/step':>14} {'share':>7}",
    ]
    for g in report["groups"]:
        lines.append(
            f"{g['group']:<18} {g['ms_per_step']:10.3f} {g['launches_per_step']:14.2f} {g['share'] * 100:6.1f}%"
        )
    lines += ["", f"top {TOP_KERNELS} kernels by device time"]
    lines.append(f"{'ms/step':>10} {'launches/step':>14} {'mean us':>10}  {'group':<17} name")
    lines.append(f"{'':>10} {'launches/step':>14} {'ms/step':>10}  <- phase: the host ops that launched it")
    for k in report["top_kernels"]:
        lines.append(
            f"{k['ms_per_step']:10.3f} {k['launches_per_step']:14.2f} {k['mean_us']:10.2f}  "
            f"{k['group']:<17} {_cut(k['name'], 160)}"
        )
        for r in k.get("launched_by", []):
            shapes = f" {r['shapes']}" if r.get("shapes") else ""
            lines.append(
                f"{'':>10} {r['launches_per_step']:14.2f} {r['ms_per_step']:10.3f}  "
                f"<- {r['phase']}: {_cut(_host_where(r) + shapes, 150)}"
            )
        if k.get("unlinked_ms_per_step", 0) >= 0.001:
            lines.append(
                f"{'':>10} {'':>14} {k['unlinked_ms_per_step']:10.3f}  <- no host call linked "
                "(replayed from a CUDA graph: profile with runtime.cuda_graphs=off to name it)"
            )
    if not report["top_kernels"]:
        lines.append("  (none: no GPU in this run)")
    lines += ["", f"top {TOP_CPU_OPS} CPU ops by self time"]
    lines.append(f"{'ms/step':>10} {'calls/step':>14}  name")
    for o in report["top_cpu_ops"]:
        lines.append(f"{o['self_ms_per_step']:10.3f} {o['calls_per_step']:14.2f}  {_cut(o['name'], 160)}")
    idle = report.get("idle")
    if idle and idle["gaps_per_step"]:
        phases = ", ".join(f"{k} {v:.3f}" for k, v in idle["by_phase_ms_per_step"].items())
        lines += [
            "",
            f"device idle per step: {idle['idle_ms_per_step']:.3f} ms in {idle['gaps_per_step']:.1f} gaps of "
            f">= {idle['min_gap_us']:g} us (by phase, ms: {phases})",
            f"{'ms/step':>10} {'gaps/step':>10} {'longest us':>11}  {'phase':<10} host op at the gap (outer > inner)",
        ]
        for r in idle["top"]:
            lines.append(
                f"{r['ms_per_step']:10.3f} {r['gaps_per_step']:10.2f} {r['longest_us']:11.1f}  {r['phase']:<10} "
                f"{_cut(_host_where(r), 150)}"
            )
        lines += [
            "",
            "longest gaps",
            f"{'us':>10} {'into phase ms':>14} {'into step ms':>13}  {'phase':<10} host op",
        ]
        for g in idle.get("longest", []):
            lines.append(
                f"{g['us']:10.1f} {g['into_phase_ms']:14.3f} {g['into_step_ms']:13.3f}  {g['phase']:<10} "
                f"{_cut(_host_where(g), 120)}"
            )
    return "\n".join(lines) + "\n"


def _host_where(row: dict[str, Any]) -> str:
    """An idle row's host ops as printed: `outer > inner`, or the one name where they are the same."""
    outer, inner = row["host_outer"], row["host_inner"]
    return outer if outer == inner else f"{outer} > {inner}"


def host_spans(events: Iterable[Any]) -> list[HostSpan]:
    """(name, start_us, end_us) of the host's ops, runtime calls and annotations among a profiler's
    FunctionEvents: the idle table's host side."""
    return [
        (e.name, float(e.time_range.start), float(e.time_range.end))
        for e in events
        if e.device_type == DeviceType.CPU
    ]


def device_kernels(events: Iterable[Any], device_index: int | None = None) -> list[Kernel]:
    """(name, start_us, end_us) of the device work among a profiler's FunctionEvents (`prof.events()`):
    CUDA events that are kernels, memcpys or memsets (not user-annotation spans), on `device_index`
    when given."""
    out: list[Kernel] = []
    for e in events:
        if e.device_type != DeviceType.CUDA:
            continue
        activity = getattr(e, "activity_type", None)  # newer torch names the kineto activity
        if activity is not None and activity not in _DEVICE_WORK:
            continue
        if activity is None and getattr(e, "is_user_annotation", False):
            continue
        if device_index is not None and e.device_index != device_index:
            continue
        out.append((e.name, float(e.time_range.start), float(e.time_range.end)))
    return out


def _cpu_ops(prof: profile) -> list[tuple[str, float, int]]:
    """(name, self CPU µs, calls) of the CPU ops over the window."""
    return [
        (a.key, float(a.self_cpu_time_total), int(a.count))
        for a in prof.key_averages()
        if getattr(a, "device_type", DeviceType.CPU) == DeviceType.CPU
    ]


class StepProfiler:
    """torch.profiler over the steps of `window` (1-based step numbers), then the report files.

    On a GPU the device is synchronised before the profiler starts and before it stops, so the window
    holds exactly the window's kernels. `announce` gets the one-line result (rank 0 passes a printer).
    """

    def __init__(
        self,
        window: range,
        device: torch.device,
        out_dir: Path,
        rank: int = 0,
        world: int = 1,
        announce: Callable[[str], None] | None = None,
        shapes: bool = False,
    ) -> None:
        self.window = window
        self.shapes = shapes  # record ops' input shapes (the launchers name them; the host runs slower)
        self.device = device
        self.out_dir = out_dir
        self.rank, self.world = rank, world
        self.announce = announce
        self.prof: profile | None = None
        self.seconds: list[float] = []
        self.steps: list[int] = []

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def begin(self, step: int) -> None:
        """Before `step` runs: start the profiler if it is the window's first step."""
        if self.prof is not None or not self.window or step != self.window.start:
            return
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        if self.cuda:
            torch.cuda.synchronize(self.device)
        self.prof = profile(activities=activities, record_shapes=self.shapes)
        # Some torch versions warn at start that a cycle reports only its own events: there is one cycle.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*clears events")
            self.prof.start()

    def end(self, step: int, seconds: float) -> bool:
        """After `step` ran (in `seconds`): True when it was profiled; after the window's last step the
        profiler stops and the report is written."""
        if self.prof is None or step not in self.window:
            return False
        self.steps.append(step)
        self.seconds.append(seconds)
        if step == self.window[-1]:
            self._finish()
        return True

    def close(self) -> None:
        """The loop is over: a window left unfinished (the run stopped inside it) is dropped."""
        if self.prof is not None:
            try:
                self.prof.stop()
            except Exception:  # the loop is already failing or stopping; the profile is not needed
                pass
            self.prof = None
            log.warning(
                "runtime.profile_steps: the run stopped inside the profiled steps; no profile written"
            )

    def _finish(self) -> None:
        prof, self.prof = self.prof, None
        assert prof is not None
        t0 = time.time()
        if self.cuda:
            torch.cuda.synchronize(self.device)
        prof.stop()
        try:
            kernels: list[Kernel] = []
            spans: list[HostSpan] = []
            launches: Launches = {}
            if self.cuda:
                index = self.device.index if self.device.index is not None else torch.cuda.current_device()
                events = prof.events()
                kernels = device_kernels(events, index)
                spans = host_spans(events)
                launches = kernel_launches(events, index)
            meta = {
                "rank": self.rank,
                "world": self.world,
                "device": str(self.device)
                + (f" ({torch.cuda.get_device_name(self.device)})" if self.cuda else ""),
                "torch": torch.__version__,
            }
            report = summarize(kernels, self.seconds, self.steps, _cpu_ops(prof), meta, spans, launches)
        except Exception as e:  # a diagnostic: a profiler that cannot be read must not end the run
            log.warning("runtime.profile_steps: cannot summarise the profile (%s: %s)", type(e).__name__, e)
            return
        report["summarise_seconds"] = round(time.time() - t0, 3)
        txt, js = self.out_dir / f"rank{self.rank}.txt", self.out_dir / f"rank{self.rank}.json"
        try:
            atomic_write_json(js, report)
            atomic_write_text(txt, render_text(report))
        except OSError as e:
            log.warning("%s: cannot write the profile (%s); training goes on", self.out_dir, e.strerror or e)
            return
        if self.announce is not None:
            self.announce(headline(report, txt))


def headline(report: dict[str, Any], path: Path) -> str:
    """The console line: where the profile is and its headline numbers (per step, this rank)."""
    steps = report["steps"]
    span = f"steps {steps[0]}-{steps[-1]}" if len(steps) > 1 else f"step {steps[0]}"
    world = report.get("world", 1)
    others = f" (one pair per rank: rank0 to rank{world - 1})" if world > 1 else ""
    return (
        f"profile ({span}, rank {report.get('rank', 0)}): step {report['step_ms_mean']:.1f} ms, "
        f"kernels {report['kernel_ms_per_step']:.1f} ms, exposed collectives "
        f"{report['exposed_collective_ms_per_step']:.1f} ms per step -> {path}{others}"
    )
