"""runtime.precision=fp8: the student's linears through row-wise scaled FP8 GEMMs, forward and backward
(CPU: torch._scaled_mm's CPU implementation and the quantisation references).

The FP8 linear's output and both gradients are checked against a dense product of the dequantised
operands computed here (equal to fp32 rounding) and against the exact fp32 product (FP8-sized error);
then the module conversion, the config's refusals, the kernel plan and the memory plan, and a whole
tiny run. The Triton kernel that writes transposed operands is checked under the interpreter in
tests/test_kernels_interp_cases.py, and at real shapes on a GPU in tests/gpu/test_fp8_student_gpu.py.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import yaml

from kdistill import dispatch
from kdistill.config import RunConfig, load_config
from kdistill.errors import UserError
from kdistill.kernels import fp8_quant, fp8_quant_cols
from kdistill.kernels import plan as plan_mod
from kdistill.memory import estimate_memory
from kdistill.models.decoder import build_decoder
from kdistill.models.fp8_train import FP8TrainLinear, convert_student_to_fp8, fp8_train_linear
from kdistill.models.spec import load_spec
from tests.test_contract import contract_problems, make_run, make_spec, run_step
from tests.test_train_kit import base_config, run_cli


def _dq_rows(t: torch.Tensor) -> torch.Tensor:
    q, s = fp8_quant.reference(t)
    return q.float() * s[:, None]  # (R, C): t quantised per row, dequantised


def _dq_cols(t: torch.Tensor) -> torch.Tensor:
    qt, s = fp8_quant_cols.reference(t)
    return (qt.float() * s[:, None]).t()  # (R, C): t quantised per column, dequantised


def _case(m=41, k=37, n=23, seed=0):
    """An odd shape, inputs of uneven magnitude per row and column, a bias, grad_output != 1."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * torch.logspace(-1, 1, k)).requires_grad_(True)
    w = (torch.randn(n, k, generator=g) * 0.05).requires_grad_(True)
    b = torch.randn(n, generator=g).requires_grad_(True)
    gy = torch.randn(m, n, generator=g) * torch.logspace(-1, 1, m)[:, None]
    return x, w, b, gy


def test_fp8_linear_value_and_gradients_are_the_dequantised_products():
    x, w, b, gy = _case()
    y = fp8_train_linear(x, w, b)
    y.backward(gy)
    with torch.no_grad():
        want_y = _dq_rows(x) @ _dq_rows(w).t() + b
        want_gx = _dq_rows(gy) @ _dq_cols(w)  # gy per token, W per input channel
        want_gw = _dq_cols(gy).t() @ _dq_cols(x)  # gy^T per output channel, x per input channel
    tight = dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(y, want_y, **tight)
    torch.testing.assert_close(x.grad, want_gx, **tight)
    torch.testing.assert_close(w.grad, want_gw, **tight)
    torch.testing.assert_close(b.grad, gy.sum(0), **tight)


def test_a_stacked_weight_gets_the_gradients_of_a_parameter():
    """q/k/v (gate/up) run on a concatenation of the parameters, whose fp8 W^T is kept from forward
    instead of the fp32 copy: the same gradients as one parameter of that value."""
    x, w, b, gy = _case(m=24, k=40, n=30, seed=4)
    w1, w2 = (t.detach().clone().requires_grad_(True) for t in w.detach().split([18, 12]))
    x2 = x.detach().clone().requires_grad_(True)
    fp8_train_linear(x, w, b).backward(gy)
    fp8_train_linear(x2, torch.cat([w1, w2]), b.detach()).backward(gy)
    torch.testing.assert_close(x2.grad, x.grad, rtol=0, atol=0)
    torch.testing.assert_close(torch.cat([w1.grad, w2.grad]), w.grad, rtol=0, atol=0)


def test_fp8_linear_is_close_to_the_exact_product():
    x, w, b, gy = _case(m=64, k=48, n=32, seed=1)
    xe, we, be = (t.detach().clone().requires_grad_(True) for t in (x, w, b))
    fp8_train_linear(x, w, b).backward(gy)
    y_exact = xe @ we.t() + be
    y_exact.backward(gy)

    def rel(a, e):
        return float((a - e).detach().norm() / e.detach().norm())

    # each operand off by at most 2^-4 of itself (3 mantissa bits), errors partly cancelling: ~2-3%
    assert rel(fp8_train_linear(x, w, b), y_exact) < 0.05
    assert rel(x.grad, xe.grad) < 0.05
    assert rel(w.grad, we.grad) < 0.05


def test_fp8_linear_under_autocast_computes_in_the_autocast_dtype():
    x, w, b, gy = _case(m=16, k=32, n=16, seed=2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = fp8_train_linear(x, w, b)
    assert y.dtype == torch.bfloat16
    y.backward(gy.bfloat16())
    assert x.grad.dtype == torch.float32 and w.grad.dtype == torch.float32
    assert torch.isfinite(w.grad).all()


def test_fp8_linear_records_the_quantisation_keys_of_all_three_gemms():
    x, w, _, gy = _case(m=8, k=24, n=40, seed=3)
    with dispatch.recording() as rec:
        fp8_train_linear(x, w).backward(gy)
    got = {(k.op, k.get("K", k.get("C"))) for k in rec.keys()}
    # forward: x and W per row (width K); backward: gy per row (N), W^T and x^T (K), gy^T (N)
    # the transposed ones as two kernels each: the column maxima of each span of rows, then the copy
    cols = {(op, c) for op in ("fp8_quant_cols_amax", "fp8_quant_cols") for c in (24, 40)}
    assert got == {("fp8_quant", 24), ("fp8_quant", 40)} | cols


def test_conversion_keeps_parameters_and_leaves_the_head_alone():
    spec = make_spec(hidden=32, inter=48, layers=2, heads=4, kv=2, head_dim=8, bias=True, tied=False)
    model = build_decoder(spec, seed=0)
    params = dict(model.named_parameters())
    ids = torch.randint(0, 40, (2, 6), generator=torch.Generator().manual_seed(0))
    before = model(ids)
    assert convert_student_to_fp8(model) == 2 * 7
    assert dict(model.named_parameters()) == params  # the same tensors: the optimizer's state holds
    assert type(model.lm_head) is torch.nn.Linear
    assert all(type(m.self_attn.q_proj) is FP8TrainLinear for m in model.model.layers)
    after = model(ids)
    after.float().pow(2).mean().backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if "proj" in n)
    assert float((after - before).norm() / before.norm()) < 0.05


def test_bad_precision_and_lora_are_one_line_errors():
    with pytest.raises(UserError, match=r"^runtime.precision is 'int8', expected one of: auto, fp8$"):
        load_config(None, ["runtime.precision=int8", "teacher.path=x", "student.path=y"]).validate()
    with pytest.raises(UserError, match=r"^runtime.precision=fp8 trains the student's own linears .*auto"):
        load_config(
            None, ["runtime.precision=fp8", "student.lora.rank=4", "teacher.path=x", "student.path=y"]
        ).validate()


def test_gpu_without_fp8_is_refused_naming_runtime_precision(monkeypatch):
    from kdistill.models import fp8

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 6))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA RTX A6000")
    with pytest.raises(UserError) as e:
        fp8.check_device(torch.device("cuda"), "runtime.precision")
    assert str(e.value) == (
        "runtime.precision=fp8 needs FP8 matrix units (compute capability 8.9 or newer: Ada, Hopper, "
        "Blackwell); NVIDIA RTX A6000 is sm_86: use runtime.precision=auto"
    )
    run = make_run()
    run.runtime.precision = "fp8"
    with pytest.raises(UserError, match=r"^runtime.precision=fp8 needs FP8 matrix units.*sm_80"):
        plan_mod.required_kernels(make_spec(), make_spec(), run, "sm_80")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_plan_covers_an_fp8_student(dtype):
    teacher = make_spec(hidden=48, inter=80, layers=2)
    student = make_spec(hidden=32, inter=48, layers=2, bias=True)
    run = make_run(dtype=dtype)
    run.runtime.precision = "fp8"
    rec = run_step(teacher, student, run)
    assert any(k.op == "fp8_quant_cols" for k in rec.keys())  # the FP8 path ran
    assert contract_problems(teacher, student, run, rec=rec) == []
    plan = plan_mod.required_kernels(teacher, student, run, "sm_90")
    widths = {32, 48, student.q_size + 2 * student.kv_size, 2 * 48}  # K and N of the block GEMMs
    assert {k["C"] for k in plan if k.op == "fp8_quant_cols"} == widths
    assert {k["K"] for k in plan if k.op == "fp8_quant"} == widths
    fp8_gemms = {(k["M"], k["N"], k["K"]) for k in plan if k.op == "gemm_fp8"}
    tokens = run.schedule.batch_size * run.data.seq_len
    assert (tokens, 32, 48) in fp8_gemms and (tokens, 48, 32) in fp8_gemms and (32, 48, tokens) in fp8_gemms
    bf16_linears = {(k["N"], k["K"]) for k in plan if k.op == "gemm" and k["M"] == tokens}
    assert (2 * 48, 32) not in bf16_linears  # the student's gate/up runs in FP8, not as a bf16 GEMM
    auto = dataclasses.replace(run, runtime=dataclasses.replace(run.runtime, precision="auto"))
    plain = plan_mod.required_kernels(teacher, student, auto, "sm_90")
    assert not any(k.op in ("fp8_quant", "fp8_quant_cols", "gemm_fp8") for k in plain)


def test_memory_plan_counts_fp8_saved_inputs_and_no_bf16_weight_copies():
    t, s = load_spec("qwen2.5-1.5b"), load_spec("qwen2.5-0.5b")
    cfg = RunConfig()
    bf16 = estimate_memory(t, s, cfg)
    cfg.runtime.precision = "fp8"
    fp8 = estimate_memory(t, s, cfg)
    n = cfg.schedule.batch_size * cfg.data.seq_len
    per_layer = -3 * s.hidden_size + s.intermediate_size + s.q_size  # 1-byte inputs (memory.py)
    assert fp8["student_activations"] - bf16["student_activations"] == n * s.num_layers * per_layer
    linears = s.num_layers * sum(a * b for a, b in s.linear_shapes().values())
    assert bf16["autocast_weight_copies"] - fp8["autocast_weight_copies"] == 2 * linears
    assert 0 < fp8["fp8_weight_copies"] < linears
    assert fp8["total"] < bf16["total"]


def test_a_run_with_an_fp8_student(tmp_path, capsys):
    cfg = base_config(tmp_path / "run", steps=2, eval_every=2, eval_batches=1)
    cfg["runtime"]["precision"] = "fp8"
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    rc, out, err = run_cli(capsys, "run", str(path), "--quiet")
    assert rc == 0, err
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["jit_after_prewarm"] in (0, None)  # None: no Triton compiles on the CPU
    assert summary["heldout"]["kl_to_teacher"] is not None
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert saved["runtime"]["precision"] == "fp8"
