"""The key contract, checked: launched keys ⊆ plan, and each key names exactly one compiled binary.

    with runtime.recording(deep=True) as rec:
        ... forward and backward of teacher and student on the reference path ...
    problems = check(rec.launches, required_kernels(...), warmed=prewarm(plan, "cpu", dry=True).specializations)
    assert not problems, problems

Four rules, each catching one class of bug:
1. every launched key is in the plan                        (a kernel missing from the plan)
2. Kernel.specialization(key) == what Triton's binder derives from the launch's actual arguments
                                                             (a key function that drops a parameter)
3. one key, one launched specialization                      (two launches colliding under one key)
4. every launched specialization was prewarmed               (a prewarm that stores under the wrong key)

Rule 2 asks Triton itself (its argument binder, for a CUDA target, run on CPU tensors), so it also
catches a key that misjudges pointer alignment or integer specialization.
"""

from __future__ import annotations

from collections.abc import Iterable

from kdistill.kernels import registry
from kdistill.kernels.keys import KernelKey
from kdistill.kernels.runtime import Launch
from kdistill.kernels.spec import triton_specialization

__all__ = ["check", "triton_specialization"]


def check(launches: Iterable[Launch], plan: set[KernelKey], warmed: set[tuple] | None = None) -> list[str]:
    """The contract's violations (empty when it holds). `warmed`: specializations a prewarm compiled."""
    problems: list[str] = []
    seen: dict[KernelKey, tuple] = {}
    for launch in launches:
        key = launch.key
        if key not in plan:
            problems.append(f"not in the plan: {key} ({launch.phase})")
        spec = launch.specialization
        if spec is None:
            continue
        try:
            expected = registry.kernel_of(key).specialization(key)
        except (KeyError, ValueError) as e:
            problems.append(f"key {key} does not determine its kernel: {e}")
            continue
        if expected != spec:
            problems.append(f"key {key} compiles {_diff(expected, spec)} at its launch")
        if key in seen and seen[key] != spec:
            problems.append(f"key {key} names two different kernels: {_diff(seen[key], spec)}")
        seen.setdefault(key, spec)
        if warmed is not None and spec not in warmed:
            problems.append(f"launch of {key} was not prewarmed (its specialization is not in the warm set)")
    return sorted(set(problems))


def _diff(a: tuple, b: tuple) -> str:
    if a[0] != b[0]:
        return f"kernel {b[0]} instead of {a[0]}"
    parts = [f"{x[0]}: {x[1:]} vs {y[1:]}" for x, y in zip(a[1], b[1]) if x != y]
    if a[2] != b[2]:
        parts.append(f"options {a[2]} vs {b[2]}")
    return "differently (" + "; ".join(parts) + ")"
