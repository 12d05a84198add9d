"""GPU tests of the decode engine (run on a GPU with `-m gpu`): the decode-attention kernel against its
reference at real head shapes; the CUDA-graph step's greedy tokens identical to the eager step's for
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
from kdistill.kernels import seal
from kdistill.models.decoder import build_decoder
from kdistill.models.spec import load_spec
from kdistill.ops.attention import decode_attention_reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize(
    "hq,hkv,d,m", [(14, 2, 64, 700), (12, 2, 128, 300), (32, 8, 128, 4100), (8, 8, 64, 33)]
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rope", [False, True])
def test_decode_attention_kernel_matches_reference(hq, hkv, d, m, dtype, rope):
    g = torch.Generator(device="cuda").manual_seed(hq * m)
    b = 5
    qkv = torch.randn((b, (hq + 2 * hkv) * d), generator=g, device="cuda", dtype=dtype)
    q = qkv[:, : hq * d].view(b, hq, d)  # the engine's layout: heads of one q/k/v row
    k = torch.randn((b, hkv, m, d), generator=g, device="cuda", dtype=dtype)
    v = torch.randn((b, hkv, m, d), generator=g, device="cuda", dtype=dtype)
    pos = torch.tensor([0, m - 1, m // 2, 255, 256], device="cuda").clamp(max=m - 1)
    kn = torch.randn((b, hkv, d), generator=g, device="cuda", dtype=dtype)
    vn = torch.randn((b, 2, hkv, d), generator=g, device="cuda", dtype=dtype)[:, 0]  # strided rows
    cos = sin = ref_cos = ref_sin = None
    if rope:
        angles = torch.randn((m, d // 2), generator=g, device="cuda").repeat(1, 2)
        cos, sin = angles.cos(), angles.sin()
        ref_cos, ref_sin = cos.to(dtype).double(), sin.to(dtype).double()  # the kernel rounds them so
    kr, vr = k.double().clone(), v.double().clone()
    ref = decode_attention_reference(q.double(), kr, vr, pos, kn.double(), vn.double(), ref_cos, ref_sin)
    with dispatch.using(mode="triton", arch="sm_90"):
        out = dispatch.decode_attention(q, k, v, pos, kn, vn, cos, sin)
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert err < 1e-2, err
    assert torch.isfinite(out).all()
    assert torch.equal(v.double(), vr)  # the new value in its slot, nothing else changed
    if rope:  # the rotated key, rounded once to the cache's dtype
        assert torch.allclose(k.double(), kr, rtol=1e-2, atol=1e-2)
    else:
        assert torch.equal(k.double(), kr)


@pytest.mark.parametrize("rows", [1, 5, 16])
@pytest.mark.parametrize(
    "n,k,epilogue", [(4864, 896, "swiglu"), (8960, 1536, "swiglu"), (896, 896, "none"), (1152, 896, "bias")]
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


def _model(preset: str = "qwen2.5-0.5b", layers: int = 4):
    spec = dataclasses.replace(load_spec(preset), num_layers=layers)
    return build_decoder(spec, "cuda", torch.bfloat16, seed=0).eval()


def _ragged(vocab: int, lens: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(100, vocab - 100, (n,), generator=g).tolist() for n in lens]


def test_graph_step_equals_eager_step_for_every_row():
    model = _model()
    prepare_kernels(model, 4, 64, 400)
    prompts = _ragged(model.spec.vocab_size, [17, 130, 64, 300, 5, 77, 250, 33, 9, 190])
    # a stop token that greedy decoding meets: rows end at different steps and slots are refilled
    s = Sampling(max_new_tokens=48)
    probe = DecodeEngine(model, batch_size=4, max_len=400, sampling=s, cuda_graphs="off").generate(prompts)
    stop = {probe[0][5], probe[3][20]}
    graph = DecodeEngine(model, batch_size=4, max_len=400, sampling=s, stop_ids=stop, cuda_graphs="on")
    eager = DecodeEngine(model, batch_size=4, max_len=400, sampling=s, stop_ids=stop, cuda_graphs="off")
    a, b = graph.generate(prompts), eager.generate(prompts)
    assert a == b
    assert len({len(r) for r in a}) > 1  # ragged completions: some rows stopped early
    assert seal.jit_after_prewarm() == 0


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
    every draft token accepted up to rounding, and the target's own greedy tokens."""
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
    print(f"speculative: {same}/8 rows identical, acceptance {accepted:.3f}, {times}")
    assert seal.jit_after_prewarm() == 0
    assert same >= 7 and accepted >= 0.9
