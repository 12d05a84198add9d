"""Activation checkpointing per decoder block: the same losses and gradients as without it, and the
same kernel keys (recomputation goes through the same dispatch calls), so the kernel plan is unchanged.
FSDP2's mixed precision (parameters gathered in the compute dtype) is planned too.
"""

from __future__ import annotations

import torch

from kdistill.kernels import contract, runtime
from kdistill.kernels import plan as plan_mod
from kdistill.kernels import seal as cache
from kdistill.models.decoder import build_decoder
from kdistill.train.step import compute_loss
from tests.test_contract import TORCH, contract_problems, make_run, make_spec, run_step


def _loss_and_grads(checkpointed: bool, divergence: str = "forward_kl", keep_swiglu: bool = False):
    teacher_spec, student_spec = make_spec(hidden=32, layers=3), make_spec(hidden=24, layers=3, inter=40)
    teacher = build_decoder(teacher_spec, seed=0).eval().requires_grad_(False)
    student = build_decoder(student_spec, seed=1)
    student.checkpoint_blocks(checkpointed)
    student.keep_swiglu(keep_swiglu)
    run = make_run(batch=2, seq=7, divergence=divergence, chunk=5)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, student_spec.vocab_size, (2, 7), generator=g)
    labels = torch.randint(0, student_spec.vocab_size, (14,), generator=g)
    labels[::4] = run.kd.ignore_index
    r = compute_loss(student, teacher, ids, labels, run, torch.autocast("cpu", enabled=False))
    r.loss.backward()
    return r, {n: p.grad.clone() for n, p in student.named_parameters()}


def test_checkpointing_keeps_losses_and_gradients():
    for divergence in ("forward_kl", "jsd"):
        plain, g_plain = _loss_and_grads(False, divergence)
        ckpt, g_ckpt = _loss_and_grads(True, divergence)
        assert torch.equal(ckpt.loss, plain.loss) and torch.equal(ckpt.kd, plain.kd)
        assert g_plain.keys() == g_ckpt.keys()
        for name in g_plain:
            torch.testing.assert_close(g_ckpt[name], g_plain[name], rtol=0, atol=1e-7, msg=name)


def test_checkpointing_recomputes_in_backward_and_launches_the_same_keys():
    teacher, student = make_spec(hidden=32), make_spec(hidden=24, inter=40)
    run = make_run(dtype="bfloat16", batch=2, seq=4)
    plain = run_step(teacher, student, run, checkpointing=False)
    ckpt = run_step(teacher, student, run, checkpointing=True)
    assert ckpt.keys() == plain.keys()
    # the recomputed forward is recorded again during backward: more forward launches, same keys
    fwd = [x for x in ckpt.launches if x.phase == "fwd"]
    assert len(fwd) > len([x for x in plain.launches if x.phase == "fwd"])
    assert contract_problems(teacher, student, run, rec=ckpt) == []


def test_sharded_student_weights_in_the_compute_dtype_are_planned():
    """Under FSDP2 on a GPU the student's gathered parameters are bf16: its norms' keys change, and
    the plan for a sharded run (`sharded=True`) covers them while the one-process plan does not."""
    teacher, student = make_spec(hidden=32), make_spec(hidden=24, inter=40)
    run = make_run(dtype="bfloat16", batch=2, seq=4)
    prec = plan_mod.precision(run, "sm_90", sharded=True)
    assert prec.student_weights == "bf16" and plan_mod.precision(run, "sm_90").student_weights == "fp32"
    rec = run_step(teacher, student, run, student_dtype=TORCH[prec.student_weights])
    sharded = plan_mod.required_kernels(teacher, student, run, "sm_90", sharded=True)
    warm = cache.prewarm(sharded, "cpu", dry=True)
    assert contract.check(rec.launches, sharded, warm.specializations) == []
    assert contract.check(rec.launches, plan_mod.required_kernels(teacher, student, run, "sm_90")) != []
    assert runtime.current().mode  # the recorder left the dispatcher configured as it found it


def test_kept_swiglu_outputs_give_the_same_losses_and_gradients():
    plain, g_plain = _loss_and_grads(False)
    kept, g_kept = _loss_and_grads(False, keep_swiglu=True)
    assert torch.equal(kept.loss, plain.loss)
    for name in g_plain:
        torch.testing.assert_close(g_kept[name], g_plain[name], rtol=0, atol=1e-7, msg=name)


def test_kept_swiglu_outputs_are_not_recomputed_and_launch_planned_keys():
    """Keeping the SwiGLU output (activation_checkpointing=none): the same keys as recomputing it,
    one SwiGLU forward a student layer fewer (none in backward), and the plan covers the launches."""
    teacher, student = make_spec(hidden=32), make_spec(hidden=24, inter=40, layers=3)
    run = make_run(dtype="bfloat16", batch=2, seq=4)
    plain = run_step(teacher, student, run)
    kept = run_step(teacher, student, run, keep_swiglu=True)
    assert kept.keys() == plain.keys()

    def swiglu_fwd(rec, phase):
        return len([x for x in rec.launches if x.key.op == "swiglu_fwd" and x.phase == phase])

    assert swiglu_fwd(plain, "bwd") + swiglu_fwd(plain, "fwd") == swiglu_fwd(kept, "fwd") + 3
    assert contract_problems(teacher, student, run, rec=kept) == []


def test_a_run_that_keeps_the_swiglu_outputs_trains_as_one_that_recomputes_them(tmp_path, capsys):
    """runtime.activation_checkpointing=none reaches the student (summary.json's layout) and trains the
    same losses as swiglu, bit for bit."""
    import json

    import yaml

    from tests.test_train_kit import base_config, read_summary, run_cli

    losses = {}
    for choice in ("none", "swiglu"):
        cfg = base_config(tmp_path / choice, steps=3)
        cfg["runtime"]["activation_checkpointing"] = choice
        path = tmp_path / f"{choice}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        rc, _, err = run_cli(capsys, "run", str(path), "--quiet")
        assert rc == 0, err
        assert read_summary(tmp_path / choice)["layout"]["swiglu_kept"] is (choice == "none")
        rows = (tmp_path / choice / "metrics.jsonl").read_text().splitlines()
        losses[choice] = [json.loads(r)["loss"] for r in rows]
    assert len(losses["none"]) == 3 and losses["none"] == losses["swiglu"]
