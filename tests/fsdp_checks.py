"""The helper checks (tests/fsdp_clip.py, fsdp_adamw.py, fsdp_gathers.py, fsdp_replicate.py) in one torchrun launch:
one process group, each check after the other, each result in its own JSON (a helper that
tests/test_distributed.py launches under torchrun; not a test module). One launch instead of three spares
the suite two starts of torchrun and its processes.

    torchrun --nproc_per_node=2 --standalone tests/fsdp_checks.py OUT_DIR

Rank 0 writes OUT_DIR/clip.json, adamw.json, gathers.json and replicate.json, as each helper alone writes its OUT.json.
Every check builds its own models from fixed seeds and draws its inputs from its own generators, so
running them together gives what each gives alone.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from kdistill.train import distributed as dist
from tests import fsdp_adamw, fsdp_clip, fsdp_gathers, fsdp_replicate

CHECKS = {
    "clip": fsdp_clip.check,
    "adamw": fsdp_adamw.check,
    "gathers": fsdp_gathers.check,
    "replicate": fsdp_replicate.check,
}


def main(out_dir: str) -> None:
    dist.init_from_env("cpu")
    folder = Path(out_dir)
    for name, check in CHECKS.items():
        result = check()
        if dist.is_main():
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"{name}.json").write_text(json.dumps(result))
    dist.destroy()


if __name__ == "__main__":
    main(sys.argv[1])
    dist.leave(0)  # no interpreter finalisation after a process group (see dist.leave)
