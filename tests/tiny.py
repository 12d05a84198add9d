"""Tiny random Hugging Face models and tokenizers for tests, built offline.

    from tests.tiny import make_tiny_model
    model_dir = make_tiny_model(tmp_path, family="qwen2", tied=True)   # config.json, model.safetensors,
                                                                         # tokenizer.json, ...
    hf = load_hf(model_dir)                                              # transformers' own model

Every model comes from `transformers` itself (its config classes and `save_pretrained`), so tests of our
loader read exactly what transformers writes. Norm weights and biases are randomised (transformers
initialises them to ones and zeros), so a parity test that drops a bias or a norm fails.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import torch

FAMILIES = ("qwen2", "llama", "qwen3")
SPECIAL_TOKENS = ["<|endoftext|>", "<|pad|>"]

_WORDS = (
    "the a teacher student model learns tokens from logits of each layer and distils knowledge into smaller "
    "network while loss falls over steps with temperature alpha divergence forward reverse kernel cache "
    "memory plan batch sequence length vocabulary embedding attention rotary norm gate up down projection "
    "quick brown fox jumps over lazy dog river mountain city light dark number one two three four five"
).split()


def corpus_text(n_words: int = 1200, seed: int = 0) -> str:
    """A few KB of deterministic pseudo-English with punctuation, digits and a little Unicode."""
    rng = random.Random(seed)
    lines = []
    words: list[str] = []
    for i in range(n_words):
        w = rng.choice(_WORDS)
        if i % 17 == 0:
            w = w.capitalize()
        if i % 29 == 0:
            w += str(rng.randint(0, 999))
        if i % 41 == 0:
            w += rng.choice([",", ".", "!", "?", ";", " café", " naïve", " 東京"])
        words.append(w)
        if len(words) >= 12:
            lines.append(" ".join(words) + ".")
            words = []
    lines.append(" ".join(words))
    return "\n".join(lines) + "\n"


def make_tokenizer(out_dir: Path, vocab_size: int = 384, seed: int = 0) -> Path:
    """Train a byte-level BPE tokenizer (like GPT-2/Qwen's) and write tokenizer.json and friends.

    Returns the path of tokenizer.json. `vocab_size` counts the 256 byte symbols, the merges and the
    special tokens; it must be at least 258.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_text(seed=seed).splitlines(), trainer=trainer)
    path = out_dir / "tokenizer.json"
    tok.save(str(path))
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": "<|endoftext|>",
                "pad_token": "<|pad|>",
                "model_max_length": 256,
            },
            indent=2,
        )
    )
    (out_dir / "special_tokens_map.json").write_text(
        json.dumps({"eos_token": "<|endoftext|>", "pad_token": "<|pad|>"}, indent=2)
    )
    return path


def tokenizer_vocab_size(model_dir: Path) -> int:
    """Number of tokens (with special tokens) of the tokenizer.json in model_dir."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json")).get_vocab_size(with_added_tokens=True)


def hf_config(family: str, vocab_size: int, tied: bool, **shape: Any):
    """A transformers config object for a tiny model of `family` ("qwen2" | "llama" | "qwen3")."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    base: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=tied,
        rms_norm_eps=1e-6,
        bos_token_id=0,
        eos_token_id=0,
    )
    if family == "qwen2":
        base.update(rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0})
        base.update(shape)
        return Qwen2Config(**base)
    if family == "llama":
        base.update(
            rms_norm_eps=1e-5,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500_000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 200,  # head_dim 8: one frequency in each llama3 band
            },
        )
        base.update(shape)
        return LlamaConfig(**base)
    if family == "qwen3":
        base.update(head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0})
        base.update(shape)
        return Qwen3Config(**base)
    raise ValueError(f"unknown family {family!r}")


@torch.no_grad()
def randomise(model: torch.nn.Module, seed: int = 0, std: float = 0.1) -> None:
    """Give every parameter random values (norms around 1, biases around 0, matrices ~ N(0, std))."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
        if "norm" in name:
            p.copy_(1.0 + 0.2 * noise)
        elif name.endswith(".bias"):
            p.copy_(0.1 * noise)
        else:
            p.copy_(std * noise)


def make_tiny_model(
    tmp_path: Path,
    family: str = "qwen2",
    tied: bool = True,
    vocab_pad: int = 0,
    seed: int = 0,
    name: str | None = None,
    dtype: torch.dtype = torch.float32,
    tokenizer_vocab: int = 384,
    max_shard_size: str | None = None,
    **shape: Any,
) -> Path:
    """Build a tiny random transformers model, save_pretrained it with a tokenizer, return its directory.

    Args:
        tmp_path: parent directory; the model goes to tmp_path / name.
        family: "qwen2" (q/k/v bias), "llama" (llama3 rope scaling) or "qwen3" (per-head q/k norm).
        tied: tie lm_head to the embedding.
        vocab_pad: extra embedding rows beyond the tokenizer's vocabulary (a padded vocab).
        seed: seed of the random weights.
        name: directory name (default: "<family>-tied|untied-<seed>").
        dtype: dtype the weights are stored in (float32, bfloat16, float16).
        tokenizer_vocab: size of the trained BPE tokenizer.
        max_shard_size: if set (e.g. "20KB"), transformers writes a sharded checkpoint with an index.
        **shape: overrides of the config (hidden_size, num_hidden_layers, ...).
    """
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    out = Path(tmp_path) / (name or f"{family}-{'tied' if tied else 'untied'}-{seed}")
    make_tokenizer(out, tokenizer_vocab)
    vocab = tokenizer_vocab_size(out) + vocab_pad
    cfg = hf_config(family, vocab, tied, **shape)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    randomise(model, seed)
    model = model.to(dtype)
    model.config.dtype = dtype
    kwargs: dict[str, Any] = {}
    if max_shard_size is not None:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(out, **kwargs)
    if not (out / "generation_config.json").exists():
        (out / "generation_config.json").write_text(
            json.dumps({"bos_token_id": 0, "eos_token_id": 0}, indent=2)
        )
    return out


def load_hf(model_dir: Path, dtype: torch.dtype = torch.float32):
    """transformers' own model from model_dir, in eval mode, eager attention (the numerically plain path)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="eager")
    return model.eval()


def sample_ids(vocab_size: int, batch: int = 2, seq_len: int = 16, seed: int = 0) -> torch.Tensor:
    """Random token ids (batch, seq_len) below vocab_size."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, seq_len), generator=g)
