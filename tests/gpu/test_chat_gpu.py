"""Conversations on a GPU: a chat distillation run of the tiny pair with strict kernels (document-masked
attention, answers-only loss, eval samples) compiles nothing after the seal, and `kdistill generate
--chat` answers with its student on the GPU.

    PYTHONPATH=src:. python3 -m pytest -m gpu tests/gpu/test_chat_gpu.py
"""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from tests.test_chat_train import write_chat_files
from tests.test_train_kit import assets, base_config, read_summary, run_cli

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_chat_run_on_gpu_is_sealed_and_its_student_answers(tmp_path, capsys):
    data, template = write_chat_files(tmp_path / "data", n=80)
    cfg = base_config(tmp_path / "run", steps=6, eval_every=3, batch_size=4)
    cfg["data"] = {
        "train": [str(data)],
        "heldout_fraction": 0.2,
        "seq_len": 64,
        "chat_template": str(template),
        "cache_dir": str(assets().cache),
    }
    cfg["runtime"] = {"device": "cuda", "kernels": "triton", "strict_kernels": True}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    rc, out, err = run_cli(capsys, "run", str(path), "--quiet")
    assert rc == 0, err
    summary = read_summary(tmp_path / "run")
    assert summary["status"] == "completed"
    assert summary["jit_after_prewarm"] == 0
    assert summary["kernels"]["mode"] == "triton" and not summary["kernels"]["fallbacks"]
    assert summary["data"]["format"] == "conversations"
    samples = (tmp_path / "run" / "samples.jsonl").read_text().splitlines()
    assert samples, "no eval samples were written"

    student = tmp_path / "run" / "student"
    (student / "chat_template.jinja").write_text(template.read_text(), encoding="utf-8")
    rc, out, err = run_cli(
        capsys, "generate", "--model", str(student), "--prompt", "hello", "--chat",
        "--max-new-tokens", "8", "--device", "cuda", "--json",
    )  # fmt: skip
    assert rc == 0, err
    row = json.loads(out.strip().splitlines()[-1])
    assert isinstance(row["text"], str) and 1 <= len(row["token_ids"]) <= 8
