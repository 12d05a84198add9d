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

from kdistill.data.chat import UNRENDERED_CALL_TEXT, conversation_from_record, tokenize_conversation
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
    # the calls are rendered, never reported; a call turn's text the template leaves out is
    text_dropped = chat == "call_with_text" and family in ("llama3", "llama3.1", "mistral")
    assert set(tc.unrendered) - {"tools"} == ({UNRENDERED_CALL_TEXT} if text_dropped else set())
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


def test_a_lora_run_on_tool_calls_merges_into_a_model_with_the_template_it_trained_with(tmp_path, capsys):
    """Tool-call conversations rendered with a Mistral-Nemo-shaped data.chat_template, the calls
    learned (data.train_on=assistant), a LoRA student whose own template (in tokenizer_config.json,
    as such models ship it) is another: `export --merge` writes the run's template, and transformers
    renders the tool conversation with it as the run did."""
    import shutil

    import yaml
    from transformers import AutoTokenizer

    from tests.chat_families import template_source
    from tests.test_lora import _lora_config
    from tests.test_train_kit import assets, run_cli

    student = tmp_path / "student"
    shutil.copytree(assets().student, student)
    (student / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((student / "tokenizer_config.json").read_text(encoding="utf-8"))
    (student / "tokenizer_config.json").write_text(
        json.dumps({**config, "chat_template": template_source("hermes")}), encoding="utf-8"
    )
    template = tmp_path / "nemo.jinja"
    template.write_text(template_source("mistral-nemo"), encoding="utf-8")
    data = tmp_path / "calls.jsonl"
    chats = [TOOL_CHATS[c] for c in ("call", "call_with_text", "two_calls")] * 6
    data.write_text("".join(json.dumps(c) + "\n" for c in chats), encoding="utf-8")
    run_dir = tmp_path / "run"
    cfg = _lora_config(run_dir, steps=2, batch_size=2)
    cfg["student"]["path"] = str(student)
    cfg["data"] = {
        "train": [str(data)],
        "heldout_fraction": 0.2,
        "seq_len": 256,
        "chat_template": str(template),
        "train_on": "assistant",
        "cache_dir": str(assets().cache),
    }
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False), encoding="utf-8")
    rc, _, err = run_cli(capsys, "run", str(tmp_path / "run.yaml"), "--quiet")
    assert rc == 0, err
    summary = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
    assert summary["data"]["train_on"] == "assistant" and summary["data"]["train_learned_tokens"] > 0
    merged = tmp_path / "merged"
    rc, _, err = run_cli(capsys, "export", "--run", str(run_dir), "--merge", "--out", str(merged))
    assert rc == 0, err
    assert (merged / "chat_template.jinja").read_text(encoding="utf-8") == template_source("mistral-nemo")
    msgs, tools = TOOL_CHATS["call"]["messages"], TOOL_CHATS["call"]["tools"]
    want = load_chat_template(assets().teacher, template).render(msgs, tools=tools)
    got = AutoTokenizer.from_pretrained(merged).apply_chat_template(msgs, tools=tools, tokenize=False)
    assert got == want and "[TOOL_CALLS]" in got


def test_a_merged_lora_student_carries_the_teachers_template_it_trained_with_not_its_own(tmp_path, capsys):
    """Without data.chat_template a run renders its conversations with the teacher's template: the
    merged model carries that one, as a full run's student/ does, not the base student's own."""
    import shutil

    import yaml
    from transformers import AutoTokenizer

    from tests.test_chat_train import TEMPLATE, write_chat_files
    from tests.test_lora import _lora_config
    from tests.test_train_kit import assets, run_cli

    teacher, student = tmp_path / "teacher", tmp_path / "student"
    shutil.copytree(assets().teacher, teacher)
    shutil.copytree(assets().student, student)
    (teacher / "chat_template.jinja").write_text(TEMPLATE, encoding="utf-8")
    (student / "chat_template.jinja").write_text("base: " + TEMPLATE, encoding="utf-8")
    data, _ = write_chat_files(tmp_path / "data", n=24)
    run_dir = tmp_path / "run"
    cfg = _lora_config(run_dir, steps=2, batch_size=2)
    cfg["teacher"]["path"], cfg["student"]["path"] = str(teacher), str(student)
    cfg["data"] = {
        "train": [str(data)],
        "heldout_fraction": 0.2,
        "seq_len": 48,
        "cache_dir": str(assets().cache),
    }
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False), encoding="utf-8")
    rc, _, err = run_cli(capsys, "run", str(tmp_path / "run.yaml"), "--quiet")
    assert rc == 0, err
    assert (run_dir / "adapter" / "chat_template.jinja").read_text(encoding="utf-8") == TEMPLATE
    for adapter_kept_it in (True, False):  # an adapter written before runs kept their template too
        if not adapter_kept_it:
            (run_dir / "adapter" / "chat_template.jinja").unlink()
        merged = tmp_path / f"merged-{adapter_kept_it}"
        rc, _, err = run_cli(capsys, "export", "--run", str(run_dir), "--merge", "--out", str(merged))
        assert rc == 0, err
        assert (merged / "chat_template.jinja").read_text(encoding="utf-8") == TEMPLATE
        conv = [{"role": "user", "content": "the quick fox"}]
        got = AutoTokenizer.from_pretrained(merged).apply_chat_template(conv, tokenize=False)
        assert got.startswith("user: the quick fox")
    assert (student / "chat_template.jinja").read_text(encoding="utf-8") == "base: " + TEMPLATE


def test_a_mistral_nemo_check_that_counts_a_null_tool_calls_turn_still_has_the_calls_learned(families):
    """The other form of Mistral-Nemo's alternation check: a turn is left out only when its tool_calls
    is set and not null, so neither stand-in without calls passes; the turn is then located with its
    values masked, and its opening (`[TOOL_CALLS][{"name": "`, no generation prompt) and closing (the
    id and `}]</s>`) are its own."""
    _, nemo, tok, _ = families["mistral-nemo"]
    old = nemo.source[nemo.source.index("{%- for m in turns | rejectattr") :]
    old = old[: old.index("{%- endfor %}") + len("{%- endfor %}")]
    new = (
        "{%- set alt = namespace(index=0) %}{%- for m in turns %}"
        "{%- if not (m.role == 'tool' or (m.tool_calls is defined and m.tool_calls is not none)) %}"
        "{%- if (m.role == 'user') != (alt.index % 2 == 0) %}"
        "{{- raise_exception('After the optional system message, roles must alternate user/assistant/...') }}"
        "{%- endif %}{%- set alt.index = alt.index + 1 %}{%- endif %}{%- endfor %}"
    )
    assert old in nemo.source
    source = nemo.source.replace(old, new)
    hf = hf_tokenizer("mistral-nemo")
    hf.chat_template = source
    strict = ChatTemplate(
        source, "nemo-strict.jinja", special_tokens={"bos_token": "<s>", "eos_token": "</s>"}
    )
    for chat in ("call", "call_with_text", "two_calls"):
        record = TOOL_CHATS[chat]
        msgs = record["messages"]
        gone = [*msgs[:1], {"role": "assistant", "content": "x", "tool_calls": None}, *msgs[2:]]
        with pytest.raises(UserError, match="roles must alternate"):
            strict.render(gone, tools=record["tools"])
        conv = conversation_from_record(record, "messages", f"{chat}:1")
        tc = tokenize_conversation(conv, strict, tok)
        want = hf.apply_chat_template(msgs, tools=record["tools"], tokenize=True, return_dict=True)[
            "input_ids"
        ]
        assert tc.input_ids.tolist() == list(want)
        assert _learned(tc, tok)[0] == CALL_TURN["mistral-nemo"][chat]
