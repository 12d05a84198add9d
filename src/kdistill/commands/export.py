"""`kdistill export`: a finished LoRA run's adapters, as they are or merged into the base student.

    kdistill export --run runs/a --out adapters/a            # PEFT layout (adapter_config.json + safetensors)
    kdistill export --run runs/a --merge --out models/a      # a Hugging Face directory: W + (alpha/r) B A

The base is the run's student.path (its config.yaml); the adapters are the run's export in
RUN_DIR/adapter. The merged directory loads in transformers with the logits of base + adapters, and
carries the chat template the run rendered its conversations with (data.chat_template, else the
teacher's; as a full run's student/ does), not the base directory's own.
Either is written to a temp folder and renamed (kdistill.outputs): an existing --out is replaced only
when it holds an earlier export of the same kind (its `.kdistill-output` marker), never a folder of the
user's, and --out may not be, or contain, the run's inputs (its folder, student.path, the teachers).
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch

from kdistill.commands.report import read_summary
from kdistill.config import RunConfig, load_config
from kdistill.data.chat_data import is_conversation_data
from kdistill.data.chat_template import load_chat_template
from kdistill.errors import UserError
from kdistill.fileio import fault_point
from kdistill.models.hf_io import load_model, save_model
from kdistill.models.lora import (
    ADAPTER_CONFIG,
    ADAPTER_TEMPLATE,
    ADAPTER_WEIGHTS,
    load_adapter,
    merge_lora,
    read_adapter,
)
from kdistill.outputs import check_target, staged_output
from kdistill.train.loading import exported_chat_template


def export_command(args: argparse.Namespace) -> int:
    run_dir, out = Path(args.run), Path(args.out)
    cfg_path = run_dir / "config.yaml"
    if not cfg_path.is_file():
        raise UserError(f"--run {run_dir}: no config.yaml there (not a kdistill run directory)")
    cfg = load_config(cfg_path)
    adapter_dir = run_dir / "adapter"
    if not (adapter_dir / ADAPTER_CONFIG).is_file():
        if (run_dir / "student" / "config.json").is_file():
            raise UserError(
                f"--run {run_dir}: not a LoRA run; its student is already a full model in {run_dir / 'student'}"
            )
        raise UserError(
            f"--run {run_dir}: no {adapter_dir / ADAPTER_CONFIG} (export needs a completed LoRA run)"
        )
    inputs = [
        ("the run directory", run_dir),
        ("student.path", cfg.student.path),
        ("teacher.path", cfg.teacher.path),
        *((f"teachers[{i}].path", t.path) for i, t in enumerate(cfg.teachers)),
    ]
    if out.absolute().resolve().is_relative_to(run_dir.absolute().resolve()):
        raise UserError(f"--out {out}: is inside the run directory {run_dir}; choose a folder outside it")
    intact = f"the run and its adapters in {adapter_dir} are intact"
    if not args.merge:
        read_adapter(adapter_dir)  # checked before it is copied
        with staged_output(
            out, "export-adapter", what="export the adapter", intact=intact, inputs=inputs
        ) as tmp:
            for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS, ADAPTER_TEMPLATE):
                if name == ADAPTER_TEMPLATE and not (adapter_dir / name).is_file():
                    continue  # the run rendered no conversations with a template of its own
                fault_point(tmp / name)
                shutil.copyfile(adapter_dir / name, tmp / name)
        print(f"adapter (PEFT layout) written to {out}")
        return 0
    check_target(out, "export-merged", inputs=inputs)  # before the base is loaded
    saved = adapter_dir / ADAPTER_TEMPLATE  # the template as the run trained with it
    template: str | None
    if saved.is_file():  # read and checked as data.chat_template is
        template = load_chat_template(cfg.teacher.path, str(saved), field=f"--run {run_dir}").source
    else:  # an adapter written before runs kept their template: resolved again from the config
        template = exported_chat_template(cfg, _trained_on_conversations(run_dir, cfg))
    model = load_model(cfg.student.path, device="cpu", dtype=torch.float32)
    merge_lora(load_adapter(model, adapter_dir))
    source = Path(cfg.student.path)
    if not (source / "tokenizer.json").is_file():
        source = Path(cfg.teacher.path)
    save_model(
        model,
        out,
        source_dir=source,
        chat_template=template,
        kind="export-merged",
        intact=intact,
        inputs=inputs,
    )
    print(f"merged student (base + adapters) written to {out}")
    return 0


def _trained_on_conversations(run_dir: Path, cfg: RunConfig) -> bool:
    """Whether the run rendered conversations (so its chat template shaped what it learned): its
    summary.json says so (data.format); a run stopped before writing one is judged by its data.train
    files, as the run judged them."""
    summary = run_dir / "summary.json"
    if summary.is_file():
        data = read_summary(summary).get("data")
        return isinstance(data, dict) and data.get("format") == "conversations"
    try:
        return is_conversation_data(cfg.data.train)
    except UserError:  # its data is gone: nothing tells, the base's own template stays
        return False
