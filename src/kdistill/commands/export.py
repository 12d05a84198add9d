"""`kdistill export`: a finished LoRA run's adapters, as they are or merged into the base student.

    kdistill export --run runs/a --out adapters/a            # PEFT layout (adapter_config.json + safetensors)
    kdistill export --run runs/a --merge --out models/a      # a Hugging Face directory: W + (alpha/r) B A

The base is the run's student.path (its config.yaml); the adapters are the run's export in
RUN_DIR/adapter. The merged directory loads in transformers with the logits of base + adapters.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch

from kdistill.config import load_config
from kdistill.errors import UserError
from kdistill.models.hf_io import load_model, save_model
from kdistill.models.lora import ADAPTER_CONFIG, load_adapter, merge_lora, read_adapter


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
    if not args.merge:
        read_adapter(adapter_dir)  # checked before it is copied
        if out.exists():
            raise UserError(f"--out {out}: already exists (choose a new folder)")
        shutil.copytree(adapter_dir, out)
        print(f"adapter (PEFT layout) written to {out}")
        return 0
    model = load_model(cfg.student.path, device="cpu", dtype=torch.float32)
    merge_lora(load_adapter(model, adapter_dir))
    source = Path(cfg.student.path)
    if not (source / "tokenizer.json").is_file():
        source = Path(cfg.teacher.path)
    save_model(model, out, source_dir=source)
    print(f"merged student (base + adapters) written to {out}")
    return 0
