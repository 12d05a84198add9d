"""On-policy distillation speed: TRL's GKDTrainer beside kdistill (kd.on_policy=1), same pair, same card.

    python benchmarks/onpolicy_bench.py                           # Qwen2.5-1.5B -> 0.5B shapes, GPU
    python benchmarks/onpolicy_bench.py --json out.json --steps 8
    python benchmarks/onpolicy_bench.py --device cpu --tiny       # a smoke check on the CPU

Both sides train the same student from the same teacher (random weights at the presets' shapes, built
here with transformers and saved once; no download) on the same prompts: batch 8 prompts of 128 tokens,
128 new tokens sampled by the student at every step (lambda = 1), JSD(0.5) at temperature 0.9 over
the full vocabulary, AdamW on an fp32 student under bf16 autocast, a bf16 teacher. The tokenizer is a
word-level one built here (one token per word), so a prompt of 128 words is 128 tokens on both sides.

Reported per side, after --warmup untimed steps: completion tokens per second through whole optimizer
steps (generation, teacher scoring, update), seconds per step, and peak GPU memory (each side runs in
its own process, so the peaks are its own). TRL needs `trl` and `datasets` (and their pure-Python
dependencies); a side that cannot run says why in its entry. The JSON holds the card, versions, date
and command. vLLM-based trainers are not measured (their engine is not installable on the benchmark
machine).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from kdistill.models.presets import PRESETS

TINY = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
)
WORDS = 2000  # the word-level tokenizer's vocabulary (the models keep their own vocab_size)
EOS = "<|endoftext|>"
# Each message's text and a newline; the answer ends with the end of text.
TEMPLATE = (
    "{% for m in messages %}{{ m['content'] }}\n{% if m['role'] == 'assistant' %}" + EOS + "{% endif %}"
    "{% endfor %}"
)


@dataclasses.dataclass
class Shape:
    batch: int = 8
    prompt: int = 128
    new: int = 128
    steps: int = 6
    warmup: int = 2
    temperature: float = 0.9


def build_assets(out: Path, tiny: bool, shape: Shape) -> Path:
    """teacher/, student/ (config, safetensors, tokenizer with the template) and data.jsonl under out."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {EOS: 0, "<unk>": 1, **{f"w{i}": i + 2 for i in range(WORDS)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens([EOS])
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token=EOS, pad_token=EOS, unk_token="<unk>"
    )
    tok.chat_template = TEMPLATE
    for role, preset in (("teacher", "qwen2.5-1.5b"), ("student", "qwen2.5-0.5b")):
        raw = dict(PRESETS[preset])
        for k in ("architectures", "torch_dtype", "layer_types", "max_window_layers"):
            raw.pop(k, None)
        if tiny:
            width = TINY["hidden_size"] * (2 if role == "teacher" else 1)
            raw.update(
                TINY, hidden_size=width, head_dim=width // TINY["num_attention_heads"], vocab_size=4096
            )
        raw.update(eos_token_id=0, bos_token_id=0, pad_token_id=0)
        torch.manual_seed(0 if role == "teacher" else 1)
        model = transformers.AutoModelForCausalLM.from_config(
            transformers.Qwen2Config(**raw), dtype=torch.bfloat16
        )
        model.save_pretrained(out / role)
        tok.save_pretrained(out / role)
        del model
    g = torch.Generator().manual_seed(0)
    with open(out / "data.jsonl", "w", encoding="utf-8") as f:
        for _ in range(64 * shape.batch):
            words = torch.randint(0, WORDS, (shape.prompt + shape.new,), generator=g).tolist()
            text = [f"w{w}" for w in words]
            row = {"prompt": " ".join(text[: shape.prompt]), "completion": " ".join(text[shape.prompt :])}
            f.write(json.dumps(row) + "\n")
    (out / "template.jinja").write_text(TEMPLATE, encoding="utf-8")
    return out


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_trl(assets: Path, device: str, shape: Shape) -> dict[str, Any]:
    """TRL's GKDTrainer at lambda = 1 for warmup + steps steps, timed step by step by a callback."""
    import datasets
    import transformers

    try:
        from trl.experimental.gkd import GKDConfig, GKDTrainer
    except ImportError:  # older TRL keeps it at the top level
        from trl import GKDConfig, GKDTrainer
    import trl

    gpu = device.startswith("cuda")
    # the word-level tokenizer as built (AutoTokenizer would pick the Qwen2 class from config.json)
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(assets / "teacher")
    student = transformers.AutoModelForCausalLM.from_pretrained(assets / "student", dtype=torch.float32)
    teacher = transformers.AutoModelForCausalLM.from_pretrained(
        assets / "teacher", dtype=torch.bfloat16 if gpu else torch.float32
    )
    rows = [json.loads(x) for x in (assets / "data.jsonl").read_text().splitlines()]
    ds = datasets.Dataset.from_list(
        [
            {
                "messages": [
                    {"role": "user", "content": r["prompt"]},
                    {"role": "assistant", "content": r["completion"]},
                ]
            }
            for r in rows
        ]
    )
    times: list[float] = []

    class Timer(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            _sync(device)
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            _sync(device)
            times.append(time.perf_counter() - self.t0)

    with tempfile.TemporaryDirectory() as tmp:
        args = GKDConfig(
            output_dir=tmp,
            per_device_train_batch_size=shape.batch,
            gradient_accumulation_steps=1,
            max_steps=shape.warmup + shape.steps,
            learning_rate=1e-5,
            lmbda=1.0,
            beta=0.5,
            temperature=shape.temperature,
            max_new_tokens=shape.new,
            max_length=shape.prompt + shape.new + 8,
            bf16=gpu,
            use_cpu=not gpu,
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            dataloader_num_workers=0,
            seed=0,
        )
        trainer = GKDTrainer(
            model=student, teacher_model=teacher, args=args, train_dataset=ds, processing_class=tok,
            callbacks=[Timer()],
        )  # fmt: skip
        if gpu:
            torch.cuda.reset_peak_memory_stats()
        trainer.train()
    timed = times[shape.warmup :]
    per_step = sum(timed) / len(timed)
    return {
        "version": trl.__version__,
        "seconds_per_step": per_step,
        # every row writes max_new_tokens tokens (random weights: a sampled EOS is rare)
        "completion_tokens_per_s": shape.batch * shape.new / per_step,
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if gpu else None,
        "steps_timed": len(timed),
    }


def run_kdistill(assets: Path, device: str, shape: Shape) -> dict[str, Any]:
    """kdistill at kd.on_policy = 1 for warmup + steps steps; per-step phases from metrics.jsonl."""
    import kdistill
    from kdistill.commands.run import new_run
    from kdistill.config import load_config

    with tempfile.TemporaryDirectory() as tmp:
        base = {
            "teacher": {"path": str(assets / "teacher")},
            "student": {"path": str(assets / "student"), "init": "pretrained"},
            "data": {
                "train": [str(assets / "data.jsonl")],
                "heldout_fraction": 0.01,
                "seq_len": shape.prompt + shape.new + 8,
                "chat_template": str(assets / "template.jinja"),
                "cache_dir": str(Path(tmp) / "cache"),
            },
            "kd": {
                "alpha": 1.0, "divergence": "jsd", "beta": 0.5, "temperature": shape.temperature,
                "on_policy": 1.0, "max_new_tokens": shape.new,
            },
            "optim": {"lr": 1e-5, "warmup_steps": 0},
            "schedule": {
                "steps": shape.warmup + shape.steps, "batch_size": shape.batch, "eval_every": 0,
                "eval_batches": 1, "checkpoint_every": 0, "sample_prompts": 0,
            },
            "output": {"dir": str(Path(tmp) / "run"), "keep_checkpoints": 1},
            "runtime": {"device": device},
        }  # fmt: skip
        cfg = load_config(None, base=base).validate()
        summary = new_run(cfg, quiet=True)
        rows = [json.loads(x) for x in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
    timed = rows[shape.warmup :]
    seconds = [r["gen_s"] + r["score_s"] + r["update_s"] for r in timed]
    tokens = sum(r["completion_tokens"] for r in timed)
    return {
        "version": kdistill.__version__ if hasattr(kdistill, "__version__") else None,
        "seconds_per_step": sum(seconds) / len(seconds),
        "completion_tokens_per_s": tokens / sum(seconds),
        "gen_s": sum(r["gen_s"] for r in timed) / len(timed),
        "score_s": sum(r["score_s"] for r in timed) / len(timed),
        "update_s": sum(r["update_s"] for r in timed) / len(timed),
        "mean_completion_len": tokens / sum(r["completions"] for r in timed),
        "peak_memory_gib": summary.get("peak_memory_gib"),
        "planned_memory_gib": summary.get("planned_memory_gib"),
        "jit_after_prewarm": summary.get("jit_after_prewarm"),
        "steps_timed": len(timed),
    }


def provider_main(args: argparse.Namespace, shape: Shape) -> int:
    """One side in this process: its result as one JSON line on stdout."""
    fn = run_trl if args.provider == "trl" else run_kdistill
    try:
        out = fn(Path(args.assets), args.device, shape)
    except ImportError as e:
        out = {"error": f"cannot import {e.name or e}: install trl and datasets to compare"}
    print("RESULT " + json.dumps(out), flush=True)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (a CPU smoke check)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--json", help="write the results here")
    p.add_argument("--only", choices=("trl", "kdistill"), help="run one side")
    p.add_argument("--provider", choices=("trl", "kdistill"), help=argparse.SUPPRESS)
    p.add_argument("--assets", help=argparse.SUPPRESS)
    args = p.parse_args()
    shape = Shape(steps=args.steps, warmup=args.warmup)
    if args.tiny:
        shape = dataclasses.replace(shape, batch=2, prompt=16, new=8)
    if args.provider:
        return provider_main(args, shape)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        assets = build_assets(Path(tmp), args.tiny, shape)
        for side in ("trl", "kdistill") if args.only is None else (args.only,):
            cmd = [
                sys.executable,
                __file__,
                "--provider",
                side,
                "--assets",
                str(assets),
                "--device",
                args.device,
            ]
            cmd += ["--steps", str(args.steps), "--warmup", str(args.warmup)] + (
                ["--tiny"] if args.tiny else []
            )
            proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
            line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
            errors = [x for x in proc.stderr.splitlines() if "Error" in x] or ["failed (no result line)"]
            results[side] = json.loads(line[7:]) if line else {"error": errors[-1].strip()}
            print(f"{side}: {json.dumps(results[side])}", file=sys.stderr, flush=True)
    speedup = None
    if "completion_tokens_per_s" in results.get("trl", {}) and "completion_tokens_per_s" in results.get(
        "kdistill", {}
    ):
        speedup = results["kdistill"]["completion_tokens_per_s"] / results["trl"]["completion_tokens_per_s"]
    report = {
        "benchmark": "on-policy distillation, whole steps",
        "pair": "tiny" if args.tiny else "qwen2.5-1.5b -> qwen2.5-0.5b shapes (random weights)",
        "shape": dataclasses.asdict(shape),
        "device": torch.cuda.get_device_name()
        if args.device.startswith("cuda")
        else platform.processor() or "cpu",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "results": results,
        "kdistill_speedup": speedup,
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
