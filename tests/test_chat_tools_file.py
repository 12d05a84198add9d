"""Tools once per file: a JSONL file's first record `{"tools": [...]}` alone (or a Parquet file's schema
metadata `tools`) serves every conversation of the file without tools of its own; a record's own tools
win over its file's, and a file's over the run's `data.template_kwargs.tools`. The rendering equals
transformers' with the tools that won; `kdistill data preview` says which tools each file's conversations
render with; malformed headers are one-line errors naming the file and line."""

from __future__ import annotations

import json

import pytest

from kdistill.data.chat import read_conversations, sniff_format, tokenize_conversation
from kdistill.data.chat_template import load_chat_template
from kdistill.errors import UserError
from kdistill.models.tokenizer import load_tokenizer
from tests.chat_families import CHATS, TOOLS, hf_tokenizer, make_family_dir
from tests.test_train_kit import run_cli

OWN = [
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Time of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
RUN = [{"type": "function", "function": {"name": "search", "description": "Search", "parameters": {}}}]
PLAIN = {"messages": CHATS["plain"]["messages"]}


def _jsonl(path, *records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    folder = make_family_dir(tmp_path_factory.mktemp("qwen"), "qwen2.5")
    return folder, load_chat_template(folder), load_tokenizer(folder), hf_tokenizer("qwen2.5")


def test_a_tools_header_serves_records_without_their_own_before_the_runs_tools(qwen, tmp_path):
    _, template, tok, hf = qwen
    data = _jsonl(tmp_path / "a.jsonl", {"tools": TOOLS}, PLAIN, {**PLAIN, "tools": OWN})
    assert sniff_format(data) == "messages"  # the header is not the file's first conversation
    first, second = read_conversations(data)
    assert (first.source, first.tools, first.tools_from) == (f"{data}:2", tuple(TOOLS), "file")
    assert (second.tools, second.tools_from) == (tuple(OWN), "record")
    run = {"tools": RUN}
    for conv, tools in ((first, TOOLS), (second, OWN)):
        tc = tokenize_conversation(conv, template, tok, template_kwargs=run)
        want = hf.apply_chat_template(conv.messages, tools=tools, tokenize=True, return_dict=True)
        assert tc.input_ids.tolist() == list(want["input_ids"]) and "search" not in tc.text
    # A file without a header: the run's tools
    (bare,) = read_conversations(_jsonl(tmp_path / "b.jsonl", PLAIN))
    assert (bare.tools, bare.tools_from) == (None, "")
    tc = tokenize_conversation(bare, template, tok, template_kwargs=run)
    assert '"name": "search"' in tc.text
    # An empty header list is the file's choice too: no tools, whatever the run gives
    (empty,) = read_conversations(_jsonl(tmp_path / "c.jsonl", {"tools": []}, PLAIN))
    assert (
        empty.tools == ()
        and "search" not in tokenize_conversation(empty, template, tok, template_kwargs=run).text
    )


@pytest.mark.parametrize(
    "records, message",
    [
        (
            [PLAIN, {"tools": TOOLS}],
            r"a.jsonl:2: a record with only 'tools' is the file's tools header, expected only as the first record",
        ),
        (
            [{"tools": TOOLS}, {"tools": TOOLS}, PLAIN],
            r"a.jsonl:2: a record with only 'tools' is the file's tools header",
        ),
        (
            [{"tools": "get_weather"}, PLAIN],
            r"a.jsonl:1 \(the file's tools header\): 'tools' is a string, expected a list of tool definitions",
        ),
        ([{"tools": TOOLS}], r"a.jsonl: no conversation records"),
    ],
)
def test_a_malformed_tools_header_is_one_line(tmp_path, records, message):
    with pytest.raises(UserError, match=message) as e:
        read_conversations(_jsonl(tmp_path / "a.jsonl", *records))
    assert "\n" not in str(e.value)


def test_a_parquet_file_carries_its_tools_in_its_schema_metadata(qwen, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    _, template, tok, hf = qwen
    table = pa.Table.from_pylist([{**PLAIN, "tools": None}, {**PLAIN, "tools": OWN}])
    path = tmp_path / "t.parquet"
    pq.write_table(table.replace_schema_metadata({"tools": json.dumps(TOOLS)}), path)
    first, second = read_conversations(path)
    assert (first.tools, first.tools_from) == (tuple(TOOLS), "file")
    assert (second.tools, second.tools_from) == (tuple(OWN), "record")
    tc = tokenize_conversation(first, template, tok, template_kwargs={"tools": RUN})
    want = hf.apply_chat_template(first.messages, tools=TOOLS, tokenize=True, return_dict=True)
    assert tc.input_ids.tolist() == list(want["input_ids"])
    bad = tmp_path / "bad.parquet"
    pq.write_table(table.replace_schema_metadata({"tools": "[{"}), bad)
    with pytest.raises(UserError, match=r"bad.parquet: schema metadata 'tools' is not JSON, expected a list"):
        read_conversations(bad)


def test_preview_says_which_tools_each_files_conversations_render_with(qwen, tmp_path, capsys):
    folder, *_ = qwen
    a = _jsonl(tmp_path / "a.jsonl", {"tools": TOOLS}, PLAIN, PLAIN, {**PLAIN, "tools": OWN})
    b = _jsonl(tmp_path / "b.jsonl", PLAIN)
    args = ("data", "preview", "--model", str(folder), "--data", str(a), str(b))
    rc, out, err = run_cli(capsys, *args, "--template-kwargs", json.dumps({"tools": RUN}))
    assert rc == 0, err
    assert f"tools in {a}: the file's (get_weather) for 2, their own for 1 conversations" in out
    assert f"tools in {b}: the run's (search) for 1 conversation" in out
    rc, out, err = run_cli(capsys, *args, "--json")
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["tools"] == [
        {
            "file": str(a),
            "file_tools": ["get_weather"],
            "conversations": {"record": 1, "file": 2, "run": 0, "none": 0},
            "run_tools": None,
        }
    ]  # b.jsonl renders with no tools at all: not listed


def test_generate_messages_files_take_a_tools_header(tmp_path):
    from kdistill.generate import read_messages_file

    path = _jsonl(
        tmp_path / "m.jsonl",
        {"tools": TOOLS},
        [{"role": "user", "content": "Weather in Paris?"}],
        {"messages": [{"role": "user", "content": "Time?"}], "tools": OWN},
    )
    first, second = read_messages_file(path)
    assert (first.tools, first.source) == (tuple(TOOLS), f"{path}:2") and second.tools == tuple(OWN)
