"""Mutation fuzzing of the readers: every mutant of a real-shaped config.json and run YAML, read through
read_json / read_yaml and checked field by field with Fields, raises nothing but UserError, and every
message is one short line."""

from __future__ import annotations

import time

import pytest

from kdistill.errors import UserError
from kdistill.jsonio import Fields, check_seed, finite_float, parse_json, parse_yaml
from tests.fuzz_util import json_mutants, yaml_mutants

# As transformers writes it for a tiny Qwen2 (Qwen2Config(...).to_json_string()), trimmed of the keys
# kdistill does not read, plus llama3 rope scaling.
QWEN2_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "hidden_act": "silu",
    "hidden_size": 32,
    "intermediate_size": 64,
    "max_position_embeddings": 256,
    "model_type": "qwen2",
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "factor": 8.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 128,
        "rope_type": "llama3",
    },
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "torch_dtype": "float32",
    "use_sliding_window": False,
    "vocab_size": 384,
}

RUN_YAML = {
    "teacher": {"path": "models/teacher"},
    "student": {"path": "models/student", "init": "teacher_layers"},
    "data": {"train": ["data/train.txt"], "seq_len": 64, "heldout_fraction": 0.1},
    "kd": {"alpha": 0.5, "temperature": 2.0, "divergence": "forward_kl"},
    "optim": {"lr": 0.0003, "weight_decay": 0.1, "grad_clip": 1.0},
    "schedule": {"steps": 20, "batch_size": 4, "seed": 0},
    "output": {"dir": "runs/tiny"},
}


def read_model_config(obj, where: str) -> dict:
    """What a model-spec reader takes from config.json, with every number feeding a division or an
    allocation range-checked."""
    f = Fields(obj, where)
    out = {
        "model_type": f.str("model_type", choices=("llama", "qwen2", "qwen3")),
        "architectures": f.optional("architectures", "list", item="str"),
        "hidden_size": f.int("hidden_size", min=1, max=1 << 20),
        "intermediate_size": f.int("intermediate_size", min=1, max=1 << 22),
        "num_hidden_layers": f.int("num_hidden_layers", min=1, max=1024),
        "num_attention_heads": f.int("num_attention_heads", min=1, max=4096),
        "num_key_value_heads": f.optional("num_key_value_heads", "int", min=1, max=4096),
        "head_dim": f.optional("head_dim", "int", min=1, max=4096),
        "vocab_size": f.int("vocab_size", min=1, max=1 << 24),
        "max_position_embeddings": f.int("max_position_embeddings", min=1, max=1 << 24),
        "rms_norm_eps": f.float("rms_norm_eps", min_exclusive=0, max=1),
        "rope_theta": f.float("rope_theta", default=10000.0, min_exclusive=0),
        "tie_word_embeddings": f.bool("tie_word_embeddings", default=False),
        "torch_dtype": f.optional("torch_dtype", "str", choices=("float32", "float16", "bfloat16")),
        "bos_token_id": f.optional("bos_token_id", "int", min=0),
        "eos_token_id": f.optional("eos_token_id", "int", min=0),
    }
    rope = f.optional("rope_scaling", "obj")
    if rope is not None:
        kind = rope.str("rope_type", choices=("default", "linear", "dynamic", "llama3"))
        if kind == "llama3":
            rope.float("factor", min_exclusive=0)
            low = rope.float("low_freq_factor", min_exclusive=0)
            rope.float("high_freq_factor", min_exclusive=low)
            rope.int("original_max_position_embeddings", min=1)
    return out


def read_run_config(obj, where: str) -> None:
    f = Fields(obj, where)
    f.obj("teacher").str("path", nonempty=True)
    s = f.obj("student")
    s.str("path", nonempty=True)
    s.str("init", default="random", choices=("random", "teacher_layers", "pretrained"))
    d = f.obj("data")
    d.list("train", item="str", min_len=1)
    d.int("seq_len", min=1)
    d.float("heldout_fraction", min=0, max_exclusive=1)
    kd = f.obj("kd")
    kd.float("alpha", min=0, max=1)
    kd.float("temperature", min_exclusive=0)
    kd.str("divergence", choices=("forward_kl", "reverse_kl", "jsd", "tvd"))
    o = f.obj("optim")
    finite_float(f"{where}: optim.lr", o.raw("lr"), min_exclusive=0)
    o.float("weight_decay", min=0)
    o.float("grad_clip", min=0)
    sc = f.obj("schedule")
    sc.int("steps", min=1)
    sc.int("batch_size", min=1)
    check_seed("schedule.seed", sc.raw("seed"), prefix=f"{where}: ")
    f.obj("output").str("dir", nonempty=True)


def _only_user_errors(mutants, parse, check) -> tuple[int, int]:
    ok = refused = 0
    for label, text in mutants:
        try:
            check(parse(text))
            ok += 1
        except UserError as e:
            msg = str(e)
            assert "\n" not in msg and len(msg) < 300, (label, msg[:500])
            refused += 1
        except Exception as e:  # pragma: no cover - the failure this test exists to find
            pytest.fail(f"mutant {label!r}: {type(e).__name__} escaped: {str(e)[:300]}")
    return ok, refused


def test_the_samples_are_valid():
    read_model_config(QWEN2_CONFIG, "config.json")
    read_run_config(RUN_YAML, "run.yaml")


@pytest.mark.parametrize("seed", [0, 1])
def test_config_json_mutants_raise_only_user_error(seed):
    t = time.perf_counter()
    mutants = list(json_mutants(QWEN2_CONFIG, seed))
    ok, refused = _only_user_errors(
        mutants,
        lambda text: parse_json(text, where="m/config.json"),
        lambda obj: read_model_config(obj, "m/config.json"),
    )
    assert len(mutants) > 600 and refused > 500 and ok > 10, (len(mutants), ok, refused)
    assert time.perf_counter() - t < 15


@pytest.mark.parametrize("seed", [0, 1])
def test_run_yaml_mutants_raise_only_user_error(seed):
    mutants = list(yaml_mutants(RUN_YAML, seed))
    ok, refused = _only_user_errors(
        mutants,
        lambda text: parse_yaml(text, where="run.yaml"),
        lambda obj: read_run_config(obj, "run.yaml"),
    )
    assert len(mutants) > 500 and refused > 400 and ok > 10, (len(mutants), ok, refused)


def test_mutants_are_deterministic():
    assert list(json_mutants(QWEN2_CONFIG, 3)) == list(json_mutants(QWEN2_CONFIG, 3))
    assert [t for _, t in yaml_mutants(RUN_YAML, 3)] == [t for _, t in yaml_mutants(RUN_YAML, 3)]
