"""Classes of bad input that must be one clear line, or just work: YAML's boolean words in fields whose
values are words.

The tests parse and validate configs only.
"""

from __future__ import annotations

import dataclasses

import pytest

from kdistill.config import RunConfig, load_config
from kdistill.errors import UserError

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
def test_a_documented_word_works_unquoted_in_an_override_and_in_a_file(tmp_path, field, word):
    section, name = field.split(".")
    assert getattr(getattr(load_config(None, [*PATHS, f"{field}={word}"]).validate(), section), name) == word
    path = tmp_path / "run.yaml"
    path.write_text(f"{section}:\n  {name}: {word}\n")  # unquoted, as the README writes it
    assert getattr(getattr(load_config(path, PATHS).validate(), section), name) == word


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
    cfg = load_config(None, [*PATHS, "data.template_kwargs={a: no, b: 'no', c: on, d: false}"]).validate()
    assert cfg.data.template_kwargs == {"a": False, "b": "no", "c": True, "d": False}
