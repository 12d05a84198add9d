"""The process-wide signal handler, with real signals sent to child processes: a signal during setup
raises Interrupted so that a half-made run directory is removed; in the training loop it only sets the
flag; inside a critical section it waits for the section's end; the second signal forces the exit."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kdistill import signals
from kdistill.signals import Interrupted

SRC = Path(__file__).resolve().parents[1] / "src"

# Each child prints "ready" once it is waiting for the signal, then reports what happened on stdout.
CHILD = {
    "setup": """
import sys, time
from kdistill import signals
from kdistill.rundir import creating_run_dir
signals.install()
try:
    with signals.stage("setup"), creating_run_dir(sys.argv[1]) as made:
        (made.path / "config.yaml").write_text("x")
        print("ready", flush=True)
        time.sleep(30)
except signals.Interrupted as e:
    print(e.message, flush=True)
    sys.exit(e.exit_code)
""",
    "loop": """
import sys, time
from kdistill import signals
signals.install()
with signals.graceful():
    print("ready", flush=True)
    step = 0
    while not signals.requested():
        time.sleep(0.01)
        step += 1
    print("saved after", signals.requested(), flush=True)
""",
    "twice": """
import sys, time
from kdistill import signals
signals.install()
with signals.graceful():
    print("ready", flush=True)
    while not signals.requested():
        time.sleep(0.01)
    print("saving", flush=True)
    # a slow checkpoint write, in steps (as a write of many tensors is); the second signal ends it. One
    # sleep of 30 s would be a race: a signal that lands between the print and the sleep's system call
    # is only handled by Python after that call returns.
    for _ in range(3000):
        time.sleep(0.01)
""",
    "deferred": """
import sys, time
from kdistill import signals
signals.install()
try:
    with signals.stage("export"):
        with signals.deferred():
            print("ready", flush=True)
            time.sleep(0.5)
            print("critical section done", flush=True)
        print("not reached", flush=True)
except signals.Interrupted as e:
    print(e.message, flush=True)
    sys.exit(e.exit_code)
""",
}


def _run(kind: str, sigs: list[signal.Signals], *args: str) -> tuple[int, str, str]:
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    p = subprocess.Popen(
        [sys.executable, "-c", CHILD[kind], *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert p.stdout.readline().strip() == "ready"
        for i, s in enumerate(sigs):
            if i:
                assert p.stdout.readline().strip() == "saving"
            p.send_signal(s)
        out, err = p.communicate(timeout=20)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    return p.returncode, out, err


@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_during_setup_removes_the_half_made_run_dir(tmp_path, sig, code):
    run = tmp_path / "out" / "run"
    rc, out, err = _run("setup", [sig], str(run))
    assert rc == code, err
    assert out.strip() == f"interrupted by {sig.name} during setup"
    assert err == ""
    assert list(tmp_path.iterdir()) == []


def test_signal_in_the_loop_sets_the_flag(tmp_path):
    rc, out, err = _run("loop", [signal.SIGTERM])
    assert rc == 0, err
    assert out.strip() == "saved after SIGTERM"
    assert err.strip() == "kdistill: SIGTERM received: finishing this step and saving a checkpoint"


def test_second_signal_forces_the_exit():
    t = time.time()
    rc, out, err = _run("twice", [signal.SIGTERM, signal.SIGINT])
    assert rc == 130 and time.time() - t < 10
    assert err.strip().splitlines()[-1] == "kdistill: second signal (SIGINT), exiting now"


def test_signal_in_a_critical_section_waits_for_its_end():
    rc, out, err = _run("deferred", [signal.SIGTERM])
    assert rc == 143, err
    assert out.split("\n")[:2] == ["critical section done", "interrupted by SIGTERM during export"]


def test_in_process_modes_and_check():
    with signals.installed():
        assert signals.requested() is None
        signals.check()  # nothing pending
        with signals.graceful():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.01)
            assert signals.requested() == "SIGTERM"
        with pytest.raises(Interrupted) as e:
            signals.check("the last checkpoint is kept")
        assert str(e.value) == "interrupted by SIGTERM; the last checkpoint is kept"
        assert e.value.exit_code == 143
        assert not isinstance(e.value, Exception)  # `except Exception` never swallows it
    assert signals.requested() is None
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_install_off_the_main_thread_is_a_no_op():
    result = []
    t = threading.Thread(target=lambda: result.append(signals.install()))
    t.start()
    t.join()
    assert result == [False]
