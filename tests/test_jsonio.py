"""The one way in for JSON, JSONL and YAML files: size and depth limits, duplicate YAML keys, bounded
alias expansion, typed fields with one-line errors, short reprs of echoed values."""

from __future__ import annotations

import json
import math
import time
import tracemalloc

import pytest

from kdistill.errors import UserError
from kdistill.jsonio import (
    Fields,
    check_int,
    check_seed,
    finite_float,
    iter_jsonl,
    parse_json,
    parse_yaml,
    read_json,
    read_yaml,
    short_repr,
)


def _err(fn, *a, **kw) -> str:
    with pytest.raises(UserError) as e:
        fn(*a, **kw)
    msg = str(e.value)
    assert "\n" not in msg and len(msg) < 400, msg
    return msg


def billion_laughs(levels: int = 9) -> str:
    text = 'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n'
    prev = "a"
    for name in "bcdefghijk"[:levels]:
        text += f"{name}: &{name} [{','.join(['*' + prev] * 9)}]\n"
        prev = name
    return text


# ----------------------------------------------------------------------------------------------
# short_repr


def test_short_repr_is_bounded_and_cheap():
    assert short_repr("abc") == "'abc'"
    assert short_repr(1.5) == "1.5"
    assert len(short_repr("x" * 10**7)) == 60
    assert short_repr("x" * 100).endswith("...")
    assert short_repr(10**5000) == "<int of 16610 bits>"
    shared: list = ["lol"] * 9
    for _ in range(30):  # 9**30 leaves if expanded
        shared = [shared] * 9
    t = time.perf_counter()
    assert len(short_repr(shared, 80)) <= 80
    assert time.perf_counter() - t < 0.1
    assert short_repr({"a": [1, 2]}) == "{'a': [1, 2]}"
    assert short_repr("a\ud800") == "'a\\ud800'"  # printable on any terminal


# ----------------------------------------------------------------------------------------------
# JSON


def test_read_json_reads_an_object(tmp_path):
    p = tmp_path / "config.json"
    p.write_text('\ufeff{"a": 1, "b": [1, 2]}')
    assert read_json(p) == {"a": 1, "b": [1, 2]}


@pytest.mark.parametrize(
    "content,expected",
    [
        (b"[1, 2]", "expected a JSON object at the top level, got a list"),
        (b'{"a": 1', "not valid JSON (Expecting ',' delimiter at line 1, column 8)"),
        (b"", "not valid JSON (Expecting value at line 1, column 1)"),
        (b'{"a": "caf\xe9"}', "not UTF-8 (invalid byte at offset 10)"),
        (b"[" * 100_000, "not valid JSON (nested too deeply)"),
        (b"[" * 70 + b"]" * 70, "nested too deeply (more than 64 levels of objects and lists)"),
        (b'{"a": ' + b"9" * 5000 + b"}", "not valid JSON (Exceeds the limit (4300 digits)"),
    ],
)
def test_read_json_refuses_bad_files_in_one_line(tmp_path, content, expected):
    p = tmp_path / "c.json"
    p.write_bytes(content)
    msg = _err(read_json, p)
    assert msg.startswith(f"{p}: ") and expected in msg, msg


def test_read_json_size_limit_and_missing_file(tmp_path):
    p = tmp_path / "big.json"
    p.write_text(json.dumps({"a": "x" * 2000}))
    assert _err(read_json, p, max_bytes=1000, what="a config.json") == (
        f"{p}: larger than 1000 bytes (expected a config.json)"
    )
    assert _err(read_json, tmp_path / "nope.json", what="a config.json") == (
        f"{tmp_path / 'nope.json'}: no such file (expected a config.json)"
    )
    assert "is a directory" in _err(read_json, tmp_path)


def test_nan_literals_parse_but_finite_fields_refuse_them():
    obj = parse_json('{"x": NaN, "y": Infinity, "z": -Infinity, "w": 1e400}', where="m.json")
    f = Fields(obj, where="m.json")
    for key, shown in [("x", "nan"), ("y", "inf"), ("z", "-inf"), ("w", "inf")]:
        assert _err(f.float, key) == f"m.json: {key} is {shown}, expected a finite number"
    assert math.isinf(f.float("y", finite=False))
    assert _err(f.float, "x", finite=False) == "m.json: x is nan, expected a number"


# ----------------------------------------------------------------------------------------------
# JSONL


def test_iter_jsonl_lines_and_errors(tmp_path):
    p = tmp_path / "m.jsonl"
    p.write_text('{"step": 1}\n\n{"step": 2}\n')
    assert list(iter_jsonl(p)) == [(1, {"step": 1}), (3, {"step": 2})]
    p.write_text('{"step": 1}\n{"step": oops}\n')
    assert _err(lambda: list(iter_jsonl(p))) == f"{p} line 2: not valid JSON (Expecting value at column 10)"
    p.write_bytes(b'{"a": 1}\n' + b"[" * 100_000 + b"\n")
    assert _err(lambda: list(iter_jsonl(p))) == f"{p} line 2: not valid JSON (nested too deeply)"
    p.write_bytes(b'{"a": 1}\n{"t": "' + b"x" * 3000 + b'"}\n')
    assert _err(lambda: list(iter_jsonl(p, max_line_bytes=1000))) == (
        f"{p} line 2: longer than 1000 bytes, expected one JSON value per line"
    )


def test_iter_jsonl_skips_a_torn_last_line_only_when_asked(tmp_path):
    p = tmp_path / "metrics.jsonl"
    p.write_text('{"step": 1}\n{"step": 2}\n{"step": 3, "lo')
    assert list(iter_jsonl(p, skip_torn_tail=True)) == [(1, {"step": 1}), (2, {"step": 2})]
    assert "line 3: not valid JSON" in _err(lambda: list(iter_jsonl(p)))
    p.write_text('{"step": 1}\n{"st\n{"step": 3}\n')  # a bad line in the middle is always an error
    assert "line 2: not valid JSON" in _err(lambda: list(iter_jsonl(p, skip_torn_tail=True)))


# ----------------------------------------------------------------------------------------------
# YAML


def test_yaml_reads_plain_configs_and_merge_keys(tmp_path):
    p = tmp_path / "run.yaml"
    p.write_text("base: &b {lr: 0.001, wd: 0.1}\noptim:\n  <<: *b\n  lr: 0.002\n")
    assert read_yaml(p) == {"base": {"lr": 0.001, "wd": 0.1}, "optim": {"lr": 0.002, "wd": 0.1}}
    assert parse_yaml("") is None


def test_yaml_duplicate_keys_are_refused_with_both_lines():
    text = "kd:\n  alpha: 0.5\noptim:\n  lr: 1\nkd:\n  temperature: 2\n"
    assert _err(parse_yaml, text, where="run.yaml") == (
        "run.yaml: line 5: duplicate key 'kd' (first given on line 1); give each key once"
    )
    assert "line 2: duplicate key 'a'" in _err(parse_yaml, "x: {a: 1,\n a: 2}", where="r.yaml")


def test_billion_laughs_is_refused_fast_with_small_memory():
    text = billion_laughs()
    assert len(text) < 600
    tracemalloc.start()
    t = time.perf_counter()
    try:
        msg = _err(parse_yaml, text, where="bomb.yaml")
        elapsed = time.perf_counter() - t
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert "more than 100000 values after expanding aliases" in msg, msg
    assert elapsed < 1.0 and peak < 20 * 2**20, (elapsed, peak)


def test_a_huge_document_is_refused_at_the_limit_before_the_rest_is_read():
    """Composing stops once a document has more than max_nodes values: a text cut short after that point
    (sequences never closed) is refused for its size, before the parser reaches the end that would make
    it a syntax error; within the limit the same text is the syntax error."""
    msg = _err(parse_yaml, "[" + "1, " * 101 + "[[[ ", where="big.yaml", max_nodes=100)
    assert msg == "big.yaml: line 1: more than 100 values (a run config or record holds far fewer)", msg
    assert "not valid YAML" in _err(parse_yaml, "[" + "1, " * 90 + "[[[ ", where="x", max_nodes=100)


@pytest.mark.parametrize(
    "text,expected",
    [
        ("a: &x [1, *x]\n", "line 1: a value contains itself through an alias"),
        ("[" * 5000, "nested too deeply"),
        ("- " * 100 + "x\n", "nested too deeply (more than 64 levels)"),
        ("kd: {alpha: 0.5\n\n\noptim: {}\n", "line 4: not valid YAML (expected ',' or '}', but got ':')"),
        ("seed: 2024-13-45\n", "not valid YAML (ValueError: month must be in 1..12)"),
        ("a: !!float\n", "not valid YAML (IndexError"),
        ("a: !!python/object/apply:os.system [ls]\n", "could not determine a constructor"),
        ("? [a, b]\n: 1\n", "line 1: a mapping key is a list, expected a string"),
        ("n: " + "1" * 5000 + "\n", "Exceeds the limit (4300 digits)"),
        ("a: 1\n\tb: 2\n", "not valid YAML"),
    ],
)
def test_yaml_failures_are_one_line(text, expected):
    msg = _err(parse_yaml, text, where="run.yaml")
    assert msg.startswith("run.yaml: ") and expected in msg, msg


def test_yaml_size_limit(tmp_path):
    p = tmp_path / "big.yaml"
    p.write_text("a: " + "x" * 5000)
    assert _err(read_yaml, p, max_bytes=4096, what="a run config") == (
        f"{p}: larger than 4096 bytes (expected a run config)"
    )


# ----------------------------------------------------------------------------------------------
# Fields


CONFIG = {
    "model_type": "qwen2",
    "num_attention_heads": 4,
    "rope_theta": 10000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0},
    "architectures": ["Qwen2ForCausalLM"],
    "tie_word_embeddings": True,
    "layer_types": [1, 2, 3],
}


def test_fields_typed_access():
    f = Fields(CONFIG, where="d/config.json")
    assert f.str("model_type", choices=("qwen2", "llama")) == "qwen2"
    assert f.int("num_attention_heads", min=1) == 4
    assert f.float("rope_theta", min_exclusive=0) == 10000.0
    assert f.obj("rope_scaling").float("factor", min_exclusive=0) == 8.0
    assert f.list("architectures", item="str") == ["Qwen2ForCausalLM"]
    assert f.list("layer_types", item="int", min=0) == [1, 2, 3]
    assert f.bool("tie_word_embeddings") is True
    assert f.optional("head_dim", "int", min=1) is None
    assert f.int("head_dim", default=8) == 8
    assert f.unknown(set(CONFIG) - {"layer_types"}) == ["layer_types"]


@pytest.mark.parametrize(
    "patch,call,expected",
    [
        (
            {"model_type": ["qwen2"]},
            lambda f: f.str("model_type"),
            "model_type is ['qwen2'] (a list), expected a string",
        ),
        (
            {"model_type": "gpt2"},
            lambda f: f.str("model_type", choices=("llama", "qwen2")),
            "model_type is 'gpt2', expected one of: llama, qwen2",
        ),
        (
            {"num_attention_heads": "8"},
            lambda f: f.int("num_attention_heads", min=1),
            "num_attention_heads is '8' (a string), expected an integer >= 1",
        ),
        (
            {"num_attention_heads": 0},
            lambda f: f.int("num_attention_heads", min=1),
            "num_attention_heads is 0, expected an integer >= 1",
        ),
        (
            {"num_attention_heads": True},
            lambda f: f.int("num_attention_heads"),
            "num_attention_heads is True (a boolean), expected an integer",
        ),
        (
            {"num_attention_heads": 2.5},
            lambda f: f.int("num_attention_heads"),
            "num_attention_heads is 2.5 (a number), expected an integer",
        ),
        (
            {"rope_theta": "1e4"},
            lambda f: f.float("rope_theta"),
            "rope_theta is '1e4' (a string), expected a finite number",
        ),
        (
            {"rope_scaling": {"factor": 0}},
            lambda f: f.obj("rope_scaling").float("factor", min_exclusive=0),
            "rope_scaling.factor is 0, expected a finite number > 0",
        ),
        (
            {"rope_scaling": "linear"},
            lambda f: f.obj("rope_scaling"),
            "rope_scaling is a string, expected an object",
        ),
        (
            {"architectures": {"a": 1}},
            lambda f: f.list("architectures"),
            "architectures is {'a': 1} (an object), expected a list",
        ),
        (
            {"architectures": ["A", 3]},
            lambda f: f.list("architectures", item="str"),
            "architectures[1] is 3 (an integer), expected a string",
        ),
        (
            {"tie_word_embeddings": "yes"},
            lambda f: f.bool("tie_word_embeddings"),
            "tie_word_embeddings is 'yes' (a string), expected true or false",
        ),
        (
            {"model_type": "x" * 10**6},
            lambda f: f.str("model_type", choices=("llama",)),
            "model_type is 'xxxxxxxx",
        ),
        ({}, lambda f: f.int("vocab_size"), "missing field vocab_size (expected an integer)"),
    ],
)
def test_fields_errors_name_file_field_and_expectation(patch, call, expected):
    f = Fields({**CONFIG, **patch}, where="d/config.json")
    msg = _err(call, f)
    assert msg.startswith("d/config.json: ") and expected in msg, msg
    assert len(msg) < 200


def test_fields_top_level_must_be_an_object():
    assert _err(Fields, [1], where="s.json") == "s.json: the top level is a list, expected an object"


# ----------------------------------------------------------------------------------------------
# Helpers for the config validator


def test_finite_float_and_seed_helpers():
    assert finite_float("optim.lr", 3e-4, min_exclusive=0) == 3e-4
    assert finite_float("kd.alpha", 1, min=0, max=1) == 1.0
    assert _err(finite_float, "optim.lr", float("inf"), min_exclusive=0) == (
        "optim.lr is inf, expected a finite number > 0"
    )
    assert _err(finite_float, "optim.grad_clip", float("nan"), min=0) == (
        "optim.grad_clip is nan, expected a finite number >= 0"
    )
    assert _err(finite_float, "kd.alpha", 1.5, min=0, max=1) == (
        "kd.alpha is 1.5, expected a finite number >= 0 and <= 1"
    )
    assert _err(finite_float, "x", 10**400) == f"x is {short_repr(10**400)}, expected a finite number"
    assert check_seed("schedule.seed", 0) == 0 and check_seed("schedule.seed", 2**32 - 1) == 2**32 - 1
    for bad in (-1, 2**32, 2**64):
        assert _err(check_seed, "schedule.seed", bad).startswith(
            f"schedule.seed is {bad}, expected an integer >= 0 and < 4294967296"
        )
    assert check_int("n", 4.0) == 4
