"""Weak scaling of on-policy distillation as a picture: onpolicy_bench.py's JSON files, drawn.

    python3 benchmarks/plot_scaling.py \
        "1.5B to 0.5B=benchmarks/results/onpolicy_scaling_2026-11-28_4xh200_r15_policy.json" \
        "one block a unit=benchmarks/results/onpolicy_scaling_2026-11-28_4xh200_r15_units_1.json" \
        "7B to 1.5B=benchmarks/results/onpolicy_scaling_2026-11-28_4xh200_r15_7b_*.json" \
        --out benchmarks/results/onpolicy_scaling_2026-11-28_4xh200_r15.png

Each argument is LABEL=FILES (a glob): the files' kdistill rows are one series, keyed by world size (a
world size found in two files of one series is refused). Left: completion tokens/s against the series'
one-GPU run (a series without one, such as another FSDP unit size, against the first series'), beside
the ideal line and the targets (1.85x on 2 GPUs, 3.6x on 4). Right: each world size's step, its phases
as every rank's mean (generate, score, update). The table it draws is printed.
"""

from __future__ import annotations

import argparse
import glob
import io
import json
import sys
from pathlib import Path
from typing import Any

from kdistill.fileio import atomic_write_bytes

TARGETS = {2: 1.85, 4: 3.6}
PHASES = ("generate", "score", "update")


class PlotError(ValueError):
    """A series that cannot be drawn: its files or their rows."""


def load_series(spec: str) -> tuple[str, dict[int, dict[str, Any]]]:
    """'LABEL=GLOB' -> (label, {world size: kdistill row}) over the files the glob matches."""
    label, sep, pattern = spec.partition("=")
    if not sep or not label or not pattern:
        raise PlotError(f"{spec!r}: expected LABEL=FILES")
    files = sorted(glob.glob(pattern))
    if not files:
        raise PlotError(f"{pattern}: no file matches")
    rows: dict[int, dict[str, Any]] = {}
    for f in files:
        try:
            results = json.loads(Path(f).read_text())["results"]["kdistill"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise PlotError(f"{f}: not an onpolicy_bench.py result with kdistill rows ({e})") from None
        for world, row in results.items():
            w = int(world)
            if w in rows:
                raise PlotError(f"{f}: world size {w} is already in series {label!r}")
            rows[w] = row
    return label, dict(sorted(rows.items()))


def table(series: list[tuple[str, dict[int, dict[str, Any]]]]) -> list[dict[str, Any]]:
    """One row per (series, world size): tokens/s, scaling against the series' one GPU (else the first
    series'), phase means."""
    if 1 not in series[0][1]:
        raise PlotError(f"series {series[0][0]!r}: no one-GPU run to scale against")
    out = []
    for label, rows in series:
        base = (rows.get(1) or series[0][1][1])["completion_tokens_per_s"]
        for w, row in rows.items():
            phases = row.get("phase_s_per_rank", {})
            out.append(
                {
                    "series": label,
                    "gpus": w,
                    "tokens_per_s": row["completion_tokens_per_s"],
                    "scaling": row["completion_tokens_per_s"] / base,
                    **{p: sum(phases[p]) / len(phases[p]) for p in PHASES if phases.get(p)},
                }
            )
    return out


def draw(rows: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(r["series"] for r in rows))
    worlds = sorted({r["gpus"] for r in rows})
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.2))
    ax.plot(worlds, worlds, color="0.7", linestyle="--", label="ideal")
    ax.scatter(list(TARGETS), list(TARGETS.values()), marker="_", s=400, color="tab:red", label="target")
    for j, label in enumerate(labels):
        mine = [r for r in rows if r["series"] == label]
        ax.plot([r["gpus"] for r in mine], [r["scaling"] for r in mine], marker="o", label=label)
        for r in mine:
            if r["gpus"] > 1:  # staggered, one line of labels per series
                ax.annotate(
                    f"{r['scaling']:.2f}×",
                    (r["gpus"], r["scaling"]),
                    textcoords="offset points",
                    xytext=(8, -4 - 11 * j),
                    fontsize=8,
                    color=ax.lines[-1].get_color(),
                )
    ax.set_xticks(worlds)
    ax.set_xlim(worlds[0] - 0.3, worlds[-1] + 0.8)
    ax.set_xlabel("GPUs (same prompts per GPU)")
    ax.set_ylabel("completion tokens/s against one GPU")
    ax.set_title("weak scaling")
    ax.legend(loc="upper left", fontsize=8)
    ticks, names, top = [], [], 0.0
    width = 0.8 / max(1, len(labels))
    colors = {"generate": "tab:blue", "score": "tab:orange", "update": "tab:green"}
    for i, w in enumerate(worlds):
        for j, label in enumerate(labels):
            r = next((r for r in rows if r["series"] == label and r["gpus"] == w), None)
            if r is None:
                continue
            x = i + (j - (len(labels) - 1) / 2) * width
            bottom = 0.0
            for p in PHASES:
                v = r.get(p, 0.0)
                bx.bar(
                    x, v, width * 0.9, bottom=bottom, color=colors[p], label=p if not ticks and v else None
                )
                bottom += v
            top = max(top, bottom)
            ticks.append(x)
            names.append(label)
    for i, w in enumerate(worlds):
        bx.text(i, top * 1.04, f"{w} GPU{'s' if w > 1 else ''}", ha="center", fontsize=9)
    bx.set_ylim(0, top * 1.3)
    bx.set_xticks(ticks, names, fontsize=7, rotation=30, ha="right")
    bx.set_ylabel("seconds a step (every rank's mean)")
    bx.set_title("where a step goes")
    bx.legend(loc="upper right", fontsize=8, ncols=3)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    atomic_write_bytes(out, buf.getvalue())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("series", nargs="+", help="LABEL=FILES (a glob of onpolicy_bench.py JSON files)")
    ap.add_argument("--out", required=True, help="the PNG to write")
    a = ap.parse_args(argv)
    try:
        rows = table([load_series(s) for s in a.series])
    except PlotError as e:
        print(f"plot_scaling: {e}", file=sys.stderr)
        return 2
    for r in rows:
        phases = "  ".join(f"{p} {r[p]:.3f}" for p in PHASES if p in r)
        print(
            f"{r['series']:>14}  {r['gpus']} GPUs  {r['tokens_per_s']:9,.0f} tok/s  {r['scaling']:.2f}x  {phases}"
        )
    draw(rows, Path(a.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
