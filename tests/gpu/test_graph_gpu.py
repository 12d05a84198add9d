"""The training step captured as a CUDA graph (runtime.cuda_graphs): the replayed steps' losses, gradient
norms and final weights equal an eager run's bit for bit, capture compiles nothing, and a non-finite
step is still skipped on the device.

    PYTHONPATH=src:. python3 -m pytest -m gpu tests/gpu/test_graph_gpu.py
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from kdistill.train.checkpoint import load_checkpoint
from tests.test_train_kit import assets, base_config, read_summary, run_cli

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _strict_run(tmp_path: Path, capsys, name: str, cfg: dict, graphs: str) -> tuple[list[dict], dict, dict]:
    """Run `cfg` with strict kernels and runtime.cuda_graphs=graphs, clipping on (inside the captured
    step): its metrics rows, summary and final weights."""
    cfg["runtime"] = {"device": "cuda", "kernels": "triton", "strict_kernels": True, "cuda_graphs": graphs}
    cfg["optim"]["grad_clip"] = 0.5  # clipping happens inside the captured step
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    rc, _, err = run_cli(capsys, "run", str(path), "--quiet")
    assert rc == 0, err
    run = tmp_path / name
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    final = sorted(p for p in (run / "checkpoints").iterdir() if p.name.startswith("step-"))[-1]
    weights, _, _ = load_checkpoint(final)
    return rows, read_summary(run), weights


def _run(
    tmp_path: Path, capsys, name: str, graphs: str, lora: bool = False, **schedule
) -> tuple[list[dict], dict, dict]:
    cfg = base_config(tmp_path / name, **schedule)
    if lora:  # adapters with dropout: the mask is drawn inside the captured step
        cfg["student"] = {
            "path": str(assets().student),
            "init": "pretrained",
            "lora": {
                "rank": 4,
                "alpha": 8,
                "dropout": 0.1,
                "targets": ["q_proj", "v_proj", "gate_proj", "down_proj"],
            },
        }
    return _strict_run(tmp_path, capsys, name, cfg, graphs)


@pytest.mark.parametrize("grad_accum,steps,lora", [(1, 20, False), (2, 10, False), (1, 12, True)])
def test_captured_steps_equal_eager_steps_bit_for_bit(tmp_path, capsys, grad_accum, steps, lora):
    kw = dict(steps=steps, grad_accum=grad_accum, lora=lora)
    eager, s_eager, w_eager = _run(tmp_path, capsys, "eager", "off", **kw)
    graph, s_graph, w_graph = _run(tmp_path, capsys, "graph", "on", **kw)
    assert s_eager["cuda_graphs"] == "off"
    counts = s_graph["cuda_graphs"]
    assert counts["captures"] == 1 and counts["eager_steps"] == 2, counts
    assert counts["replays"] == steps - 2, counts
    assert s_graph["jit_after_prewarm"] == 0 and s_eager["jit_after_prewarm"] == 0
    for key in ("loss", "ce", "kd", "grad_norm"):
        assert [r[key] for r in graph] == [r[key] for r in eager], key
    for k in w_eager:
        assert torch.equal(w_eager[k], w_graph[k]), k


def test_a_nonfinite_replayed_step_is_skipped_on_the_device(tmp_path, capsys, monkeypatch):
    # the poisoned weight is written in place before the replay: steps 5 and 6 are replayed on it
    monkeypatch.setenv("KDISTILL_TEST_POISON_STEP", "5")
    cfg = base_config(tmp_path / "run", steps=6, checkpoint_every=1)
    cfg["output"]["keep_checkpoints"] = 6
    cfg["runtime"] = {"device": "cuda", "kernels": "triton", "strict_kernels": True, "cuda_graphs": "on"}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    rc, _, err = run_cli(capsys, "run", str(path), "--quiet")
    assert rc == 0, err
    run = tmp_path / "run"
    summary = read_summary(run)
    assert summary["nonfinite_skipped"] == 2 and summary["jit_after_prewarm"] == 0
    assert summary["cuda_graphs"]["replays"] == 4, summary["cuda_graphs"]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("skipped") is None for r in rows] == [True] * 4 + [False] * 2
    ckpt = {p.name: load_checkpoint(p) for p in (run / "checkpoints").iterdir() if p.name.startswith("step-")}
    _, o4, _ = ckpt["step-0000004"]
    _, o6, s6 = ckpt["step-0000006"]
    for k in o4:  # AdamW's moments and step counts did not move on the skipped replays
        assert torch.equal(o4[k], o6[k]), k


def _on_policy_run(tmp_path: Path, capsys, name: str, graphs: str) -> tuple[list[dict], dict, dict]:
    return _strict_run(tmp_path, capsys, name, _on_policy_config(tmp_path, name), graphs)


def _on_policy_config(tmp_path: Path, name: str) -> dict:
    from tests.test_chat_train import write_chat_files

    data, template = write_chat_files(tmp_path / f"{name}-data", n=60)
    cfg = base_config(tmp_path / name, steps=8, batch_size=4, grad_accum=2)
    cfg["data"] = {
        "train": [str(data)],
        "heldout_fraction": 0.2,
        "seq_len": 48,
        "chat_template": str(template),
    }
    # near-uniform sampling over the tiny vocabulary: some rows stop early, so token counts differ
    cfg["kd"].update(on_policy=1.0, max_new_tokens=32, divergence="jsd", sample_temperature=2.0)
    cfg["schedule"]["sample_prompts"] = 0
    return cfg


def test_captured_on_policy_updates_equal_eager_ones_bit_for_bit(tmp_path, capsys, monkeypatch):
    """Every step on-policy, completions of varying length: the update is captured once and replayed at
    every count of completion tokens, equal bit for bit to the same run's eager steps (capture held off),
    and within rounding of a run that never captures (the KD head counts its rows on the host there)."""
    from kdistill.train import graph as graph_mod

    graph, s_graph, w_graph = _on_policy_run(tmp_path, capsys, "graph", "on")
    counts = s_graph["cuda_graphs"]
    # the teacher's scoring forward has graphs of its own: 2 micro-batches a step, captured after 2 eager
    want = {"captures": 1, "replays": 6, "eager_steps": 2, "scoring_captures": 1, "scoring_replays": 14}
    assert counts == want, counts
    assert len({r["completion_tokens"] for r in graph}) > 1  # the replays saw several token counts
    monkeypatch.setattr(graph_mod, "WARM_STEPS", 10**6)
    held, s_held, w_held = _on_policy_run(tmp_path, capsys, "held", "on")
    assert s_held["cuda_graphs"]["captures"] == 0 and s_held["cuda_graphs"]["eager_steps"] == 8
    for key in ("loss", "kd", "grad_norm", "completion_tokens"):
        assert [r[key] for r in graph] == [r[key] for r in held], key
    for k in w_held:
        assert torch.equal(w_held[k], w_graph[k]), k
    monkeypatch.undo()
    eager, s_eager, _ = _on_policy_run(tmp_path, capsys, "eager", "off")
    assert s_eager["cuda_graphs"] == "off"
    assert s_graph["jit_after_prewarm"] == 0 and s_held["jit_after_prewarm"] == 0
    first = [r["loss"] for r in eager][:1], [r["loss"] for r in graph][:1]  # same samples at step 1
    assert first[0][0] == pytest.approx(first[1][0], rel=1e-3)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_captured_on_policy_updates_under_torchrun_equal_eager_ones_bit_for_bit(tmp_path):
    """Two GPUs, a whole student on each (runtime.student_placement=replicate): the update is captured
    with its collectives (the logged means' all-reduce and the gradients' average) and replayed at every
    count of completion tokens, equal bit for bit to the same run's eager steps (capture held off)."""
    from kdistill.train.faults import HOLD_CAPTURE_ENV
    from tests.test_distributed import torchrun

    out = {}
    for name, env in (("graph", {}), ("held", {HOLD_CAPTURE_ENV: "1"})):
        cfg = _on_policy_config(tmp_path, name)
        cfg["runtime"] = {
            "device": "cuda",
            "kernels": "triton",
            "strict_kernels": True,
            "cuda_graphs": "on",
            "student_placement": "replicate",
        }
        cfg["optim"]["grad_clip"] = 0.5  # clipping happens inside the captured step
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        r = torchrun(["run", str(path), "--quiet"], timeout=900, **env)
        assert r.returncode == 0, r.stderr[-5000:]
        assert "teardown did not end" not in r.stderr  # every graph released before the group went
        run = tmp_path / name
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        summary = read_summary(run)
        assert summary["world_size"] == 2 and summary["layout"]["student_replicated"]
        assert summary["jit_after_prewarm"] == 0
        out[name] = rows, summary, (run / "student" / "model.safetensors").read_bytes()
    (graph, s_graph, w_graph), (held, s_held, w_held) = out["graph"], out["held"]
    want = {"captures": 1, "replays": 6, "eager_steps": 2, "scoring_captures": 1, "scoring_replays": 14}
    assert s_graph["cuda_graphs"] == want, s_graph["cuda_graphs"]
    assert s_held["cuda_graphs"]["captures"] == 0 and s_held["cuda_graphs"]["eager_steps"] == 8
    assert len({r["completion_tokens"] for r in graph}) > 1  # the replays saw several token counts
    for key in ("loss", "kd", "grad_norm", "completion_tokens"):
        assert [r[key] for r in graph] == [r[key] for r in held], key
    assert w_graph == w_held  # the exported student, byte for byte
