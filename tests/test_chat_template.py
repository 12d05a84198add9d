"""Chat templates and answer masks: token-id parity with transformers' apply_chat_template on the real
Qwen2.5, Qwen3 and Llama 3.1 templates, the learned tokens of a rendered conversation shown token run by
token run, and template loading and its errors."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kdistill.data.chat import (
    Conversation,
    answer_spans,
    conversation_from_record,
    end_of_turn_token,
    tokenize_conversation,
)
from kdistill.data.chat_template import ChatTemplate, load_chat_template, template_mismatch
from kdistill.errors import UserError
from kdistill.models.tokenizer import load_tokenizer
from tests.chat_tiny import TEMPLATES, hf_tokenizer, make_chat_model_dir

NAMES = sorted(TEMPLATES)

CHATS = [
    [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "The capital of France is Paris."},
    ],
    [
        {"role": "user", "content": "What is two plus two?"},
        {"role": "assistant", "content": "Two plus two is four."},
        {"role": "user", "content": "Thanks!"},
        {"role": "assistant", "content": "You're welcome."},
    ],
    [
        {"role": "system", "content": "  Ünïcödé — 你好  \n"},
        {"role": "user", "content": "\n emoji 🙂\ttabs "},
        {"role": "assistant", "content": "  leading and trailing space  \n\n"},
    ],
    [
        {"role": "user", "content": "Think first."},
        {"role": "assistant", "content": "<think>\nHmm, two.\n</think>\n\nTwo."},
        {"role": "user", "content": "Again?"},
        {"role": "assistant", "content": "<think>\nStill two.\n</think>\n\nTwo again."},
    ],
    [
        {"role": "user", "content": "Say <|im_end|> and <|eot_id|> literally"},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": "ok"},
        {"role": "assistant", "content": "done"},
    ],
]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat_models")
    out = {}
    for name in NAMES:
        folder = make_chat_model_dir(root, name)
        out[name] = (load_chat_template(folder), load_tokenizer(folder), hf_tokenizer(name))
    return out


@pytest.mark.parametrize("name", NAMES)
def test_token_ids_match_transformers_apply_chat_template(models, name):
    template, tok, hf = models[name]
    for chat in CHATS:
        for gen in (False, True):
            msgs = chat[:-1] if gen else chat
            ours_text = template.render(msgs, add_generation_prompt=gen)
            assert ours_text == hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
            ours = tok.encode(ours_text)
            theirs = hf.apply_chat_template(msgs, tokenize=True, return_dict=True, add_generation_prompt=gen)[
                "input_ids"
            ]
            assert ours == list(theirs), (name, msgs, gen)
            # and the ids of the training path (rendering + masks) are the same ids
            if not gen:
                conv = conversation_from_record({"messages": msgs}, "messages", "t:1")
                assert tokenize_conversation(conv, template, tok).input_ids.tolist() == ours


def _runs(tc, tok) -> str:
    """The rendered conversation with each run of learned tokens in [[ ]], decoded run by run."""
    out, i, ids, tr = [], 0, tc.input_ids, tc.trained
    while i < len(ids):
        j = i
        while j < len(ids) and tr[j] == tr[i]:
            j += 1
        text = tok.decode(ids[i:j])
        out.append(f"[[{text}]]" if tr[i] else text)
        i = j
    return "".join(out)


SIMPLE = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello there"},
]

EXPECTED_SIMPLE = {
    "qwen2.5": "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    "<|im_start|>assistant\n[[Hello there<|im_end|>]]\n",
    # Qwen3 writes an empty think block into the last answer: it is part of what the model says.
    "qwen3": "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    "<|im_start|>assistant\n[[<think>\n\n</think>\n\nHello there<|im_end|>]]\n",
    "llama3.1": "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nKnowledge cutoff: "
    "December 2023\nDate today: 01 Jan 2025\n\nBe brief.<|eot_id|><|start_header_id|>user<|end_header_id|>"
    "\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n[[Hello there<|eot_id|>]]",
}


@pytest.mark.parametrize("name", NAMES)
def test_mask_token_by_token(models, name):
    template, tok, _ = models[name]
    conv = conversation_from_record({"messages": SIMPLE}, "messages", "t:1")
    tc = tokenize_conversation(conv, template, tok)
    assert _runs(tc, tok) == EXPECTED_SIMPLE[name]
    # Token by token: every learned token lies inside the answer + end-of-turn, the header before it
    # and everything after it are masked, and the end-of-turn token itself is learned.
    eot = TEMPLATES[name][2]
    pieces = [(tok.decode([int(t)]), bool(m)) for t, m in zip(tc.input_ids, tc.trained)]
    learned = [p for p, m in pieces if m]
    assert learned[-1] == eot
    first = next(i for i, (_, m) in enumerate(pieces) if m)
    assert pieces[first - 1][0].endswith("\n") and not pieces[first - 1][1]  # header end: masked
    assert all(not m for _, m in pieces[:first]) and sum(m for _, m in pieces) == len(learned)
    assert all(m for _, m in pieces[first : first + len(learned)])  # one contiguous run
    # labels: the target of position i is token i + 1 when learned
    labels = tc.labels(-100)
    assert labels[first - 1] == tc.input_ids[first] and labels[first - 2] == -100 and labels[-1] == -100
    assert int((labels != -100).sum()) == len(learned)
    assert end_of_turn_token(template, tok) == eot


EXPECTED_MULTI = {
    "qwen2.5": "<|im_start|>user\nThink first.<|im_end|>\n<|im_start|>assistant\n"
    "[[<think>\nHmm, two.\n</think>\n\nTwo.<|im_end|>]]\n<|im_start|>user\nAgain?<|im_end|>\n"
    "<|im_start|>assistant\n[[<think>\nStill two.\n</think>\n\nTwo again.<|im_end|>]]\n",
    # Qwen3 drops the reasoning of earlier answers; the last keeps it.
    "qwen3": "<|im_start|>user\nThink first.<|im_end|>\n<|im_start|>assistant\n[[Two.<|im_end|>]]\n"
    "<|im_start|>user\nAgain?<|im_end|>\n<|im_start|>assistant\n"
    "[[<think>\nStill two.\n</think>\n\nTwo again.<|im_end|>]]\n",
    "llama3.1": "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nKnowledge cutoff: "
    "December 2023\nDate today: 01 Jan 2025\n\n<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n"
    "Think first.<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    "[[<think>\nHmm, two.\n</think>\n\nTwo.<|eot_id|>]]<|start_header_id|>user<|end_header_id|>\n\n"
    "Again?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    "[[<think>\nStill two.\n</think>\n\nTwo again.<|eot_id|>]]",
}


@pytest.mark.parametrize("name", NAMES)
def test_mask_of_several_turns(models, name):
    template, tok, _ = models[name]
    conv = conversation_from_record({"messages": CHATS[3]}, "messages", "t:1")
    assert _runs(tokenize_conversation(conv, template, tok), tok) == EXPECTED_MULTI[name]


@pytest.mark.parametrize("name", NAMES)
def test_trimmed_answer_and_empty_answer(models, name):
    template, tok, _ = models[name]
    for chat in CHATS[2], CHATS[4]:
        conv = conversation_from_record({"messages": chat}, "messages", "t:1")
        text, spans = answer_spans(conv, template, ["<|im_end|>", "<|eot_id|>"])
        eot = TEMPLATES[name][2]
        for a, b in spans:
            assert text[a:b].endswith(eot)
        answers = [m["content"] for m in chat if m["role"] == "assistant"]
        for (a, b), content in zip(spans, answers):
            body = text[a:b][: -len(eot)]
            assert body.rstrip().endswith(content.strip())


def test_prompt_completion_learns_the_completion_only(models):
    template, tok, _ = models["qwen2.5"]
    record = {
        "prompt": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"},
            {"role": "user", "content": "Bye"},
        ],
        "completion": "Goodbye",
    }
    conv = conversation_from_record(record, "prompt_completion", "t:1")
    runs = _runs(tokenize_conversation(conv, template, tok), tok)
    assert "[[Goodbye<|im_end|>]]" in runs and "[[Hello" not in runs
    plain = conversation_from_record({"prompt": "Hi", "completion": "Hello"}, "prompt_completion", "t:2")
    assert _runs(tokenize_conversation(plain, template, tok), tok).endswith(
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n[[Hello<|im_end|>]]\n"
    )


def test_train_on_all(models):
    template, tok, _ = models["llama3.1"]
    conv = conversation_from_record({"messages": SIMPLE}, "messages", "t:1")
    tc = tokenize_conversation(conv, template, tok, train_on="all")
    assert tc.trained.all()
    labels = tc.labels(-100)
    assert labels[:-1].tolist() == tc.input_ids[1:].tolist() and labels[-1] == -100
    with pytest.raises(
        UserError, match="data.train_on is 'users', expected one of assistant, last_assistant, all"
    ):
        tokenize_conversation(conv, template, tok, train_on="users")


def test_tokenizers_backend_is_accepted(models):
    from tokenizers import Tokenizer

    template, tok, _ = models["qwen2.5"]
    backend = Tokenizer.from_str(tok._tk.to_str())
    conv = conversation_from_record({"messages": SIMPLE}, "messages", "t:1")
    a = tokenize_conversation(conv, template, tok)
    b = tokenize_conversation(conv, template, backend)
    assert np.array_equal(a.input_ids, b.input_ids) and np.array_equal(a.trained, b.trained)


# ---------------------------------------------------------------------------------------------------
# Loading, the sandbox and errors


def test_template_sources_in_order(tmp_path):
    folder = make_chat_model_dir(tmp_path, "qwen2.5")
    tpl = load_chat_template(folder)
    assert tpl.origin.endswith("tokenizer_config.json") and tpl.special_tokens == {"eos_token": "<|im_end|>"}
    (folder / "chat_template.jinja").write_text("{{ bos_token }}jinja{{ eos_token }}", encoding="utf-8")
    tpl = load_chat_template(folder)
    assert tpl.origin.endswith("chat_template.jinja") and tpl.render([]) == "jinja<|im_end|>"
    override = tmp_path / "mine.jinja"
    override.write_text("{% for m in messages %}{{ m.role }}:{{ m.content }};{% endfor %}", encoding="utf-8")
    tpl = load_chat_template(folder, override)
    assert tpl.render([{"role": "user", "content": "x"}]) == "user:x;"
    assert tpl.special_tokens == {"eos_token": "<|im_end|>"}  # still the model's special tokens
    named = tmp_path / "named.json"
    named.write_text(
        json.dumps(
            {"chat_template": [{"name": "tool_use", "template": "t"}, {"name": "default", "template": "d"}]}
        )
    )
    assert load_chat_template(folder, named).source == "d"
    # special tokens given as AddedToken objects
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["bos_token"] = {"content": "<|endoftext|>", "special": True}
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert load_chat_template(folder).special_tokens["bos_token"] == "<|endoftext|>"


def test_template_errors_are_one_line(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UserError, match="no chat template .*data.chat_template=PATH"):
        load_chat_template(empty)
    (empty / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(UserError, match=r"tokenizer_config.json: not valid JSON \(.* at line 1"):
        load_chat_template(empty)
    (empty / "tokenizer_config.json").write_text(json.dumps({"chat_template": 3}))
    with pytest.raises(UserError, match="'chat_template' is int, expected a string"):
        load_chat_template(empty)
    (empty / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% for %}"}))
    with pytest.raises(UserError, match=r"tokenizer_config.json: chat template line 1: ") as e:
        load_chat_template(empty)
    assert "\n" not in str(e.value)
    with pytest.raises(UserError, match="data.chat_template: .*missing.jinja is not a file"):
        load_chat_template(empty, tmp_path / "missing.jinja")
    raising = ChatTemplate("{{ raise_exception('Conversation roles must alternate') }}", "t.jinja")
    with pytest.raises(
        UserError, match="t.jinja: chat template failed at line 1: Conversation roles must alternate"
    ):
        raising.render([])


def test_sandbox_blocks_escapes():
    evil = ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}", "evil.jinja")
    with pytest.raises(UserError, match="evil.jinja: chat template failed"):
        evil.render([])
    mutate = ChatTemplate("{{ messages.append(1) }}", "mutate.jinja")
    with pytest.raises(UserError, match="mutate.jinja: chat template failed"):
        mutate.render([])
    ns = ChatTemplate("{% set n = namespace(_x=1) %}", "ns.jinja")
    with pytest.raises(UserError, match="ns.jinja: chat template failed"):
        ns.render([])
    ok = ChatTemplate(
        "{% set n = namespace(k=0) %}{% for m in messages %}{% set n.k = n.k + 1 %}{% if loop.index > 1 %}"
        "{% break %}{% endif %}{% endfor %}{{ n.k }} {{ {'é': 1} | tojson }}{% generation %}g{% endgeneration %}",
        "ok.jinja",
    )
    assert ok.render([{"role": "user", "content": "a"}] * 3) == '2 {"é": 1}g'


def test_template_mismatch_names_both(tmp_path):
    a = load_chat_template(make_chat_model_dir(tmp_path, "qwen2.5"))
    b = load_chat_template(make_chat_model_dir(tmp_path, "llama3.1"))
    assert template_mismatch(a, a) is None
    note = template_mismatch(a, b)
    assert "qwen2.5" in note and "llama3.1" in note and "teacher's" in note and "\n" not in note


def test_template_that_transforms_answers_is_located_by_render_diff():
    # A template that upper-cases every message: spans come from render diffs, not from the text.
    tpl = ChatTemplate(
        "{% for m in messages %}<{{ m.role }}>{{ m.content | upper }}</s>{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}",
        "upper.jinja",
    )
    conv = Conversation(
        ({"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}), (False, True), "f:3"
    )
    text, spans = answer_spans(conv, tpl, ["</s>"])
    assert text[spans[0][0] : spans[0][1]] == "B</s>"
    assert end_of_turn_token(tpl, _special_tokenizer(["</s>"])) == "</s>"
    dropper = ChatTemplate(
        "{% for m in messages %}{% if m.role != 'assistant' %}{{ m.content }}{% endif %}{% endfor %}",
        "drop.jinja",
    )
    with pytest.raises(UserError, match="f:3: the chat template drop.jinja does not render answer 1"):
        answer_spans(conv, dropper)
    # A template that cuts the answer's last character: what it does render is learned.
    cutter = ChatTemplate("{% for m in messages %}{{ m.content[:-1] }}|{% endfor %}", "cut.jinja")
    conv2 = Conversation(
        ({"role": "user", "content": "ab"}, {"role": "assistant", "content": "xyz"}), (False, True), "f:4"
    )
    text, spans = answer_spans(conv2, cutter)
    assert text == "a|xy|" and text[spans[0][0] : spans[0][1]] == "xy"


def _special_tokenizer(specials):
    from tokenizers import Tokenizer, models

    tk = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    tk.add_special_tokens(specials)
    return tk


# ---------------------------------------------------------------------------------------------------
# Templates are untrusted programs: every fault is one line naming the template (and its line), within
# a time and output budget per rendering.

FAULTS = [
    ("a\n{{ 1 // 0 }}", r"at line 2: ZeroDivisionError: integer division or modulo by zero"),
    ("{{ messages[0].content + 1 }}", r"at line 1: TypeError: can only concatenate str"),
    ("\n\n{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", r"recursion too deep at line 3"),
    ("{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}", r"ran longer than"),
    ("{% for i in range(99999) %}{{ 'x' * 1000 }}{% endfor %}", r"wrote more than 1048576 characters"),
    ("{% for c in 'x' * 1000000 %}{% for d in 'y' * 1000000 %}{% endfor %}{% endfor %}", r"ran longer than"),
    (
        "{% set ns = namespace(s='x') %}{% for i in range(99) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
        "more than",
    ),
    ("{{ 'x' * 10**9 }}", r"builds a value of more than 1048576 items with '\*'"),
    ("{{ 'x' | center(10**10) }}", r"asked for a size of 10000000000"),
    ("{{ 'x'.ljust(10**10) }}", r"asked for a size of 10000000000"),
    ("{{ '%999999999d' % 1 }}", r"formats a field wider than 1048576 characters"),
    ("{{ '%.999999999f' % 1.0 }}", r"formats a field wider than 1048576 characters"),
    ("{{ '%*d' % (999999999, 1) }}", r"formats a field wider than 1048576 characters"),
    ("{{ '%999999999d' | format(1) }}", r"formats a field wider than 1048576 characters"),
    ("{{ '{:>999999999}'.format('x') }}", r"formats a field wider than 1048576 characters"),
    # a constant filter call is not run while compiling, where no budget applies
    ("{{ 'a\nb' | indent(999999999) }}", r"asked for a size of 999999999"),
    ("{{ 2 ** 99999999 }}", r"builds a number of more than"),
    ("{{ raise_exception('no system role') }}", r"failed at line 1: no system role"),
]


@pytest.mark.parametrize("source,message", FAULTS)
def test_template_faults_are_one_line_within_budget(source, message):
    import time

    tpl = ChatTemplate(source, "bad.jinja", time_limit_s=0.5, max_chars=1 << 20)
    t0 = time.monotonic()
    with pytest.raises(UserError, match=r"^bad.jinja: chat template .*" + message) as e:
        tpl.render([{"role": "user", "content": "hi"}])
    assert "\n" not in str(e.value) and time.monotonic() - t0 < 5
    assert e.value.__cause__ is None and e.value.__suppress_context__


def test_a_raising_template_is_one_line_through_the_cli(tmp_path, capsys):
    from tests.test_train_kit import run_cli

    folder = make_chat_model_dir(tmp_path, "qwen2.5")
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "a", "completion": "b"}) + "\n", encoding="utf-8")
    bad = tmp_path / "recurse.jinja"
    bad.write_text("{% macro f(n) %}{{ f(n) }}{% endmacro %}\n{{ f(1) }}", encoding="utf-8")
    rc, _, err = run_cli(
        capsys, "data", "preview", "--model", str(folder), "--data", str(data), "--chat-template", str(bad)
    )
    assert rc == 2 and err.count("\n") == 1 and "recurse.jinja: chat template recursion too deep" in err


def test_chat_template_file_is_relative_to_the_config_file(tmp_path):
    """data.chat_template names a file beside the config as the model and data paths do; a template
    given inline (not a path that exists) is left as written."""
    from kdistill.config import load_config

    (tmp_path / "templates").mkdir()
    (tmp_path / "templates" / "chat.jinja").write_text("{{ messages }}")
    cfg_path = tmp_path / "run.yaml"
    cfg_path.write_text(
        "teacher: {path: t}\nstudent: {path: s}\ndata: {chat_template: templates/chat.jinja}\n"
    )
    assert load_config(str(cfg_path)).data.chat_template == str(tmp_path / "templates" / "chat.jinja")
    cfg_path.write_text("teacher: {path: t}\nstudent: {path: s}\ndata: {chat_template: nowhere.jinja}\n")
    assert load_config(str(cfg_path)).data.chat_template == "nowhere.jinja"
