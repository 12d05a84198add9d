"""On-policy distillation: the student writes completions of the data's prompts and the teacher grades them.

- A generated step's loss and gradient equal the dense formula computed here on the sampled tokens,
  for every divergence (kd.alpha = 1 over the full vocabulary at the completion positions, normalised
  by the completion tokens) and for the sampled reverse KL (policy-gradient form).
- Rollouts: the generator's state reproduces the tokens; rows stop at a stop token; the prompt's
  labels are masked.
- A run with kd.on_policy = 0 is bit-identical to one without the on-policy settings; a run with
  kd.on_policy = 1 reports its phases and samples; bad settings are one-line errors.
- A run killed mid-way and resumed ends with the same weights and metrics as an uninterrupted one.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import yaml

from kdistill.config import DIVERGENCES, RunConfig
from kdistill.memory import Layout, engine_weights, estimate_memory
from kdistill.models.decoder import build_decoder
from kdistill.models.lora import apply_lora, has_lora
from kdistill.ops.kd_loss import kd_loss_dense
from kdistill.train import distributed as dist
from kdistill.train import onpolicy
from kdistill.train.onpolicy import OnPolicy, completion_rows, generated_accumulate
from kdistill.train.rollouts import Rollout, RolloutSampling, rollout
from kdistill.train.step import StepContext
from tests.test_chat_train import TEMPLATE, write_chat_files
from tests.test_contract import make_spec
from tests.test_train_kit import (
    assert_same_weights,
    assets,
    base_config,
    final_weights,
    one_error_line,
    read_summary,
    run_cli,
    run_proc,
)

VOCAB = 40
PROMPTS = [[1, 2, 3, 4], [5, 6], [7, 8, 9], [3, 1]]


def _pair():
    teacher = build_decoder(make_spec(hidden=32, vocab=VOCAB), seed=0).eval().requires_grad_(False)
    student = build_decoder(make_spec(hidden=24, vocab=VOCAB), seed=1)
    return teacher, student


def _cfg(divergence: str = "reverse_kl", loss: str = "divergence", temperature: float = 1.5) -> RunConfig:
    cfg = RunConfig()
    cfg.data.seq_len = 12
    cfg.schedule.batch_size, cfg.schedule.grad_accum = 2, 2
    kd = cfg.kd
    kd.divergence, kd.on_policy_loss, kd.temperature, kd.alpha = divergence, loss, temperature, 0.3
    kd.on_policy, kd.max_new_tokens, kd.chunk_size = 1.0, 6, 5  # chunks split the rows
    kd.samples_per_prompt = 2
    return cfg.validate(need_paths=False)


def _step(cfg: RunConfig, teacher, student):
    """One on-policy step's accumulation, and the rows it trained on (drawn again from the same seed)."""
    op = OnPolicy(cfg, PROMPTS, stop_ids={0}, pad_id=0, device=torch.device("cpu"))
    again = OnPolicy(cfg, PROMPTS, stop_ids={0}, pad_id=0, device=torch.device("cpu"))
    opt = torch.optim.AdamW(student.parameters())
    ctx = StepContext(cfg, student, teacher, opt, torch.device("cpu"), contextlib.nullcontext(), None)
    student.zero_grad()
    means, tokens, stats, _ = generated_accumulate(ctx, op, 0, "on_policy")
    micro, out = again.generate(student, contextlib.nullcontext())
    return means, tokens, stats, micro, out


def _dense_grads(student, teacher, micro, cfg, loss_fn):
    """The dense loss per micro-batch, backward of their mean: (losses, the student's gradients)."""
    student.zero_grad()
    losses = []
    for ids, labels in micro:
        s_logits = student.logits(ids).flatten(0, 1)  # (N, V)
        with torch.no_grad():
            t_logits = teacher.logits(ids).flatten(0, 1)
        loss = loss_fn(s_logits, t_logits, labels.flatten())
        (loss / len(micro)).backward()
        losses.append(float(loss.detach()))
    return losses, {n: p.grad.clone() for n, p in student.named_parameters()}


@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_on_policy_divergence_equals_the_dense_formula_on_the_samples(divergence):
    cfg = _cfg(divergence)
    teacher, student = _pair()
    means, tokens, stats, micro, out = _step(cfg, teacher, student)
    got = {n: p.grad.clone() for n, p in student.named_parameters()}
    assert tokens == out.tokens == sum(int((lab != -100).sum()) for _, lab in micro)
    assert stats.completions == 4  # 2 micro-batches of 2 rows: 2 prompts, 2 samples each

    def dense(s, t, y):  # alpha = 1 on generated steps: the divergence alone, T^2 D(p_T || q_T)
        return kd_loss_dense(
            s, t, y, alpha=1.0, temperature=1.5, divergence=divergence, beta=cfg.kd.beta
        ).loss

    losses, want = _dense_grads(student, teacher, micro, cfg, dense)
    torch.testing.assert_close(means[:, 0], torch.tensor(losses, dtype=torch.float64), atol=1e-5, rtol=1e-5)
    for name in want:
        torch.testing.assert_close(got[name], want[name].float(), atol=1e-6, rtol=1e-4, msg=name)


def test_sampled_reverse_kl_equals_the_policy_gradient_formula():
    cfg = _cfg(loss="sampled_reverse_kl")
    teacher, student = _pair()
    means, _, _, micro, _ = _step(cfg, teacher, student)
    got = {n: p.grad.clone() for n, p in student.named_parameters()}
    kd_means = []

    def dense(s, t, y):
        valid = y != -100
        yy = y.clamp(min=0)[:, None]
        logq = (s.double() / 1.5).log_softmax(-1).gather(1, yy).squeeze(1)[valid]
        logp = (t.double() / 1.5).log_softmax(-1).gather(1, yy).squeeze(1)[valid]
        adv = (logq - logp).detach()  # the per-token reverse KL of the sampled token, as the advantage
        kd_means.append(float(adv.mean()))
        return (adv * logq).sum() / valid.sum()

    losses, want = _dense_grads(student, teacher, micro, cfg, dense)
    torch.testing.assert_close(means[:, 0], torch.tensor(losses, dtype=torch.float64), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(means[:, 2], torch.tensor(kd_means, dtype=torch.float64), atol=1e-5, rtol=1e-5)
    for name in want:
        torch.testing.assert_close(got[name], want[name].float(), atol=1e-6, rtol=1e-4, msg=name)


def test_rollout_is_reproduced_from_the_generator_state_and_stops_at_a_stop_token():
    _, student = _pair()
    gen = torch.Generator().manual_seed(3)
    state = gen.get_state()
    sampling = RolloutSampling(max_new_tokens=8, temperature=1.0)
    first = rollout(student, PROMPTS, sampling, {0}, gen)
    gen.set_state(state)
    assert rollout(student, PROMPTS, sampling, {0}, gen).completions == first.completions
    assert student.training  # put back in train mode
    greedy = rollout(student, PROMPTS, RolloutSampling(8, 0.0), set(), None)
    stop = greedy.completions[0][2]  # the third greedy token of the first row becomes a stop token
    stopped = rollout(student, PROMPTS, RolloutSampling(8, 0.0), {stop}, None)
    row = stopped.completions[0]
    assert stopped.stopped[0] and row[-1] == stop and stop not in row[:-1] and len(row) <= 3
    for c, s in zip(stopped.completions, stopped.stopped):
        assert (c[-1] == stop) == s and all(t != stop for t in c[:-1])


def test_a_rollout_is_the_oracles_greedy_decoding_and_a_kept_engine_follows_the_weights():
    """rollout writes with the decode engine on the CPU too: the greedy completions and stops of the
    left-padded eager oracle (tests/oracle_decode.py), with or without a kept engine; reproducible from
    the generator state when sampling; a kept engine sees the model's new weights after an update."""
    from kdistill.decode import Sampling
    from tests.oracle_decode import generate_ids

    _, student = _pair()
    stop = generate_ids(student, PROMPTS, Sampling(max_new_tokens=8))[1][3]
    want = generate_ids(student, PROMPTS, Sampling(max_new_tokens=8), {stop})
    alone = rollout(student, PROMPTS, RolloutSampling(8, 0.0), {stop}, None)
    assert alone.completions == want and alone.stopped == [r[-1] == stop for r in want]
    engines: dict = {}
    gen = torch.Generator().manual_seed(0)
    got = rollout(student, PROMPTS, RolloutSampling(8, 0.0), {stop}, gen, engines=engines, max_len=40)
    assert got == alone and list(engines) == [id(student)]
    state = gen.get_state()
    a = rollout(student, PROMPTS, RolloutSampling(8, 1.0), {stop}, gen, engines=engines, max_len=40)
    gen.set_state(state)
    assert rollout(student, PROMPTS, RolloutSampling(8, 1.0), {stop}, gen, engines=engines, max_len=40) == a
    with torch.no_grad():
        for p in student.parameters():
            p.mul_(1.5)  # an "update"
    fresh = generate_ids(student, PROMPTS, Sampling(max_new_tokens=8), {stop})
    again = rollout(student, PROMPTS, RolloutSampling(8, 0.0), {stop}, gen, engines=engines, max_len=40)
    assert again.completions == fresh != want


@pytest.mark.parametrize("temperature", [1e-9, 5e-324, 0.99e-5])
def test_a_tiny_positive_temperature_is_greedy_on_every_sampling_path(temperature):
    """Below decode.MIN_TEMPERATURE a temperature is greedy in the decode engine, whether a rollout
    keeps its engine or not, as in the oracle, instead of dividing the logits by almost nothing."""
    from kdistill.decode import Sampling
    from tests.oracle_decode import generate_ids

    _, student = _pair()
    greedy = rollout(student, PROMPTS, RolloutSampling(8, 0.0), set(), None)
    gen = torch.Generator().manual_seed(0)
    assert rollout(student, PROMPTS, RolloutSampling(8, temperature), set(), gen) == greedy
    engines: dict = {}
    got = rollout(student, PROMPTS, RolloutSampling(8, temperature), set(), gen, engines=engines, max_len=40)
    assert got == greedy
    want = generate_ids(student.eval(), PROMPTS, Sampling(max_new_tokens=8), set())
    assert generate_ids(student, PROMPTS, Sampling(max_new_tokens=8, temperature=temperature), set()) == want
    assert want == greedy.completions


def test_completion_rows_label_the_completion_only():
    ids, labels = completion_rows(
        [[1, 2, 3], [4]], [[7, 8], [9, 5, 6]], seq_len=6, pad_id=0, ignore_index=-100
    )
    assert ids.tolist() == [[1, 2, 3, 7, 0, 0], [4, 9, 5, 0, 0, 0]]
    assert labels.tolist() == [[-100, -100, 7, 8, -100, -100], [9, 5, 6, -100, -100, -100]]


def test_memory_plan_has_a_generation_phase():
    t, s = make_spec(hidden=64, vocab=5000), make_spec(hidden=32, vocab=5000)
    cfg = _cfg()
    cfg.schedule.batch_size, cfg.schedule.grad_accum = 64, 4
    eager = dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, cuda_graphs="off"))
    off = estimate_memory(t, s, dataclasses.replace(eager, kd=dataclasses.replace(cfg.kd, on_policy=0.0)))
    on = estimate_memory(t, s, eager)
    assert on["total"] > off["total"] and "generation_kv_cache_and_logits" in on
    # a run that captures its update writes beside the captured step's pool: both are counted
    captured = estimate_memory(t, s, cfg)
    assert captured["generation_beside_graph_pool"] >= on["generation_kv_cache_and_logits"]
    assert captured["total"] > on["total"]


def test_memory_plan_counts_the_gathered_writers_under_torchrun():
    t, s = make_spec(hidden=64, vocab=5000), make_spec(hidden=32, vocab=5000)
    cfg = _cfg()
    cfg.kd.seq_kd = 0.5
    sharded, replicated = Layout(world=2, teacher_sharded=True), Layout(world=2, teacher_sharded=False)
    # GPU: the engines' bf16 weights, a sharded teacher's all of them (gathered), a replicated one's stacked
    # q/k/v and gate/up only (the rest is its own weights)
    full = estimate_memory(t, s, cfg, batch=1, layout=sharded)["decode_engine_weights"]
    part = estimate_memory(t, s, cfg, batch=1, layout=replicated)["decode_engine_weights"]
    assert full == engine_weights(s, full=True) + engine_weights(t, full=True)
    assert part == engine_weights(s, full=True) + engine_weights(t, full=False) < full
    # CPU: the gathered fp32 copies of the sharded writers (the engine of each shares its tensors)
    cpu = estimate_memory(t, s, cfg, "cpu", batch=1, layout=sharded)
    assert cpu["gathered_writers"] == (s.param_counts()["total"] + t.param_counts()["total"]) * 4
    assert "gathered_writers" not in estimate_memory(t, s, cfg, "cpu", batch=2)  # one process: none


def _fake_rollout(model, prompts, sampling, stop_ids, generator, **kwargs):
    """Completions of unequal lengths that depend on the prompt alone (any split of the rows over
    processes writes the same ones)."""
    comps = [[(sum(p) + j) % VOCAB for j in range(1 + sum(p) % sampling.max_new_tokens)] for p in prompts]
    return Rollout(comps, [len(c) < sampling.max_new_tokens for c in comps])


@pytest.mark.parametrize("loss", ["divergence", "sampled_reverse_kl"])
def test_processes_weigh_their_losses_by_their_share_of_all_completion_tokens(monkeypatch, loss):
    """Under torchrun each process trains on its rows of every micro-batch; its loss is weighted by its
    share of the micro-batch's completion tokens over all processes. Two processes emulated in one: each
    runs the step on its rows with the collectives answered by the sums over both, and the average of
    their gradients (FSDP's reduce-scatter) and their combined means equal one process's on every row."""
    cfg = _cfg(loss=loss)
    cfg.kd.samples_per_prompt = 1  # two prompts per micro-batch: one per process
    teacher, base = _pair()
    cpu, amp = torch.device("cpu"), contextlib.nullcontext()
    monkeypatch.setattr(onpolicy, "rollout", _fake_rollout)

    def run(rows=None):
        student = copy.deepcopy(base)
        ctx = StepContext(cfg, student, teacher, torch.optim.AdamW(student.parameters()), cpu, amp, rows)
        op = OnPolicy(cfg, PROMPTS, stop_ids={0}, pad_id=0, device=cpu, rows=rows)
        means, tokens, stats, stops = generated_accumulate(ctx, op, 0, "on_policy")
        return means, tokens, stats, stops, {n: p.grad for n, p in student.named_parameters()}

    want_means, want_tokens, want_stats, _, want = run()
    micro, out = OnPolicy(cfg, PROMPTS, {0}, 0, cpu).generate(base, amp)
    counts = [int((lab != -100).sum()) for _, lab in micro]
    # the counts, samples and (last) the processes asked to stop, summed over both
    sums = [float(c) for c in counts] + [out.tokens, len(out.completions), sum(out.stopped), 0.0]
    given = []
    monkeypatch.setattr(dist, "all_reduce_sum", lambda values: list(sums))
    monkeypatch.setattr(dist, "all_reduce_tensor", lambda t: given.append(t.clone()) or t)
    ranks = []
    for rank in (0, 1):
        monkeypatch.setattr(dist, "_INFO", dist.DistInfo(rank, 2, rank, None))
        ranks.append(run(dist.batch_slice(cfg.schedule.batch_size)))
    mine = [g[:-1, 3].tolist() for g in given]  # each process's completion tokens per micro-batch
    assert mine[0] != mine[1] and [a + b for a, b in zip(*mine)] == counts  # unequal shares: weights != 1
    both = given[0] + given[1]
    torch.testing.assert_close(both[:-1, :3] / both[:-1, 3:], want_means, atol=1e-6, rtol=1e-6)
    for stats in (ranks[0][2], ranks[1][2]):  # every process reports the samples of all
        assert (stats.completion_tokens, stats.completions, stats.eos) == (
            want_stats.completion_tokens, want_stats.completions, want_stats.eos,
        )  # fmt: skip
    assert float(ranks[0][1] + ranks[1][1]) == want_tokens  # each its own, summed by the all-reduce
    assert float(both[-1, 0]) == 0  # no process asked to stop
    for name in want:
        torch.testing.assert_close(
            (ranks[0][4][name] + ranks[1][4][name]) / 2, want[name], atol=1e-7, rtol=1e-5
        )


def test_a_replicated_students_captured_form_weighs_and_sums_as_the_eager_step(monkeypatch):
    """The generated step in the form a CUDA graph captures (a fixed-row KD head) under torchrun with a
    whole student on every process: each process's loss weighted by its share of the completion tokens
    (an input of the graph), its logged means weighted so that their sum over the processes (the
    captured all-reduce) is the mean over every row, and the average of its gradients (GradAverage) the
    gradient of one process over every row. Two processes emulated in one, each step run eagerly in
    that form (a CPU StepGraph never captures); the update itself is left out (`_packed` returns the
    means it is given)."""
    from kdistill.train import step as step_mod
    from kdistill.train.graph import StepGraph

    cfg = _cfg(loss="divergence")
    cfg.kd.samples_per_prompt = 1  # two prompts per micro-batch: one per process
    teacher, base = _pair()
    cpu, amp = torch.device("cpu"), contextlib.nullcontext()
    monkeypatch.setattr(onpolicy, "rollout", _fake_rollout)
    monkeypatch.setattr(step_mod, "MIN_FILL", 0.0)  # the fixed-row form whatever the completions' fill
    monkeypatch.setattr(step_mod, "_packed", lambda ctx, means: means)

    def run(rows=None):
        student = copy.deepcopy(base)
        ctx = StepContext(cfg, student, teacher, torch.optim.AdamW(student.parameters()), cpu, amp, rows)
        op = OnPolicy(cfg, PROMPTS, stop_ids={0}, pad_id=0, device=cpu, rows=rows)
        graph = StepGraph(cpu)
        means, tokens, _, stop = step_mod._generated_graphed(ctx, graph, op, 0, "on_policy")
        assert graph.counts["eager_steps"] == 1 and graph.graph is None
        return means, tokens, stop, {n: p.grad for n, p in student.named_parameters()}

    want_means, want_tokens, _, want = run()
    micro, out = OnPolicy(cfg, PROMPTS, {0}, 0, cpu).generate(base, amp)
    counts = [int((lab != -100).sum()) for _, lab in micro]
    sums = [float(c) for c in counts] + [out.tokens, len(out.completions), sum(out.stopped), 1.0]
    monkeypatch.setattr(dist, "all_reduce_sum", lambda values: list(sums))  # one process asked to stop
    given = []
    monkeypatch.setattr(dist, "all_reduce_tensor", lambda t: given.append(t.clone()) or t)
    ranks = []
    for rank in (0, 1):
        monkeypatch.setattr(dist, "_INFO", dist.DistInfo(rank, 2, rank, None))
        ranks.append(run(dist.batch_slice(cfg.schedule.batch_size)))
    assert len(given) == 2  # one all-reduce of the means a step, inside the captured body
    torch.testing.assert_close(ranks[0][0] + ranks[1][0], want_means, atol=1e-6, rtol=1e-6)
    assert ranks[0][1] == ranks[1][1] == want_tokens == sum(counts)  # every process's total
    assert ranks[0][2] and ranks[1][2]  # one process's stop request reaches both
    for name in want:
        torch.testing.assert_close(
            (ranks[0][3][name] + ranks[1][3][name]) / 2, want[name], atol=1e-7, rtol=1e-5
        )


def test_gathered_copy_writes_as_the_model_with_its_adapters_merged():
    """The eager path's writer under torchrun (distributed.gathered_copy; here of an unsharded model, whose
    parameters are whole already): a plain decoder whose logits are the LoRA model's, refreshed in place."""
    _, student = _pair()
    apply_lora(student, rank=2, alpha=4, dropout=0.0, targets=["q_proj", "v_proj", "down_proj"])
    with torch.no_grad():
        for name, p in student.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)  # adapters that change the output
    ids = torch.tensor([PROMPTS[0] * 2])
    plain = dist.gathered_copy(student)
    assert not has_lora(plain)
    torch.testing.assert_close(plain.logits(ids), student.logits(ids), atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        student.model.norm.weight.mul_(2.0)
    assert dist.gathered_copy(student, into=plain) is plain
    torch.testing.assert_close(plain.logits(ids), student.logits(ids), atol=1e-5, rtol=1e-5)


def test_a_checkpoint_of_other_processes_samples_from_a_new_deterministic_stream(caplog):
    cfg = _cfg()
    cpu = torch.device("cpu")
    saved = OnPolicy(cfg, PROMPTS, {0}, 0, cpu).state_dict()
    mine = saved.pop("generator")
    saved["generators"] = [mine, mine]  # as two processes write it
    states = []
    for _ in range(2):
        op = OnPolicy(cfg, PROMPTS, {0}, 0, cpu)
        op.load_state_dict(saved)
        states.append(op.generator.get_state())
    assert torch.equal(states[0], states[1]) and not torch.equal(
        states[0], torch.tensor(mine, dtype=torch.uint8)
    )
    assert "sampling generators of 2 process(es), this run has 1" in caplog.text
    one = OnPolicy(cfg, PROMPTS, {0}, 0, cpu)
    one.load_state_dict({**saved, "generators": [mine]})  # as many processes: exactly the saved state
    assert one.generator.get_state().tolist() == mine


# -- whole runs --------------------------------------------------------------------------------------
def _run_config(root: Path, **kd) -> dict:
    data, template = write_chat_files(root / "data", n=40)
    cfg = base_config(root / "run", steps=4, batch_size=4, grad_accum=1)
    cfg["data"] = {
        "train": [str(data)],
        "heldout_fraction": 0.2,
        "seq_len": 40,
        "chat_template": str(template),
    }
    cfg["kd"].update(temperature=1.0, divergence="reverse_kl", **kd)
    cfg["schedule"]["sample_prompts"] = 0
    return cfg


def _write(root: Path, cfg: dict, name: str = "run.yaml") -> Path:
    path = root / name
    path.write_text(yaml.safe_dump(cfg))
    return path


def _metrics(run_dir: Path, drop=("tokens_per_s", "gen_s", "score_s", "update_s", "phase_s")) -> list[dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in drop} for r in rows]


def test_lambda_zero_is_the_off_policy_run_and_lambda_one_reports_its_phases(tmp_path, capsys):
    cfg = _run_config(tmp_path)
    rc, _, err = run_cli(capsys, "run", str(_write(tmp_path, cfg)), "--quiet")
    assert rc == 0, err
    cfg["output"]["dir"] = str(tmp_path / "zero")
    cfg["kd"].update(on_policy=0.0, max_new_tokens=8, samples_per_prompt=2, sample_temperature=0.7)
    rc, _, err = run_cli(capsys, "run", str(_write(tmp_path, cfg, "zero.yaml")), "--quiet")
    assert rc == 0, err
    assert _metrics(tmp_path / "run", ("tokens_per_s",)) == _metrics(tmp_path / "zero", ("tokens_per_s",))
    assert_same_weights(final_weights(tmp_path / "run"), final_weights(tmp_path / "zero"))
    assert "on_policy" not in read_summary(tmp_path / "zero")

    cfg["output"]["dir"] = str(tmp_path / "one")
    cfg["kd"].update(on_policy=1.0)
    rc, _, err = run_cli(capsys, "run", str(_write(tmp_path, cfg, "one.yaml")), "--quiet")
    assert rc == 0, err
    rows = _metrics(tmp_path / "one", ())
    assert all(r["policy"] == "on_policy" and r["completions"] == 4 for r in rows)
    assert all(1 <= r["completion_len"] <= 8 and 0 <= r["eos_fraction"] <= 1 for r in rows)
    assert all(r["gen_s"] > 0 and r["score_s"] > 0 and r["update_s"] >= 0 for r in rows)
    for r in rows:  # one process: its own phases, no wait for another
        phases = r["phase_s"]
        assert list(phases) == ["generate", "wait", "score", "update"]
        assert phases["generate"] == [r["gen_s"]] and phases["wait"] == [0.0]
        assert phases["score"] == [r["score_s"]] and phases["update"] == [r["update_s"]]
    assert all(r["sample_kl"] == r["kd"] and r["loss"] == r["kd"] for r in rows)  # alpha = 1: the KL alone
    summary = read_summary(tmp_path / "one")
    op = summary["on_policy"]
    assert summary["status"] == "completed" and op["on_policy_steps"] == 4 and op["seq_kd_steps"] == 0
    assert op["mean_completion_len"] == pytest.approx(sum(r["completion_len"] for r in rows) / 4)
    assert summary["jit_after_prewarm"] == 0


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("kd.on_policy=1.5", "kd.on_policy is 1.5, expected a number in [0, 1]"),
        ("kd.on_policy=-0.1", "kd.on_policy is -0.1, expected a number in [0, 1]"),
        ("kd.seq_kd=2", "kd.seq_kd is 2.0, expected a number in [0, 1]"),
        ("kd.max_new_tokens=0", "kd.max_new_tokens is 0, expected a positive number"),
        (
            "kd.on_policy_loss=ppo",
            "kd.on_policy_loss is 'ppo', expected one of: divergence, sampled_reverse_kl",
        ),
        ("kd.max_new_tokens=40", "kd.max_new_tokens is 40, expected fewer than data.seq_len (40)"),
        ("teacher.cache=somewhere", "kd.on_policy needs a live teacher, but teacher.cache is set"),
    ],
)
def test_bad_on_policy_settings_are_one_line_errors(tmp_path, capsys, override, expected):
    cfg = _run_config(tmp_path, on_policy=1.0, max_new_tokens=8)
    rc, _, err = run_cli(capsys, "run", str(_write(tmp_path, cfg)), override, "--quiet")
    assert rc == 2 and expected in one_error_line(err), err
    assert "Traceback" not in err


def test_raw_text_prompts_are_the_first_half_of_each_window(tmp_path, capsys):
    """Raw text has no answers: an on-policy prompt is the first half of a training window (the
    completion continues that text), read from the windows as drawn; a run trains on them."""
    import numpy as np

    windows = np.arange(5 * 13).reshape(5, 13)
    pool = onpolicy.prompt_pool(windows)
    assert len(pool) == 5 and pool[3] == list(range(39, 45)) and pool[1:3] == [pool[1], pool[2]]
    cfg = base_config(tmp_path / "run", steps=2)
    cfg["kd"].update(on_policy=1.0, max_new_tokens=8)
    rc, _, err = run_cli(capsys, "run", str(_write(tmp_path, cfg)), "--quiet")
    assert rc == 0, err
    rows = _metrics(tmp_path / "run", ())
    assert [r["policy"] for r in rows] == ["on_policy"] * 2 and all(r["completion_len"] >= 1 for r in rows)
    assert read_summary(tmp_path / "run")["jit_after_prewarm"] == 0


def _prepared(root: Path, train_on: str, template: str = TEMPLATE, prompts: bool = True):
    from kdistill.config import DataConfig
    from kdistill.data.chat_data import prepare_chat_data
    from kdistill.data.chat_template import ChatTemplate
    from kdistill.models.tokenizer import load_tokenizer

    data, _ = write_chat_files(root, n=30)
    cfg = DataConfig(train=[str(data)], heldout_fraction=0.2, seq_len=256, train_on=train_on)
    tok = load_tokenizer(assets().teacher)
    return prepare_chat_data(cfg, tok, ChatTemplate(template, "t"), prompts=prompts), tok


def test_on_policy_prompts_are_the_conversation_up_to_its_answer_whatever_train_on(tmp_path):
    """data.train_on=all learns every token, so the first learned token no longer marks the answer:
    the prompts of generated steps and of the run's samples are still each conversation up to its
    first answer, the answer's generation prompt ("assistant: ") included, as with train_on=assistant."""
    from kdistill.samples import sample_prompts

    want, tok = _prepared(tmp_path / "a", "assistant")
    got, _ = _prepared(tmp_path / "b", "all")
    assert got.train.learned_tokens() > want.train.learned_tokens()  # every token learned
    pool = onpolicy.prompt_pool(got.train)
    assert sorted(pool) == sorted(onpolicy.prompt_pool(want.train))
    assert all(len(p) > 1 and tok.decode(p).rsplit("\n", 1)[-1].startswith("assistant:") for p in pool)
    assert sample_prompts(got.heldout, 5) == sample_prompts(want.heldout, 5)


def test_a_template_that_renders_no_answer_gives_prompts_of_the_first_half(tmp_path):
    """A template whose answers cannot be located (the reason to train on all) prompts with the first
    half of each conversation's tokens, never a single token."""
    silent = "{% for m in messages %}{% if m['role'] != 'assistant' %}{{ m['content'] }}{% endif %}{{ m['role'] }}\n{% endfor %}"
    got, _ = _prepared(tmp_path, "all", silent)
    docs = got.train.doc_ids
    assert got.train.truncated == 0 and all(len(p) > 1 for p in onpolicy.prompt_pool(got.train))
    lengths = [int((docs[r] == d).sum()) for r in range(len(docs)) for d in range(int(docs[r].max()) + 1)]
    assert sorted(len(p) for p in onpolicy.prompt_pool(got.train)) == sorted(max(1, n // 2) for n in lengths)


def test_the_rollouts_end_of_turn_stop_is_rendered_with_the_template_kwargs(tmp_path):
    """A template that needs a variable renders its end-of-turn token only with data.template_kwargs:
    the stop of generated steps comes from that rendering."""
    from kdistill.data.chat_template import ChatTemplate
    from kdistill.models.tokenizer import load_tokenizer

    needs = (
        "{% if eot is not defined %}{{ raise_exception('eot is needed') }}{% endif %}"
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{{ eot }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    tok = load_tokenizer(assets().teacher)
    eot = "<|endoftext|>"
    cfg = RunConfig()
    cfg.teacher.path = str(assets().teacher)
    cfg.data.template_kwargs = {"eot": eot}
    stops = onpolicy.rollout_stop_ids(cfg, tok, ChatTemplate(needs, "t"))
    assert tok.token_to_id(eot) in stops
    cfg.data.template_kwargs = {"eot": "<|im_end|>"}  # a token the tokenizer lacks: no end-of-turn stop
    cfg.teacher.path = str(tmp_path)  # no config.json: no EOS ids from it
    assert onpolicy.rollout_stop_ids(cfg, tok, ChatTemplate(needs, "t")) <= {tok.eos_id}


def test_killed_and_resumed_on_policy_run_matches_uninterrupted(tmp_path):
    cfg = _run_config(tmp_path, on_policy=0.5, seq_kd=0.5, max_new_tokens=6)
    cfg["schedule"].update(steps=6, checkpoint_every=3, grad_accum=2)
    path = _write(tmp_path, cfg)
    base, cut = tmp_path / "base", tmp_path / "cut"
    with ThreadPoolExecutor(2) as pool:
        a = pool.submit(run_proc, ["run", str(path), f"output.dir={base}", "--quiet"], 240)
        b = pool.submit(
            run_proc, ["run", str(path), f"output.dir={cut}", "--quiet"], 240, KDISTILL_TEST_KILL_AT="5"
        )
        assert a.result().returncode == 0, a.result().stderr
        assert b.result().returncode != 0  # killed after step 5; its newest checkpoint is step 3
    r = run_proc(["run", "--resume", str(cut), "--quiet"], 240)
    assert r.returncode == 0 and "resuming from" in r.stderr, r.stderr
    assert_same_weights(final_weights(base), final_weights(cut))
    rows = _metrics(base)
    assert rows == _metrics(cut)
    assert {r.get("policy", "data") for r in rows} == {"on_policy", "seq_kd", "data"}
    s_base, s_cut = read_summary(base)["on_policy"], read_summary(cut)["on_policy"]
    for k in ("on_policy_steps", "seq_kd_steps", "mean_completion_len", "eos_fraction", "sample_kl"):
        assert s_base[k] == s_cut[k], k


def test_lora_student_and_fp8_teacher_train_on_generated_steps(tmp_path, capsys):
    cfg = _run_config(tmp_path, on_policy=0.5, seq_kd=1.0, max_new_tokens=6)
    cfg["teacher"]["precision"] = "fp8"  # the teacher writes the seq_kd completions with its FP8 linears
    cfg["student"] = {
        "path": str(assets().student),
        "init": "pretrained",
        "lora": {"rank": 4, "alpha": 8, "dropout": 0.1, "targets": ["q_proj", "v_proj"]},
    }
    rc, _, err = run_cli(capsys, "run", str(_write(tmp_path, cfg)), "--quiet")
    assert rc == 0, err
    rows = _metrics(tmp_path / "run", ())
    assert {r["policy"] for r in rows} == {"on_policy", "seq_kd"}  # seq_kd = 1: every other step
    assert all(r["skipped"] is None for r in rows if "skipped" in r)
    assert (tmp_path / "run" / "adapter" / "adapter_model.safetensors").is_file()


def test_kernel_plan_covers_the_generated_steps_decoding():
    from kdistill.kernels.plan import generation_kernels, required_kernels

    t, s = make_spec(hidden=32, vocab=VOCAB), make_spec(hidden=24, vocab=VOCAB)
    cfg = _cfg()
    plan = required_kernels(t, s, cfg, "sm_90")
    prompt = cfg.data.seq_len + 1 - cfg.kd.max_new_tokens
    # on a GPU the decode engine's prefill of a step's 4 rows (causal SDPA) and its bf16 norms
    sdpa = [dict(k.params) for k in plan if k.op == "sdpa" and not k.get("grad")]
    assert any(p["B"] == 4 and p["T"] == prompt and not p.get("masked") for p in sdpa)
    assert any(k.op == "rmsnorm_fwd" and k["w_dtype"] == "bf16" for k in plan)
    on_cpu = dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, device="cpu"))
    cpu = required_kernels(t, s, on_cpu, "sm_90")  # the engine in the student's own dtype (fp32)
    engine = generation_kernels(s, "sm_90", "fp32", batch=4, prompt_len=prompt, max_len=cfg.data.seq_len + 1)
    assert engine <= cpu and not engine <= plan
    off = dataclasses.replace(cfg, kd=dataclasses.replace(cfg.kd, on_policy=0.0))
    assert required_kernels(t, s, off, "sm_90") < plan


def _counted_and_capturing(monkeypatch, min_fill: float | None = None):
    """One on-policy step of a run that does not capture (the counted step: its values, tokens, stats)
    and the same step of a run that captures its generated steps, on a copy of the student from the
    same seeds (its values, tokens, stats, graph): what reached the KD head ((rows, n_tokens) per call)
    and both students. min_fill: the capturing run's MIN_FILL."""
    from kdistill import dispatch
    from kdistill.train import step as step_mod
    from kdistill.train.graph import StepGraph

    cfg = _cfg("jsd")
    cpu = torch.device("cpu")
    teacher, student = _pair()
    other = copy.deepcopy(student)

    def ctx(model, graph=None):
        opt = torch.optim.AdamW(model.parameters())
        return StepContext(cfg, model, teacher, opt, cpu, contextlib.nullcontext(), None, graph=graph)

    plain = ctx(student)
    means, tokens, stats, _ = generated_accumulate(plain, OnPolicy(cfg, PROMPTS, {0}, 0, cpu), 0, "on_policy")
    counted = (torch.cat(step_mod._update(plain, means) + [means[:, 0]]), tokens, stats)
    seen = []
    real = dispatch.kd_loss

    def recording(*a, **k):
        seen.append((k.get("rows"), k.get("n_tokens")))
        return real(*a, **k)

    monkeypatch.setattr(dispatch, "kd_loss", recording)
    if min_fill is not None:
        monkeypatch.setattr(step_mod, "MIN_FILL", min_fill)
    graph = StepGraph(cpu)
    capturing = step_mod._generated_graphed(
        ctx(other, graph), graph, OnPolicy(cfg, PROMPTS, {0}, 0, cpu), 0, "on_policy"
    )
    assert capturing[3] is False  # one process: nothing asked it to stop
    return cfg, counted, (*capturing[:3], graph), seen, student, other


def test_a_capturing_runs_generated_step_trains_as_the_counted_step(monkeypatch):
    """A run that captures its generated steps (runtime.cuda_graphs) computes them with the KD head at a
    fixed row count, the most completion tokens a micro-batch holds, on its eager steps too: the same
    losses, tokens and updated weights as the counted step, up to rounding (the replay is on a GPU)."""
    cfg, (counted, tokens, stats), (packed, tokens2, stats2, graph), seen, student, other = (
        _counted_and_capturing(monkeypatch)
    )
    rows = cfg.schedule.batch_size * cfg.kd.max_new_tokens
    assert seen == [(rows, None)] * cfg.schedule.grad_accum  # no host count reaches the head
    assert graph.counts == {"captures": 0, "replays": 0, "eager_steps": 1}  # the first step is eager
    assert tokens2 == tokens and stats2.completion_tokens == stats.completion_tokens
    assert torch.allclose(packed, counted, rtol=1e-5, atol=1e-7)
    for (name, a), b in zip(student.named_parameters(), other.parameters(), strict=True):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7), name


def test_a_capturing_runs_step_of_short_completions_counts_its_rows_on_the_host(monkeypatch):
    """Completions filling less than MIN_FILL of the fixed head's rows: the step runs eagerly with the
    head at the host's count (no ignored rows computed), exactly the counted step."""
    cfg, (counted, tokens, _), (packed, tokens2, _, graph), seen, student, other = _counted_and_capturing(
        monkeypatch,
        min_fill=1.01,  # no step fills more than its head
    )
    assert [rows for rows, _ in seen] == [None] * cfg.schedule.grad_accum
    assert sum(n for _, n in seen) == tokens == tokens2
    assert graph.counts["eager_steps"] == 1 and not graph.capture_now(graph.last_sig)
    assert torch.equal(packed, counted)
    for a, b in zip(student.parameters(), other.parameters(), strict=True):
        assert torch.equal(a, b)
