"""The dispatcher's state: which path ops take, the arch their keys are for, and the key recorder.

kdistill.dispatch (the only place that picks kernel or reference) uses it per call:

    rt = runtime.current()
    key = swiglu.fwd_key(rt.arch, inter=..., dtype=..., aligned=...)
    if rt.use_kernel(key, gate, up):          # triton mode, CUDA tensors, key not failed before
        try:
            return rt.launch(key, lambda: SwiGLUFunction.apply(...))   # records the key, runs
        except Exception as e:
            rt.kernel_failed(key, e)           # one warning per key; KernelError in strict mode
    rt.record(key, "fwd", ...)                 # the reference records the key it WOULD launch
    ... reference math; rt.on_backward(outputs, fn) records the backward key when grads flow

Set the state once per process with `configure(...)` (the training loop does, from runtime.*), or
temporarily with `using(...)`; record keys with `with recording() as rec:`.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
import os
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from kdistill.errors import KernelCacheMiss, KernelError, UserError
from kdistill.kernels._triton import AVAILABLE
from kdistill.kernels.keys import DEFAULT_ARCH, KernelKey, normalize_arch
from kdistill.kernels.spec import triton_specialization

log = logging.getLogger("kdistill.kernels")

# The key whose kernel is being launched right now: the compile hooks name misses by it.
LAUNCHING: contextvars.ContextVar[KernelKey | None] = contextvars.ContextVar(
    "kdistill_launching", default=None
)


class KernelFallbackWarning(RuntimeWarning):
    """An op ran on its PyTorch reference because its kernel could not run (once per key)."""


@dataclasses.dataclass(frozen=True)
class Launch:
    key: KernelKey
    phase: str  # "fwd" | "bwd"
    specialization: tuple | None = None  # Triton's own specialization of the launch args (deep mode)


class Recorder:
    """Collects every key the dispatcher launches or would launch. deep=True also asks Triton's binder
    how it would specialize the actual launch arguments (needs triton; used by the contract tests)."""

    def __init__(self, deep: bool = False) -> None:
        self.deep = deep
        self.launches: list[Launch] = []

    def keys(self) -> set[KernelKey]:
        return {launch.key for launch in self.launches}

    def add(
        self,
        key: KernelKey,
        phase: str,
        launch_args: Callable[[], tuple] | None = None,
        arch: str = DEFAULT_ARCH,
    ) -> None:
        spec = None
        if self.deep and launch_args is not None and not key.is_library:
            kernel, _grid, args, kwargs, _outs = launch_args()
            spec = triton_specialization(kernel, args, kwargs, arch)
        self.launches.append(Launch(key, phase, spec))


@dataclasses.dataclass
class KernelRuntime:
    mode: str = "reference"  # "triton" | "reference"
    arch: str = DEFAULT_ARCH
    strict: bool = False
    recorder: Recorder | None = None
    failed: set[KernelKey] = dataclasses.field(default_factory=set)
    warned: set[KernelKey] = dataclasses.field(default_factory=set)
    forced_failures: set[str] = dataclasses.field(default_factory=set)  # op names (tests: planted failures)
    # A decode step of a small bucket is being launched: every kernel of its chain is kdistill's own (no
    # multi-wave GEMM), so its norms and attention launch with programmatic dependent launch too.
    chained: bool = False

    # -- deciding the path ---------------------------------------------------------------------
    def use_kernel(self, key: KernelKey, *tensors: torch.Tensor) -> bool:
        """True when the op should launch its Triton kernel for `key`; else the reference runs (with
        one warning per key when triton mode was asked for but cannot serve this call)."""
        if self.mode != "triton" or key in self.failed:
            return False
        if not triton_available():
            self._fallback(key, "Triton is not installed")
            return False
        if not all(t.is_cuda for t in tensors) and not interpreting():
            self._fallback(key, "tensors are on the CPU")
            return False
        return True

    def launch(
        self,
        key: KernelKey,
        run: Callable[[], Any],
        launch_args: Callable[[], tuple] | None = None,
        phase: str = "fwd",
    ) -> Any:
        """Record `key` and run the kernel (`run`), naming the key for the compile hooks."""
        if key.op in self.forced_failures:
            raise KernelError(f"planted failure of {key.op}")
        self.record(key, phase, launch_args)
        token = LAUNCHING.set(key)
        try:
            return run()
        finally:
            LAUNCHING.reset(token)

    def record(self, key: KernelKey, phase: str, launch_args: Callable[[], tuple] | None = None) -> None:
        if self.recorder is not None:
            self.recorder.add(key, phase, launch_args, self.arch)

    def kernel_failed(self, key: KernelKey, exc: BaseException) -> None:
        """A kernel raised on compile or launch: from now on its op runs the reference for this key."""
        if isinstance(exc, KernelCacheMiss | UserError):
            raise exc
        self.failed.add(key)
        self._fallback(key, f"{exc.__class__.__name__}: {exc}", exc)

    def _fallback(self, key: KernelKey, why: str, exc: BaseException | None = None) -> None:
        if self.strict:
            raise KernelError(
                f"kernel {key} cannot run ({why}); strict mode forbids the reference fallback"
            ) from exc
        if key not in self.warned:
            self.warned.add(key)
            msg = f"kernel {key} falls back to the PyTorch reference: {' '.join(why.split())[:300]}"
            log.warning(msg)
            warnings.warn(msg, KernelFallbackWarning, stacklevel=3)

    # -- backward recording on the reference path -----------------------------------------------
    def on_backward(
        self, outputs: Sequence[torch.Tensor], fn: Callable[[Sequence[torch.Tensor | None]], None]
    ) -> None:
        """Call fn(grads) once the gradients of `outputs` are known (None for outputs that get none).
        Only while recording: the reference path has nothing to launch otherwise."""
        if self.recorder is None or not torch.is_grad_enabled():
            return
        # Only outputs that require grad get a hook (a frozen LoRA base leaves some without one); the
        # others are reported as None, in their place.
        where = [i for i, o in enumerate(outputs) if o is not None and o.requires_grad]
        if not where:
            return

        def hook(grads: Sequence[torch.Tensor | None]) -> None:
            full: list[torch.Tensor | None] = [None] * len(outputs)
            for i, g in zip(where, grads):
                full[i] = g
            fn(full)

        torch.autograd.graph.register_multi_grad_hook([outputs[i] for i in where], hook, mode="all")


_STATE = KernelRuntime()


def current() -> KernelRuntime:
    return _STATE


def triton_available() -> bool:
    return AVAILABLE


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def device_arch(device: torch.device | str | None = None) -> str | None:
    """'sm_90' for the current (or given) CUDA device; None without a GPU."""
    if not torch.cuda.is_available():
        return None
    dev = torch.device(device) if device is not None else torch.device("cuda")
    if dev.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(dev)
    return f"sm_{major}{minor}"


def resolve_arch(arch: str | None = "auto", device: torch.device | str | None = None) -> str:
    """The arch keys are computed for: the device's, else the given runtime.arch, else DEFAULT_ARCH."""
    found = device_arch(device) if device is None or torch.device(device).type == "cuda" else None
    if found:
        return found
    if arch and arch != "auto":
        try:
            return normalize_arch(arch)
        except ValueError:
            raise UserError(f"runtime.arch is '{arch}', expected auto or a GPU arch such as sm_90") from None
    return DEFAULT_ARCH


def resolve_mode(kernels: str = "auto", device: torch.device | str | None = None) -> str:
    """'triton' or 'reference'. auto: Triton when it is installed and the device is a GPU."""
    if kernels not in ("auto", "triton", "reference"):
        raise UserError(f"runtime.kernels is '{kernels}', expected one of: auto, triton, reference")
    if kernels == "reference":
        return "reference"
    if kernels == "triton":
        return "triton"
    on_gpu = torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda")
    return "triton" if on_gpu and triton_available() else "reference"


def configure(
    run: Any = None,
    *,
    kernels: str | None = None,
    strict: bool | None = None,
    arch: str | None = None,
    device: torch.device | str | None = None,
) -> KernelRuntime:
    """Set the process-wide dispatcher state from a RunConfig (runtime.kernels, strict_kernels, arch)
    and/or explicit values (which win). seal.configure also sets up Triton's cache and hooks."""
    global _STATE
    rt_cfg = getattr(run, "runtime", None)
    kernels = kernels or (rt_cfg.kernels if rt_cfg else "auto")
    strict = strict if strict is not None else (bool(rt_cfg.strict_kernels) if rt_cfg else False)
    arch = arch or (rt_cfg.arch if rt_cfg else "auto")
    if device is None and rt_cfg is not None and rt_cfg.device != "auto":
        device = rt_cfg.device
    _STATE = KernelRuntime(
        mode=resolve_mode(kernels, device),
        arch=resolve_arch(arch, device),
        strict=strict,
        recorder=_STATE.recorder,
    )
    return _STATE


@contextlib.contextmanager
def using(**changes: Any) -> Iterator[KernelRuntime]:
    """Temporarily replace fields of the dispatcher state (mode, arch, strict, recorder, ...)."""
    global _STATE
    saved = _STATE
    if "arch" in changes:
        changes["arch"] = normalize_arch(changes["arch"])
    _STATE = dataclasses.replace(saved, failed=set(), warned=set(), **changes)
    try:
        yield _STATE
    finally:
        _STATE = saved


@contextlib.contextmanager
def chained(on: bool = True) -> Iterator[KernelRuntime]:
    """Launch the block's norm and attention kernels with programmatic dependent launch inside (keys.pdl):
    the decode step of a bucket whose products are the matrix-vector kernels. Not where a cuBLAS GEMM of
    several waves precedes them: its early trigger would let their programs take SMs its last waves need."""
    saved = _STATE.chained
    _STATE.chained = bool(on)
    try:
        yield _STATE
    finally:
        _STATE.chained = saved


@contextlib.contextmanager
def recording(deep: bool = False) -> Iterator[Recorder]:
    """Record every key launched (or that the reference would launch) inside the block."""
    global _STATE
    rec = Recorder(deep=deep)
    saved = _STATE.recorder
    _STATE.recorder = rec
    try:
        yield rec
    finally:
        _STATE.recorder = saved


def aligned(*tensors: torch.Tensor | None) -> tuple[bool, ...]:
    """Triton's pointer specialization: is each data pointer 16-byte aligned?"""
    return tuple(t is None or t.data_ptr() % 16 == 0 for t in tensors)
