"""Fault injection for the tests of resume, signals and the non-finite policy; inert unless set.

KDISTILL_TEST_KILL_AT names points at which the process signals itself ("SIGNAL@POINT,..."; a bare
POINT means SIGKILL); under torchrun KDISTILL_TEST_KILL_RANK=R limits that to the process of rank R.
The step loop calls `at(point)` at these points:
    "S"        after step S's metrics line,
    "S.M"      after micro-batch M's backward of step S,
    "S.saved"  after the checkpoint of step S;
`kdistill generate --out` calls `at("generate.N")` once its N-th chunk of answers is on disk, then
`at("generate.rewrite")` before it rewrites the finished file in order and `at("generate.mark")` before
it marks it complete; KDISTILL_TEST_GENERATE_CHUNK sets the answers per chunk. The arch probe of
`kdistill kernels build` calls `at("kernels.probe.ARCH")` in its child process before compiling for ARCH.
KDISTILL_TEST_NAN_STEPS="3,4" makes the loss of those (1-based) steps non-finite (`nan_step`).
KDISTILL_TEST_POISON_STEP=S sets one weight of the student to +inf before step S's forward (`poison`):
a non-finite value that the real forward, loss and backward carry, on any CPU (no float overflow needed).
KDISTILL_TEST_CKPT_PAUSE=FILE makes a checkpoint write stop between its files: it writes the stage name
to FILE and sleeps, so that a test can kill the process inside the write (`checkpoint_pause`).
KDISTILL_TEST_HOLD_AT="POINT@DIR" makes every process of a first torchrun attempt (restart count 0) stop
at POINT, write its PID to DIR/rank{RANK}.pid and sleep (SIGTERM ends it at once), so that a test can
kill one rank by PID and watch torchrun restart the job.
KDISTILL_TEST_HOLD_CAPTURE=1 keeps a run that captures its step (runtime.cuda_graphs) from capturing: every
step runs eagerly in the captured form (`capture_held`), the reference a replayed step must equal bit for
bit, in processes a test cannot patch (torchrun's).
KDISTILL_TEST_TEARDOWN_HANG=SECONDS makes the process group's teardown never end and its wait last SECONDS
(`teardown_hang`), as a run whose CUDA graphs still held NCCL's communicator hung (distributed.destroy).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import torch

KILL_ENV, NAN_ENV, PAUSE_ENV = "KDISTILL_TEST_KILL_AT", "KDISTILL_TEST_NAN_STEPS", "KDISTILL_TEST_CKPT_PAUSE"
KILL_RANK_ENV = "KDISTILL_TEST_KILL_RANK"
POISON_ENV = "KDISTILL_TEST_POISON_STEP"
HOLD_ENV = "KDISTILL_TEST_HOLD_AT"
GENERATE_CHUNK_ENV = "KDISTILL_TEST_GENERATE_CHUNK"
HOLD_CAPTURE_ENV = "KDISTILL_TEST_HOLD_CAPTURE"
TEARDOWN_HANG_ENV = "KDISTILL_TEST_TEARDOWN_HANG"


def capture_held() -> bool:
    """Whether a test keeps this run's step from being captured (KDISTILL_TEST_HOLD_CAPTURE=1)."""
    return os.environ.get(HOLD_CAPTURE_ENV) == "1"


def teardown_hang() -> float | None:
    """The seconds a test lets a teardown that never ends be waited for (KDISTILL_TEST_TEARDOWN_HANG),
    else None."""
    value = os.environ.get(TEARDOWN_HANG_ENV)
    return float(value) if value else None


def at(point: str) -> None:
    """Signal this process if KDISTILL_TEST_KILL_AT names `point`; hold it if KDISTILL_TEST_HOLD_AT does."""
    hold(point)
    spec = os.environ.get(KILL_ENV)
    if not spec:
        return
    only = os.environ.get(KILL_RANK_ENV)
    if only is not None and os.environ.get("RANK", "0") != only:
        return
    for item in spec.split(","):
        name, _, where = item.rpartition("@")
        if where == point:
            os.kill(os.getpid(), signal.Signals[name or "SIGKILL"])


def nan_step(step: int) -> bool:
    """True if KDISTILL_TEST_NAN_STEPS names `step` (1-based): its loss is to read as NaN."""
    spec = os.environ.get(NAN_ENV)
    return bool(spec) and str(step) in spec.split(",")


def poison(step: int, model: Any) -> None:
    """If KDISTILL_TEST_POISON_STEP names `step` (1-based): the first element of the student's first norm
    weight becomes +inf (its hidden states, logits and loss then turn non-finite through the real path)."""
    if os.environ.get(POISON_ENV) != str(step):
        return
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            with torch.no_grad():
                local = p.to_local() if hasattr(p, "to_local") else p  # a DTensor shard under FSDP2
                local.view(-1)[0] = float("inf")
            return


def checkpoint_pause(stage: str) -> None:
    """Inside a checkpoint write: if KDISTILL_TEST_CKPT_PAUSE names a file, say `stage` there and wait."""
    flag = os.environ.get(PAUSE_ENV)
    if flag:
        Path(flag).write_text(stage)
        time.sleep(3600)


def hold(point: str) -> None:
    """On a first torchrun attempt, if KDISTILL_TEST_HOLD_AT names `point`: write the PID and sleep."""
    where, _, folder = os.environ.get(HOLD_ENV, "").partition("@")
    if where != point or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") not in ("", "0"):
        return
    # torchrun's elastic agent ends a held worker with SIGTERM: it must end it
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    Path(folder, f"rank{os.environ.get('RANK', '0')}.pid").write_text(str(os.getpid()))
    while True:
        time.sleep(1)
