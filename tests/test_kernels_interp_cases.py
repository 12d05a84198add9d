"""Kernel-vs-reference cases, shared by the interpreter tests (CPU) and the GPU tests (full size).

No pytest tests here (functions are `case_*`): tests/test_kernels_interp.py runs them in a subprocess
with TRITON_INTERPRET=1 set before triton is imported; tests/gpu/test_kernels_gpu.py runs them on CUDA.
Each case runs the op through the dispatcher in strict triton mode (so a silent reference fallback
is an error) and compares values and gradients with the PyTorch reference at grad_output != 1.

    TRITON_INTERPRET=1 python tests/test_kernels_interp_cases.py     # prints one JSON line per case
"""

from __future__ import annotations

import json
import sys
import time
import traceback

import torch

TOL = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (2e-2, 2e-2)}


def _close(name, got, want, dtype, scale=1.0):
    atol, rtol = TOL[dtype]
    got, want = got.float(), want.float()
    if not torch.allclose(got, want, atol=atol * scale, rtol=rtol):
        err = (got - want).abs().max().item()
        raise AssertionError(f"{name}: max abs error {err:.3g} (atol {atol * scale}, rtol {rtol})")


def _grads(fn, inputs, outs_grad):
    outs = fn(*inputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    pairs = [(o, g) for o, g in zip(outs, outs_grad) if g is not None]
    grads = torch.autograd.grad(
        [o for o, _ in pairs], [i for i in inputs if i.requires_grad], [g for _, g in pairs]
    )
    return outs, grads


def _kernel_mode():
    from kdistill.kernels import runtime

    return runtime.using(mode="triton", strict=True)


def _leaf(shape, dtype, device, g, scale=1.0):
    return (torch.randn(shape, generator=g) * scale).to(device=device, dtype=dtype).requires_grad_(True)


def case_rmsnorm(
    device="cpu",
    dtype=torch.float32,
    rows=(3, 5),
    hidden=37,
    residual=True,
    use_ds=True,
    r_dtype=None,
    w_dtype=None,
):
    from kdistill import dispatch
    from kdistill.ops import rmsnorm as op

    g = torch.Generator().manual_seed(hidden)
    x = _leaf((*rows, hidden), dtype, device, g)
    w = _leaf((hidden,), w_dtype or dtype, device, g)
    with torch.no_grad():
        w.mul_(0.5).add_(1.0)
    inputs = [x, w]
    if residual:
        r = _leaf((*rows, hidden), r_dtype or dtype, device, g)
        inputs = [x, r, w]
    eps = 1e-6

    def kernel(*a):
        return dispatch.add_rmsnorm(a[0], a[1], a[2], eps) if residual else dispatch.rmsnorm(a[0], a[1], eps)

    def ref(*a):
        return (
            op.add_rmsnorm_reference(a[0], a[1], a[2], eps)
            if residual
            else op.rmsnorm_reference(a[0], a[1], eps)
        )

    ref_outs = ref(*inputs)
    ref_outs = ref_outs if isinstance(ref_outs, tuple) else (ref_outs,)
    dy = torch.randn(ref_outs[0].shape, generator=g).to(device=device, dtype=ref_outs[0].dtype) * 0.7
    ds = torch.randn(ref_outs[-1].shape, generator=g).to(device=device, dtype=ref_outs[-1].dtype) * 0.3
    og = [dy, ds if (residual and use_ds) else None] if residual else [dy]
    want_o, want_g = _grads(ref, inputs, og)
    with _kernel_mode():
        got_o, got_g = _grads(kernel, inputs, og)
    for i, (a, b) in enumerate(zip(got_o, want_o)):
        assert a.dtype == b.dtype, f"output {i} dtype {a.dtype} != {b.dtype}"
        _close(f"out{i}", a, b, a.dtype if a.dtype in TOL else dtype)
    for i, (a, b) in enumerate(zip(got_g, want_g)):
        _close(
            f"grad{i}",
            a,
            b,
            torch.bfloat16 if torch.bfloat16 in (dtype, a.dtype) else torch.float32,
            scale=(10.0 if i == len(got_g) - 1 else 1.0) * max(1.0, rows[0] * rows[1] / 64),
        )


def case_rope(device="cpu", dtype=torch.float32, b=2, hq=3, hkv=1, t=5, d=24):
    from kdistill import dispatch
    from kdistill.models.decoder import rope_tables
    from kdistill.models.spec import load_spec
    from kdistill.ops import rope as op

    g = torch.Generator().manual_seed(d)
    spec = load_spec("qwen2.5-0.5b")
    import dataclasses

    spec = dataclasses.replace(spec, head_dim=d)
    cos, sin = rope_tables(spec, t, device)
    # the decoder's layout: (B, T, H, D) projections viewed as (B, H, T, D)
    q = (
        torch.randn((b, t, hq, d), generator=g)
        .to(device=device, dtype=dtype)
        .transpose(1, 2)
        .requires_grad_(True)
    )
    k = (
        torch.randn((b, t, hkv, d), generator=g)
        .to(device=device, dtype=dtype)
        .transpose(1, 2)
        .requires_grad_(True)
    )
    dq = torch.randn((b, hq, t, d), generator=g).to(device=device, dtype=dtype) * 0.5
    dk = torch.randn((b, hkv, t, d), generator=g).to(device=device, dtype=dtype) * 1.5
    want_o, want_g = _grads(lambda a, c: op.rope_reference(a, c, cos, sin), [q, k], [dq, dk])
    with _kernel_mode():
        got_o, got_g = _grads(lambda a, c: dispatch.apply_rope(a, c, cos, sin), [q, k], [dq, dk])
    for name, a, w in zip(("q", "k", "dq", "dk"), (*got_o, *got_g), (*want_o, *want_g)):
        _close(name, a, w, dtype, scale=2.0)


def case_swiglu(device="cpu", dtype=torch.float32, rows=(3, 7), inter=37):
    from kdistill import dispatch
    from kdistill.ops import swiglu as op

    g = torch.Generator().manual_seed(inter)
    gate = _leaf((*rows, inter), dtype, device, g, 2.0)
    up = _leaf((*rows, inter), dtype, device, g)
    dy = torch.randn((*rows, inter), generator=g).to(device=device, dtype=dtype) * 0.6
    want_o, want_g = _grads(op.swiglu_reference, [gate, up], [dy])
    with _kernel_mode():
        got_o, got_g = _grads(dispatch.swiglu, [gate, up], [dy])
    for name, a, w in zip(("y", "dgate", "dup"), (*got_o, *got_g), (*want_o, *want_g)):
        _close(name, a, w, dtype, scale=2.0)


def case_rope_qkv_views(device="cpu", dtype=torch.float32, b=2, hq=4, hkv=2, t=5, d=16):
    """q and k as the decoder passes them: views into one (B, T, q + 2 kv) projection output. The
    outputs come back in the (B, T, H, D) layout that attention keeps (no copies around it)."""
    import dataclasses

    from kdistill import dispatch
    from kdistill.models.decoder import rope_tables
    from kdistill.models.spec import load_spec
    from kdistill.ops import rope as op

    g = torch.Generator().manual_seed(d + 1)
    spec = dataclasses.replace(load_spec("qwen2.5-0.5b"), head_dim=d)
    cos, sin = rope_tables(spec, t, device)
    qs, ks = hq * d, hkv * d
    qkv = _leaf((b, t, qs + 2 * ks), dtype, device, g)
    dq = torch.randn((b, hq, t, d), generator=g).to(device=device, dtype=dtype) * 0.5
    dk = torch.randn((b, hkv, t, d), generator=g).to(device=device, dtype=dtype) * 1.5

    def views(x):
        q = x[..., :qs].view(b, t, hq, d).transpose(1, 2)
        return q, x[..., qs : qs + ks].view(b, t, hkv, d).transpose(1, 2)

    want_o, want_g = _grads(lambda x: op.rope_reference(*views(x), cos, sin), [qkv], [dq, dk])
    with _kernel_mode():
        got_o, got_g = _grads(lambda x: dispatch.apply_rope(*views(x), cos, sin), [qkv], [dq, dk])
    for name, a, w in zip(("q", "k", "dqkv"), (*got_o, *got_g), (*want_o, *want_g)):
        _close(name, a, w, dtype, scale=2.0)
    for name, o in zip(("q", "k"), got_o):
        if not o.transpose(1, 2).is_contiguous():
            raise AssertionError(f"rotated {name} is not in the (B, T, H, D) layout: strides {o.stride()}")


def case_swiglu_down_fused(device="cpu", dtype=torch.float32, rows=(2, 5), inter=40, hidden=24):
    """The MLP's fused path: gu = [gate, up] (..., 2I) from one GEMM, SwiGLU on its halves in place,
    down_proj, SwiGLU recomputed in backward, d gate and d up written as the halves of one gradient."""
    import torch.nn.functional as F

    from kdistill import dispatch
    from kdistill.kernels import swiglu as kernel
    from kdistill.ops import swiglu as op

    g = torch.Generator().manual_seed(inter)
    gu = _leaf((*rows, 2 * inter), dtype, device, g, 2.0)
    w = _leaf((hidden, inter), dtype, device, g, 0.2)
    dy = torch.randn((*rows, hidden), generator=g).to(device=device, dtype=dtype) * 0.6
    if kernel.pair(*kernel.halves(gu.detach()))[2] != 2 * inter:
        raise AssertionError("the halves of gu were not read in place (row stride 2I)")
    want_o, want_g = _grads(lambda x, v: F.linear(op.swiglu_reference(*x.chunk(2, dim=-1)), v), [gu, w], [dy])
    with _kernel_mode():
        got_o, got_g = _grads(dispatch.swiglu_down, [gu, w], [dy])
    for name, a, b in zip(("y", "dgu", "dw"), (*got_o, *got_g), (*want_o, *want_g)):
        _close(name, a, b, dtype, scale=4.0)


def case_swiglu_halves(device="cpu", dtype=torch.float32, rows=(2, 5), inter=40):
    """SwiGLU on the halves of gu = [gate, up] (..., 2I) (an FP8 student's MLP): the values and the
    gradient of silu(gate) * up, and that gradient written as one (..., 2I) tensor whose halves the
    kernel wrote (no concatenation: it is not a fresh copy of two separate gradients)."""
    from kdistill import dispatch
    from kdistill.ops import swiglu as op

    g = torch.Generator().manual_seed(inter + 1)
    gu = _leaf((*rows, 2 * inter), dtype, device, g, 2.0)
    dy = torch.randn((*rows, inter), generator=g).to(device=device, dtype=dtype) * 0.6
    want_o, want_g = _grads(lambda x: op.swiglu_reference(*x.chunk(2, dim=-1)), [gu], [dy])
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    with _kernel_mode():
        y = dispatch.swiglu_halves(gu)
        with Ops() as ops:
            (dgu,) = torch.autograd.grad(y, gu, dy)
    _close("y", y, want_o[0], dtype, scale=4.0)
    _close("dgu", dgu, want_g[0], dtype, scale=4.0)
    if dgu.shape != gu.shape or "cat" in ops.names:
        raise AssertionError(f"the SwiGLU backward concatenated its gradient: {ops.names}")


def case_norm_to_gemm_autocast(device="cpu", rows=(3, 5), hidden=48):
    """A hidden-size norm under autocast (bf16) with an fp32 residual stream and weight: to_gemm writes
    y in bf16, the values autocast's cast of the fp32 output would give; its gradient comes in bf16."""
    from kdistill import dispatch
    from kdistill.ops import rmsnorm as op

    g = torch.Generator().manual_seed(hidden)
    x = _leaf((*rows, hidden), torch.bfloat16, device, g)
    r = _leaf((*rows, hidden), torch.float32, device, g)
    w = _leaf((hidden,), torch.float32, device, g, 0.3)
    dy = torch.randn((*rows, hidden), generator=g).to(device=device, dtype=torch.bfloat16)
    ds = torch.randn((*rows, hidden), generator=g).to(device=device) * 0.5

    def ref(a, b, c):
        y, s = op.add_rmsnorm_reference(a, b, c, 1e-6)
        return y.to(torch.bfloat16), s

    want_o, want_g = _grads(ref, [x, r, w], [dy, ds])
    with _kernel_mode(), torch.autocast(device if device != "cpu" else "cpu", dtype=torch.bfloat16):
        got_o, got_g = _grads(
            lambda a, b, c: dispatch.add_rmsnorm(a, b, c, 1e-6, to_gemm=True), [x, r, w], [dy, ds]
        )
    if got_o[0].dtype != torch.bfloat16 or got_o[1].dtype != torch.float32:
        raise AssertionError(f"dtypes y {got_o[0].dtype}, s {got_o[1].dtype}; expected bf16 and fp32")
    for name, a, b in zip(("y", "s", "dx", "dr", "dw"), (*got_o, *got_g), (*want_o, *want_g)):
        _close(name, a, b, torch.bfloat16, scale=2.0 if name != "dw" else 8.0)


def _tiny_decoder_spec(arch: str):
    """A 2-layer decoder config of `arch` (qwen3, qwen2 or llama) small enough for the interpreter."""
    from kdistill.models.spec import spec_from_hf_config

    names = {"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}
    return spec_from_hf_config(
        {
            "model_type": arch,
            "architectures": [names[arch]],
            "vocab_size": 50,
            "hidden_size": 40,
            "intermediate_size": 72,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 10,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
        }
    )


def case_decoder(device="cpu", dtype=torch.float32, arch="qwen3"):
    """A tiny decoder, forward and backward, kernels vs reference: the dispatch plumbing end to end."""
    from kdistill.kernels import runtime
    from kdistill.models.decoder import build_decoder

    spec = _tiny_decoder_spec(arch)
    ids = torch.randint(0, 50, (2, 6), generator=torch.Generator().manual_seed(1)).to(device)
    results = []
    for mode in ("reference", "triton"):
        model = build_decoder(spec, device=device, dtype=dtype, seed=3)
        with runtime.using(mode=mode, strict=True):
            h = model(ids)
            (h.float() * torch.linspace(-1, 2, h.shape[-1], device=device)).sum().backward()
        results.append((h.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (h_ref, g_ref), (h_k, g_k) = results
    _close("hidden", h_k, h_ref, dtype, scale=5.0)
    for name in g_ref:
        _close(name, g_k[name], g_ref[name], dtype, scale=20.0)


def case_frozen_forward_skips_autograd(device="cpu", dtype=torch.float32):
    """A frozen model's forward without grad (a teacher) launches the same kernels without their
    autograd Functions: bit-identical hidden states to the forward through the Functions."""
    from kdistill.kernels import rmsnorm, rope, runtime, swiglu
    from kdistill.models.decoder import build_decoder

    model = build_decoder(_tiny_decoder_spec("qwen2"), device=device, dtype=dtype, seed=3)
    ids = torch.randint(0, 50, (2, 6), generator=torch.Generator().manual_seed(1)).to(device)
    functions = (rmsnorm.RMSNormFunction, rope.RopeFunction, swiglu.SwiGLUFunction)
    applied: list[str] = []
    saved = {f: f.forward for f in functions}
    for f in functions:
        f.forward = staticmethod(lambda ctx, *a, _f=f: (applied.append(_f.__name__), saved[_f](ctx, *a))[1])
    try:
        with runtime.using(mode="triton", strict=True):
            through_functions = model(ids).detach()
            used = sorted(set(applied))
            applied.clear()
            model.requires_grad_(False)
            with torch.no_grad():
                frozen = model(ids)
    finally:
        for f in functions:
            f.forward = staticmethod(saved[f])
    assert used == ["RMSNormFunction", "RopeFunction"], used  # SwiGLU: recomputed in backward, no Function
    assert applied == [], applied
    assert torch.equal(frozen, through_functions)


def case_bwd_failure_falls_back(device="cpu", dtype=torch.float32):
    """A backward kernel that raises: the reference backward runs, one warning, gradients still right."""
    import warnings

    from kdistill import dispatch
    from kdistill.kernels import runtime
    from kdistill.kernels import swiglu as kernel
    from kdistill.ops import swiglu as op

    g = torch.Generator().manual_seed(0)
    gate, up = _leaf((4, 33), dtype, device, g), _leaf((4, 33), dtype, device, g)
    dy = torch.randn((4, 33), generator=g).to(device=device, dtype=dtype)
    want_o, want_g = _grads(op.swiglu_reference, [gate, up], [dy])
    saved = kernel.bwd_launch

    def broken(*a, **k):
        raise RuntimeError("planted backward failure")

    kernel.bwd_launch = broken
    try:
        with runtime.using(mode="triton", strict=False), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                got_o, got_g = _grads(dispatch.swiglu, [gate, up], [dy])
    finally:
        kernel.bwd_launch = saved
    fallbacks = [w for w in caught if issubclass(w.category, runtime.KernelFallbackWarning)]
    assert len(fallbacks) == 1, [str(w.message) for w in caught]
    for name, a, w in zip(("y", "dgate", "dup"), (*got_o, *got_g), (*want_o, *want_g)):
        _close(name, a, w, dtype)
    kernel.bwd_launch = broken
    try:
        with runtime.using(mode="triton", strict=True):
            try:
                _grads(dispatch.swiglu, [gate, up], [dy])
            except Exception as e:  # KernelError from strict mode
                assert "strict" in str(e), e
            else:
                raise AssertionError("strict mode did not raise on a failing backward kernel")
    finally:
        kernel.bwd_launch = saved


def case_decode_attention(
    device="cpu",
    dtype=torch.float32,
    b=4,
    hq=4,
    hkv=2,
    d=16,
    m=300,
    rope=False,
    chained=False,
    wide=False,
    mid=False,
    positions=(0, 37, 256),
    lanes=None,
):
    """One token per row over a static cache: rows whose newest slot is 0, inside the first split, on
    a split boundary and at the cache's end (empty splits must weigh nothing). rope: q and the new key
    arrive unrotated, q as a view into a q/k/v row (as the engine's step passes it), and the kernel
    rotates both at the row's position. chained: the key of a small bucket's step on an arch with
    programmatic dependent launch, whose split reads its first tile of cached keys before the wait.
    wide: the key of a step of more than WIDE_ROWS rows (the threshold lowered to this case's rows),
    whose splits run several tiles of keys. mid: the key of a step of 17 to 32 rows (the bound lowered to
    this case's rows), whose splits take at least MID_SPLIT keys. positions: the first rows' newest
    slots (the last row's is the cache's end). lanes: the parts the combine reads back at a time
    (key LANES; None: the policy, `combine_lanes`)."""
    from unittest import mock

    from kdistill import dispatch
    from kdistill.kernels import decode_attention as decode_kernel
    from kdistill.kernels import decode_gemv, runtime
    from kdistill.ops.attention import decode_attention_reference

    g = torch.Generator().manual_seed(m)
    qkv = torch.randn((b, (hq + 2 * hkv) * d), generator=g).to(device=device, dtype=dtype)
    q = qkv[:, : hq * d].view(b, hq, d) if rope else torch.randn((b, hq, d), generator=g).to(device, dtype)
    k = torch.randn((b, hkv, m, d), generator=g).to(device=device, dtype=dtype)
    v = torch.randn((b, hkv, m, d), generator=g).to(device=device, dtype=dtype)
    pos = torch.tensor([*positions, m - 1][:b], device=device)
    # the step's new k and v: k with contiguous rows, v a strided view (as the q/k/v GEMM gives it)
    kn = torch.randn((b, hkv, d), generator=g).to(device=device, dtype=dtype)
    vn = torch.randn((b, 3, hkv, d), generator=g).to(device=device, dtype=dtype)[:, 1]
    cos = sin = None
    if rope:  # any table will do: the kernel reads both halves of each row
        angles = torch.randn((m, d // 2), generator=g).repeat(1, 2).to(device)
        cos, sin = angles.cos(), angles.sin()
    kr, vr = k.float().clone(), v.float().clone()
    want = decode_attention_reference(q.float(), kr, vr, pos, kn.float(), vn.float(), cos, sin)
    # slots from each row's newest on hold anything (NaN here): the kernel must not read them, though
    # its first tile's loads are issued before it knows where the row ends
    past = torch.arange(m, device=device)[None, None, :, None] >= pos[:, None, None, None]
    k.masked_fill_(past, float("nan"))
    v.masked_fill_(past, float("nan"))
    ahead = torch.arange(m, device=device)[None, None, :, None] > pos[:, None, None, None]
    kr.masked_fill_(ahead, float("nan"))
    vr.masked_fill_(ahead, float("nan"))
    arch = {"arch": "sm_90"} if chained else {}
    empty_parts = decode_kernel.empty_parts

    def nan_parts(*args):  # the parts as NaN: a split past a row's end writes none, and none is read
        return tuple(t.fill_(float("nan")) for t in empty_parts(*args))

    with (
        runtime.using(mode="triton", strict=True, **arch),
        runtime.chained(chained),
        runtime.recording() as rec,
        mock.patch.object(decode_kernel, "WIDE_ROWS", b - 1 if wide else decode_kernel.WIDE_ROWS),
        mock.patch.object(decode_kernel, "MID_ROWS", (b - 1, b) if mid else decode_kernel.MID_ROWS),
        mock.patch.object(decode_kernel, "empty_parts", nan_parts),
        mock.patch.object(
            decode_kernel, "combine_lanes", (lambda *_: lanes) if lanes else decode_kernel.combine_lanes
        ),
    ):
        decode_kernel.split_key.cache_clear()  # the keys under this case's constants
        try:
            got = dispatch.decode_attention(q, k, v, pos, kn, vn, cos, sin)
        finally:
            decode_kernel.split_key.cache_clear()
        split = decode_kernel.split_len(m, b)  # under the lowered bounds
        policy = decode_kernel.combine_lanes(d, m, decode_kernel.min_split(b))
    assert [k["LANES"] for k in rec.keys()] == [lanes or policy]
    if lanes is None:  # a short step over a long cache of narrow heads reads its parts 16 at a time
        narrow_long = d <= decode_kernel.ONE_TILE_HEAD and m > decode_kernel.SHORT_CACHE and not wide
        assert policy == (decode_kernel.LONG_LANES if narrow_long else decode_kernel.COMBINE_LANES)
    # every (row, kv head)'s arrival count is back at zero: its used splits, no more, were counted
    assert not decode_gemv.counters(q.device, b * hkv)[: b * hkv].any()
    assert [k["PDL"] for k in rec.keys()] == [chained]
    assert [k["SPLIT"] for k in rec.keys()] == [split]
    bound = decode_kernel.WIDE_SPLIT if wide else decode_kernel.MID_SPLIT if mid else 0
    assert split == max(decode_kernel.split_len(m), bound)
    if wide:  # a wide step's split over a long cache reads a 64-wide head's keys 128 at a time
        long = m > decode_kernel.SHORT_CACHE and d <= decode_kernel.ONE_TILE_HEAD
        assert [k["BLOCK_N"] for k in rec.keys()] == [128 if long else 64]
    assert got.dtype == dtype and got.shape == (b, hq, d)
    _close("o", got, want, dtype)
    # the new key and value are in the cache, nothing else changed
    _close("k cache", k.float().nan_to_num(), kr.nan_to_num(), dtype)
    _close("v cache", v.float().nan_to_num(), vr.nan_to_num(), dtype)


def case_decode_attention_multi(
    device="cpu", dtype=torch.float32, b=5, hq=4, hkv=2, d=16, m=300, t=5, rope=False, starts=None
):
    """T new tokens per row in one launch, equal to T one-token steps in order (the one-token
    reference, token j's write before token j + 1's read): rows from slot 0, across a split boundary
    (slots 61..65 over splits of 64), into the cache's end (the later tokens clamped to its last slot)
    and wholly past it (every token on the last slot: each sees its own key, the slot keeps the last
    token's). q, k and v are views of one (B, T, q/k/v) GEMM output, as the engine's forward hands them
    over; rope: unrotated, rotated by the kernel at each token's slot."""
    from unittest import mock

    from kdistill import dispatch
    from kdistill.kernels import decode_attention as decode_kernel
    from kdistill.ops.attention import decode_attention_reference

    g = torch.Generator().manual_seed(m * t + d)
    w = (hq + 2 * hkv) * d
    qkv = torch.randn((b, t, w), generator=g).to(device=device, dtype=dtype)
    q = qkv[..., : hq * d].view(b, t, hq, d).transpose(1, 2)  # (B, Hq, T, D), token stride w
    kn = qkv[..., hq * d : (hq + hkv) * d].view(b, t, hkv, d).transpose(1, 2)
    vn = qkv[..., (hq + hkv) * d :].view(b, t, hkv, d).transpose(1, 2)
    k = torch.randn((b, hkv, m, d), generator=g).to(device=device, dtype=dtype)
    v = torch.randn((b, hkv, m, d), generator=g).to(device=device, dtype=dtype)
    starts = starts or [0, 61, m - 3, m, 17]
    start = torch.tensor(starts[:b], device=device)
    cos = sin = None
    if rope:
        angles = torch.randn((m, d // 2), generator=g).repeat(1, 2).to(device)
        cos, sin = angles.cos(), angles.sin()
    kr, vr = k.float().clone(), v.float().clone()
    want = []
    for j in range(t):  # T one-token steps, in order
        pos = (start + j).clamp(max=m - 1)
        want.append(
            decode_attention_reference(
                q[:, :, j].float(), kr, vr, pos, kn[:, :, j].float(), vn[:, :, j].float(), cos, sin
            )
        )
    empty_parts = decode_kernel.empty_multi_parts

    def nan_parts(*args):  # NaN: a split past a row's slots writes its log-sum-exp alone, its output unread
        return tuple(x.fill_(float("nan")) for x in empty_parts(*args))

    with _kernel_mode(), mock.patch.object(decode_kernel, "empty_multi_parts", nan_parts):
        got = dispatch.decode_attention_multi(q, k, v, start, kn, vn, cos, sin)
    assert got.dtype == dtype and got.shape == (b, hq, t, d)
    _close("o", got, torch.stack(want, 2), dtype)
    _close("k cache", k, kr, dtype)  # the new keys and values in their slots, nothing else changed
    _close("v cache", v, vr, dtype)


def case_forward_at_multi(device="cpu", dtype=torch.float32, head_dim=32):
    """The engine's T-token step (DecodeEngine.forward_at, as speculative decoding's verify step runs
    it) with the kernels equals T one-token steps of the reference path: hidden states and both caches,
    for rows mid-cache and one running into the cache's end. From a head of 32 on, RoPE inside the
    T-token kernel; at 16, the RoPE kernel first."""
    import tempfile

    from tiny import make_tiny_model

    from kdistill.decode import DecodeEngine, _Slots
    from kdistill.models.hf_io import load_model

    d = make_tiny_model(
        tempfile.mkdtemp(), family="qwen2", tied=False, hidden_size=64, num_attention_heads=4,
        num_key_value_heads=2, head_dim=head_dim, intermediate_size=48, num_hidden_layers=2,
    )  # fmt: skip
    model = load_model(d, device, dtype).eval()
    eng = DecodeEngine(model, batch_size=3, max_len=24, cuda_graphs="off")
    prompts = [[5, 9, 17, 3, 8, 2, 11], [40, 41, 42], [(7 * i) % 90 + 1 for i in range(21)]]
    g = torch.Generator().manual_seed(head_dim)
    ids = torch.randint(1, model.spec.vocab_size, (3, 5), generator=g).to(device)
    out = []
    for mode in ("reference", "triton"):
        st = _Slots(model.spec, 3, 24, 1, eng.dtype, eng.device)
        _, _, lens = eng.write_prompts(st, [0, 1, 2], prompts)
        with torch.no_grad():
            if mode == "reference":  # one token at a time, in order
                h = torch.cat([eng.forward_at(st, ids[:, j : j + 1], lens + j) for j in range(5)], 1)
            else:
                with _kernel_mode():
                    h = eng.forward_at(st, ids, lens)
        out.append((h, st))
    (want, ref), (got, st) = out
    assert got.shape == want.shape == (3, 5, model.spec.hidden_size)
    _close("hidden", got, want, dtype, scale=10)
    for i in range(model.spec.num_layers):
        _close(f"k cache {i}", st.k[i], ref.k[i], dtype, scale=10)
        _close(f"v cache {i}", st.v[i], ref.v[i], dtype, scale=10)


def case_decode_gemv(device="cpu", dtype=torch.float32, rows=3, n=40, k=48, epilogue="swiglu", split=0):
    """A decode step's linear at a few rows: plain, with a bias, and the stacked gate/up product with
    its SwiGLU, against the unfused reference (odd widths: masked columns). split: K split over that
    many programs by a key of its own (no PDL; the launcher's path, not the engine's policy)."""
    from kdistill import dispatch
    from kdistill.kernels import decode_gemv
    from kdistill.kernels.keys import make_key

    g = torch.Generator().manual_seed(n * k + rows)
    x = torch.randn((rows, k), generator=g).to(device=device, dtype=dtype)
    w = (torch.randn((2 * n if epilogue == "swiglu" else n, k), generator=g) / k**0.5).to(device, dtype)
    bias = torch.randn(n, generator=g).to(device, dtype) if epilogue == "bias" else None
    with torch.no_grad():
        y = torch.nn.functional.linear(x.float(), w.float(), None if bias is None else bias.float())
        if epilogue == "swiglu":
            gate, up = y.chunk(2, dim=-1)
            y = torch.nn.functional.silu(gate) * up
        code = {"none": decode_gemv.EPI_NONE, "bias": decode_gemv.EPI_BIAS, "swiglu": decode_gemv.EPI_SWIGLU}
        if split:
            key = decode_gemv.gemv_key("sm_80", n=n, k=k, dtype=dtype, epilogue=code[epilogue])
            k_split = -(-k // split)
            key = make_key(key.op, key.arch, **{**dict(key.params), "SPLIT": split, "K_SPLIT": k_split})
            got = decode_gemv.run(decode_gemv.launch(key, x, w, bias))[0]
        else:
            from kdistill.kernels import runtime

            with _kernel_mode(), runtime.recording() as rec:
                got = dispatch.decode_linear(x, w, bias, gate_up=epilogue == "swiglu")
            tiles = [key["BLOCK_M"] for key in rec.keys() if key.op == "decode_gemv"]
            if (
                epilogue == "swiglu" and k > decode_gemv.WIDE_SWIGLU_K and rows <= 16
            ):  # the wide SwiGLU's prefetch
                assert [key["PRE_K"] for key in rec.keys() if key.op == "decode_gemv"] == [
                    decode_gemv.PRE_K_WIDE_SWIGLU
                ]
            # the bucket's row tile where the kernel serves the product, else the library GEMM
            served = decode_gemv.serves(rows, k, code[epilogue], n)
            assert served == (
                rows <= 32 or (rows <= decode_gemv.MAX_ROWS and (epilogue == "swiglu" or k <= 1024))
            )
            assert tiles == ([decode_gemv.block_m(rows)] if served else []), tiles
            # the product the next kernel reads as it is: split only past MAX_PLAIN_K inputs
            for key in (key for key in rec.keys() if key.op == "decode_gemv"):
                long_k = code[epilogue] != decode_gemv.EPI_SWIGLU and k > decode_gemv.MAX_PLAIN_K
                assert (key["SPLIT"] > 1) == long_k, key
                assert key["BLOCK_N"] == (decode_gemv.LONG_BLOCK_N if long_k else key["BLOCK_N"])
                wide_swiglu = epilogue == "swiglu" and k > decode_gemv.WIDE_SWIGLU_K and key["BLOCK_M"] == 32
                assert (key["BLOCK_N"] == 64) == (long_k or wide_swiglu), key
    assert got.shape == (rows, n) and got.dtype == dtype
    _close("y", got, y, dtype)

    # a split product's last program sets its column block's arrival count back to zero
    assert int(decode_gemv.counters(x.device, 1).abs().sum()) == 0


def case_decode_norm_fold(
    device="cpu", dtype=torch.float32, rows=3, n=48, k=48, inter=24, consumer="gate_up"
):
    """A norm inside the products around it: the product before it (o_proj; the down) adds the residual
    and writes each row's sums of squares by column block (an ADD key; split over K, its last program
    adds), the product after it (gate/up; q/k/v with its bias: `inter` outputs), whose weights hold the
    norm's weight, scales each row by its rstd (an RSTD key): the residual sum equal to the unfused
    kernels', the output the unfused one's within rounding, no norm launch."""
    from kdistill import dispatch
    from kdistill.kernels import decode_gemv, runtime

    g = torch.Generator().manual_seed(n + k + inter + rows)
    x = torch.randn((rows, k), generator=g).to(device=device, dtype=dtype)
    w = (torch.randn((n, k), generator=g) / k**0.5).to(device, dtype)
    residual = torch.randn((rows, 1, n), generator=g).to(device, dtype)
    nw = (torch.rand(n, generator=g) + 0.5).to(device, dtype)
    swiglu = consumer == "gate_up"
    wc = (torch.randn(((2 if swiglu else 1) * inter, n), generator=g) / n**0.5).to(device, dtype)
    bias = None if swiglu else torch.randn(inter, generator=g).to(device, dtype)
    epi = decode_gemv.EPI_SWIGLU if swiglu else decode_gemv.EPI_BIAS
    eps = 1e-6
    with _kernel_mode(), runtime.chained(True):
        assert dispatch.folds(rows, n, k, inter, epi)
        with runtime.recording() as rec:
            summed, ss = dispatch.decode_linear_add_stats(x, w, residual)
            out = dispatch.decode_linear_scaled(summed, wc * nw[None, :], ss, eps, bias, gate_up=swiglu)
        want_h, want_sum = dispatch.add_rmsnorm(dispatch.decode_linear(x, w)[:, None], residual, nw, eps)
        want = dispatch.decode_linear(want_h[:, 0], wc, bias, gate_up=swiglu)
    gkeys = sorted((key for key in rec.keys() if key.op == "decode_gemv"), key=lambda key: not key.get("ADD"))
    assert [bool(key.get("ADD")) for key in gkeys] == [True, False]
    assert gkeys[1]["RSTD"] == ss.shape[0] == -(-n // gkeys[0]["BLOCK_N"])
    assert gkeys[1]["EPI"] == epi
    assert not [key for key in rec.keys() if key.op == "rmsnorm_fwd"]  # no norm launch
    assert summed.shape == (rows, n) and ss.shape[1] == rows
    if gkeys[0]["SPLIT"] == 1:  # the same product, the same rounding: the same sum
        assert torch.equal(summed, want_sum[:, 0])
    else:
        _close("sum", summed, want_sum[:, 0], dtype)
    _close("sums of squares", ss.sum(0), summed.float().pow(2).sum(-1), dtype)
    _close("out", out, want, dtype)
    # the references of both keys compute the same
    ref_sum, ref_ss = decode_gemv.add_stats_reference(x, w, residual[:, 0], int(gkeys[0]["BLOCK_N"]))
    _close("reference sum", ref_sum, summed, dtype)
    _close("reference sums of squares", ref_ss, ss, dtype, scale=10)
    ref_out = decode_gemv.scaled_reference(summed, wc * nw[None, :], ss, eps, bias, swiglu=swiglu)
    _close("reference out", ref_out, out, dtype)
    assert int(decode_gemv.counters(x.device, 1).abs().sum()) == 0


def case_decode_linear_add_rmsnorm(device="cpu", dtype=torch.float32, rows=3, n=20, k=1536):
    """A small bucket's o_proj or down with the residual add + norm after it: the product split over K
    hands its fp32 partials to the norm kernel, which sums them in split order; the same values as the
    product combining them itself, then the add + norm."""
    from kdistill import dispatch
    from kdistill.kernels import decode_gemv, runtime
    from kdistill.kernels.keys import make_key

    g = torch.Generator().manual_seed(n + k)
    x = torch.randn((rows, k), generator=g).to(device=device, dtype=dtype)
    w = (torch.randn((n, k), generator=g) / k**0.5).to(device, dtype)
    residual = torch.randn((rows, 1, n), generator=g).to(device, dtype)
    nw = torch.rand(n, generator=g).to(device, dtype) + 0.5
    assert decode_gemv.split(n, k) > 1
    with _kernel_mode(), runtime.chained(True), runtime.recording() as rec:
        y, summed = dispatch.decode_linear_add_rmsnorm(x, w, residual, nw, 1e-6)
    parts = {key["PARTS"] for key in rec.keys() if key.op == "rmsnorm_fwd"}
    assert parts == {decode_gemv.split(n, k)}
    (gkey,) = [key for key in rec.keys() if key.op == "decode_gemv"]
    assert not gkey["COMBINE"]
    # the same split with the product's own combine (its last-arriving program sums the partials)
    own = make_key(gkey.op, gkey.arch, **{**dict(gkey.params), "COMBINE": True})
    with _kernel_mode(), runtime.chained(True):
        delta = decode_gemv.run(decode_gemv.launch(own, x.contiguous(), w))[0]
        want_y, want_sum = dispatch.add_rmsnorm(delta[:, None], residual, nw, 1e-6)
    assert y.shape == summed.shape == residual.shape
    assert torch.equal(summed, want_sum) and torch.equal(y, want_y)
    with torch.no_grad():
        ref_y, ref_sum = dispatch.add_rmsnorm_reference(
            x.double() @ w.double().T, residual.double()[:, 0], nw.double(), 1e-6
        )
    _close("sum", summed[:, 0], ref_sum, dtype)
    _close("y", y[:, 0], ref_y, dtype)


def case_embed_rmsnorm(
    device="cpu", dtype=torch.float32, vocab=50, hidden=40, ids=(7, 0, 7, 49, 3), chained=True
):
    """A decode step's embedding lookup inside its first norm (one launch, the GATHER key): the rows it
    keeps are the table's rows bit for bit, and its output is the plain norm kernel's on those rows
    (the same arithmetic), within rounding of the float64 reference; repeated ids and the table's
    first and last rows included."""
    from kdistill import dispatch
    from kdistill.kernels import runtime
    from kdistill.kernels.keys import pdl
    from kdistill.ops.rmsnorm import rmsnorm_reference

    g = torch.Generator().manual_seed(vocab + hidden)
    table = torch.randn((vocab, hidden), generator=g).to(device, dtype)
    w = (torch.rand(hidden, generator=g) + 0.5).to(device, dtype)
    tok = torch.tensor(ids, dtype=torch.int64, device=device)
    with _kernel_mode(), runtime.chained(chained), runtime.recording() as rec:
        y, kept = dispatch.embed_rmsnorm(tok, table, w, 1e-6)
    keys = [k for k in rec.keys() if k.op == "rmsnorm_fwd"]
    assert [(k["GATHER"], k["HAS_RESIDUAL"]) for k in keys] == [(True, False)], keys
    assert all(k["PDL"] == (chained and pdl(k.arch)) for k in keys)
    assert y.shape == kept.shape == (len(ids), hidden) and y.dtype == kept.dtype == dtype
    assert torch.equal(kept, table[tok])
    with _kernel_mode(), runtime.chained(chained):
        plain = dispatch.rmsnorm(table[tok], w, 1e-6)
    assert torch.equal(y, plain)
    ref = rmsnorm_reference(table[tok].double(), w.double(), 1e-6)
    _close("y", y, ref, dtype)


def case_decode_engine(device="cpu", dtype=torch.float32, head_dim=16, temperature=0.0, layers=1):
    """The decode engine's tokens with the kernels equal the reference ops' (slot refill, a stop token,
    a head size the decode-attention kernel takes; from 32 on, with RoPE inside it), greedy or sampled
    (the same uniforms: the sampler kernel's inverse CDF picks the reference's tokens)."""
    import tempfile

    from tiny import make_tiny_model

    from kdistill.decode import DecodeEngine, Sampling
    from kdistill.models.hf_io import load_model

    d = make_tiny_model(
        tempfile.mkdtemp(), family="qwen2", tied=False, hidden_size=32, num_attention_heads=2,
        num_key_value_heads=1, head_dim=head_dim, intermediate_size=48, num_hidden_layers=layers,
    )  # fmt: skip
    model = load_model(d, device, dtype).eval()
    prompts = [[5, 9, 17, 3], [40, 41], [7, 8, 9, 10, 11, 12]]
    s = Sampling(max_new_tokens=4, temperature=temperature, seed=5)
    want = DecodeEngine(model, batch_size=2, max_len=16, sampling=s, stop_ids={3}).generate(prompts)
    with _kernel_mode():
        eng = DecodeEngine(model, batch_size=2, max_len=16, sampling=s, stop_ids={3})
        got = eng.generate(prompts)
    assert got == want, (got, want)
    assert eng.weights.fold_post and eng.weights.fold_input  # no product split: both norms folded


def case_decode_sample(device="cpu", dtype=torch.float32, rows=6, vocab=5000, temperature=0.0):
    """A decode step's sampler and bookkeeping in one kernel against the reference (ops/sample.py), over
    a vocabulary of three chunks (the last ragged): greedy, the first index of a maximum planted twice
    across chunks; sampled, the token of the exact (float64) inverse CDF wherever u is not within
    rounding of a token's boundary. The rows' state covers a done row (pad id, nothing grows), a stop
    id, a row at its budget, one at the cache's end, and one that goes on."""
    from kdistill import dispatch
    from kdistill.decode import Sampling
    from kdistill.kernels import decode_gemv, runtime
    from kdistill.ops.sample import Rows, sample_append

    g = torch.Generator().manual_seed(vocab + rows)
    logits = (torch.randn((rows, vocab), generator=g) * 3).to(device=device, dtype=dtype)
    logits[0, 4321] = logits[0, 17] = logits[0].max() + 1  # a tie across chunks: the first index wins
    u = torch.rand(rows, generator=g).to(device)
    s = Sampling(max_new_tokens=4, temperature=temperature)
    i64 = dict(dtype=torch.int64, device=device)

    def state():
        return dict(
            tok=torch.zeros(rows, **i64),
            lens=torch.tensor([5, 7, 9, 3, 15, 6][:rows], **i64),
            ngen=torch.tensor([1, 0, 2, 3, 1, 2][:rows], **i64),
            limit=torch.tensor([4, 4, 4, 4, 4, 4][:rows], **i64),
            done=torch.tensor([False, True, False, False, False, False][:rows], device=device),
            out=torch.full((rows, 5), -7, **i64),
        )

    want, got = state(), state()
    with torch.no_grad():
        first = logits.argmax(-1) if s.greedy else None
        stop = int(first[2]) if s.greedy else 11
        stops = torch.tensor([stop, 99999], **i64)
        args = (stops, 3, 16)  # pad id 3, 16 slots
        sample_append(logits, u, s, Rows(*want.values(), *args))
        with _kernel_mode(), runtime.recording() as rec:
            dispatch.decode_sample(logits, u, s, Rows(*got.values(), *args))
    assert [k.op for k in rec.keys()] == ["decode_sample"]
    assert int(decode_gemv.counters(logits.device, rows).abs().sum()) == 0  # the rows' counts reset
    if s.greedy:
        assert int(got["tok"][0]) == 17
        for name in want:
            assert torch.equal(got[name], want[name]), (name, got[name], want[name])
        return
    # sampled: the exact inverse CDF (float64) at u up to rounding: the token's interval of the CDF
    # holds u times the total within eps; where u is farther than eps from the exact token's bounds,
    # the kernel's token and the reference's are the exact one
    cdf = torch.softmax(logits.double() / temperature, -1).cumsum(-1)
    target = u.double() * cdf[:, -1]
    eps = 1e-5
    live = ~state()["done"]
    tok = got["tok"].clamp(0, vocab - 1)
    lo = torch.where(tok > 0, cdf.gather(1, (tok - 1).clamp(min=0)[:, None])[:, 0], 0.0)
    hi = cdf.gather(1, tok[:, None])[:, 0]
    assert bool(((lo - eps <= target) & (target <= hi + eps) & (hi > lo))[live].all()), (lo, target, hi)
    exact = torch.searchsorted(cdf, target[:, None], right=True)[:, 0]
    e_lo = torch.where(exact > 0, cdf.gather(1, (exact - 1).clamp(min=0)[:, None])[:, 0], 0.0)
    e_hi = cdf.gather(1, exact[:, None])[:, 0]
    far = live & (target - e_lo > eps) & (e_hi - target > eps)
    assert torch.equal(got["tok"][far], exact[far]) and torch.equal(want["tok"][far], exact[far])
    same = got["tok"] == want["tok"]  # then the same bookkeeping
    for name in want:
        assert torch.equal(got[name][same], want[name][same]), name


def case_fp8_quant_cols(device="cpu", dtype=torch.float32, rows=1100, cols=45):
    """The transposed FP8 quantisation (an FP8 student's backward operands): scales equal to the
    reference's, and the transposed tile holds the bytes the row-wise kernel writes for x^T. Several
    spans of rows with a ragged last one (the column maxima combined across spans), columns past one
    block and not a multiple of it, an all-zero column, and a column's largest value in the last
    span. On a GPU the bytes are also compared with the reference; the interpreter's float8 conversion is not the GPU's (it
    rounds some values that round up to a power of two differently, and e4m3 subnormals, below
    2^-6), so here that is checked for every other value."""
    from kdistill import dispatch
    from kdistill.kernels import fp8_quant_cols

    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, cols, generator=g) * torch.logspace(-2, 2, cols)).to(device=device, dtype=dtype)
    x[:, 1] = 0
    x[rows - 1, 2] = 2 * x[:, 2].abs().max()  # column 2's maximum in the last span only
    with _kernel_mode():
        qt, s = dispatch.quantize_cols(x)  # (C, R), (C,)
        q_rows, s_rows = dispatch.quantize_rows(x.t().contiguous())
    rq, rs = fp8_quant_cols.reference(x)
    assert qt.shape == (cols, rows) and qt.is_contiguous() and s.shape == (cols,)
    assert torch.equal(s, rs) and torch.equal(s_rows, rs), "scales differ from the reference"
    assert torch.equal(qt.view(torch.uint8), q_rows.view(torch.uint8)), "transposed bytes differ"
    diff = qt.float() != rq.float()
    if device != "cpu":
        assert not diff.any(), f"{int(diff.sum())} values differ from the reference"
    else:
        m = rq.float().abs()[diff]
        ok = (m == torch.exp2(torch.log2(m).round())) | (m < 2.0**-6)
        assert bool(ok.all()), "values differ from the reference"


CASES = {
    "bwd_failure_falls_back": (case_bwd_failure_falls_back, {}),
    "frozen_forward_skips_autograd": (case_frozen_forward_skips_autograd, {}),
    "rmsnorm_fp32_odd": (case_rmsnorm, dict(dtype=torch.float32)),
    "rmsnorm_bf16_odd": (case_rmsnorm, dict(dtype=torch.bfloat16)),
    "rmsnorm_plain_fp32": (case_rmsnorm, dict(dtype=torch.float32, residual=False, hidden=64)),
    "rmsnorm_plain_bf16_qk": (
        case_rmsnorm,
        dict(dtype=torch.bfloat16, residual=False, hidden=16, rows=(2, 9)),
    ),
    "rmsnorm_no_dres_bf16": (case_rmsnorm, dict(dtype=torch.bfloat16, use_ds=False, hidden=50)),
    "rmsnorm_mixed_bf16_fp32": (
        case_rmsnorm,
        dict(dtype=torch.bfloat16, r_dtype=torch.float32, w_dtype=torch.float32),
    ),
    "rope_fp32_odd": (case_rope, dict(dtype=torch.float32)),
    "rope_bf16": (case_rope, dict(dtype=torch.bfloat16, hq=4, hkv=2, d=16)),
    "swiglu_fp32_odd": (case_swiglu, dict(dtype=torch.float32)),
    "swiglu_bf16_blocks": (case_swiglu, dict(dtype=torch.bfloat16, rows=(2, 3), inter=1500)),
    "rope_qkv_views_bf16": (case_rope_qkv_views, dict(dtype=torch.bfloat16)),
    "swiglu_down_fused_fp32": (case_swiglu_down_fused, dict(dtype=torch.float32)),
    "swiglu_down_fused_bf16": (case_swiglu_down_fused, dict(dtype=torch.bfloat16, inter=24)),
    "swiglu_halves_fp32": (case_swiglu_halves, dict(dtype=torch.float32)),
    "norm_to_gemm_autocast": (case_norm_to_gemm_autocast, {}),
    "decoder_qwen3_fp32": (case_decoder, dict(dtype=torch.float32, arch="qwen3")),
    "decoder_qwen2_fp32": (case_decoder, dict(dtype=torch.float32, arch="qwen2")),
    "decode_attention_fp32": (case_decode_attention, dict(dtype=torch.float32)),
    # fp32 only: the interpreter's dot of bf16 tiles is not the GPU's (the GPU tests cover bf16/fp16)
    "decode_attention_fp32_gqa3": (case_decode_attention, dict(dtype=torch.float32, hq=6, hkv=2, d=32)),
    # a cache long enough that its splits grow past one tile (the combine's parts stay <= 64)
    "decode_attention_fp32_long": (
        case_decode_attention,
        dict(dtype=torch.float32, b=4, hq=2, hkv=1, m=4200),
    ),
    "decode_attention_multi_fp32": (case_decode_attention_multi, dict(dtype=torch.float32)),
    "decode_attention_multi_fp32_rope_two": (
        case_decode_attention_multi,
        dict(dtype=torch.float32, hq=6, hkv=2, d=32, t=2, rope=True),
    ),
    # 17 tokens x 7 q heads: 119 rows (a tile of 128, 8 warps), splits of 128 keys (a long cache)
    "decode_attention_multi_fp32_rope_17": (
        case_decode_attention_multi,
        dict(dtype=torch.float32, b=4, hq=7, hkv=1, d=32, m=4200, t=17, rope=True, starts=[0, 120, 4190, 9]),
    ),
    # 64 q heads per kv head: 5 tokens are 320 rows, past one tile: two launches (4 tokens, then 1)
    "decode_attention_multi_fp32_chunks": (
        case_decode_attention_multi,
        dict(dtype=torch.float32, b=3, hq=64, hkv=1, d=16, m=130, t=5, starts=[0, 62, 128]),
    ),
    "forward_at_multi_fp32_rope_in_attention": (case_forward_at_multi, dict(head_dim=32)),
    "forward_at_multi_fp32_rope_kernel_first": (case_forward_at_multi, dict(head_dim=16)),
    "decode_engine_fp32": (case_decode_engine, {}),
    "decode_engine_fp32_sampled": (case_decode_engine, dict(head_dim=32, temperature=0.8)),
    # two blocks: the norm after the first block's down inside it and the second block's q/k/v
    "decode_engine_fp32_two_blocks": (case_decode_engine, dict(layers=2)),
    # the sampler and bookkeeping kernel: greedy (a tie across chunks), sampled (the inverse CDF)
    "decode_sample_fp32_greedy": (case_decode_sample, {}),
    "decode_sample_bf16_greedy": (case_decode_sample, dict(dtype=torch.bfloat16, rows=5)),
    "decode_sample_fp32_sampled": (case_decode_sample, dict(temperature=0.7)),
    "decode_gemv_fp32_swiglu": (case_decode_gemv, dict(rows=3, n=40, k=48, epilogue="swiglu")),
    "decode_gemv_fp32_bias_one_row": (case_decode_gemv, dict(rows=1, n=37, k=144, epilogue="bias")),
    "decode_gemv_fp32_plain_16_rows": (case_decode_gemv, dict(rows=16, n=24, k=256, epilogue="none")),
    # past the 256 inputs loaded before the wait: the K loop
    "decode_gemv_fp32_swiglu_k_loop": (case_decode_gemv, dict(rows=4, n=40, k=400, epilogue="swiglu")),
    # few column blocks: a product the next kernel reads as it is is not split (1,024 inputs before the
    # wait, then the loop)
    "decode_gemv_fp32_bias_k_loop": (case_decode_gemv, dict(rows=5, n=20, k=1536, epilogue="bias")),
    "decode_gemv_fp32_plain_k_loop": (case_decode_gemv, dict(rows=2, n=2000, k=3008, epilogue="none")),
    # K split over 3 programs by a key of its own: the last to arrive adds the partials and the bias
    "decode_gemv_fp32_split_k_bias": (case_decode_gemv, dict(rows=5, n=20, k=1536, epilogue="bias", split=3)),
    # plain products past MAX_PLAIN_K inputs: the long-K tile (64 columns a program, K split, 512 inputs
    # before the wait, then the loop)
    "decode_gemv_fp32_long_k": (case_decode_gemv, dict(rows=3, n=72, k=5248, epilogue="none")),
    # 17 to 64 rows (a narrow product): the 32- or 64-row tile (split products too); past 64 rows, or a
    # plain product of more than NARROW inputs past 32, the library GEMM (and the SwiGLU kernel)
    "decode_gemv_fp32_swiglu_20_rows": (case_decode_gemv, dict(rows=20, n=40, k=48, epilogue="swiglu")),
    "decode_gemv_fp32_bias_32_rows": (case_decode_gemv, dict(rows=32, n=20, k=1536, epilogue="bias")),
    "decode_gemv_fp32_swiglu_40_rows": (case_decode_gemv, dict(rows=40, n=40, k=48, epilogue="swiglu")),
    "decode_gemv_fp32_bias_40_rows": (case_decode_gemv, dict(rows=40, n=20, k=1536, epilogue="bias")),
    "decode_gemv_fp32_swiglu_72_rows": (case_decode_gemv, dict(rows=72, n=40, k=48, epilogue="swiglu")),
    # the norm after o_proj inside o_proj (the residual add, sums of squares) and gate/up (the rstd)
    "decode_norm_fold_fp32": (case_decode_norm_fold, {}),
    "decode_norm_fold_fp32_split": (case_decode_norm_fold, dict(rows=5, n=32, k=1536, inter=40)),
    "decode_norm_fold_fp32_16_rows": (case_decode_norm_fold, dict(rows=16, n=80, k=64)),
    # the norm after the down: the down (K split over 4, its last program adding) then q/k/v with its bias
    "decode_norm_fold_fp32_down_qkv": (
        case_decode_norm_fold,
        dict(rows=4, n=32, k=2048, inter=24, consumer="qkv"),
    ),
    "decode_engine_fp32_rope_in_attention": (case_decode_engine, dict(head_dim=32)),
    "decode_attention_fp32_rope": (
        case_decode_attention,
        dict(dtype=torch.float32, hq=6, hkv=2, d=32, rope=True),
    ),
    # the chained split: its first tile of cached keys read before the wait, the rest by the loop
    "decode_attention_fp32_rope_chained_long": (
        case_decode_attention,
        dict(dtype=torch.float32, b=4, hq=2, hkv=1, d=32, m=4200, rope=True, chained=True),
    ),
    "decode_attention_fp32_chained": (case_decode_attention, dict(dtype=torch.float32, chained=True)),
    # a wide step's splits of 256 keys: four tiles each, a row's newest slot on the second split's first
    "decode_attention_fp32_rope_wide": (
        case_decode_attention,
        dict(dtype=torch.float32, hq=6, hkv=2, d=32, rope=True, wide=True),
    ),
    # a step of 17 to 32 rows: splits of 128 keys, one tile of 128 for a 64-wide head; chained
    "decode_attention_fp32_rope_mid_chained": (
        case_decode_attention,
        dict(
            dtype=torch.float32, hq=6, hkv=2, d=32, rope=True, chained=True, mid=True, positions=(0, 127, 128)
        ),
    ),
    # a narrow model's wide step, chained: its first tile before the wait, three tiles in flight
    "decode_attention_fp32_rope_wide_chained": (
        case_decode_attention,
        dict(dtype=torch.float32, hq=6, hkv=2, d=32, rope=True, wide=True, chained=True),
    ),
    # the combine reading eight parts a round trip: rows of 1, 3, 6 and 9 used splits (of 128 keys)
    "decode_attention_fp32_rope_lanes8": (
        case_decode_attention,
        dict(dtype=torch.float32, hq=6, hkv=2, d=32, m=1100, rope=True, lanes=8, positions=(0, 300, 700)),
    ),
    # the policy's lanes over a long cache of narrow heads (16 a round trip): rows of 1, 3, 6 and 9 used
    # splits, all of a row's parts in one round trip
    "decode_attention_fp32_rope_long_lanes": (
        case_decode_attention,
        dict(dtype=torch.float32, hq=6, hkv=2, d=32, m=1100, rope=True, positions=(0, 300, 700)),
    ),
    # a wide step over a long cache: splits of 256 keys in tiles of 128, rows ending on a split's last
    # slot, inside one and at the cache's end
    "decode_attention_fp32_rope_wide_long": (
        case_decode_attention,
        dict(dtype=torch.float32, hq=6, hkv=2, d=32, m=1100, rope=True, wide=True, positions=(0, 255, 700)),
    ),
    # a wide step over a cache one split holds: the output written directly (no parts, no count)
    "decode_attention_fp32_rope_wide_one_split": (
        case_decode_attention,
        dict(dtype=torch.float32, hq=6, hkv=2, d=32, m=200, rope=True, wide=True, positions=(0, 64, 130)),
    ),
    # the step's embedding lookup inside its first norm, chained or not, a hidden size not a power of 2
    "embed_rmsnorm_fp32": (case_embed_rmsnorm, {}),
    "embed_rmsnorm_bf16_unchained": (case_embed_rmsnorm, dict(dtype=torch.bfloat16, chained=False)),
    # a split product's partials summed by the residual add + norm after it (o_proj, down)
    "decode_linear_add_rmsnorm_fp32": (case_decode_linear_add_rmsnorm, {}),
    "decode_linear_add_rmsnorm_fp32_16_rows": (case_decode_linear_add_rmsnorm, dict(rows=16, n=40, k=2048)),
    "decode_linear_add_rmsnorm_fp32_32_rows": (case_decode_linear_add_rmsnorm, dict(rows=27, n=40, k=2048)),
    # a SwiGLU over more than NARROW inputs: fewer inputs loaded before the wait, the rest in the loop
    "decode_gemv_fp32_swiglu_wide": (case_decode_gemv, dict(rows=5, n=40, k=1104, epilogue="swiglu")),
    # and at 17 to 32 rows: 64 columns a program (two column blocks here, the second masked)
    "decode_gemv_fp32_swiglu_wide_24_rows": (
        case_decode_gemv,
        dict(rows=24, n=80, k=1104, epilogue="swiglu"),
    ),
    # plain products past MAX_PLAIN_K inputs at 17 to 32 rows: the long-K tile with 32 rows a program
    "decode_gemv_fp32_long_k_24_rows": (case_decode_gemv, dict(rows=24, n=72, k=5248, epilogue="none")),
    # the SwiGLU epilogue applied by the last of a column block's K splits (the policy keeps it whole)
    "decode_gemv_fp32_swiglu_split": (
        case_decode_gemv,
        dict(rows=3, n=40, k=1100, epilogue="swiglu", split=3),
    ),
    "fp8_quant_cols_fp32": (case_fp8_quant_cols, dict(dtype=torch.float32)),
    "fp8_quant_cols_narrow": (case_fp8_quant_cols, dict(dtype=torch.float32, rows=5, cols=3)),
    # fp32: the interpreter rounds float8 ties away from even, and bf16 inputs make exact ties common
    # (the GPU tests cover bf16); rows a multiple of 16 take the kernel's other store
    "fp8_quant_cols_blocks": (case_fp8_quant_cols, dict(dtype=torch.float32, rows=1040, cols=72)),
    # x^T's rows wider than the row-wise kernel's block: its two-pass path
    "fp8_quant_cols_long": (case_fp8_quant_cols, dict(dtype=torch.float32, rows=2100, cols=3)),
}


def run_case(name: str, device: str = "cpu", **overrides) -> dict:
    fn, kw = CASES[name]
    t0 = time.perf_counter()
    try:
        fn(device=device, **{**kw, **overrides})
        return {"case": name, "ok": True, "seconds": round(time.perf_counter() - t0, 3)}
    except Exception as e:
        return {
            "case": name,
            "ok": False,
            "error": f"{e.__class__.__name__}: {e}",
            "trace": traceback.format_exc()[-2000:],
        }


if __name__ == "__main__":
    for name in sys.argv[1:] or CASES:
        print(json.dumps(run_case(name)), flush=True)
