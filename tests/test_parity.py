"""Parity with transformers: our Decoder, loaded by the production loader from the directory transformers
wrote, gives the same logits as transformers itself (fp32, max abs diff <= 1e-4), for every family."""

from __future__ import annotations

import pytest
import torch

from kdistill.models.hf_io import load_model
from tests.tiny import load_hf, make_tiny_model, sample_ids

CASES = [
    ("qwen2", True),  # q/k/v bias, tied
    ("qwen2", False),
    ("llama", False),  # llama3 rope scaling, untied head
    ("llama", True),
    ("qwen3", True),  # per-head q/k RMSNorm
    ("qwen3", False),
]


@pytest.mark.parametrize("family,tied", CASES, ids=[f"{f}-{'tied' if t else 'untied'}" for f, t in CASES])
def test_logits_match_transformers(tmp_path, family, tied):
    model_dir = make_tiny_model(tmp_path, family=family, tied=tied, seed=3)
    ours = load_model(model_dir).eval()
    theirs = load_hf(model_dir)
    ids = sample_ids(ours.spec.vocab_size, batch=2, seq_len=48, seed=1)
    with torch.no_grad():
        a = ours.logits(ids)
        b = theirs(ids).logits
    assert a.shape == b.shape == (2, 48, ours.spec.vocab_size)
    assert (a - b).abs().max().item() <= 1e-4
    # the test means something: a different seed's weights do not match
    assert b.std().item() > 0.05


def test_parity_with_gqa_and_more_layers(tmp_path):
    model_dir = make_tiny_model(
        tmp_path,
        family="qwen2",
        tied=False,
        seed=5,
        hidden_size=64,
        num_attention_heads=8,
        num_key_value_heads=2,
        num_hidden_layers=3,
        intermediate_size=96,
    )
    ours = load_model(model_dir).eval()
    theirs = load_hf(model_dir)
    ids = sample_ids(ours.spec.vocab_size, batch=1, seq_len=33, seed=2)
    with torch.no_grad():
        assert (ours.logits(ids) - theirs(ids).logits).abs().max().item() <= 1e-4
