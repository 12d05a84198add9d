"""Conversations: read from JSONL or Parquet, rendered with the chat template, tokenized with the
answers marked as the only tokens to learn.

    convs = read_conversations("chats.jsonl")                    # [Conversation(messages, train, source)]
    tc = tokenize_conversation(convs[0], template, tokenizer)    # input_ids, trained (per token), spans
    tc.labels(-100)                                              # targets per position, -100 where masked

File formats (detected per file from the first record; every other record must have the same shape):
- `messages`: a list of {"role", "content"} with roles system / user / assistant, content a string;
  at least one assistant turn. Every assistant turn is an answer to learn.
- `prompt` + `completion`: `prompt` a string (one user turn) or a list of messages; `completion` a
  string (one assistant turn) or a list of messages with at least one assistant turn. Only the
  completion's assistant turns are learned; assistant turns inside the prompt are context.
- JSONL (`.jsonl`, `.ndjson`): one JSON object per line; blank lines are skipped.
- Parquet (`.parquet`, needs the `parquet` extra: pyarrow): the same columns, one row per record.
Other keys of a record or message are ignored. A malformed record is a one-line UserError naming the
file and the line (JSONL) or row (Parquet, counted from 1).

What is learned (train_on="assistant"): each answer's text AND the special token that closes it in the
rendered text (`<|im_end|>`, `<|eot_id|>`: the student must learn to stop). The template's headers
(`<|im_start|>assistant\\n`), system and user turns, and answers that are only context are masked.
An answer starts where the generation prompt for it ends: render(messages[:k],
add_generation_prompt=True) must be a prefix of the whole rendering. It ends where its content ends,
found by rendering once more with an invisible private-use marker after each answer's text (before
trailing whitespace, so templates that `trim` see the same text) and checking that, markers removed,
the text is the same (trailing whitespace the template keeps belongs to the answer). Character spans map to tokens through the tokenizer's offsets: a token is learned
when it starts inside an answer span. train_on="all" learns every token.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from kdistill.data.chat_template import ChatTemplate
from kdistill.errors import UserError

ROLES = ("system", "user", "assistant")
TRAIN_ON = ("assistant", "all")
MAX_LINE_BYTES = 16 << 20  # a JSONL line longer than this is refused (bounded memory per line)
JSONL_SUFFIXES = (".jsonl", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)
FORMATS = ("messages", "prompt_completion")


@dataclasses.dataclass(frozen=True)
class Conversation:
    """One conversation: its messages, which of them are answers to learn, and where it came from.

    Attributes:
        messages: ({"role": ..., "content": ...}, ...) in order.
        train: per message, True for an assistant turn whose text is learned.
        source: "file:line" (JSONL) or "file:row N" (Parquet), for messages.
    """

    messages: tuple[dict[str, str], ...]
    train: tuple[bool, ...]
    source: str


# ---------------------------------------------------------------------------------------------------
# Records -> conversations


def detect_format(record: Any) -> str | None:
    """ "messages" or "prompt_completion" for a record of that shape, else None."""
    if not isinstance(record, dict):
        return None
    if "messages" in record:
        return "messages"
    if "prompt" in record and "completion" in record:
        return "prompt_completion"
    return None


def _messages(value: Any, where: str, field: str) -> list[dict[str, str]]:
    if not isinstance(value, list):
        raise UserError(f"{where}: '{field}' is {_json_type(value)}, expected a list of messages")
    if not value:
        raise UserError(f"{where}: '{field}' is an empty list, expected at least one message")
    out = []
    for i, m in enumerate(value):
        at = f"{where}: {field}[{i}]"
        if not isinstance(m, dict):
            raise UserError(f"{at} is {_json_type(m)}, expected an object with 'role' and 'content'")
        if "role" not in m:
            raise UserError(f"{at} has no 'role' (expected one of {', '.join(ROLES)})")
        role = m["role"]
        if role not in ROLES:
            raise UserError(f"{at}: role {_short(role)} is unknown, expected one of {', '.join(ROLES)}")
        if "content" not in m:
            raise UserError(f"{at} ({role}) has no 'content' (expected a string)")
        if not isinstance(m["content"], str):
            raise UserError(f"{at} ({role}): content is {_json_type(m['content'])}, expected a string")
        out.append({"role": role, "content": m["content"]})
    return out


def conversation_from_record(record: Any, fmt: str, where: str) -> Conversation:
    """Check one record of format `fmt` and turn it into a Conversation.

    Raises:
        UserError: one line naming `where` (file:line) and what was expected.
    """
    if not isinstance(record, dict):
        raise UserError(f"{where}: a record is {_json_type(record)}, expected a JSON object")
    got = detect_format(record)
    if got is None:
        keys = ", ".join(sorted(map(str, record))[:8]) or "none"
        raise UserError(
            f"{where}: record has keys [{keys}], expected 'messages' or 'prompt' + 'completion' "
            f"(this file's first record has {_format_words(fmt)})"
        )
    if got != fmt:
        raise UserError(
            f"{where}: record has {_format_words(got)} but this file's first record has "
            f"{_format_words(fmt)} (one format per file)"
        )
    if fmt == "messages":
        messages = _messages(record["messages"], where, "messages")
        train = [m["role"] == "assistant" for m in messages]
    else:
        prompt, completion = record["prompt"], record["completion"]
        if isinstance(prompt, str):
            head = [{"role": "user", "content": prompt}]
        else:
            head = _messages(prompt, where, "prompt")
        if isinstance(completion, str):
            tail = [{"role": "assistant", "content": completion}]
        else:
            tail = _messages(completion, where, "completion")
        messages = head + tail
        train = [False] * len(head) + [m["role"] == "assistant" for m in tail]
    if not any(train):
        field = "messages" if fmt == "messages" else "completion"
        raise UserError(f"{where}: '{field}' has no assistant turn, expected at least one answer to learn")
    return Conversation(messages=tuple(messages), train=tuple(train), source=where)


def _format_words(fmt: str) -> str:
    return "'messages'" if fmt == "messages" else "'prompt' + 'completion'"


# ---------------------------------------------------------------------------------------------------
# Files


def read_conversations_jsonl(f: BinaryIO, name: str) -> list[Conversation]:
    """Every conversation of a JSONL stream (opened in binary); `name` is used in messages.

    Raises:
        UserError: a line that is not UTF-8, not JSON, too long, of another format than the first
            record, or not a valid conversation; or a file without any record.
    """
    out: list[Conversation] = []
    fmt: str | None = None
    lineno = 0
    while True:
        raw = f.readline(MAX_LINE_BYTES + 1)
        if not raw:
            break
        lineno += 1
        if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
            raise UserError(f"{name}:{lineno}: line longer than {MAX_LINE_BYTES >> 20} MiB")
        where = f"{name}:{lineno}"
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise UserError(f"{where}: not UTF-8 at byte {e.start} of the line") from None
        if lineno == 1:
            text = text.removeprefix("\ufeff")
        if not text.strip():
            continue
        try:
            record = json.loads(text)
        except json.JSONDecodeError as e:
            raise UserError(f"{where}: not valid JSON (column {e.colno}: {e.msg})") from None
        except RecursionError:
            raise UserError(f"{where}: JSON nested too deeply") from None
        if fmt is None:
            fmt = detect_format(record)
            if fmt is None:
                keys = ", ".join(sorted(map(str, record))[:8]) if isinstance(record, dict) else ""
                shape = f"keys [{keys}]" if isinstance(record, dict) else _json_type(record)
                raise UserError(
                    f"{where}: first record has {shape}, expected a conversation: 'messages' "
                    "(a list of {role, content}) or 'prompt' + 'completion'"
                )
        out.append(conversation_from_record(record, fmt, where))
    if not out:
        raise UserError(f"{name}: no conversation records (the file is empty or blank)")
    return out


def read_conversations_parquet(path: str | Path) -> list[Conversation]:
    """Every conversation of a Parquet file with a `messages` column or `prompt` + `completion` columns.

    Raises:
        UserError: pyarrow missing (names the `parquet` extra), an unreadable file, missing columns,
            or a row that is not a valid conversation (named by its row, counted from 1).
    """
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError(f"{path}: reading Parquet needs pyarrow (pip install 'kdistill[parquet]')") from None
    try:
        pf = pq.ParquetFile(str(path))
    except (OSError, ValueError) as e:
        first = str(e).splitlines()[0] if str(e) else e.__class__.__name__
        raise UserError(f"{path}: not a readable Parquet file ({first[:200]})") from None
    columns = set(pf.schema_arrow.names)
    if "messages" in columns:
        fmt, wanted = "messages", ["messages"]
    elif {"prompt", "completion"} <= columns:
        fmt, wanted = "prompt_completion", ["prompt", "completion"]
    else:
        have = ", ".join(sorted(columns)[:8]) or "none"
        raise UserError(
            f"{path}: columns [{have}], expected 'messages' or 'prompt' + 'completion' for conversations"
        )
    out: list[Conversation] = []
    row = 0
    try:
        for batch in pf.iter_batches(batch_size=1024, columns=wanted):
            for record in batch.to_pylist():
                row += 1
                # Parquet structs carry every field of the schema: absent ones read as None.
                if fmt == "messages" and isinstance(record.get("messages"), list):
                    record["messages"] = [_drop_none(m) for m in record["messages"]]
                out.append(conversation_from_record(record, fmt, f"{path}:row {row}"))
    except OSError as e:
        raise UserError(f"{path}: cannot read row {row + 1} ({str(e).splitlines()[0][:200]})") from None
    if not out:
        raise UserError(f"{path}: no rows")
    return out


def _drop_none(m: Any) -> Any:
    return {k: v for k, v in m.items() if v is not None} if isinstance(m, dict) else m


def read_conversations(path: str | Path) -> list[Conversation]:
    """Every conversation of a `.jsonl`/`.ndjson` or `.parquet` file, by suffix.

    Raises:
        UserError: see read_conversations_jsonl / read_conversations_parquet; or another suffix.
    """
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix in PARQUET_SUFFIXES:
        return read_conversations_parquet(p)
    if suffix not in JSONL_SUFFIXES:
        raise UserError(f"{p}: conversations are read from .jsonl, .ndjson or .parquet files")
    try:
        with open(p, "rb") as f:
            return read_conversations_jsonl(f, str(p))
    except OSError as e:
        raise UserError(f"{p}: cannot read ({e.strerror or e.__class__.__name__})") from None


def sniff_format(path: str | Path) -> str | None:
    """ "messages" / "prompt_completion" when a JSONL file's first record is a conversation (or a
    Parquet file has those columns), else None: lets a loader send the file here or to the text reader."""
    p = Path(path)
    if p.suffix.lower() in PARQUET_SUFFIXES:
        return "parquet"
    try:
        with open(p, "rb") as f:
            for _ in range(1000):
                raw = f.readline(MAX_LINE_BYTES + 1)
                if not raw:
                    return None
                if raw.strip():
                    try:
                        return detect_format(json.loads(raw.decode("utf-8").removeprefix("\ufeff")))
                    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
                        return None
    except OSError:
        return None
    return None


# ---------------------------------------------------------------------------------------------------
# Rendering and tokenizing


@dataclasses.dataclass
class TokenizedConversation:
    """A conversation as the student sees it.

    Attributes:
        input_ids: (n,) int64 token ids of the rendered text.
        trained: (n,) bool, True for a token the student learns to predict (inside an answer span).
        text: the rendered text.
        spans: [(start, end)] character spans of the learned text (answers and their end-of-turn).
        source: where the conversation came from.
    """

    input_ids: np.ndarray
    trained: np.ndarray
    text: str
    spans: list[tuple[int, int]]
    source: str

    def __len__(self) -> int:
        return len(self.input_ids)

    def labels(self, ignore_index: int = -100) -> np.ndarray:
        """(n,) int64 targets per position, as the batcher's labels: labels[i] = input_ids[i + 1] when
        that token is learned, else ignore_index (always at the last position)."""
        out = np.full(len(self.input_ids), ignore_index, dtype=np.int64)
        if len(self.input_ids) > 1:
            nxt = self.input_ids[1:]
            out[:-1] = np.where(self.trained[1:], nxt, ignore_index)
        return out


def _backend(tokenizer: Any) -> Any:
    """The `tokenizers.Tokenizer` behind `tokenizer`: kdistill's Tokenizer keeps it as `_tk`; a
    `tokenizers.Tokenizer` is used as it is."""
    backend = getattr(tokenizer, "_tk", tokenizer)
    if not hasattr(backend, "get_added_tokens_decoder") or not hasattr(backend, "encode"):
        raise TypeError(
            f"expected a tokenizers.Tokenizer or kdistill Tokenizer, got {type(tokenizer).__name__}"
        )
    return backend


def special_token_strings(tokenizer: Any) -> list[str]:
    """The tokenizer's special added tokens (e.g. <|im_end|>, <|eot_id|>), longest first."""
    added = _backend(tokenizer).get_added_tokens_decoder()
    return sorted({t.content for t in added.values() if t.special}, key=len, reverse=True)


def _marker_for(messages: Sequence[Mapping[str, str]], template: ChatTemplate) -> str:
    for code in range(0xE000, 0xF900):  # Unicode private use area: never in a template or a tokenizer
        ch = chr(code)
        if ch not in template.source and not any(ch in m["content"] for m in messages):
            return ch
    raise UserError("conversation uses every private-use character; cannot locate its answers")


def answer_spans(
    conv: Conversation, template: ChatTemplate, special_tokens: Sequence[str] = ()
) -> tuple[str, list[tuple[int, int]]]:
    """(rendered text, [(start, end)] character span of each learned answer, end-of-turn included).

    `special_tokens`: the tokenizer's special tokens, longest first; the one that directly follows an
    answer in the text is its end-of-turn and is part of the span.

    Raises:
        UserError: the template fails on this conversation, renders earlier turns differently once a
            later turn exists, or alters an answer's text so that its end cannot be found.
    """
    messages = list(conv.messages)
    text = template.render(messages)
    marker = _marker_for(messages, template)
    marked = []
    for m, learn in zip(messages, conv.train):
        if learn:
            core = m["content"].rstrip()
            m = {**m, "content": core + marker + m["content"][len(core) :]}
        marked.append(m)
    marked_text = template.render(marked)
    if marked_text.replace(marker, "") != text:
        raise UserError(
            f"{conv.source}: the chat template {template.origin} changes an answer's text around its "
            "end, so the answers cannot be located for loss masking (use data.train_on=all)"
        )
    ends = []
    removed = 0
    for i, ch in enumerate(marked_text):
        if ch == marker:
            ends.append(i - removed)
            removed += 1
    learned = [k for k, t in enumerate(conv.train) if t]
    if len(ends) != len(learned):
        raise UserError(
            f"{conv.source}: the chat template {template.origin} shows {len(ends)} of "
            f"{len(learned)} answers, so the answers cannot be located for loss masking"
        )
    spans = []
    for k, end in zip(learned, ends):
        content = messages[k]["content"]
        trail = content[len(content.rstrip()) :]
        if text.startswith(trail, end):  # trailing whitespace the template kept is part of the answer
            end += len(trail)
        prompt = template.render(messages[:k], add_generation_prompt=True)
        if not text.startswith(prompt):
            raise UserError(
                f"{conv.source}: the chat template {template.origin} renders the turns before answer "
                f"{k} differently from its generation prompt, so the answer's start cannot be found"
            )
        start = len(prompt)
        if end < start:
            raise UserError(
                f"{conv.source}: answer {k} ends before its generation prompt does in the rendering "
                f"of {template.origin}"
            )
        for tok in special_tokens:
            if text.startswith(tok, end):
                end += len(tok)
                break
        spans.append((start, end))
    return text, spans


def tokenize_conversation(
    conv: Conversation, template: ChatTemplate, tokenizer: Any, train_on: str = "assistant"
) -> TokenizedConversation:
    """Render `conv` with `template`, encode it (no special tokens added: the template writes them, as
    in `apply_chat_template`), and mark the learned tokens.

    Args:
        tokenizer: kdistill's Tokenizer or a `tokenizers.Tokenizer`.
        train_on: "assistant" (answers and their end-of-turn only) or "all" (every token).

    Raises:
        UserError: see answer_spans; or an unknown train_on.
    """
    if train_on not in TRAIN_ON:
        raise UserError(f"data.train_on is {train_on!r}, expected one of {', '.join(TRAIN_ON)}")
    backend = _backend(tokenizer)
    if train_on == "all":
        text = template.render(list(conv.messages))
        spans = [(0, len(text))]
    else:
        text, spans = answer_spans(conv, template, special_token_strings(backend))
    enc = backend.encode(text, add_special_tokens=False)
    ids = np.asarray(enc.ids, dtype=np.int64)
    starts = np.asarray([a for a, _ in enc.offsets], dtype=np.int64)
    trained = np.zeros(len(ids), dtype=bool)
    for a, b in spans:
        trained |= (starts >= a) & (starts < b)
    return TokenizedConversation(input_ids=ids, trained=trained, text=text, spans=spans, source=conv.source)


def end_of_turn_token(template: ChatTemplate, tokenizer: Any) -> str | None:
    """The special token the template writes after an answer (e.g. <|im_end|>), or None: a stop token
    for generation."""
    probe = Conversation(
        messages=({"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}),
        train=(False, True),
        source=f"{template.origin} (probe)",
    )
    text, spans = answer_spans(probe, template, special_token_strings(tokenizer))
    start, end = spans[0]
    answer_end = text.index("Hello", start) + len("Hello")
    return text[answer_end:end] or None


# ---------------------------------------------------------------------------------------------------


def _json_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, int | float):
        return "a number"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, list):
        return "a list"
    if isinstance(v, dict):
        return "an object"
    return type(v).__name__


def _short(v: Any, n: int = 40) -> str:
    s = json.dumps(v, ensure_ascii=False) if not isinstance(v, str) else repr(v)
    return s if len(s) <= n else s[: n - 3] + "..."
