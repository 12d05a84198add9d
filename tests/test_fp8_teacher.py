"""teacher.precision=fp8: row-wise FP8 quantisation, FP8 linears, the plan, and a whole run (CPU).

On the CPU the FP8 GEMM runs on dequantised operands (kdistill.models.fp8.fp8_linear_reference): the
same values an FP8 GEMM gives, so the teacher's loss and the plan can be checked here; the kernel
against the GPU's own conversion is in tests/gpu.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import yaml

from kdistill import dispatch
from kdistill.config import RunConfig, load_config
from kdistill.errors import UserError
from kdistill.kernels import fp8_quant
from kdistill.kernels import plan as plan_mod
from kdistill.memory import estimate_memory
from kdistill.models.decoder import build_decoder
from kdistill.models.fp8 import FP8Linear, convert_to_fp8, fp8_linear, fused
from kdistill.models.spec import load_spec
from kdistill.ops.kd_loss import kd_loss
from tests.test_contract import contract_problems, make_run, make_spec
from tests.test_train_kit import base_config, run_cli


def test_row_scales_and_values_within_e4m3_precision():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 96, generator=g) * torch.logspace(-3, 2, 7)[:, None]  # rows of any magnitude
    x[3] = 0.0  # an all-zero row: a tiny scale, zeros out
    q, s = fp8_quant.reference(x)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and s.shape == (7,)
    amax = x.abs().amax(-1)
    nz = amax > 0
    torch.testing.assert_close(s[nz], amax[nz] / 448.0)
    assert float(q.float().abs().amax(-1)[nz].min()) == 448.0  # every row's largest entry maps to 448
    back = q.float() * s[:, None]
    # e4m3: 3 mantissa bits, so a normal value is off by at most 2^-4 of itself; the smallest
    # (subnormal) step is 2^-9 of the scale
    assert bool(((back - x).abs() <= x.abs() / 16 + s[:, None] * 2.0**-9 + 1e-30).all())
    assert bool((q[3].float() == 0).all())


def test_fp8_linear_matches_the_dequantised_product_and_is_close_to_the_exact_one():
    g = torch.Generator().manual_seed(1)
    lin = torch.nn.Linear(64, 48, bias=True)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(48, 64, generator=g) * 0.05)
        lin.bias.copy_(torch.randn(48, generator=g))
    f = FP8Linear.from_linear(lin)
    assert f.weight.dtype == torch.float8_e4m3fn and f.weight_scale.shape == (48,)
    x = torch.randn(3, 5, 64, generator=g)
    y = f(x)
    assert y.shape == (3, 5, 48) and y.dtype == x.dtype
    xq, xs = fp8_quant.reference(x)
    want = (xq.float() * xs[:, None]) @ (f.weight.float() * f.weight_scale[:, None]).t() + lin.bias
    torch.testing.assert_close(y.reshape(-1, 48), want)
    with torch.no_grad():
        exact = lin(x)
        y = f(x)
    rel = float((y - exact).norm() / exact.norm())
    assert rel < 0.05, rel  # two 3-bit-mantissa operands: a few percent at most


def test_quantize_rows_records_its_key():
    x = torch.randn(4, 32)
    with dispatch.recording() as rec:
        q, s = dispatch.quantize_rows(x)
    (key,) = rec.keys()
    assert key.op == "fp8_quant" and key["K"] == 32
    torch.testing.assert_close(q.float(), fp8_quant.reference(x)[0].float())


def test_fp8_teacher_loss_close_to_the_full_precision_teacher():
    spec = make_spec(hidden=64, inter=96, layers=2, heads=4, kv=2, head_dim=16, vocab=40)
    student = build_decoder(spec, seed=2)
    teacher = build_decoder(spec, seed=1).eval().requires_grad_(False)
    ids = torch.randint(0, 40, (2, 12), generator=torch.Generator().manual_seed(0))
    labels = torch.randint(0, 40, (24,), generator=torch.Generator().manual_seed(1))

    @torch.no_grad()
    def loss(t):
        th, sh = t(ids).flatten(0, 1), student(ids).flatten(0, 1)
        return float(
            kd_loss(
                sh, student.lm_head_weight, th, t.lm_head_weight, labels, alpha=1.0, temperature=2.0,
                divergence="forward_kl", chunk_size=8,
            ).loss
        )  # fmt: skip

    before = loss(teacher)
    assert convert_to_fp8(teacher) == 2 * 7
    assert all(type(m) is not torch.nn.Linear for m in teacher.model.layers.modules())
    after = loss(teacher)
    assert abs(after - before) <= 0.02 * abs(before), (before, after)


def test_fused_qkv_and_gate_up_give_the_per_layer_products():
    """The decoder runs q/k/v (and gate/up) of an FP8 teacher as one FP8 GEMM on stacked weights:
    the same values as the three (two) layers one by one (row-wise scales are per output channel)."""
    spec = make_spec(hidden=32, inter=48, layers=1, heads=4, kv=2, head_dim=8, bias=True, arch="qwen2")
    t = build_decoder(spec, seed=3).eval().requires_grad_(False)
    convert_to_fp8(t)
    attn = t.model.layers[0].self_attn
    x = torch.randn(2, 6, 32)
    w, _, _ = fused([attn.q_proj, attn.k_proj, attn.v_proj])
    assert w.data_ptr() == attn.q_proj.weight.data_ptr() and w.shape[0] == 64  # a view, no copy
    q, k, v = attn.project_qkv(x)
    torch.testing.assert_close(q, attn.q_proj(x))
    torch.testing.assert_close(k, attn.k_proj(x))
    torch.testing.assert_close(v, attn.v_proj(x))
    mlp = t.model.layers[0].mlp
    from kdistill.ops.swiglu import swiglu_reference

    want = fp8_linear(
        swiglu_reference(mlp.gate_proj(x), mlp.up_proj(x)), mlp.down_proj.weight, mlp.down_proj.weight_scale
    )
    torch.testing.assert_close(mlp(x), want)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_plan_covers_an_fp8_teacher(dtype):
    teacher = make_spec(hidden=48, inter=80, layers=2)
    student = make_spec(hidden=32, inter=48, layers=1)
    run = make_run(dtype=dtype)
    run.teacher.precision = "fp8"
    assert contract_problems(teacher, student, run) == []
    plan = plan_mod.required_kernels(teacher, student, run, "sm_90")
    assert {k["K"] for k in plan if k.op == "fp8_quant"} == {48, teacher.q_size, 80}
    assert any(k.op == "gemm_fp8" for k in plan)
    plain = dataclasses.replace(run.teacher, precision="auto")
    assert not any(k.op.startswith(("fp8", "gemm_fp8")) for k in plan_mod.required_kernels(
        teacher, student, dataclasses.replace(run, teacher=plain), "sm_90"))  # fmt: skip


def test_plan_refuses_fp8_below_compute_capability_89():
    run = make_run()
    run.teacher.precision = "fp8"
    with pytest.raises(UserError, match=r"teacher.precision=fp8 needs FP8 matrix units.*sm_80"):
        plan_mod.required_kernels(make_spec(), make_spec(), run, "sm_80")
    plan_mod.required_kernels(make_spec(), make_spec(), run, "sm_89")


def test_memory_plan_counts_fp8_weights_at_one_byte():
    t, s = load_spec("qwen2.5-1.5b"), load_spec("qwen2.5-0.5b")
    cfg = RunConfig()
    bf16 = estimate_memory(t, s, cfg)["teacher_weights"]
    cfg.teacher.precision = "fp8"
    fp8 = estimate_memory(t, s, cfg)["teacher_weights"]
    linear = t.num_layers * sum(a * b for a, b in t.linear_shapes().values())
    assert bf16 - fp8 == linear - 4 * t.num_layers * sum(b for _, b in t.linear_shapes().values())


def test_bad_precision_is_one_line():
    with pytest.raises(UserError, match=r"teacher.precision is 'int8', expected one of: auto, fp8"):
        load_config(None, ["teacher.precision=int8", "teacher.path=x", "student.path=y"]).validate()


def test_a_run_with_an_fp8_teacher(tmp_path, capsys):
    cfg = base_config(tmp_path / "run", steps=3, eval_every=3)
    cfg["teacher"]["precision"] = "fp8"
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    rc, out, err = run_cli(capsys, "run", str(path), "--quiet")
    assert rc == 0, err
    summary = yaml.safe_load((tmp_path / "run" / "summary.json").read_text())
    assert summary["jit_after_prewarm"] == 0 or summary["jit_after_prewarm"] is None
    assert summary["heldout"]["teacher_loss"] is not None


def test_gpu_without_fp8_is_refused(monkeypatch):
    from kdistill.models import fp8

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(UserError) as e:
        fp8.check_device(torch.device("cuda"))
    assert str(e.value) == (
        "teacher.precision=fp8 needs FP8 matrix units (compute capability 8.9 or newer: Ada, Hopper, "
        "Blackwell); NVIDIA A100-SXM4-80GB is sm_80: use teacher.precision=auto"
    )
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    fp8.check_device(torch.device("cuda"))
    fp8.check_device(torch.device("cpu"))


def test_fp8_with_a_sharded_teacher_is_refused():
    from kdistill.train.preflight import check_fp8_layout

    cfg = RunConfig()
    cfg.teacher.precision = "fp8"
    with pytest.raises(UserError, match=r"set runtime.teacher_placement=replicate$"):
        check_fp8_layout(cfg, teacher_sharded=True)
    check_fp8_layout(cfg, teacher_sharded=False)


def test_quant_kernel_constant_is_the_fp32_reciprocal_of_448():
    """The kernel multiplies by a literal; it must be the fp32 constant the reference multiplies by."""
    import inspect

    from kdistill.kernels import fp8_quant

    assert fp8_quant.INV_FP8_MAX == float(torch.tensor(1 / 448, dtype=torch.float32))
    assert repr(fp8_quant.INV_FP8_MAX) in inspect.getsource(fp8_quant.fp8_quant_rows_kernel.fn)
