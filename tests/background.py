"""Batches of subprocesses that a module's fixtures wait for, started early and run in the background.

Most of the suite runs in the pytest process, on one core at a time. The torchrun modules' fixtures
start batches of processes that keep every core busy (each process spends most of its few seconds
importing torch); waited for in turn, with nothing else to do, they would add up. tests/conftest.py
moves the modules that have a `prelaunch(fixturenames)` function to the end of the run and calls it once
the tests are collected; `prelaunch` prepares the batches of the fixtures the selected tests use (in the
pytest process) and starts them here, so that they use the cores the in-process tests leave idle. The
fixtures then wait for results that are mostly ready. Nothing a test asserts changes: the same launches,
the same checks, only earlier.

    first = background.start("distributed.first", lambda: launch_and_wait(...))
    ...
    out = background.wait("distributed.first")      # in the fixture: the job's result, or its exception

The jobs run one after another in one thread (the launches of a batch already run at once, so at most
one batch's processes are alive). Their processes run at the lowest CPU priority (nice 19), so the tests
in the foreground keep their speed (a batch's hang guards allow for the wait: 900 s a launch); and with
the environment the suite started with (`environ()`), so a variable that a foreground test sets for its
own children does not reach them. KDISTILL_TEST_BACKGROUND=0 keeps the file order: each fixture then
starts its batch when it needs it and waits for it, as a plain fixture would.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import Any

# The background processes' niceness (Linux: per thread, inherited by the processes it starts). The
# lowest priority: a foreground process keeps ~80% of a core beside a whole batch (weights 1024 against
# 15 per process), so the tests that bound a duration measure what they did before.
NICE = 19

_JOBS: dict[str, Future] = {}
_QUEUE: queue.Queue[tuple[Future, Callable[[], Any]] | None] = queue.Queue()
_LOCAL = threading.local()
_LOCK = threading.Lock()
_WORKER: threading.Thread | None = None


def _work(env: dict[str, str]) -> None:
    _LOCAL.environ = env
    try:  # niceness is per thread on Linux: the processes this thread starts inherit it
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)
    except (AttributeError, OSError):
        pass
    while (item := _QUEUE.get()) is not None:
        future, job = item
        if not future.set_running_or_notify_cancel():
            continue
        try:
            future.set_result(job())
        except BaseException as e:  # handed to the fixture that waits for it
            future.set_exception(e)


def start(name: str, job: Callable[[], Any]) -> Future:
    """Queue `job` (once per name) for the background thread; its future."""
    global _WORKER
    with _LOCK:
        if name in _JOBS:
            return _JOBS[name]
        if _WORKER is None:
            # a daemon: a run stopped early (-x, ^C) does not wait for a batch nobody will read
            _WORKER = threading.Thread(target=_work, args=(dict(os.environ),), name="background", daemon=True)
            _WORKER.start()
        future: Future = Future()
        _JOBS[name] = future
        _QUEUE.put((future, job))
        return future


def wait(name: str) -> Any:
    """The result of the job started under `name` (its exception raised here)."""
    return _JOBS[name].result()


def started(name: str) -> bool:
    return name in _JOBS


def environ() -> Mapping[str, str]:
    """The environment for a child process: in the background thread, the suite's at its start."""
    return getattr(_LOCAL, "environ", os.environ)


def cancel_pending() -> None:
    """At the end of the session: drop the jobs not started (a run stopped before it needed them)."""
    for future in _JOBS.values():
        future.cancel()
