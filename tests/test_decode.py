"""The decode engine on the CPU: the same tokens as transformers and as the oracle, slot refill
bookkeeping, stops found on the device, seeded sampling, the planned keys, and `generate --out`.

- Greedy tokens equal transformers' `generate` for a ragged batch with a stop token, whatever the
  bucket (1, 2 or 8 rows at once: rows wait and take freed slots).
- On a CPU the engine runs eagerly in the model's dtype, sharing its tensors, and equals the left-padded
  eager oracle (tests/oracle_decode.py) token for token: prompts of 1 to 21 tokens, 1, 3 or 8 slots.
- Slot refill: answers come back in prompt order, on_finish once per prompt as each ends, and a row
  ends at its stop token, its budget or the cache's end.
- The sampler: inverse CDF over the kept tokens (top-k, top-p), greedy below MIN_TEMPERATURE; seeded
  sampling reproduces its tokens and another seed differs.
- Every Triton key the engine launches is in kernels.plan.generation_kernels.
- `kdistill generate --out`: rows with the conversation and the answer as an assistant turn, a manifest,
  resume after a kill (the torn line dropped, the rest kept, the result equal to an uninterrupted run),
  another process's file or other settings refused, bad sizes refused in one line.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kdistill.decode import MIN_TEMPERATURE, DecodeEngine, Sampling
from kdistill.kernels import contract, runtime, seal
from kdistill.kernels import plan as plan_mod
from kdistill.models.hf_io import load_model
from kdistill.ops.sample import sample_tokens
from tests import test_generate
from tests.oracle_decode import generate_ids
from tests.test_generate import cli, hf_greedy
from tests.tiny import load_hf, make_tiny_model, sample_ids

LENS = (7, 3, 11, 5, 9)
ROOT = Path(__file__).resolve().parents[1]


def ragged(vocab: int) -> list[list[int]]:
    return [sample_ids(vocab, 1, n, seed=n)[0].add(1).clamp(max=vocab - 1).tolist() for n in LENS]


@pytest.fixture(scope="module", params=["qwen2", "llama", "qwen3"])
def pair(request, tmp_path_factory):
    d = make_tiny_model(tmp_path_factory.mktemp(request.param), family=request.param, tied=False)
    return load_model(d).eval(), load_hf(d)


def test_greedy_equals_transformers_in_every_bucket(pair):
    model, hf = pair
    rows = ragged(model.spec.vocab_size)
    free = generate_ids(model, rows, Sampling(max_new_tokens=10))
    eos = free[0][3]  # a token greedy decoding meets: rows end at different steps
    want = [hf_greedy(hf, [r], 10, eos)[0] for r in rows]
    for batch in (1, 2, 8):
        eng = DecodeEngine(
            model, batch_size=batch, max_len=32, sampling=Sampling(max_new_tokens=10), stop_ids={eos}
        )
        assert eng.generate(rows) == want, batch
    assert len({len(r) for r in want}) > 1


ORACLE_LENS = (1, 2, 5, 8, 13, 21, 3)


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_the_engine_on_the_cpu_equals_the_oracle_token_for_token(pair, batch):
    """On a CPU the engine steps eagerly in the model's own dtype, sharing its tensors, and writes the
    left-padded eager oracle's greedy tokens (tests/oracle_decode.py) for prompts of 1 to 21 tokens,
    whether all rows run at once or fewer slots are refilled as rows finish."""
    model, _ = pair
    v = model.spec.vocab_size
    rows = [sample_ids(v, 1, n, seed=40 + n)[0].add(1).clamp(max=v - 1).tolist() for n in ORACLE_LENS]
    free = generate_ids(model, rows, Sampling(max_new_tokens=9))
    stop = free[1][4]  # a token greedy decoding meets: rows end at different steps
    want = generate_ids(model, rows, Sampling(max_new_tokens=9), {stop})
    eng = DecodeEngine(
        model, batch_size=batch, max_len=32, sampling=Sampling(max_new_tokens=9), stop_ids={stop}
    )
    assert not eng.graphs and eng.dtype == torch.float32 and eng.sync_every == 1
    assert eng.weights.embed.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # shared, not copied
    assert eng.weights.layers[0].down.data_ptr() == model.model.layers[0].mlp.down_proj.weight.data_ptr()
    assert eng.generate(rows) == want
    assert len({len(r) for r in want}) > 1 and any(r[-1] == stop for r in want)


@pytest.mark.parametrize("sync_every", [1, 3, 4])
def test_the_host_queues_a_round_ahead_but_no_step_past_the_rows_budgets(pair, sync_every):
    """The host reads each round's done flags while the next round runs (the device never waits for
    it), and the last round runs only the steps the rows' budgets leave: rows that all run to
    max_new_tokens cost the steps a step-at-a-time loop runs, and the tokens are the same."""
    model, _ = pair
    rows = ragged(model.spec.vocab_size)[:4]
    s = Sampling(max_new_tokens=10)
    one = DecodeEngine(model, batch_size=4, max_len=40, sampling=s, sync_every=1)
    eng = DecodeEngine(model, batch_size=4, max_len=40, sampling=s, sync_every=sync_every)
    out = eng.generate(rows)
    assert out == one.generate(rows) and all(len(r) == 10 for r in out)
    assert one.steps == 9  # the prefill samples each row's first token, a step each of the other nine
    assert eng.steps == one.steps  # the last round shortened to the budgets, whatever sync_every
    one_new = DecodeEngine(model, batch_size=4, max_len=40, sampling=Sampling(max_new_tokens=1), sync_every=4)
    assert all(len(r) == 1 for r in one_new.generate(rows)) and one_new.steps == 1  # not a whole round


def test_slot_refill_bookkeeping(pair):
    model, _ = pair
    rows = ragged(model.spec.vocab_size)
    free = generate_ids(model, rows, Sampling(max_new_tokens=6))
    stop = free[2][1]
    eng = DecodeEngine(model, batch_size=2, max_len=14, sampling=Sampling(max_new_tokens=6), stop_ids={stop})
    seen: list[tuple[int, list[int]]] = []
    out = eng.generate(rows, on_finish=lambda i, ids: seen.append((i, ids)))
    assert sorted(i for i, _ in seen) == list(range(len(rows)))  # each prompt once
    assert [dict(seen)[i] for i in range(len(rows))] == out  # in prompt order
    for prompt, new, ref in zip(rows, out, free):
        budget = min(6, 14 - len(prompt))  # the cache's end limits a long prompt's answer
        cut = ref[: ref.index(stop) + 1] if stop in ref else ref
        assert new == cut[:budget]
    assert out[2][-1] == stop and len(out[2]) == free[2].index(stop) + 1 < 6


def test_sampler_inverse_cdf_top_k_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2], [0.2, 0.3, 0.5]]))
    s = Sampling(temperature=1.0)
    u = torch.tensor([0.1, 0.1])
    assert sample_tokens(logits, s, u).tolist() == [0, 0]  # the CDF in vocabulary order: [.5 .8 1], [.2 .5 1]
    assert sample_tokens(logits, s, torch.tensor([0.6, 0.6])).tolist() == [1, 2]
    assert sample_tokens(logits, s, torch.tensor([0.95, 0.95])).tolist() == [2, 2]
    # top-p 0.6 keeps the two likeliest (0.5 + 0.3 reaches it); u is scaled to their mass
    assert sample_tokens(
        logits, Sampling(temperature=1.0, top_p=0.6), torch.tensor([0.99, 0.99])
    ).tolist() == [1, 1]
    assert sample_tokens(logits, Sampling(temperature=1.0, top_k=1), torch.tensor([0.99, 0.99])).tolist() == [
        0,
        2,
    ]
    tiny = Sampling(temperature=MIN_TEMPERATURE / 10)
    assert tiny.greedy and sample_tokens(logits, tiny, u).tolist() == [0, 2]


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    return load_model(make_tiny_model(tmp_path_factory.mktemp("q2"), family="qwen2", tied=False)).eval()


def test_seeded_sampling_reproduces(qwen2):
    model = qwen2
    rows = ragged(model.spec.vocab_size)
    s = Sampling(max_new_tokens=8, temperature=1.3, top_k=40, top_p=0.95, seed=5)

    def run(sampling):
        return DecodeEngine(model, batch_size=2, max_len=24, sampling=sampling).generate(rows)

    a = run(s)
    assert a == run(s)
    assert a != run(Sampling(max_new_tokens=8, temperature=1.3, top_k=40, top_p=0.95, seed=6))
    greedy = [r[:8] for r in generate_ids(model, rows, Sampling(max_new_tokens=8))]
    assert run(Sampling(max_new_tokens=8, temperature=1.0, top_k=1)) == greedy


@pytest.mark.parametrize("head_dim", [16, 32])
def test_engine_keys_are_planned(tmp_path, head_dim):
    d = make_tiny_model(
        tmp_path,
        family="qwen3",
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
    )
    model = load_model(d).eval()
    rows = ragged(model.spec.vocab_size)
    with runtime.using(mode="reference", arch="sm_90"), runtime.recording() as rec:
        DecodeEngine(model, batch_size=2, max_len=40, sampling=Sampling(max_new_tokens=5)).generate(rows)
    plan = plan_mod.generation_kernels(model.spec, "sm_90", "fp32", batch=2, prompt_len=11, max_len=40)
    triton = {k for k in rec.keys() if not k.is_library}
    assert triton <= plan, triton - plan
    assert {k.op for k in triton} >= {
        "rmsnorm_fwd",
        "rope_fwd",
        "swiglu_fwd",
        "decode_attn_split",
        "decode_gemv",
    }
    assert "decode_attn_combine" not in {k.op for k in triton}  # the split's last program combines
    # from a head of 32 on, the step's RoPE runs inside the attention kernel (16: the RoPE kernel first)
    assert {k["ROPE"] for k in triton if k.op == "decode_attn_split"} == {head_dim >= 32}


@pytest.mark.parametrize("temperature,top_p", [(0.0, 1.0), (0.8, 1.0), (0.8, 0.9)])
def test_the_steps_sampler_is_planned_prewarmed_and_specialized_as_keyed(tmp_path, temperature, top_p):
    """The decode step's sampler and bookkeeping: one kernel (greedy, or a temperature alone) whose key
    is in the plan and whose launch specializes as the key says; top-p sampling stays on the reference
    (no key)."""
    model = load_model(make_tiny_model(tmp_path, family="qwen2", hidden_size=64, head_dim=32)).eval()
    rows = ragged(model.spec.vocab_size)
    s = Sampling(max_new_tokens=4, temperature=temperature, top_p=top_p)
    with runtime.using(mode="reference", arch="sm_90"), runtime.recording(deep=True) as rec:
        DecodeEngine(model, batch_size=2, max_len=40, sampling=s).generate(rows)
    plan = plan_mod.generation_kernels(model.spec, "sm_90", "fp32", batch=2, prompt_len=11, max_len=40)
    triton = [launch for launch in rec.launches if not launch.key.is_library]
    sampler = {launch.key for launch in triton if launch.key.op == "decode_sample"}
    assert {k["GREEDY"] for k in sampler} == (set() if top_p < 1 else {temperature == 0})
    warm = seal.prewarm(plan, "cpu", dry=True)
    assert warm.failed == []
    assert contract.check(triton, plan, warm.specializations) == []


@pytest.mark.parametrize("batch", [1, 2, 3])
def test_a_rounds_steps_read_their_rows_of_one_draw_keyed_as_a_single_step(tmp_path, batch):
    """A full round of steps (sync_every of them) draws every step's uniforms in one launch, a row per
    step, and step i samples from row i; each row starts 16-byte aligned, so the sampler launched from
    any row is the single step's key, planned and prewarmed (a round of one-row steps included, where
    the rows are padded)."""
    from kdistill import dispatch

    model = load_model(make_tiny_model(tmp_path, family="qwen2", hidden_size=64, head_dim=32)).eval()
    rows = ragged(model.spec.vocab_size)[:batch]
    s = Sampling(max_new_tokens=10, temperature=0.8, seed=9)
    seen: list[torch.Tensor] = []
    real = dispatch.decode_sample

    def spy(logits, u, sampling, r):
        seen.append(u.clone())
        real(logits, u, sampling, r)

    eng = DecodeEngine(model, batch_size=batch, max_len=40, sampling=s, sync_every=4)
    try:
        dispatch.decode_sample = spy
        with runtime.using(mode="reference", arch="sm_90"), runtime.recording(deep=True) as rec:
            out = eng.generate(rows)
    finally:
        dispatch.decode_sample = real
    assert all(len(r) == 10 for r in out) and len(seen) == eng.steps == 9  # rounds of 4, 4, then 1
    st = eng.slots
    assert st.uk.shape == (4, -(-batch // 4) * 4)
    assert all(st.uk[i].data_ptr() % 16 == 0 for i in range(4))
    # the same generator, drawn as the engine draws: the prefill's first tokens, two rounds, one step
    g = torch.Generator().manual_seed(9)
    torch.rand(batch, generator=g)
    want = []
    for _ in range(2):
        draw = torch.empty_like(st.uk).uniform_(generator=g)
        want += [draw[i, :batch] for i in range(4)]
    want.append(torch.empty(batch).uniform_(generator=g))
    assert all(torch.equal(a, b) for a, b in zip(seen, want))
    # the tokens follow from the draws: an engine stepping one at a time draws differently
    one = DecodeEngine(model, batch_size=batch, max_len=40, sampling=s, sync_every=1).generate(rows)
    again = DecodeEngine(model, batch_size=batch, max_len=40, sampling=s, sync_every=4).generate(rows)
    assert again == out and [r[:1] for r in one] == [r[:1] for r in out]
    plan = plan_mod.generation_kernels(model.spec, "sm_90", "fp32", batch=batch, prompt_len=11, max_len=40)
    triton = [launch for launch in rec.launches if not launch.key.is_library]
    assert len({launch.key for launch in triton if launch.key.op == "decode_sample"}) == 1
    warm = seal.prewarm(plan, "cpu", dry=True)
    assert contract.check(triton, plan, warm.specializations) == []


def test_prefill_graphs_take_a_shape_seen_twice_and_keep_the_most_recent():
    """The bookkeeping of captured prefills: a shape is captured on its second sighting if it is small
    enough and its capture never failed; the least recently used graph goes first, and its shape is not
    captured again (a cycle of more shapes than kept graphs would capture at every sighting)."""
    from kdistill.decode import _PrefillGraphs

    pg = _PrefillGraphs(max_tokens=64, keep=2)
    assert not pg.wants((2, 16)) and pg.wants((2, 16))  # seen once: eager; twice: capture
    assert not pg.wants((2, 40)) and not pg.wants((2, 40))  # 80 tokens: never
    graphs = {shape: object() for shape in [(1, 8), (2, 8), (3, 8), (4, 8)]}
    for shape in [(1, 8), (2, 8), (3, 8)]:
        pg.add(shape, graphs[shape])
    assert list(pg.graphs) == [(2, 8), (3, 8)]
    assert pg.get((2, 8)) is graphs[(2, 8)] and pg.get((1, 8)) is None
    pg.add((4, 8), graphs[(4, 8)])  # (3, 8) was used least recently
    assert list(pg.graphs) == [(2, 8), (4, 8)]
    assert not pg.wants((1, 8)) and not pg.wants((3, 8))  # dropped: eager from now on
    pg.failed((2, 16))
    assert not pg.wants((2, 16))
    pg.clear()
    assert not pg.graphs and not pg.wants((2, 16))  # forgotten: a first sighting again


def test_a_cycle_of_more_prefill_shapes_than_kept_graphs_captures_each_at_most_once():
    """The engine's use of the bookkeeping (get, else wants -> capture -> add) over runs that cycle
    through three shapes with room for two graphs: each shape is captured once (on its second
    sighting), and a shape that keeps its graph is replayed."""
    from kdistill.decode import _PrefillGraphs

    pg = _PrefillGraphs(max_tokens=64, keep=2)
    captures, replays = [], []
    for _ in range(5):
        for shape in [(1, 8), (2, 8), (3, 8)]:
            if pg.get(shape) is not None:
                replays.append(shape)
            elif pg.wants(shape):
                captures.append(shape)
                pg.add(shape, object())
    assert sorted(captures) == [(1, 8), (2, 8), (3, 8)]
    assert replays and all(s in pg.graphs for s in set(replays[-2:]))


def test_the_cpu_engine_captures_no_prefill(tmp_path):
    model = load_model(make_tiny_model(tmp_path, family="qwen2", hidden_size=64, head_dim=32)).eval()
    rows = ragged(model.spec.vocab_size)
    eng = DecodeEngine(model, batch_size=2, max_len=40, sampling=Sampling(max_new_tokens=3))
    first = eng.generate(rows)
    assert eng.generate(rows) == first and eng.generate(rows) == first
    assert not eng.slots.prefill_graphs.graphs and not eng.slots.prefill_graphs.seen


def test_a_plan_for_the_longest_cache_serves_engines_with_shorter_ones(tmp_path):
    """The decode step's keys do not follow the cache's length below the split length's first step
    (1,024 slots): one plan, made for a run's longest cache, holds the keys of its engines with shorter
    caches, so none of them compiles after the seal."""
    model = load_model(make_tiny_model(tmp_path, family="qwen2", hidden_size=64, head_dim=32)).eval()
    rows = ragged(model.spec.vocab_size)
    plan = plan_mod.generation_kernels(model.spec, "sm_90", "fp32", batch=2, prompt_len=11, max_len=1024)
    for max_len in (40, 129, 640):
        with runtime.using(mode="reference", arch="sm_90"), runtime.recording() as rec:
            DecodeEngine(model, batch_size=2, max_len=max_len, sampling=Sampling(max_new_tokens=3)).generate(
                rows
            )
        triton = {k for k in rec.keys() if not k.is_library}
        assert "decode_attn_split" in {k.op for k in triton}
        assert triton <= plan, (max_len, triton - plan)


@pytest.mark.parametrize(
    "arch,prompts,chained",
    [("sm_90", 3, True), ("sm_90", 17, True), ("sm_80", 3, False), ("sm_90", 65, False)],
)
def test_only_a_small_buckets_step_launches_its_norms_and_attention_chained(tmp_path, arch, prompts, chained):
    """Programmatic dependent launch for the step's norms and attention where the arch has it and the
    bucket's products are the matrix-vector kernels (a narrow model's: at most 64 rows); the prefill's norms never."""
    model = load_model(make_tiny_model(tmp_path, family="qwen2", hidden_size=64, head_dim=32)).eval()
    rows = [sample_ids(model.spec.vocab_size, 1, 5, seed=i)[0].tolist() for i in range(prompts)]
    with runtime.using(mode="reference", arch=arch), runtime.recording() as rec:
        DecodeEngine(model, batch_size=72, max_len=16, sampling=Sampling(max_new_tokens=2)).generate(rows)
    pdl = {k["PDL"] for k in rec.keys() if k.op in ("decode_attn_split", "rmsnorm_fwd")}
    assert pdl == ({False, True} if chained else {False})  # the prefill's norms: False
    assert all(k["PDL"] == (arch == "sm_90") for k in rec.keys() if k.op == "decode_gemv")
    assert {k["PDL"] for k in rec.keys() if k.op == "decode_attn_split"} == {chained}


def _engine_keys(model, prompts: list[list[int]], batch: int, max_len: int) -> tuple[set, set]:
    """The Triton keys an engine of `batch` rows launches on sm_90 decoding `prompts` (2 new tokens each,
    the reference in place of each kernel) and its plan's keys; the launched ones are in the plan."""
    with runtime.using(mode="reference", arch="sm_90"), runtime.recording() as rec:
        DecodeEngine(model, batch_size=batch, max_len=max_len, sampling=Sampling(max_new_tokens=2)).generate(
            prompts
        )
    triton = {k for k in rec.keys() if not k.is_library}
    plan = plan_mod.generation_kernels(
        model.spec, "sm_90", "fp32", batch=batch, prompt_len=3, max_len=max_len
    )
    assert triton <= plan, (batch, triton - plan)
    return triton, plan


@pytest.mark.parametrize("batch,prompts", [(4, 3), (72, 70)])
def test_the_steps_embedding_lookup_is_inside_its_first_norm_and_planned(tmp_path, batch, prompts):
    """A decode step looks its tokens' embeddings up inside the first block's norm (the norm key's
    GATHER: one launch, chained as the step is); the prefill keeps its own lookup and plain norm. The
    plan holds the gathering norm chained, and unchained too for an engine with buckets of more rows
    than chain (a narrow model: 64)."""
    model = load_model(make_tiny_model(tmp_path, family="qwen2", hidden_size=64, head_dim=32)).eval()
    rows = [sample_ids(model.spec.vocab_size, 1, 3, seed=i)[0].tolist() for i in range(prompts)]
    triton, plan = _engine_keys(model, rows, batch, 16)
    gathers = {k for k in triton if k.op == "rmsnorm_fwd" and k["GATHER"]}
    assert {k["PDL"] for k in gathers} == {prompts <= 64}  # the bucket of 4 rows chains, of 72 not
    assert all(not k["HAS_RESIDUAL"] and k["H"] == 64 for k in gathers)
    planned = {k["PDL"] for k in plan if k.op == "rmsnorm_fwd" and k["GATHER"]}
    assert planned == ({True} if batch <= 64 else {True, False})
    # the prefill's first norm: a plain one, unchained
    assert any(
        k.op == "rmsnorm_fwd" and not k["GATHER"] and not k["PDL"] and not k["HAS_RESIDUAL"] for k in triton
    )


def test_a_steps_attention_reads_longer_splits_as_its_rows_grow_and_its_plan_holds_them(tmp_path):
    """A step of more than WIDE_ROWS rows reads its cache in splits of at least WIDE_SPLIT keys (programs
    enough without short splits), chained or not (a narrow model chains 64 rows), a step of MID_ROWS in
    splits of at least MID_SPLIT, a step of at most 16 rows in the cache's own (64 keys for a short
    cache); the plan for an engine of each batch holds the keys of every bucket it may run, and an engine
    of fewer rows never launches the longer splits."""
    from kdistill.kernels import decode_attention

    model = load_model(make_tiny_model(tmp_path, family="qwen2", hidden_size=64, head_dim=32)).eval()
    batches = (64, decode_attention.WIDE_ROWS + 1, decode_attention.MID_ROWS[1], decode_attention.MID_ROWS[0])
    rows = [sample_ids(model.spec.vocab_size, 1, 3, seed=i)[0].tolist() for i in range(max(batches) + 1)]
    splits = {}
    for batch in batches:
        triton, plan = _engine_keys(model, rows[: batch + 1], batch, 16)
        splits[batch] = {k["SPLIT"] for k in triton if k.op == "decode_attn_split"}
        assert splits[batch] == {decode_attention.split_len(16, batch)}
        planned = {k["SPLIT"] for k in plan if k.op == "decode_attn_split"}
        buckets = {min(batch, 1 << i) for i in range(batch.bit_length() + 1)}  # its smaller buckets too
        assert planned == {decode_attention.split_len(16, r) for r in buckets}
    assert splits[64] == splits[decode_attention.WIDE_ROWS + 1] == {decode_attention.WIDE_SPLIT}
    assert splits[decode_attention.MID_ROWS[1]] == {decode_attention.MID_SPLIT}
    assert splits[decode_attention.MID_ROWS[0]] == {64} == {decode_attention.split_len(16)}


def test_a_narrow_models_bucket_of_17_to_64_rows_runs_a_32_or_64_row_tile_and_its_plan_holds_it(tmp_path):
    """The matrix-vector kernel serves a narrow model's buckets of up to 64 rows: 17 to 32 in a tile of
    32 rows, 33 to 64 in one of 64 (the weights still streamed once), chained like a 16-row bucket's
    step. An engine's plan holds the tiles of its buckets: of more than 32 rows all three, of 17 to 32
    the 16- and 32-row ones, of at most 16 only 16."""
    from kdistill.kernels import decode_gemv

    model = load_model(make_tiny_model(tmp_path, family="qwen2", hidden_size=64, head_dim=32)).eval()
    rows = [sample_ids(model.spec.vocab_size, 1, 3, seed=i)[0].tolist() for i in range(40)]
    tiles = {}
    for batch in (64, 32, 16):
        triton, plan = _engine_keys(model, rows, batch, 16)
        tiles[batch] = {k["BLOCK_M"] for k in triton if k.op == "decode_gemv"}
        planned = {k["BLOCK_M"] for k in plan if k.op == "decode_gemv"}
        assert planned == {t for t in decode_gemv.ROW_TILES if t <= max(16, batch)}, planned
        pdl = {k["PDL"] for k in triton if k.op == "decode_attn_split"}
        assert pdl == {True}, (batch, pdl)  # every step chained
    assert tiles == {64: {64}, 32: {32}, 16: {16}}  # 40 prompts: one bucket of 64 rows, or refilled
    assert [decode_gemv.block_m(r) for r in (16, 17, 32, 33, 64)] == [16, 32, 32, 64, 64]


def _one_block_model(tmp_path, width: int, intermediate: int):
    """A one-block Qwen2 model `width` wide (64-wide heads, one key/value head)."""
    return load_model(
        make_tiny_model(
            tmp_path,
            family="qwen2",
            hidden_size=width,
            intermediate_size=intermediate,
            num_attention_heads=width // 64,
            num_key_value_heads=1,
            head_dim=64,
            num_hidden_layers=1,
        )
    ).eval()


def test_a_wide_models_bucket_of_17_to_32_rows_stays_on_the_library_gemm_unchained(tmp_path):
    """The larger tiles serve narrow products only (a side of at most decode_gemv.NARROW_32 at 32 rows,
    NARROW at 64): a model wider than that decodes a bucket of 17 to 32 rows with the library GEMM, its
    norms and attention unchained, and plans no larger tile; its 16-row buckets still run the kernel
    chained."""
    from kdistill.kernels import decode_gemv

    width = decode_gemv.NARROW_32 + 64
    model = _one_block_model(tmp_path, width, width + 64)
    rows = [sample_ids(model.spec.vocab_size, 1, 3, seed=i)[0].tolist() for i in range(20)]
    for batch, tile in ((32, None), (16, 16)):
        triton, plan = _engine_keys(model, rows, batch, 8)
        assert {k["BLOCK_M"] for k in plan if k.op == "decode_gemv"} == {16}
        launched = {k["BLOCK_M"] for k in triton if k.op == "decode_gemv"}
        assert launched == (set() if tile is None else {tile})
        steps = {k["PDL"] for k in triton if k.op == "decode_attn_split"}
        assert steps == ({False} if tile is None else {True})
    assert decode_gemv.step_rows(width) == 16 and decode_gemv.step_rows(896) == decode_gemv.MAX_ROWS
    assert decode_gemv.step_rows(1536) == 32  # Qwen2.5-1.5B: chained up to 32 rows


def test_a_model_of_up_to_narrow_32_wide_chains_its_buckets_of_17_to_32_rows_not_64(tmp_path):
    """Wider than NARROW but at most NARROW_32 (Qwen2.5-1.5B's 1,536): a bucket of 17 to 32 rows runs the
    kernel's 32-row tile chained, its down past MAX_PLAIN_K inputs on the long-K tile; a bucket of 33 to
    64 rows stays on the library GEMM, unchained."""
    from kdistill.kernels import decode_gemv

    width = decode_gemv.NARROW + 64
    model = _one_block_model(tmp_path, width, decode_gemv.MAX_PLAIN_K + 128)
    rows = [sample_ids(model.spec.vocab_size, 1, 3, seed=i)[0].tolist() for i in range(40)]
    for batch, n, tile in ((32, 20, 32), (64, 40, None)):
        triton, _ = _engine_keys(model, rows[:n], batch, 8)
        launched = {k["BLOCK_M"] for k in triton if k.op == "decode_gemv"}
        assert launched == (set() if tile is None else {tile}), batch
        steps = {k["PDL"] for k in triton if k.op == "decode_attn_split"}
        assert steps == ({False} if tile is None else {True}), batch
        if tile:
            down = [
                k for k in triton if k.op == "decode_gemv" and int(k["K"]) == model.spec.intermediate_size
            ]
            assert down and all(k["BLOCK_N"] == decode_gemv.LONG_BLOCK_N for k in down)
    assert decode_gemv.step_rows(width) == 32


def test_the_larger_row_tiles_are_planned_for_narrow_presets_with_their_own_swiglu_prefetch():
    """Planned from the configs alone: an engine of 64 rows for Qwen2.5-0.5B (896 wide) holds the 32-
    and 64-row tiles of its block products (gate/up's first-inputs prefetch PRE_K_TILE; down, 4,864
    inputs, not at 64 rows), for 1.5B (1,536 wide) the 16- and 32-row tiles: its 16-row gate/up
    prefetches fewer inputs than the 0.5B's (PRE_K_WIDE_SWIGLU: more than WIDE_SWIGLU_K inputs), its
    32-row gate/up takes 64 columns a program, its down (8,960 inputs) the long-K tile at both."""
    from kdistill.kernels import decode_gemv
    from kdistill.models.presets import PRESETS
    from kdistill.models.spec import spec_from_hf_config

    for preset, narrow in (("qwen2.5-0.5b", True), ("qwen2.5-1.5b", False)):
        spec = spec_from_hf_config(PRESETS[preset])
        keys = plan_mod.generation_kernels(spec, "sm_90", "bf16", batch=64, prompt_len=8, max_len=64)
        gemv = [k for k in keys if k.op == "decode_gemv"]
        assert {k["BLOCK_M"] for k in gemv} == ({16, 32, 64} if narrow else {16, 32}), preset
        # gate/up's keys: plain, and at 0.5B (its o_proj not split, the norm after it folded) scaled by
        # the rstd of o_proj's sums of squares; the 1.5B's o_proj is split: its norm stays a launch
        at16 = [k for k in gemv if k["BLOCK_M"] == 16 and k["EPI"] == decode_gemv.EPI_SWIGLU]
        assert {k["PRE_K"] for k in at16} == {512 if narrow else decode_gemv.PRE_K_WIDE_SWIGLU}, preset
        rstd_16 = [-(-spec.hidden_size // 16)] if narrow else []
        assert sorted(int(k.get("RSTD") or 0) for k in at16) == [0, *rstd_16], preset
        if not narrow:
            at32 = [k for k in gemv if k["BLOCK_M"] == 32]
            assert {k["BLOCK_N"] for k in at32 if k["EPI"] == decode_gemv.EPI_SWIGLU} == {64}
            down = [k for k in gemv if int(k["K"]) == spec.intermediate_size]
            assert {k["BLOCK_N"] for k in down} == {decode_gemv.LONG_BLOCK_N}
            assert {k["BLOCK_M"] for k in down} == {16, 32}
            continue
        for tile in (32, 64):
            at = [k for k in gemv if k["BLOCK_M"] == tile]
            swiglu = {k["PRE_K"] for k in at if k["EPI"] == decode_gemv.EPI_SWIGLU}
            assert swiglu == {decode_gemv.PRE_K_TILE[tile][decode_gemv.EPI_SWIGLU]}
            # folded up to FOLD_ROWS rows: gate/up's rstd key beside its plain one
            rstd = {int(k.get("RSTD") or 0) for k in at if k["EPI"] == decode_gemv.EPI_SWIGLU}
            assert rstd == ({0, *rstd_16} if tile <= decode_gemv.FOLD_ROWS else {0}), tile
            down = {k for k in at if int(k["K"]) == spec.intermediate_size}
            assert bool(down) == (tile == 32), tile


@pytest.mark.parametrize("fold", [None, 2])
def test_a_small_buckets_split_products_hand_their_partials_to_the_norm_after_them(
    tmp_path, monkeypatch, fold
):
    """o_proj and down split over K in a small bucket's step (runtime.chained): their fp32 partials go to
    the residual add + norm after them (a key without the product's own combine, a norm key summing
    that many parts), unless that norm is folded into the products around it (FOLD_NORM 2; the policy
    leaves a split product's norm where it is); a bucket past 64 rows runs cuBLAS's products, its norms
    sum no partials. Both are in the plan, and the engine's tokens are the reference forward's."""
    from kdistill.kernels import decode_gemv

    monkeypatch.setattr(decode_gemv, "FOLD_NORM", fold)
    model = load_model(
        make_tiny_model(tmp_path, family="qwen2", hidden_size=64, head_dim=32, intermediate_size=1024)
    ).eval()
    splits = decode_gemv.split(model.spec.hidden_size, model.spec.intermediate_size)
    assert splits > 1
    rows = [sample_ids(model.spec.vocab_size, 1, 4, seed=i)[0].tolist() for i in range(3)]
    with runtime.using(mode="reference", arch="sm_90"), runtime.recording() as rec:
        got = DecodeEngine(model, batch_size=4, max_len=16, sampling=Sampling(max_new_tokens=3)).generate(
            rows
        )
    triton = {k for k in rec.keys() if not k.is_library}
    plan = plan_mod.generation_kernels(model.spec, "sm_90", "fp32", batch=4, prompt_len=4, max_len=16)
    assert triton <= plan, triton - plan
    assert {k["PARTS"] for k in triton if k.op == "rmsnorm_fwd"} == {0, splits}
    downs = {k for k in triton if k.op == "decode_gemv" and k["K"] == 1024}
    # the last block's down: partials to the final norm; with the norm after the down folded (FOLD_NORM
    # 2) the others' own combine adds the residual for the next q/k/v
    folded = decode_gemv.norm_folds(model.spec.hidden_size, model.spec.q_size, model.spec.intermediate_size)
    assert folded[1] == (fold == 2)
    assert {(k["COMBINE"], bool(k.get("ADD")), k["SPLIT"]) for k in downs} == {
        (False, False, splits),
        *([(True, True, splits)] if fold == 2 else []),
    }
    assert got == generate_ids(model, rows, Sampling(max_new_tokens=3))
    with runtime.using(mode="reference", arch="sm_90"), runtime.recording() as rec:
        DecodeEngine(model, batch_size=72, max_len=16, sampling=Sampling(max_new_tokens=2)).generate(
            rows * 24
        )
    assert {k["PARTS"] for k in rec.keys() if k.op == "rmsnorm_fwd"} == {0}
    # a bucket of 33-64 rows still runs the kernel's products but folds no norm (FOLD_ROWS): the
    # folded weights follow a norm of weight one, the tokens the reference forward's
    with runtime.using(mode="reference", arch="sm_90"), runtime.recording() as rec:
        eng = DecodeEngine(model, batch_size=40, max_len=16, sampling=Sampling(max_new_tokens=2))
        got = eng.generate(rows * 14)
    assert eng.weights.fold_post  # gate/up's rows hold the norm's weight
    gemv = [k for k in rec.keys() if k.op == "decode_gemv"]
    assert {k["BLOCK_M"] for k in gemv} == {64} and not [k for k in gemv if k.get("RSTD") or k.get("ADD")]
    assert got == generate_ids(model, rows * 14, Sampling(max_new_tokens=2))


# -- generate --out ------------------------------------------------------------------------------
chat_dir = test_generate.chat_dir  # the tiny chat model of the generate tests (a module fixture)


def prompts_file(path: Path, n: int) -> Path:
    words = ["the fox", "a cat sat", "quick brown", "over the lazy dog", "hello", "jumps"]
    lines = [json.dumps([{"role": "user", "content": words[i % len(words)] * (1 + i % 3)}]) for i in range(n)]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_out_writes_conversations_and_a_manifest(chat_dir, tmp_path, capsys):
    msgs = prompts_file(tmp_path / "p.jsonl", 5)
    out = tmp_path / "answers.jsonl"
    argv = ["--model", str(chat_dir), "--messages", str(msgs), "--out", str(out), "--device", "cpu"]
    rc, _, err = cli(capsys, *argv, "--max-new-tokens", "5", "--samples-per-prompt", "2", "--batch-size", "3")
    assert rc == 0, err
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [(r["index"], r["sample"]) for r in rows] == [(i, j) for i in range(5) for j in range(2)]
    first = json.loads(msgs.read_text().splitlines()[0])
    assert rows[0]["messages"] == [*first, {"role": "assistant", "content": rows[0]["text"]}]
    assert rows[0]["token_ids"] == rows[1]["token_ids"]  # greedy: both samples agree
    m = json.loads((tmp_path / "answers.jsonl.manifest.json").read_text())
    assert m["status"] == "complete" and m["written"] == 10 and m["sampling"]["max_new_tokens"] == 5
    assert m["samples_per_prompt"] == 2 and m["model"] == str(chat_dir.resolve())
    # a second start has nothing to do and changes nothing
    before = out.read_bytes()
    rc, _, _ = cli(capsys, *argv, "--max-new-tokens", "5", "--samples-per-prompt", "2")
    assert rc == 0 and out.read_bytes() == before
    # other settings on the same file: one line, nothing changed
    rc, _, err = cli(capsys, *argv, "--max-new-tokens", "6", "--samples-per-prompt", "2")
    assert rc == 2 and err.count("\n") == 1 and "other settings" in err and "sampling" in err, err
    assert out.read_bytes() == before


def test_out_never_replaces_a_file_kdistill_did_not_write(chat_dir, tmp_path, capsys):
    msgs = prompts_file(tmp_path / "p.jsonl", 2)
    out = tmp_path / "notes.jsonl"
    out.write_text("my own notes\n")
    rc, _, err = cli(
        capsys, "--model", str(chat_dir), "--messages", str(msgs), "--out", str(out), "--device", "cpu"
    )
    assert rc == 2 and err.count("\n") == 1 and "was not written by kdistill" in err, err
    assert out.read_text() == "my own notes\n"


def test_out_resumes_after_a_kill(chat_dir, tmp_path, capsys):
    msgs = prompts_file(tmp_path / "p.jsonl", 12)
    out, ref = tmp_path / "a.jsonl", tmp_path / "ref.jsonl"
    argv = ["generate", "--model", str(chat_dir), "--messages", str(msgs), "--device", "cpu", "--batch-size", "2",
            "--max-new-tokens", "4", "--quiet"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "KDISTILL_TEST_GENERATE_CHUNK": "3",
           "KDISTILL_TEST_KILL_AT": "generate.2"}  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "kdistill", *argv, "--out", str(out)], env=env, capture_output=True
    )
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]  # killed after its second chunk
    kept = out.read_text().splitlines()
    assert len(kept) == 6
    with open(out, "a") as f:
        f.write('{"index": 11, "sample": 0, "te')  # a line torn by the kill
    m = json.loads((tmp_path / "a.jsonl.manifest.json").read_text())
    assert m["status"] == "running"
    rc, _, err = cli(capsys, *argv[1:], "--out", str(out))
    assert rc == 0, err
    rc, _, err = cli(capsys, *argv[1:], "--out", str(ref))
    assert rc == 0, err
    assert out.read_text() == ref.read_text()  # greedy: the resumed file equals an uninterrupted one
    assert set(kept) <= set(out.read_text().splitlines())


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--batch-size", "0"], "--batch-size is 0"),
        (["--temperature", "-0.5"], "--temperature is -0.5"),
        (["--top-p", "1.5"], "--top-p is 1.5"),
        (["--samples-per-prompt", "0"], "--samples-per-prompt is 0"),
        (["--max-new-tokens", "1000000000"], "expected fewer than the model's context"),
        (["--max-length", "4"], "prompt 1 has"),
        (["--max-length", "100000000"], "--max-length is 100000000"),
    ],
)
def test_bad_sizes_are_one_line_errors(chat_dir, capsys, argv, message):
    rc, _, err = cli(
        capsys, "--model", str(chat_dir), "--prompt", "the quick brown fox", "--device", "cpu", *argv
    )
    assert rc == 2 and err.count("\n") == 1 and message in err, err


def _equal_engines(a, b) -> bool:
    """Whether two engines' weights are the same bit for bit."""
    a, b = a.weights, b.weights
    same = [torch.equal(x, y) for x, y in ((a.embed, b.embed), (a.lm_head, b.lm_head), (a.norm, b.norm))]
    for la, lb in zip(a.layers, b.layers, strict=True):
        same += [torch.equal(t, getattr(lb, n)) for n, t in dataclasses.asdict(la).items() if t is not None]
    return all(same)


@pytest.mark.parametrize("tied,bias", [(True, True), (False, False)])
def test_a_refresh_copies_every_parameter_in_one_foreach_call_a_dtype_pair(tied, bias):
    """The on-policy refresh after an update: the engine (bf16 here, its own copies of an fp32 model)
    equals an engine built from the updated model, and the copies go out as one foreach call a
    (source, destination) dtype pair, not one copy launch a parameter (the host's time, in which the
    device waits, ~5 ms a step on Qwen2.5-0.5B). The next refresh of the same parameters reuses the
    copies without building the views again; a parameter given new storage makes it build them again."""
    from torch.profiler import ProfilerActivity, profile

    from kdistill.models.decoder import build_decoder
    from tests.test_contract import make_spec

    spec = make_spec(hidden=32, vocab=96, tied=tied, bias=bias)
    model = build_decoder(spec, seed=0).eval()
    eng = DecodeEngine(model, batch_size=2, max_len=32, dtype=torch.bfloat16)

    def update(scale: float) -> None:  # an optimizer step: every parameter changed in place
        with torch.no_grad():
            for i, p in enumerate(model.parameters()):
                p.add_(scale * (i + 1))

    def refresh() -> dict[str, int]:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            eng.refresh(model)
        return {e.key: e.count for e in prof.key_averages()}

    update(0.01)
    first = refresh()
    assert first.get("aten::_foreach_copy_") == 1  # every fp32 parameter into the bf16 engine at once
    assert _equal_engines(eng, DecodeEngine(model, batch_size=2, max_len=32, dtype=torch.bfloat16))
    update(-0.02)
    again = refresh()
    assert again.get("aten::_foreach_copy_") == 1 and "aten::slice" not in again  # no view built again
    assert _equal_engines(eng, DecodeEngine(model, batch_size=2, max_len=32, dtype=torch.bfloat16))
    p = model.model.layers[0].mlp.down_proj.weight
    p.data = p.data * 2  # new storage: the kept copies would read the old one
    moved = refresh()
    assert "aten::slice" in moved
    assert _equal_engines(eng, DecodeEngine(model, batch_size=2, max_len=32, dtype=torch.bfloat16))
