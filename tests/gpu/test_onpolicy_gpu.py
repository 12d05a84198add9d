"""On-policy distillation on a GPU (run with `-m gpu`): strict kernels across generation, scoring and
the update (nothing compiled after the seal), for each on-policy loss, with the student writing every
step's completions and the teacher writing some.

    pytest -m gpu tests/gpu/test_onpolicy_gpu.py -q
"""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from tests.test_chat_train import write_chat_files
from tests.test_train_kit import base_config, read_summary, run_cli

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("loss", ["divergence", "sampled_reverse_kl"])
def test_strict_on_policy_run_compiles_nothing_after_the_seal(tmp_path, capsys, loss):
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
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    rc, _, err = run_cli(capsys, "run", str(path), "--quiet")
    assert rc == 0, err
    summary = read_summary(tmp_path / "run")
    assert summary["status"] == "completed" and summary["jit_after_prewarm"] == 0
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert {r.get("policy") for r in rows} >= {"on_policy", "seq_kd"}
    assert all(r["jit_after_prewarm"] == 0 for r in rows)
