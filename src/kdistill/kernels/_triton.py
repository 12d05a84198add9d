"""Triton, when installed; else stand-ins that keep the kernel files importable on a CPU-only install.

    from kdistill.kernels._triton import AVAILABLE, jit, tl, triton

Without Triton, `jit` returns a `StandIn` that keeps the Python function and its do_not_specialize
lists (so signatures, keys and the plan still work) and raises KernelError when launched; `tl` is an
object whose attributes exist (`tl.constexpr` in annotations); `triton` is None. The dispatcher asks
`AVAILABLE` and falls back to the PyTorch reference with one warning (strict mode: an error).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kdistill.errors import KernelError

try:
    import triton
    import triton.language as tl

    AVAILABLE = True
    jit = triton.jit
except ImportError:
    AVAILABLE = False
    triton = None

    class _Language:
        """`tl` without Triton: every attribute is a placeholder (annotations, never executed)."""

        def __getattr__(self, name: str) -> Any:
            return name

    tl = _Language()

    class StandIn:
        """What @triton.jit returns when Triton is missing: the function and its specialization lists."""

        def __init__(self, fn: Callable, do_not_specialize=(), do_not_specialize_on_alignment=()) -> None:
            self.fn = fn
            self.do_not_specialize = list(do_not_specialize)
            self.do_not_specialize_on_alignment = list(do_not_specialize_on_alignment)
            self.__name__ = fn.__name__

        def __getitem__(self, grid: Any) -> Callable:
            raise KernelError(f"{self.__name__}: Triton is not installed")

        def warmup(self, *args: Any, **kwargs: Any) -> None:
            raise KernelError(f"{self.__name__}: Triton is not installed")

    def jit(fn: Callable | None = None, **kwargs: Any) -> Any:
        if fn is None:
            return lambda f: StandIn(f, **kwargs)
        return StandIn(fn, **kwargs)


if AVAILABLE:
    try:
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    except ImportError:  # pragma: no cover - a Triton without grid dependency control: PDL keys stay off
        gdc_launch_dependents = gdc_wait = None

    @jit
    def pdl_release(PDL: tl.constexpr):
        """Programmatic dependent launch: the next kernel's programs may be placed now (they wait in
        pdl_wait for this kernel to finish). A no-op unless PDL."""
        if PDL:
            gdc_launch_dependents()

    @jit
    def pdl_wait(PDL: tl.constexpr):
        """Wait until the previous kernel has finished and its writes are visible: nothing written by
        an earlier kernel may be read, and nothing written, before this. A no-op unless PDL."""
        if PDL:
            gdc_wait()

else:
    pdl_release = pdl_wait = jit(lambda PDL: None)


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) (triton.cdiv, also without Triton)."""
    return -(-a // b)
