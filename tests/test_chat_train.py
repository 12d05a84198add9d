"""Training on conversations: packed rows without cross-talk, loss over the answers only, a whole run.

- A packed row of several conversations gives the same hidden states (and per-token loss) as running
  each conversation alone, for the three families (fp32 on the CPU, <= 1e-5).
- The KD loss on a rendered conversation equals the dense formula over the unmasked tokens only, and
  masked rows are never sent to the loss head.
- A chat distillation run of the tiny pair on a conversation JSONL finishes, reports its packing
  efficiency, and its student loads in transformers.
- The kernel plan covers the document-masked attention a conversation step launches.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from kdistill import dispatch
from kdistill.data.batches import Batcher, heldout_batches
from kdistill.data.chat import Conversation, tokenize_conversation
from kdistill.data.chat_pack import pack_conversations
from kdistill.data.chat_template import ChatTemplate
from kdistill.kernels import runtime
from kdistill.models.decoder import build_decoder
from kdistill.ops.kd_loss import kd_loss_dense
from tests.test_contract import make_run, make_spec
from tests.test_train_kit import assets, base_config, read_summary, run_cli
from tests.tiny import make_tokenizer

# A template over the tiny tokenizer's own special token: the answer and its <|endoftext|> are learned.
TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}<|endoftext|>\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
WORDS = "the teacher student model learns tokens from logits quick brown fox jumps over lazy dog".split()


def conversations(n: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        turns = []
        if i % 3 == 0:
            turns.append({"role": "system", "content": "be brief"})
        for _ in range(1 + i % 2):
            turns.append({"role": "user", "content": " ".join(rng.choice(WORDS, 4 + i % 5))})
            turns.append({"role": "assistant", "content": " ".join(rng.choice(WORDS, 3 + i % 7))})
        out.append({"messages": turns})
    return out


def write_chat_files(folder: Path, n: int = 60) -> tuple[Path, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / "chats.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in conversations(n)), encoding="utf-8")
    template = folder / "chat.jinja"
    template.write_text(TEMPLATE, encoding="utf-8")
    return data, template


def tokenized(n: int, tok_dir: Path):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(make_tokenizer(tok_dir)))
    tpl = ChatTemplate(source=TEMPLATE, origin="chat.jinja", special_tokens={})
    convs = []
    for i, rec in enumerate(conversations(n)):
        msgs = tuple(rec["messages"])
        conv = Conversation(
            messages=msgs, train=tuple(m["role"] == "assistant" for m in msgs), source=f"c:{i}"
        )
        convs.append(tokenize_conversation(conv, tpl, tok))
    return convs


@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3"])
def test_packed_row_equals_each_conversation_alone(tmp_path, arch):
    convs = tokenized(6, tmp_path)
    rows = pack_conversations(convs, seq_len=sum(len(c) for c in convs) // 2 + 40, pad_id=0)
    assert len(rows) >= 2 and max(len(s) for s in rows.sources) >= 2  # several conversations a row
    spec = make_spec(arch=arch, vocab=384, layers=2, llama3=arch == "llama")
    model = build_decoder(spec, seed=0).eval()
    ids = torch.from_numpy(rows.input_ids)
    pos, doc = torch.from_numpy(rows.position_ids), torch.from_numpy(rows.doc_ids.astype(np.int64))
    with torch.no_grad():
        packed = model(ids, pos, doc)  # (R, T, H)
        for r in range(len(rows)):
            cu = rows.cu_seqlens(r)
            for a, b in zip(cu[:-1], cu[1:]):
                if rows.doc_ids[r, a] < 0:
                    continue
                alone = model(ids[r : r + 1, a:b])[0]  # plain causal, positions 0..n-1
                torch.testing.assert_close(packed[r, a:b], alone, atol=1e-5, rtol=1e-5)


def test_without_documents_the_decoder_is_the_plain_causal_one():
    spec = make_spec(vocab=40)
    model = build_decoder(spec, seed=0).eval()
    ids = torch.randint(0, 40, (2, 9))
    pos = torch.arange(9).expand(2, 9)
    one_doc = torch.zeros(2, 9, dtype=torch.long)
    with torch.no_grad():
        torch.testing.assert_close(model(ids, pos, one_doc), model(ids), atol=1e-6, rtol=1e-6)


def test_loss_counts_only_the_answers_and_skips_masked_rows(tmp_path):
    convs = tokenized(4, tmp_path)
    rows = pack_conversations(convs, seq_len=256, pad_id=0)
    labels = torch.from_numpy(rows.labels).flatten()
    n_valid = int((labels != -100).sum())
    assert 0 < n_valid < labels.numel() // 2  # prompts and padding are masked
    g = torch.Generator().manual_seed(0)
    n, h, v = labels.numel(), 16, 384
    s_h = torch.randn(n, h, generator=g, requires_grad=True)
    s_w = torch.randn(v, h, generator=g) * 0.3
    t_h, t_w = torch.randn(n, h, generator=g), torch.randn(v, h, generator=g) * 0.3
    seen = []

    def spy(s_logits, t_logits, lab, **kw):
        seen.append(int(lab.numel()))
        from kdistill.ops.kd_loss import chunk_divergence_reference

        return chunk_divergence_reference(s_logits, t_logits, lab, **kw)

    from kdistill.ops.kd_loss import kd_loss

    kw = dict(alpha=0.5, temperature=2.0, divergence="forward_kl", chunk_size=64)
    r = kd_loss(s_h, s_w, t_h, t_w, labels, chunk_fn=spy, **kw)
    assert sum(seen) == n_valid and r.tokens == n_valid  # masked rows never reach the head
    dense = kd_loss_dense(s_h @ s_w.t(), t_h @ t_w.t(), labels, **{k: kw[k] for k in kw if k != "chunk_size"})
    valid = labels != -100
    only = kd_loss_dense(
        (s_h @ s_w.t())[valid], (t_h @ t_w.t())[valid], labels[valid], alpha=0.5, temperature=2.0,
        divergence="forward_kl",
    )  # fmt: skip
    torch.testing.assert_close(r.loss.double(), dense.loss, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(dense.loss, only.loss)
    r.loss.backward()
    gh = s_h.grad
    assert torch.all(gh[~valid] == 0) and gh[valid].abs().sum() > 0
    s2 = s_h.detach().clone().requires_grad_(True)
    kd_loss_dense(
        s2 @ s_w.t(), t_h @ t_w.t(), labels, alpha=0.5, temperature=2.0, divergence="forward_kl"
    ).loss.backward()
    torch.testing.assert_close(gh.double(), s2.grad.double(), atol=1e-6, rtol=1e-5)


def test_batches_of_packed_rows_carry_positions_and_documents(tmp_path):
    rows = pack_conversations(tokenized(5, tmp_path), seq_len=128, pad_id=0)
    ids, labels, pos, doc = Batcher(rows, batch_size=2, seed=0).next()
    assert ids.shape == labels.shape == pos.shape == doc.shape == (2, 128)
    assert all(t.dtype == torch.int64 for t in (ids, labels, pos, doc))
    (first, *_), *_ = list(heldout_batches(rows, 8))
    assert torch.equal(first, torch.from_numpy(rows.input_ids))


def test_plan_covers_document_masked_attention():
    from kdistill.kernels import plan as plan_mod
    from kdistill.kernels import seal
    from kdistill.kernels.contract import check
    from kdistill.train.step import compute_loss, heldout_eval

    t, s = make_spec(hidden=32, vocab=40), make_spec(hidden=24, vocab=40)
    run = make_run(dtype="bfloat16", batch=2, seq=8)
    teacher = build_decoder(t, dtype=torch.bfloat16, seed=0).eval().requires_grad_(False)
    student = build_decoder(s, seed=1)
    ids = torch.randint(0, 40, (2, 8))
    labels = torch.randint(0, 40, (2, 8))
    labels[:, :3] = -100
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0]] * 2)
    doc = torch.tensor([[0, 0, 0, 1, 1, 1, 1, -1]] * 2)
    amp = torch.autocast("cpu", dtype=torch.bfloat16)
    with runtime.using(mode="reference", arch="sm_90"), runtime.recording(deep=True) as rec:
        compute_loss(student, teacher, ids, labels, run, amp, pos, doc).loss.backward()
        heldout_eval(student, teacher, [(ids, labels, pos, doc)], run, torch.device("cpu"), amp, True)
    assert any(k.op == "sdpa" and k.get("masked") for k in rec.keys())
    plan = plan_mod.required_kernels(t, s, run, "sm_90", documents=True)
    warm = seal.prewarm(plan, "cpu", dry=True)
    assert warm.failed == [] and check(rec.launches, plan, warm.specializations) == []
    # Without documents the plan has no masked attention, and the raw path's keys are unchanged.
    assert not any(k.get("masked") for k in plan_mod.required_kernels(t, s, run, "sm_90"))
    assert check(rec.launches, plan_mod.required_kernels(t, s, run, "sm_90")) != []


def test_masked_attention_prewarm_runs_on_cpu():
    from kdistill.kernels import library

    key = library.sdpa_key(
        "sm_90", batch=2, q_heads=4, kv_heads=2, seq=6, head_dim=8, dtype="fp32", grad=True, masked=True
    )
    library.SDPA.warm(key, "cpu", dry=False)  # forward and backward with a two-document mask
    unmasked = library.sdpa_key(
        "sm_90", batch=2, q_heads=4, kv_heads=2, seq=6, head_dim=8, dtype="fp32", grad=True
    )
    assert "masked" not in dict(unmasked.params)


def test_chat_run_finishes_and_its_student_loads_in_transformers(tmp_path, capsys):
    data, template = write_chat_files(tmp_path / "data", n=80)
    cfg = base_config(tmp_path / "run", steps=6, eval_every=3, batch_size=4)
    cfg["data"] = {
        "train": [str(data)],
        "heldout_fraction": 0.2,
        "seq_len": 64,
        "chat_template": str(template),
        "cache_dir": str(assets().cache),
    }
    path = tmp_path / "run.yaml"
    import yaml

    path.write_text(yaml.safe_dump(cfg))
    rc, out, err = run_cli(capsys, "run", str(path), "--quiet")
    assert rc == 0, err
    summary = read_summary(tmp_path / "run")
    assert summary["status"] == "completed" and summary["jit_after_prewarm"] == 0
    d = summary["data"]
    assert d["format"] == "conversations" and 0.5 < d["packing_efficiency"] <= 1.0
    assert d["train_on"] == "assistant" and d["train_learned_tokens"] > 0
    assert summary["heldout"]["student_loss"] is not None
    # the template the run rendered with (data.chat_template) is the exported student's
    assert (tmp_path / "run" / "student" / "chat_template.jinja").read_text(encoding="utf-8") == TEMPLATE
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "student", dtype=torch.float32)
    assert model(input_ids=torch.tensor([[1, 2, 3]])).logits.shape[-1] >= 384


def test_teacher_template_is_used_and_a_mismatch_warns(tmp_path, caplog):
    from kdistill.config import RunConfig
    from kdistill.train.loading import chat_template

    a, b = tmp_path / "t", tmp_path / "s"
    for folder, src in ((a, TEMPLATE), (b, TEMPLATE + " ")):
        folder.mkdir()
        (folder / "chat_template.jinja").write_text(src, encoding="utf-8")
    cfg = RunConfig()
    cfg.teacher.path, cfg.student.path = str(a), str(b)
    with caplog.at_level("WARNING", logger="kdistill"):
        tpl = chat_template(cfg)
    assert tpl.source == TEMPLATE
    assert any(str(a) in r.message and str(b) in r.message for r in caplog.records)


def test_conversations_mixed_with_text_is_one_error(tmp_path, capsys):
    data, template = write_chat_files(tmp_path / "data", n=10)
    (tmp_path / "data" / "notes.txt").write_text("plain text\n", encoding="utf-8")
    from kdistill.data.chat_data import is_conversation_data
    from kdistill.errors import UserError

    with pytest.raises(UserError, match="is not a conversation file but"):
        is_conversation_data([str(tmp_path / "data")])
    assert is_conversation_data([str(data)]) and not is_conversation_data(
        [str(tmp_path / "data" / "notes.txt")]
    )


def test_rope_with_per_token_tables_equals_gathered_reference():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 5, 8, generator=g), torch.randn(2, 2, 5, 8, generator=g)
    cos, sin = torch.randn(2, 5, 8, generator=g), torch.randn(2, 5, 8, generator=g)
    with runtime.using(mode="reference", arch="sm_90"):
        qo, ko = dispatch.apply_rope(q, k, cos, sin)
    from kdistill.ops.rope import rope_reference

    qr, kr = rope_reference(q, k, cos[:, None], sin[:, None])
    torch.testing.assert_close(qo, qr)
    torch.testing.assert_close(ko, kr)


def test_heldout_split_of_conversations_is_by_conversation_and_stable(tmp_path):
    from kdistill.config import DataConfig
    from kdistill.data.chat_data import prepare_chat_data
    from kdistill.models.tokenizer import load_tokenizer

    data, template = write_chat_files(tmp_path / "data", n=40)
    tok = load_tokenizer(assets().teacher)
    tpl = ChatTemplate(source=TEMPLATE, origin=str(template), special_tokens={})
    cfg = DataConfig(train=[str(data)], heldout_fraction=0.25, seq_len=96)
    a = prepare_chat_data(cfg, tok, tpl, seed=0)
    b = prepare_chat_data(cfg, tok, tpl, seed=0)
    assert a.documents and np.array_equal(a.heldout.input_ids, b.heldout.input_ids)
    train_src = {s for row in a.train.sources for s in row}
    held_src = {s for row in a.heldout.sources for s in row}
    assert held_src and not (train_src & held_src) and len(train_src | held_src) == 40
    assert a.stats["packing_efficiency"] == a.train.efficiency and "conversations" in a.summary()


# A think-block template of our own over the tiny tokenizer: the answers after the last user turn show
# their reasoning (the Qwen3 shape); enable_thinking=false closes an empty block in the prompt.
THINK_TEMPLATE = (
    "{% set ns = namespace(last=-1) %}{% for m in messages %}{% if m.role == 'user' %}"
    "{% set ns.last = loop.index0 %}{% endif %}{% endfor %}{% for m in messages %}{{ m.role }}: "
    "{% if m.role == 'assistant' and loop.index0 > ns.last %}<think>{{ m.reasoning_content or '' }}</think>"
    "{% endif %}{{ m.content }}<|endoftext|>\n{% endfor %}{% if add_generation_prompt %}assistant: "
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}{% endif %}"
)


def test_reasoning_run_exports_a_student_that_chats(tmp_path, capsys):
    import shutil

    import yaml
    from transformers import AutoTokenizer

    teacher = tmp_path / "teacher"
    shutil.copytree(assets().teacher, teacher)
    (teacher / "chat_template.jinja").write_text(THINK_TEMPLATE, encoding="utf-8")
    side = {"added_tokens.json": {}, "special_tokens_map.json": {"eos_token": "<|endoftext|>"}}
    side["generation_config.json"] = {"eos_token_id": 0}
    for name, value in side.items():
        if not (teacher / name).is_file():
            (teacher / name).write_text(json.dumps(value), encoding="utf-8")
    rng = np.random.default_rng(0)
    data = tmp_path / "think.jsonl"
    with open(data, "w", encoding="utf-8") as f:
        for _ in range(40):
            q, r, a = (" ".join(rng.choice(WORDS, n)) for n in (4, 6, 3))
            msgs = [
                {"role": "user", "content": q},
                {"role": "assistant", "reasoning_content": r, "content": a},
            ]
            f.write(json.dumps({"messages": msgs}) + "\n")
    cfg = base_config(tmp_path / "run", steps=4, batch_size=4)
    cfg["teacher"]["path"] = str(teacher)
    cfg["data"] = {
        "train": [str(data)],
        "heldout_fraction": 0.2,
        "seq_len": 64,
        "train_on": "last_assistant",
        "template_kwargs": {"enable_thinking": True},
        "cache_dir": str(assets().cache),
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    rc, _, err = run_cli(capsys, "run", str(path), "--quiet")
    assert rc == 0, err
    student = tmp_path / "run" / "student"
    assert (student / "chat_template.jinja").read_text(encoding="utf-8") == THINK_TEMPLATE
    for name in ("tokenizer.json", "tokenizer_config.json", *side):
        assert (student / name).read_bytes() == (teacher / name).read_bytes(), name
    assert AutoTokenizer.from_pretrained(student).chat_template == THINK_TEMPLATE
    rc, out, err = run_cli(
        capsys,
        "generate",
        "--model",
        str(student),
        "--prompt",
        "the fox",
        "--chat",
        "--max-new-tokens",
        "4",
        "--device",
        "cpu",
        "--json",
    )
    assert rc == 0, err
    assert len(json.loads(out)["token_ids"]) >= 1
