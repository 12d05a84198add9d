"""`kdistill prewarm CONFIG` and `kdistill kernels build --arch ... CONFIG`: the kernel commands.

kdistill prewarm run.yaml [--pack DIR]                    # compile (or load from a pack) the plan on this GPU
kdistill kernels build --arch sm_80,sm_90 qwen2.5-1.5b:qwen2.5-0.5b [--json] [--out DIR]   # no GPU needed
kdistill kernels build --arch sm_90 run.yaml --nproc 8 --out DIR   # the plan of a torchrun process
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import torch

from kdistill.commands.common import resolve_run
from kdistill.data.chat_data import is_conversation_data
from kdistill.errors import UserError
from kdistill.kernels.build import build_plan, default_archs
from kdistill.kernels.keys import arch_capability, normalize_arch
from kdistill.kernels.pack import PackWriter
from kdistill.kernels.plan import required_kernels
from kdistill.kernels.seal import configure, prewarm
from kdistill.train.corpus import expand_data_paths


def prewarm_command(args: argparse.Namespace) -> int:
    """`kdistill prewarm CONFIG [--pack DIR]`: compile the run's kernel plan on this GPU (loading what the
    pack holds instead: --pack, else runtime.kernel_pack) and report counts and time."""
    cfg, teacher, student = resolve_run(args.config, getattr(args, "overrides", []) or [])
    pack = getattr(args, "pack", None) or cfg.runtime.kernel_pack
    if not torch.cuda.is_available():
        raise UserError(
            "prewarm: no CUDA GPU on this machine (prewarm compiles for the GPU it runs on); to check that the "
            f"plan compiles without a GPU run: kdistill kernels build --arch sm_90 {args.config}"
        )
    device = cfg.runtime.device if cfg.runtime.device.startswith("cuda") else "cuda"
    rt = configure(cfg, kernels="triton", device=device)
    try:  # conversation data attends by document: its attention keys differ
        documents = is_conversation_data(expand_data_paths(cfg.data.train))
    except UserError:  # data not readable here: the run itself reports it
        documents = False
    plan = required_kernels(teacher, student, cfg, rt.arch, documents=documents)
    report = prewarm(plan, device, pack=pack or None, arch=rt.arch)
    print(report.line())
    for failure in report.failed:
        print(f"  failed: {failure}")
    return 1 if report.failed else 0


def parse_archs(text: str) -> list[str]:
    """'sm_80,sm_90' -> ['sm_80', 'sm_90']; a UserError for anything Triton cannot target."""
    out = []
    for part in str(text).split(","):
        if not part.strip():
            continue
        try:
            arch = normalize_arch(part)
        except ValueError:
            raise UserError(f"--arch: '{part}' is not a GPU arch (expected e.g. sm_80,sm_90)") from None
        if arch_capability(arch) < 75:
            raise UserError(f"--arch: {arch} is older than sm_75, which Triton does not target")
        out.append(arch)
    if not out:
        raise UserError("--arch is empty, expected e.g. sm_80,sm_90")
    return out


def build_command(args: argparse.Namespace) -> int:
    """`kdistill kernels build`: compile the plan per arch; print a table (or JSON); non-zero on failure."""
    try:
        import triton  # noqa: F401
    except ImportError:
        raise UserError("kernels build needs Triton (pip install 'kdistill[kernels]')") from None
    archs = parse_archs(getattr(args, "arch", None) or ",".join(default_archs()))
    cfg, teacher, student = resolve_run(args.config, getattr(args, "overrides", []) or [])
    nproc = getattr(args, "nproc", None)
    nproc = 1 if nproc is None else nproc
    if nproc < 1:
        raise UserError(f"--nproc {nproc}: expected the number of torchrun processes (1 or more)")
    out = getattr(args, "out", None)
    pack = PackWriter(out) if out else None
    t0 = time.perf_counter()
    try:
        results = build_plan(teacher, student, cfg, archs, pack, sharded=nproc > 1)
    except BaseException:
        if pack is not None:
            pack.abort()
        raise
    failed = [r for r in results if not r.ok]
    packed = ""
    if pack is not None:
        if failed:
            pack.abort()
            packed = f"kernel pack {out} not written: {len(failed)} kernels failed"
        else:
            added = pack.commit()
            packed = f"kernel pack {out}: {added} kernels written, {len(pack.manifest.kernels)} in the pack"
    total = time.perf_counter() - t0
    if getattr(args, "json", False):
        print(
            json.dumps(
                {
                    "archs": archs,
                    "kernels": [dataclasses.asdict(r) for r in results],
                    "ok": not failed,
                    "failed": len(failed),
                    "seconds": round(total, 2),
                    "pack": packed,
                },
                indent=1,
            )
        )
    else:
        print(f"{'arch':7} {'kernel':12} {'status':6} {'seconds':>7}  key")
        for r in results:
            status = "ok" if r.ok else "FAILED"
            print(f"{r.arch:7} {r.op:12} {status:6} {r.seconds:7.2f}  {r.key}")
            if not r.ok:
                print(f"        error: {r.error}")
        print(
            f"{len(results) - len(failed)}/{len(results)} kernels built for {', '.join(archs)} in {total:.1f} s"
        )
        if packed:
            print(packed)
    return 1 if failed else 0
