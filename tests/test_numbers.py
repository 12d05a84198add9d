"""Sizes and ranks the user types are checked against the model before anything is allocated: data
preview's --seq-len against the model's context, a LoRA rank against the student's linears, an adapter's
r against its config and tensors. Each is one line naming the number and its limit."""

from __future__ import annotations

import json
import shutil
import tracemalloc

import pytest
import yaml

from tests.chat_tiny import make_chat_model_dir
from tests.test_train_kit import assets, base_config, one_error_line, run_cli


def test_preview_seq_len_beyond_the_models_context(tmp_path, capsys):
    model = make_chat_model_dir(tmp_path, "qwen2.5")  # a tokenizer-only folder: a fixed cap
    data = tmp_path / "a.jsonl"
    data.write_text(json.dumps({"prompt": "Hi", "completion": "Hello"}) + "\n")
    argv = ("data", "preview", "--model", str(model), "--data", str(data), "--seq-len")
    rc, _, err = run_cli(capsys, *argv, "1000000000")
    assert rc == 2 and "--seq-len is 1000000000, expected at most 1048576" in one_error_line(err)
    shutil.copy(assets().student / "config.json", model / "config.json")
    limit = json.loads((model / "config.json").read_text())["max_position_embeddings"]
    tracemalloc.start()
    rc, _, err = run_cli(capsys, *argv, "1000000000")
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert rc == 2 and one_error_line(err) == (
        f"--seq-len is 1000000000, expected at most {limit} (max_position_embeddings of {model / 'config.json'})"
    )
    assert peak < 64 << 20  # refused before any row was allocated


def _lora_cfg(tmp_path, rank):
    cfg = base_config(tmp_path / "run", steps=1)
    cfg["student"] = {
        "path": str(assets().student),
        "init": "pretrained",
        "lora": {"rank": rank, "targets": ["q_proj", "down_proj"]},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def test_a_lora_rank_larger_than_the_linears_names_the_rank(tmp_path, capsys):
    cfg = json.loads((assets().student / "config.json").read_text())
    q_out = cfg["num_attention_heads"] * cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    limit = min(cfg["hidden_size"], q_out, cfg["intermediate_size"])
    rc, _, err = run_cli(capsys, "run", str(_lora_cfg(tmp_path, 10**7)), "--quiet")
    assert rc == 2
    line = one_error_line(err)
    assert line.startswith(f"student.lora.rank is 10000000, expected at most {limit} (the smallest dimension")
    assert "batch" not in line and not (tmp_path / "run").exists()


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    from kdistill.cli import main

    root = tmp_path_factory.mktemp("numbers")
    assert main(["run", str(_lora_cfg(root, 2)), "--quiet"]) == 0
    return root / "run"


@pytest.mark.parametrize(
    "edit,needle",
    [
        ({"r": 0}, "r is 0, expected a positive integer"),
        ({"r": -3}, "r is -3, expected a positive integer"),
        ({"r": "8"}, "r is '8', expected a positive integer"),
        ({"r": 10**9}, "not rank r=1000000000"),
        ({"lora_alpha": 0}, "lora_alpha is 0, expected a positive number"),
        ({"target_modules": []}, "target_modules is [], expected a module name"),
    ],
)
def test_an_adapter_with_a_bad_rank_is_one_line(lora_run, tmp_path, capsys, edit, needle):
    run = tmp_path / "run"
    shutil.copytree(lora_run, run)
    adapter_cfg = run / "adapter" / "adapter_config.json"
    adapter_cfg.write_text(json.dumps({**json.loads(adapter_cfg.read_text()), **edit}))
    rc, _, err = run_cli(capsys, "export", "--run", str(run), "--merge", "--out", str(tmp_path / "m"))
    assert rc == 2 and needle in one_error_line(err)
    assert not (tmp_path / "m").exists()
