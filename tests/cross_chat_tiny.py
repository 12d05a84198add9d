"""A teacher and a student that share neither tokenizer nor chat template, for the cross-tokenizer
conversation tests: the teacher a Llama-3-style model with its own byte-level BPE and a header-token
template (tests/fixtures/cross_chat/header_tokens.jinja), the student a Qwen2-style model with another
byte-level BPE (other text, other vocabulary size, other merges) and ChatML (chatml.jinja).

    pair = cross_pair()                  # Pair(root, teacher, student): model directories, built once
    convs = conversations(20)            # {"messages": [...]} records
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import json
import random
import shutil
import tempfile
from pathlib import Path

import torch

from tests.tiny import hf_config, randomise

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "cross_chat"
TEACHER_SPECIAL = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]
STUDENT_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

_TEACHER_WORDS = "the river flows past the mountain city and light falls on dark water each evening".split()
_STUDENT_WORDS = (
    "a student learns numbers one two three four five from a quick brown fox over lazy dogs".split()
)
_CHAT_WORDS = "what is the capital of france paris two plus two four thanks hello how are you fine".split()


def _text(words: list[str], seed: int, n: int = 400) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(words + _CHAT_WORDS) for _ in range(12)).capitalize() + "." for _ in range(n)]


def make_bpe(out: Path, lines: list[str], vocab_size: int, special: list[str], config: dict) -> int:
    """Train a byte-level BPE on `lines`, write tokenizer.json and tokenizer_config.json; its size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(lines, trainer=trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return tok.get_vocab_size(with_added_tokens=True)


def _model(out: Path, family: str, vocab: int, seed: int, **shape) -> None:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(family, vocab, False, **shape), dtype=torch.float32)
    randomise(model, seed)
    model.save_pretrained(out)
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 0}))


@dataclasses.dataclass(frozen=True)
class Pair:
    root: Path
    teacher: Path
    student: Path


@functools.cache
def cross_pair() -> Pair:
    """The two model directories (weights, tokenizer, template), built once per test process."""
    root = Path(tempfile.mkdtemp(prefix="kdistill-xchat-"))
    atexit.register(shutil.rmtree, root, True)
    teacher, student = root / "teacher", root / "student"
    t_vocab = make_bpe(
        teacher, _text(_TEACHER_WORDS, 1), 420, TEACHER_SPECIAL,
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
         "chat_template": (FIXTURES / "header_tokens.jinja").read_text(encoding="utf-8")},
    )  # fmt: skip
    s_vocab = make_bpe(
        student, _text(_STUDENT_WORDS, 2), 330, STUDENT_SPECIAL,
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
         "chat_template": (FIXTURES / "chatml.jinja").read_text(encoding="utf-8")},
    )  # fmt: skip
    _model(teacher, "llama", t_vocab, 3, hidden_size=64, intermediate_size=128)
    _model(student, "qwen2", s_vocab, 1)
    return Pair(root, teacher, student)


def conversations(n: int, seed: int = 0) -> list[dict]:
    """Conversations of one or two exchanges, some with a system turn."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        turns = [{"role": "system", "content": "Be brief."}] if i % 3 == 0 else []
        for _ in range(1 + i % 2):
            turns.append(
                {"role": "user", "content": " ".join(rng.choice(_CHAT_WORDS) for _ in range(5)) + "?"}
            )
            turns.append(
                {"role": "assistant", "content": " ".join(rng.choice(_CHAT_WORDS) for _ in range(4 + i % 5))}
            )
        out.append({"messages": turns})
    return out


def write_conversations(path: Path, n: int, seed: int = 0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(c) + "\n" for c in conversations(n, seed)), encoding="utf-8")
    return path
