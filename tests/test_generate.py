"""Generation with a KV cache: greedy parity with transformers' `generate`, seeded sampling, stops.

- Greedy new tokens equal transformers' `generate(do_sample=False)` token for token on the tiny Qwen2,
  Llama and Qwen3 models, one prompt and a batch of prompts of different lengths (left-padded).
- The cached forward gives the same last hidden state as the full forward.
- Sampling with a seed is reproducible, another seed differs; top-k 1 is greedy.
- `kdistill generate` (the decode engine): --json equals the reference path's tokens, a single prompt streams the same text, --chat and
  --messages render with the model's template, and every bad flag or messages line is a one-line error.
- `--kernel-pack`: a folder that is not a pack, or a pack of another Triton or GPU, is one line naming the
  flag before the model is loaded (nothing written for --out); a pack reaches the decode engine's prewarm.
"""

from __future__ import annotations

import json

import pytest
import torch

from kdistill.cli import main
from kdistill.data.chat_template import ChatTemplate, load_chat_template
from kdistill.generate import Sampling, encode_prompts, read_messages_file, stop_token_ids
from kdistill.models.hf_io import load_model
from kdistill.models.tokenizer import load_tokenizer
from tests.oracle_decode import KVCache, forward_cached, generate_ids
from tests.tiny import load_hf, make_tiny_model, sample_ids

PROMPT_LENS = (7, 3, 11)


@pytest.fixture(scope="module", params=["qwen2", "llama", "qwen3"])
def pair(request, tmp_path_factory):
    d = make_tiny_model(tmp_path_factory.mktemp(request.param), family=request.param, tied=False)
    return load_model(d).eval(), load_hf(d)


def prompts(vocab: int) -> list[list[int]]:
    return [sample_ids(vocab, 1, n, seed=n)[0].add(1).clamp(max=vocab - 1).tolist() for n in PROMPT_LENS]


def hf_greedy(hf, rows: list[list[int]], n: int, eos: int) -> list[list[int]]:
    """transformers' greedy new tokens per row (left padding, attention mask), cut after the first EOS."""
    p = max(len(r) for r in rows)
    ids = torch.zeros((len(rows), p), dtype=torch.long)
    mask = torch.zeros((len(rows), p), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, p - len(r) :] = torch.tensor(r)
        mask[i, p - len(r) :] = 1
    out = hf.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=n,
        eos_token_id=eos,
        pad_token_id=eos,
    )
    res = []
    for row in out[:, p:].tolist():
        res.append(row[: row.index(eos) + 1] if eos in row else row)
    return res


def test_greedy_matches_transformers(pair):
    ours, hf = pair
    rows = prompts(ours.spec.vocab_size)
    # a stop id that occurs: the 4th greedy token of the first row, so rows stop at different steps
    free = generate_ids(ours, rows, Sampling(max_new_tokens=12))
    eos = free[0][3]
    for batch in ([rows[0]], rows):
        want = hf_greedy(hf, batch, 12, eos)
        got = generate_ids(ours, batch, Sampling(max_new_tokens=12), {eos})
        assert got == want


def test_cached_forward_matches_full_forward(pair):
    model, _ = pair
    ids = sample_ids(model.spec.vocab_size, 2, 9, seed=3)
    full = model(ids)
    cache = KVCache.empty(model.spec, batch=2, max_len=9, device="cpu", dtype=torch.float32)
    pos = torch.arange(9).expand(2, 9)
    valid = torch.ones(2, 9, dtype=torch.bool)
    h = forward_cached(model, ids[:, :6], pos[:, :6], valid[:, :6], cache)
    torch.testing.assert_close(h, full[:, :6], atol=1e-5, rtol=1e-5)
    for t in range(6, 9):
        h = forward_cached(model, ids[:, t : t + 1], pos[:, t : t + 1], valid[:, t : t + 1], cache)
        torch.testing.assert_close(h[:, 0], full[:, t], atol=1e-5, rtol=1e-5)


def test_sampling_is_reproducible(pair):
    model, _ = pair
    rows = prompts(model.spec.vocab_size)
    s = Sampling(max_new_tokens=10, temperature=1.5, top_k=50, top_p=0.95, seed=7)
    a = generate_ids(model, rows, s)
    assert a == generate_ids(model, rows, s)
    assert a != generate_ids(model, rows, Sampling(max_new_tokens=10, temperature=1.5, seed=8))
    greedy = generate_ids(model, rows, Sampling(max_new_tokens=10))
    assert generate_ids(model, rows, Sampling(max_new_tokens=10, temperature=1.0, top_k=1)) == greedy


# -- the command line ----------------------------------------------------------------------------
TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}<|endoftext|>\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    d = make_tiny_model(tmp_path_factory.mktemp("chat"), family="qwen2")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = TEMPLATE
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(["generate", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cli_json_equals_api(chat_dir, capsys):
    rc, out, _ = cli(
        capsys,
        "--model",
        str(chat_dir),
        "--prompt",
        "the quick",
        "--prompt",
        "a",
        "--json",
        "--max-new-tokens",
        "6",
        "--device",
        "cpu",
    )
    assert rc == 0
    rows = sorted((json.loads(line) for line in out.splitlines()), key=lambda r: r["index"])
    model = load_model(chat_dir).eval()
    tok = load_tokenizer(chat_dir)
    want = generate_ids(model, tok.encode_batch(["the quick", "a"]), Sampling(max_new_tokens=6), {tok.eos_id})
    assert [r["token_ids"] for r in rows] == want
    assert rows[0]["text"] == tok.decode([i for i in want[0] if i != tok.eos_id])


def test_cli_streams_a_single_prompt(chat_dir, capsys):
    rc, out, _ = cli(
        capsys, "--model", str(chat_dir), "--prompt", "the quick", "--max-new-tokens", "6", "--device", "cpu"
    )
    assert rc == 0
    rc, js, _ = cli(
        capsys,
        "--model",
        str(chat_dir),
        "--prompt",
        "the quick",
        "--max-new-tokens",
        "6",
        "--device",
        "cpu",
        "--json",
    )
    assert out == json.loads(js)["text"] + "\n"


def test_cli_chat_renders_the_template(chat_dir, tmp_path, capsys):
    msgs = tmp_path / "m.jsonl"
    conv = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the fox"}]
    msgs.write_text(json.dumps({"messages": conv}) + "\n" + json.dumps(conv[1:]) + "\n")
    rc, out, _ = cli(
        capsys,
        "--model",
        str(chat_dir),
        "--messages",
        str(msgs),
        "--prompt",
        "the fox",
        "--chat",
        "--json",
        "--max-new-tokens",
        "5",
        "--device",
        "cpu",
    )
    assert rc == 0
    rows = sorted((json.loads(line) for line in out.splitlines()), key=lambda r: r["index"])
    assert [r["index"] for r in rows] == [0, 1, 2]
    # --prompt X --chat is the conversation [user: X]
    assert rows[0]["token_ids"] == rows[2]["token_ids"] and rows[0]["messages"] == rows[2]["messages"]
    tok = load_tokenizer(chat_dir)
    tpl = load_chat_template(chat_dir)
    ids = [tok.encode(tpl.render(c, add_generation_prompt=True)) for c in ([conv[1]], conv)]
    want = generate_ids(load_model(chat_dir).eval(), ids, Sampling(max_new_tokens=5), {tok.eos_id})
    assert [rows[0]["token_ids"], rows[1]["token_ids"]] == want


@pytest.mark.parametrize(
    "argv, lines, message",
    [
        ([], None, "expected --prompt TEXT or --messages FILE"),
        (["--prompt", "a", "--temperature", "-1"], None, "--temperature is -1.0"),
        (["--prompt", "a", "--top-p", "0"], None, "--top-p is 0.0"),
        (["--prompt", "a", "--max-new-tokens", "0"], None, "--max-new-tokens is 0"),
        (["--prompt", "a", "--top-k", "-2"], None, "--top-k is -2"),
        (["--prompt", "", "--prompt", "a"], None, "--prompt 1 is empty"),
        (["--prompt", "a", "--device", "tpu"], None, "--device is 'tpu'"),
        ([], ["{bad"], "m.jsonl:1: not valid JSON"),
        ([], ["[]"], "m.jsonl:1: expected a non-empty list of messages"),
        ([], ['[{"role": "user", "content": 3}]'], "m.jsonl:1: messages[0] (user): content is a number"),
        ([], ['[{"role": 7, "content": "x"}]'], "m.jsonl:1: messages[0]: role 7 is not a name"),
        (
            [],
            ["", '[{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]'],
            "m.jsonl:2: the last message is 'assistant', expected a turn to answer",
        ),
        (["--prompt", "a", "--chat", "--chat-template", "missing.jinja"], None, "--chat-template: missing"),
        ([], [""], "no conversations"),
    ],
)
def test_cli_errors_are_one_line(chat_dir, tmp_path, capsys, argv, lines, message):
    if lines is not None:
        (tmp_path / "m.jsonl").write_text("\n".join(lines) + "\n")
        argv = [*argv, "--messages", str(tmp_path / "m.jsonl")]
    rc, _, err = cli(capsys, "--model", str(chat_dir), *argv)
    assert rc == 2
    assert err.count("\n") == 1 and message in err, err


def test_chat_without_template_is_an_error(tmp_path, capsys):
    d = make_tiny_model(tmp_path, family="llama")
    rc, _, err = cli(capsys, "--model", str(d), "--prompt", "a", "--chat")
    assert rc == 2 and err.count("\n") == 1 and "template" in err, err


# -- chat templates: any transformation, another template, every field -------------------------------
def test_a_template_that_transforms_content_does_not_break_generate(tmp_path, capsys):
    d = make_tiny_model(tmp_path, family="qwen2")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = TEMPLATE.replace("{{ m['content'] }}", "{{ m['content'] | upper }}")
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = load_tokenizer(d)
    # the end-of-turn stop comes from the render diff, whatever the template does to the text
    assert tok.token_to_id("<|endoftext|>") in stop_token_ids(d, tok, load_chat_template(d))
    for extra in ([], ["--chat"]):
        rc, out, err = cli(capsys, "--model", str(d), "--prompt", "the fox", "--max-new-tokens", "3", *extra)
        assert rc == 0, err


def test_a_template_that_raises_only_costs_plain_prompts_their_end_of_turn_stop(tmp_path, capsys):
    d = make_tiny_model(tmp_path, family="qwen2")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{{ raise_exception('no chat here') }}"
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    rc, _, err = cli(
        capsys, "--model", str(d), "--prompt", "the fox", "--max-new-tokens", "3", "--device", "cpu"
    )
    assert rc == 0, err
    rc, _, err = cli(capsys, "--model", str(d), "--prompt", "the fox", "--chat", "--device", "cpu")
    assert rc == 2 and err.count("\n") == 1 and "chat template failed at line 1: no chat here" in err, err


def test_chat_template_flag_renders_with_another_template(tmp_path, capsys):
    d = make_tiny_model(tmp_path, family="llama")  # no template of its own
    rc, _, err = cli(capsys, "--model", str(d), "--prompt", "a", "--chat")
    assert rc == 2 and "--chat-template PATH" in err and "data.chat_template" not in err
    tpl = tmp_path / "mine.jinja"
    tpl.write_text(TEMPLATE, encoding="utf-8")
    rc, out, err = cli(
        capsys,
        "--model",
        str(d),
        "--prompt",
        "the fox",
        "--chat",
        "--chat-template",
        str(tpl),
        "--json",
        "--max-new-tokens",
        "4",
        "--device",
        "cpu",
    )
    assert rc == 0, err
    tok = load_tokenizer(d)
    ids = [tok.encode(ChatTemplate(TEMPLATE, "mine").render([{"role": "user", "content": "the fox"}], True))]
    want = generate_ids(
        load_model(d).eval(),
        ids,
        Sampling(max_new_tokens=4),
        stop_token_ids(d, tok, None) | {tok.token_to_id("<|endoftext|>")},
    )
    assert json.loads(out)["token_ids"] == want[0]


def test_messages_keep_every_field_and_their_tools(tmp_path):
    msgs = tmp_path / "m.jsonl"
    call = {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    record = {
        "tools": [{"type": "function", "function": {"name": "get_weather"}}],
        "messages": [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": None, "tool_calls": [call], "reasoning_content": "look it up"},
            {"role": "tool", "tool_call_id": "1", "content": "sunny"},
        ],
    }
    msgs.write_text(json.dumps(record) + "\n", encoding="utf-8")
    (conv,) = read_messages_file(msgs)
    tpl = ChatTemplate(
        "{{ tools | map(attribute='function.name') | join(',') }}|{% for m in messages %}{{ m.role }}:"
        "{{ m.content or '' }}{{ m.reasoning_content or '' }}{{ (m.tool_calls or []) | length }};{% endfor %}"
        "{% if add_generation_prompt %}>{{ flavour }}{% endif %}",
        "t.jinja",
    )
    tok = load_tokenizer(make_tiny_model(tmp_path, family="qwen2"))
    (ids,) = encode_prompts(tok, tpl, conversations=[conv], template_kwargs={"flavour": "x"})
    assert tok.decode(ids) == "get_weather|user:Weather?0;assistant:look it up1;tool:sunny0;>x"


def test_a_prompt_that_is_not_unicode_is_one_line(chat_dir, capsys):
    rc, _, err = cli(capsys, "--model", str(chat_dir), "--prompt", "a\udcff", "--device", "cpu")
    assert rc == 2 and err.count("\n") == 1 and "prompt 1 holds a lone surrogate" in err, err


# -- --kernel-pack: checked before the model is loaded, handed to the decode prewarm --------------------
def _pack(folder, **fields):
    """A pack folder whose manifest is this process's Triton's, with `fields` changed (kernels: none)."""
    from kdistill.kernels import pack

    folder.mkdir(parents=True, exist_ok=True)
    manifest = {
        "format": 1,
        "triton": pack.triton_version(),
        "triton_build": pack.triton_build(),
        "kernels": {},
    }
    (folder / "manifest.json").write_text(json.dumps({**manifest, **fields}), encoding="utf-8")
    return folder


def _no_model_load(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before --kernel-pack was checked")

    monkeypatch.setattr("kdistill.generate.load_model", refuse)


@pytest.mark.parametrize("to_file", [False, True])
@pytest.mark.parametrize(
    "damage, message",
    [
        (None, ": not a folder (expected the --out folder of kdistill kernels build)"),
        (lambda p: p.mkdir(), ": no manifest.json"),
        (
            lambda p: (p.mkdir(), (p / "manifest.json").write_text('{"format": 1, "tri')),
            "not a readable JSON",
        ),
        (lambda p: (p.mkdir(), (p / "manifest.json").write_text('{"format": 7}')), "with format 1, got"),
    ],
)
def test_a_bad_kernel_pack_is_one_line_before_the_model_is_loaded(
    chat_dir, tmp_path, capsys, monkeypatch, damage, message, to_file
):
    folder = tmp_path / "pack"
    if damage is not None:
        damage(folder)
    _no_model_load(monkeypatch)
    out = tmp_path / "answers.jsonl"
    where = ["--out", str(out)] if to_file else ["--json"]
    rc, _, err = cli(
        capsys,
        "--model",
        str(chat_dir),
        "--prompt",
        "a",
        "--device",
        "cpu",
        "--kernel-pack",
        str(folder),
        *where,
    )
    assert rc == 2 and err.count("\n") == 1, err
    assert err.startswith(f"kdistill: error: --kernel-pack {folder}") and message in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == (["pack"] if damage else [])  # nothing written


def test_a_kernel_pack_of_another_triton_or_gpu_is_refused_before_the_model_is_loaded(
    chat_dir, tmp_path, capsys, monkeypatch
):
    """Where the decode kernels are Triton's (a GPU; stood in for by the arch it would report), the
    pack's Triton version and build and its archs are checked against this process, naming both."""
    from kdistill.kernels import pack

    pytest.importorskip("triton")
    monkeypatch.setattr("kdistill.generate.decode_kernel_arch", lambda device: "sm_90")
    _no_model_load(monkeypatch)
    entry = {"arch": "sm_80", "triton": pack.triton_version(), "cuda": "12.8", "dir": "sm_80/k", "name": "k"}
    entry.update(triton_hash="00", files={"k.cubin": "00"})
    cases = [
        (
            _pack(tmp_path / "old", triton="3.0.0"),
            f"built with Triton 3.0.0, this is Triton {pack.triton_version()}",
        ),
        (
            _pack(tmp_path / "build", triton_build="0123456789abcdef"),
            "build 0123456789abcdef, this is Triton",
        ),
        (_pack(tmp_path / "a100", kernels={"k[sm_80]": entry}), "built for sm_80, this GPU is sm_90"),
    ]
    for folder, message in cases:
        argv = ["--model", str(chat_dir), "--prompt", "a", "--device", "cpu", "--kernel-pack", str(folder)]
        rc, _, err = cli(capsys, *argv)
        assert rc == 2 and err.count("\n") == 1, err
        assert err.startswith(f"kdistill: error: --kernel-pack {folder}: ") and message in err, err


@pytest.mark.parametrize("to_file", [False, True])
def test_the_kernel_pack_reaches_the_decode_prewarm(chat_dir, tmp_path, capsys, monkeypatch, to_file):
    """The decode engine's prewarm gets the pack with the plan and arch it warms; on the CPU the Triton
    mode is stood in for (the kernels still run on the reference path) and the prewarm recorded."""
    import dataclasses

    import kdistill.generate as gen
    from kdistill.kernels.seal import PrewarmReport

    folder = _pack(tmp_path / "pack")
    calls = []
    real_configure = gen.configure

    def configure(**kwargs):
        return dataclasses.replace(real_configure(**kwargs), mode="triton", arch="sm_90")

    def prewarm(plan, device, *, pack=None, arch=None):
        calls.append(("prewarm", len(plan), str(device), pack, arch))
        return PrewarmReport(pack=str(pack))

    monkeypatch.setattr(gen, "configure", configure)
    monkeypatch.setattr(gen, "prewarm", prewarm)
    monkeypatch.setattr(gen, "unseal", lambda: calls.append(("unseal",)))
    monkeypatch.setattr(gen, "seal", lambda strict=None: calls.append(("seal",)))
    out = tmp_path / "answers.jsonl"
    where = ["--out", str(out), "--quiet"] if to_file else ["--json"]
    argv = ["--model", str(chat_dir), "--prompt", "the fox", "--max-new-tokens", "3", "--device", "cpu"]
    rc, stdout, err = cli(capsys, *argv, "--kernel-pack", str(folder), *where)
    assert rc == 0, err
    (kind, planned, device, pack, arch), *rest = calls
    assert (kind, device, pack, arch) == ("prewarm", "cpu", str(folder), "sm_90") and planned > 0
    assert rest == [("unseal",), ("seal",)]  # sealed after the pack's prewarm, before decoding
    rows = [json.loads(line) for line in (out.read_text() if to_file else stdout).splitlines()]
    assert len(rows) == 1 and len(rows[0]["token_ids"]) >= 1
