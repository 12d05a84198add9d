"""The decode engine refreshed from an FSDP2-sharded student under torchrun (2 processes, gloo on the
CPU): tests/decode_refresh_check.py, one launch.

A refresh gathers the shards a bucket at a time (at most the largest tensor's bytes per all-gather),
never a DTensor at a time, and writes every parameter straight into its rows of the engine's stacked
q/k/v and gate/up tensors; the result equals an engine built from a whole copy of the same weights, in
the model's dtype and in bf16. Generation issues no collective: processes with other prompts and other
token budgets each finish on their own, with the tokens a whole copy writes.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.test_distributed import finish, start_helper

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def checked(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("refresh") / "refresh.json"
    done: subprocess.CompletedProcess = finish(start_helper("decode_refresh_check.py", out), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


def test_a_sharded_students_refresh_equals_the_whole_weights_on_every_process(checked):
    assert len(checked) == 2
    for rank in checked:
        assert set(rank) == {"tied_model_dtype", "tied_bf16", "untied_model_dtype", "untied_bf16"}
        assert all(case["equal"] for case in rank.values())


def test_a_refresh_gathers_buckets_of_shards_not_one_tensor_at_a_time(checked):
    for rank in checked:
        for case in rank.values():
            assert case["per_tensor_gathers"] == 0
            assert 1 <= case["flat_gathers"] < case["parameters"]


def test_generation_from_a_refreshed_engine_waits_for_no_other_process(checked):
    for rank in checked:
        for case in rank.values():
            assert case["generation_collectives"] == 0
            assert case["same_tokens"]
