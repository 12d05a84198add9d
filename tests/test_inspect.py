"""`kdistill inspect` through the real CLI entry point: a directory, a preset, and the error path."""

from __future__ import annotations

import json

import torch

from kdistill.cli import main
from kdistill.models.inspect import inspect_model
from kdistill.models.tokenizer import load_tokenizer
from tests.tiny import make_tiny_model


def test_inspect_directory_json(tmp_path, capsys):
    d = make_tiny_model(tmp_path, family="llama", tied=False, vocab_pad=16, dtype=torch.bfloat16)
    assert main(["inspect", str(d), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["source"] == "directory"
    assert info["architecture"]["arch"] == "llama"
    assert info["architecture"]["num_layers"] == 2 and info["architecture"]["hidden_size"] == 32
    assert info["architecture"]["rope_scaling"]["factor"] == 8.0
    assert info["weights_dtype"] == "bfloat16"
    assert (
        info["embedding_rows"] == 400 and info["tokenizer_vocab_size"] == 384 and info["vocab_padding"] == 16
    )
    assert info["params"]["total"] == info["stored_params"]
    assert len(info["tokenizer_identity"]) == 64
    assert info["tokenizer_identity"] == load_tokenizer(d).identity


def test_inspect_table_and_identity_is_shared(tmp_path, capsys):
    a = make_tiny_model(tmp_path, family="qwen2", tied=True, name="a")
    b = make_tiny_model(tmp_path, family="qwen3", tied=False, name="b", vocab_pad=8)
    assert main(["inspect", str(a)]) == 0
    out = capsys.readouterr().out
    for field in ("architecture", "qwen2", "params total", "weights dtype", "float32", "tokenizer identity"):
        assert field in out
    # same tokenizer, different models: same identity; tied model has no lm_head params
    assert inspect_model(a)["tokenizer_identity"] == inspect_model(b)["tokenizer_identity"]
    assert inspect_model(a)["params"]["lm_head"] == 0


def test_inspect_preset(capsys):
    assert main(["inspect", "qwen2.5-0.5b", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["source"] == "preset" and info["name"] == "qwen2.5-0.5b"
    assert info["architecture"]["hidden_size"] == 896
    assert 480e6 < info["params"]["total"] < 500e6
    assert "tokenizer_identity" not in info


def test_inspect_errors_are_one_line_exit_2(tmp_path, capsys):
    d = make_tiny_model(tmp_path, family="qwen2")
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:100])
    assert main(["inspect", str(d)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kdistill: error: ") and "Traceback" not in err
    assert str(f) in err and "truncated" in err

    assert main(["inspect", str(tmp_path / "nothing-here")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a model directory, config.json or preset" in err
