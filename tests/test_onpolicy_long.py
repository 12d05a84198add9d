"""Reasoning-length on-policy steps on the CPU: what the memory plan counts and the rollout's slot refill.

- Packed conversations attend through one additive document bias per forward (ops.attention.document_bias),
  equal to the boolean document mask, shared by every layer, in the attention's dtype; the plan's
  document-mask term is that tensor's bytes, counted only where the rows carry documents (from the
  config's data files), and, when every step is generated, in a held-out eval phase of its own.
- The generation phase at 8,192 new tokens: the decode engine's static KV cache (kept across steps) is
  the plan's `decode_engine_kv_cache`, sized by kd.rollout_batch rows, not by the step's rows.
- kd.rollout_batch: more rows than slots, rows stopping at very different lengths: a freed slot takes the
  next prompt, completions come back in prompt order and equal the per-row reference under greedy; a
  sampled rollout repeats from the generator's saved state; a bad value is a one-line error.
"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

from kdistill import dispatch
from kdistill.config import RunConfig
from kdistill.decode import _Slots
from kdistill.errors import UserError
from kdistill.memory import (
    document_mask_bytes,
    estimate_memory,
    kv_cache_bytes,
    rows_carry_documents,
)
from kdistill.models import decoder as decoder_mod
from kdistill.models.decoder import build_decoder
from kdistill.ops import attention as attn
from kdistill.train.onpolicy import OnPolicy
from kdistill.train.rollouts import RolloutSampling, rollout
from tests.test_chat_train import write_chat_files
from tests.test_contract import make_spec
from tests.test_onpolicy import PROMPTS as POOL
from tests.test_onpolicy import _cfg, _pair, _run_config, _write
from tests.test_train_kit import assets, one_error_line, run_cli

VOCAB = 40


def _docs(rows: int, t: int) -> torch.Tensor:
    """(rows, t) document ids: documents of different lengths per row, padding (-1) at the end."""
    out = torch.full((rows, t), -1, dtype=torch.long)
    for r in range(rows):
        pos, doc = 0, 0
        while pos < t - 3:
            n = min(3 + (5 * r + 7 * doc) % 11, t - 3 - pos)
            out[r, pos : pos + n] = doc
            pos, doc = pos + n, doc + 1
    return out


def test_the_document_bias_is_the_document_mask_as_zero_and_minus_infinity(monkeypatch):
    monkeypatch.setattr(attn, "BIAS_BLOCK_ELEMENTS", 3 * 2 * 37)  # several blocks of query rows
    doc = _docs(2, 37)
    bias = attn.document_bias(doc, torch.float32)
    want = attn.document_mask(doc)
    assert bias.shape == want.shape == (2, 1, 37, 37) and bias.dtype == torch.float32
    assert torch.equal(bias == 0, want) and torch.equal(bias == float("-inf"), ~want)
    # rows 16-element aligned (memory-efficient SDPA takes it without a padded copy), the one buffer's bytes
    assert bias.stride() == (37 * 48, 37 * 48, 48, 1)
    assert bias.untyped_storage().nbytes() == document_mask_bytes(2, 37, 4)
    assert attn.document_bias(doc, torch.bfloat16).untyped_storage().nbytes() == document_mask_bytes(2, 37, 2)


def test_attention_with_the_bias_equals_attention_with_the_boolean_mask_forward_and_backward():
    torch.manual_seed(0)
    doc = _docs(2, 29)
    q = torch.randn(2, 4, 29, 8, requires_grad=True)
    k, v = (torch.randn(2, 2, 29, 8, requires_grad=True) for _ in range(2))
    g = torch.randn(2, 4, 29, 8)
    outs = []
    for mask in (attn.document_mask(doc), attn.document_bias(doc, torch.float32)):
        y = attn.attention_reference(q, k, v, mask)
        grads = torch.autograd.grad(y, (q, k, v), g)
        outs.append((y.detach(), *grads))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("autocast", [False, True])
def test_a_packed_forward_builds_one_bias_in_the_attention_dtype_shared_by_every_layer(monkeypatch, autocast):
    model = build_decoder(make_spec(layers=3, vocab=VOCAB), seed=0)
    seen: list[torch.Tensor] = []

    def spy(q, k, v, mask=None):
        seen.append(mask)
        assert mask is not None and mask.dtype == q.dtype  # no conversion inside SDPA
        return dispatch.attention(q, k, v, mask)

    monkeypatch.setattr(decoder_mod, "attention", spy)
    doc = _docs(2, 21)
    ids = torch.randint(1, VOCAB, (2, 21))
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else torch.autocast("cpu", enabled=False)
    with ctx:
        model(ids, None, doc).float().sum().backward()
    assert len(seen) == 3 and len({m.data_ptr() for m in seen}) == 1
    assert seen[0].dtype == (torch.bfloat16 if autocast else torch.float32)
    assert seen[0].untyped_storage().nbytes() == document_mask_bytes(2, 21, 2 if autocast else 4)


def _conversation_cfg(tmp_path, on_policy: float) -> RunConfig:
    data, _ = write_chat_files(tmp_path / "chats")
    cfg = RunConfig()
    cfg.data.train, cfg.data.seq_len = [str(data)], 8256
    cfg.schedule.batch_size = 4
    cfg.kd.on_policy, cfg.kd.max_new_tokens = on_policy, 8192
    return cfg


def test_the_plan_counts_the_document_bias_only_where_rows_carry_documents(tmp_path):
    t, s = make_spec(hidden=64, vocab=384, layers=4), make_spec(hidden=64, vocab=384, layers=2)
    chats = _conversation_cfg(tmp_path, on_policy=0.0)
    text = dataclasses.replace(chats, data=dataclasses.replace(chats.data, train=[str(assets().train)]))
    assert rows_carry_documents(chats) and not rows_carry_documents(text)
    bias = document_mask_bytes(4, 8256, 2)
    assert bias == 4 * 8256 * 8256 * 2  # 8,256 is a multiple of the alignment: no padding
    # data steps: the student's bias, kept from its forward to its backward, at the peak
    assert estimate_memory(t, s, chats)["document_mask"] == bias
    assert "document_mask" not in estimate_memory(t, s, text)
    assert estimate_memory(t, s, text, documents=True)["document_mask"] == bias  # the caller may say
    # every step generated (plain causal rows): only the held-out evals have a bias, a phase of their own
    every = dataclasses.replace(chats, kd=dataclasses.replace(chats.kd, on_policy=1.0))
    eager = dataclasses.replace(every, runtime=dataclasses.replace(every.runtime, cuda_graphs="off"))
    plan = estimate_memory(t, s, eager)
    assert "document_mask" not in plan and plan["heldout_eval_with_document_mask"] > bias
    no_docs = estimate_memory(t, s, eager, documents=False)
    assert "heldout_eval_with_document_mask" not in no_docs and plan["total"] - no_docs["total"] >= bias // 2
    # the update captured as a CUDA graph: the eval runs beside its pool, with its bias
    captured = estimate_memory(t, s, every)
    assert "document_mask" not in captured and captured["eval_beside_graph_pool"] > bias


def test_the_generation_phase_at_8192_new_tokens_is_the_engines_kv_cache_at_rollout_batch_rows(tmp_path):
    t, s = make_spec(hidden=64, vocab=384, layers=4), make_spec(hidden=64, vocab=384, layers=2)
    cfg = _conversation_cfg(tmp_path, on_policy=1.0)
    cfg.schedule.grad_accum = 2  # 8 rows a step
    slots = cfg.data.seq_len + 1
    # the engine's static cache as decode._Slots allocates it (bf16, as on a GPU), measured
    for rows in (8, 3):
        c = dataclasses.replace(cfg, kd=dataclasses.replace(cfg.kd, rollout_batch=rows if rows < 8 else 0))
        st = _Slots(s, rows, slots, 8192, torch.bfloat16, torch.device("cpu"))
        measured = sum(x.untyped_storage().nbytes() for x in st.k + st.v)
        assert measured == kv_cache_bytes(s, rows, slots, 2)
        assert estimate_memory(t, s, c)["decode_engine_kv_cache"] == measured
        del st
    # the eager path (CPU) writes every row at once and frees its cache: a phase, at every row
    cpu = estimate_memory(t, s, cfg, "cpu")
    assert "decode_engine_kv_cache" not in cpu
    few = dataclasses.replace(cfg, kd=dataclasses.replace(cfg.kd, rollout_batch=2))
    assert estimate_memory(t, s, few)["total"] < estimate_memory(t, s, cfg)["total"]


def test_a_small_prefill_keeps_its_graphs_pool_in_the_memory_plan(tmp_path, monkeypatch):
    """On a GPU the engine captures a prefill of at most PREFILL_GRAPH_TOKENS padded tokens, whose pool
    then stays allocated: a kept term of the plan, one per writing engine; a larger prefill stays eager."""
    from kdistill import memory
    from kdistill.memory import engine_prefill_bytes

    t, s = make_spec(hidden=64, vocab=384, layers=4), make_spec(hidden=64, vocab=384, layers=2)
    cfg = _conversation_cfg(tmp_path, on_policy=1.0)
    prompt = cfg.data.seq_len + 1 - cfg.kd.max_new_tokens
    rows = cfg.kd.rollout_slots(cfg.schedule.batch_size * cfg.schedule.grad_accum)
    assert rows * prompt <= memory.PREFILL_GRAPH_TOKENS, (rows, prompt)  # 4 rows of 65 prompt tokens
    # the limit at this prefill's size, so that the tiny config's longer prompts cross it
    monkeypatch.setattr(memory, "PREFILL_GRAPH_TOKENS", rows * prompt)
    plan = estimate_memory(t, s, cfg)
    assert plan["decode_engine_prefill_graphs"] == engine_prefill_bytes(s, rows * prompt)
    big = dataclasses.replace(cfg, kd=dataclasses.replace(cfg.kd, max_new_tokens=8))  # long prompts
    big_prompt = big.data.seq_len + 1 - 8
    assert rows * big_prompt > memory.PREFILL_GRAPH_TOKENS, (rows, big_prompt)
    assert "decode_engine_prefill_graphs" not in estimate_memory(t, s, big)
    assert "decode_engine_prefill_graphs" not in estimate_memory(t, s, cfg, "cpu")


def _student():
    return build_decoder(make_spec(hidden=24, vocab=VOCAB), seed=1).eval()


PROMPTS = [[1, 2, 3, 4], [5, 6], [7, 8, 9], [3, 1], [9, 9, 2, 5, 1], [4], [6, 7]]


def test_more_rows_than_slots_with_ragged_stops_equal_the_per_row_reference_under_greedy():
    model = _student()
    free = [rollout(model, [p], RolloutSampling(24, 0.0), set(), None).completions[0] for p in PROMPTS]
    stops = {free[0][1], free[3][17]}  # rows stop early, late, or run to the budget
    reference = []
    for row in free:
        cut = next((i + 1 for i, tok in enumerate(row) if tok in stops), len(row))
        reference.append(row[:cut])
    lengths = sorted(len(r) for r in reference)
    assert lengths[0] <= 3 and lengths[-1] >= 18  # very different lengths
    engines: dict = {}
    got = rollout(model, PROMPTS, RolloutSampling(24, 0.0), stops, None, engines=engines, max_len=40, batch=2)
    (engine,) = engines.values()
    assert engine.batch_size == 2 and engine.slots.batch == 2  # 7 rows through 2 slots
    assert got.completions == reference
    assert got.stopped == [bool(r) and r[-1] in stops for r in reference]
    all_rows = rollout(model, PROMPTS, RolloutSampling(24, 0.0), stops, None, engines={}, max_len=40)
    assert all_rows.completions == reference


def test_a_sampled_rollout_with_more_rows_than_slots_repeats_from_the_saved_generator_state():
    model = _student()
    gen = torch.Generator().manual_seed(5)
    sampling = RolloutSampling(16, 1.0)
    engines: dict = {}
    first = rollout(model, PROMPTS, sampling, {0}, gen, engines=engines, max_len=40, batch=3)
    state = gen.get_state()  # what a checkpoint after this step keeps
    second = rollout(model, PROMPTS, sampling, {0}, gen, engines=engines, max_len=40, batch=3)
    gen.set_state(state)  # a resumed run: a fresh engine, the saved generator state
    resumed = rollout(model, PROMPTS, sampling, {0}, gen, engines={}, max_len=40, batch=3)
    assert resumed == second and len(second.completions) == len(PROMPTS)
    assert first != second  # the generator moved on


@pytest.mark.parametrize("value", ["-1", "1.5", "true"])
def test_a_bad_rollout_batch_is_a_one_line_error(tmp_path, capsys, value):
    cfg = _run_config(tmp_path, on_policy=1.0, max_new_tokens=8)
    rc, _, err = run_cli(capsys, "run", str(_write(tmp_path, cfg)), f"kd.rollout_batch={value}", "--quiet")
    assert rc == 2 and "kd.rollout_batch is" in one_error_line(err), err
    assert "expected an integer" in err and "Traceback" not in err


def test_an_on_policy_step_writes_through_an_engine_of_kd_rollout_batch_rows():
    """The decode engine's path of OnPolicy.generate (a GPU's; here on the CPU): the engine holds
    kd.rollout_batch slots, and the step's rows, in order, are those of the eager path under greedy."""
    _, student = _pair()
    cfg = _cfg()
    cfg.kd.sample_temperature = 1e-9  # greedy: the rows do not depend on how they are batched
    cfg.kd.rollout_batch = 3  # 4 rows a step (2 micro-batches of 2)
    eager = OnPolicy(cfg, POOL, {0}, 0, torch.device("cpu"))
    engine = OnPolicy(cfg, POOL, {0}, 0, torch.device("cpu"))
    engine.engines = {}
    want, _ = eager.generate(student, contextlib.nullcontext())
    got, out = engine.generate(student, contextlib.nullcontext())
    (eng,) = engine.engines.values()
    assert eng.batch_size == 3 and len(out.completions) == 4
    for (a_ids, a_labels), (b_ids, b_labels) in zip(want, got):
        assert torch.equal(a_ids, b_ids) and torch.equal(a_labels, b_labels)


def _kv_heavy_cfg(auto_fit: bool, budget_gib: float) -> RunConfig:
    cfg = RunConfig()
    cfg.data.seq_len = 8256
    cfg.schedule.batch_size, cfg.schedule.grad_accum = 4, 8  # 32 rows a generated step
    cfg.kd.on_policy, cfg.kd.max_new_tokens = 1.0, 8192
    cfg.runtime = dataclasses.replace(cfg.runtime, auto_fit=auto_fit, gpu_memory_gib=budget_gib)
    return cfg


def test_a_plan_over_budget_lowers_the_rollout_batch_first_or_names_it():
    """The engines' KV caches at every row are what is over: runtime.auto_fit writes fewer rows at once
    (the largest power of two that fits; the batch unchanged), and without it the refusal names it."""
    from kdistill.memory import fit_rollout_batch
    from kdistill.train.preflight import check_memory

    t = make_spec(hidden=32, layers=2, heads=4, kv=4, head_dim=64, vocab=384)
    s = make_spec(hidden=32, layers=8, heads=4, kv=4, head_dim=64, vocab=384)
    budget = 1.5
    cfg = _kv_heavy_cfg(True, budget)
    cuda = torch.device("cuda")  # planned only: runtime.gpu_memory_gib stands for the device's memory
    fitted, layout = check_memory(cfg, t, s, cuda, quiet=True)
    slots = fitted.kd.rollout_batch
    assert fitted.schedule.batch_size == 4 and 1 <= slots < 32 and slots & (slots - 1) == 0

    def terms(n: int) -> dict:
        c = dataclasses.replace(cfg, kd=dataclasses.replace(cfg.kd, rollout_batch=n))
        return estimate_memory(t, s, c, layout=layout, documents=False)

    def total(n: int) -> int:
        return terms(n)["total"]

    assert total(slots) <= budget * 0.95 * 2**30 < total(2 * slots) <= total(32)
    shrunk = terms(32)["decode_engine_kv_cache"] - terms(slots)["decode_engine_kv_cache"]
    assert shrunk == kv_cache_bytes(s, 32 - slots, 8257, 2)  # the engine's cache shrank
    assert fit_rollout_batch(t, s, cfg, int(budget * 0.95 * 2**30), layout=layout) == slots
    with pytest.raises(UserError) as err:
        check_memory(_kv_heavy_cfg(False, budget), t, s, cuda, quiet=True)
    assert f"or kd.rollout_batch={slots}; or set runtime.auto_fit=true" in str(err.value)
    assert "\n" not in str(err.value)
