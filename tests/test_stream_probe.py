"""benchmarks/stream_probe.py and stream_probe_gluon.py without a GPU: the Gluon kernel compiles for sm_90
with the installed Triton (TMA copies into shared memory, warpgroup MMA on them), and the Triton loop's
plain and TMA variants give the product under the interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_gluon_kernel_compiles_for_sm_90_with_tma_copies_and_warpgroup_mma():
    gluon = pytest.importorskip("triton.experimental.gluon", reason="a Triton without Gluon")
    del gluon
    from benchmarks import stream_probe_gluon

    kernel = stream_probe_gluon.build_sm90(n=256, k=256, block_n=64, block_k=128, stages=3)
    ptx = kernel.asm["ptx"]
    assert ptx.count("cp.async.bulk.tensor") > 0
    assert ptx.count("wgmma.mma_async") == 128 // 16  # one 16-input MMA per chunk's 16 inputs
    assert kernel.metadata.shared >= stream_probe_gluon.smem_bytes(3, 64, 128)


def test_the_triton_loop_gives_the_product_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}
    r = subprocess.run(
        [sys.executable, "benchmarks/stream_probe.py", "--device", "cpu", "--tiny", "--per-sm", "1",
         "--stages", "2", "--block-k", "64", "--providers", "plain,tma"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    lines = [line for line in r.stdout.splitlines() if line.startswith("tiny")]
    assert len(lines) == 2 and all(line.endswith(" ok") for line in lines), r.stdout


def test_the_one_launch_block_probe_compiles_for_sm_90_with_the_next_weights_issued_ahead():
    pytest.importorskip("triton.experimental.gluon", reason="a Triton without Gluon")
    from benchmarks import block_probe_gluon

    built = block_probe_gluon.build(stages=3)
    (one_tma, one_mma, _), (bar_tma, bar_mma, _), (pre_tma, pre_mma, _) = (
        built["one"],
        built["barrier"],
        built["prefetch"],
    )
    assert one_mma > 0 and bar_mma == pre_mma == 4 * one_mma  # a block's four products
    assert pre_tma > bar_tma > one_tma  # the next product's weights issued before each barrier
