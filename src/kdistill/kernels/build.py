"""Cross-arch build: compile a run's whole kernel plan to GPU binaries on a machine without a GPU.

    kdistill kernels build --arch sm_80,sm_89,sm_90,sm_100,sm_120 CONFIG [--json] [--out PACK]

For each arch the plan is computed with that arch (required_kernels), and every Triton key is compiled
by the JIT warmup of the tiny launch prewarm makes (on CPU tensors), with Triton's driver standing in
for a GPU of that arch (kernels/pack.py `jit_compile`): the same key objects the dispatcher computes
and prewarm warms, and the same cache entry a GPU's prewarm looks up. Each key is first checked
against its registered kernel's `specialization(key)` (kernels/spec.py, derived from the jit function's
own signature) with Triton's binder, so build, prewarm and runtime cannot drift apart.
With `--out PACK` every binary is kept in a kernel pack (kernels/pack.py) that prewarm installs on a GPU
instead of compiling. The default arch list (`default_archs`) adds sm_103 and sm_121 where the
installed Triton can target them.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from kdistill.kernels import keys as K
from kdistill.kernels import registry, swiglu
from kdistill.kernels.pack import PackWriter, can_target, jit_compile
from kdistill.kernels.plan import required_kernels, triton_keys
from kdistill.kernels.seal import setup_cache_dir

# Archs the default build adds when the installed Triton's ptxas knows them (Triton >= 3.6 for both).
NEWER_ARCHS = ("sm_103", "sm_121")


def default_archs() -> list[str]:
    """keys.ARCHS, plus sm_103 (B300) and sm_121 (GB10) where this Triton can target them."""
    archs = list(K.ARCHS) + [a for a in NEWER_ARCHS if can_target(a)]
    return sorted(archs, key=K.arch_capability)


@dataclasses.dataclass
class BuildResult:
    arch: str
    op: str
    key: str
    ok: bool
    seconds: float
    error: str = ""


def check_against_launch(key: K.KernelKey) -> None:
    """Raise if the key's compiled specialization differs from the tiny launch prewarm uses."""
    kernel = registry.kernel_of(key)
    got = kernel.warm(key, "cpu", dry=True)
    want = kernel.specialization(key)
    if got != want:
        raise RuntimeError(f"key and warm launch disagree: {want} vs {got}")


def compile_key(key: K.KernelKey, pack: PackWriter | None = None) -> BuildResult:
    """Compile `key` for its arch through Triton's JIT warmup (pack.jit_compile: the cache entry a GPU
    looks up); with `pack`, stage its binary there."""
    t0 = time.perf_counter()
    try:
        check_against_launch(key)
        compiled: Any = jit_compile(key)
        if pack is not None:
            pack.add(key, compiled)
        return BuildResult(key.arch, key.op, str(key), True, time.perf_counter() - t0)
    except Exception as e:  # reported per kernel; the command exits non-zero
        msg = " ".join(f"{e.__class__.__name__}: {e}".split())[:300]
        return BuildResult(key.arch, key.op, str(key), False, time.perf_counter() - t0, msg)


def probe_key(arch: str) -> K.KernelKey:
    """The small kernel a build first compiles for `arch` in a child process: an arch this Triton cannot
    target fails (or aborts the compiler) on any kernel."""
    return swiglu.fwd_key(arch, inter=64, dtype="bf16")


def build_plan(
    teacher, student, run, archs: list[str], pack: PackWriter | None = None, *, sharded: bool = False
) -> list[BuildResult]:
    """Compile the Triton keys of required_kernels(teacher, student, run, arch) for every arch (with
    `pack`: staged there; the caller commits the pack when every key built). sharded: the plan of a
    torchrun process (the student gathered in the compute dtype by FSDP2)."""
    setup_cache_dir()
    results = []
    for arch in archs:
        for key in triton_keys(required_kernels(teacher, student, run, arch, sharded=sharded)):
            results.append(compile_key(key, pack))
    return results
