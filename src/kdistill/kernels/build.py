"""Cross-arch build: compile a run's whole kernel plan to GPU binaries on a machine without a GPU.

    kdistill kernels build --arch sm_80,sm_89,sm_90,sm_100,sm_120 CONFIG [--json]

For each arch the plan is computed with that arch (required_kernels), and every Triton key is
compiled with `triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget(...))`,
where signature, constexprs and divisibility attrs come from `keys.source_spec(key)`: the same key
objects the dispatcher computes and prewarm warms. Each key is also checked against the tiny launch
prewarm would use (Triton's binder on CPU tensors), so build, prewarm and runtime cannot drift apart.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from kdistill.kernels import keys as K


@dataclasses.dataclass
class BuildResult:
    arch: str
    op: str
    key: str
    ok: bool
    seconds: float
    error: str = ""


def kernel_fn(op: str) -> Any:
    """The @triton.jit function of a Triton op."""
    if op.startswith("rmsnorm"):
        from kdistill.kernels.triton import rmsnorm as m

        return m.rmsnorm_fwd_kernel if op == "rmsnorm_fwd" else m.rmsnorm_bwd_kernel
    if op.startswith("rope"):
        from kdistill.kernels.triton import rope as m

        return m.rope_fwd_kernel if op == "rope_fwd" else m.rope_bwd_kernel
    if op.startswith("swiglu"):
        from kdistill.kernels.triton import swiglu as m

        return m.swiglu_fwd_kernel if op == "swiglu_fwd" else m.swiglu_bwd_kernel
    raise ValueError(f"unknown Triton op {op}")


def ast_source(key: K.KernelKey) -> tuple[Any, dict[str, Any]]:
    """(ASTSource, compile options) for `key`, derived from the key alone."""
    from triton.compiler import ASTSource

    if key.op == "kd_loss":
        from kdistill.kernels.triton.kd_loss import build_source

        return build_source(K.kd_loss_raw_key(key))
    spec = K.source_spec(key)
    return ASTSource(kernel_fn(key.op), spec["signature"], spec["constexprs"], spec["attrs"]), dict(
        spec["options"]
    )


def check_against_launch(key: K.KernelKey) -> None:
    """Raise if the key's compiled specialization differs from the tiny launch prewarm uses."""
    if key.op == "kd_loss":
        return
    from kdistill.kernels.contract import triton_specialization
    from kdistill.kernels.seal import launch_for_key

    kernel, _grid, args, kwargs, _ = launch_for_key(key, "cpu")
    got = triton_specialization(kernel, args, kwargs, key.arch)
    want = K.specialization_of(key)
    if got != want:
        raise RuntimeError(f"key and warm launch disagree: {want} vs {got}")


def compile_key(key: K.KernelKey) -> BuildResult:
    import triton
    from triton.backends.compiler import GPUTarget

    t0 = time.perf_counter()
    try:
        check_against_launch(key)
        src, options = ast_source(key)
        triton.compile(src, target=GPUTarget("cuda", K.arch_capability(key.arch), 32), options=options)
        return BuildResult(key.arch, key.op, str(key), True, time.perf_counter() - t0)
    except Exception as e:  # reported per kernel; the command exits non-zero
        msg = " ".join(f"{e.__class__.__name__}: {e}".split())[:300]
        return BuildResult(key.arch, key.op, str(key), False, time.perf_counter() - t0, msg)


def build_plan(teacher, student, run, archs: list[str]) -> list[BuildResult]:
    """Compile the Triton keys of required_kernels(teacher, student, run, arch) for every arch."""
    from kdistill.kernels.plan import required_kernels, triton_keys
    from kdistill.kernels.seal import setup_cache_dir

    setup_cache_dir()
    results = []
    for arch in archs:
        for key in triton_keys(required_kernels(teacher, student, run, arch)):
            results.append(compile_key(key))
    return results
