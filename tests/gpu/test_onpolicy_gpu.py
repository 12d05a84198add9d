"""On-policy distillation on a GPU (run with `-m gpu`): strict kernels across generation, scoring and
the update (nothing compiled after the seal), for each on-policy loss, with the student writing every
step's completions and the teacher writing some; and the same under torchrun on 2 GPUs (FSDP2, the
teacher sharded: each decode engine gathers its writer's weights, every process writes its own rows).

    pytest -m gpu tests/gpu/test_onpolicy_gpu.py -q
"""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from tests.test_chat_train import write_chat_files
from tests.test_distributed import torchrun
from tests.test_train_kit import base_config, read_summary, run_cli

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _config(tmp_path, loss: str) -> dict:
    data, template = write_chat_files(tmp_path / "data", n=60)
    cfg = base_config(tmp_path / "run", steps=6, batch_size=4, grad_accum=2)
    cfg["data"] = {
        "train": [str(data)],
        "heldout_fraction": 0.2,
        "seq_len": 48,
        "chat_template": str(template),
    }
    cfg["kd"].update(
        on_policy=0.7, seq_kd=1.0, on_policy_loss=loss, max_new_tokens=16, divergence="reverse_kl"
    )
    cfg["schedule"]["sample_prompts"] = 0
    cfg["runtime"] = {"device": "cuda", "kernels": "triton", "strict_kernels": True}
    return cfg


def _check(run_dir) -> list[dict]:
    summary = read_summary(run_dir)
    assert summary["status"] == "completed" and summary["jit_after_prewarm"] == 0
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert {r.get("policy") for r in rows} >= {"on_policy", "seq_kd"}
    assert all(r["jit_after_prewarm"] == 0 for r in rows)
    return rows


@pytest.mark.parametrize("loss", ["divergence", "sampled_reverse_kl"])
def test_strict_on_policy_run_compiles_nothing_after_the_seal(tmp_path, capsys, loss):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(_config(tmp_path, loss)))
    rc, _, err = run_cli(capsys, "run", str(path), "--quiet")
    assert rc == 0, err
    _check(tmp_path / "run")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_strict_two_gpu_on_policy_run_under_torchrun(tmp_path):
    cfg = _config(tmp_path, "divergence")
    cfg["runtime"]["teacher_placement"] = "shard"  # the teacher's engine gathers it whole to write
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    r = torchrun(["run", str(path), "--quiet"], timeout=900)
    # strict kernels: a compile after the seal on any process would have failed the run
    assert r.returncode == 0, r.stderr[-5000:]
    rows = _check(tmp_path / "run")
    summary = read_summary(tmp_path / "run")
    assert summary["world_size"] == 2 and summary["layout"]["teacher_sharded"]
    # every generated step: both processes' samples, 2 micro-batches of 4 rows
    assert all(r["completions"] == 8 for r in rows if "policy" in r)


def test_a_strict_on_policy_run_with_8192_new_tokens(tmp_path, capsys):
    """Reasoning-length completions: up to 8,192 new tokens a row (sampled, so rows stop at EOS at very
    different lengths), scored and trained at that length, with nothing compiled after the seal and the
    memory plan's generation phase (the KV cache of every row at data.seq_len slots) covering the run."""
    from tests.tiny import make_tiny_model

    shape = dict(
        hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=8448,
    )  # fmt: skip
    teacher = make_tiny_model(
        tmp_path, "qwen2", tied=True, seed=1, name="teacher-8k", num_hidden_layers=4, **shape
    )
    student = make_tiny_model(
        tmp_path, "qwen2", tied=True, seed=2, name="student-8k", num_hidden_layers=2, **shape
    )
    cfg = _config(tmp_path, "divergence")
    cfg["teacher"] = {"path": str(teacher)}
    cfg["student"] = {"path": str(student)}
    cfg["data"]["seq_len"] = 8192 + 64
    cfg["kd"].update(on_policy=1.0, seq_kd=0.0, max_new_tokens=8192, sample_temperature=1.0)
    cfg["schedule"].update(steps=2, batch_size=4, grad_accum=1)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    rc, _, err = run_cli(capsys, "run", str(path), "--quiet")
    assert rc == 0, err
    summary = read_summary(tmp_path / "run")
    assert summary["status"] == "completed" and summary["jit_after_prewarm"] == 0
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    gen = [r for r in rows if r.get("policy") == "on_policy"]
    assert gen and all(r["jit_after_prewarm"] == 0 for r in rows)
    print(
        "8k on-policy:", {k: summary.get(k) for k in ("planned_memory_gib", "peak_memory_gib", "on_policy")}
    )
    from kdistill.config import load_config
    from kdistill.memory import GIB, Layout, estimate_memory
    from kdistill.models.spec import load_spec

    terms = estimate_memory(
        load_spec(str(teacher)), load_spec(str(student)), load_config(path), batch=4,
        layout=Layout(**summary["layout"]),
    )  # fmt: skip
    print("8k plan terms (GiB):", {k: round(v / GIB, 4) for k, v in terms.items()})
    assert summary["planned_memory_gib"] >= summary["peak_memory_gib"] * 0.85


def test_a_strict_on_policy_run_across_tokenizers_compiles_nothing_after_the_seal(tmp_path, capsys):
    """A Llama-3-style teacher and a ChatML student with different vocabularies: the student writes
    completions with its own engine, they are re-tokenized for the teacher and graded by the aligned
    ULD term plus the exact term; every kernel of generation, both scorings and the update was planned."""
    from tests.test_cross_chat import _config as cross_config

    cfg = cross_config(tmp_path, steps=6, eval_every=3)
    cfg["kd"].update(on_policy=0.7, max_new_tokens=24, divergence="reverse_kl", exact_weight=0.5)
    cfg["runtime"] = {"device": "cuda", "kernels": "triton", "strict_kernels": True}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    rc, _, err = run_cli(capsys, "run", str(path), "--quiet")
    assert rc == 0, err
    summary = read_summary(tmp_path / "run")
    assert summary["status"] == "completed" and summary["jit_after_prewarm"] == 0
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("policy") == "on_policy" for r in rows)
    assert all(r["jit_after_prewarm"] == 0 for r in rows)
    print("cross-tokenizer on-policy:", {k: summary.get(k) for k in ("jit_after_prewarm", "on_policy")})
