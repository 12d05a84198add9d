"""The key contract, proven on a CPU: launched keys ⊆ required_kernels, one key = one binary, and
prewarm covers every launch; then planted defects that each must make the check fail.

The reference path records the key it would launch (forward, and backward when grads flow) and, in
deep mode, asks Triton's own binder how the launch's actual arguments would specialize for a CUDA
target. See kdistill/kernels/contract.py for the four rules.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kdistill.config import DIVERGENCES, RunConfig
from kdistill.dtypes import long_name
from kdistill.kernels import contract, keys, library, rope, runtime, swiglu
from kdistill.kernels import plan as plan_mod
from kdistill.kernels import rmsnorm as rms_kernel
from kdistill.kernels import seal as cache
from kdistill.models.decoder import build_decoder
from kdistill.models.fp8 import convert_to_fp8
from kdistill.models.fp8_train import convert_student_to_fp8
from kdistill.models.spec import spec_from_hf_config
from kdistill.train.step import compute_loss, heldout_eval

ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
TORCH = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def make_spec(
    arch="qwen2",
    hidden=32,
    inter=48,
    layers=2,
    heads=4,
    kv=2,
    head_dim=8,
    eps=1e-6,
    theta=1e4,
    tied=True,
    vocab=40,
    llama3=False,
    bias=False,
):
    cfg = {
        "model_type": arch,
        "architectures": [ARCHS[arch]],
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": head_dim,
        "rms_norm_eps": eps,
        "rope_theta": theta,
        "tie_word_embeddings": tied,
        "attention_bias": bias,
    }
    if llama3:
        cfg["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
    return spec_from_hf_config(cfg)


def make_run(dtype="float32", batch=2, seq=5, divergence="forward_kl", alpha=0.5, chunk=4, logits="float32"):
    run = RunConfig()
    run.runtime.dtype, run.schedule.batch_size, run.data.seq_len = dtype, batch, seq
    run.kd.divergence, run.kd.alpha, run.kd.chunk_size = divergence, alpha, chunk
    run.kd.logits_dtype = logits
    return run


def run_step(
    teacher_spec,
    student_spec,
    run,
    arch="sm_90",
    deep=True,
    seed=0,
    checkpointing=False,
    student_dtype=None,
    keep_swiglu=False,
) -> runtime.Recorder:
    """A training step and a held-out eval step as train/loop.py does them, on the reference path,
    with the loop's dtypes (teacher in the compute dtype, fp32 student, autocast), recording keys.
    checkpointing: the student's blocks recomputed in backward; student_dtype: its weights' dtype
    (default the plan's: fp32 masters); keep_swiglu: its MLPs keep their SwiGLU output."""
    prec = plan_mod.precision(run, arch)
    teacher = (
        build_decoder(teacher_spec, dtype=TORCH[prec.teacher_weights], seed=seed).eval().requires_grad_(False)
    )
    if run.teacher.precision == "fp8":  # as the loop loads it (train/recipe.py teacher_precision)
        convert_to_fp8(teacher)
    student = build_decoder(student_spec, dtype=student_dtype or TORCH[prec.student_weights], seed=seed + 1)
    if run.runtime.precision == "fp8":  # as the loop loads it (train/loading.py student_precision)
        convert_student_to_fp8(student)
    student.checkpoint_blocks(checkpointing)
    student.keep_swiglu(keep_swiglu)
    g = torch.Generator().manual_seed(seed)
    b, t = run.schedule.batch_size, run.data.seq_len
    ids = torch.randint(0, student_spec.vocab_size, (b, t), generator=g)
    labels = torch.randint(0, student_spec.vocab_size, (b * t,), generator=g)
    labels[::3] = run.kd.ignore_index
    amp = torch.autocast("cpu", dtype=TORCH[prec.compute], enabled=prec.autocast)
    # The loop's own functions: the KD head's operand casts and calls are spelled in one place.
    with runtime.using(mode="reference", arch=arch), runtime.recording(deep=deep) as rec:
        compute_loss(student, teacher, ids, labels, run, amp).loss.backward()
        heldout_eval(student, teacher, [(ids, labels)], run, torch.device("cpu"), amp, with_teacher_loss=True)
    return rec


def contract_problems(teacher_spec, student_spec, run, arch="sm_90", rec=None) -> list[str]:
    rec = rec or run_step(teacher_spec, student_spec, run, arch)
    plan = plan_mod.required_kernels(teacher_spec, student_spec, run, arch)
    warm = cache.prewarm(
        plan, "cpu", dry=True
    )  # a key prewarm cannot even build a launch for is a problem too
    return [f"prewarm failed: {f}" for f in warm.failed] + contract.check(
        rec.launches, plan, warm.specializations
    )


# -- (a) the property ---------------------------------------------------------------------------------
@st.composite
def specs(draw, vocab):
    arch = draw(st.sampled_from(sorted(ARCHS)))
    heads = draw(st.sampled_from([1, 2, 3, 4, 6]))
    kv = draw(st.sampled_from([d for d in range(1, heads + 1) if heads % d == 0]))
    return make_spec(
        arch=arch,
        hidden=draw(st.integers(8, 72)),
        inter=draw(st.integers(8, 130)),
        layers=draw(st.integers(1, 3)),
        heads=heads,
        kv=kv,
        head_dim=draw(st.sampled_from([4, 6, 8, 16, 24])),
        eps=draw(st.sampled_from([1e-5, 1e-6])),
        theta=draw(st.sampled_from([1e4, 5e5, 1e6])),
        tied=draw(st.booleans()),
        vocab=vocab,
        llama3=arch == "llama" and draw(st.booleans()),
        bias=arch != "qwen2" and draw(st.booleans()),
    )


@st.composite
def setups(draw):
    vocab = draw(st.integers(17, 48))
    teacher = draw(specs(vocab + draw(st.sampled_from([0, 0, 5]))))  # sometimes a padded teacher vocab
    student = draw(specs(vocab))
    run = make_run(
        dtype=draw(st.sampled_from(["float32", "bfloat16", "auto"])),
        batch=draw(st.integers(1, 3)),
        seq=draw(st.integers(1, 9)),
        divergence=draw(st.sampled_from(DIVERGENCES)),
        alpha=draw(st.sampled_from([0.0, 0.5, 1.0])),
        chunk=draw(st.sampled_from([3, 8, 1024])),
        logits=draw(st.sampled_from(["float32", "compute"])),
    )
    return teacher, student, run, draw(st.sampled_from(["sm_80", "sm_90", "sm_120"]))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(setups())
def test_launched_keys_are_planned_and_prewarmed(setup):
    teacher, student, run, arch = setup
    rec = run_step(teacher, student, run, arch)
    assert rec.keys(), "nothing was recorded"
    assert {launch.phase for launch in rec.launches} == {"fwd", "bwd"}
    assert contract_problems(teacher, student, run, arch, rec) == []


def test_preset_pair_contract_on_a_shrunken_copy():
    """The real presets' numerics (eps, theta, llama3 scaling, qk-norm) with shrunken sizes."""
    from kdistill.models.spec import load_spec

    for t_name, s_name in [
        ("qwen2.5-1.5b", "qwen2.5-0.5b"),
        ("llama-3.2-3b", "llama-3.2-1b"),
        ("qwen3-1.7b", "qwen3-0.6b"),
    ]:
        shrink = dict(
            num_layers=2,
            hidden_size=32,
            intermediate_size=40,
            num_heads=4,
            num_kv_heads=2,
            head_dim=8,
            vocab_size=64,
        )
        t = dataclasses.replace(load_spec(t_name), **shrink)
        s = dataclasses.replace(load_spec(s_name), **{**shrink, "hidden_size": 24})
        assert contract_problems(t, s, make_run(dtype="bfloat16", batch=2, seq=4)) == [], (t_name, s_name)


def _cross_tokenizer_step(arch: str, run: RunConfig, sharded: bool) -> tuple[runtime.Recorder, tuple]:
    """A kd.cross_tokenizer training step and its held-out eval (the student's CE only, as the loop's
    Evaluator runs it) on the reference path, recording keys: tests/test_cross_tokenizer.py's two BPE
    tokenizers (student 320 symbols, teacher 384), tiny models with those vocabularies. sharded: the
    student's weights in the compute dtype, as FSDP2 gathers them. Returns (recorder, (teacher spec,
    student spec))."""
    from kdistill.models.tokenizer import load_tokenizer
    from kdistill.train.cross_tok import CrossTokenizer
    from tests.test_cross_tokenizer import other_student
    from tests.test_train_kit import assets

    s_tok, t_tok = load_tokenizer(other_student()), load_tokenizer(assets().teacher)
    teacher_spec = make_spec(hidden=48, inter=64, tied=False, vocab=t_tok.vocab_size)
    student_spec = make_spec(vocab=s_tok.vocab_size)
    prec = plan_mod.precision(run, arch, sharded)
    teacher = (
        build_decoder(teacher_spec, dtype=TORCH[prec.teacher_weights], seed=0).eval().requires_grad_(False)
    )
    student = build_decoder(student_spec, dtype=TORCH[prec.student_weights], seed=1)
    g = torch.Generator().manual_seed(0)
    b, t = run.schedule.batch_size, run.data.seq_len
    ids = torch.randint(0, s_tok.vocab_size, (b, t), generator=g)
    labels = ids.roll(-1, 1)  # (B, T): the cross-tokenizer loss pairs positions per row
    labels[:, -1] = run.kd.ignore_index
    cross = CrossTokenizer(s_tok, t_tok, teacher_spec.max_position_embeddings)
    amp = torch.autocast("cpu", dtype=TORCH[prec.compute], enabled=prec.autocast)
    with runtime.using(mode="reference", arch=arch), runtime.recording(deep=True) as rec:
        compute_loss(student, teacher, ids, labels, run, amp, cross=cross).loss.backward()
        heldout_eval(student, None, [(ids, labels)], run, torch.device("cpu"), amp, with_teacher_loss=True)
    return rec, (teacher_spec, student_spec)


@pytest.mark.parametrize(
    "dtype, alpha, sharded", [("float32", 0.5, False), ("bfloat16", 1.0, False), ("bfloat16", 0.5, True)]
)
def test_cross_tokenizer_step_is_planned(dtype, alpha, sharded):
    """kd.cross_tokenizer: the Triton keys its step launches are planned and prewarmed (the student's CE
    through the KD head without KD, its gradient in the student weights' dtype), and the plan holds the
    loss's own lm_head GEMMs (not recorded at runtime, so checked as shapes). The teacher's SDPA runs at
    its own row length (varies per batch, warmed lazily): the one recorded key the plan may lack. The
    sharded case's bf16 student lm_head goes through the ULD term's fp32 GEMMs too (cast, not mixed)."""
    arch = "sm_90"
    run = make_run(dtype=dtype, batch=2, seq=7, alpha=alpha, chunk=4)
    run.kd.cross_tokenizer = True
    rec, (teacher, student) = _cross_tokenizer_step(arch, run, sharded)
    plan = plan_mod.required_kernels(teacher, student, run, arch, sharded=sharded)
    warm = cache.prewarm(plan, "cpu", dry=True)
    assert warm.failed == []
    problems = contract.check(rec.launches, plan, warm.specializations)
    lazy = {launch.key for launch in rec.launches if launch.key.op == "sdpa" and launch.key["T"] != 7}
    assert lazy and all(not k["grad"] and k["HQ"] == teacher.num_heads for k in lazy)
    assert problems == sorted(f"not in the plan: {k} (fwd)" for k in lazy)
    ce = [k for k in rec.keys() if k.op == "kd_loss" and k["NEED_GRAD"]]
    prec = plan_mod.precision(run, arch, sharded)
    assert [(k["HAS_KD"], k["vocab_size"], k["grad_dtype"]) for k in ce] == [
        (False, 320, long_name(prec.student_weights))
    ]
    m = 4  # kd.chunk_size rows (of 2 x 7 tokens)
    gemms = {
        library.gemm_key(arch, m=m, n=320, k=32, dtype=prec.student_weights, grad=True),  # CE head
        library.gemm_key(arch, m=m, n=320, k=32, dtype="fp32", grad=True),  # ULD: student logits
        library.gemm_key(arch, m=m, n=384, k=48, dtype="fp32", grad=False),  # ULD: teacher logits
    }
    assert gemms <= plan
    # The KD head's plan alone has these shapes only where every GEMM of the run is fp32.
    run.kd.cross_tokenizer = False
    without = plan_mod.required_kernels(teacher, student, run, arch, sharded=sharded)
    assert (gemms <= without) == (prec.compute == "fp32")


def test_unaligned_pointer_is_part_of_the_key():
    from kdistill.dispatch import rmsnorm

    buf = torch.randn(3 * 16 + 1)
    x = buf[1:].view(3, 16)  # 4-byte offset: not 16-byte aligned
    w = torch.ones(16)
    with runtime.using(mode="reference", arch="sm_90"), runtime.recording(deep=True) as rec:
        rmsnorm(x, w, 1e-6)
    (launch,) = rec.launches
    assert launch.key["align"].startswith("uu")
    assert contract.check(rec.launches, {launch.key}) == []


# -- (b) planted defects ------------------------------------------------------------------------------
def _drop(fn, params):
    """fn with the key parameters named in `params` (comma-separated) left out of its keys."""
    names = params.split(",")

    def dropped(*a, **k):
        key = fn(*a, **k)
        return keys.KernelKey(key.op, key.arch, tuple(p for p in key.params if p[0] not in names))

    return dropped


@pytest.mark.parametrize(
    "module,param,field,a,b",
    [
        (rms_kernel, "EPS", "rms_eps", 1e-5, 1e-6),
        (rope, "HQ", "num_heads", 6, 8),
        (swiglu, "I,SX", "intermediate_size", 40, 56),  # SX (the row stride) is I or 2I
    ],
)
def test_key_that_drops_a_parameter_is_detected(monkeypatch, module, param, field, a, b):
    """A kernel file's forward key function that forgets a parameter the binary depends on."""
    teacher = dataclasses.replace(make_spec(), **{field: a})
    student = dataclasses.replace(make_spec(), **{field: b})  # differs from the teacher only there
    run = make_run()
    assert contract_problems(teacher, student, run) == []
    monkeypatch.setattr(module, "fwd_key", _drop(module.fwd_key, param))
    rec = run_step(teacher, student, run)
    plan = plan_mod.required_kernels(teacher, student, run, "sm_90")
    assert rec.keys() <= plan  # the subset check alone is fooled: both sides use the broken function
    problems = contract_problems(teacher, student, run, rec=rec)
    assert any(param.split(",")[0] in p for p in problems), problems
    assert any("names two different kernels" in p for p in problems), problems


def test_prewarm_under_a_hard_coded_key_is_detected(monkeypatch):
    teacher, student, run = make_spec(), make_spec(hidden=24, eps=1e-5), make_run()
    assert contract_problems(teacher, student, run) == []
    plan = plan_mod.required_kernels(teacher, student, run, "sm_90")
    first = plan_mod.triton_keys(plan)[0]
    warm = cache._warm
    monkeypatch.setattr(cache, "_warm", lambda key, device, dry: warm(first, device, dry))
    problems = contract_problems(teacher, student, run)
    assert problems and all("not prewarmed" in p for p in problems), problems


def test_kernel_missing_from_the_plan_is_detected(monkeypatch):
    """A planner that forgets the last layer's add_rmsnorm backward (no gradient reaches its sum)."""
    teacher, student, run = make_spec(), make_spec(hidden=24), make_run()
    assert contract_problems(teacher, student, run) == []
    registered = rms_kernel.SPEC.plan

    def forgetful(*a, **k):
        return {key for key in registered(*a, **k) if key.get("HAS_DRES") is not False}

    monkeypatch.setattr(rms_kernel.SPEC, "plan", forgetful)
    problems = contract_problems(teacher, student, run)
    assert any("not in the plan" in p for p in problems), problems
    assert all("HAS_DRES=False" in p for p in problems), problems


def test_a_key_that_misses_the_backward_of_an_op_is_detected():
    teacher, student, run = make_spec(), make_spec(hidden=24), make_run()
    plan = plan_mod.required_kernels(teacher, student, run, "sm_90")
    rec = run_step(teacher, student, run)
    problems = contract.check(rec.launches, {k for k in plan if k.op != "rope_bwd"})
    assert problems and all("rope_bwd" in p for p in problems)


def test_compute_dtype_logits_are_planned_and_a_float32_plan_misses_them():
    """kd.logits_dtype=compute under bf16 autocast launches the KD head on bf16 logits: the plan for the
    run holds that key, and the plan of the same run with float32 logits does not cover the launch."""
    teacher, student = make_spec(vocab=40), make_spec(hidden=24, vocab=40)
    run = make_run(dtype="bfloat16", logits="compute")
    rec = run_step(teacher, student, run)
    heads = [k for k in rec.keys() if k.op == "kd_loss" and k["NEED_GRAD"]]
    assert [k["logits_dtype"] for k in heads] == ["bfloat16"]
    assert contract_problems(teacher, student, run, rec=rec) == []
    assert contract_problems(teacher, student, make_run(dtype="bfloat16"), rec=rec) != []
