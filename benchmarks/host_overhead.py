"""Host time of the dispatcher's kernel path: microseconds of Python per call, per op and per block.

    python benchmarks/host_overhead.py [--out FILE.json] [--src DIR]

At a multi-GPU step's batch the host sets the pace (benchmarks/NOTES.md): what the GPU does per
kernel is small next to what the host spends to launch it. This measures that host work with tiny
tensors, so the device (or the CPU's arithmetic) costs next to nothing:

- on a GPU: real launches of the sealed kernels; wall time of many calls divided by their number,
  with one synchronisation at the end (the GPU finishes each tiny kernel faster than the host
  issues the next);
- without a GPU: the kernel path through the dispatcher under Triton's interpreter flag, the
  launches themselves replaced by nothing (the outputs are allocated as usual): what kdistill adds
  on the host around a launch, without Triton's own launch.

Every number is the median of repeats of `--calls` calls. `--src DIR` measures another checkout's
`src` (e.g. the previous commit, `git worktree add`) with this same script.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    ap.add_argument("--src", type=Path, default=None, help="import kdistill from this src directory")
    ap.add_argument("--label", default="", help="a name for this measurement in the JSON (e.g. the commit)")
    ap.add_argument("--calls", type=int, default=500)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    if args.src is not None:
        sys.path.insert(0, str(args.src.resolve()))
    import torch

    gpu = torch.cuda.is_available()
    if not gpu:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: the kernel path on the CPU
    from kdistill import dispatch
    from kdistill.kernels import rmsnorm, rope, swiglu

    if not gpu:
        rmsnorm._run = rope._run = swiglu.run = lambda launch: launch[4]  # outputs only, no launch
    torch.set_num_threads(1)
    device = "cuda" if gpu else "cpu"
    dispatch.configure(kernels="triton", strict=True, arch="auto" if gpu else "sm_90", device=device)
    results = {"device": torch.cuda.get_device_name() if gpu else _cpu_name()}
    results["label"] = args.label
    results["launches"] = "real" if gpu else "none (interpreter flag, launch replaced)"
    results["torch"] = torch.__version__
    try:
        import triton

        results["triton"] = triton.__version__
    except ImportError:
        results["triton"] = None
    results["python"] = platform.python_version()
    ops = _ops(torch, dispatch, device)
    for name, fn in ops.items():
        results[name] = _time(torch, fn, args.calls, args.repeats, gpu)
        print(f"{name:32s} {results[name]:8.1f} us", flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=1) + "\n")


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"CPU: {line.split(':', 1)[1].strip()}, {os.cpu_count()} cores"
    except OSError:
        pass
    return f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores"


def _ops(torch, dispatch, device):
    from kdistill.models.decoder import build_decoder
    from kdistill.models.spec import spec_from_hf_config

    bf16 = torch.bfloat16
    h, n = 64, 16
    g = torch.Generator().manual_seed(0)

    def leaf(*shape, dtype=bf16, grad=True):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype).requires_grad_(grad)

    x, r, w = leaf(1, n, h), leaf(1, n, h), leaf(h)
    gu = leaf(1, n, 2 * 96)
    q, k = leaf(1, 4, n, 16), leaf(1, 2, n, 16)
    cos, sin = torch.randn(n, 16, device=device), torch.randn(n, 16, device=device)
    ones_y, ones_gate = (
        torch.ones(1, n, h, device=device, dtype=bf16),
        torch.ones(1, n, 96, device=device, dtype=bf16),
    )

    def norm_fwd_bwd():
        y, s = dispatch.add_rmsnorm(x, r, w, 1e-6)
        torch.autograd.backward([y, s], [ones_y, ones_y])

    def norm_frozen():
        with torch.no_grad():
            dispatch.add_rmsnorm(x, r, w, 1e-6)

    def rope_fwd_bwd():
        qo, ko = dispatch.apply_rope(q, k, cos, sin)
        torch.autograd.backward([qo, ko], [torch.ones_like(qo), torch.ones_like(ko)])

    def rope_frozen():
        with torch.no_grad():
            dispatch.apply_rope(q, k, cos, sin)

    def swiglu_frozen():
        with torch.no_grad():
            dispatch.swiglu(*dispatch.swiglu_kernel.halves(gu))

    def swiglu_fwd_bwd():
        y = dispatch.swiglu(*dispatch.swiglu_kernel.halves(gu))
        y.backward(ones_gate)

    cfg = {
        "model_type": "qwen2",
        "architectures": ["Qwen2ForCausalLM"],
        "vocab_size": 64,
        "hidden_size": h,
        "intermediate_size": 96,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
    }
    spec = spec_from_hf_config(cfg)
    student = build_decoder(spec, device=device, dtype=torch.float32, seed=1)
    teacher = build_decoder(spec, device=device, dtype=bf16, seed=2).requires_grad_(False)
    ids = torch.randint(0, 64, (1, n), generator=g).to(device)

    def student_block_fwd_bwd():  # per block: a 4-block student, forward and backward under autocast
        with torch.autocast(device, dtype=bf16):
            out = student(ids)
        out.float().sum().backward()

    def teacher_block_fwd():  # per block: a frozen 4-block teacher's forward
        with torch.no_grad():
            teacher(ids)

    return {
        "add_rmsnorm fwd+bwd": norm_fwd_bwd,
        "add_rmsnorm frozen fwd": norm_frozen,
        "rope fwd+bwd": rope_fwd_bwd,
        "rope frozen fwd": rope_frozen,
        "swiglu fwd+bwd": swiglu_fwd_bwd,
        "swiglu frozen fwd": swiglu_frozen,
        "student block fwd+bwd": (student_block_fwd_bwd, 4),
        "teacher block fwd": (teacher_block_fwd, 4),
    }


def _time(torch, fn, calls: int, repeats: int, gpu: bool) -> float:
    per = 1
    if isinstance(fn, tuple):
        fn, per = fn
        calls = max(1, calls // 10)
    for _ in range(max(3, calls // 10)):
        fn()
    samples = []
    for _ in range(repeats):
        if gpu:
            torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        if gpu:
            torch.cuda.synchronize()
        samples.append((time.perf_counter() - t) / calls / per * 1e6)
    return statistics.median(samples)


if __name__ == "__main__":
    main()
