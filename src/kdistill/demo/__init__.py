"""The embedded default: a shipped teacher and the Python standard library as corpus.

`kdistill run` with no arguments distils `assets/teacher` (about 4M parameters, trained by
scripts/make_demo_teacher.py on the stdlib's train split) into the small student of
`assets/student/config.json`, then trains the same student on hard labels only for the same steps,
and compares held-out losses.
"""

from __future__ import annotations

from pathlib import Path

ASSETS = Path(__file__).resolve().parent / "assets"

# The demo's run config (a dict of RunConfig sections). Sized to finish in well under 3 minutes
# on a 2-core CPU.
DEMO_CONFIG = {
    "teacher": {"path": str(ASSETS / "teacher")},
    "student": {"path": str(ASSETS / "student" / "config.json"), "init": "random"},
    "data": {"train": ["stdlib:train"], "heldout": ["stdlib:heldout"], "seq_len": 128, "max_tokens": 400000},
    "kd": {"alpha": 0.5, "temperature": 2.0, "divergence": "forward_kl", "chunk_size": 512},
    "optim": {"lr": 3e-3, "warmup_steps": 10, "weight_decay": 0.0, "min_lr_ratio": 0.1},
    "schedule": {"steps": 150, "batch_size": 8, "eval_every": 50, "eval_batches": 8, "checkpoint_every": 0},
    "output": {"dir": "runs/demo", "keep_checkpoints": 1},
    "runtime": {"device": "cpu"},
}
