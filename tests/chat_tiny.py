"""Tiny chat fixtures for the chat tests: a byte-level BPE tokenizer with the families' special tokens,
and model directories holding it with a chat template written for the tests that reproduces a
family's structure (tests/fixtures/chat_families)."""

from __future__ import annotations

import functools
import json
from pathlib import Path

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "chat_families"

# name -> (template file, bos_token, eos_token)
TEMPLATES = {
    "qwen2.5": ("qwen2.5.jinja", None, "<|im_end|>"),
    "qwen3": ("qwen3.jinja", None, "<|im_end|>"),
    "llama3.1": ("llama3.jinja", "<|begin_of_text|>", "<|eot_id|>"),
}

SPECIAL = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|python_tag|>",
]
ADDED = ["<think>", "</think>"]  # Qwen3 adds these as ordinary (not special) added tokens

CORPUS = [
    "You are a helpful assistant. Hello there, how are you? The capital of France is Paris.",
    "system user assistant Cutting Knowledge Date: December 2023 Today Date: 26 Jul 2024",
    "What is two plus two? Two plus two is four. Thanks! You're welcome. Qwen Alibaba Cloud",
    "Ünïcödé — 你好, 世界! emoji 🙂 tabs\tand\nnewlines",
]


@functools.lru_cache(maxsize=1)
def tokenizer_json() -> str:
    """A byte-level BPE tokenizer.json (vocab ~500) trained on CORPUS, with SPECIAL and ADDED tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=SPECIAL,
        show_progress=False,
    )
    tk.train_from_iterator(CORPUS * 10, trainer)
    tk.add_tokens(ADDED)
    return tk.to_str()


def make_chat_model_dir(root: Path, name: str) -> Path:
    """A model directory with tokenizer.json and a tokenizer_config.json holding the family's test template."""
    file, bos, eos = TEMPLATES[name]
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(tokenizer_json(), encoding="utf-8")
    config = {"chat_template": (FIXTURES / file).read_text(encoding="utf-8"), "eos_token": eos}
    if bos is not None:
        config["bos_token"] = bos
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return folder


def hf_tokenizer(name: str):
    """transformers' PreTrainedTokenizerFast over the same tokenizer, with the template set."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    file, bos, eos = TEMPLATES[name]
    kwargs = {"eos_token": eos}
    if bos is not None:
        kwargs["bos_token"] = bos
    hf = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(tokenizer_json()), **kwargs)
    hf.chat_template = (FIXTURES / file).read_text(encoding="utf-8")
    return hf
