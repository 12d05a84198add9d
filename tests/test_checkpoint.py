"""Hugging Face model I/O (kdistill.models.hf_io) round trips: HF -> ours -> HF with identical logits, dtypes,
shards, vocab trimming, atomic saves."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from kdistill.errors import UserError
from kdistill.models.decoder import build_decoder
from kdistill.models.hf_io import TOKENIZER_FILES, has_weights, load_model, save_model
from kdistill.models.spec import load_spec
from tests.tiny import load_hf, make_tiny_model, sample_ids


def _logits(model, ids):
    with torch.no_grad():
        out = model.logits(ids) if hasattr(model, "lm_head_weight") else model(ids).logits
    return out.float()


@pytest.mark.parametrize("family,tied", [("qwen2", True), ("llama", False), ("qwen3", False)])
def test_ours_to_transformers_round_trip(tmp_path, family, tied):
    src = make_tiny_model(tmp_path, family=family, tied=tied, seed=7)
    spec = load_spec(src)
    ours = build_decoder(spec, seed=11)  # our own random weights, not transformers'
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)
    out = tmp_path / "exported"
    save_model(ours, out, source_dir=src)
    names = set(load_file(out / "model.safetensors"))
    assert ("lm_head.weight" in names) == (not tied)
    theirs = load_hf(out)
    ids = sample_ids(spec.vocab_size, seq_len=24)
    assert (_logits(ours.eval(), ids) - _logits(theirs, ids)).abs().max().item() <= 1e-4
    # and back: the exported directory loads in ours bit for bit
    again = load_model(out)
    for (n1, p1), (n2, p2) in zip(ours.state_dict().items(), again.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2)
    for f in [*TOKENIZER_FILES, "generation_config.json"]:
        assert (out / f).exists() == (src / f).exists()
        if (src / f).exists():
            assert (out / f).read_bytes() == (src / f).read_bytes()


def test_transformers_to_ours_to_transformers(tmp_path):
    src = make_tiny_model(tmp_path, family="qwen2", tied=True, seed=2)
    ours = load_model(src)
    out = tmp_path / "copy"
    save_model(ours, out, source_dir=src)
    ids = sample_ids(ours.spec.vocab_size, seq_len=20)
    assert torch.equal(_logits(load_hf(src), ids), _logits(load_hf(out), ids))


@pytest.mark.parametrize("stored", [torch.bfloat16, torch.float16])
def test_half_precision_checkpoints_load(tmp_path, stored):
    src = make_tiny_model(tmp_path, family="llama", tied=False, dtype=stored, seed=4)
    header = json.loads((src / "config.json").read_text())
    assert header["dtype"] == str(stored).removeprefix("torch.")
    ref = load_file(src / "model.safetensors")
    assert all(t.dtype == stored for t in ref.values())
    as_fp32 = load_model(src)
    assert all(p.dtype == torch.float32 for p in as_fp32.parameters())
    for name, t in ref.items():
        assert torch.equal(as_fp32.state_dict()[name], t.float())
    native = load_model(src, dtype=stored)
    assert all(p.dtype == stored for p in native.parameters())
    ids = sample_ids(as_fp32.spec.vocab_size, seq_len=16)
    hf = load_hf(src)  # transformers upcasts the same stored values
    assert (_logits(as_fp32.eval(), ids) - _logits(hf, ids)).abs().max().item() <= 1e-4


def test_sharded_checkpoint_loads(tmp_path):
    src = make_tiny_model(tmp_path, family="qwen3", tied=False, seed=9, max_shard_size="20KB")
    assert (src / "model.safetensors.index.json").is_file() and not (src / "model.safetensors").exists()
    assert len(list(src.glob("model-*.safetensors"))) > 2
    assert has_weights(src)
    ours = load_model(src).eval()
    ids = sample_ids(ours.spec.vocab_size, seq_len=16)
    assert (_logits(ours, ids) - _logits(load_hf(src), ids)).abs().max().item() <= 1e-4


def test_vocab_rows_trims_padded_embedding(tmp_path):
    src = make_tiny_model(tmp_path, family="llama", tied=False, vocab_pad=64, seed=1)
    full = load_model(src)
    trimmed = load_model(src, vocab_rows=full.spec.vocab_size - 64)
    assert trimmed.spec.vocab_size == full.spec.vocab_size - 64 == 384
    assert trimmed.model.embed_tokens.weight.shape == (384, 32)
    assert trimmed.lm_head.weight.shape == (384, 32)
    ids = sample_ids(384, seq_len=12)
    assert torch.equal(_logits(trimmed, ids), _logits(full, ids)[..., :384])
    same = load_model(src, vocab_rows=full.spec.vocab_size)
    assert same.spec.vocab_size == full.spec.vocab_size
    with pytest.raises(UserError, match="cannot trim the vocabulary to 999 rows"):
        load_model(src, vocab_rows=999)


def test_tied_vocab_trim(tmp_path):
    src = make_tiny_model(tmp_path, family="qwen2", tied=True, vocab_pad=16)
    m = load_model(src, vocab_rows=384)
    assert m.lm_head_weight.shape == (384, 32) and m.spec.tie_word_embeddings


def test_loads_straight_to_dtype_and_nothing_on_meta(tmp_path):
    src = make_tiny_model(tmp_path, family="qwen3", tied=True)
    m = load_model(src, device="cpu", dtype=torch.bfloat16)
    for name, t in [*m.named_parameters(), *m.named_buffers()]:
        assert not t.is_meta, name
        assert t.dtype == torch.bfloat16 and t.device.type == "cpu"
        assert t.is_contiguous()


def test_tied_checkpoint_with_lm_head_tensor_loads(tmp_path):
    from safetensors.torch import save_file

    src = make_tiny_model(tmp_path, family="qwen2", tied=True)
    tensors = load_file(src / "model.safetensors")
    assert "lm_head.weight" not in tensors
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, src / "model.safetensors")
    m = load_model(src)
    assert torch.equal(m.lm_head_weight, tensors["model.embed_tokens.weight"])


def test_save_replaces_existing_model_dir_atomically(tmp_path):
    src = make_tiny_model(tmp_path, family="qwen2", tied=True)
    a = load_model(src)
    out = tmp_path / "out"
    save_model(a, out, source_dir=src)
    b = build_decoder(a.spec, seed=99)
    save_model(b, out, dtype=torch.bfloat16)
    back = load_model(out)
    assert torch.equal(back.model.embed_tokens.weight, b.model.embed_tokens.weight.to(torch.bfloat16).float())
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert not (out / "tokenizer.json").exists()  # the new directory replaced the old one whole
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".out.")]
    assert leftovers == []


def test_save_refuses_to_replace_a_non_model_directory(tmp_path):
    src = make_tiny_model(tmp_path, family="qwen2", tied=True)
    m = load_model(src)
    precious = tmp_path / "home"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    with pytest.raises(UserError, match="was not written by kdistill"):
        save_model(m, precious)
    assert (precious / "notes.txt").read_text() == "keep me"
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(UserError, match="exists and is not a folder"):
        save_model(m, afile)


def test_failed_save_leaves_previous_model_intact(tmp_path, monkeypatch):
    src = make_tiny_model(tmp_path, family="qwen2", tied=True)
    m = load_model(src)
    out = tmp_path / "out"
    save_model(m, out, source_dir=src)
    before = (out / "model.safetensors").read_bytes()

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("kdistill.models.hf_io.save_file", full_disk)
    with pytest.raises(UserError, match="cannot write the model .*No space left on device"):
        save_model(build_decoder(m.spec, seed=5), out)
    assert (out / "model.safetensors").read_bytes() == before
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out.")] == []


def test_has_weights(tmp_path):
    assert not has_weights(tmp_path)
    src = make_tiny_model(tmp_path, family="qwen2")
    assert has_weights(src)
