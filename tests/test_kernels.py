"""Kernel keys, dispatcher fallback, seal counting, the prewarm command without a GPU, and the
cross-arch build (tiny pair and the Qwen2.5-1.5B -> 0.5B presets) on a machine without a GPU."""

from __future__ import annotations

import argparse
import json
import os
import warnings

import pytest
import torch

from kdistill.commands.kernels import build_command, prewarm_command
from kdistill.dispatch import add_rmsnorm, rmsnorm, swiglu
from kdistill.errors import KernelCacheMiss, KernelError, UserError
from kdistill.kernels import keys, rope, runtime
from kdistill.kernels import rmsnorm as rms_kernel
from kdistill.kernels import seal as cache
from kdistill.kernels import swiglu as swiglu_kernel
from kdistill.ops.rmsnorm import rmsnorm_reference
from kdistill.ops.swiglu import swiglu_reference


# -- keys ---------------------------------------------------------------------------------------------
def test_f64_bits_are_exact_and_distinguish_close_floats():
    assert keys.f64_bits(1e-6) == "f64:3eb0c6f7a0b5ed8d"
    assert keys.f64_value(keys.f64_bits(1e-5)) == 1e-5
    assert keys.f64_bits(1e-6) != keys.f64_bits(1e-6 * (1 + 2**-52))


def test_key_is_frozen_hashable_and_round_trips_through_its_string():
    k = rms_kernel.fwd_key(
        "sm90", hidden=896, eps=1e-6, dtype=torch.bfloat16, w_dtype="float32", residual=True, r_dtype="fp32"
    )
    assert k.arch == "sm_90" and k["EPS"] == "f64:3eb0c6f7a0b5ed8d"
    assert keys.KernelKey.parse(str(k)) == k and hash(keys.KernelKey.parse(str(k))) == hash(k)
    with pytest.raises(dataclasses_frozen()):
        k.op = "x"
    import pickle

    copy = pickle.loads(pickle.dumps(k))
    assert copy == k and hash(copy) == hash(k) and copy["H"] == 896 and k.get("nope", 7) == 7
    assert repr(copy) == repr(k) and "_index" not in repr(k)
    with pytest.raises(KeyError, match="has no parameter 'nope'"):
        k["nope"]
    assert sorted([k, copy, keys.KernelKey("a", "sm_80", (("Z", 1), ("A", 2)))])[0].params == (
        ("A", 2),
        ("Z", 1),
    )
    assert str(k) == str(
        rms_kernel.fwd_key(
            "sm_90", hidden=896, eps=1e-6, dtype="bf16", w_dtype="fp32", residual=True, r_dtype="fp32"
        )
    )


def dataclasses_frozen():
    import dataclasses

    return dataclasses.FrozenInstanceError


@pytest.mark.parametrize(
    "change",
    [
        dict(eps=1e-5),
        dict(hidden=897),
        dict(dtype="fp32"),
        dict(residual=False),
        dict(aligned=(False, True, True)),
        dict(arch="sm_80"),
    ],
)
def test_every_parameter_changes_the_key(change):
    base = dict(arch="sm_90", hidden=896, eps=1e-6, dtype="bf16", w_dtype="bf16", residual=True)
    arch = change.pop("arch", base.pop("arch"))
    base.pop("arch", None)
    assert rms_kernel.fwd_key(arch, **{**base, **change}) != rms_kernel.fwd_key("sm_90", **base)


def test_rope_key_holds_block_sizes_and_not_theta():
    """The cos/sin tables are runtime inputs: every rope theta shares one binary."""
    a = rope.fwd_key("sm_90", head_dim=128, q_heads=12, kv_heads=2, dtype="bf16")
    assert (a["BLOCK_D"], a["BLOCK_HQ"], a["BLOCK_HKV"]) == (64, 16, 2)
    assert a.get("THETA") is None and "THETA" not in rope.FWD.source(a)["constexprs"]


def test_source_spec_marks_aligned_pointers_and_unspecialized_ints():
    k = swiglu_kernel.bwd_key("sm_90", inter=4864, dtype="bf16", aligned=(True, False, True))
    spec = swiglu_kernel.BWD.source(k)
    assert spec["signature"]["DY"] == "*bf16" and spec["constexprs"]["I"] == 4864
    assert (0,) in spec["attrs"] and (1,) not in spec["attrs"] and (3,) in spec["attrs"]  # outputs aligned
    r = rms_kernel.FWD.source(
        rms_kernel.fwd_key("sm_90", hidden=64, eps=1e-6, dtype="fp32", w_dtype="fp32", residual=False)
    )
    at = list(r["signature"]).index
    assert r["signature"]["n_rows"] == "i32" and (at("n_rows"),) not in r["attrs"]
    # a pointer left out of alignment specialization (the gather's ids): typed by the key, never divisible
    assert r["signature"]["IDS"] == "*fp32" and (at("IDS"),) not in r["attrs"]
    g = rms_kernel.FWD.source(
        rms_kernel.fwd_key(
            "sm_90", hidden=64, eps=1e-6, dtype="bf16", w_dtype="bf16", residual=False, gather=True
        )
    )
    assert g["signature"]["IDS"] == "*i64" and g["constexprs"]["GATHER"] is True


# -- dispatcher and fallback --------------------------------------------------------------------------
def _fallbacks(caught):
    return [w for w in caught if issubclass(w.category, runtime.KernelFallbackWarning)]


def test_configure_on_cpu_picks_reference_and_the_given_arch():
    rt = runtime.configure(kernels="auto", arch="sm_89", device="cpu")
    try:
        assert rt.mode == "reference" and rt.arch == "sm_89"
    finally:
        runtime.configure(kernels="reference")


def test_triton_mode_on_cpu_tensors_falls_back_once_per_key(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x, w = torch.randn(4, 8), torch.ones(8)
    with runtime.using(mode="triton"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ys = [rmsnorm(x, w, 1e-6) for _ in range(3)]
        rmsnorm(torch.randn(4, 16), torch.ones(16), 1e-6)  # another key: one more warning
    assert len(_fallbacks(caught)) == 2
    assert torch.equal(ys[0], rmsnorm_reference(x, w, 1e-6))
    with runtime.using(mode="triton", strict=True), pytest.raises(KernelError, match="strict"):
        rmsnorm(x, w, 1e-6)


def test_no_triton_falls_back_with_one_warning(monkeypatch):
    monkeypatch.setattr(runtime, "triton_available", lambda: False)
    g, u = torch.randn(3, 5), torch.randn(3, 5)
    with runtime.using(mode="triton"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y = [swiglu(g, u) for _ in range(2)][0]
    assert len(_fallbacks(caught)) == 1 and "not installed" in str(_fallbacks(caught)[0].message)
    assert torch.equal(y, swiglu_reference(g, u))


def test_kernel_that_raises_runs_the_reference_once_warned_and_errors_in_strict(monkeypatch):
    monkeypatch.setattr(runtime, "interpreting", lambda: True)  # let CPU tensors reach the launch
    g, u = torch.randn(3, 5, requires_grad=True), torch.randn(3, 5, requires_grad=True)
    with (
        runtime.using(mode="triton", forced_failures={"swiglu_fwd"}) as rt,
        warnings.catch_warnings(record=True) as caught,
    ):
        warnings.simplefilter("always")
        y1, y2 = swiglu(g, u), swiglu(g, u)
        y1.sum().backward()
        assert len(rt.failed) == 1
    assert len(_fallbacks(caught)) == 1 and "planted failure" in str(_fallbacks(caught)[0].message)
    assert torch.equal(y2, swiglu_reference(g, u)) and g.grad is not None
    with (
        runtime.using(mode="triton", strict=True, forced_failures={"swiglu_fwd"}),
        pytest.raises(KernelError, match="strict"),
    ):
        swiglu(g, u)


def test_reference_path_records_forward_and_backward_keys():
    x = torch.randn(2, 3, 8, requires_grad=True)
    r = torch.randn(2, 3, 8, requires_grad=True)
    w = torch.ones(8, requires_grad=True)

    with runtime.using(mode="reference", arch="sm_90"), runtime.recording() as rec:
        y, s = add_rmsnorm(x, r, w, 1e-5)
        y.sum().backward()  # s gets no gradient: HAS_DRES=False
    ops = sorted((launch.key.op, launch.key.get("HAS_DRES")) for launch in rec.launches)
    assert ops == [("rmsnorm_bwd", False), ("rmsnorm_fwd", None)]


# -- seal -----------------------------------------------------------------------------------------------
@pytest.fixture
def sealed_state():
    cache.unseal()
    yield
    cache.unseal()


def test_install_hooks_finds_this_triton_api():
    assert cache.install_hooks() in ("triton.knobs.runtime.jit_cache_hook", "JITFunction.cache_hook")


def test_compile_after_seal_is_counted_and_logged(sealed_state, capsys):
    cache._on_compile_start("before-seal")
    assert cache.jit_after_prewarm() == 0
    cache.seal(strict=False)
    key = swiglu_kernel.fwd_key("sm_90", inter=64, dtype="bf16")
    token = runtime.LAUNCHING.set(key)
    try:
        cache._on_compile_start("fallback-name")
    finally:
        runtime.LAUNCHING.reset(token)
    assert cache.jit_after_prewarm() == 1
    assert f"kernel cache miss after prewarm: {key}" in capsys.readouterr().err


def test_compile_after_seal_raises_in_strict_mode_naming_the_key(sealed_state):
    cache.seal(strict=True)
    key = rope.bwd_key("sm_90", head_dim=64, q_heads=14, kv_heads=2, dtype="bf16")
    token = runtime.LAUNCHING.set(key)
    try:
        with pytest.raises(KernelCacheMiss, match="rope_bwd"):
            cache._on_compile_start("x")
    finally:
        runtime.LAUNCHING.reset(token)


def test_triton_jit_cache_hook_is_chained_to_the_seal(sealed_state):
    import triton

    if not hasattr(getattr(triton, "knobs", None), "runtime"):
        pytest.skip("Triton without knobs")  # pragma: no cover
    cache.install_hooks()
    cache.seal(strict=False)
    triton.knobs.runtime.jit_cache_hook(
        key="k", repr="some_kernel[...]", fn=None, compile={}, is_manual_warmup=False, already_compiled=False
    )
    assert cache.cache_misses() == ["some_kernel[...]"]


def test_cache_dir_is_under_kdistill(monkeypatch, tmp_path):
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.setenv("KDISTILL_CACHE_DIR", str(tmp_path))
    assert cache.setup_cache_dir() == str(tmp_path / "triton")


# -- commands without a GPU -------------------------------------------------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_prewarm_without_gpu_says_so_and_points_to_build():
    args = argparse.Namespace(config="qwen2.5-1.5b:qwen2.5-0.5b", overrides=[])
    with pytest.raises(UserError, match="no CUDA GPU.*kernels build"):
        prewarm_command(args)


def test_build_rejects_a_bad_arch():
    args = argparse.Namespace(
        config="qwen2.5-1.5b:qwen2.5-0.5b", overrides=[], arch="sm_90,hopper", json=False
    )
    with pytest.raises(UserError, match="hopper"):
        build_command(args)


def _write_tiny_pair(folder):
    """teacher/ and student/ config.json directories (qwen3 with qk-norm, llama with llama3 rope) and a YAML."""
    import yaml

    from kdistill.models.spec import PRESETS

    t = {
        **PRESETS["qwen3-0.6b"],
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 300,
    }
    s = {
        **PRESETS["qwen3-0.6b"],
        "hidden_size": 48,
        "intermediate_size": 80,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "vocab_size": 300,
        "rms_norm_eps": 1e-5,
    }
    for name, cfg in (("teacher", t), ("student", s)):
        (folder / name).mkdir()
        (folder / name / "config.json").write_text(json.dumps(cfg))
    path = folder / "run.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "teacher": {"path": "teacher"},
                "student": {"path": "student"},
                "data": {"seq_len": 64},
                "schedule": {"batch_size": 2},
            }
        )
    )
    return path


def test_cross_arch_build_tiny_pair_from_yaml(tmp_path, capsys, monkeypatch):
    """A YAML config whose models are config.json directories, built for every default arch."""
    cfg = _write_tiny_pair(tmp_path)
    monkeypatch.setenv("KDISTILL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    args = argparse.Namespace(
        config=str(cfg),
        overrides=["kd.divergence=jsd"],
        arch="sm_80,sm_89,sm_90,sm_100,sm_120",
        json=True,
        out=str(tmp_path / "pack"),
    )
    assert build_command(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] and out["failed"] == 0
    assert {k["arch"] for k in out["kernels"]} == {"sm_80", "sm_89", "sm_90", "sm_100", "sm_120"}
    # the same build wrote the pack: every binary it built, per arch
    manifest = json.loads((tmp_path / "pack" / "manifest.json").read_text())
    assert sorted(manifest["kernels"]) == sorted(k["key"] for k in out["kernels"])
    assert {e["arch"] for e in manifest["kernels"].values()} == {k["arch"] for k in out["kernels"]}
    assert out["pack"].endswith(f"{len(out['kernels'])} kernels written, {len(out['kernels'])} in the pack")
    ops = {k["op"] for k in out["kernels"]}
    assert {
        "rmsnorm_fwd",
        "rmsnorm_bwd",
        "rope_fwd",
        "rope_bwd",
        "swiglu_fwd",
        "swiglu_bwd",
        "kd_loss",
    } <= ops


def test_the_64_row_decode_tile_builds_for_every_arch_with_its_prefetch(tmp_path, monkeypatch):
    """The matrix-vector kernel's 64-row tile (a narrow model's buckets of 33 to 64 rows) builds without
    a GPU for each arch: on archs with tensor memory its prefetch stays within what Triton's tcgen05 dot
    takes (a key of 1,024 prefetched inputs fails there), elsewhere it keeps the measured policy's."""
    from kdistill.kernels import decode_gemv
    from kdistill.kernels.build import compile_key

    monkeypatch.setenv("KDISTILL_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    for arch, tmem in (("sm_90", False), ("sm_100", True)):
        assert decode_gemv.tensor_memory(arch) == tmem
        key = decode_gemv.gemv_key(arch, n=896, k=896, dtype="bf16", epilogue=decode_gemv.EPI_NONE, rows=64)
        assert key["BLOCK_M"] == 64
        assert key["PRE_K"] == (decode_gemv.TMEM_MAX_PRE_K if tmem else 1024)
        result = compile_key(key)
        assert result.ok, result.error
    small = decode_gemv.gemv_key("sm_100", n=896, k=896, dtype="bf16", rows=32)
    assert small["PRE_K"] == 1024  # below 64 rows the dot is not tcgen05's: the policy's prefetch


PRESET_PAIR = "qwen2.5-1.5b:qwen2.5-0.5b"
PRESET_ARCHS = "sm_80,sm_89,sm_90,sm_100,sm_120"


@pytest.mark.slow
def test_cross_arch_build_qwen25_preset_pair(capsys, tmp_path, monkeypatch):
    """The Qwen2.5-1.5B -> 0.5B presets built for five archs: a kernel pack of this Triton holding every
    key of each arch's plan, each binary as its manifest says. scripts/test.sh builds that pack
    (`kdistill kernels build --arch ... --out build/kernel-pack`) before pytest and names it in
    KDISTILL_TEST_PRESET_PACK, so the suite checks it rather than compiling the same kernels again;
    without the variable the test builds the pack itself."""
    from pathlib import Path

    from kdistill.commands.common import resolve_run
    from kdistill.kernels import pack
    from kdistill.kernels.plan import required_kernels, triton_keys

    folder = os.environ.get("KDISTILL_TEST_PRESET_PACK")
    if not folder:
        monkeypatch.setenv("KDISTILL_CACHE_DIR", str(tmp_path))
        monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
        folder = str(tmp_path / "pack")
        args = argparse.Namespace(config=PRESET_PAIR, overrides=[], arch=PRESET_ARCHS, json=False, out=folder)
        assert build_command(args) == 0
        out = capsys.readouterr().out
        assert "FAILED" not in out and f"kernels built for {PRESET_ARCHS.replace(',', ', ')} in" in out
    manifest = pack.read_manifest(folder)
    cfg, teacher, student = resolve_run(PRESET_PAIR)
    for arch in PRESET_ARCHS.split(","):
        pack.check(manifest, Path(folder), arch)  # this Triton and build, this arch, this CUDA's ptxas
        want = {str(k) for k in triton_keys(required_kernels(teacher, student, cfg, arch))}
        assert want and want <= manifest.kernels.keys(), sorted(want - manifest.kernels.keys())[:3]
        for key in want:
            assert manifest.kernels[key].arch == arch
            pack.verified(Path(folder), manifest.kernels[key])  # every file's sha256
