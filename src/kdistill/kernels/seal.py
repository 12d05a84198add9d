"""Prewarm and seal: compile every planned kernel before any weight is on the GPU, then count compiles.

    setup_cache_dir()                       # Triton's disk cache under kdistill's (before any compile)
    report = prewarm(keys, "cuda")          # compiles every Triton key, runs each library key once
    report = prewarm(keys, "cuda", pack=DIR)   # the same, the pack's binaries installed first (kernels/pack.py)
    seal()                                  # from now on every compile is a miss
    ... training ...
    jit_after_prewarm()                     # number of compiles after the seal: 0 in a healthy run

Compiles are seen through Triton's hooks (`knobs.runtime.jit_cache_hook` before a compile,
`jit_post_compile_hook` after it, `knobs.compilation.listener` for disk-cache hits; older Triton:
`JITFunction.cache_hook`). After the seal a compile raises KernelCacheMiss naming the key (strict) or
is logged as `kernel cache miss after prewarm: <key>` and counted. KDISTILL_LOG_KERNELS=1 logs every
compile and disk-cache hit with its key and time.

The training loop starts all of it with one call, before any weight is on the device:

    session = start(cfg, teacher_spec, student_spec, device, dtype, batch=per_rank_batch)
    ... train ...
    session.jit_after_prewarm()   # 0 in a healthy run; in summary.json and metrics.jsonl
    session.summary()             # mode, arch, strict, plan size, prewarm counts and time, misses

`kdistill prewarm CONFIG` (commands/kernels.py) runs only the prewarm for a config.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from kdistill.errors import KernelCacheMiss
from kdistill.kernels import pack as packs
from kdistill.kernels import registry, runtime
from kdistill.kernels.keys import KernelKey
from kdistill.kernels.plan import required_kernels

log = logging.getLogger("kdistill.kernels")


# -- cache directory ------------------------------------------------------------------------------
def kdistill_cache_dir() -> Path:
    return Path(os.environ.get("KDISTILL_CACHE_DIR") or Path.home() / ".cache" / "kdistill")


def setup_cache_dir() -> str:
    """Point Triton's on-disk cache at <kdistill cache>/triton unless TRITON_CACHE_DIR is set by the
    user. Must run before the first compile; returns the directory in use."""
    if not os.environ.get("TRITON_CACHE_DIR"):
        os.environ["TRITON_CACHE_DIR"] = str(kdistill_cache_dir() / "triton")
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton >= 3.9 warns when unset; same default
    path = os.environ["TRITON_CACHE_DIR"]
    try:
        from triton import knobs

        if getattr(knobs.cache, "dir", None) != path:
            knobs.cache.dir = path
    except Exception:  # no Triton, or an older one that reads the environment variable
        pass
    return path


def configure(
    run: Any = None,
    *,
    kernels: str | None = None,
    strict: bool | None = None,
    arch: str | None = None,
    device: torch.device | str | None = None,
) -> runtime.KernelRuntime:
    """Set the process-wide dispatcher state (runtime.configure) after pointing Triton's cache at
    kdistill's directory; in triton mode install the compile hooks."""
    setup_cache_dir()
    rt = runtime.configure(run, kernels=kernels, strict=strict, arch=arch, device=device)
    if rt.mode == "triton":
        install_hooks()
    return rt


# -- hooks and the seal ---------------------------------------------------------------------------
@dataclasses.dataclass
class _SealState:
    installed: str = ""  # which hook API is in use ("" until installed)
    sealed: bool = False
    strict: bool = False
    misses: list[str] = dataclasses.field(default_factory=list)
    events: list[tuple[str, float, bool | None]] = dataclasses.field(
        default_factory=list
    )  # name, s, disk hit
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    started: dict[str, float] = dataclasses.field(default_factory=dict)
    last_cache_hit: bool | None = None


_SEAL = _SealState()


def _log_kernels() -> bool:
    return os.environ.get("KDISTILL_LOG_KERNELS", "") not in ("", "0")


def _name(fallback: str) -> str:
    key = runtime.LAUNCHING.get()
    return str(key) if key is not None else fallback


def _on_compile_start(fallback: str) -> None:
    name = _name(fallback)
    with _SEAL.lock:
        _SEAL.started[name] = time.perf_counter()
        _SEAL.last_cache_hit = None
        if not _SEAL.sealed:
            return
        _SEAL.misses.append(name)
    msg = f"kernel cache miss after prewarm: {name}"
    if _SEAL.strict:
        raise KernelCacheMiss(msg)
    log.warning(msg)
    print(f"kdistill: warning: {msg}", file=sys.stderr)


def _on_compile_end(fallback: str) -> None:
    name = _name(fallback)
    with _SEAL.lock:
        seconds = time.perf_counter() - _SEAL.started.pop(name, time.perf_counter())
        hit = _SEAL.last_cache_hit
        _SEAL.events.append((name, seconds, hit))
    if _log_kernels():
        what = "loaded from disk cache" if hit else "compiled"
        _emit(f"kernel {what} in {seconds:.3f}s: {name}")


def _emit(msg: str) -> None:
    log.info(msg)
    print(f"kdistill: {msg}", file=sys.stderr)


def install_hooks() -> str:
    """Install the compile hooks once (chaining any hooks already set). Returns the API used, or ''
    when this Triton offers none (then the seal cannot count and says so)."""
    if _SEAL.installed:
        return _SEAL.installed
    try:
        import triton
    except ImportError:
        return ""
    knobs = getattr(triton, "knobs", None)
    rt_knobs = getattr(knobs, "runtime", None)
    if (
        rt_knobs is not None
        and hasattr(rt_knobs, "jit_cache_hook")
        and hasattr(rt_knobs, "jit_post_compile_hook")
    ):
        prev_pre, prev_post = rt_knobs.jit_cache_hook, rt_knobs.jit_post_compile_hook

        def pre(*args: Any, **kw: Any) -> Any:
            _on_compile_start(str(kw.get("repr", "?")))
            return prev_pre(*args, **kw) if prev_pre else None

        def post(*args: Any, **kw: Any) -> Any:
            _on_compile_end(str(kw.get("repr", "?")))
            return prev_post(*args, **kw) if prev_post else None

        rt_knobs.jit_cache_hook, rt_knobs.jit_post_compile_hook = pre, post
        comp = getattr(knobs, "compilation", None)
        if comp is not None and hasattr(comp, "listener"):
            prev_listener = comp.listener

            def listener(*args: Any, **kw: Any) -> None:
                _SEAL.last_cache_hit = bool(kw.get("cache_hit"))
                if prev_listener:
                    prev_listener(*args, **kw)

            comp.listener = listener
        _SEAL.installed = "triton.knobs.runtime.jit_cache_hook"
        return _SEAL.installed
    jit_fn = getattr(getattr(triton, "runtime", None), "JITFunction", None)
    if jit_fn is not None and hasattr(jit_fn, "cache_hook"):  # Triton < 3.4
        prev = jit_fn.cache_hook

        def hook(*args: Any, **kw: Any) -> Any:
            _on_compile_start(str(kw.get("repr", "?")))
            return prev(*args, **kw) if prev else None

        jit_fn.cache_hook = hook
        _SEAL.installed = "JITFunction.cache_hook"
        return _SEAL.installed
    log.warning("this Triton offers no compile hook: compiles after prewarm cannot be counted")
    return ""


def seal(strict: bool | None = None) -> None:
    """From now on every Triton compile in this process is a cache miss (KernelCacheMiss if strict)."""
    install_hooks()
    with _SEAL.lock:
        _SEAL.sealed = True
        _SEAL.strict = runtime.current().strict if strict is None else bool(strict)


def unseal() -> None:
    """Lift the seal and forget the misses (tests; a new run in the same process)."""
    with _SEAL.lock:
        _SEAL.sealed = False
        _SEAL.misses.clear()


def jit_after_prewarm() -> int:
    """Compiles since the seal (0 in a healthy run)."""
    return len(_SEAL.misses)


def cache_misses() -> list[str]:
    return list(_SEAL.misses)


# -- prewarm --------------------------------------------------------------------------------------
@dataclasses.dataclass
class PrewarmReport:
    compiled: int = 0  # Triton kernels compiled now
    from_cache: int = 0  # loaded from the disk cache (or already in memory)
    from_pack: int = 0  # installed from the kernel pack and loaded, not compiled
    pack: str = ""  # the kernel pack's folder ("" without one)
    pack_missing: int = 0  # planned Triton keys the pack lacks (compiled or read from the cache instead)
    library: int = 0  # cuBLAS / SDPA shapes run once
    failed: list[str] = dataclasses.field(default_factory=list)
    seconds: float = 0.0
    cache_dir: str = ""
    specializations: set[tuple] = dataclasses.field(default_factory=set)  # dry runs: what would compile
    per_key: list[tuple[str, str, float]] = dataclasses.field(default_factory=list)  # key, status, seconds

    def line(self) -> str:
        n = self.compiled + self.from_cache + self.from_pack
        counts = f"{self.compiled} compiled, {self.from_cache} from cache"
        if self.pack:
            counts = f"from pack {self.from_pack}, compiled {self.compiled}, {self.from_cache} from cache"
        tail = f"; kernel pack: {self.pack} ({self.pack_missing} missing)" if self.pack else ""
        return (
            f"prewarm: {n} kernels ({counts}), {self.library} library shapes, {len(self.failed)} failed, "
            f"{self.seconds:.1f} s; triton cache: {self.cache_dir}{tail}"
        )


def _warm(key: KernelKey, device: Any, dry: bool) -> tuple | None:
    """Compile one key through its registered kernel's warm launch (dry: its specialization)."""
    token = runtime.LAUNCHING.set(key)
    try:
        return registry.kernel_of(key).warm(key, device, dry)
    finally:
        runtime.LAUNCHING.reset(token)


def prewarm(
    keys: Iterable[KernelKey],
    device: Any = "cuda",
    *,
    dry: bool = False,
    pack: str | os.PathLike | None = None,
    arch: str | None = None,
) -> PrewarmReport:
    """Compile every Triton key (JIT warmup on tiny tensors that specialize as the key) and run every
    library key once, before any model weight is on the GPU. dry=True compiles nothing: it returns the
    specializations a prewarm would compile (works on a CPU; used by the contract tests).
    pack: a kernel pack folder whose binaries are installed into Triton's cache first, so that the
    warmup loads them instead of compiling (a key it lacks: compiled, or KernelCacheMiss when strict);
    arch: the arch of `keys` (default: the dispatcher's)."""
    keys = set(keys)
    report = PrewarmReport(cache_dir=setup_cache_dir())
    packed: set[KernelKey] = set()
    if pack and not dry:
        installed = packs.install(pack, keys, arch or runtime.current().arch, strict=runtime.current().strict)
        packed, report.pack, report.pack_missing = installed.keys, str(pack), len(installed.missing)
    if not dry:
        install_hooks()
        # A prewarm starts a new session in this process (a second run, or generation after a run in
        # the same Python process): the compiles it makes are not misses of the session before it.
        unseal()
    t0 = time.perf_counter()
    for key in sorted(keys):
        if key.is_library:
            if not dry:
                _warm(key, device, dry)
                report.library += 1
            continue
        n_events = len(_SEAL.events)
        t1 = time.perf_counter()
        try:
            spec = _warm(key, device, dry)
        except KernelCacheMiss:
            raise
        except Exception as e:
            report.failed.append(f"{key}: {e.__class__.__name__}: {' '.join(str(e).split())[:200]}")
            report.per_key.append((str(key), "failed", time.perf_counter() - t1))
            if runtime.current().strict:
                raise
            continue
        if dry:
            if spec is not None:
                report.specializations.add(spec)
            continue
        new = _SEAL.events[n_events:]
        compiled = any(hit is not True for _, _, hit in new) if new else False
        report.compiled += compiled
        report.from_pack += not compiled and key in packed
        report.from_cache += not compiled and key not in packed
        status = "compiled" if compiled else "pack" if key in packed else "cached"
        report.per_key.append((str(key), status, time.perf_counter() - t1))
        if _log_kernels() and not new:
            _emit(f"kernel already in memory: {key}")
    packed_names = {str(k) for k in packed}
    recompiled = [k for k, status, _ in report.per_key if status == "compiled" and k in packed_names]
    if recompiled:  # in the pack, yet Triton looked elsewhere: its cache key differs in this process
        _emit(
            f"warning: kernel pack {pack}: {len(recompiled)} packed kernels were compiled anyway (Triton's cache "
            f"key differs here: a TRITON_* environment variable?), e.g. {recompiled[0]}"
        )
    if not dry and torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    report.seconds = time.perf_counter() - t0
    return report


# -- the session the training loop starts ----------------------------------------------------------
@dataclasses.dataclass
class KernelSession:
    mode: str
    arch: str
    strict: bool
    planned: int = 0
    report: PrewarmReport | None = None

    def jit_after_prewarm(self) -> int:
        return jit_after_prewarm()

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "mode": self.mode,
            "arch": self.arch,
            "strict": self.strict,
            "planned": self.planned,
            "jit_after_prewarm": self.jit_after_prewarm(),
            "misses": cache_misses()[:20],
            "fallbacks": sorted(str(k) for k in runtime.current().warned)[:20],
        }
        if self.report is not None:
            r = self.report
            out["prewarm"] = {
                "compiled": r.compiled,
                "from_cache": r.from_cache,
                "from_pack": r.from_pack,
                "pack": r.pack,
                "pack_missing": r.pack_missing,
                "library": r.library,
                "failed": r.failed,
                "seconds": round(r.seconds, 3),
                "cache_dir": r.cache_dir,
            }
        return out


def start(
    cfg,
    teacher,
    student,
    device: torch.device | str,
    dtype: torch.dtype | None = None,
    *,
    quiet: bool = False,
    batch: int | None = None,
    documents: bool = False,
    sharded: bool = False,
    extra_teachers: tuple | list = (),
) -> KernelSession:
    """Configure the dispatcher from cfg.runtime; on a GPU in triton mode compile the whole plan and
    seal the cache (before any weight is on the device). `dtype` is the compute dtype the loop chose
    (the plan derives the same from cfg.runtime.dtype). batch: the per-process batch (under torchrun
    batch_size / world); default cfg.schedule.batch_size. documents, sharded: see required_kernels.
    extra_teachers: the other teachers' specs of a mixture (`teachers:`)."""
    rt = configure(cfg, device=device)
    session = KernelSession(rt.mode, rt.arch, rt.strict)
    if rt.mode == "triton" and torch.device(device).type == "cuda":
        plan = required_kernels(
            teacher,
            student,
            cfg,
            rt.arch,
            batch=batch,
            documents=documents,
            sharded=sharded,
            extra_teachers=extra_teachers,
        )
        session.planned = len(plan)
        pack = getattr(cfg.runtime, "kernel_pack", "") if cfg is not None else ""
        session.report = prewarm(plan, device, pack=pack or None, arch=rt.arch)
        if not quiet:
            print(session.report.line())
        unseal()
        seal(strict=rt.strict)
    return session
