"""Fault injection for the tests of resume, signals and the non-finite policy; inert unless set.

KDISTILL_TEST_KILL_AT names points at which the process signals itself ("SIGNAL@POINT,..."; a bare
POINT means SIGKILL). The step loop calls `at(point)` at these points:
    "S"        after step S's metrics line,
    "S.M"      after micro-batch M's backward of step S,
    "S.saved"  after the checkpoint of step S.
KDISTILL_TEST_NAN_STEPS="3,4" makes the loss of those (1-based) steps non-finite (`nan_step`).
KDISTILL_TEST_CKPT_PAUSE=FILE makes a checkpoint write stop between its files: it writes the stage name
to FILE and sleeps, so that a test can kill the process inside the write (`checkpoint_pause`).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

KILL_ENV, NAN_ENV, PAUSE_ENV = "KDISTILL_TEST_KILL_AT", "KDISTILL_TEST_NAN_STEPS", "KDISTILL_TEST_CKPT_PAUSE"


def at(point: str) -> None:
    """Signal this process if KDISTILL_TEST_KILL_AT names `point`."""
    spec = os.environ.get(KILL_ENV)
    if not spec:
        return
    for item in spec.split(","):
        name, _, where = item.rpartition("@")
        if where == point:
            os.kill(os.getpid(), signal.Signals[name or "SIGKILL"])


def nan_step(step: int) -> bool:
    """True if KDISTILL_TEST_NAN_STEPS names `step` (1-based): its loss is to read as NaN."""
    spec = os.environ.get(NAN_ENV)
    return bool(spec) and str(step) in spec.split(",")


def checkpoint_pause(stage: str) -> None:
    """Inside a checkpoint write: if KDISTILL_TEST_CKPT_PAUSE names a file, say `stage` there and wait."""
    flag = os.environ.get(PAUSE_ENV)
    if flag:
        Path(flag).write_text(stage)
        time.sleep(3600)
