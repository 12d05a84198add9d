"""GPU tests of kernel packs (run on a GPU with `-m gpu`): a pack built by `kdistill kernels build --out`
on this machine's CPU, with no GPU visible (the same Triton install as the runs below), is loaded in
fresh processes with empty Triton caches: `kdistill prewarm --pack` compiles nothing, and a strict
Qwen2.5-shaped train/eval step and a strict demo run compile nothing in prewarm and nothing after it;
the decode engine of `kdistill generate --kernel-pack`, from a pack of an on-policy plan, neither.

    pytest -m gpu tests/gpu/test_kernel_pack_gpu.py -q
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ROOT = Path(__file__).resolve().parents[2]
DEMO = str(ROOT / "src" / "kdistill" / "demo" / "demo.yaml")
PAIR = "qwen2.5-1.5b:qwen2.5-0.5b"
# The Qwen2.5 run below and its build share these (the plan's Triton keys follow the KD settings).
QWEN = ["data.seq_len=256", "schedule.batch_size=2", "kd.divergence=jsd", "kd.alpha=0.5", "kd.temperature=2"]


def _arch() -> str:
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}"


def _env(cache: Path, **extra: str) -> dict[str, str]:
    env = {**os.environ, "KDISTILL_CACHE_DIR": str(cache), "PYTHONPATH": str(ROOT / "src"), **extra}
    env.pop("TRITON_CACHE_DIR", None)
    return env


def _run(cmd: list[str], env: dict[str, str], timeout: int = 1200) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT)
    print(out.stdout[-3000:], out.stderr[-3000:])
    assert out.returncode == 0, out.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def cpu_pack(tmp_path_factory) -> Path:
    """The demo's and the Qwen2.5 pair's plans for this GPU's arch, built with CUDA hidden into one pack."""
    root = tmp_path_factory.mktemp("pack")
    env = _env(root / "build-cache", CUDA_VISIBLE_DEVICES="")
    kdistill = [sys.executable, "-m", "kdistill", "kernels", "build", "--arch", _arch()]
    # the run below overrides runtime.device (the demo's default is the CPU): the build plans for the
    # same run, so that its decode engines' keys are the GPU's (bf16), not the CPU's
    _run([*kdistill, DEMO, "runtime.device=cuda", "--out", str(root / "pack")], env)
    out = _run([*kdistill, PAIR, *QWEN, "--out", str(root / "pack")], env)
    assert "kernels written" in out.stdout
    return root / "pack"


def test_prewarm_from_a_cpu_built_pack_compiles_nothing(cpu_pack, tmp_path):
    cmd = [sys.executable, "-m", "kdistill", "prewarm", PAIR, *QWEN, "runtime.strict_kernels=true"]
    out = _run([*cmd, "--pack", str(cpu_pack)], _env(tmp_path / "fresh"))
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("prewarm:"))
    assert ", compiled 0, 0 from cache)" in line and "(0 missing)" in line, line
    assert "(from pack 0," not in line, line


STRICT_STEPS = """
import dataclasses, json, sys
import torch
from kdistill.commands.common import resolve_run
from kdistill.kernels import seal
from kdistill.models.decoder import build_decoder
from kdistill.train.step import compute_loss, heldout_eval

cfg, t, s = resolve_run(sys.argv[1], sys.argv[2:])
t, s = dataclasses.replace(t, num_layers=2), dataclasses.replace(s, num_layers=2)
dev, bf16 = torch.device("cuda"), torch.bfloat16
session = seal.start(cfg, t, s, dev, bf16)
teacher = build_decoder(t, device=dev, dtype=bf16).eval().requires_grad_(False)
student = build_decoder(s, device=dev, dtype=torch.float32)
ids = torch.randint(0, s.vocab_size, (2, 256), device=dev)
labels = ids.roll(-1, dims=1)
amp = torch.autocast("cuda", dtype=bf16)
for _ in range(2):   # the training loop's own step and held-out eval
    r = compute_loss(student, teacher, ids, labels, cfg, amp)
    r.loss.backward()
    heldout_eval(student, teacher, [(ids, labels)], cfg, dev, amp, with_teacher_loss=True)
torch.cuda.synchronize()
print(json.dumps({**session.summary()["prewarm"], "jit_after_prewarm": session.jit_after_prewarm(),
                  "loss": float(r.loss)}))
"""


def test_strict_qwen25_steps_from_a_cpu_built_pack_compile_nothing(cpu_pack, tmp_path):
    overrides = [
        *QWEN,
        "runtime.kernels=triton",
        "runtime.strict_kernels=true",
        f"runtime.kernel_pack={cpu_pack}",
    ]
    out = _run([sys.executable, "-c", STRICT_STEPS, PAIR, *overrides], _env(tmp_path / "fresh"))
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["compiled"] == 0 and r["from_pack"] > 0 and r["pack_missing"] == 0, r
    assert r["jit_after_prewarm"] == 0 and r["failed"] == [], r
    assert r["loss"] == r["loss"], r  # finite, not NaN


def test_strict_demo_run_from_a_cpu_built_pack_compiles_nothing(cpu_pack, tmp_path):
    run_dir = tmp_path / "demo"
    cmd = [
        sys.executable,
        "-m",
        "kdistill",
        "run",
        DEMO,
        "runtime.device=cuda",
        "runtime.strict_kernels=true",
        f"runtime.kernel_pack={cpu_pack}",
        "schedule.steps=6",
        "schedule.eval_every=3",
        "schedule.eval_batches=2",
        f"output.dir={run_dir}",
        "--quiet",
    ]
    _run(cmd, _env(tmp_path / "fresh"))
    summary = json.loads((run_dir / "summary.json").read_text())
    prewarm = summary["kernels"]["prewarm"]
    assert prewarm["compiled"] == 0 and prewarm["from_pack"] > 0 and prewarm["pack_missing"] == 0, prewarm
    assert summary["jit_after_prewarm"] == 0 and summary["kernels"]["fallbacks"] == [], summary["kernels"]


GENERATE = """
import json, sys
from kdistill.decode import Sampling
from kdistill.generate import build_engine, prepare_job, run_job
from kdistill.kernels.seal import jit_after_prewarm

job = prepare_job(sys.argv[1], prompts=["def main(", "import"])
engine, info = build_engine(job, Sampling(max_new_tokens=8), device="cuda", batch_size=2, kernel_pack=sys.argv[2])
rows = run_job(job, engine, [(0, 0), (1, 0)])
print(json.dumps({"prewarm": info["prewarm"], "jit_after_prewarm": jit_after_prewarm(), "rows": len(rows)}))
"""


def test_generate_from_a_pack_of_an_on_policy_plan_compiles_nothing(tmp_path):
    """An on-policy run's plan holds the decode engine's kernels (its rollouts run it): a pack built
    from it on the CPU serves `generate --kernel-pack` with the run's student, nothing compiled."""
    model = str(ROOT / "src" / "kdistill" / "demo" / "assets" / "teacher")
    plan = [DEMO, f"student.path={model}", "runtime.device=cuda", "kd.on_policy=0.5", "kd.max_new_tokens=32"]
    build = [sys.executable, "-m", "kdistill", "kernels", "build", "--arch", _arch(), *plan]
    _run([*build, "--out", str(tmp_path / "pack")], _env(tmp_path / "build-cache", CUDA_VISIBLE_DEVICES=""))
    out = _run([sys.executable, "-c", GENERATE, model, str(tmp_path / "pack")], _env(tmp_path / "fresh"))
    r = json.loads(out.stdout.strip().splitlines()[-1])
    line = r["prewarm"]
    assert ", compiled 0, 0 from cache)" in line and "(0 missing)" in line and "(from pack 0," not in line, (
        line
    )
    assert r["jit_after_prewarm"] == 0 and r["rows"] == 2, r
    assert "compiled anyway" not in out.stderr
