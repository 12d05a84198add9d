"""Classes of bad input that must be one clear line, or just work: YAML's boolean words in fields whose
values are words, values no config file can hold, megabyte values quoted in a message.

Most tests parse and validate only; a few run the tiny pair of tests/test_train_kit.py for two steps.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import yaml

import kdistill
from kdistill.config import RunConfig, load_config
from kdistill.errors import UserError
from tests.test_train_kit import base_config, one_error_line, run_cli, write_config

PATHS = ["teacher.path=t", "student.path=s"]
BIG = "x" * (2 << 20)  # a 2 MiB value


def _accepts(part: object, name: str, value: str) -> bool:
    try:
        dataclasses.replace(part, **{name: value}).validate()  # type: ignore[type-var]
    except UserError:
        return False
    return True


def _words_fields() -> list[tuple[str, str]]:
    """(field, word) for every config field with a fixed set of words (it refuses a made-up one) that
    includes a YAML 1.1 boolean word, found by asking each section's validator."""
    out = []
    cfg = RunConfig()
    for section in dataclasses.fields(cfg):
        part = getattr(cfg, section.name)
        if not dataclasses.is_dataclass(part):
            continue
        for f in dataclasses.fields(part):
            if isinstance(getattr(part, f.name), str) and not _accepts(part, f.name, "made-up"):
                words = [w for w in ("on", "off", "yes", "no") if _accepts(part, f.name, w)]
                out.extend((f"{section.name}.{f.name}", w) for w in words)
    return out


WORD_FIELDS = _words_fields()


def test_the_word_valued_fields_are_found():
    assert ("runtime.cuda_graphs", "on") in WORD_FIELDS and ("runtime.cuda_graphs", "off") in WORD_FIELDS


@pytest.mark.parametrize("field,word", WORD_FIELDS)
def test_a_documented_word_works_unquoted_in_an_override_and_in_a_file(tmp_path, capsys, field, word):
    section, name = field.split(".")
    assert getattr(getattr(load_config(None, [*PATHS, f"{field}={word}"]).validate(), section), name) == word
    path = tmp_path / "run.yaml"
    path.write_text(f"{section}:\n  {name}: {word}\n")  # unquoted, as the README writes it
    assert getattr(getattr(load_config(path, PATHS).validate(), section), name) == word
    presets = ["teacher.path=qwen2.5-1.5b", "student.path=qwen2.5-0.5b"]  # the command line, end to end
    rc, out, err = run_cli(capsys, "plan", str(path), *presets, "--json")
    assert rc == 0, err
    rc, out, err = run_cli(capsys, "plan", *presets, f"{field}={word}", "--json")
    assert rc == 0, err


def test_boolean_fields_still_take_every_yaml_spelling(tmp_path):
    for word, truth in [("yes", True), ("on", True), ("true", True), ("no", False), ("Off", False)]:
        cfg = load_config(None, [*PATHS, f"runtime.strict_kernels={word}"]).validate()
        assert cfg.runtime.strict_kernels is truth
        path = tmp_path / "run.yaml"
        path.write_text(f"kd:\n  cross_tokenizer: {word}\nruntime:\n  auto_fit: {word}\n")
        cfg = load_config(path, PATHS).validate()
        assert cfg.kd.cross_tokenizer is truth and cfg.runtime.auto_fit is truth


def test_a_path_spelled_like_a_boolean_stays_its_text():
    cfg = load_config(None, [*PATHS, "output.dir=off", "data.train=[yes, no]"]).validate()
    assert cfg.output.dir == "off" and cfg.data.train == ["yes", "no"]


def test_template_variables_keep_yaml_booleans_and_quoted_words(tmp_path):
    cfg = load_config(None, [*PATHS, "data.template_kwargs={a: no, b: 'no', c: on, d: false, on: 1}"])
    assert cfg.validate().data.template_kwargs == {"a": False, "b": "no", "c": True, "d": False, "on": 1}


# -- values a config file cannot hold ----------------------------------------------------------------
def test_a_date_from_yaml_is_kept_as_its_iso_text(tmp_path):
    cfg = load_config(None, [*PATHS, "data.template_kwargs={today: 2024-01-01, at: 2024-01-01 10:00:00}"])
    assert cfg.validate().data.template_kwargs == {"today": "2024-01-01", "at": "2024-01-01T10:00:00"}
    path = tmp_path / "run.yaml"
    path.write_text("data:\n  template_kwargs:\n    today: 2024-01-01\n  chat_template: 2024-01-01\n")
    cfg = load_config(path, PATHS).validate()
    assert cfg.data.template_kwargs == {"today": "2024-01-01"} and cfg.data.chat_template == "2024-01-01"


def test_a_run_with_a_date_template_variable_writes_it_and_completes(tmp_path, capsys):
    cfg = write_config(tmp_path, steps=2, checkpoint_every=1)
    rc, _, err = run_cli(capsys, "run", str(cfg), "data.template_kwargs={today: 2024-01-01}", "--quiet")
    assert rc == 0, err
    run = tmp_path / "run"
    assert yaml.safe_load((run / "config.yaml").read_text())["data"]["template_kwargs"] == {
        "today": "2024-01-01"
    }
    state = json.loads((run / "checkpoints" / "step-0000001" / "state.json").read_text())
    assert state["config"]["data"]["template_kwargs"] == {"today": "2024-01-01"}
    assert json.loads((run / "summary.json").read_text())["status"] == "completed"


class _Thing:
    pass


@pytest.mark.parametrize(
    "value,message",
    [
        ({"x": {1, 2}}, "data.template_kwargs.x is {1, 2} (a Python set), expected a string, number"),
        ({"x": _Thing()}, "data.template_kwargs.x is <"),
        (
            {"x": [1, {2: "two"}]},
            "data.template_kwargs.x[1] has the key 2 (a Python int), expected string keys",
        ),
        ({"x": b"raw"}, "data.template_kwargs.x is b'raw' (a Python bytes)"),
        ({"x": (1, 2)}, "data.template_kwargs.x is (1, 2) (a Python tuple)"),
    ],
)
def test_a_value_no_config_file_can_hold_is_refused_before_anything_is_written(tmp_path, value, message):
    cfg = base_config(tmp_path / "run", steps=2)
    cfg["data"]["template_kwargs"] = value
    with pytest.raises(UserError, match="^" + _escape(message)) as e:
        kdistill.distill(cfg)
    assert "\n" not in str(e.value) and len(str(e.value)) < 400
    assert not (tmp_path / "run").exists()
    # The same value set on a RunConfig's field, which the API copies before it validates
    run_cfg = load_config(None, base=base_config(tmp_path / "run", steps=2))
    run_cfg.data.template_kwargs = value
    with pytest.raises(UserError, match="^" + _escape(message)):
        kdistill.distill(run_cfg)
    assert not (tmp_path / "run").exists()


def test_an_object_in_a_text_field_is_refused_and_a_path_object_is_text(tmp_path):
    with pytest.raises(UserError, match="^output.dir is <.*, expected a string$"):
        load_config(None, base={"output": {"dir": _Thing()}})
    assert load_config(None, base={"output": {"dir": tmp_path}}).output.dir == str(tmp_path)


def _escape(text: str) -> str:
    import re

    return re.escape(text)


# -- a megabyte value is never a megabyte message ---------------------------------------------------
def _bounded(message: str) -> None:
    assert "\n" not in message and len(message) <= 1000, len(message)
    assert "x" * 201 not in message  # no value quoted beyond about 200 characters


@pytest.mark.parametrize(
    "override",
    [
        f"kd.divergence={BIG}",
        f"output.report_to=[{BIG}]",
        f"student.lora.targets=[{BIG}]",
        f"runtime.device={BIG}",
        f"kd.layer_map=[[{','.join(['1'] * 500_000)}]]",
        f"teachers={BIG}",
        BIG,
        f"{BIG}=1",
        f"kd.{BIG}=1",
    ],
    ids=["choice", "list", "lora", "device", "layer_map", "sections", "no_equals", "key", "field"],
)
def test_a_two_megabyte_override_is_quoted_in_a_short_line(capsys, override):
    rc, _, err = run_cli(capsys, "plan", *PATHS, override, "--json")
    assert rc == 2
    _bounded(one_error_line(err))


def test_a_two_megabyte_config_field_is_quoted_in_a_short_line(tmp_path):
    for section, field in [("kd", "divergence"), ("runtime", "device"), ("student", "init")]:
        cfg = base_config(tmp_path / "run")
        cfg[section][field] = BIG
        with pytest.raises(UserError) as e:
            kdistill.distill(cfg)
        _bounded(str(e.value))
        assert str(e.value).startswith(f"{section}.{field} is 'xxx")


def test_a_two_megabyte_data_record_is_quoted_in_a_short_line(tmp_path, capsys):
    from kdistill.data.chat import read_conversations

    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": [{"role": BIG}]}) + "\n")
    with pytest.raises(UserError) as e:
        read_conversations(path)
    _bounded(str(e.value))
    assert str(e.value).startswith(f"{path}:1: messages[0] (xxx")
    cfg = write_config(tmp_path, steps=2)
    rc, _, err = run_cli(capsys, "run", str(cfg), f"data.train=[{path}]", "--quiet")
    assert rc == 2
    _bounded(one_error_line(err))


def test_every_user_error_is_bounded_however_it_is_built():
    message = str(UserError(f"{BIG} is {BIG!r} and " + "word " * 500_000 + "expected the end"))
    _bounded(message)
    assert message.endswith("expected the end")
    path = "/" + "/".join(["folder"] * 40) + "/model.safetensors"  # a long path keeps its file name
    assert str(UserError(f"{path}: truncated")).endswith("/model.safetensors: truncated")
