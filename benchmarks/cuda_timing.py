"""Median seconds of a GPU callable, timed with CUDA events: shared by the small benchmarks."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch


def median_seconds(fn: Callable[[], object], reps: int, warmup: int = 1) -> float:
    """Median seconds of fn() over `reps` calls after `warmup` untimed ones (CUDA events around each)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    return statistics.median(times)
