"""Every family's template structure, with fixture templates written for these tests
(tests/chat_families.py): plain, multi-turn, reasoning and tool-call conversations give the ids of
transformers' apply_chat_template (same tools and template variables), and the learned tokens follow
the written policy: after the generation prompt, through the end-of-turn token, found by render diffs
(DeepSeek-R1's prompt ending in `<think>\\n`, Mistral's system text in the last user turn, Gemma's
trimmed `model` turns); a field the template does not render is reported, not dropped silently."""

from __future__ import annotations

import json

import pytest

from kdistill.data.chat import conversation_from_record, end_of_turn_token, tokenize_conversation
from kdistill.data.chat_template import load_chat_template
from kdistill.errors import UserError
from kdistill.models.tokenizer import load_tokenizer
from tests.chat_families import CHATS, FAMILIES, TOOLS, hf_tokenizer, make_family_dir
from tests.test_train_kit import run_cli

# The templates' own refusals (Gemma: no system role; roles must alternate, so no tool turns).
REFUSED = {
    ("gemma", "plain"): "System role not supported",
    ("gemma", "tools"): "Conversation roles must alternate",
}

# The learned text of each answer, in order (the rest of the rendering is masked).
LEARNED = {
    ("qwen2.5", "plain"): ["Paris.<|im_end|>"],
    ("qwen2.5", "multi"): ["Hello there<|im_end|>", "Four.<|im_end|>"],
    ("qwen2.5", "reasoning"): ["Four.<|im_end|>", "Five.<|im_end|>"],  # reasoning not rendered: warned
    ("qwen2.5", "tools"): [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
        "It is 18 C and sunny in Paris.<|im_end|>",
    ],
    ("qwen3", "plain"): ["<think>\n\n</think>\n\nParis.<|im_end|>"],
    ("qwen3", "multi"): ["Hello there<|im_end|>", "<think>\n\n</think>\n\nFour.<|im_end|>"],
    # the reasoning of an answer before the last user turn is not in the history; the last keeps it
    ("qwen3", "reasoning"): [
        "Four.<|im_end|>",
        "<think>\nTwo plus three is five.\n</think>\n\nFive.<|im_end|>",
    ],
    ("qwen3", "tools"): [
        '<think>\n\n</think>\n\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        "</tool_call><|im_end|>",
        "<think>\n\n</think>\n\nIt is 18 C and sunny in Paris.<|im_end|>",
    ],
    ("llama3", "plain"): ["Paris.<|eot_id|>"],
    ("llama3", "multi"): ["Hello there<|eot_id|>", "Four.<|eot_id|>"],
    ("llama3", "reasoning"): ["Four.<|eot_id|>", "Five.<|eot_id|>"],
    ("llama3", "tools"): [
        '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eom_id|>',
        "It is 18 C and sunny in Paris.<|eot_id|>",
    ],
    ("deepseek-r1", "plain"): ["Paris.<｜end▁of▁sentence｜>"],
    ("deepseek-r1", "multi"): ["Hello there<｜end▁of▁sentence｜>", "Four.<｜end▁of▁sentence｜>"],
    ("deepseek-r1", "reasoning"): ["Four.<｜end▁of▁sentence｜>", "Five.<｜end▁of▁sentence｜>"],
    ("deepseek-r1", "tools"): [
        '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}'
        "<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>",
        "It is 18 C and sunny in Paris.<｜end▁of▁sentence｜>",
    ],
    ("mistral", "plain"): ["Paris.</s>"],
    ("mistral", "multi"): ["Hello there</s>", "Four.</s>"],
    ("mistral", "reasoning"): ["Four.</s>", "Five.</s>"],
    ("mistral", "tools"): [
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]</s>',
        "It is 18 C and sunny in Paris.</s>",
    ],
    ("gemma", "multi"): ["Hello there<end_of_turn>", "Four.<end_of_turn>"],
    ("gemma", "reasoning"): ["Four.<end_of_turn>", "Five.<end_of_turn>"],
    ("phi4", "plain"): ["Paris.<|im_end|>"],
    ("phi4", "multi"): ["Hello there<|im_end|>", "Four.<|im_end|>"],
    ("phi4", "reasoning"): ["Four.<|im_end|>", "Five.<|im_end|>"],
    ("phi4", "tools"): ["<|im_end|>", "It is 18 C and sunny in Paris.<|im_end|>"],  # calls not rendered
    ("smollm2", "plain"): ["Paris.<|im_end|>"],
    ("smollm2", "multi"): ["Hello there<|im_end|>", "Four.<|im_end|>"],
    ("smollm2", "reasoning"): ["Four.<|im_end|>", "Five.<|im_end|>"],
    ("smollm2", "tools"): ["<|im_end|>", "It is 18 C and sunny in Paris.<|im_end|>"],
    ("mistral-nemo", "plain"): ["Paris.</s>"],
    ("mistral-nemo", "multi"): ["Hello there</s>", "Four.</s>"],
    ("mistral-nemo", "reasoning"): ["Four.</s>", "Five.</s>"],
    ("mistral-nemo", "tools"): [
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "call00001"}]</s>',
        "It is 18 C and sunny in Paris.</s>",
    ],
    ("llama3.1", "plain"): ["Paris.<|eot_id|>"],
    ("llama3.1", "multi"): ["Hello there<|eot_id|>", "Four.<|eot_id|>"],
    ("llama3.1", "reasoning"): ["Four.<|eot_id|>", "Five.<|eot_id|>"],
    ("llama3.1", "tools"): [
        '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>',
        "It is 18 C and sunny in Paris.<|eot_id|>",
    ],
    ("hermes", "plain"): ["Paris.<|im_end|>"],
    ("hermes", "multi"): ["Hello there<|im_end|>", "Four.<|im_end|>"],
    ("hermes", "reasoning"): ["Four.<|im_end|>", "Five.<|im_end|>"],
    ("hermes", "tools"): [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
        "It is 18 C and sunny in Paris.<|im_end|>",
    ],
}

# What each family's rendering leaves out of these conversations (reported once per file).
UNRENDERED = {
    ("qwen2.5", "reasoning"): ("reasoning_content",),
    ("qwen3", "tools"): ("tools",),
    ("llama3", "reasoning"): ("reasoning_content",),
    ("deepseek-r1", "reasoning"): ("reasoning_content",),
    ("deepseek-r1", "tools"): ("tools",),
    ("mistral", "reasoning"): ("reasoning_content",),
    ("gemma", "reasoning"): ("reasoning_content",),
    ("phi4", "reasoning"): ("reasoning_content",),
    ("phi4", "tools"): ("tool_calls", "tools"),
    ("smollm2", "reasoning"): ("reasoning_content",),
    ("smollm2", "tools"): ("tool_calls", "tools"),
    ("mistral-nemo", "reasoning"): ("reasoning_content",),
    ("llama3.1", "reasoning"): ("reasoning_content",),
    ("hermes", "reasoning"): ("reasoning_content",),
}

END_OF_TURN = {
    "qwen2.5": "<|im_end|>",
    "qwen3": "<|im_end|>",
    "llama3": "<|eot_id|>",
    "deepseek-r1": "<｜end▁of▁sentence｜>",
    "mistral": "</s>",
    "gemma": "<end_of_turn>",
    "phi4": "<|im_end|>",
    "smollm2": "<|im_end|>",
    "mistral-nemo": "</s>",
    "llama3.1": "<|eot_id|>",
    "hermes": "<|im_end|>",
}


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    out = {}
    for name in FAMILIES:
        folder = make_family_dir(root, name)
        out[name] = (folder, load_chat_template(folder), load_tokenizer(folder), hf_tokenizer(name))
    return out


def _learned(tc, tok) -> list[str]:
    """The decoded runs of learned tokens."""
    runs, i, ids, tr = [], 0, tc.input_ids, tc.trained
    while i < len(ids):
        j = i
        while j < len(ids) and tr[j] == tr[i]:
            j += 1
        if tr[i]:
            runs.append(tok.decode(ids[i:j]))
        i = j
    return runs


def _common_prefix(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("chat", sorted(CHATS))
def test_ids_match_transformers_and_learned_tokens_follow_the_policy(families, family, chat):
    folder, template, tok, hf = families[family]
    record = CHATS[chat]
    msgs, tools = record["messages"], record.get("tools")
    conv = conversation_from_record(record, "messages", f"{chat}.jsonl:1")
    if (family, chat) in REFUSED:
        with pytest.raises(Exception, match=REFUSED[family, chat]):
            hf.apply_chat_template(msgs, tools=tools, tokenize=False)
        with pytest.raises(UserError, match=r"chat_template.jinja: chat template failed at line \d+: ") as e:
            tokenize_conversation(conv, template, tok)
        assert "\n" not in str(e.value) and REFUSED[family, chat] in str(e.value)
        return
    for gen, part in ((False, msgs), (True, msgs[:-1])):
        theirs = hf.apply_chat_template(
            part, tools=tools, tokenize=True, return_dict=True, add_generation_prompt=gen
        )
        ours = tok.encode(template.render(part, add_generation_prompt=gen, tools=tools))
        assert ours == list(theirs["input_ids"]), (family, chat, gen)
    tc = tokenize_conversation(conv, template, tok)
    assert tc.input_ids.tolist() == list(
        hf.apply_chat_template(msgs, tools=tools, tokenize=True, return_dict=True)["input_ids"]
    )
    assert _learned(tc, tok) == LEARNED[family, chat]
    assert tc.unrendered == UNRENDERED.get((family, chat), ())
    # The last answer, by the policy's own render diff: what the conversation adds to the history,
    # less what the generation prompt already wrote, through the end-of-turn token.
    full = template.render(msgs, tools=tools)
    history = template.render(msgs[:-1], tools=tools)
    prompt = template.render(msgs[:-1], add_generation_prompt=True, tools=tools)
    added = full[_common_prefix(history, full) :]
    generated = prompt[_common_prefix(history, prompt) :]
    answer = added[_common_prefix(added, generated) :]
    eot = END_OF_TURN[family]
    assert LEARNED[family, chat][-1] == answer[: answer.index(eot) + len(eot)]


def test_end_of_turn_tokens_come_from_the_render_diff(families):
    for name, (_, template, tok, _) in families.items():
        assert end_of_turn_token(template, tok) == END_OF_TURN[name], name


def test_deepseek_r1_answers_are_learned_although_its_prompt_opens_a_think_block(families):
    _, template, tok, _ = families["deepseek-r1"]
    record = {
        "messages": [
            {"role": "user", "content": "Two plus two?"},
            {"role": "assistant", "content": "<think>\nAdd them.\n</think>\n\nFour."},
        ]
    }
    assert template.render(record["messages"][:1], add_generation_prompt=True).endswith("<think>\n")
    tc = tokenize_conversation(conversation_from_record(record, "messages", "r1:1"), template, tok)
    assert _learned(tc, tok) == ["\n\nFour.<｜end▁of▁sentence｜>"]  # its history drops the reasoning


def test_template_variables_tools_and_last_assistant(families):
    _, qwen3, tok, hf = families["qwen3"]
    msgs = CHATS["reasoning"]["messages"]
    kwargs = {"enable_thinking": False}
    theirs = hf.apply_chat_template(msgs[:-1], add_generation_prompt=True, tokenize=False, **kwargs)
    assert qwen3.render(msgs[:-1], add_generation_prompt=True, **kwargs) == theirs
    assert theirs.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    conv = conversation_from_record(CHATS["reasoning"], "messages", "r:1")
    tc = tokenize_conversation(conv, qwen3, tok, "last_assistant", kwargs)
    assert _learned(tc, tok) == ["Two plus three is five.\n</think>\n\nFive.<|im_end|>"]
    # llama3's date line is a template variable; a run-wide tools list serves records without one
    _, llama, tok, hf = families["llama3"]
    plain = CHATS["plain"]["messages"]
    kwargs = {"date_string": "26 Nov 2026", "tools": TOOLS}
    want = hf.apply_chat_template(plain, tokenize=True, return_dict=True, **kwargs)["input_ids"]
    tc = tokenize_conversation(
        conversation_from_record({"messages": plain}, "messages", "p:1"), llama, tok, "assistant", kwargs
    )
    assert tc.input_ids.tolist() == list(want) and "26 Nov 2026" in tc.text and "get_weather" in tc.text
    assert _learned(tc, tok) == ["Paris.<|eot_id|>"]


def test_every_message_field_reaches_the_template():
    from kdistill.data.chat_template import ChatTemplate

    tpl = ChatTemplate(
        "{% for m in messages %}{{ m.role }}|{{ m.name }}|{{ m.tool_call_id }}|{{ m.reasoning_content }}|"
        "{{ m.custom }}|{{ m.tool_calls | default(none) | tojson }};{% endfor %}{{ tools | tojson }}",
        "fields.jinja",
    )
    record = {
        "tools": TOOLS,
        "messages": [
            {"role": "developer", "content": "x", "custom": 7},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "a"}], "reasoning_content": "r"},
            {"role": "tool", "content": "y", "tool_call_id": "a", "name": "f"},
            {"role": "assistant", "content": "done"},
        ],
    }
    conv = conversation_from_record(record, "messages", "f:1")
    text = tpl.render(conv.messages, tools=conv.tools)
    assert text.startswith('developer||||7|null;assistant|||r||[{"id": "a"}];tool|f|a|||null;')
    assert text.endswith(json.dumps(TOOLS))


def test_preview_json_on_each_family_warns_once_per_file(families, tmp_path, capsys):
    for name, (folder, *_rest) in families.items():
        data = tmp_path / f"{name}.jsonl"
        chats = [CHATS[c] for c in sorted(CHATS) if (name, c) not in REFUSED]
        data.write_text("".join(json.dumps(c) + "\n" for c in chats * 2), encoding="utf-8")
        rc, out, err = run_cli(
            capsys, "data", "preview", "--model", str(folder), "--data", str(data), "--json", "-n", "8"
        )
        assert rc == 0, err
        doc = json.loads(out)
        learned = sum(sum(y != -100 for y in row["labels"]) for row in doc["rows"])
        assert doc["conversations"] == len(chats) * 2 and learned > 0
        fields = sorted({f for c in sorted(CHATS) for f in UNRENDERED.get((name, c), ())})
        assert len(doc["warnings"]) == (1 if fields else 0) and err.count("warning") == len(doc["warnings"])
        if fields:
            assert all(f in doc["warnings"][0] for f in fields) and str(data) in doc["warnings"][0]


def test_a_run_warns_once_per_file_about_unrendered_reasoning(families, tmp_path, caplog):
    from kdistill.config import DataConfig
    from kdistill.data.chat_data import prepare_chat_data

    folder, template, tok, _ = families["deepseek-r1"]
    data = tmp_path / "r.jsonl"
    data.write_text("".join(json.dumps(CHATS["reasoning"]) + "\n" for _ in range(6)), encoding="utf-8")
    cfg = DataConfig(train=[str(data)], heldout_fraction=0.0, seq_len=128)
    with caplog.at_level("WARNING", logger="kdistill"):
        prepare_chat_data(cfg, tok, template, require_heldout=False)
    lines = [r.message for r in caplog.records if "reasoning_content" in r.message]
    assert len(lines) == 1 and str(data) in lines[0] and "does not render" in lines[0]


def test_a_template_that_checks_tool_turns_still_has_the_calls_learned(families):
    from kdistill.data.chat_template import ChatTemplate

    _, _, tok, _ = families["qwen2.5"]
    strict = ChatTemplate(
        "{% for m in messages %}{% if m.role == 'tool' and not messages[loop.index0 - 1].tool_calls %}"
        "{{ raise_exception('a tool result needs a call before it') }}{% endif %}"
        "<|im_start|>{{ m.role }}\n{{ m.content or '' }}{% for c in m.tool_calls or [] %}<tool_call>"
        "{{ c.function.name }}</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
        "strict.jinja",
    )
    record = json.loads(json.dumps(CHATS["tools"]))
    for content in ("Checking.", None):
        record["messages"][1]["content"] = content
        conv = conversation_from_record(record, "messages", "s:1")
        tc = tokenize_conversation(conv, strict, tok)
        # located with the call's values masked (the template needs a call before the result): the
        # calls are learned with the text, through the end-of-turn token
        assert _learned(tc, tok) == [
            f"{content or ''}<tool_call>get_weather</tool_call><|im_end|>",
            "It is 18 C and sunny in Paris.<|im_end|>",
        ]


def test_end_of_turn_of_a_template_that_needs_a_system_turn(families):
    from kdistill.data.chat_template import ChatTemplate

    _, _, tok, _ = families["phi4"]
    needs_system = ChatTemplate(
        "{% if messages[0].role != 'system' %}{{ raise_exception('a system turn comes first') }}{% endif %}"
        "{% for m in messages %}<|im_start|>{{ m.role }}<|im_sep|>{{ m.content | upper }}<|im_end|>{% endfor %}",
        "sys.jinja",
    )
    assert end_of_turn_token(needs_system, tok) == "<|im_end|>"
    never = ChatTemplate("{{ raise_exception('no') }}", "never.jinja")
    with pytest.raises(UserError, match="never.jinja: chat template failed at line 1: no"):
        end_of_turn_token(never, tok)


def test_a_lone_surrogate_is_one_line(families, tmp_path):
    from kdistill.data.chat import read_conversations

    _, template, tok, _ = families["qwen2.5"]
    data = tmp_path / "s.jsonl"
    data.write_text('{"prompt": "q\\ud800", "completion": "a"}\n', encoding="utf-8")
    (conv,) = read_conversations(data)
    with pytest.raises(UserError, match=r"s.jsonl:1: the rendered conversation holds a lone surrogate"):
        tokenize_conversation(conv, template, tok)


@pytest.mark.parametrize(
    "override, message",
    [
        ("data.template_kwargs=3", "data.template_kwargs is 3, expected a mapping of template variables"),
        ("data.template_kwargs={messages: 1}", "data.template_kwargs has key 'messages'"),
        ("data.template_kwargs={tools: 3}", "data.template_kwargs.tools is not a list of tool definitions"),
        ("data.train_on=users", "data.train_on is 'users', expected one of: assistant, last_assistant, all"),
    ],
)
def test_chat_config_is_checked(override, message):
    from kdistill.config import load_config

    with pytest.raises(UserError, match=message.replace(".", r"\.")):
        load_config(None, [override]).validate(need_paths=False)
    assert load_config(None, ["data.template_kwargs={enable_thinking: false}"]).data.template_kwargs == {
        "enable_thinking": False
    }
