"""Conversations: read from JSONL or Parquet, rendered with the chat template, tokenized with the
answers marked as the only tokens to learn.

    convs = read_conversations("chats.jsonl")                    # [Conversation(messages, train, source)]
    tc = tokenize_conversation(convs[0], template, tokenizer)    # input_ids, trained (per token), spans
    tc.labels(-100)                                              # targets per position, -100 where masked

File formats (detected per file from the first record; every other record must have the same shape):
- `messages`: a list of messages, each an object with a string `role` and `content` (a string, a list
  of content parts, or null/absent on an assistant turn with `tool_calls`). Every key of a message
  (`reasoning_content`, `tool_calls`, `tool_call_id`, `name`, ...) reaches the template as given; roles
  are whatever the template accepts (`tool` included). Every assistant turn is an answer to learn.
- `prompt` + `completion`: `prompt` a string (one user turn) or a list of messages; `completion` a
  string (one assistant turn) or a list of messages with at least one assistant turn. Only the
  completion's assistant turns are learned; assistant turns inside the prompt are context.
- either may carry `tools`: a list of tool definitions, passed to the template as transformers passes
  it. Tools for every record of a file: a JSONL file's first record may be `{"tools": [...]}` alone (a
  header, not a conversation); a Parquet file's schema metadata may hold `tools` (a JSON list). A record's
  own `tools` wins over its file's, and a file's over the run's `data.template_kwargs.tools`.
- JSONL (`.jsonl`, `.ndjson`): one JSON object per line; blank lines are skipped.
- Parquet (`.parquet`, needs the `parquet` extra: pyarrow): the same columns, one row per record.
Other keys of a record are ignored. A malformed record is a one-line UserError naming the file and the
line (JSONL) or row (Parquet, counted from 1).

What is learned (train_on="assistant"), found by render diffs and never by searching the text for
words: an answer's learned tokens are those the model must write after the template's generation
prompt, through its end-of-turn token: reasoning block and tool calls included, as the template renders
them in the conversation. For answer k:
- its body is where the full rendering changes when answer k alone is replaced by a one-character
  stand-in (its reasoning, tool calls and content all go): the common prefix and suffix of the two
  renderings bound it, so a template that transforms content (`| upper`) is located all the same;
  a template that refuses that stand-in (a role-alternation check, a tool result that needs its call)
  gets it with `tool_calls: null`, then the turn itself with every value the model writes masked
  (content, reasoning, call names and arguments; ids kept): the body then spans its first to its last
  value, and the turn's own opening and closing (what the rendering that ends with it writes before the
  first and after the last, e.g. `[TOOL_CALLS][{"name": "` and `"}]</s>`) are added. A tool-call turn is
  learned whenever the template renders its calls, with or without content; it is refused only when
  nothing of it appears (the same text with or without the turn);
- it starts where the template's generation prompt for it ends: the generation prompt's own text
  (render(messages[:k], add_generation_prompt=True) minus render(messages[:k])) is found ending at
  or before the body, longest prefix first (DeepSeek-R1's prompt ends in `<think>\n`, which history
  does not repeat: its `<｜Assistant｜>` is matched); an empty one (Mistral) starts at the body;
- it ends with the end-of-turn token: the special token (of the tokenizer) that the unchanged tail
  after the body starts with, after any whitespace; none when the tail starts otherwise.
train_on="last_assistant" learns the last such answer only; "all" learns every token. Character spans
map to tokens through the tokenizer's offsets: a token is learned when it overlaps a span.
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

ROLES = ("system", "user", "assistant", "tool")  # the usual ones; any string role reaches the template
TRAIN_ON = ("assistant", "last_assistant", "all")
# Message fields a template may or may not render: a conversation that carries one its template drops
# is reported (warn_unrendered) rather than trained on silently without it.
TRACE_FIELDS = ("reasoning_content", "reasoning", "thinking", "tool_calls")
UNRENDERED_CALL_TEXT = "the text of tool-call turns"  # how unrendered_fields names it
MAX_LINE_BYTES = 16 << 20  # a JSONL line longer than this is refused (bounded memory per line)
JSONL_SUFFIXES = (".jsonl", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)
FORMATS = ("messages", "prompt_completion")


@dataclasses.dataclass(frozen=True)
class Conversation:
    """One conversation: its messages, which of them are answers to learn, and where it came from.

    Attributes:
        messages: ({"role": ..., "content": ..., any other key}, ...) in order, as given.
        train: per message, True for an assistant turn whose text is learned.
        source: "file:line" (JSONL) or "file:row N" (Parquet), for messages.
        tools: the record's `tools` list, else its file's (None: neither gives one).
        tools_from: "record" or "file" (a JSONL header, Parquet metadata) for `tools`; "" for none.
    """

    messages: tuple[dict[str, Any], ...]
    train: tuple[bool, ...]
    source: str
    tools: tuple[Any, ...] | None = None
    tools_from: str = ""


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


def _messages(value: Any, where: str, field: str) -> list[dict[str, Any]]:
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
            raise UserError(f"{at} has no 'role' (expected a string such as {', '.join(ROLES)})")
        role = m["role"]
        if not isinstance(role, str) or not role:
            raise UserError(
                f"{at}: role {_short(role)} is not a name, expected a string such as {', '.join(ROLES)}"
            )
        calls = m.get("tool_calls") is not None
        if "content" not in m and not calls:
            raise UserError(f"{at} ({role}) has no 'content' (expected a string, or 'tool_calls')")
        content = m.get("content")
        if not (isinstance(content, str | list) or (content is None and calls)):
            raise UserError(
                f"{at} ({role}): content is {_json_type(content)}, expected a string or a list of parts"
                + (" (null only with 'tool_calls')" if content is None else "")
            )
        if calls and not isinstance(m["tool_calls"], list):
            raise UserError(f"{at} ({role}): tool_calls is {_json_type(m['tool_calls'])}, expected a list")
        out.append(dict(m))
    return out


def _tools(record: dict[str, Any], where: str) -> tuple[Any, ...] | None:
    tools = record.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise UserError(
            f"{where}: 'tools' is {_json_type(tools)}, expected a list of tool definitions (objects)"
        )
    return tuple(tools)


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
    tools = _tools(record, where)
    return Conversation(
        messages=tuple(messages),
        train=tuple(train),
        source=where,
        tools=tools,
        tools_from="record" if tools is not None else "",
    )


def is_tools_header(record: Any) -> bool:
    """A JSONL file's tools header: an object whose only key is `tools`."""
    return isinstance(record, dict) and set(record) == {"tools"}


def tools_header(record: Any, where: str) -> tuple[Any, ...]:
    """The tools of a file's tools header record (see is_tools_header), checked.

    Raises:
        UserError: `tools` is not a list of objects (naming `where`).
    """
    tools = _tools(record, f"{where} (the file's tools header)")
    return tools if tools is not None else ()


def tool_names(tools: Sequence[Any]) -> list[str]:
    """The names of tool definitions ({"function": {"name": ...}} or {"name": ...}), "?" where none."""
    out = []
    for t in tools:
        fn = t.get("function") if isinstance(t, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else t.get("name") if isinstance(t, dict) else None
        out.append(name if isinstance(name, str) else "?")
    return out


def with_file_tools(conv: Conversation, tools: tuple[Any, ...] | None) -> Conversation:
    """`conv` with its file's tools when it has none of its own (a record's own tools win)."""
    if tools is None or conv.tools is not None:
        return conv
    return dataclasses.replace(conv, tools=tools, tools_from="file")


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
    file_tools: tuple[Any, ...] | None = None
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
        if is_tools_header(record):
            if fmt is not None or file_tools is not None:
                raise UserError(
                    f"{where}: a record with only 'tools' is the file's tools header, expected only as "
                    "the first record"
                )
            file_tools = tools_header(record, where)
            continue
        if fmt is None:
            fmt = detect_format(record)
            if fmt is None:
                keys = ", ".join(sorted(map(str, record))[:8]) if isinstance(record, dict) else ""
                shape = f"keys [{keys}]" if isinstance(record, dict) else _json_type(record)
                raise UserError(
                    f"{where}: first record has {shape}, expected a conversation: 'messages' "
                    "(a list of {role, content}) or 'prompt' + 'completion'"
                )
        out.append(with_file_tools(conversation_from_record(record, fmt, where), file_tools))
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
    if "tools" in columns:
        wanted.append("tools")
    file_tools = _parquet_tools(pf.schema_arrow.metadata, path)
    out: list[Conversation] = []
    row = 0
    try:
        for batch in pf.iter_batches(batch_size=1024, columns=wanted):
            for record in batch.to_pylist():
                row += 1
                # Parquet structs carry every field of the schema: absent ones read as None.
                if fmt == "messages" and isinstance(record.get("messages"), list):
                    record["messages"] = [_drop_none(m) for m in record["messages"]]
                conv = conversation_from_record(record, fmt, f"{path}:row {row}")
                out.append(with_file_tools(conv, file_tools))
    except OSError as e:
        raise UserError(f"{path}: cannot read row {row + 1} ({str(e).splitlines()[0][:200]})") from None
    if not out:
        raise UserError(f"{path}: no rows")
    return out


def _parquet_tools(metadata: Mapping[bytes, bytes] | None, path: str | Path) -> tuple[Any, ...] | None:
    """The file's tools from its schema metadata key `tools` (a JSON list of tool definitions)."""
    raw = (metadata or {}).get(b"tools")
    if raw is None:
        return None
    where = f"{path}: schema metadata 'tools'"
    try:
        value = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise UserError(f"{where} is not JSON, expected a list of tool definitions (objects)") from None
    return _tools({"tools": value}, where)


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
                        record = json.loads(raw.decode("utf-8").removeprefix("\ufeff"))
                    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
                        return None
                    if not is_tools_header(record):  # a tools header: the next record tells
                        return detect_format(record)
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
        trained: (n,) bool, True for a token the student learns to predict (overlapping an answer span).
        text: the rendered text.
        spans: [(start, end)] character spans of the learned text (answers and their end-of-turn).
        source: where the conversation came from.
        unrendered: fields the conversation carries that the template does not render (e.g.
            "reasoning_content", "tools"): their text is not in `text`.
    """

    input_ids: np.ndarray
    trained: np.ndarray
    text: str
    spans: list[tuple[int, int]]
    source: str
    unrendered: tuple[str, ...] = ()

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


def _common_prefix(a: str, b: str) -> int:
    """Length of the longest common prefix of a and b (binary search over slice comparisons: C speed)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _common_suffix(a: str, b: str) -> int:
    return _common_prefix(a[::-1], b[::-1])


def _prompt_end(text: str, prompt: str, lo: int, hi: int) -> int:
    """Where the generation prompt's text ends in text[lo:hi]: the end of the last occurrence, ending at
    or before hi, of the longest prefix of `prompt` found there; hi when none is."""
    if not prompt or text.rfind(prompt[:1], lo, hi) < 0:
        return hi
    if text.rfind(prompt, lo, hi) >= 0:
        return text.rfind(prompt, lo, hi) + len(prompt)
    found, missing = 1, len(prompt)  # prompt[:found] occurs; prompt[:missing] does not (monotone in m)
    while missing - found > 1:
        mid = (found + missing) // 2
        if text.rfind(prompt[:mid], lo, hi) >= 0:
            found = mid
        else:
            missing = mid
    return text.rfind(prompt[:found], lo, hi) + found


class _Renderer:
    """Renders one conversation's message lists with its tools and the template variables."""

    def __init__(self, conv: Conversation, template: ChatTemplate, kwargs: Mapping[str, Any] | None) -> None:
        values = dict(kwargs or {})
        run_tools = values.pop("tools", None)
        self.template, self.values = template, values
        self.tools = list(conv.tools) if conv.tools is not None else run_tools

    def __call__(self, messages: Sequence[Mapping[str, Any]], gen: bool = False, tools: Any = "same") -> str:
        return self.template.render(
            messages, add_generation_prompt=gen, tools=self.tools if tools == "same" else tools, **self.values
        )


def _stand_in(conv: Conversation, template: ChatTemplate) -> str:
    """One private-use character found in neither the template nor the conversation: what an answer is
    replaced by to find where it is rendered."""
    try:
        seen = json.dumps([conv.messages, conv.tools], ensure_ascii=False, default=str)
    except (RecursionError, ValueError):
        raise UserError(
            f"{conv.source}: a message is nested too deeply, expected plain JSON values"
        ) from None
    for code in range(0xE000, 0xF900):  # Unicode private use area: never in a template or a tokenizer
        ch = chr(code)
        if ch not in template.source and ch not in seen:
            return ch
    raise UserError(
        f"{conv.source}: conversation uses every private-use character; cannot locate its answers"
    )


@dataclasses.dataclass(frozen=True)
class Answer:
    """Where an answer is in the rendered conversation (character offsets).

    Attributes:
        message: its index in the conversation's messages.
        start, end: the learned span [start, end): from the end of its generation prompt through its
            end-of-turn token.
        body_end: where the text that depends on the answer ends (end - body_end covers the
            end-of-turn token and the whitespace before it).
        end_of_turn: the special token that closes it ("" when the template writes none).
    """

    message: int
    start: int
    end: int
    body_end: int
    end_of_turn: str


def locate_answers(
    conv: Conversation,
    template: ChatTemplate,
    special_tokens: Sequence[str] = (),
    template_kwargs: Mapping[str, Any] | None = None,
    train_on: str = "assistant",
) -> tuple[str, list[Answer]]:
    """(rendered text, the learned answers), located by render diffs (see the module docstring).

    Raises:
        UserError: the template fails on this conversation (one line naming it), or does not render
            an answer at all (the same text with or without it).
    """
    render = _Renderer(conv, template, template_kwargs)
    messages = list(conv.messages)
    text = render(messages)
    learned = [k for k, t in enumerate(conv.train) if t]
    if train_on == "last_assistant":
        learned = learned[-1:]
    if not learned:
        return text, []
    mark = _stand_in(conv, template)
    answers: list[Answer] = []
    lo = 0
    for k in learned:
        stand_in, alt, kept = _alternative(render, messages, k, mark)
        if alt != text and not kept and _body(text, alt)[0] == _body(text, alt)[1]:
            # Nothing where the stand-in shows: a template that skips the turn (e.g. a tool-call turn
            # it does not render) gives the conversation without it.
            alt = text if _try(render, messages[:k] + messages[k + 1 :]) == text else alt
        if alt == text:
            raise UserError(
                f"{conv.source}: the chat template {template.origin} does not render answer {k} (the "
                "same text with or without it), so it cannot be learned (use data.train_on=all)"
            )
        body, body_end = _body(text, alt)
        start = body
        # (a template that refuses the history alone, e.g. one ending on a tool result, has no prompt
        # to match: the answer starts at its body)
        prompt = _try(render, messages[:k], gen=True)
        before = _try(render, messages[:k]) if k else ""
        # The rendering that ends with this turn: what it writes after its body is its own closing.
        own = text if k + 1 == len(messages) else _try(render, messages[: k + 1])
        own_alt = alt if k + 1 == len(messages) else _try(render, messages[:k] + [stand_in])
        alone = own is not None and own_alt is not None
        if not alone:  # a template that refuses to end on this turn: no closing of its own to add
            own, own_alt = text, alt
        own_body, own_body_end = _body(own, own_alt)
        if prompt is not None and before is not None:
            gen_text = prompt[_common_prefix(before, prompt) :]
            # With the turn kept (its values masked), the text before its first value is the turn's
            # own (e.g. `[TOOL_CALLS][{"name": "`): without a generation prompt, the turn starts where
            # the history's rendering ends.
            head = _common_prefix(before, own) if kept and not gen_text else None
            if k + 1 == len(messages):  # the turn's own rendering is the conversation's
                start = _prompt_end(text, gen_text, max(lo, _common_prefix(before, text)), body)
                if head is not None:
                    start = max(lo, min(head, body))
            else:
                # Find the prompt in the rendering that ends with this turn (its region is bounded by
                # the history before it there), then carry the text between the prompt and the body
                # (e.g. Qwen3's "<think>\n") over when the conversation renders it too.
                lead_at = (
                    head
                    if head is not None
                    else _prompt_end(own, gen_text, _common_prefix(before, own), own_body)
                )
                lead = own[min(lead_at, own_body) : own_body]
                if lead and lo <= body - len(lead) and text[body - len(lead) : body] == lead:
                    start = body - len(lead)
        tail = text[body_end:]
        closing = own[own_body_end:].rstrip() if alone else ""
        if kept and closing and tail.startswith(closing):
            # The turn kept its structure: what the rendering that ends with it writes after its last
            # value is its own closing (e.g. `"}]</s>`), end-of-turn token included when it ends with one.
            end = body_end + len(closing)
            eot = next((t for t in special_tokens if closing.endswith(t)), "")
        else:
            ws = len(tail) - len(tail.lstrip())
            eot = next((t for t in special_tokens if text.startswith(t, body_end + ws)), "")
            end = body_end + ws + len(eot) if eot else body_end
        answers.append(Answer(message=k, start=start, end=end, body_end=body_end, end_of_turn=eot))
        lo = end
    return text, answers


def _masked(value: Any, mark: str) -> Any:
    """`value` with every string replaced by as many `mark` characters (lengths kept, so a template's
    length checks still pass); the values of "id" and "type" keys are kept (templates match call ids
    against tool results and branch on types)."""
    if isinstance(value, str):
        return mark * len(value)
    if isinstance(value, list):
        return [_masked(v, mark) for v in value]
    if isinstance(value, dict):
        return {key: v if key in ("id", "type") else _masked(v, mark) for key, v in value.items()}
    return value


def _alternative(
    render: _Renderer, messages: list[dict[str, Any]], k: int, mark: str
) -> tuple[dict[str, Any], str, bool]:
    """(stand-in, rendering with answer k replaced by it, whether the stand-in keeps the turn's own
    structure): the first of these the template renders without an error.

    1. the answer gone, its content one `mark`: the diff is all the turn writes;
    2. the same, with `tool_calls: null` kept as a key: templates that tell tool-call turns apart by the
       key being defined (e.g. a role-alternation check over the turns without one);
    3. the turn kept with every value the model writes masked (content, reasoning, the calls' names
       and arguments; ids kept): templates that check the turns around a call (ids, order, a result
       after a call); the diff then spans the first to the last masked value, and the turn's own
       opening and closing are added by the caller.
    4. the content alone masked, everything else kept (a template that checks the calls' names or
       arguments).
    The first one's error (the template's own check) is raised when every one fails.
    """
    m = messages[k]
    calls = m.get("tool_calls") is not None
    candidates: list[tuple[dict[str, Any], bool]] = [({"role": m.get("role"), "content": mark}, False)]
    if calls:
        candidates.append(({"role": m.get("role"), "content": mark, "tool_calls": None}, False))
    masked = {
        key: _masked(v, mark) if key in ("content", "tool_calls", *TRACE_FIELDS) else v
        for key, v in m.items()
    }
    if not isinstance(m.get("content"), str | list) or not m.get("content"):
        masked["content"] = mark  # nothing to mask: the mark shows where the content goes
    candidates.append((masked, True))
    candidates.append(({**m, "content": mark}, True))
    error: UserError | None = None
    for stand_in, kept in candidates:
        try:
            return stand_in, render(messages[:k] + [stand_in] + messages[k + 1 :]), kept
        except UserError as e:
            error = error or e
    assert error is not None
    raise error


def _body(text: str, alt: str) -> tuple[int, int]:
    """[a, b) of `text` that differs from `alt` (the same conversation with one answer replaced)."""
    a = _common_prefix(text, alt)
    b = len(text) - _common_suffix(text[a:], alt[a:])
    return a, max(a, b)


def _try(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """fn(*args, **kwargs), or None where the template raises (e.g. on an empty conversation)."""
    try:
        return fn(*args, **kwargs)
    except UserError:
        return None


def answer_spans(
    conv: Conversation,
    template: ChatTemplate,
    special_tokens: Sequence[str] = (),
    template_kwargs: Mapping[str, Any] | None = None,
    train_on: str = "assistant",
) -> tuple[str, list[tuple[int, int]]]:
    """(rendered text, [(start, end)] character span of each learned answer, end-of-turn included).

    `special_tokens`: the tokenizer's special tokens, longest first; the one the unchanged tail after
    an answer starts with (after whitespace) is its end-of-turn and is part of the span.

    Raises:
        UserError: see locate_answers.
    """
    text, answers = locate_answers(conv, template, special_tokens, template_kwargs, train_on)
    return text, [(a.start, a.end) for a in answers]


def unrendered_fields(
    conv: Conversation, template: ChatTemplate, text: str, template_kwargs: Mapping[str, Any] | None = None
) -> tuple[str, ...]:
    """The reasoning / tool fields (and `tools`, and the text of turns with tool calls) the conversation
    carries that its rendering `text` does not show: rendering without them gives the same text."""
    render = _Renderer(conv, template, template_kwargs)
    present = sorted({f for m in conv.messages for f in TRACE_FIELDS if m.get(f) not in (None, "", [], {})})
    out: list[str] = []
    # A template that fails without a field needs it, so renders it: only an equal text counts.
    if present:
        stripped = [{k: v for k, v in m.items() if k not in TRACE_FIELDS} for m in conv.messages]
        if _try(render, stripped) == text:
            out.extend(present)
    if render.tools and _try(render, list(conv.messages), tools=None) == text:
        out.append("tools")
    # Some templates write a tool-call turn's calls alone, leaving its text out.
    spoken = {
        i
        for i, m in enumerate(conv.messages)
        if m.get("tool_calls") and isinstance(m.get("content"), str) and m["content"].strip()
    }
    if spoken:
        silent = [{**m, "content": ""} if i in spoken else m for i, m in enumerate(conv.messages)]
        if _try(render, silent) == text:
            out.append(UNRENDERED_CALL_TEXT)
    return tuple(out)


def tokenize_conversation(
    conv: Conversation,
    template: ChatTemplate,
    tokenizer: Any,
    train_on: str = "assistant",
    template_kwargs: Mapping[str, Any] | None = None,
) -> TokenizedConversation:
    """Render `conv` with `template`, encode it (no special tokens added: the template writes them, as
    in `apply_chat_template`), and mark the learned tokens.

    Args:
        tokenizer: kdistill's Tokenizer or a `tokenizers.Tokenizer`.
        train_on: "assistant" (answers and their end-of-turn only), "last_assistant" (the last answer
            only) or "all" (every token).
        template_kwargs: template variables (e.g. {"enable_thinking": False}); a `tools` entry is the
            tools list of records without their own.

    Raises:
        UserError: see locate_answers; or an unknown train_on.
    """
    if train_on not in TRAIN_ON:
        raise UserError(f"data.train_on is {train_on!r}, expected one of {', '.join(TRAIN_ON)}")
    backend = _backend(tokenizer)
    if train_on == "all":
        text = _Renderer(conv, template, template_kwargs)(list(conv.messages))
        spans = [(0, len(text))]
    else:
        text, spans = answer_spans(conv, template, special_token_strings(backend), template_kwargs, train_on)
    check_unicode(text, f"{conv.source}: the rendered conversation")
    enc = backend.encode(text, add_special_tokens=False)
    ids = np.asarray(enc.ids, dtype=np.int64)
    offsets = np.asarray(enc.offsets, dtype=np.int64).reshape(-1, 2)
    starts, ends = offsets[:, 0], offsets[:, 1]
    trained = np.zeros(len(ids), dtype=bool)
    for a, b in spans:
        # A token overlapping the span is learned: its characters are (partly) the answer's, e.g. a
        # SentencePiece "▁word" whose space the template wrote before the answer.
        trained |= (ends > a) & (starts < b) | ((starts == ends) & (starts >= a) & (starts < b))
    return TokenizedConversation(
        input_ids=ids,
        trained=trained,
        text=text,
        spans=spans,
        source=conv.source,
        unrendered=unrendered_fields(conv, template, text, template_kwargs),
    )


def check_unicode(text: str, what: str) -> None:
    """Refuse text a tokenizer cannot take: a lone surrogate (a JSON escape such as \\ud800, or a
    template's own) is not Unicode text.

    Raises:
        UserError: naming `what` and the character's offset.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise UserError(
            f"{what} holds a lone surrogate at character {e.start} (expected Unicode text; a JSON "
            "escape such as \\ud800 without its pair is not)"
        ) from None


def end_of_turn_token(
    template: ChatTemplate, tokenizer: Any, template_kwargs: Mapping[str, Any] | None = None
) -> str | None:
    """The special token the template writes after an answer (e.g. <|im_end|>), or None: a stop token
    for generation, from the render diff of a probe conversation (never from searching the text).
    A template that refuses the plain probe is tried with a system turn first.

    Raises:
        UserError: the template refuses both probes (the first one's message).
    """
    hi, hello = {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}
    first: UserError | None = None
    for messages in ((hi, hello), ({"role": "system", "content": "Be brief."}, hi, hello)):
        probe = Conversation(
            messages=messages,
            train=tuple(m is hello for m in messages),
            source=f"{template.origin} (probe)",
        )
        try:
            _, answers = locate_answers(probe, template, special_token_strings(tokenizer), template_kwargs)
        except UserError as e:
            first = first or e
            continue
        return answers[0].end_of_turn or None
    assert first is not None
    raise first


def warn_unrendered(tokenized: Sequence[TokenizedConversation], template: ChatTemplate) -> list[str]:
    """One warning per file whose conversations carry fields the template does not render."""
    seen: dict[str, set[str]] = {}
    first: dict[str, str] = {}
    for tc in tokenized:
        if tc.unrendered:
            file = tc.source.rsplit(":", 1)[0]
            seen.setdefault(file, set()).update(tc.unrendered)
            first.setdefault(file, tc.source)
    return [
        f"{file}: the chat template {template.origin} does not render {', '.join(sorted(fields))} "
        f"(first at {first[file]}): that text is not learned"
        for file, fields in seen.items()
    ]


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
