"""Tokenizers: a thin wrapper over the `tokenizers` library's tokenizer.json.

    tok = load_tokenizer("path/to/model_dir")     # or the tokenizer.json file itself
    ids = tok.encode("hello world")                # list[int], no special tokens added
    tok.vocab_size, tok.eos_id, tok.identity       # identity: sha256 of vocab, merges, added tokens

The identity is computed from the *content* of tokenizer.json (canonical JSON of the model type, the
vocabulary, the merges and the added tokens), so two files that differ only in formatting, key order or
merge spelling ("a b" vs ["a", "b"]) have the same identity. Teacher and student are compared by it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as Backend

from kdistill.errors import UserError
from kdistill.jsonio import parse_json, read_bytes_limited

# Looked up, in this order, when neither tokenizer_config.json nor config.json names the EOS token.
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>", "[SEP]")

MAX_TOKENIZER_BYTES = 1 << 30  # refuse tokenizer.json files above 1 GiB (real ones are < 50 MB)


class Tokenizer:
    """A loaded tokenizer.json with the few things kdistill needs.

    Attributes:
        vocab_size: number of token ids, added/special tokens included.
        identity: sha256 hex of the canonicalised vocabulary, merges and added tokens.
        eos_id: id of the end-of-sequence token, or None when the files name none.
        path: the tokenizer.json it was read from.
    """

    def __init__(self, backend: Any, identity: str, eos_id: int | None, path: Path) -> None:
        self._tk = backend
        self.identity = identity
        self.eos_id = eos_id
        self.path = path
        self.vocab_size = int(backend.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without special tokens (no BOS/EOS added)."""
        try:
            return list(self._tk.encode(text, add_special_tokens=False).ids)
        except Exception as e:  # the Rust library raises plain Exception subclasses
            raise self._failed(e) from None

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """encode() of each text, in parallel inside the `tokenizers` library."""
        try:
            return [list(e.ids) for e in self._tk.encode_batch(list(texts), add_special_tokens=False)]
        except Exception as e:
            raise self._failed(e) from None

    def _failed(self, e: Exception) -> UserError:
        first = str(e).splitlines()[0] if str(e) else e.__class__.__name__
        return UserError(f"{self.path}: the tokenizer failed to encode text ({first[:200]})")

    def largest_id(self) -> tuple[int, str]:
        """(the largest token id, its token) over the vocabulary and added tokens."""
        vocab = self._tk.get_vocab(with_added_tokens=True)
        if not vocab:
            return -1, ""
        token, tid = max(vocab.items(), key=lambda kv: kv[1])
        return int(tid), token

    def encode_offsets(self, text: str) -> tuple[list[int], list[int]]:
        """(token ids, the character offset where each token ends) of `text` (no special tokens added)."""
        enc = self._tk.encode(text, add_special_tokens=False)
        return list(enc.ids), [int(end) for _, end in enc.offsets]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`; special tokens are kept."""
        return self._tk.decode([int(i) for i in ids], skip_special_tokens=False)

    def token_to_id(self, token: str) -> int | None:
        return self._tk.token_to_id(token)

    def __repr__(self) -> str:
        return f"Tokenizer({str(self.path)!r}, vocab_size={self.vocab_size}, eos_id={self.eos_id})"


class IdsOnlyTokenizer:
    """Stand-in for a model directory without tokenizer.json: token-id data works, text does not.

    `encode` raises a UserError naming what is missing, so only pre-tokenized inputs (JSONL with
    `input_ids`, `.bin` shards) can be read with it.
    """

    def __init__(self, vocab_size: int, where: str) -> None:
        self.vocab_size = int(vocab_size)
        self.identity = f"ids-only:{self.vocab_size}"
        self.eos_id: int | None = None
        self.path = Path(where)
        self._where = where

    def encode(self, text: str) -> list[int]:
        raise UserError(
            f"{self._where}: no tokenizer.json, so text data cannot be tokenized "
            "(give token ids as JSONL 'input_ids' or .bin shards, or add tokenizer.json)"
        )

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        return " ".join(str(int(i)) for i in ids)


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load tokenizer.json from a model directory (or the file itself).

    The EOS id comes from tokenizer_config.json's `eos_token`, else config.json's `eos_token_id`
    (then generation_config.json's), else the first of EOS_CANDIDATES present in the vocabulary.

    Raises:
        UserError: the path or tokenizer.json is missing, unreadable or not a valid tokenizer.
    """
    p = Path(path)
    if p.is_dir():
        file, folder = p / "tokenizer.json", p
        if not file.is_file():
            raise UserError(
                f"{p}: no tokenizer.json in this directory (expected a Hugging Face tokenizer file)"
            )
    elif p.is_file():
        file, folder = p, p.parent
    else:
        raise UserError(f"{p}: no such tokenizer file or model directory")
    raw = read_bytes_limited(file, max_bytes=MAX_TOKENIZER_BYTES, what="a tokenizer.json")
    data = parse_json(raw, where=str(file))  # the one JSON reader: UTF-8, syntax and depth checked
    text = raw.decode("utf-8").removeprefix("\ufeff")
    if not isinstance(data, dict) or not isinstance(data.get("model"), dict):
        raise UserError(f"{file}: no 'model' object, expected a Hugging Face tokenizer.json")
    try:
        backend = Backend.from_str(text)
    except Exception as e:  # the Rust library raises plain Exception subclasses
        first = str(e).splitlines()[0] if str(e) else e.__class__.__name__
        raise UserError(f"{file}: not a valid tokenizer.json ({first[:200]})") from None
    identity = tokenizer_identity(data)
    tok = Tokenizer(backend, identity, None, file)
    tok.eos_id = _find_eos(tok, folder)
    return tok


def tokenizer_identity(data: dict[str, Any]) -> str:
    """sha256 hex over the canonical form of a parsed tokenizer.json's vocab, merges and added tokens."""
    model = data.get("model") or {}
    vocab = model.get("vocab")
    if isinstance(vocab, dict):
        # Order by id, then token: the JSON key order of the file does not matter.
        vocab = sorted(([str(k), v] for k, v in vocab.items()), key=lambda kv: (str(kv[1]), kv[0]))
    merges = []
    for m in model.get("merges") or []:
        if isinstance(m, str):
            merges.append(m.split(" ", 1))
        else:
            merges.append(m)
    added = []
    for t in data.get("added_tokens") or []:
        if isinstance(t, dict):
            added.append([t.get("id"), t.get("content"), bool(t.get("special"))])
    added.sort(key=lambda t: (str(t[0]), str(t[1])))
    canon = {"type": model.get("type"), "vocab": vocab, "merges": merges, "added_tokens": added}
    blob = json.dumps(canon, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(blob.encode("utf-8", "surrogatepass")).hexdigest()


def _read_json(path: Path) -> dict[str, Any]:
    try:
        if path.is_file() and path.stat().st_size < (64 << 20):
            data = json.loads(path.read_text(encoding="utf-8"))
            return data if isinstance(data, dict) else {}
    except (OSError, ValueError, RecursionError):
        pass  # an unreadable side file only means we look for EOS elsewhere
    return {}


def _find_eos(tok: Tokenizer, folder: Path) -> int | None:
    eos = _read_json(folder / "tokenizer_config.json").get("eos_token")
    if isinstance(eos, dict):
        eos = eos.get("content")
    if isinstance(eos, str) and tok.token_to_id(eos) is not None:
        return tok.token_to_id(eos)
    for name in ("config.json", "generation_config.json"):
        value = _read_json(folder / name).get("eos_token_id")
        if isinstance(value, list) and value:
            value = value[0]
        if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < tok.vocab_size:
            return value
    for cand in EOS_CANDIDATES:
        if tok.token_to_id(cand) is not None:
            return tok.token_to_id(cand)
    return None
