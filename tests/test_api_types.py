"""The Python API checks its arguments' types as the CLI checks its options: a wrong type is a one-line
kdistill.UserError naming the argument and what was expected, never a TypeError or AttributeError from
inside (and nothing is written)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import kdistill
from kdistill.errors import UserError
from tests.test_train_kit import assets


@pytest.mark.parametrize(
    "call,needle",
    [
        (lambda: kdistill.distill(None, 5), "override 5 is an int, expected a string 'section.field=value'"),
        (lambda: kdistill.distill(None, ["schedule.steps=1"]), "override ['schedule.steps=1'] is a list"),
        (lambda: kdistill.distill(None, overwrite="yes"), "overwrite is a str, expected True or False"),
        (lambda: kdistill.distill(123), "config is an int, expected a RunConfig, a dict or a YAML path"),
        (lambda: kdistill.distill(None, kd=5), "override kd=5: expected section.field=value"),
        (lambda: kdistill.load(None), "path is None, expected a path (str or pathlib.Path)"),
        (lambda: kdistill.load(""), "path is empty, expected a path"),
        (
            lambda: kdistill.load(assets().student, dtype="float8"),
            "dtype is 'float8', expected torch.float32",
        ),
        (
            lambda: kdistill.load(assets().student, dtype=torch.int8),
            "dtype is torch.int8, expected torch.float32",
        ),
        (lambda: kdistill.load(assets().student, device=0), "device is an int, expected 'cpu', 'cuda'"),
        (lambda: kdistill.load(assets().student, device="gpu9"), "device is 'gpu9', expected 'cpu', 'cuda'"),
        (lambda: kdistill.evaluate([assets().student], assets().heldout), "model is a list, expected a path"),
        (lambda: kdistill.evaluate(assets().student, 123), "data is an int, expected a path"),
        (lambda: kdistill.evaluate(assets().student, []), "data is an empty list, expected one or more"),
        (
            lambda: kdistill.evaluate(assets().student, [assets().heldout, 7]),
            "data[1] is an int, expected a path",
        ),
        (
            lambda: kdistill.evaluate(assets().student, assets().heldout, batch_size="8"),
            "batch_size is a str",
        ),
        (
            lambda: kdistill.evaluate(assets().student, assets().heldout, batch_size=0),
            "batch_size is 0, expected",
        ),
        (lambda: kdistill.evaluate(assets().student, assets().heldout, seq_len=True), "seq_len is a bool"),
        (
            lambda: kdistill.evaluate(assets().student, assets().heldout, max_tokens=1.5),
            "max_tokens is a float",
        ),
        (
            lambda: kdistill.evaluate(assets().student, assets().heldout, packed=1),
            "packed is an int, expected True",
        ),
        (lambda: kdistill.evaluate(assets().student, assets().heldout, device=None), "device is None"),
        (lambda: kdistill.plan(None, 3), "override 3 is an int"),
        (lambda: kdistill.plan(3.5), "config is a float, expected a RunConfig"),
    ],
)
def test_wrong_types_are_one_line_user_errors(call, needle, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError) as e:
        call()
    assert needle in str(e.value) and "\n" not in str(e.value)
    assert list(Path(tmp_path).iterdir()) == []


def test_a_dtype_name_loads_like_the_torch_dtype():
    model, _ = kdistill.load(assets().student, dtype="bfloat16")
    assert next(model.parameters()).dtype == torch.bfloat16
    model, _ = kdistill.load(str(assets().student), dtype=torch.float32, device=torch.device("cpu"))
    assert next(model.parameters()).dtype == torch.float32
