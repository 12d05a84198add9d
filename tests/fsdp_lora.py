"""Checks of a LoRA student sharded with FSDP2 that need the processes' own objects (a helper that
tests/test_lora_distributed.py launches under torchrun; not a test module).

    torchrun --nproc_per_node=2 --standalone tests/fsdp_lora.py run OUT.json run RUN.yaml ...
    torchrun --nproc_per_node=2 --standalone tests/fsdp_lora.py step OUT.json

`run`: `kdistill run ...` as the command line runs it, and once the student is exported, the whole
student gathered (its frozen base too) and compared, on rank 0, with student.path's weights; writes
{"compared": n, "differ": [names], "optimizer_params": n, "adapters": n}.

`step`: for a fp32 and a bf16 base, a tiny LoRA student sharded as the run shards it (bf16 compute, as
on a GPU, through CPU autocast), one training and one held-out step recorded on the reference path and
checked against the sharded kernel plan, then three AdamW steps (weight decay on, gradients clipped);
writes {base_dtype: {"problems": [...], "wrong_dtype_plan_problems": n, "base_differ": [names],
"adapters_moved": bool, "grad_norms": [...]}}.
"""

from __future__ import annotations

import json
import sys

import torch

from kdistill import cli
from kdistill.config import RunConfig
from kdistill.kernels import contract, runtime
from kdistill.kernels import plan as plan_mod
from kdistill.kernels import seal as cache
from kdistill.models.decoder import build_decoder
from kdistill.models.hf_io import load_model
from kdistill.models.lora import adapter_state, apply_lora
from kdistill.train import distributed as dist
from kdistill.train import recipe
from kdistill.train.optim import make_optimizer
from kdistill.train.step import compute_loss, heldout_eval
from tests.test_contract import make_spec


def run(out: str, argv: list[str]) -> int:
    export = recipe.export_student

    def export_and_compare(r: recipe.Run) -> None:
        export(r)
        student = r.ctx.student
        full = dist.full_model_state(student)  # collective: every tensor, the frozen base too
        if not dist.is_main():
            return
        base = load_model(r.cfg.student.path).state_dict()
        frozen = [k for k in full if ".lora_A." not in k and ".lora_B." not in k]
        differ = [k for k in frozen if not torch.equal(full[k], base[k.replace(".base_layer", "")])]
        report = {
            "compared": len(frozen),
            "base_tensors": len(base),
            "differ": differ,
            "optimizer_params": sum(len(g["params"]) for g in r.ctx.opt.param_groups),
            "adapters": len(adapter_state(student)),
        }
        with open(out, "w") as f:
            json.dump(report, f)

    recipe.export_student = export_and_compare
    return cli.main(argv)


def step(out: str) -> None:
    dist.init_from_env("cpu")
    rank = dist.info().rank
    results = {}
    for base_dtype in ("float32", "bfloat16"):
        teacher_spec, student_spec = make_spec(hidden=48), make_spec(arch="llama", hidden=32, layers=3)
        cfg = RunConfig()
        cfg.runtime.dtype, cfg.schedule.batch_size, cfg.data.seq_len, cfg.kd.chunk_size = "bfloat16", 2, 5, 4
        cfg.student.lora.rank, cfg.student.lora.base_dtype = 4, base_dtype
        cfg.student.lora.targets = ["q_proj", "o_proj", "up_proj"]
        cfg.optim.lr, cfg.optim.weight_decay, cfg.optim.grad_clip = 1e-2, 0.1, 1e-3  # clipping bites
        teacher = build_decoder(teacher_spec, dtype=torch.bfloat16, seed=0).eval().requires_grad_(False)
        student = build_decoder(student_spec, dtype=getattr(torch, base_dtype), seed=1)
        apply_lora(student, rank=4, alpha=8, dropout=0.0, targets=cfg.student.lora.targets)
        before = {n: p.detach().clone() for n, p in student.named_parameters() if not p.requires_grad}
        dist.shard_student(student, torch.bfloat16)  # as the run does with a GPU's compute dtype
        ids = torch.randint(0, 40, (2, 5), generator=torch.Generator().manual_seed(rank))  # this rank's rows
        labels = ids.flatten().clone()
        held = torch.randint(0, 40, (4, 5), generator=torch.Generator().manual_seed(9))  # a global batch
        amp = torch.autocast("cpu", dtype=torch.bfloat16)
        with runtime.using(mode="reference", arch="sm_90"), runtime.recording(deep=True) as rec:
            compute_loss(student, teacher, ids, labels, cfg, amp).loss.backward()
            heldout_eval(
                student, teacher, [(held, held)], cfg, torch.device("cpu"), amp, with_teacher_loss=True
            )
        planned = plan_mod.required_kernels(teacher_spec, student_spec, cfg, "sm_90", sharded=True)
        warm = cache.prewarm(planned, "cpu", dry=True)
        problems = [f"prewarm failed: {f}" for f in warm.failed]
        problems += contract.check(rec.launches, planned, warm.specializations)
        # The check sees the weights' dtype: the plan of the other base dtype does not cover these launches.
        cfg.student.lora.base_dtype = "bfloat16" if base_dtype == "float32" else "float32"
        wrong_plan = plan_mod.required_kernels(teacher_spec, student_spec, cfg, "sm_90", sharded=True)
        wrong_problems = len(contract.check(rec.launches, wrong_plan))
        cfg.student.lora.base_dtype = base_dtype

        student.zero_grad(set_to_none=True)
        opt = make_optimizer(student, cfg.optim)
        norms = []
        for _ in range(3):
            with amp:
                loss = compute_loss(student, teacher, ids, labels, cfg, amp).loss
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(student.parameters(), cfg.optim.grad_clip)
            norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
            opt.step()
            opt.zero_grad(set_to_none=True)
        after = dist.full_model_state(student)  # rank 0: every tensor, gathered
        if dist.is_main():
            results[base_dtype] = {
                "problems": problems,
                "wrong_dtype_plan_problems": wrong_problems,
                "base_differ": [
                    n for n, v in before.items() if after[n].dtype != v.dtype or not torch.equal(after[n], v)
                ],
                "adapters_moved": all(
                    after[n].abs().max() > 0 for n in adapter_state(student) if ".lora_B." in n
                ),
                "optimizer_params": sum(len(g["params"]) for g in opt.param_groups),
                "adapters": len(adapter_state(student)),
                "grad_norms": norms,
            }
    if dist.is_main():
        with open(out, "w") as f:
            json.dump(results, f)
    dist.destroy()


if __name__ == "__main__":
    # no interpreter finalisation after a process group (see dist.leave)
    if sys.argv[1] == "run":
        dist.leave(run(sys.argv[2], sys.argv[3:]))
    step(sys.argv[2])
    dist.leave(0)
