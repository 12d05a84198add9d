"""GPU tests of the kernels (run on a GPU with `-m gpu`): full-size kernels vs reference, a strict
prewarm + seal + forward/backward that ends with jit_after_prewarm() == 0, and a second prewarm
process that compiles nothing.

    pytest -m gpu tests/gpu/test_kernels_gpu.py -q
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS))

BF16, FP32 = torch.bfloat16, torch.float32
FULL = [
    ("rmsnorm_fp32_odd", dict(dtype=FP32, rows=(41, 401), hidden=1271)),
    ("rmsnorm_bf16_odd", dict(dtype=BF16, rows=(41, 401), hidden=1271)),
    ("rmsnorm_bf16_odd", dict(dtype=BF16, rows=(8, 2048), hidden=1536)),
    ("rmsnorm_mixed_bf16_fp32", dict(dtype=BF16, r_dtype=FP32, w_dtype=FP32, rows=(8, 2048), hidden=896)),
    ("rmsnorm_no_dres_bf16", dict(dtype=BF16, rows=(4, 2048), hidden=2048)),
    ("rmsnorm_plain_bf16_qk", dict(dtype=BF16, rows=(4 * 2048, 16), hidden=128)),
    ("rope_fp32_odd", dict(dtype=FP32, b=3, hq=14, hkv=2, t=1271, d=64)),
    ("rope_bf16", dict(dtype=BF16, b=4, hq=12, hkv=2, t=2048, d=128)),
    ("swiglu_fp32_odd", dict(dtype=FP32, rows=(41, 401), inter=1271)),
    ("swiglu_bf16_blocks", dict(dtype=BF16, rows=(4, 2048), inter=8960)),
    ("decoder_qwen3_fp32", dict(dtype=FP32, arch="qwen3")),
    ("decoder_qwen2_fp32", dict(dtype=FP32, arch="qwen2")),
    ("decode_sample_bf16_greedy", dict(dtype=BF16, rows=6, vocab=151936)),
    ("decode_sample_fp32_sampled", dict(dtype=BF16, rows=6, vocab=151936, temperature=2.0)),
    ("decode_sample_fp32_sampled", dict(dtype=FP32, rows=6, vocab=128256, temperature=0.6)),
    ("embed_rmsnorm_fp32", dict(vocab=151936, hidden=896, ids=tuple(range(0, 151936, 9497)) + (151935,))),
    ("embed_rmsnorm_bf16_unchained", dict(vocab=151936, hidden=1536, ids=(5,) * 40 + (151935,))),
    # a wide step over a long cache, a 64-wide head: splits of 256 keys read in tiles of 128
    (
        "decode_attention_fp32_rope_wide_long",
        dict(dtype=BF16, hq=14, hkv=2, d=64, m=1152, positions=(0, 255, 700)),
    ),
    # a short step over a long cache, a 64-wide head: the combine reads a row's nine parts in one trip
    (
        "decode_attention_fp32_rope_long_lanes",
        dict(dtype=BF16, b=7, hq=14, hkv=2, d=64, m=1152, positions=(0, 127, 128, 300, 700, 1000)),
    ),
    ("bwd_failure_falls_back", {}),
    ("frozen_forward_skips_autograd", {}),
]


@pytest.mark.parametrize("name,overrides", FULL, ids=[f"{n}-{i}" for i, (n, _) in enumerate(FULL)])
def test_kernel_matches_reference_full_size(name, overrides):
    from test_kernels_interp_cases import run_case

    r = run_case(name, device="cuda", **overrides)
    assert r["ok"], f"{r.get('error')}\n{r.get('trace', '')}"


def _pair(name_t: str, name_s: str, layers: int = 2):
    from kdistill.models.spec import load_spec

    return (
        dataclasses.replace(load_spec(name_t), num_layers=layers),
        dataclasses.replace(load_spec(name_s), num_layers=layers),
    )


@pytest.mark.parametrize(
    "pair", [("qwen2.5-1.5b", "qwen2.5-0.5b"), ("llama-3.2-3b", "llama-3.2-1b"), ("qwen3-1.7b", "qwen3-0.6b")]
)
def test_strict_prewarm_seal_train_step_compiles_nothing(pair, tmp_path, monkeypatch):
    """Real shapes (2 layers), bf16 autocast, strict: every launch after the seal hits the cache."""
    from test_contract import make_run

    from kdistill.kernels import runtime, seal
    from kdistill.models.decoder import build_decoder
    from kdistill.train.step import compute_loss, heldout_eval

    monkeypatch.setenv("KDISTILL_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    teacher_spec, student_spec = _pair(*pair)
    run = make_run(dtype="auto", batch=2, seq=256, divergence="jsd", alpha=0.5, chunk=256)
    run.runtime.kernels, run.runtime.strict_kernels = "triton", True
    run.kd.temperature = 2.0
    dev = torch.device("cuda")
    s = seal.start(run, teacher_spec, student_spec, dev, BF16, quiet=False)
    try:
        assert s.report is not None and not s.report.failed, s.report.failed
        teacher = build_decoder(teacher_spec, device=dev, dtype=BF16).eval().requires_grad_(False)
        student = build_decoder(student_spec, device=dev, dtype=FP32)
        ids = torch.randint(0, student_spec.vocab_size, (2, 256), device=dev)
        labels = ids.roll(-1, dims=1)
        amp = torch.autocast("cuda", dtype=BF16)
        # the training loop's own step and held-out eval (its operand casts and calls), twice
        for _ in range(2):
            r = compute_loss(student, teacher, ids, labels, run, amp)
            r.loss.backward()
            heldout_eval(student, teacher, [(ids, labels)], run, dev, amp, with_teacher_loss=True)
        torch.cuda.synchronize()
        assert torch.isfinite(r.loss)
        assert not runtime.current().warned, runtime.current().warned  # no reference fallback happened
        assert s.jit_after_prewarm() == 0, seal.cache_misses()
    finally:
        seal.unseal()
        runtime.configure(kernels="reference")


def test_second_prewarm_process_compiles_nothing(tmp_path):
    env = {**os.environ, "KDISTILL_CACHE_DIR": str(tmp_path)}
    env.pop("TRITON_CACHE_DIR", None)
    cmd = [
        sys.executable,
        "-m",
        "kdistill",
        "prewarm",
        "qwen2.5-1.5b:qwen2.5-0.5b",
        "data.seq_len=512",
        "schedule.batch_size=2",
    ]
    first = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    second = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert first.returncode == 0, first.stderr[-2000:]
    assert second.returncode == 0, second.stderr[-2000:]
    print(first.stdout, second.stdout)
    assert "(0 compiled" in second.stdout, second.stdout
