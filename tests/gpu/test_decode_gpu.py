"""GPU tests of the decode engine (run on a GPU with `-m gpu`): the decode-attention kernels (one token
and T tokens per row) against the reference at real head shapes; the engine's T-token step against its
one-token steps; the CUDA-graph step's greedy tokens identical to the eager step's for
every row of a ragged batch with slot refill; generation after a strict prewarm compiles nothing at
three batch sizes and two prompt-length buckets; seeded sampling reproducible on the device.

    pytest -m gpu tests/gpu/test_decode_gpu.py -q
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kdistill import dispatch
from kdistill.decode import DecodeEngine, Sampling
from kdistill.generate import prepare_kernels
from kdistill.kernels import decode_gemv, seal
from kdistill.kernels.keys import make_key
from kdistill.models.decoder import build_decoder
from kdistill.models.spec import load_spec
from kdistill.ops.attention import decode_attention_reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize(
    "hq,hkv,d,m", [(14, 2, 64, 700), (12, 2, 128, 300), (32, 8, 128, 4100), (8, 8, 64, 33)]
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rope", [False, True])
@pytest.mark.parametrize("chained", [False, True])  # a small bucket's step: PDL, first tile before the wait
def test_decode_attention_kernel_matches_reference(hq, hkv, d, m, dtype, rope, chained):
    _attention_matches_reference(hq, hkv, d, m, dtype, rope, chained, [0, m - 1, m // 2, 255, 256])


@pytest.mark.parametrize("hq,hkv,d,m", [(14, 2, 64, 700), (12, 2, 128, 300)])
def test_a_wide_steps_decode_attention_matches_reference(hq, hkv, d, m):
    """More rows than WIDE_ROWS: splits of at least WIDE_SPLIT keys, several tiles each."""
    from kdistill.kernels import decode_attention

    rows = decode_attention.WIDE_ROWS + 6
    pos = [0, m - 1, 255, 256, 63, 64] + torch.randint(0, m, (rows - 6,)).tolist()
    with dispatch.recording() as rec:
        _attention_matches_reference(hq, hkv, d, m, torch.bfloat16, True, False, pos)
    assert [k["SPLIT"] for k in rec.keys()] == [decode_attention.split_len(m, rows)]


def _attention_matches_reference(hq, hkv, d, m, dtype, rope, chained, positions):
    g = torch.Generator(device="cuda").manual_seed(hq * m)
    b = len(positions)
    qkv = torch.randn((b, (hq + 2 * hkv) * d), generator=g, device="cuda", dtype=dtype)
    q = qkv[:, : hq * d].view(b, hq, d)  # the engine's layout: heads of one q/k/v row
    k = torch.randn((b, hkv, m, d), generator=g, device="cuda", dtype=dtype)
    v = torch.randn((b, hkv, m, d), generator=g, device="cuda", dtype=dtype)
    pos = torch.tensor(positions, device="cuda").clamp(max=m - 1)
    kn = torch.randn((b, hkv, d), generator=g, device="cuda", dtype=dtype)
    vn = torch.randn((b, 2, hkv, d), generator=g, device="cuda", dtype=dtype)[:, 0]  # strided rows
    cos = sin = ref_cos = ref_sin = None
    if rope:
        angles = torch.randn((m, d // 2), generator=g, device="cuda").repeat(1, 2)
        cos, sin = angles.cos(), angles.sin()
        ref_cos, ref_sin = cos.to(dtype).double(), sin.to(dtype).double()  # the kernel rounds them so
    kr, vr = k.double().clone(), v.double().clone()
    ref = decode_attention_reference(q.double(), kr, vr, pos, kn.double(), vn.double(), ref_cos, ref_sin)
    with dispatch.using(mode="triton", arch="sm_90"), dispatch.chained(chained):
        out = dispatch.decode_attention(q, k, v, pos, kn, vn, cos, sin)
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert err < 1e-2, err
    assert torch.isfinite(out).all()
    assert torch.equal(v.double(), vr)  # the new value in its slot, nothing else changed
    if rope:  # the rotated key, rounded once to the cache's dtype
        assert torch.allclose(k.double(), kr, rtol=1e-2, atol=1e-2)
    else:
        assert torch.equal(k.double(), kr)


@pytest.mark.parametrize(
    "hq,hkv,d,m", [(28, 4, 128, 700), (14, 2, 64, 4100), (16, 16, 128, 300), (32, 8, 128, 257)]
)
@pytest.mark.parametrize("t", [2, 5, 17])
@pytest.mark.parametrize("rope", [False, True])
def test_t_token_decode_attention_kernel_matches_reference(hq, hkv, d, m, t, rope):
    """The T-token kernel (speculative decoding's draft and verify steps) in bf16 against T one-token
    steps of the float64 reference in order: rows from slot 0, across a split, into the cache's end and
    past it; q, k and v as views of one (B, T, q/k/v) GEMM output, as the engine hands them over."""
    g = torch.Generator(device="cuda").manual_seed(hq * m + t)
    dtype, b, w = torch.bfloat16, 5, (hq + 2 * hkv) * d
    qkv = torch.randn((b, t, w), generator=g, device="cuda", dtype=dtype)
    q = qkv[..., : hq * d].view(b, t, hq, d).transpose(1, 2)  # (B, Hq, T, D)
    kn = qkv[..., hq * d : (hq + hkv) * d].view(b, t, hkv, d).transpose(1, 2)
    vn = qkv[..., (hq + hkv) * d :].view(b, t, hkv, d).transpose(1, 2)
    k = torch.randn((b, hkv, m, d), generator=g, device="cuda", dtype=dtype)
    v = torch.randn((b, hkv, m, d), generator=g, device="cuda", dtype=dtype)
    start = torch.tensor([0, 62, m - 3, m, m // 2], device="cuda")
    cos = sin = ref_cos = ref_sin = None
    if rope:
        angles = torch.randn((m, d // 2), generator=g, device="cuda").repeat(1, 2)
        cos, sin = angles.cos(), angles.sin()
        ref_cos, ref_sin = cos.to(dtype).double(), sin.to(dtype).double()  # the kernel rounds them so
    kr, vr = k.double().clone(), v.double().clone()
    ref = []
    for j in range(t):
        pos = (start + j).clamp(max=m - 1)
        qj, kj, vj = q[:, :, j].double(), kn[:, :, j].double(), vn[:, :, j].double()
        ref.append(decode_attention_reference(qj, kr, vr, pos, kj, vj, ref_cos, ref_sin))
    ref = torch.stack(ref, 2)
    with dispatch.using(mode="triton", arch="sm_90", strict=True):
        out = dispatch.decode_attention_multi(q, k, v, start, kn, vn, cos, sin)
    assert out.shape == (b, hq, t, d) and torch.isfinite(out).all()
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert err < 1e-2, err
    assert torch.equal(v.double(), vr)  # each new value in its slot (a repeated slot: the last), nothing else
    if rope:  # the rotated keys, rounded once to the cache's dtype
        assert torch.allclose(k.double(), kr, rtol=1e-2, atol=1e-2)
    else:
        assert torch.equal(k.double(), kr)


def test_t_token_step_equals_one_token_steps_on_the_device():
    """The engine's verify-shaped step (5 tokens per row, RoPE in the kernel, bf16) against 5 one-token
    steps: the same hidden states up to bf16 rounding, the same caches."""
    from kdistill.decode import _Slots

    model = _model(layers=2)
    eng = DecodeEngine(model, batch_size=4, max_len=300, cuda_graphs="off")
    prompts = _ragged(model.spec.vocab_size, [20, 64, 130, 297])  # the last runs into the cache's end
    ids = torch.tensor(_ragged(model.spec.vocab_size, [5] * 4, seed=1), device="cuda")
    out = []
    with torch.no_grad(), dispatch.using(mode="triton", arch="sm_90"):
        for whole in (True, False):
            st = _Slots(model.spec, 4, 300, 1, eng.dtype, eng.device)
            _, _, lens = eng.write_prompts(st, [0, 1, 2, 3], prompts)
            if whole:
                h = eng.forward_at(st, ids, lens)
            else:
                h = torch.cat([eng.forward_at(st, ids[:, j : j + 1], lens + j) for j in range(5)], 1)
            out.append((h.double(), st))
    (a, sa), (b, sb) = out
    err = ((a - b).norm() / b.norm()).item()
    assert err < 2e-2, err
    for x, y in zip(sa.k + sa.v, sb.k + sb.v):
        assert ((x.double() - y.double()).norm() / y.double().norm()).item() < 1e-2


@pytest.mark.parametrize("rows", [1, 5, 16, 23, 32, 40, 64])
@pytest.mark.parametrize(
    "n,k,epilogue",
    [
        (4864, 896, "swiglu"),
        (8960, 1536, "swiglu"),
        (896, 896, "none"),
        (1152, 896, "bias"),
        (896, 4864, "none"),  # K split over 4 programs
        (1536, 8960, "none"),  # past MAX_PLAIN_K: the long-K tile up to 32 rows (K split), then cuBLAS
        (2048, 1536, "bias"),  # read as it is by the attention: not split
    ],
)
def test_decode_gemv_kernel_matches_reference(rows, n, k, epilogue):
    g = torch.Generator(device="cuda").manual_seed(n + rows)
    x = torch.randn((rows, k), generator=g, device="cuda", dtype=torch.bfloat16)
    w = (
        torch.randn((2 * n if epilogue == "swiglu" else n, k), generator=g, device="cuda") / k**0.5
    ).bfloat16()
    bias = torch.randn(n, generator=g, device="cuda", dtype=torch.bfloat16) if epilogue == "bias" else None
    ref = torch.nn.functional.linear(x.double(), w.double(), None if bias is None else bias.double())
    if epilogue == "swiglu":
        gate, up = ref.chunk(2, dim=-1)
        ref = torch.nn.functional.silu(gate) * up
    with dispatch.using(mode="triton", arch="sm_90"):
        out = dispatch.decode_linear(x, w, bias, gate_up=epilogue == "swiglu")
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert out.shape == (rows, n) and err < 1e-2, err


@pytest.mark.parametrize("rows", [1, 16, 32, 64])
# down, o_proj split, not split, the long-K down (64 columns a program)
@pytest.mark.parametrize("n,k", [(896, 4864), (1536, 1536), (896, 896), (1536, 8960)])
def test_split_partials_summed_by_the_norm_equal_the_products_own_combine(rows, n, k):
    g = torch.Generator(device="cuda").manual_seed(n + k + rows)
    x = torch.randn((rows, k), generator=g, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn((n, k), generator=g, device="cuda") / k**0.5).bfloat16()
    residual = torch.randn((rows, 1, n), generator=g, device="cuda", dtype=torch.bfloat16)
    nw = (torch.rand(n, generator=g, device="cuda") + 0.5).bfloat16()
    with dispatch.using(mode="triton", arch="sm_90", strict=True), dispatch.chained(True):
        with dispatch.recording() as rec:
            y, summed = dispatch.decode_linear_add_rmsnorm(x, w, residual, nw, 1e-6)
        # the product at the same tiles with its own combine (unsplit: the plain product)
        gkeys = [key for key in rec.keys() if key.op == "decode_gemv"]
        if gkeys and gkeys[0]["SPLIT"] > 1:
            own = make_key(gkeys[0].op, gkeys[0].arch, **{**dict(gkeys[0].params), "COMBINE": True})
            delta = decode_gemv.run(decode_gemv.launch(own, x, w))[0]
        else:
            delta = dispatch.decode_linear(x, w)
        want_y, want_sum = dispatch.add_rmsnorm(delta[:, None], residual, nw, 1e-6)
    assert torch.equal(summed, want_sum) and torch.equal(y, want_y)
    split = {key["PARTS"] for key in rec.keys() if key.op == "rmsnorm_fwd"}
    parts = decode_gemv.split(n, k) if decode_gemv.serves(rows, k, decode_gemv.EPI_NONE, n) else 1
    assert split == {parts if parts > 1 else 0}  # a wide product past 16 rows: cuBLAS, nothing split


@pytest.mark.parametrize("rows", [1, 16, 32, 64])
@pytest.mark.parametrize(
    "n,k,inter,swiglu",
    [
        (896, 896, 4864, True),  # 0.5B: o_proj, gate/up
        (1536, 1536, 8960, True),  # 1.5B (o_proj split: its last program adds)
        (896, 4864, 1152, False),  # 0.5B: the down (split), the next q/k/v with its bias
        (1536, 8960, 2048, False),  # 1.5B: the long-K down, q/k/v
    ],
)
def test_a_norm_folded_into_the_products_around_it_matches_the_unfused_step(rows, n, k, inter, swiglu):
    """The product before the norm adding the residual and writing its sums of squares, the product after
    it (the norm's weight folded into its rows) scaling by each row's rstd: the residual sum and the
    output of the unfused product, add + norm and product, where a chained bucket's kernels serve both."""
    g = torch.Generator(device="cuda").manual_seed(n + k + rows)
    x = torch.randn((rows, k), generator=g, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn((n, k), generator=g, device="cuda") / k**0.5).bfloat16()
    residual = torch.randn((rows, 1, n), generator=g, device="cuda", dtype=torch.bfloat16)
    nw = (torch.rand(n, generator=g, device="cuda") + 0.5).bfloat16()
    wc = (torch.randn(((2 if swiglu else 1) * inter, n), generator=g, device="cuda") / n**0.5).bfloat16()
    bias = None if swiglu else torch.randn(inter, generator=g, device="cuda", dtype=torch.bfloat16)
    epi = decode_gemv.EPI_SWIGLU if swiglu else decode_gemv.EPI_BIAS
    with dispatch.using(mode="triton", arch="sm_90", strict=True), dispatch.chained(True):
        if not dispatch.folds(rows, n, k, inter, epi):  # a wide bucket, or a product left to cuBLAS
            served = decode_gemv.serves(rows, k, decode_gemv.EPI_NONE, n) and decode_gemv.serves(
                rows, n, epi, inter
            )
            assert rows > decode_gemv.FOLD_ROWS or not served
            return
        with dispatch.recording() as rec:
            summed, ss = dispatch.decode_linear_add_stats(x, w, residual)
            act = dispatch.decode_linear_scaled(summed, wc * nw[None, :], ss, 1e-6, bias, gate_up=swiglu)
        h, want_sum = dispatch.add_rmsnorm(dispatch.decode_linear(x, w)[:, None], residual, nw, 1e-6)
        want = dispatch.decode_linear(h[:, 0], wc, bias, gate_up=swiglu)
    assert {bool(key.get("ADD")) for key in rec.keys() if key.op == "decode_gemv"} == {True, False}
    assert not [key for key in rec.keys() if key.op == "rmsnorm_fwd"]
    err_sum = ((summed.double() - want_sum[:, 0].double()).norm() / want_sum.double().norm()).item()
    err = ((act.double() - want.double()).norm() / want.double().norm()).item()
    assert err_sum < 1e-2 and err < 2e-2, (err_sum, err)


def _model(preset: str = "qwen2.5-0.5b", layers: int = 4):
    spec = dataclasses.replace(load_spec(preset), num_layers=layers)
    return build_decoder(spec, "cuda", torch.bfloat16, seed=0).eval()


def _ragged(vocab: int, lens: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(100, vocab - 100, (n,), generator=g).tolist() for n in lens]


@pytest.mark.parametrize(
    "preset,batch",
    # the 1.5B: the long-K down; at 32 rows its chained 32-row step (gate/up on 64 columns a program,
    # 128-key attention splits); the 0.5B at 64 rows: its chained step with the wide attention splits
    [("qwen2.5-0.5b", 4), ("qwen2.5-1.5b", 4), ("qwen2.5-1.5b", 32), ("qwen2.5-0.5b", 64)],
)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_graph_step_equals_eager_step_for_every_row(temperature, preset, batch):
    """The captured step's tokens are the eager step's, greedy and sampled (the sampler kernel draws from
    the same uniforms), with refilled slots and ragged stops, full rounds replayed as one graph of their
    steps and shorter ones step by step; nothing compiles after the prewarm."""
    model = _model(preset)
    prepare_kernels(model, batch, 64, 400)
    lens = [17, 130, 64, 300, 5, 77, 250, 33, 9, 190]
    prompts = _ragged(model.spec.vocab_size, lens * (batch // 4))
    # a stop token that decoding meets: rows end at different steps and slots are refilled
    s = Sampling(max_new_tokens=48, temperature=temperature, seed=11)
    probe = DecodeEngine(model, batch_size=batch, max_len=400, sampling=s, cuda_graphs="off").generate(
        prompts
    )
    stop = {probe[0][5], probe[3][20]}
    graph = DecodeEngine(model, batch_size=batch, max_len=400, sampling=s, stop_ids=stop, cuda_graphs="on")
    eager = DecodeEngine(model, batch_size=batch, max_len=400, sampling=s, stop_ids=stop, cuda_graphs="off")
    a, b = graph.generate(prompts), eager.generate(prompts)
    assert a == b
    assert graph.slots.round_graph is not None and eager.slots.round_graph is None  # rounds of 8 steps
    assert len({len(r) for r in a}) > 1  # ragged completions: some rows stopped early
    if temperature:
        assert len({t for r in a for t in r}) > 100  # sampled: not one repeated token
    assert seal.jit_after_prewarm() == 0


def test_captured_prefill_gives_the_eager_prefills_tokens():
    """A prefill shape seen a second time is captured and replayed: the same tokens as the eager
    engine's, call after call, with nothing compiled after the seal."""
    model = _model()
    prepare_kernels(model, 4, 64, 200)
    seal.seal(strict=True)
    prompts = _ragged(model.spec.vocab_size, [40, 64, 17, 50])
    s = Sampling(max_new_tokens=24)
    want = DecodeEngine(model, batch_size=4, max_len=200, sampling=s, cuda_graphs="off").generate(prompts)
    eng = DecodeEngine(model, batch_size=4, max_len=200, sampling=s, cuda_graphs="on")
    for _ in range(3):  # eager (first sighting), captured, replayed
        assert eng.generate(prompts) == want
    assert list(eng.slots.prefill_graphs.graphs) == [(4, 64)]
    assert seal.jit_after_prewarm() == 0, seal.cache_misses()


def test_generation_after_strict_prewarm_compiles_nothing():
    model = _model(layers=2)
    lens_short, lens_long = [20, 31, 64], [200, 380, 255]
    prepare_kernels(model, 32, 64, 512)
    seal.seal(strict=True)
    for batch in (1, 8, 32):
        for lens in (lens_short, lens_long):
            eng = DecodeEngine(model, batch_size=batch, max_len=512, sampling=Sampling(max_new_tokens=16))
            out = eng.generate(_ragged(model.spec.vocab_size, lens * 3))
            assert all(len(r) == 16 for r in out)
    assert seal.jit_after_prewarm() == 0, seal.cache_misses()


def test_seeded_sampling_is_reproducible_on_the_device():
    model = _model(layers=2)
    prepare_kernels(model, 8, 64, 200)
    prompts = _ragged(model.spec.vocab_size, [10, 50, 30, 70, 12])
    s = Sampling(max_new_tokens=20, temperature=0.9, top_k=40, top_p=0.9, seed=3)
    a = DecodeEngine(model, batch_size=2, max_len=200, sampling=s).generate(prompts)
    b = DecodeEngine(model, batch_size=2, max_len=200, sampling=s).generate(prompts)
    c = DecodeEngine(model, batch_size=2, max_len=200, sampling=dataclasses.replace(s, seed=4)).generate(
        prompts
    )
    assert a == b and a != c


def test_speculative_decoding_with_a_draft_the_target_agrees_with():
    """A draft made of the target's first blocks, against a target whose last blocks add nothing (their
    o_proj and down_proj are zero): the whole round captured, nothing compiled after the strict seal,
    every draft token accepted up to rounding, and the target's own greedy tokens: where a row parts from
    the target decoding alone, the two tokens tie in the target's logits up to bf16 rounding (the verify
    step's products and attention over K + 1 tokens round differently from the one-token step's)."""
    import time

    from kdistill.speculative import SpeculativeDecoder, prepare_speculative_kernels

    target = _model(layers=4)
    with torch.no_grad():
        for block in target.model.layers[2:]:
            block.self_attn.o_proj.weight.zero_()
            block.mlp.down_proj.weight.zero_()
    draft = _model(layers=2)
    draft.load_state_dict(target.state_dict(), strict=False)  # the target's blocks 2 and 3 left out
    prepare_speculative_kernels(target, draft, 8, 100, 256, 4)
    seal.seal(strict=True)
    prompts = _ragged(target.spec.vocab_size, [20, 64, 33, 100, 7, 50, 80, 12])
    s = Sampling(max_new_tokens=64)
    alone = DecodeEngine(target, batch_size=8, max_len=256 + 5, sampling=s)
    dec = SpeculativeDecoder(target, draft, draft_tokens=4, batch_size=8, max_len=256, sampling=s)
    want, got = alone.generate(prompts), dec.generate(prompts)
    same = sum(a == b for a, b in zip(want, got))
    accepted = sum(a for a, _ in dec.stats) / max(1, 4 * sum(v for _, v in dec.stats))
    times = {}
    for name, gen in (("alone", alone), ("speculative", dec)):
        for batch in (1, 8):
            torch.cuda.synchronize()
            t = time.perf_counter()
            gen.generate(prompts[:batch])
            torch.cuda.synchronize()
            times[f"{name}_b{batch}_s"] = round(time.perf_counter() - t, 4)
    gaps = []
    for p, a, b in zip(prompts, want, got):
        at = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if at is None:
            assert len(a) == len(b)
            continue
        with torch.no_grad():  # the target's own logits where the two parted
            h = target(torch.tensor([p + a[:at]], device="cuda"))[0, -1].float()
            logits = h @ target.lm_head_weight.float().T
        gaps.append(float((logits[a[at]] - logits[b[at]]).abs() / (logits.max() - logits.min())))
    print(f"speculative: {same}/8 rows identical, tie gaps {gaps}, acceptance {accepted:.3f}, {times}")
    assert seal.jit_after_prewarm() == 0
    assert accepted >= 0.9 and same >= 4
    assert all(g <= 0.01 for g in gaps)  # a near tie: 1% of the logits' range, bf16 keeps 8 bits


@pytest.mark.parametrize("preset", ["qwen2.5-0.5b", "qwen2.5-1.5b"])
def test_a_refresh_from_fp32_masters_equals_a_fresh_engine(preset):
    """On-policy's refresh after an optimizer step: every fp32 parameter copied into the bf16 engine's
    stacked tensors (one foreach copy a dtype pair, kept for the next refresh) and the norms folded
    again, bit for bit what an engine built from the updated model holds."""
    spec = dataclasses.replace(load_spec(preset), num_layers=3)
    model = build_decoder(spec, "cuda", torch.float32, seed=0).eval()
    prepare_kernels(model, 4, 64, 64)
    eng = DecodeEngine(model, batch_size=4, max_len=64, dtype=torch.bfloat16, cuda_graphs="off")
    g = torch.Generator(device="cuda").manual_seed(1)
    for _ in range(2):  # the second refresh reuses the first one's foreach groups
        with torch.no_grad():
            for p in model.parameters():  # an update that changes every parameter
                p.add_(torch.randn(p.shape, generator=g, device="cuda") * 0.01)
        eng.refresh(model)
    assert eng.weights._copies is not None
    fresh = DecodeEngine(model, batch_size=4, max_len=64, dtype=torch.bfloat16, cuda_graphs="off")
    a, b = eng.weights, fresh.weights
    assert torch.equal(a.embed, b.embed) and torch.equal(a.norm, b.norm) and torch.equal(a.lm_head, b.lm_head)
    for la, lb in zip(a.layers, b.layers, strict=True):
        for name, t in dataclasses.asdict(la).items():
            if t is not None:
                assert torch.equal(t, getattr(lb, name)), name
    prompts = _ragged(spec.vocab_size, [5, 9, 3, 7])
    assert eng.generate(prompts) == fresh.generate(prompts)
