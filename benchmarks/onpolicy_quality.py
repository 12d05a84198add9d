"""Does on-policy distillation help, on real text? The embedded demo's comparison at a larger budget.

    PYTHONPATH=src:. python3 benchmarks/onpolicy_quality.py --json benchmarks/results/onpolicy_quality.json
    PYTHONPATH=src:. python3 benchmarks/onpolicy_quality.py --quick --device cpu      # the logic, on a CPU
    PYTHONPATH=src:. python3 benchmarks/onpolicy_quality.py --cross-tokenizer --json results/xtok.json

The comparison of `kdistill run src/kdistill/demo/on_policy.yaml` (kdistill.demo.onpolicy.compare): a
shared off-policy warm-up of the student, then from it an on-policy arm (kd.on_policy = lambda, reverse
KL on the student's own samples) and an off-policy arm (the data's completions, forward KL) for the
same measured training time; the teacher grades each model's greedy completions of held-out prompts
(its per-token NLL and the reverse KL per token, lower is better, with standard errors over prompts,
and the fraction of repeated 4-grams) beside each model's held-out CE.

Models: the demo's own teacher (about 4M parameters, trained on the Python standard library's train
split by scripts/make_demo_teacher.py and shipped with the package) and the demo's student shapes.
Qwen2.5 pretrained weights cannot be read where this runs (no network), and random-weight
Qwen2.5-shaped models make a meaningless quality comparison (a random teacher's grades carry no
signal), so this is not at Qwen2.5 shapes: it is the demo's pair on one GPU with a larger budget than
the CPU demo (longer warm-up and arms, larger batches, longer completions, more held-out prompts:
--prompts-per-file windows from each held-out file). Data: the stdlib of the Python running it.

--cross-tokenizer: the student has a tokenizer of its own (demo.student_vocab, --student-vocab tokens, a
byte-level BPE trained on the train prompts and completions: other merges than the teacher's 4096) and
every phase distils across tokenizers (kd.cross_tokenizer: the on-policy arm's completions are decoded to
text and re-tokenized by the teacher); each model's greedy completions are graded the same way, by the
teacher's NLL per teacher token and per character of their text, and each arm is also graded at
--grade-points evenly spaced steps (from the warm-up's student on: the `curves` of the JSON), so the
teacher's NLL of the student's own completions can be followed over the run.

The JSON (--json) holds the card, versions, date, command, settings and the table; each phase's wall
time is in it too. The default budget is sized for a few minutes on one H100 (on-policy steps through
the decode engine).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

from kdistill.demo.onpolicy import compare, load_demo_config, print_table

try:  # run as a script (benchmarks/ on sys.path) or as a module
    from kd_throughput import _argv_for_record
    from kd_throughput import _version as version
except ImportError:
    from benchmarks.kd_throughput import _argv_for_record
    from benchmarks.kd_throughput import _version as version

# (GPU default, --quick) per setting
BUDGET = {
    "warmup_steps": (1500, 3),
    "steps": (300, 3),  # the on-policy arm's steps (the off-policy arm gets the same time)
    "batch": (32, 2),
    "new_tokens": (64, 8),
    "seq_len": (192, 48),
    "prompts_per_file": (4, 1),
    "heldout_prompts": (0, 4),  # 0: all
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="a tiny budget: checks the logic in a minute")
    for name, (full, _) in BUDGET.items():
        p.add_argument(f"--{name.replace('_', '-')}", type=int, help=f"default {full}")
    p.add_argument("--lambda", dest="lam", type=float, default=1.0, help="kd.on_policy of the on-policy arm")
    p.add_argument("--lr", type=float, default=1e-3, help="the arms' peak learning rate")
    p.add_argument("--warmup-lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cross-tokenizer", action="store_true", help="a student with a tokenizer of its own")
    p.add_argument("--student-vocab", type=int, default=3072, help="its vocabulary (with --cross-tokenizer)")
    p.add_argument(
        "--grade-points", type=int, help="grades per arm (default 3 with --cross-tokenizer, else 1)"
    )
    p.add_argument("--out", help="the run's folder (default: a temporary one)")
    p.add_argument("--json", help="write the results here")
    a = p.parse_args()
    b = {k: getattr(a, k) if getattr(a, k) is not None else v[1 if a.quick else 0] for k, v in BUDGET.items()}
    overrides = [
        f"runtime.device={a.device}",
        f"schedule.steps={b['steps']}",
        f"schedule.batch_size={b['batch']}",
        f"schedule.seed={a.seed}",
        f"schedule.eval_batches={64 if not a.quick else 2}",
        f"data.seq_len={b['seq_len']}",
        f"kd.max_new_tokens={b['new_tokens']}",
        f"kd.on_policy={a.lam}",
        f"optim.lr={a.lr}",
        f"demo.warmup_steps={b['warmup_steps']}",
        f"demo.warmup_lr={a.warmup_lr}",
        f"demo.prompts_per_file={b['prompts_per_file']}",
        f"demo.heldout_prompts={b['heldout_prompts']}",
        f"demo.student_vocab={a.student_vocab if a.cross_tokenizer else 0}",
        f"demo.grade_points={a.grade_points or (3 if a.cross_tokenizer else 1)}",
    ]
    cfg, settings = load_demo_config(overrides)
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(a.out or Path(tmp) / "run")
        cfg.output.dir = str(run_dir)

        def say(msg: str) -> None:
            print(f"[{time.time() - t0:7.1f}s] {msg}", file=sys.stderr, flush=True)

        result = compare(cfg, settings, run_dir, quiet=True, log=say)
    print_table(result)
    cuda = a.device != "cpu" and torch.cuda.is_available()
    report = {
        "benchmark": "on-policy distillation quality: the demo teacher on the stdlib, equal training time"
        + (", a student with another tokenizer" if a.cross_tokenizer else ""),
        "device": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
        "torch": torch.__version__,
        "triton": version("triton"),
        "transformers": version("transformers"),
        "tokenizers": version("tokenizers"),
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "PYTHONPATH=src:. python3 benchmarks/onpolicy_quality.py " + _argv_for_record(),
        "budget": {**b, "lambda": a.lam, "lr": a.lr, "warmup_lr": a.warmup_lr, "seed": a.seed},
        "config": {k: v for k, v in cfg.to_dict().items() if k in ("kd", "optim", "schedule", "data")},
        **{k: v for k, v in result.items() if k != "device"},  # the table, settings, phases' wall time
        "torch_device": result.get("device"),
        "wall_seconds": time.time() - t0,
    }
    text = json.dumps(report, indent=2)
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(text + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
