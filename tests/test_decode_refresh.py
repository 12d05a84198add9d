"""The decode engine refreshed from an FSDP2-sharded student under torchrun (2 processes, gloo on the
CPU): tests/decode_refresh_check.py, one launch.

A refresh gathers the shards a bucket at a time (at most the largest tensor's bytes per all-gather),
never a DTensor at a time, and writes every parameter straight into its rows of the engine's stacked
q/k/v and gate/up tensors; the result equals an engine built from a whole copy of the same weights, in
the model's dtype and in bf16. Generation issues no collective: processes with other prompts and other
token budgets each finish on their own, with the tokens a whole copy writes. A student kept gathered
from forward to backward is gathered once per on-policy step, before it writes: the engine built from
it owns its weights (FSDP frees the gathered ones after the backward), and neither the refresh nor the
update's forward and backward gather again, with the gradients of a step that gathers for itself.
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
        cases = {k: v for k, v in rank.items() if k != "shared"}
        assert set(cases) == {"tied_model_dtype", "tied_bf16", "untied_model_dtype", "untied_bf16"}
        assert all(case["equal"] for case in cases.values())


def test_a_refresh_gathers_buckets_of_shards_not_one_tensor_at_a_time(checked):
    for rank in checked:
        for name, case in rank.items():
            if name == "shared":
                continue
            assert case["per_tensor_gathers"] == 0
            assert 1 <= case["flat_gathers"] < case["parameters"]


def test_generation_from_a_refreshed_engine_waits_for_no_other_process(checked):
    for rank in checked:
        for name, case in rank.items():
            if name == "shared":
                continue
            assert case["generation_collectives"] == 0
            assert case["same_tokens"]


def test_a_kept_student_gathered_before_it_writes_is_not_gathered_again_by_the_refresh_or_the_update(checked):
    for rank in checked:
        shared = rank["shared"]
        assert shared["unshard_gathers"] == 3  # the root and both blocks, once
        assert shared["refresh_gathers"] == 0 and shared["step_gathers"] == 0
        assert shared["same_gradients"]
        assert shared["engine_kept"]  # its own copy, not FSDP's freed tensors
