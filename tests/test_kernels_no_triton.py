"""Without Triton installed (blocked by an import hook in a child process): the kernel modules and the
dispatcher import, the plan is computed, and triton mode falls back to the reference with one warning
(an error in strict mode)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

CHILD = textwrap.dedent(
    """
    import importlib.abc, sys, warnings

    class BlockTriton(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name == "triton" or name.startswith("triton."):
                raise ImportError("triton is blocked")

    sys.meta_path.insert(0, BlockTriton())
    import torch
    from kdistill import dispatch
    from kdistill.config import RunConfig
    from kdistill.errors import KernelError
    from kdistill.kernels import plan, registry
    from kdistill.kernels._triton import AVAILABLE
    from kdistill.models.spec import load_spec
    from kdistill.ops.rmsnorm import rmsnorm_reference

    assert not AVAILABLE and "triton" not in sys.modules
    run = RunConfig()
    run.teacher.precision = "fp8"  # every registered kernel, the FP8 teacher's quantisation too
    run.runtime.precision = "fp8"  # and the FP8 student's transposed one
    keys = plan.required_kernels(load_spec("qwen2.5-1.5b"), load_spec("qwen2.5-0.5b"), run, "sm_90")
    # and the decode engine's with speculative decoding's (attention over the static cache, T-token steps)
    keys |= plan.speculative_kernels(
        load_spec("qwen2.5-1.5b"), load_spec("qwen2.5-0.5b"), "sm_90", "bf16",
        batch=2, prompt_len=8, max_len=16, draft_tokens=4,
    )
    ops = {k.op for k in keys}
    assert {kern.op for spec in registry.KERNELS for kern in spec.kernels} <= ops, ops
    x, w = torch.randn(2, 3, 16), torch.rand(16)
    with dispatch.using(mode="triton", arch="sm_90"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y = dispatch.rmsnorm(x, w, 1e-6)
        y2 = dispatch.rmsnorm(x, w, 1e-6)
    assert torch.equal(y, rmsnorm_reference(x, w, 1e-6)) and torch.equal(y, y2)
    fallbacks = [c for c in caught if issubclass(c.category, dispatch.KernelFallbackWarning)]
    assert len(fallbacks) == 1 and "Triton is not installed" in str(fallbacks[0].message)
    with dispatch.using(mode="triton", arch="sm_90", strict=True):
        try:
            dispatch.swiglu(x, x)
        except KernelError as e:
            assert "strict" in str(e)
        else:
            raise AssertionError("strict mode ran the reference")
    print("ok")
    """
)


def test_kernels_and_dispatch_work_without_triton():
    r = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().endswith("ok")
