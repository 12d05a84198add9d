"""A training run on a GPU: a non-finite step is skipped on the device (the fused AdamW's found_inf
flag, no wait for the GPU inside the step) and changes no weight and no AdamW state.

    PYTHONPATH=src:. python3 -m pytest -m gpu tests/gpu/test_train_gpu.py
"""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from kdistill.train.checkpoint import load_checkpoint
from tests.test_train_kit import base_config, read_summary, run_cli

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_nonfinite_step_is_skipped_on_the_device_and_changes_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("KDISTILL_TEST_NAN_STEPS", "3")
    cfg = base_config(tmp_path / "run", steps=4, checkpoint_every=1, batch_size=4)
    cfg["output"]["keep_checkpoints"] = 4
    cfg["runtime"] = {"device": "cuda", "kernels": "triton", "strict_kernels": True}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    rc, _, err = run_cli(capsys, "run", str(path), "--quiet")
    assert rc == 0, err
    run = tmp_path / "run"
    summary = read_summary(run)
    assert summary["nonfinite_skipped"] == 1 and summary["jit_after_prewarm"] == 0
    assert summary["kernels"]["mode"] == "triton"
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("skipped") for r in rows] == [None, None, "loss is nan", None]
    ckpt = {p.name: load_checkpoint(p) for p in (run / "checkpoints").iterdir() if p.name.startswith("step-")}
    w2, o2, s2 = ckpt["step-0000002"]
    w3, o3, s3 = ckpt["step-0000003"]
    w4, _, _ = ckpt["step-0000004"]
    assert s3["step"] == 3
    for k in w2:  # the skipped step changed no weight, moment or step count
        assert torch.equal(w2[k], w3[k]), k
    for k in o2:
        assert torch.equal(o2[k], o3[k]), k
    assert any(not torch.equal(w3[k], w4[k]) for k in w3)  # the next step trains again


def test_a_profiled_runs_top_kernels_name_the_host_ops_that_launched_them(tmp_path, capsys):
    """runtime.profile_steps with profile_shapes on a GPU: every top kernel lists its launchers, the
    training step's phase among them, with the inner op's input shapes."""
    cfg = base_config(tmp_path / "run", steps=4, batch_size=4)
    cfg["runtime"] = {"device": "cuda", "profile_steps": 1, "profile_shapes": True, "cuda_graphs": "off"}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    rc, _, err = run_cli(capsys, "run", str(path), "--quiet")
    assert rc == 0, err
    report = json.loads((tmp_path / "run" / "profile" / "rank0.json").read_text())
    tops = report["top_kernels"]
    assert tops and all(k["launched_by"] for k in tops)
    chains = [r for k in tops for r in k["launched_by"]]
    assert any(r["phase"] == "step" for r in chains)
    assert any(r.get("shapes") for r in chains)  # recorded shapes name what the ops ran on
    for k in tops:  # a kernel's launchers hold at most its own time
        assert sum(r["ms_per_step"] for r in k["launched_by"]) <= k["ms_per_step"] + 1e-3
