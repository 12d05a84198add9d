"""Intermediate-layer distillation (kd.layer_map): the decoder's collected layer outputs equal
transformers' hidden_states, the layer loss (hidden MSE / cosine through the projection, attention-map
KL) equals a dense formula written here from transformers' own hidden states and attention
probabilities, and a tiny run with a layer map trains and exports a student without the projection.

Run: .venv/bin/python -m pytest tests/test_layer_map.py -q
"""

from __future__ import annotations

import contextlib
import functools
import json

import pytest
import torch
import yaml

from kdistill.config import load_config
from kdistill.errors import UserError
from kdistill.models.hf_io import load_model
from kdistill.train import layers
from tests.test_train_kit import assets, base_config, final_weights, one_error_line, read_summary, run_cli
from tests.tiny import load_hf, make_tiny_model, sample_ids

MAP = [
    [0, 1],
    [1, 0],
    [2, 2],
]  # teacher layer, student layer (4 layers each: transformers final-norms the last one)


@functools.cache
def models():
    root = assets().root
    t = make_tiny_model(root, "qwen2", tied=False, seed=7, name="lm-teacher", hidden_size=64,
                        intermediate_size=96, num_hidden_layers=4)  # fmt: skip
    s = make_tiny_model(root, "llama", tied=True, seed=8, name="lm-student", num_hidden_layers=4)
    return t, s


@pytest.mark.parametrize("kind", ["mse", "cosine"])
def test_layer_loss_matches_dense_formula(kind):
    tdir, sdir = models()
    teacher, student = load_model(tdir), load_model(sdir)
    cfg = load_config(None, base={"kd": {"layer_map": MAP, "hidden_weight": 0.7, "hidden_loss": kind,
                                         "attention_weight": 0.3}}).validate(need_paths=False)  # fmt: skip
    layers.attach_projections(student, teacher.spec, cfg, seed=1)
    ids = sample_ids(300, batch=2, seq_len=12)
    labels = ids.roll(-1, 1)
    labels[:, -1] = -100
    labels[0, :3] = -100
    extra, _, _ = layers.layer_kd(student, teacher, ids, labels, cfg, contextlib.nullcontext())
    grads = torch.autograd.grad(extra, [student.kd_layer_proj["1"].weight])

    # The dense formula from transformers' own model: hidden_states[i + 1] is block i's output.
    ht, hs = load_hf(tdir), load_hf(sdir)
    ot = ht(ids, output_hidden_states=True, output_attentions=True)
    os_ = hs(ids, output_hidden_states=True, output_attentions=True)
    valid = (labels != -100).double()
    proj = {k: v.weight.detach().double().requires_grad_() for k, v in student.kd_layer_proj.items()}
    hid = att = 0.0
    for t, s in MAP:
        a = os_.hidden_states[s + 1].double() @ proj[str(s)].T
        b = ot.hidden_states[t + 1].double()
        if kind == "mse":
            rows = ((a - b) ** 2).mean(-1)
        else:
            rows = 1 - (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1))
        hid = hid + (rows * valid).sum() / valid.sum()
        p_t = ot.attentions[t].double().mean(1)  # (B, T, T) head-averaged
        p_s = os_.attentions[s].double().mean(1)
        kl = torch.where(p_t > 0, p_t * (p_t.log() - p_s.clamp_min(1e-300).log()), torch.zeros_like(p_t))
        att = att + (kl.sum(-1) * valid).sum() / valid.sum()
    expected = (0.7 * hid + 0.3 * att) / len(MAP)
    (g_expected,) = torch.autograd.grad(expected, [proj["1"]])
    assert abs(float(extra.detach()) - float(expected.detach())) < 2e-5 * max(
        1.0, abs(float(expected.detach()))
    )
    assert torch.allclose(grads[0].double(), g_expected, atol=1e-5, rtol=1e-4)


def test_collected_states_equal_transformers():
    tdir, _ = models()
    ours = load_model(tdir)
    ids = sample_ids(300, batch=2, seq_len=10, seed=3)
    final, states = ours(ids, collect={0, 2})
    hf = load_hf(tdir)(ids, output_hidden_states=True)
    assert set(states) == {0, 2}
    for i in (0, 2):
        assert torch.allclose(states[i], hf.hidden_states[i + 1], atol=1e-5)
    assert torch.equal(final, ours(ids))  # the default path is the same computation


def test_run_with_layer_map_exports_without_projection(tmp_path, capsys):
    cfg = base_config(tmp_path / "run", steps=6, checkpoint_every=3)
    cfg["kd"].update(layer_map=[[0, 0], [1, 1]], hidden_weight=0.5, attention_weight=0.1)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    rc, _, err = run_cli(capsys, "run", str(path), "--quiet")
    assert rc == 0, err
    run = tmp_path / "run"
    s = read_summary(run)
    assert s["status"] == "completed" and s["final_loss"] < s["initial_loss"]
    ckpt = final_weights(run)
    assert {k for k in ckpt if k.startswith("kd_layer_proj.")} == {
        "kd_layer_proj.0.weight",
        "kd_layer_proj.1.weight",
    }
    from safetensors.torch import load_file

    exported = load_file(str(run / "student" / "model.safetensors"))
    assert not any(k.startswith("kd_") for k in exported)
    assert json.loads((run / "student" / "config.json").read_text())["hidden_size"] == 32
    load_hf(run / "student")  # transformers loads it as is


def test_layer_map_errors(tmp_path, capsys):
    with pytest.raises(UserError, match="supported up to seq_len 1024"):
        load_config(None, base={"kd": {"layer_map": [[0, 0]], "attention_weight": 1.0},
                                "data": {"seq_len": 2048}}).validate(need_paths=False)  # fmt: skip
    with pytest.raises(UserError, match=r"kd.layer_map\[0\] is \[0\]"):
        load_config(None, base={"kd": {"layer_map": [[0]]}}).validate(need_paths=False)
    with pytest.raises(UserError, match="kd.hidden_loss"):
        load_config(None, base={"kd": {"hidden_loss": "l1"}}).validate(need_paths=False)
    cfg = base_config(tmp_path / "run", steps=2)
    cfg["kd"]["layer_map"] = [[5, 0]]
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    rc, _, err = run_cli(capsys, "run", str(path), "--quiet")
    assert rc != 0 and "kd.layer_map[0] is [5, 0], expected teacher layers < 2" in one_error_line(err)


def test_memory_plan_counts_the_layer_map(tmp_path):
    from kdistill.memory import estimate_memory
    from kdistill.models.spec import load_spec

    base = base_config(tmp_path / "run")
    plain = load_config(None, base=base).validate()
    base["kd"].update(layer_map=[[0, 0], [1, 1]], attention_weight=0.5)
    mapped = load_config(None, base=base).validate()
    t, s = load_spec(plain.teacher.path), load_spec(plain.student.path)
    m0, m1 = estimate_memory(t, s, plain), estimate_memory(t, s, mapped)
    assert m1["layer_projections"] == 2 * 32 * 64 * 16 and m1["layer_map"] > 0
    assert m1["total"] > m0["total"]
