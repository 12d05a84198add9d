"""kdistill: logit knowledge distillation of causal language models.

Distils a teacher LM into a smaller student without ever materialising [tokens x vocab] logits,
with Triton kernels on NVIDIA GPUs that are compiled before training and a PyTorch reference path
that runs everywhere.

    import kdistill
    run = kdistill.distill("run.yaml", "schedule.steps=100")

The Python API (`distill`, `load`, `evaluate`, `plan`, `RunConfig`, `DistillResult`) lives in
kdistill.api and is loaded on first use, so `import kdistill` stays cheap (no torch).
"""

import importlib
from typing import Any

from kdistill.errors import UserError

__version__ = "0.1.0"
__all__ = ["DistillResult", "RunConfig", "UserError", "distill", "evaluate", "load", "plan", "__version__"]

_API = {"distill", "load", "evaluate", "plan", "DistillResult", "RunConfig"}


def __getattr__(name: str) -> Any:
    if name in _API:
        return getattr(importlib.import_module("kdistill.api"), name)
    raise AttributeError(f"module 'kdistill' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_API])
