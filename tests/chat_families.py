"""Chat template fixtures of eleven model family shapes, written for these tests (not copied): each
reproduces what makes its family different (tests/fixtures/chat_families/*.jinja), with one tiny
byte-level BPE tokenizer that knows every family's special tokens, and conversations of four kinds:
plain, multi-turn, reasoning (`reasoning_content`) and tool calls (`tools`, `tool_calls`, role tool)."""

from __future__ import annotations

import functools
import json
from pathlib import Path

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "chat_families"

# family -> (bos_token, eos_token)
FAMILIES = {
    "qwen2.5": (None, "<|im_end|>"),
    "qwen3": (None, "<|im_end|>"),
    "llama3": ("<|begin_of_text|>", "<|eot_id|>"),
    "deepseek-r1": ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
    "mistral": ("<s>", "</s>"),
    "gemma": ("<bos>", "<eos>"),
    "phi4": (None, "<|im_end|>"),
    "smollm2": (None, "<|im_end|>"),
    "mistral-nemo": ("<s>", "</s>"),
    "llama3.1": ("<|begin_of_text|>", "<|eot_id|>"),
    "hermes": (None, "<|im_end|>"),
}

SPECIAL = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|im_sep|>",
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<｜begin▁of▁sentence｜>",
    "<｜end▁of▁sentence｜>",
    "<s>",
    "</s>",
    "[INST]",
    "[/INST]",
    "[TOOL_CALLS]",
    "[AVAILABLE_TOOLS]",
    "[/AVAILABLE_TOOLS]",
    "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]",
    "<bos>",
    "<eos>",
    "<start_of_turn>",
    "<end_of_turn>",
]
# Special tokens added after training (their ids follow every other token's).
SPECIAL_LATER = ["<|python_tag|>"]
# Ordinary added tokens (not special), as these families' tokenizers add them.
ADDED = [
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<｜User｜>",
    "<｜Assistant｜>",
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁calls▁end｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁sep｜>",
    "<｜tool▁output▁begin｜>",
    "<｜tool▁output▁end｜>",
]

CORPUS = [
    "Be brief. What is the capital of France? Paris. Hi Hello there. Two plus two? Four. And three? Five.",
    "Add two and two. Two plus three is five. Weather in Paris? 18 C, sunny. It is 18 C and sunny in Paris.",
    "system user assistant model ipython tool Knowledge cutoff: December 2023 Date today: 01 Jan 2025",
    'get_weather city name arguments parameters function {"type": "object", "properties": {}}',
]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CALL = {
    "type": "function",
    "id": "call00001",  # 9 characters, as Mistral-Nemo's template requires
    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
}

CHATS = {
    "plain": {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "Paris."},
        ]
    },
    "multi": {
        "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello there"},
            {"role": "user", "content": "Two plus two?"},
            {"role": "assistant", "content": "Four."},
        ]
    },
    "reasoning": {
        "messages": [
            {"role": "user", "content": "Two plus two?"},
            {"role": "assistant", "reasoning_content": "Add two and two.", "content": "Four."},
            {"role": "user", "content": "And three?"},
            {"role": "assistant", "reasoning_content": "Two plus three is five.", "content": "Five."},
        ]
    },
    "tools": {
        "tools": TOOLS,
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "call00001", "name": "get_weather", "content": "18 C, sunny"},
            {"role": "assistant", "content": "It is 18 C and sunny in Paris."},
        ],
    },
}


@functools.lru_cache(maxsize=1)
def tokenizer_json() -> str:
    """A byte-level BPE tokenizer.json (vocab ~600) trained on CORPUS, with SPECIAL and ADDED tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=SPECIAL,
        show_progress=False,
    )
    tk.train_from_iterator(CORPUS * 10, trainer)
    tk.add_tokens(ADDED)
    tk.add_special_tokens(SPECIAL_LATER)
    return tk.to_str()


def template_source(family: str) -> str:
    return (FIXTURES / f"{family}.jinja").read_text(encoding="utf-8")


def make_family_dir(root: Path, family: str) -> Path:
    """A model directory as transformers 5 writes one: tokenizer.json, tokenizer_config.json with the
    special tokens, and the template in chat_template.jinja."""
    bos, eos = FAMILIES[family]
    folder = root / family
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(tokenizer_json(), encoding="utf-8")
    config = {"eos_token": eos, **({"bos_token": bos} if bos else {})}
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    (folder / "chat_template.jinja").write_text(template_source(family), encoding="utf-8")
    return folder


def hf_tokenizer(family: str):
    """transformers' PreTrainedTokenizerFast over the same tokenizer, with the family's template."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    bos, eos = FAMILIES[family]
    kwargs = {"eos_token": eos, **({"bos_token": bos} if bos else {})}
    hf = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(tokenizer_json()), **kwargs)
    hf.chat_template = template_source(family)
    return hf
