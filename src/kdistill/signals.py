"""SIGTERM and SIGINT from the first line of a command to its exit.

    signals.install()                   # first line of a command (main thread); idempotent
    with signals.stage("setup"):        # a signal raises Interrupted here (cleanup runs via finally /
        ...                             # except BaseException), naming the stage
    with signals.deferred():            # a critical section (rename + marker): a signal waits for
        ...                             # the block's end, then raises Interrupted there
    with signals.graceful():            # the training loop: a signal only sets the flag; the loop
        while not signals.requested():  # checks it at a step boundary, saves and exits 0
            ...
    signals.check()                     # a safe point: raise Interrupted if a signal is pending

The second signal, in any mode, forces the exit at once with one line on stderr and code 128 + signal
number (130 for SIGINT, 143 for SIGTERM). `Interrupted` derives from BaseException, like
KeyboardInterrupt, so `except Exception` blocks (kernel fallbacks, retries) never swallow it; the CLI
prints its one line and exits with `Interrupted.exit_code`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Interrupted(BaseException):
    """A signal arrived outside the training loop; raised at a safe point so cleanup runs."""

    def __init__(self, signame: str, stage: str | None = None, note: str | None = None) -> None:
        self.signame = signame
        self.stage = stage
        self.exit_code = 128 + int(signal.Signals[signame])
        text = f"interrupted by {signame}" + (f" during {stage}" if stage else "")
        super().__init__(text + (f"; {note}" if note else ""))

    @property
    def message(self) -> str:
        return str(self)


class _State:
    installed = False
    requested: str | None = None  # name of the first signal received
    mode = "raise"  # "raise" | "defer" | "graceful"
    stage: str | None = None
    old: dict[int, Any] = {}
    exit_hook: Any = None  # test seam: called instead of os._exit


def _forced_exit(signame: str) -> None:
    code = 128 + int(signal.Signals[signame])
    try:
        sys.stderr.write(f"\nkdistill: second signal ({signame}), exiting now\n")
        sys.stderr.flush()
    finally:
        (_State.exit_hook or os._exit)(code)


def _handler(signum: int, frame: Any) -> None:
    name = signal.Signals(signum).name
    if _State.requested is not None:
        _forced_exit(name)
        return
    _State.requested = name
    if _State.mode == "raise":
        raise Interrupted(name, _State.stage)
    if _State.mode == "graceful":
        sys.stderr.write(f"\nkdistill: {name} received: finishing this step and saving a checkpoint\n")
        sys.stderr.flush()


def install() -> bool:
    """Install the handlers for SIGTERM and SIGINT (idempotent). False off the main thread, where Python
    does not allow signal handlers (the caller then runs without them)."""
    if _State.installed:
        return True
    if threading.current_thread() is not threading.main_thread():
        return False
    for s in SIGNALS:
        _State.old[s] = signal.signal(s, _handler)
    _State.installed = True
    return True


def uninstall() -> None:
    """Restore the handlers that were there before `install` and forget any pending signal."""
    if _State.installed:
        for s, h in _State.old.items():
            signal.signal(s, h)
    _State.old = {}
    _State.installed = False
    _State.requested = None
    _State.mode = "raise"
    _State.stage = None


@contextlib.contextmanager
def installed() -> Iterator[None]:
    """install() for the block, uninstall() after it (tests, library use)."""
    fresh = not _State.installed
    install()
    try:
        yield
    finally:
        if fresh:
            uninstall()


def requested() -> str | None:
    """The name of the first signal received ('SIGTERM', 'SIGINT'), or None."""
    return _State.requested


def check(note: str | None = None) -> None:
    """A safe point: raise Interrupted if a signal arrived (in any mode)."""
    if _State.requested is not None:
        raise Interrupted(_State.requested, _State.stage, note)


@contextlib.contextmanager
def _mode(mode: str) -> Iterator[None]:
    saved = _State.mode
    _State.mode = mode
    try:
        yield
    finally:
        _State.mode = saved


@contextlib.contextmanager
def stage(name: str) -> Iterator[None]:
    """Name the stage for messages; a signal inside raises Interrupted (a pending one at once)."""
    saved = _State.stage
    _State.stage = name
    try:
        with _mode("raise"):
            check()
            yield
    finally:
        _State.stage = saved


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """A critical section: a signal inside only sets the flag; Interrupted is raised at the block's end
    (unless the enclosing mode is graceful, where the loop reads the flag itself)."""
    outer = _State.mode
    with _mode("defer" if outer != "graceful" else "graceful"):
        yield
    if outer == "raise":
        check()


@contextlib.contextmanager
def graceful() -> Iterator[None]:
    """The training loop: a signal sets the flag (see `requested`) and the loop stops at a step
    boundary; nothing is raised."""
    with _mode("graceful"):
        yield
