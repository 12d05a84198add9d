"""The key contract, checked: launched keys ⊆ plan, and each key names exactly one compiled binary.

    with runtime.recording(deep=True) as rec:
        ... forward and backward of teacher and student on the reference path ...
    problems = check(rec.launches, required_kernels(...), warmed=prewarm(plan, "cpu", dry=True).specializations)
    assert not problems, problems

Four rules, each catching one class of bug:
1. every launched key is in the plan                        (a kernel missing from the plan)
2. specialization_of(key) == what Triton's binder derives from the launch's actual arguments
                                                             (a key function that drops a parameter)
3. one key, one launched specialization                      (two launches colliding under one key)
4. every launched specialization was prewarmed               (a prewarm that stores under the wrong key)

Rule 2 asks Triton itself (its argument binder, for a CUDA target, run on CPU tensors), so it also
catches a key that misjudges pointer alignment or integer specialization.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kdistill.kernels.keys import KernelKey, arch_capability, specialization_of
from kdistill.kernels.runtime import Launch

_BINDERS: dict[tuple[int, int], Any] = {}


def triton_specialization(kernel: Any, args: tuple, kwargs: dict, arch: str = "sm_90") -> tuple:
    """How Triton specializes `kernel[grid](*args, **kwargs)` for `arch`, in specialization_of's form.
    Works on CPU tensors: only data pointers, dtypes and values are looked at."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    cap = arch_capability(arch)
    ident = (id(kernel), cap)
    if ident not in _BINDERS:
        backend = make_backend(GPUTarget("cuda", cap, 32))
        _BINDERS[ident] = create_function_from_signature(kernel.signature, kernel.params, backend)
    _bound, spec, options = _BINDERS[ident](*args, **kwargs)
    out = []
    for param, (ty, attr) in zip(kernel.params, spec):
        if ty == "constexpr":
            out.append((param.name, "constexpr", attr))
        elif ty.startswith("*"):
            out.append((param.name, ty, attr or ""))
        else:
            out.append((param.name, ty, attr))
    opts = options if isinstance(options, dict) else dict(getattr(options, "__dict__", {}))
    op = kernel.fn.__name__.removesuffix("_kernel")
    return (
        op,
        tuple(out),
        tuple(sorted((k, v) for k, v in opts.items() if k in ("num_warps", "num_stages"))),
    )


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
            expected = kd_loss_specialization(key) if key.op == "kd_loss" else specialization_of(key)
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


def kd_loss_specialization(key: KernelKey) -> tuple:
    """specialization_of for the KD loss head, from its own build_source (kernels/triton/kd_loss.py)."""
    from kdistill.kernels.keys import kd_loss_raw_key
    from kdistill.kernels.triton.kd_loss import build_source

    src, options = build_source(kd_loss_raw_key(key))
    kernel = src.fn
    out = []
    for i, param in enumerate(kernel.params):
        ty = src.signature[param.name]
        aligned = (i,) in src.attrs and any(a[0] == "tt.divisibility" for a in src.attrs[(i,)])
        if ty == "constexpr":
            out.append((param.name, "constexpr", src.constants.get((i,), "<missing>")))
        elif ty.startswith("*"):
            out.append((param.name, ty, "D" if aligned else ""))
        elif ty.startswith(("i", "u")) and not param.do_not_specialize:
            out.append((param.name, ty, "D" if aligned else ""))
        else:
            out.append((param.name, ty, None))
    op = kernel.fn.__name__.removesuffix("_kernel")
    opts = tuple(sorted((k, v) for k, v in options.items() if k in ("num_warps", "num_stages")))
    return (op, tuple(out), opts)
