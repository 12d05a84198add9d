"""The decode engine's T-token step on the CPU (DecodeEngine.forward_at: speculative decoding's draft and
verify steps), whose attention is the T-token decode attention kernel (kernels/decode_attention.py).

- The T-token reference equals T one-token reference steps in order: outputs and both caches, with RoPE
  and without, for rows that cross a split, run into the cache's end, or start past it.
- forward_at with T tokens equals T one-token forward_at calls (hidden states and caches).
- The keys a speculative generate launches are planned and prewarmed, each specialized as its key says
  (Triton's own binder); a step longer than one tile's rows launches the planned chunks; a plan made for
  another draft length misses the verify step's key, and a key function that forgets T is caught.
- The T-token keys of a Qwen2.5-7B-shaped target (28 q heads, 4 kv heads of 128) build for sm_80 and
  sm_90 on this machine (triton.compile for a CUDA target).

The kernel itself against the reference under Triton's interpreter: tests/test_kernels_interp_cases.py
(case_decode_attention_multi, case_forward_at_multi).
"""

from __future__ import annotations

import pytest
import torch

from kdistill import dispatch
from kdistill.decode import DecodeEngine, Sampling, _Slots
from kdistill.kernels import contract, runtime, seal
from kdistill.kernels import decode_attention as kernel
from kdistill.kernels import plan as plan_mod
from kdistill.kernels.keys import KernelKey
from kdistill.models.hf_io import load_model
from kdistill.ops.attention import decode_attention_multi_reference, decode_attention_reference
from kdistill.speculative import SpeculativeDecoder
from tests.test_speculative import perturbed, ragged
from tests.tiny import make_tiny_model


def _one_token_steps(q, k, v, start, kn, vn, cos, sin):
    """T calls of the one-token reference in order -> (B, Hq, T, D)."""
    m = k.shape[2]
    outs = []
    for j in range(q.shape[2]):
        pos = (start + j).clamp(max=m - 1)
        outs.append(decode_attention_reference(q[:, :, j], k, v, pos, kn[:, :, j], vn[:, :, j], cos, sin))
    return torch.stack(outs, 2)


@pytest.mark.parametrize("rope", [False, True])
@pytest.mark.parametrize("hq,hkv,t", [(4, 2, 5), (6, 6, 2), (7, 1, 17)])
def test_t_token_reference_equals_t_one_token_steps_in_order(rope, hq, hkv, t):
    g = torch.Generator().manual_seed(hq * t)
    b, d, m = 5, 32, 90
    q = torch.randn((b, hq, t, d), generator=g, dtype=torch.float64)
    k = torch.randn((b, hkv, m, d), generator=g, dtype=torch.float64)
    v = torch.randn((b, hkv, m, d), generator=g, dtype=torch.float64)
    kn = torch.randn((b, hkv, t, d), generator=g, dtype=torch.float64)
    vn = torch.randn((b, hkv, t, d), generator=g, dtype=torch.float64)
    # from slot 0, across the first split of 64, into the cache's end, past it, the last slot alone
    start = torch.tensor([0, 62, m - 3, m + 4, m - 1])
    cos = sin = None
    if rope:
        angles = torch.randn((m, d // 2), generator=g, dtype=torch.float64).repeat(1, 2)
        cos, sin = angles.cos(), angles.sin()
    k1, v1, k2, v2 = k.clone(), v.clone(), k.clone(), v.clone()
    want = _one_token_steps(q, k1, v1, start, kn, vn, cos, sin)
    got = decode_attention_multi_reference(q, k2, v2, start, kn, vn, cos, sin)
    assert got.shape == (b, hq, t, d)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert torch.equal(k2, k1) and torch.equal(v2, v1)  # a repeated last slot keeps the last token's
    assert not torch.equal(k2, k)  # the step wrote its keys


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A two-layer qwen3 model per head size: 16 (RoPE kernel first), 32 (RoPE inside the attention)."""
    root = tmp_path_factory.mktemp("tokens")
    out = {}
    for head_dim in (16, 32):
        d = make_tiny_model(
            root / str(head_dim), family="qwen3", hidden_size=64, num_attention_heads=4,
            num_key_value_heads=2, head_dim=head_dim, num_hidden_layers=2,
        )  # fmt: skip
        out[head_dim] = d
    return out


@pytest.mark.parametrize("head_dim", [16, 32])
def test_a_t_token_step_equals_t_one_token_steps(tiny, head_dim):
    model = load_model(tiny[head_dim]).eval()
    eng = DecodeEngine(model, batch_size=3, max_len=20)
    prompts = [
        [5, 9, 17, 3, 8],
        [40, 41],
        [(7 * i) % 90 + 1 for i in range(17)],
    ]  # the last runs into the end
    ids = torch.randint(1, model.spec.vocab_size, (3, 5), generator=torch.Generator().manual_seed(1))
    caches = []
    with torch.no_grad():
        for whole in (True, False):
            st = _Slots(model.spec, 3, 20, 1, eng.dtype, eng.device)
            _, _, lens = eng.write_prompts(st, [0, 1, 2], prompts)
            if whole:
                want = eng.forward_at(st, ids, lens)
            else:
                got = torch.cat([eng.forward_at(st, ids[:, j : j + 1], lens + j) for j in range(5)], 1)
            caches.append(st)
    assert want.shape == (3, 5, model.spec.hidden_size)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for a, b in zip(caches[0].k + caches[0].v, caches[1].k + caches[1].v):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def _speculative_launches(tiny, head_dim, draft_tokens):
    d = tiny[head_dim]
    target, draft = load_model(d).eval(), perturbed(d, 0.01)
    with runtime.using(mode="reference", arch="sm_90"), runtime.recording(deep=True) as rec:
        SpeculativeDecoder(
            target,
            draft,
            draft_tokens=draft_tokens,
            batch_size=2,
            max_len=30,
            sampling=Sampling(max_new_tokens=6),
        ).generate(ragged(target.spec.vocab_size))
    return target, draft, rec


@pytest.mark.parametrize("head_dim", [16, 32])
def test_speculative_t_token_keys_are_planned_prewarmed_and_specialized_as_keyed(tiny, head_dim):
    target, draft, rec = _speculative_launches(tiny, head_dim, draft_tokens=4)
    plan = plan_mod.speculative_kernels(
        target.spec, draft.spec, "sm_90", "fp32", batch=2, prompt_len=11, max_len=30 + 5, draft_tokens=4
    )
    multi = {launch.key for launch in rec.launches if launch.key.op == "decode_attn_multi_split"}
    assert {k["T"] for k in multi} == {2, 5}  # the draft's two-token step, the verify step's K + 1
    assert {k["ROPE"] for k in multi} == {head_dim >= 32}
    assert all(launch.specialization is not None for launch in rec.launches if launch.key in multi)
    warm = seal.prewarm(plan, "cpu", dry=True)
    assert warm.failed == []
    triton = [launch for launch in rec.launches if not launch.key.is_library]  # prefills: library shapes
    assert contract.check(triton, plan, warm.specializations) == []
    # a plan for three draft tokens lacks the verify step's T = 5 key
    short = plan_mod.speculative_kernels(
        target.spec, draft.spec, "sm_90", "fp32", batch=2, prompt_len=11, max_len=30 + 5, draft_tokens=3
    )
    problems = contract.check(triton, short)
    assert problems and all("decode_attn_multi_split" in p and ",T=5," in p for p in problems), problems


def test_a_t_token_key_that_forgets_t_is_detected(tiny, monkeypatch):
    """A planted defect: the T-token key function leaves T out. The draft's two-token step and the verify
    step then launch two binaries under one key, and the plan made with the same function cannot tell."""
    registered = kernel.multi_split_key

    def forgetful(*a, **k):
        key = registered(*a, **k)
        return KernelKey(key.op, key.arch, tuple(p for p in key.params if p[0] != "T"))

    monkeypatch.setattr(kernel, "multi_split_key", forgetful)
    target, draft, rec = _speculative_launches(tiny, 32, draft_tokens=4)
    plan = plan_mod.speculative_kernels(
        target.spec, draft.spec, "sm_90", "fp32", batch=2, prompt_len=11, max_len=30 + 5, draft_tokens=4
    )
    triton = [launch for launch in rec.launches if not launch.key.is_library]
    assert {launch.key for launch in triton} <= plan  # the subset check alone is fooled
    problems = contract.check(triton, plan)
    assert any("decode_attn_multi_split" in p and "names two different kernels" in p for p in problems)


def test_a_step_past_one_tile_of_rows_launches_the_planned_chunks():
    """7 q heads per kv head: 36 tokens fill a tile of 256 rows, so a 41-token step is two launches."""
    assert kernel.token_chunks(41, 28, 4) == [36, 5]
    assert kernel.token_chunks(5, 28, 4) == [5] and kernel.token_chunks(72, 28, 4) == [36, 36]
    g = torch.Generator().manual_seed(0)
    b, hq, hkv, t, d, m = 2, 7, 1, 41, 32, 80
    q, kn, vn = (torch.randn((b, h, t, d), generator=g) for h in (hq, hkv, hkv))
    k, v = torch.randn((b, hkv, m, d), generator=g), torch.randn((b, hkv, m, d), generator=g)
    with runtime.using(mode="reference", arch="sm_90"), runtime.recording() as rec:
        dispatch.decode_attention_multi(q, k, v, torch.tensor([0, 30]), kn, vn)
    launched = {key["T"] for key in rec.keys() if key.op == "decode_attn_multi_split"}
    assert launched == {36, 5}
    planned = kernel.plan("sm_90", grad=False, head_dim=d, q_heads=hq, kv_heads=hkv, dtype="fp32",
                          max_len=m, rope=False, tokens=(t,))  # fmt: skip
    assert rec.keys() <= planned


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_t_token_keys_of_a_7b_target_build_for_cuda_archs(tmp_path, monkeypatch, arch):
    """The verify step's T = 5 (K = 4), the draft's two-token key and a 17-token one (a tile of 128 rows,
    8 warps), RoPE inside, bf16, at a 7B's heads (28 q heads over 4 kv heads of 128): triton.compile for
    the arch, each key checked against its warm launch first."""
    pytest.importorskip("triton")
    from kdistill.kernels import build, pack

    monkeypatch.setenv("KDISTILL_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    seal.setup_cache_dir()
    keys = kernel.plan(
        arch, grad=False, head_dim=128, q_heads=28, kv_heads=4, dtype="bf16", max_len=4096, tokens=(2, 5, 17)
    )
    multi = sorted((k for k in keys if k.op == "decode_attn_multi_split"), key=lambda k: k["T"])
    assert [k["T"] for k in multi] == [2, 5, 17]
    for key in multi:
        result = build.compile_key(key)
        assert result.ok, result.error
        assert pack.jit_compile(key).asm.get("cubin"), key  # the same binary, from Triton's cache: a cubin
