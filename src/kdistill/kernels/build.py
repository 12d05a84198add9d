"""Cross-arch build: compile a run's whole kernel plan to GPU binaries on a machine without a GPU.

    kdistill kernels build --arch sm_80,sm_89,sm_90,sm_100,sm_120 CONFIG [--json]

For each arch the plan is computed with that arch (required_kernels), and every Triton key is
compiled with `triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget(...))`,
where signature, constexprs and divisibility attrs come from the registered kernel's `source(key)`
(kernels/spec.py, derived from the jit function's own signature): the same key
objects the dispatcher computes and prewarm warms. Each key is also checked against the tiny launch
prewarm would use (Triton's binder on CPU tensors), so build, prewarm and runtime cannot drift apart.
"""

from __future__ import annotations

import dataclasses
import time

from kdistill.kernels import keys as K
from kdistill.kernels import registry
from kdistill.kernels.plan import required_kernels, triton_keys
from kdistill.kernels.seal import setup_cache_dir


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


def compile_key(key: K.KernelKey) -> BuildResult:
    import triton
    from triton.backends.compiler import GPUTarget

    t0 = time.perf_counter()
    try:
        check_against_launch(key)
        src, options = registry.kernel_of(key).ast_source(key)
        triton.compile(src, target=GPUTarget("cuda", K.arch_capability(key.arch), 32), options=options)
        return BuildResult(key.arch, key.op, str(key), True, time.perf_counter() - t0)
    except Exception as e:  # reported per kernel; the command exits non-zero
        msg = " ".join(f"{e.__class__.__name__}: {e}".split())[:300]
        return BuildResult(key.arch, key.op, str(key), False, time.perf_counter() - t0, msg)


def build_plan(teacher, student, run, archs: list[str]) -> list[BuildResult]:
    """Compile the Triton keys of required_kernels(teacher, student, run, arch) for every arch."""
    setup_cache_dir()
    results = []
    for arch in archs:
        for key in triton_keys(required_kernels(teacher, student, run, arch)):
            results.append(compile_key(key))
    return results
