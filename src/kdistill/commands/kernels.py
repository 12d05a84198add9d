"""`kdistill prewarm CONFIG` and `kdistill kernels build --arch ... CONFIG`: the kernel commands.

kdistill prewarm run.yaml [--pack DIR]                    # compile (or load from a pack) the plan on this GPU
kdistill kernels build --arch sm_80,sm_90 qwen2.5-1.5b:qwen2.5-0.5b [--json] [--out DIR]   # no GPU needed
kdistill kernels build --arch sm_90 run.yaml --nproc 8 --out DIR   # the plan of a torchrun process

Before anything is compiled or written, each arch is probed in a child process (one small kernel per
arch, `probe_archs`): an arch this Triton cannot target, whether its compiler fails or aborts the whole
process (an LLVM error, SIGABRT), is one line naming it, and no pack folder is touched. The build reads
the config's plan only: its runtime.kernel_pack (the pack a run loads) is not consulted.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from kdistill.commands.common import resolve_run
from kdistill.data.chat_data import is_conversation_data
from kdistill.errors import UserError
from kdistill.kernels.build import build_plan, compile_key, default_archs, probe_key
from kdistill.kernels.keys import arch_capability, normalize_arch
from kdistill.kernels.pack import PackWriter, can_target, quote, triton_version
from kdistill.kernels.plan import required_kernels
from kdistill.kernels.seal import configure, prewarm, setup_cache_dir
from kdistill.train import faults
from kdistill.train.corpus import expand_data_paths

PROBE = "from kdistill.commands.kernels import probe_child; probe_child()"
PROBE_TIMEOUT_S = 1800


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


def probe_child() -> None:
    """The child process of probe_archs: `python -c PROBE RESULTS ARCH...` compiles probe_key(arch) for
    each arch in turn, appending {"arch", "ok", "error"} as one JSON line to the file RESULTS."""
    results, archs = sys.argv[1], sys.argv[2:]
    setup_cache_dir()
    for arch in archs:
        faults.at(f"kernels.probe.{arch}")
        r = compile_key(probe_key(arch))
        with open(results, "a", encoding="utf-8") as f:
            f.write(json.dumps({"arch": arch, "ok": r.ok, "error": r.error}) + "\n")


def probe_archs(archs: list[str]) -> None:
    """Compile one small kernel per arch in a child process (its output kept out of the terminal); an
    arch whose compile aborts the child (an LLVM error, SIGABRT), or fails where this Triton's ptxas
    does not list the arch, is a UserError naming it. Another failure is left to the build's table."""
    root = str(Path(__file__).resolve().parents[2])  # this kdistill's folder, in the child too
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    with tempfile.TemporaryDirectory(prefix="kdistill-probe-") as tmp:
        results = Path(tmp) / "probe.jsonl"
        try:
            proc = subprocess.run(
                [sys.executable, "-c", PROBE, str(results), *archs],
                env=env,
                capture_output=True,
                text=True,
                errors="replace",
                timeout=PROBE_TIMEOUT_S,
            )
        except subprocess.TimeoutExpired:
            raise UserError(
                f"--arch {','.join(archs)}: compiling a probe kernel took over {PROBE_TIMEOUT_S} s"
            ) from None
        lines = results.read_text(encoding="utf-8").splitlines() if results.exists() else []
    done = [json.loads(x) for x in lines]
    for r in done:
        if not r["ok"] and not can_target(r["arch"]):
            raise UserError(
                f"--arch {r['arch']}: Triton {triton_version()} cannot compile for it ({quote(r['error'])}); "
                "drop it from --arch"
            )
    if proc.returncode != 0 and len(done) < len(archs):
        arch = archs[len(done)]
        code = -proc.returncode
        how = (
            f"the compiler aborted the process ({signal.Signals(code).name})"
            if 0 < code < signal.NSIG
            else f"the compiling process exited with status {proc.returncode}"
        )
        said = [x for x in proc.stderr.splitlines() if x.strip()]
        detail = next((x for x in reversed(said) if "LLVM ERROR" in x or "error" in x.lower()), "")
        raise UserError(
            f"--arch {arch}: Triton {triton_version()} cannot compile for it ({how}"
            f"{': ' + quote(detail) if detail else ''}); drop it from --arch"
        )


def build_command(args: argparse.Namespace) -> int:
    """`kdistill kernels build`: compile the plan per arch; print a table (or JSON); non-zero on failure."""
    try:
        import triton  # noqa: F401
    except ImportError:
        raise UserError("kernels build needs Triton (pip install 'kdistill[kernels]')") from None
    archs = parse_archs(getattr(args, "arch", None) or ",".join(default_archs()))
    overrides = [*(getattr(args, "overrides", []) or []), "runtime.kernel_pack="]  # the build writes packs
    cfg, teacher, student = resolve_run(args.config, overrides)
    nproc = getattr(args, "nproc", None)
    nproc = 1 if nproc is None else nproc
    if nproc < 1:
        raise UserError(f"--nproc {nproc}: expected the number of torchrun processes (1 or more)")
    out = getattr(args, "out", None)
    probe_archs(archs)  # before any pack folder is touched
    pack = PackWriter(out, archs) if out else None
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
            if pack.repaired:
                packed += f"; {pack.repaired} missing or damaged binaries replaced"
            if pack.dropped:
                packed += (
                    f"; {len(pack.dropped)} damaged kernels this build does not make dropped (first: "
                    f"{quote(pack.dropped[0])})"
                )
            if pack.stale:
                packed += f"; {len(pack.stale)} staging folders of killed builds removed"
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
