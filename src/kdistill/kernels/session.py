"""The training loop's entry to the kernels: configure, prewarm, seal; then report.

session = start(cfg, teacher_spec, student_spec, device, dtype, quiet=False)   # before loading weights
... train ...
session.jit_after_prewarm()   # 0 in a healthy run; in summary.json and metrics.jsonl
session.summary()             # mode, arch, strict, plan size, prewarm counts and time, misses
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from kdistill.kernels import cache, runtime
from kdistill.kernels.plan import required_kernels


@dataclasses.dataclass
class KernelSession:
    mode: str
    arch: str
    strict: bool
    planned: int = 0
    report: cache.PrewarmReport | None = None

    def jit_after_prewarm(self) -> int:
        return cache.jit_after_prewarm()

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "mode": self.mode,
            "arch": self.arch,
            "strict": self.strict,
            "planned": self.planned,
            "jit_after_prewarm": self.jit_after_prewarm(),
            "misses": cache.cache_misses()[:20],
            "fallbacks": sorted(str(k) for k in runtime.current().warned)[:20],
        }
        if self.report is not None:
            r = self.report
            out["prewarm"] = {
                "compiled": r.compiled,
                "from_cache": r.from_cache,
                "library": r.library,
                "failed": r.failed,
                "seconds": round(r.seconds, 3),
                "cache_dir": r.cache_dir,
            }
        return out


def start(
    cfg, teacher, student, device: torch.device | str, dtype: torch.dtype | None = None, quiet: bool = False
) -> KernelSession:
    """Configure the dispatcher from cfg.runtime; on a GPU in triton mode compile the whole plan and
    seal the cache (before any weight is on the device). `dtype` is the compute dtype the loop chose
    (the plan derives the same from cfg.runtime.dtype)."""
    rt = runtime.configure(cfg, device=device)
    session = KernelSession(rt.mode, rt.arch, rt.strict)
    if rt.mode == "triton" and torch.device(device).type == "cuda":
        plan = required_kernels(teacher, student, cfg, rt.arch)
        session.planned = len(plan)
        session.report = cache.prewarm(plan, device)
        if not quiet:
            print(session.report.line())
        cache.unseal()
        cache.seal(strict=rt.strict)
    return session
