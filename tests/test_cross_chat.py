"""Conversations across tokenizers (kd.cross_tokenizer over conversation files): a Llama-3-style teacher
(its own byte-level BPE, a header-token template) and a Qwen2-style ChatML student (another BPE trained
on other text), built by tests/cross_chat_tiny.py.

- Each model renders the conversation with its own template; the learned messages are the same in both
  and every learned student position is paired with the teacher position before the same text (the one
  before each answer with the teacher's, the one before the end-of-turn with the teacher's).
- The loss of packed rows through the production source equals a dense reference written here: both
  models (transformers' own) on each conversation alone, full logits, the ULD formula with sorted lists.
- `kdistill run` distils conversations end to end, exports the student with its own tokenizer and
  template, and a SIGKILLed run resumes to the same losses and weights; the kernel plan covers the step.

Run: .venv/bin/python -m pytest tests/test_cross_chat.py -q
"""

from __future__ import annotations

import contextlib
import json
import math

import numpy as np
import pytest
import torch
import yaml

from kdistill.config import RunConfig
from kdistill.data.chat import Conversation
from kdistill.data.chat_template import load_chat_template
from kdistill.data.cross_chat import T_IDS, T_PAIR, align_conversation, fit_row, offset_map, pack_aligned
from kdistill.errors import UserError
from kdistill.models.tokenizer import load_tokenizer
from tests.cross_chat_tiny import conversations, cross_pair, write_conversations
from tests.test_train_kit import read_summary, run_cli, run_proc, student_weights


def _conv(record: dict, source: str = "chats.jsonl:1") -> Conversation:
    msgs = tuple(record["messages"])
    return Conversation(messages=msgs, train=tuple(m["role"] == "assistant" for m in msgs), source=source)


def _sides():
    p = cross_pair()
    s_tok, t_tok = load_tokenizer(p.student), load_tokenizer(p.teacher)
    return load_chat_template(p.student), s_tok, load_chat_template(p.teacher), t_tok


def test_offsets_map_one_to_one_on_equal_text_and_through_matching_blocks():
    assert offset_map("Paris.", "Paris.").tolist() == list(range(7))
    m = offset_map("xyParis", "Paris")  # a lead the other rendering does not write maps onto its start
    assert m.tolist() == [0, 0, 0, 1, 2, 3, 4, 5]
    m = offset_map("ab-cd", "abcd")
    assert m[2] == 2 and m[5] == 4 and (np.diff(m) >= 0).all()


def test_each_model_renders_its_own_template_and_the_same_answers_pair_up():
    s_tpl, s_tok, t_tpl, t_tok = _sides()
    record = {
        "messages": [
            {"role": "user", "content": "what is the capital of france?"},
            {"role": "assistant", "content": "paris"},
            {"role": "user", "content": "two plus two?"},
            {"role": "assistant", "content": "four thanks"},
        ]
    }
    ac = align_conversation(_conv(record), s_tpl, s_tok, t_tpl, t_tok)
    s_ids, t_ids = ac.student.input_ids.tolist(), ac.teacher_ids.tolist()
    assert s_tok.decode(s_ids).startswith("<|im_start|>user\nwhat is")
    assert t_tok.decode(t_ids).startswith("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nwhat")
    learned = [i for i in range(len(s_ids) - 1) if ac.student.trained[i + 1]]
    assert learned and all(ac.pairs[i] >= 0 for i in learned)
    assert all(ac.pairs[i] < 0 for i in range(len(s_ids)) if i not in learned)
    im_end, eot = s_tok.token_to_id("<|im_end|>"), t_tok.token_to_id("<|eot_id|>")
    _, s_ends = s_tok.encode_offsets(ac.student.text)
    t_text = t_tok.decode(t_ids)
    _, t_ends = t_tok.encode_offsets(t_text)
    answers = ["paris", "four thanks"]
    for answer in answers:
        # the answer's learned positions: from the one ending the generation prompt through the one
        # before the end-of-turn, each paired with the teacher's position before the same text
        s_at = ac.student.text.index("<|im_start|>assistant\n" + answer) + len("<|im_start|>assistant\n")
        t_at = t_text.index("assistant<|end_header_id|>\n\n" + answer) + len("assistant<|end_header_id|>\n\n")
        mine = [i for i in learned if s_at <= s_ends[i] <= s_at + len(answer)]
        assert s_ends[mine[0]] == s_at and t_ends[ac.pairs[mine[0]]] == t_at
        last = mine[-1]
        assert s_ids[last + 1] == im_end and t_ids[ac.pairs[last] + 1] == eot
        for i in mine:  # where the teacher has a token ending at the same point of the answer, that one
            rel = s_ends[i] - s_at
            if t_at + rel in t_ends:
                assert t_ends[ac.pairs[i]] == t_at + rel
            else:  # else the nearest
                near = min(abs(e - (t_at + rel)) for e in t_ends)
                assert abs(t_ends[ac.pairs[i]] - (t_at + rel)) == near
        assert len(mine) == len(s_tok.encode(answer)) + 1  # every answer token and the end-of-turn


def test_a_conversation_longer_than_a_row_is_cut_on_both_sides():
    from kdistill.data.align import vocab_map

    s_tpl, s_tok, t_tpl, t_tok = _sides()
    ac = align_conversation(
        _conv(conversations(2)[1]), s_tpl, s_tok, t_tpl, t_tok, vmap=vocab_map(s_tok, t_tok)
    )
    seq_len = len(ac.student.input_ids) - 5
    fitted, cut = fit_row(ac, seq_len)
    assert cut and len(fitted.student.input_ids) == seq_len and len(fitted.teacher_ids) <= seq_len
    learned = np.flatnonzero(fitted.student.labels(-100) != -100)
    assert len(learned) and (fitted.pairs[learned] >= 0).all() and (fitted.pairs[learned] < seq_len).all()
    assert (fitted.pairs[learned] == ac.pairs[learned]).all() and ac.exact.any()
    assert (fitted.exact[learned] == ac.exact[learned]).all() and not fitted.exact[fitted.pairs < 0].any()
    assert int(fitted.pairs.max()) == len(fitted.teacher_ids) - 1  # the teacher side ends at its last partner


def test_train_on_all_is_refused_across_tokenizers():
    s_tpl, s_tok, t_tpl, t_tok = _sides()
    with pytest.raises(UserError, match="data.train_on=all cannot be aligned across tokenizers"):
        align_conversation(_conv(conversations(1)[0]), s_tpl, s_tok, t_tpl, t_tok, train_on="all")


def _dense_uld(s_logits: torch.Tensor, t_logits: torch.Tensor, temperature: float) -> float:
    q = sorted(torch.softmax(s_logits / temperature, -1).tolist(), reverse=True)
    p = sorted(torch.softmax(t_logits / temperature, -1).tolist(), reverse=True)
    v = max(len(p), len(q))
    q, p = q + [0.0] * (v - len(q)), p + [0.0] * (v - len(p))
    return sum(abs(a - b) for a, b in zip(p, q))


def _dense_exact(
    s_logits: torch.Tensor, t_logits: torch.Tensor, vmap: np.ndarray, t: float, div: str
) -> float:
    """The exact term at one position: D over the shared tokens (same text) plus one bucket for the rest."""
    q, p = torch.softmax(s_logits / t, -1).tolist(), torch.softmax(t_logits / t, -1).tolist()
    s_idx = [i for i in range(len(vmap)) if vmap[i] >= 0]
    qb, pb = [q[i] for i in s_idx], [p[int(vmap[i])] for i in s_idx]
    qb, pb = qb + [1 - sum(qb)], pb + [1 - sum(pb)]
    a, b = (pb, qb) if div == "forward_kl" else (qb, pb)
    return sum(x * math.log(x / y) for x, y in zip(a, b) if x > 0)


@pytest.mark.parametrize("divergence", ["forward_kl", "reverse_kl"])
def test_loss_of_packed_conversations_equals_a_dense_reference(divergence):
    from kdistill.data.align import vocab_map
    from kdistill.data.batches import take
    from kdistill.models.hf_io import load_model
    from kdistill.train.cross_tok import CrossTokenizer
    from kdistill.train.targets import CrossChatTargets, MicroBatch, batch_loss
    from tests.tiny import load_hf

    p = cross_pair()
    s_tpl, s_tok, t_tpl, t_tok = _sides()
    vmap = vocab_map(s_tok, t_tok)
    convs = [_conv(r, f"c:{i}") for i, r in enumerate(conversations(9))]
    seq_len = 80
    rows = pack_aligned(convs, s_tpl, s_tok, t_tpl, t_tok, seq_len, vmap=vmap)
    assert any(len(m) > 1 for m in rows.members)  # rows hold several conversations
    cfg = RunConfig()
    cfg.kd.cross_tokenizer, cfg.kd.alpha, cfg.kd.temperature, cfg.kd.chunk_size = True, 0.6, 2.0, 7
    cfg.kd.divergence, cfg.kd.uld_weight, cfg.kd.exact_weight = divergence, 0.7, 1.5
    teacher = load_model(p.teacher, device=torch.device("cpu"), dtype=torch.float32).eval()
    student = load_model(p.student, device=torch.device("cpu"), dtype=torch.float32)
    source = CrossChatTargets(teacher, CrossTokenizer(s_tok, t_tok, 256, rows=rows, vmap=vmap))
    idx = np.arange(min(3, len(rows)))
    ids, labels, pos, doc = take(rows, idx)
    batch = MicroBatch(ids, labels, pos, doc, cached=source.fetch(idx, None, torch.device("cpu")))
    got = batch_loss(student, batch, source, cfg, contextlib.nullcontext())

    # dense: each conversation alone through transformers' own models, full logits
    hf_s, hf_t = load_hf(p.student), load_hf(p.teacher)
    ce, uld, exact, n, n_exact = 0.0, 0.0, 0.0, 0, 0
    for r in idx:
        for k in rows.members[r]:
            ac, _ = fit_row(align_conversation(convs[k], s_tpl, s_tok, t_tpl, t_tok, vmap=vmap), seq_len)
            s_ids = torch.as_tensor(ac.student.input_ids)[None]
            t_ids = torch.as_tensor(ac.teacher_ids)[None]
            with torch.no_grad():
                s_logits, t_logits = hf_s(s_ids).logits[0], hf_t(t_ids).logits[0]
            for i in np.flatnonzero(ac.student.labels(-100) != -100):
                target = int(ac.student.input_ids[i + 1])
                ce -= float(torch.log_softmax(s_logits[i].double(), -1)[target])
                uld += _dense_uld(s_logits[i].double(), t_logits[ac.pairs[i]].double(), 2.0)
                if ac.exact[i]:
                    s_i, t_j = s_logits[i].double(), t_logits[ac.pairs[i]].double()
                    exact += _dense_exact(s_i, t_j, vmap, 2.0, divergence)
                    n_exact += 1
                n += 1
    assert n == got.tokens == int((labels != -100).sum())
    assert 0 < n_exact < n  # some positions map one to one, not all
    kd = 0.7 * uld / n + 1.5 * 4.0 * exact / n
    assert math.isclose(float(got.ce), ce / n, rel_tol=1e-5)
    assert math.isclose(float(got.kd), kd, rel_tol=1e-5)
    assert math.isclose(float(got.loss.detach()), 0.4 * ce / n + 0.6 * kd, rel_tol=1e-5)
    # the teacher rows of the batch lay out each conversation's own teacher tokens
    first = rows.members[0][0]
    ac, _ = fit_row(align_conversation(convs[first], s_tpl, s_tok, t_tpl, t_tok, vmap=vmap), seq_len)
    assert rows.teacher[0, T_IDS, : len(ac.teacher_ids)].tolist() == ac.teacher_ids.tolist()
    assert rows.teacher[0, T_PAIR, : len(ac.pairs)].tolist() == ac.pairs.tolist()


def _config(tmp_path, steps: int = 6, **schedule) -> dict:
    p = cross_pair()
    data = write_conversations(tmp_path / "data" / "chats.jsonl", 48)
    return {
        "teacher": {"path": str(p.teacher)},
        "student": {"path": str(p.student)},
        "data": {"train": [str(data)], "heldout_fraction": 0.2, "seq_len": 96},
        "kd": {"cross_tokenizer": True, "alpha": 0.5, "temperature": 1.0, "chunk_size": 32},
        "optim": {"lr": 3e-3, "warmup_steps": 1},
        "schedule": {
            "steps": steps, "batch_size": 2, "eval_every": 3, "eval_batches": 1, "checkpoint_every": 0,
            "seed": 0, **schedule,
        },
        "output": {"dir": str(tmp_path / "run")},
        "runtime": {"device": "cpu"},
    }  # fmt: skip


def test_a_cross_tokenizer_run_on_conversations_distils_and_exports_the_students_own_format(
    tmp_path, capsys, caplog
):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(_config(tmp_path)))
    with caplog.at_level("WARNING"):
        rc, _, err = run_cli(capsys, "run", str(path), "--quiet")
    assert rc == 0, err
    assert not any("template" in r.getMessage() for r in caplog.records)  # no teacher-template warning
    s = read_summary(tmp_path / "run")
    assert s["status"] == "completed" and s["final_loss"] < s["initial_loss"]
    assert s["data"]["format"] == "conversations" and s["data"]["train_learned_tokens"] > 0
    assert s["jit_after_prewarm"] == 0 and s["heldout"]["student_loss"] is not None
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(0 < r["kd"] <= 2 for r in rows)  # the ULD term, bounded by 2
    out, p = tmp_path / "run" / "student", cross_pair()
    assert (out / "tokenizer.json").read_bytes() == (p.student / "tokenizer.json").read_bytes()
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in config["chat_template"] and "<|start_header_id|>" not in config["chat_template"]


def test_a_killed_cross_tokenizer_conversation_run_resumes_to_the_same_losses_and_weights(tmp_path):
    def metrics(run_dir):
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in rows]

    straight, killed = tmp_path / "a", tmp_path / "b"
    for d in (straight, killed):
        d.mkdir()
        (d / "run.yaml").write_text(yaml.safe_dump(_config(d, steps=5, checkpoint_every=2, eval_every=0)))
    r = run_proc(["run", str(straight / "run.yaml"), "--quiet"], timeout=180)
    assert r.returncode == 0, r.stderr
    r = run_proc(["run", str(killed / "run.yaml"), "--quiet"], timeout=180, KDISTILL_TEST_KILL_AT="3")
    assert r.returncode != 0 and not (killed / "run" / "summary.json").exists()
    r = run_proc(["run", "--resume", str(killed / "run"), "--quiet"], timeout=180)
    assert r.returncode == 0, r.stderr
    assert metrics(killed / "run") == metrics(straight / "run")
    a = student_weights(straight / "run" / "student" / "model.safetensors")
    b = student_weights(killed / "run" / "student" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_memory_plan_counts_the_uld_term_over_both_vocabularies():
    import dataclasses

    from kdistill.memory import estimate_memory
    from kdistill.models.spec import load_spec

    teacher, student = load_spec("llama-3.2-1b"), load_spec("qwen2.5-0.5b")
    cfg = RunConfig()
    # a batch whose forward outweighs the optimizer phase: the forward's terms are the plan's
    cfg.schedule.batch_size, cfg.data.seq_len, cfg.kd.chunk_size = 8, 4096, 1024
    same = estimate_memory(teacher, student, cfg)
    cfg.kd.cross_tokenizer = True
    cross = estimate_memory(teacher, student, cfg)
    # each model's fp32 logits, softmax and sorted copy at least, over its own vocabulary
    assert cross["loss_chunk_logits"] >= 1024 * (student.vocab_size + teacher.vocab_size) * 4 * 3
    assert cross["loss_chunk_logits"] > same["loss_chunk_logits"]
    assert cross["teacher_aligned_rows"] == 8 * 4096 * teacher.hidden_size * 4
    wider = dataclasses.replace(teacher, vocab_size=2 * teacher.vocab_size)
    assert estimate_memory(wider, student, cfg)["loss_chunk_logits"] > cross["loss_chunk_logits"]


@pytest.mark.parametrize("dtype, alpha, sharded", [("float32", 0.5, False), ("bfloat16", 1.0, True)])
def test_the_kernel_plan_covers_a_conversation_step_across_tokenizers(dtype, alpha, sharded):
    """The teacher runs on its own packed rows of data.seq_len tokens, documents masked: every key the
    step and its held-out eval launch is planned and prewarmed (none is left to lazy warming)."""
    from kdistill.data.batches import take
    from kdistill.kernels import contract, runtime
    from kdistill.kernels import plan as plan_mod
    from kdistill.kernels import seal as cache
    from kdistill.models.decoder import build_decoder
    from kdistill.train.cross_tok import CrossTokenizer
    from kdistill.train.step import heldout_eval
    from kdistill.train.targets import CrossChatTargets, MicroBatch, batch_loss
    from tests.test_contract import TORCH, make_run, make_spec

    s_tpl, s_tok, t_tpl, t_tok = _sides()
    arch, seq = "sm_90", 40
    run = make_run(dtype=dtype, batch=2, seq=seq, alpha=alpha, chunk=8)
    run.kd.cross_tokenizer = True
    rows = pack_aligned(
        [_conv(r, f"c:{i}") for i, r in enumerate(conversations(6))], s_tpl, s_tok, t_tpl, t_tok, seq
    )
    teacher_spec = make_spec(
        "llama", hidden=48, inter=64, heads=6, tied=False, vocab=t_tok.vocab_size, llama3=True
    )
    student_spec = make_spec(vocab=s_tok.vocab_size)
    prec = plan_mod.precision(run, arch, sharded)
    teacher = (
        build_decoder(teacher_spec, dtype=TORCH[prec.teacher_weights], seed=0).eval().requires_grad_(False)
    )
    student = build_decoder(student_spec, dtype=TORCH[prec.student_weights], seed=1)
    source = CrossChatTargets(teacher, CrossTokenizer(s_tok, t_tok, 256, rows=rows))
    idx = np.arange(2)
    batch = take(rows, idx)
    amp = torch.autocast("cpu", dtype=TORCH[prec.compute], enabled=prec.autocast)
    with runtime.using(mode="reference", arch=arch), runtime.recording(deep=True) as rec:
        micro = MicroBatch(*batch, cached=source.fetch(idx, None, torch.device("cpu")))
        batch_loss(student, micro, source, run, amp).loss.backward()
        heldout_eval(student, None, [batch], run, torch.device("cpu"), amp, with_teacher_loss=True)
    plan = plan_mod.required_kernels(teacher_spec, student_spec, run, arch, documents=True, sharded=sharded)
    warm = cache.prewarm(plan, "cpu", dry=True)
    assert warm.failed == []
    teacher_sdpa = [k for k in rec.keys() if k.op == "sdpa" and k["HQ"] == 6]
    assert teacher_sdpa and all(k["T"] == seq and not k["grad"] for k in teacher_sdpa)  # rows of seq_len
    assert contract.check(rec.launches, plan, warm.specializations) == []


def test_conversations_across_tokenizers_refuse_train_on_all_and_a_student_without_a_template(
    tmp_path, capsys
):
    import shutil

    from tests.test_train_kit import one_error_line

    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(_config(tmp_path, steps=2)))
    rc, _, err = run_cli(capsys, "run", str(path), "data.train_on=all", "--quiet")
    assert rc == 2 and one_error_line(err).startswith("data.train_on=all cannot be aligned across tokenizers")
    bare = tmp_path / "bare-student"  # the student's files, its template taken out
    shutil.copytree(cross_pair().student, bare)
    config = json.loads((bare / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    rc, _, err = run_cli(
        capsys, "run", str(path), f"student.path={bare}", "output.dir=" + str(tmp_path / "r2"), "--quiet"
    )
    assert rc == 2 and one_error_line(err).startswith(f"{bare}: no chat template")


def test_an_answer_one_template_rewrites_is_aligned_through_its_matching_text():
    """The teacher's template trims the answer (` four ` -> `four`), the student's does not: the student's
    positions still meet the teacher's at the answer's start, its text and its end-of-turn."""
    s_tpl, s_tok, t_tpl, t_tok = _sides()
    record = {
        "messages": [{"role": "user", "content": "two plus two?"}, {"role": "assistant", "content": " four "}]
    }
    ac = align_conversation(_conv(record), s_tpl, s_tok, t_tpl, t_tok)
    s_ids, t_ids = ac.student.input_ids.tolist(), ac.teacher_ids.tolist()
    assert "<|im_start|>assistant\n four <|im_end|>" in ac.student.text
    assert t_tok.decode(t_ids).endswith("<|end_header_id|>\n\nfour<|eot_id|>")
    learned = [i for i in range(len(s_ids) - 1) if ac.student.trained[i + 1]]
    _, t_ends = t_tok.encode_offsets(t_tok.decode(t_ids))
    t_start = t_tok.decode(t_ids).rindex("\n\nfour") + 2
    assert t_ends[ac.pairs[learned[0]]] == t_start  # both before the answer
    assert s_ids[learned[-1] + 1] == s_tok.token_to_id("<|im_end|>")
    assert t_ids[ac.pairs[learned[-1]] + 1] == t_tok.token_to_id("<|eot_id|>")  # both before the end-of-turn
    assert all(a <= b for a, b in zip(ac.pairs[learned], ac.pairs[learned][1:]))  # in order


def _completion_side(rows, where, seq_len: int = 96):
    from kdistill.data.align import vocab_map
    from kdistill.data.cross_chat import CompletionSide

    p = cross_pair()
    s_tok, t_tok = load_tokenizer(p.student), load_tokenizer(p.teacher)
    stops = {s_tok.token_to_id("<|im_end|>")}
    return CompletionSide(
        where, stops, s_tok, load_chat_template(p.teacher), t_tok, None, seq_len, vocab_map(s_tok, t_tok)
    )


def test_a_completion_written_as_the_data_has_it_is_aligned_as_the_data_is():
    """On-policy across tokenizers: a completion whose tokens are the student's own tokenization of the
    data's answer (then its end-of-turn) is paired and marked exact as the conversation itself is."""
    from kdistill.data.align import vocab_map
    from kdistill.data.cross_chat import cross_prompt_pool

    s_tpl, s_tok, t_tpl, t_tok = _sides()
    vmap = vocab_map(s_tok, t_tok)
    record = {
        "messages": [
            {"role": "user", "content": "two plus two?"},
            {"role": "assistant", "content": "four thanks paris"},
        ]
    }
    rows = pack_aligned([_conv(record)], s_tpl, s_tok, t_tpl, t_tok, 96, vmap=vmap)
    prompts, where = cross_prompt_pool(rows)
    (_, ac), prompt = rows.aligned[0], prompts[0]
    assert where[0][1] == 1 and ac.student.input_ids[: len(prompt)].tolist() == prompt
    completion = ac.student.input_ids[len(prompt) :].tolist()  # the answer, <|im_end|>, "\n"
    t_ids, pairs, exact = _completion_side(rows, where).row(0, completion)
    learned = np.arange(len(prompt) - 1, len(prompt) - 1 + len(completion) - 1)  # "\n" after the stop: none
    assert (
        t_ids[: len(ac.teacher_ids)].tolist() == ac.teacher_ids.tolist()
    )  # the data's: cut at its last partner
    assert pairs[:-1].tolist() == ac.pairs[learned].tolist()
    assert exact[:-1].tolist() == ac.exact[learned].tolist() and exact[:-1].any()


def test_a_completion_in_other_tokens_pairs_by_its_text_and_is_exact_only_where_the_tokens_agree():
    from kdistill.data.cross_chat import cross_prompt_pool

    s_tpl, s_tok, t_tpl, t_tok = _sides()
    record = {"messages": [{"role": "user", "content": "hello?"}, {"role": "assistant", "content": "fine"}]}
    rows = pack_aligned([_conv(record)], s_tpl, s_tok, t_tpl, t_tok, 96)
    _, where = cross_prompt_pool(rows)
    side = _completion_side(rows, where)
    text = " paris four"
    chars = [s_tok.encode(c)[0] for c in text]  # one token per character: not the student's own merges
    im_end = s_tok.token_to_id("<|im_end|>")
    t_ids, pairs, exact = side.row(0, chars + [im_end])
    t_text = t_tok.decode(t_ids.tolist())
    assert t_text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\nparis four<|eot_id|>")  # trimmed
    _, t_ends = t_tok.encode_offsets(t_text)
    start = t_text.rindex("\n\nparis four") + 2
    assert t_ends[pairs[0]] == start  # the first character: predicted where the teacher's answer begins
    assert t_ids[pairs[-1] + 1] == t_tok.token_to_id(
        "<|eot_id|>"
    )  # the stop: before the teacher's end-of-turn
    for c, tok in enumerate(chars):  # exact: the same point, and the teacher's next token is this character
        j = pairs[c]
        want = j + 1 < len(t_ids) and t_tok.decode([int(t_ids[j + 1])]) == s_tok.decode([tok])
        rel = len(text[:c].lstrip())  # where this character starts in the trimmed answer
        want = want and t_ends[j] == start + rel and t_ends[j + 1] == start + rel + len(text[c].strip())
        assert bool(exact[c]) == bool(want), c
    assert not exact[-1]  # <|im_end|> and <|eot_id|> are not the same text


def test_on_policy_across_tokenizers_refuses_teacher_completions_and_the_sampled_loss():
    from kdistill.config import load_config

    base = {"kd": {"cross_tokenizer": True, "on_policy": 0.5, "seq_kd": 0.5, "max_new_tokens": 4}}
    with pytest.raises(UserError, match="kd.seq_kd and kd.cross_tokenizer cannot be combined"):
        load_config(None, base=base).validate(need_paths=False)
    base = {
        "kd": {
            "cross_tokenizer": True,
            "on_policy": 1.0,
            "on_policy_loss": "sampled_reverse_kl",
            "max_new_tokens": 4,
        }
    }
    with pytest.raises(UserError, match="kd.on_policy_loss=sampled_reverse_kl and kd.cross_tokenizer"):
        load_config(None, base=base).validate(need_paths=False)
    with pytest.raises(UserError, match="kd.exact_weight is -1.0, expected a finite number >= 0"):
        load_config(None, base={"kd": {"exact_weight": -1.0}}).validate(need_paths=False)


def test_an_on_policy_run_across_tokenizers_resumes_after_a_kill_to_the_same_samples_and_weights(tmp_path):
    def metrics(run_dir):
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        drop = ("tokens_per_s", "gen_s", "score_s", "update_s", "phase_s")  # timings
        return [{k: v for k, v in r.items() if k not in drop} for r in rows]

    straight, killed = tmp_path / "a", tmp_path / "b"
    for d in (straight, killed):
        d.mkdir()
        cfg = _config(d, steps=4, checkpoint_every=2, eval_every=0)
        cfg["kd"].update(on_policy=0.7, max_new_tokens=12, divergence="reverse_kl")
        (d / "run.yaml").write_text(yaml.safe_dump(cfg))
    r = run_proc(["run", str(straight / "run.yaml"), "--quiet"], timeout=180)
    assert r.returncode == 0, r.stderr
    r = run_proc(["run", str(killed / "run.yaml"), "--quiet"], timeout=180, KDISTILL_TEST_KILL_AT="3")
    assert r.returncode != 0 and not (killed / "run" / "summary.json").exists()
    r = run_proc(["run", "--resume", str(killed / "run"), "--quiet"], timeout=180)
    assert r.returncode == 0, r.stderr
    rows = metrics(straight / "run")
    assert {r.get("policy", "data") for r in rows} == {"on_policy", "data"}  # both kinds of steps ran
    assert metrics(killed / "run") == rows
    s = read_summary(straight / "run")
    assert s["on_policy"]["on_policy_steps"] >= 1 and s["on_policy"]["sample_kl"] > 0
    a = student_weights(straight / "run" / "student" / "model.safetensors")
    b = student_weights(killed / "run" / "student" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(
    "divergence", ["forward_kl", "reverse_kl", "jsd", "tvd", "skew_kl", "skew_reverse_kl"]
)
def test_the_exact_term_has_the_gradient_of_its_value(divergence):
    """The exact term (K shared tokens plus a rest bucket) is differentiated by autograd through the
    divergence's formula: its gradient matches finite differences for every kd.divergence."""
    from kdistill.train.cross_tok import SharedVocab, exact_rows

    vmap = np.array([2, -1, 0, 5, -1, 1, -1], dtype=np.int64)  # 4 of 7 student tokens shared
    shared = SharedVocab.of(vmap, teacher_vocab=6)
    cfg = RunConfig()
    cfg.kd.divergence, cfg.kd.temperature = divergence, 1.5
    g = torch.Generator().manual_seed(0)
    s = torch.randn(3, 7, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.randn(3, 6, generator=g, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda x: exact_rows(x, t, shared, cfg), (s,), eps=1e-6, atol=1e-6)
    assert (exact_rows(s, t, shared, cfg) >= -1e-12).all()


def test_the_kernel_plan_covers_an_on_policy_step_across_tokenizers():
    """An on-policy step across tokenizers: the teacher scores the student's completions on its own rows
    of data.seq_len tokens, the student trains on them: every key launched is planned and prewarmed."""
    from kdistill.data.align import vocab_map
    from kdistill.data.cross_chat import CompletionSide, cross_prompt_pool
    from kdistill.kernels import contract, runtime
    from kdistill.kernels import plan as plan_mod
    from kdistill.kernels import seal as cache
    from kdistill.models.decoder import build_decoder
    from kdistill.train.cross_tok import CrossTokenizer
    from kdistill.train.onpolicy import completion_rows
    from kdistill.train.targets import CrossChatTargets, MicroBatch, batch_loss
    from tests.test_contract import TORCH, make_run, make_spec

    s_tpl, s_tok, t_tpl, t_tok = _sides()
    arch, seq = "sm_90", 40
    run = make_run(dtype="bfloat16", batch=2, seq=seq, alpha=1.0, chunk=8)
    run.kd.cross_tokenizer, run.kd.on_policy, run.kd.max_new_tokens = True, 1.0, 8
    vmap = vocab_map(s_tok, t_tok)
    rows = pack_aligned(
        [_conv(r, f"c:{i}") for i, r in enumerate(conversations(4))], s_tpl, s_tok, t_tpl, t_tok, seq
    )
    prompts, where = cross_prompt_pool(rows)
    cross = CrossTokenizer(s_tok, t_tok, 256, rows=rows, vmap=vmap)
    cross.completions = CompletionSide(
        where, {s_tok.token_to_id("<|im_end|>")}, s_tok, t_tpl, t_tok, None, seq, vmap
    )
    completions = [s_tok.encode(" paris four"), s_tok.encode(" two") + [s_tok.token_to_id("<|im_end|>")]]
    ids, labels = completion_rows(prompts[:2], completions, seq, 0, -100)
    teacher_spec = make_spec(
        "llama", hidden=48, inter=64, heads=6, tied=False, vocab=t_tok.vocab_size, llama3=True
    )
    student_spec = make_spec(vocab=s_tok.vocab_size)
    prec = plan_mod.precision(run, arch, False)
    teacher = (
        build_decoder(teacher_spec, dtype=TORCH[prec.teacher_weights], seed=0).eval().requires_grad_(False)
    )
    student = build_decoder(student_spec, dtype=TORCH[prec.student_weights], seed=1)
    source = CrossChatTargets(teacher, cross)
    amp = torch.autocast("cpu", dtype=TORCH[prec.compute], enabled=prec.autocast)
    with runtime.using(mode="reference", arch=arch), runtime.recording(deep=True) as rec:
        micro = MicroBatch(ids, labels, cached=source.generated([0, 1], labels, torch.device("cpu")))
        batch_loss(student, micro, source, run, amp).loss.backward()
    plan = plan_mod.required_kernels(teacher_spec, student_spec, run, arch, documents=True)
    warm = cache.prewarm(plan, "cpu", dry=True)
    assert warm.failed == []
    teacher_sdpa = [k for k in rec.keys() if k.op == "sdpa" and k["HQ"] == 6]
    assert teacher_sdpa and all(k["T"] == seq and not k["grad"] for k in teacher_sdpa)
    assert contract.check(rec.launches, plan, warm.specializations) == []
