"""Conversation files: JSONL with `messages` or `prompt` + `completion`, Parquet with the same columns,
and every malformed record as a one-line error naming the file and the line (or row)."""

from __future__ import annotations

import io
import json
import sys

import pytest

from kdistill.data.chat import (
    read_conversations,
    read_conversations_jsonl,
    read_conversations_parquet,
    sniff_format,
)
from kdistill.errors import UserError

CHAT = {
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Bye"},
        {"role": "assistant", "content": "Goodbye"},
    ]
}


def _jsonl(*records, raw: bytes = b"") -> io.BytesIO:
    body = b"".join(json.dumps(r, ensure_ascii=False).encode() + b"\n" for r in records)
    return io.BytesIO(body + raw)


def test_messages_file():
    convs = read_conversations_jsonl(_jsonl(CHAT, CHAT), "a.jsonl")
    assert [c.source for c in convs] == ["a.jsonl:1", "a.jsonl:2"]
    c = convs[0]
    assert [m["role"] for m in c.messages] == ["system", "user", "assistant", "user", "assistant"]
    assert c.train == (False, False, True, False, True)


def test_prompt_completion_file_strings_and_lists():
    recs = [
        {"prompt": "Hi", "completion": "Hello"},
        {"prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}], "completion": "a"},
        {
            "prompt": [
                {"role": "user", "content": "u"},
                {"role": "assistant", "content": "ctx"},
                {"role": "user", "content": "u2"},
            ],
            "completion": [{"role": "assistant", "content": "answer"}],
        },
    ]
    convs = read_conversations_jsonl(_jsonl(*recs), "pc.jsonl")
    assert convs[0].messages == ({"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"})
    assert convs[0].train == (False, True)
    assert convs[1].train == (False, False, True)
    assert convs[2].train == (False, False, False, True)  # the prompt's assistant turn is context


def test_blank_lines_bom_and_extra_keys_are_fine():
    data = b"\xef\xbb\xbf" + json.dumps({**CHAT, "id": 7}).encode() + b"\n\n   \n" + json.dumps(CHAT).encode()
    convs = read_conversations_jsonl(io.BytesIO(data), "b.jsonl")
    assert [c.source for c in convs] == ["b.jsonl:1", "b.jsonl:4"]


BAD = [
    (
        {"messages": [{"content": "x"}]},
        r"m.jsonl:2: messages\[0\] has no 'role' \(expected a string such as system, user, assistant, tool\)",
    ),
    (
        {"messages": [{"role": 3, "content": "x"}]},
        r"m.jsonl:2: messages\[0\]: role 3 is not a name, expected a string such as system, user",
    ),
    (
        {"messages": [{"role": "user", "content": 5}]},
        r"m.jsonl:2: messages\[0\] \(user\): content is a number, expected a string or a list of parts",
    ),
    (
        {"messages": [{"role": "assistant", "content": None}]},
        r"m.jsonl:2: messages\[0\] \(assistant\): content is null, .*\(null only with 'tool_calls'\)",
    ),
    (
        {"messages": [{"role": "assistant", "tool_calls": {"name": "f"}}]},
        r"m.jsonl:2: messages\[0\] \(assistant\): tool_calls is an object, expected a list",
    ),
    (
        {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}], "tools": {}},
        r"m.jsonl:2: 'tools' is an object, expected a list of tool definitions",
    ),
    ({"messages": [{"role": "user"}]}, r"m.jsonl:2: messages\[0\] \(user\) has no 'content'"),
    ({"messages": []}, r"m.jsonl:2: 'messages' is an empty list, expected at least one message"),
    ({"messages": "hi"}, r"m.jsonl:2: 'messages' is a string, expected a list of messages"),
    ({"messages": [{"role": "user", "content": "x"}]}, r"m.jsonl:2: 'messages' has no assistant turn"),
    (
        {"messages": ["x"]},
        r"m.jsonl:2: messages\[0\] is a string, expected an object with 'role' and 'content'",
    ),
    (
        {"prompt": "p", "completion": "c"},
        r"m.jsonl:2: record has 'prompt' \+ 'completion' but this file's first record has 'messages' \(one format per file\)",
    ),
    (
        {"text": "plain"},
        r"m.jsonl:2: record has keys \[text\], expected 'messages' or 'prompt' \+ 'completion'",
    ),
    ([1, 2], r"m.jsonl:2: a record is a list, expected a JSON object"),
]


@pytest.mark.parametrize("record,message", BAD)
def test_malformed_messages_records(record, message):
    with pytest.raises(UserError, match=message) as e:
        read_conversations_jsonl(_jsonl(CHAT, record), "m.jsonl")
    assert "\n" not in str(e.value)


BAD_PC = [
    ({"prompt": 3, "completion": "c"}, r"p.jsonl:2: 'prompt' is a number, expected a list of messages"),
    ({"prompt": "p", "completion": None}, r"p.jsonl:2: 'completion' is null, expected a list of messages"),
    (
        {"prompt": "p", "completion": [{"role": "user", "content": "c"}]},
        r"p.jsonl:2: 'completion' has no assistant turn",
    ),
    (CHAT, r"p.jsonl:2: record has 'messages' but this file's first record has 'prompt' \+ 'completion'"),
]


@pytest.mark.parametrize("record,message", BAD_PC)
def test_malformed_prompt_completion_records(record, message):
    with pytest.raises(UserError, match=message):
        read_conversations_jsonl(_jsonl({"prompt": "p", "completion": "c"}, record), "p.jsonl")


def test_malformed_lines_and_files():
    with pytest.raises(UserError, match=r"j.jsonl:2: not valid JSON \(column 2"):
        read_conversations_jsonl(_jsonl(CHAT, raw=b"{oops\n"), "j.jsonl")
    with pytest.raises(UserError, match="j.jsonl:2: not UTF-8 at byte 13 of the line"):
        read_conversations_jsonl(_jsonl(CHAT, raw=b'{"messages": \xff}\n'), "j.jsonl")
    with pytest.raises(
        UserError, match=r"j.jsonl:1: first record has keys \[text\], expected a conversation"
    ):
        read_conversations_jsonl(_jsonl({"text": "a"}), "j.jsonl")
    with pytest.raises(UserError, match="j.jsonl: no conversation records"):
        read_conversations_jsonl(io.BytesIO(b"\n \n"), "j.jsonl")
    with pytest.raises(UserError, match=r"j.jsonl:1: JSON nested too deeply"):
        read_conversations_jsonl(io.BytesIO(b"[" * 100000 + b"\n"), "j.jsonl")


def test_read_by_suffix_and_sniff(tmp_path):
    p = tmp_path / "c.jsonl"
    p.write_bytes(_jsonl(CHAT).getvalue())
    assert len(read_conversations(p)) == 1 and sniff_format(p) == "messages"
    q = tmp_path / "t.jsonl"
    q.write_text('{"text": "hello"}\n')
    assert sniff_format(q) is None
    with pytest.raises(UserError, match=r"c.txt: conversations are read from .jsonl, .ndjson or .parquet"):
        read_conversations(tmp_path / "c.txt")
    with pytest.raises(UserError, match="nope.jsonl: cannot read"):
        read_conversations(tmp_path / "nope.jsonl")


def test_parquet_both_formats_and_errors(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "m.parquet"
    pq.write_table(pa.table({"messages": [CHAT["messages"], CHAT["messages"][:3]]}), path)
    convs = read_conversations(path)
    assert [c.source for c in convs] == [f"{path}:row 1", f"{path}:row 2"]
    assert convs[1].train == (False, False, True)
    assert sniff_format(path) == "parquet"

    pc = tmp_path / "pc.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b"], "completion": ["x", "y"], "id": [1, 2]}), pc)
    assert [c.messages[-1]["content"] for c in read_conversations_parquet(pc)] == ["x", "y"]

    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"messages": [CHAT["messages"], [{"role": "robot", "content": "x"}]]}), bad)
    with pytest.raises(UserError, match=r"bad.parquet:row 2: 'messages' has no assistant turn"):
        read_conversations(bad)
    cols = tmp_path / "cols.parquet"
    pq.write_table(pa.table({"text": ["a"]}), cols)
    with pytest.raises(
        UserError, match=r"cols.parquet: columns \[text\], expected 'messages' or 'prompt' \+ 'completion'"
    ):
        read_conversations(cols)
    junk = tmp_path / "junk.parquet"
    junk.write_bytes(b"not parquet at all")
    with pytest.raises(UserError, match="junk.parquet: not a readable Parquet file"):
        read_conversations(junk)


def test_parquet_without_pyarrow_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(
        UserError, match=r"x.parquet: reading Parquet needs pyarrow \(pip install 'kdistill\[parquet\]'\)"
    ):
        read_conversations(tmp_path / "x.parquet")


def test_parquet_keeps_reasoning_tool_fields_and_tools(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    call = {"type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
    msgs = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": None, "tool_calls": [call], "reasoning_content": "think"},
        {"role": "tool", "content": "r", "tool_call_id": "1"},
        {"role": "assistant", "content": "a"},
    ]
    tools = [{"type": "function", "function": {"name": "f", "description": "d"}}]
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"messages": [msgs], "tools": [tools]}), path)
    (conv,) = read_conversations(path)
    assert conv.tools == tuple(tools) and conv.train == (False, True, False, True)
    assert conv.messages[1] == {"role": "assistant", "tool_calls": [call], "reasoning_content": "think"}
    assert conv.messages[2] == {"role": "tool", "content": "r", "tool_call_id": "1"}
