"""What the student says during a run: samples.jsonl at each held-out eval, shown by `kdistill report`.

- A chat run writes, at each eval, the student's greedy answers to fixed held-out prompts (each
  conversation up to its first answer) and the teacher's once; the last eval's answers equal what
  generation from the exported student gives.
- A raw-text run uses the first tokens of held-out rows; schedule.sample_prompts=0 writes nothing.
- The answers come from the decode engine and equal the eager oracle's (tests/oracle_decode.py); the
  run's kernel plan holds every key the samples' engines launch and its memory plan their weights and
  caches.
- `kdistill report` prints the latest samples beside the teacher's, and --json carries them.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import yaml

from kdistill.data.chat import Conversation, tokenize_conversation
from kdistill.data.chat_pack import pack_conversations
from kdistill.data.chat_template import ChatTemplate
from kdistill.decode import Sampling
from kdistill.models.hf_io import load_model
from kdistill.models.tokenizer import load_tokenizer
from kdistill.samples import sample_prompts
from tests.oracle_decode import generate_ids
from tests.test_chat_train import TEMPLATE, write_chat_files
from tests.test_train_kit import assets, base_config, read_summary, run_cli


def read_rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_chat_run_writes_samples_and_report_shows_them(tmp_path, capsys):
    data, template = write_chat_files(tmp_path / "data", n=60)
    cfg = base_config(
        tmp_path / "run", steps=4, eval_every=2, batch_size=4, sample_prompts=3, sample_tokens=5
    )
    cfg["data"] = {
        "train": [str(data)],
        "heldout_fraction": 0.2,
        "seq_len": 64,
        "chat_template": str(template),
        "cache_dir": str(assets().cache),
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    rc, _, err = run_cli(capsys, "run", str(path), "--quiet")
    assert rc == 0, err
    assert read_summary(tmp_path / "run")["jit_after_prewarm"] == 0
    rows = read_rows(tmp_path / "run" / "samples.jsonl")
    student = [r for r in rows if r["model"] == "student"]
    teacher = [r for r in rows if r["model"] == "teacher"]
    assert [r["step"] for r in student] == [2, 2, 2, 4, 4, 4]
    assert [r["step"] for r in teacher] == [2, 2, 2]
    assert [r["prompt"] for r in teacher] == [r["prompt"] for r in student[:3]]
    # each conversation up to its first learned token (a token that straddles the header is not learned)
    assert all(r["prompt"].rsplit("\n", 1)[-1].startswith("assistant:") for r in student)
    assert all(1 <= len(r["answer_ids"]) <= 5 for r in rows)
    # the last eval's answers are what generation from the exported student gives
    tok = load_tokenizer(tmp_path / "run" / "student")
    model = load_model(tmp_path / "run" / "student").eval()
    prompts = [tok.encode(r["prompt"]) for r in student[3:]]
    want = generate_ids(model, prompts, Sampling(max_new_tokens=5), {tok.eos_id}, pad_id=tok.eos_id)
    assert [r["answer_ids"] for r in student[3:]] == want

    rc, out, _ = run_cli(capsys, "report", str(tmp_path / "run"))
    assert rc == 0
    assert out.count("(student at step 4)") == 3 and out.count("  teacher  ") == 3
    rc, out, _ = run_cli(capsys, "report", str(tmp_path / "run"), "--json")
    samples = json.loads(out)["samples"]
    assert len(samples) == 3 and samples[0]["teacher"] == teacher[0]["answer"]
    assert samples[0]["student"] == student[3]["answer"]


def test_raw_text_run_samples_and_off_switch(tmp_path, capsys):
    for n, sub in ((2, "on"), (0, "off")):
        cfg = base_config(tmp_path / sub, steps=2, eval_every=0, sample_prompts=n, sample_tokens=4)
        path = tmp_path / f"{sub}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        rc, _, err = run_cli(capsys, "run", str(path), "--quiet")
        assert rc == 0, err
    rows = read_rows(tmp_path / "on" / "samples.jsonl")
    assert [(r["model"], r["step"]) for r in rows] == [("student", 2)] * 2 + [("teacher", 2)] * 2
    tok = load_tokenizer(assets().teacher)
    assert all(len(tok.encode(r["prompt"])) <= 16 for r in rows)
    assert not (tmp_path / "off" / "samples.jsonl").exists()
    rc, out, _ = run_cli(capsys, "report", str(tmp_path / "off"))
    assert rc == 0 and "sample 1" not in out


def test_sample_prompts_of_packed_conversations():
    tok = load_tokenizer(assets().teacher)
    tpl = ChatTemplate(TEMPLATE, "t")
    convs = [
        Conversation(
            messages=({"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}),
            train=(False, True),
            source=f"x:{i}",
        )
        for i in range(3)
    ]
    tokenized = [tokenize_conversation(c, tpl, tok) for c in convs]
    rows = pack_conversations(tokenized, seq_len=64, pad_id=0)
    prompts = sample_prompts(rows, 2)
    for i, p in enumerate(prompts):  # up to the first learned token, whatever the header's last token is
        row = rows.input_ids[0]
        start = int(np.flatnonzero(rows.doc_ids[0] == i)[0])
        first = start + int(np.flatnonzero(rows.labels[0][start:] != -100)[0])
        assert p == row[start : first + 1].tolist()
        assert tok.decode(p).startswith(f"user: q{i}<|endoftext|>\nassistant:")
    raw = np.arange(40).reshape(2, 20)
    assert sample_prompts(raw, 5) == [list(range(9)), list(range(20, 29))]


def test_sample_settings_are_validated():
    import pytest

    from kdistill.config import ScheduleConfig
    from kdistill.errors import UserError

    with pytest.raises(UserError, match="schedule.sample_tokens is 0, expected a positive number"):
        ScheduleConfig(sample_tokens=0).validate()
    with pytest.raises(UserError, match="schedule.sample_prompts is -1, expected 0 or a positive integer"):
        ScheduleConfig(sample_prompts=-1).validate()
    ScheduleConfig(sample_prompts=0).validate()


def test_a_runs_samples_are_the_engines_greedy_answers_equal_to_the_oracle(tmp_path):
    """answer_rows writes with the decode engine (on the CPU: eager, the model's own fp32 weights) the
    oracle's greedy tokens, each row's stop token last in its ids and left out of its text; the model's
    weights and mode are untouched."""
    from kdistill.samples import answer_rows
    from tests.tiny import make_tiny_model, sample_ids

    model = load_model(make_tiny_model(tmp_path, family="qwen3")).train()
    v = model.spec.vocab_size
    prompts = [sample_ids(v, 1, n, seed=n)[0].add(1).clamp(max=v - 1).tolist() for n in (3, 16, 1, 9)]
    free = generate_ids(model, prompts, Sampling(max_new_tokens=6))
    stops = {free[0][2]}
    before = {n: p.clone() for n, p in model.state_dict().items()}
    rows = answer_rows(model, prompts, 6, stops, lambda ids: " ".join(map(str, ids)), max_len=64)
    want = generate_ids(model, prompts, Sampling(max_new_tokens=6), stops, pad_id=min(stops))
    assert [r["answer_ids"] for r in rows] == want
    assert rows[0]["answer_ids"][-1] in stops and rows[0]["answer"] == " ".join(map(str, want[0][:-1]))
    assert [r["prompt"] for r in rows] == [" ".join(map(str, p)) for p in prompts]
    assert model.training and all(torch.equal(p, before[n]) for n, p in model.state_dict().items())


@pytest.mark.parametrize("head_dim", [16, 32])
def test_the_run_plan_holds_every_key_its_samples_launch(head_dim):
    """On a GPU a run's samples are bf16 decode engines of the student and the teacher: their Triton keys,
    recorded on the CPU's reference path, are all in the run's kernel plan (prewarmed, then sealed), and
    a plan without samples lacks some of them."""
    from kdistill.config import RunConfig
    from kdistill.kernels import plan as plan_mod
    from kdistill.kernels import runtime
    from kdistill.models.decoder import build_decoder
    from kdistill.samples import answer_rows
    from tests.test_contract import make_spec

    t_spec = make_spec(hidden=64, inter=96, heads=4, kv=2, head_dim=head_dim, vocab=60)
    s_spec = make_spec(hidden=32, inter=48, heads=2, kv=1, head_dim=head_dim, vocab=60)
    cfg = RunConfig()
    cfg.data.seq_len, cfg.schedule.batch_size = 24, 2
    cfg.schedule.sample_prompts, cfg.schedule.sample_tokens = 3, 5
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11]]
    launched = set()
    for spec, seed in ((s_spec, 1), (t_spec, 0)):
        model = build_decoder(spec, dtype=torch.bfloat16, seed=seed)
        with runtime.using(mode="reference", arch="sm_90"), runtime.recording() as rec:
            answer_rows(model, prompts, 5, {0}, str, max_len=cfg.data.seq_len + 1 + 5)
        launched |= {k for k in rec.keys() if not k.is_library}
    ops = {k.op for k in launched}
    assert "decode_attn_split" in ops and "decode_attn_combine" not in ops  # the last split combines
    assert launched <= plan_mod.required_kernels(t_spec, s_spec, cfg, "sm_90")
    cfg.schedule.sample_prompts = 0
    assert not launched <= plan_mod.required_kernels(t_spec, s_spec, cfg, "sm_90")


def test_the_memory_plan_counts_the_sample_engines():
    """On a GPU the samples' engines are in the memory plan: the student's (all its weights in bf16) at
    each eval, beside a captured step's pool; the teacher's (its stacked q/k/v and gate/up) once before
    the first step; none on a CPU, under torchrun or with schedule.sample_prompts=0."""
    from kdistill.config import RunConfig
    from kdistill.memory import (
        Layout,
        StepShape,
        engine_weights,
        estimate_memory,
        generation_memory,
        sample_engine_memory,
    )
    from kdistill.models.spec import load_spec

    t, s = load_spec("qwen2.5-7b"), load_spec("qwen2.5-1.5b")
    cfg = RunConfig()
    cfg.schedule.batch_size, cfg.data.seq_len = 1, 512
    cfg.schedule.sample_prompts, cfg.schedule.sample_tokens = 64, 1024
    slots = 512 + 1 + 1024
    student, teacher = sample_engine_memory(StepShape.of(t, s, cfg))
    assert student == engine_weights(s, full=True) + generation_memory([s], 64, slots, 2)
    assert teacher == engine_weights(t, full=False) + generation_memory([t], 64, slots, 2)
    assert sample_engine_memory(StepShape.of(t, s, cfg, device="cpu")) == (0, 0)
    assert sample_engine_memory(StepShape.of(t, s, cfg, layout=Layout(world=2))) == (0, 0)
    graphed = estimate_memory(t, s, cfg)  # a small step: the engines outgrow its activations
    assert graphed["sample_engine"] == teacher and graphed["eval_beside_graph_pool"] == student
    cfg.runtime.cuda_graphs = "off"
    assert estimate_memory(t, s, cfg)["sample_engine"] == max(student, teacher)
    cfg.schedule.sample_prompts = 0
    assert sample_engine_memory(StepShape.of(t, s, cfg)) == (0, 0)
    assert "sample_engine" not in estimate_memory(t, s, cfg)
