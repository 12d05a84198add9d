"""Tool-call turns are learned as the template renders them. For each family's shape (Qwen's
<tool_call> blocks, Llama 3.1's JSON and <|python_tag|> calls, Mistral's [TOOL_CALLS] list, with
Mistral-Nemo's role and id checks, Hermes blocks, DeepSeek-R1's call tokens) a turn of calls with or
without text, a turn of two calls and a conversation ending on a call give the ids of transformers'
apply_chat_template, and the learned text of the call turn is its render diff: what the conversation
that ends with it adds after the generation prompt. Templates that check the turns around a call (a
result after its call, matching ids) still have the calls learned; a template that renders nothing of
a turn is refused."""

from __future__ import annotations

import json

import pytest

from kdistill.data.chat import conversation_from_record, tokenize_conversation
from kdistill.data.chat_template import ChatTemplate, load_chat_template
from kdistill.errors import UserError
from kdistill.models.tokenizer import load_tokenizer
from tests.chat_families import CALL, CHATS, hf_tokenizer, make_family_dir
from tests.test_chat_families import _common_prefix, _learned

TOOL_FAMILIES = ("qwen2.5", "qwen3", "llama3", "llama3.1", "deepseek-r1", "mistral", "mistral-nemo", "hermes")
CALL2 = {
    "type": "function",
    "id": "call00002",
    "function": {"name": "get_weather", "arguments": {"city": "Rome"}},
}


def _with_text(record: dict, text: str) -> dict:
    out = json.loads(json.dumps(record))
    out["messages"][1]["content"] = text
    return out


TOOL_CHATS = {
    "call": CHATS["tools"],
    "call_with_text": _with_text(CHATS["tools"], "Let me check."),
    "two_calls": {
        "tools": CHATS["tools"]["tools"],
        "messages": [
            {"role": "user", "content": "Weather in Paris and Rome?"},
            {"role": "assistant", "content": None, "tool_calls": [CALL, CALL2]},
            {"role": "tool", "tool_call_id": "call00001", "name": "get_weather", "content": "18 C, sunny"},
            {"role": "tool", "tool_call_id": "call00002", "name": "get_weather", "content": "21 C, clear"},
            {"role": "assistant", "content": "Sunny in both."},
        ],
    },
    "ends_on_call": {"tools": CHATS["tools"]["tools"], "messages": CHATS["tools"]["messages"][:2]},
}

PARIS = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
ROME = '{"name": "get_weather", "arguments": {"city": "Rome"}}'
NEMO_PARIS = '{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "call00001"}'
NEMO_ROME = '{"name": "get_weather", "arguments": {"city": "Rome"}, "id": "call00002"}'
LLAMA_PARIS = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
LLAMA_ROME = '{"name": "get_weather", "parameters": {"city": "Rome"}}'
R1 = '<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{{"city": "{}"}}<｜tool▁call▁end｜>'
R1_END = "<｜tool▁calls▁end｜>"
QWEN3_EMPTY_THINK = "<think>\n\n</think>\n\n"

# The learned text of the call turn (message 1), as each template renders it in the conversation.
# (Llama's and the older Mistral shape's templates do not render a call turn's text; the others do.)
CALL_TURN = {
    "qwen2.5": {
        "call": f"<tool_call>\n{PARIS}\n</tool_call><|im_end|>",
        "call_with_text": f"Let me check.\n<tool_call>\n{PARIS}\n</tool_call><|im_end|>",
        "two_calls": f"<tool_call>\n{PARIS}\n</tool_call>\n<tool_call>\n{ROME}\n</tool_call><|im_end|>",
    },
    "qwen3": {
        "call": f"{QWEN3_EMPTY_THINK}\n<tool_call>\n{PARIS}\n</tool_call><|im_end|>",
        "call_with_text": f"{QWEN3_EMPTY_THINK}Let me check.\n<tool_call>\n{PARIS}\n</tool_call><|im_end|>",
        "two_calls": f"{QWEN3_EMPTY_THINK}\n<tool_call>\n{PARIS}\n</tool_call>\n<tool_call>\n{ROME}\n"
        "</tool_call><|im_end|>",
    },
    "llama3": {
        "call": f"{LLAMA_PARIS}<|eom_id|>",
        "call_with_text": f"{LLAMA_PARIS}<|eom_id|>",
        "two_calls": f"{LLAMA_PARIS}{LLAMA_ROME}<|eom_id|>",
    },
    "llama3.1": {"call": f"{LLAMA_PARIS}<|eot_id|>", "call_with_text": f"{LLAMA_PARIS}<|eot_id|>"},
    "deepseek-r1": {
        "call": f"<｜tool▁calls▁begin｜>{R1.format('Paris')}{R1_END}<｜end▁of▁sentence｜>",
        "call_with_text": f"<｜tool▁calls▁begin｜>{R1.format('Paris')}{R1_END}Let me check.<｜end▁of▁sentence｜>",
        "two_calls": f"<｜tool▁calls▁begin｜>{R1.format('Paris')}{R1.format('Rome')}{R1_END}<｜end▁of▁sentence｜>",
    },
    "mistral": {
        "call": f"[TOOL_CALLS][{PARIS}]</s>",
        "call_with_text": f"[TOOL_CALLS][{PARIS}]</s>",
        "two_calls": f"[TOOL_CALLS][{PARIS}, {ROME}]</s>",
    },
    "mistral-nemo": {
        "call": f"[TOOL_CALLS][{NEMO_PARIS}]</s>",
        "call_with_text": f"Let me check.[TOOL_CALLS][{NEMO_PARIS}]</s>",
        "two_calls": f"[TOOL_CALLS][{NEMO_PARIS}, {NEMO_ROME}]</s>",
    },
    "hermes": {
        "call": f"<tool_call>\n{PARIS}\n</tool_call><|im_end|>",
        "call_with_text": f"Let me check.\n<tool_call>\n{PARIS}\n</tool_call><|im_end|>",
        "two_calls": f"<tool_call>\n{PARIS}\n</tool_call>\n<tool_call>\n{ROME}\n</tool_call><|im_end|>",
    },
}
for _family in CALL_TURN.values():
    _family["ends_on_call"] = _family["call"]
# A template's own refusal: Llama 3.1 takes one call per turn.
REFUSED = {("llama3.1", "two_calls"): "One tool call per turn"}


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    root = tmp_path_factory.mktemp("tool-families")
    out = {}
    for name in TOOL_FAMILIES:
        folder = make_family_dir(root, name)
        out[name] = (folder, load_chat_template(folder), load_tokenizer(folder), hf_tokenizer(name))
    return out


def _render_diff(template: ChatTemplate, tok, messages: list, k: int, **kwargs) -> str:
    """What the conversation ending with answer k adds to the history after its generation prompt
    (compared token by token), trailing whitespace dropped: the answer as the model writes it, by
    render diffs alone."""
    own = template.render(messages[: k + 1], **kwargs)
    history = template.render(messages[:k], **kwargs)
    prompt = template.render(messages[:k], add_generation_prompt=True, **kwargs)
    added = tok.encode(own[_common_prefix(history, own) :])
    generated = tok.encode(prompt[_common_prefix(history, prompt) :])
    n = 0
    while n < min(len(added), len(generated)) and added[n] == generated[n]:
        n += 1
    return tok.decode(added[n:]).rstrip()


@pytest.mark.parametrize("family", TOOL_FAMILIES)
@pytest.mark.parametrize("chat", sorted(TOOL_CHATS))
def test_a_tool_call_turn_is_learned_as_its_template_renders_it(families, family, chat):
    _, template, tok, hf = families[family]
    record = TOOL_CHATS[chat]
    msgs, tools = record["messages"], record["tools"]
    conv = conversation_from_record(record, "messages", f"{chat}.jsonl:1")
    if (family, chat) in REFUSED:
        with pytest.raises(Exception, match=REFUSED[family, chat]):
            hf.apply_chat_template(msgs, tools=tools, tokenize=False)
        with pytest.raises(UserError, match=REFUSED[family, chat]):
            tokenize_conversation(conv, template, tok)
        return
    tc = tokenize_conversation(conv, template, tok)
    theirs = hf.apply_chat_template(msgs, tools=tools, tokenize=True, return_dict=True)["input_ids"]
    assert tc.input_ids.tolist() == list(theirs)
    learned = _learned(tc, tok)
    assert learned[0] == CALL_TURN[family][chat] == _render_diff(template, tok, msgs, 1, tools=tools)
    assert len(learned) == sum(m["role"] == "assistant" for m in msgs)
    assert not tc.unrendered or tc.unrendered == ("tools",)  # the calls are rendered, never reported
    # Only the last answer: the call turn when the conversation ends on it.
    last = tokenize_conversation(conv, template, tok, "last_assistant")
    assert _learned(last, tok) == learned[-1:]


def test_a_llama_builtin_tool_call_is_learned_after_its_python_tag(families):
    _, template, tok, hf = families["llama3.1"]
    call = {"type": "function", "function": {"name": "brave_search", "arguments": {"query": "Paris weather"}}}
    msgs = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "ipython", "content": "18 C, sunny"},
        {"role": "assistant", "content": "It is 18 C and sunny in Paris."},
    ]
    kwargs = {"builtin_tools": ["brave_search"]}
    conv = conversation_from_record({"messages": msgs}, "messages", "b:1")
    tc = tokenize_conversation(conv, template, tok, template_kwargs=kwargs)
    theirs = hf.apply_chat_template(msgs, tokenize=True, return_dict=True, **kwargs)["input_ids"]
    assert tc.input_ids.tolist() == list(theirs) and "Tools: brave_search" in tc.text
    want = '<|python_tag|>brave_search.call(query="Paris weather")<|eom_id|>'
    assert _learned(tc, tok) == [want, "It is 18 C and sunny in Paris.<|eot_id|>"]
    assert want == _render_diff(template, tok, msgs, 1, **kwargs)
    assert tok.encode("<|python_tag|>") == [tc.input_ids[tc.trained][0]]  # one special token, learned


def test_mistral_nemo_tool_calls_are_learned_although_its_template_refuses_a_turn_without_them(families):
    """The case of a Mistral-Nemo-shaped template: the call turn with its calls gone breaks the
    template's role alternation (it leaves out only turns that carry a tool_calls key), so the turn is
    located with the key kept empty; before, it was refused as an answer the template does not render."""
    _, template, tok, _ = families["mistral-nemo"]
    msgs = TOOL_CHATS["call"]["messages"]
    without = [msgs[0], {"role": "assistant", "content": "x"}, *msgs[2:]]
    with pytest.raises(UserError, match="roles must alternate"):
        template.render(without, tools=TOOL_CHATS["call"]["tools"])
    conv = conversation_from_record(TOOL_CHATS["call"], "messages", "n:1")
    tc = tokenize_conversation(conv, template, tok)
    assert _learned(tc, tok)[0] == f"[TOOL_CALLS][{NEMO_PARIS}]</s>"
    # every token of the call is learned, the tool result and the question are not
    assert tc.trained.sum() == len(
        tok.encode(f"[TOOL_CALLS][{NEMO_PARIS}]</s>It is 18 C and sunny in Paris.</s>")
    )


def test_a_template_that_matches_results_to_call_ids_still_has_the_calls_learned(families):
    """No generation prompt, a result must name the id of the call before it, and the id is written
    after the call: the turn is located with its values masked and its ids kept; the text before its
    first value and after its last (its opening and closing) are the turn's own."""
    _, _, tok, _ = families["mistral"]
    strict = ChatTemplate(
        "{{ bos_token }}{% for m in messages %}{% if m.role == 'user' %}[INST]{{ m.content }}[/INST]"
        "{% elif m.role == 'assistant' %}{{ m.content or '' }}{% if m.tool_calls %}[TOOL_CALLS]"
        "{{ m.tool_calls | map(attribute='function') | list | tojson }}{% for c in m.tool_calls %} id={{ c.id }}"
        "{% endfor %}{% endif %}</s>{% elif m.role == 'tool' %}"
        "{% set before = messages[loop.index0 - 1] %}"
        "{% if not before.tool_calls or before.tool_calls[0].id != m.tool_call_id %}"
        "{{ raise_exception('a result names the call before it') }}{% endif %}"
        "[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]{% endif %}{% endfor %}",
        "ids.jinja",
        special_tokens={"bos_token": "<s>"},
    )
    for content, want in ((None, ""), ("Checking.", "Checking.")):
        record = _with_text(CHATS["tools"], content)
        tc = tokenize_conversation(conversation_from_record(record, "messages", "i:1"), strict, tok)
        assert _learned(tc, tok) == [
            f"{want}[TOOL_CALLS][{PARIS}] id=call00001</s>",
            "It is 18 C and sunny in Paris.</s>",
        ]


def test_a_template_that_renders_nothing_of_a_call_turn_is_refused(families):
    _, _, tok, _ = families["qwen2.5"]
    skips = ChatTemplate(
        "{% for m in messages %}{% if not m.tool_calls %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
        "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
        "skips.jinja",
    )
    conv = conversation_from_record(CHATS["tools"], "messages", "k:1")
    with pytest.raises(
        UserError, match=r"k:1: the chat template skips.jinja does not render answer 1 \(the same"
    ):
        tokenize_conversation(conv, skips, tok)
    assert _learned(tokenize_conversation(conv, skips, tok, "last_assistant"), tok) == [
        "It is 18 C and sunny in Paris.<|im_end|>"
    ]
