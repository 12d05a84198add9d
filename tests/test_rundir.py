"""Run directories: removed only when kdistill's marker proves it made them (never cwd, a parent of it,
home or /), created completely or not at all, and locked to one run at a time."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kdistill.errors import UserError
from kdistill.fileio import inject_write_faults
from kdistill.rundir import (
    LOCK_NAME,
    MARKER_NAME,
    DirectoryInUse,
    RunLock,
    check_path_value,
    creating_run_dir,
    has_marker,
    safe_remove_run_dir,
    write_marker,
)
from kdistill.signals import Interrupted


def _err(fn, *a, **kw) -> str:
    with pytest.raises(UserError) as e:
        fn(*a, **kw)
    assert "\n" not in str(e.value)
    return str(e.value)


@pytest.mark.parametrize("value", ["", "   ", "\t\n"])
def test_empty_or_whitespace_path_is_an_error(value):
    assert _err(check_path_value, "output.dir", value) == "output.dir is empty, expected a directory path"
    assert _err(safe_remove_run_dir, value) == "output.dir is empty, expected a directory path"


def test_removal_refuses_cwd_its_parents_home_and_root(tmp_path, monkeypatch):
    work = tmp_path / "work"
    (work / "sub").mkdir(parents=True)
    write_marker(work)
    monkeypatch.chdir(work / "sub")
    assert "parent" not in _err(safe_remove_run_dir, ".")
    assert (
        _err(safe_remove_run_dir, ".")
        == "output.dir '.': refusing to remove it (it is the current working directory)"
    )
    assert "(it contains the current working directory)" in _err(safe_remove_run_dir, "..")
    assert "(it contains the current working directory)" in _err(safe_remove_run_dir, str(work))
    assert "(it is the filesystem root)" in _err(safe_remove_run_dir, "/")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    assert "(it is the home directory)" in _err(safe_remove_run_dir, str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path / "home")
    assert "(it contains the home directory)" in _err(safe_remove_run_dir, str(tmp_path))
    assert work.is_dir() and (work / "sub").is_dir()


def test_removal_needs_the_marker(tmp_path):
    d = tmp_path / "out"
    (d / "checkpoints").mkdir(parents=True)
    assert _err(safe_remove_run_dir, d) == (
        f"output.dir '{d}' was not created by kdistill (no {MARKER_NAME} marker); refusing to remove it: "
        "delete it yourself or choose another directory"
    )
    (d / MARKER_NAME).write_text("not json")  # a marker we did not write
    assert "not created by kdistill" in _err(safe_remove_run_dir, d)
    (d / MARKER_NAME).unlink()
    (d / MARKER_NAME).symlink_to(tmp_path / "elsewhere")
    assert "not created by kdistill" in _err(safe_remove_run_dir, d)
    assert (d / "checkpoints").is_dir()
    link = tmp_path / "link"
    link.symlink_to(d)
    assert "is a symbolic link" in _err(safe_remove_run_dir, link)
    f = tmp_path / "file"
    f.write_text("x")
    assert _err(safe_remove_run_dir, f) == f"output.dir '{f}' is a file, expected a directory"


def test_removal_of_a_marked_directory(tmp_path):
    d = tmp_path / "run"
    (d / "checkpoints").mkdir(parents=True)
    write_marker(d)
    (d / LOCK_NAME).write_text("{}")
    safe_remove_run_dir(d, keep=(MARKER_NAME, LOCK_NAME))
    assert sorted(p.name for p in d.iterdir()) == sorted([MARKER_NAME, LOCK_NAME])
    safe_remove_run_dir(d)
    assert not d.exists()
    safe_remove_run_dir(d)  # already gone: nothing to do


# ----------------------------------------------------------------------------------------------
# creating_run_dir


def test_creating_run_dir_completes(tmp_path):
    with creating_run_dir(tmp_path / "a" / "b" / "run") as made:
        assert has_marker(made.path)
    assert has_marker(tmp_path / "a" / "b" / "run") and len(made.run_id) == 16


@pytest.mark.parametrize(
    "exc", [UserError("bad teacher"), Interrupted("SIGTERM", "setup"), KeyboardInterrupt()]
)
def test_creating_run_dir_removes_only_what_it_made(tmp_path, exc):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "keep.txt").write_text("mine")
    with pytest.raises(type(exc)):
        with creating_run_dir(tmp_path / "a" / "b" / "run") as made:
            (made.path / "config.yaml").write_text("x")
            raise exc
    assert not (tmp_path / "a" / "b").exists()
    assert (tmp_path / "a" / "keep.txt").read_text() == "mine"


def test_creating_run_dir_in_an_existing_empty_dir(tmp_path):
    d = tmp_path / "out"
    d.mkdir()
    with pytest.raises(UserError):
        with creating_run_dir(d):
            (d / "config.yaml").write_text("x")
            raise UserError("late failure")
    assert d.is_dir() and list(d.iterdir()) == []


def test_creating_run_dir_refuses_a_foreign_directory_or_a_file(tmp_path):
    d = tmp_path / "photos"
    d.mkdir()
    (d / "cat.jpg").write_bytes(b"\xff")
    assert "exists and is not empty, and is not a kdistill run directory" in _err(
        lambda: creating_run_dir(d).__enter__()
    )
    assert (d / "cat.jpg").exists()
    assert "is a file, expected a directory" in _err(lambda: creating_run_dir(d / "cat.jpg").__enter__())
    assert "is empty" in _err(lambda: creating_run_dir(" ").__enter__())


# ----------------------------------------------------------------------------------------------
# RunLock


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_lock_is_exclusive_and_released(tmp_path):
    with RunLock(tmp_path) as lock:
        info = json.loads((tmp_path / LOCK_NAME).read_text())
        assert info["pid"] == os.getpid() and info["host"] == socket.gethostname()
        assert "already locked by this process" in _err(RunLock(tmp_path).acquire)
        assert lock.held
    assert not (tmp_path / LOCK_NAME).exists()


def test_a_live_lock_is_a_one_line_error(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": child.pid, "host": socket.gethostname()}))
        msg = _err(RunLock(tmp_path).acquire)
        assert f"is in use by another kdistill run (pid {child.pid} on host {socket.gethostname()})" in msg
    finally:
        child.kill()
        child.wait()
    # Another host: its pid cannot be checked from here, so it counts as live.
    (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": 1, "host": "elsewhere-host"}))
    assert "(pid 1 on host elsewhere-host)" in _err(RunLock(tmp_path).acquire)


def test_a_stale_lock_is_reported_and_taken_over(tmp_path, caplog):
    dead = _dead_pid()
    (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": dead, "host": socket.gethostname()}))
    with caplog.at_level("WARNING"):
        with RunLock(tmp_path) as lock:
            assert lock.took_over["pid"] == dead
            assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    assert f"took over a stale lock (pid {dead}" in caplog.text
    assert not (tmp_path / LOCK_NAME).exists()
    assert [p.name for p in tmp_path.iterdir()] == []


def test_a_reused_pid_is_stale_and_a_torn_lock_is_taken_over(tmp_path):
    # Our own pid, but a start time that is not ours: the pid was reused after the owner died.
    (tmp_path / LOCK_NAME).write_text(
        json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "start": "1"})
    )
    if Path("/proc/self/stat").exists():
        with RunLock(tmp_path) as lock:
            assert lock.took_over is not None
    (tmp_path / LOCK_NAME).write_text("")  # killed between create and write
    with RunLock(tmp_path) as lock:
        assert lock.took_over == {}


def test_lock_survives_sigkill_as_a_stale_lock(tmp_path):
    code = f"from kdistill.rundir import RunLock; import os; RunLock({str(tmp_path)!r}).acquire(); os.kill(os.getpid(), 9)"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    p = subprocess.run([sys.executable, "-c", code], env=env)
    assert p.returncode == -9 and (tmp_path / LOCK_NAME).exists()
    with RunLock(tmp_path) as lock:
        assert isinstance(lock.took_over["pid"], int)


def test_lock_on_a_missing_or_unwritable_directory(tmp_path):
    assert "does not exist" in _err(RunLock(tmp_path / "nope").acquire)
    with inject_write_faults("EACCES"):
        assert (
            _err(RunLock(tmp_path).acquire) == f"output.dir '{tmp_path}' is not writable (Permission denied)"
        )
    with inject_write_faults("EROFS"):
        assert "is not writable (Read-only file system)" in _err(RunLock(tmp_path).acquire)
    assert list(tmp_path.iterdir()) == []


def test_creating_run_dir_fault_leaves_nothing(tmp_path):
    with inject_write_faults("ENOSPC", nth=2):  # the second mkdir
        with pytest.raises(OSError):
            with creating_run_dir(tmp_path / "a" / "b"):
                pass
    assert list(tmp_path.iterdir()) == []
    with inject_write_faults("ENOSPC", nth=2):  # the marker write, after both mkdirs
        with pytest.raises(OSError):
            with creating_run_dir(tmp_path / "a"):
                pass
    assert list(tmp_path.iterdir()) == []


def test_a_run_refused_by_the_lock_removes_nothing_of_the_run_holding_it(tmp_path):
    """Two runs started together on one directory: the one refused by the lock leaves the other's files,
    whether it found the directory made (and listed it before the other wrote there) or made it itself a
    moment before the other took the lock."""
    found = tmp_path / "found"
    with creating_run_dir(found):  # the first run made it
        pass
    holder = RunLock(found).acquire()
    try:
        with pytest.raises(DirectoryInUse, match="is already locked"), creating_run_dir(found):
            (found / "metrics.jsonl").write_text("{}\n")  # the holder writes after this run listed it
            RunLock(found).acquire()
        assert (found / "metrics.jsonl").exists() and has_marker(found)
    finally:
        holder.release()
    made = tmp_path / "parent" / "made"
    with pytest.raises(DirectoryInUse), creating_run_dir(made):  # this run makes the directory...
        other = RunLock(made).acquire()  # ...and the other takes the lock first
        (made / "metrics.jsonl").write_text("{}\n")
        RunLock(made).acquire()
    assert (made / "metrics.jsonl").exists() and has_marker(made)
    other.release()
    # any other failure still removes what this run made
    gone = tmp_path / "gone" / "run"
    with pytest.raises(UserError), creating_run_dir(gone):
        raise UserError("a check before the first step")
    assert not (tmp_path / "gone").exists()


def test_a_directory_made_by_another_process_between_the_check_and_mkdir_is_not_ours(tmp_path, monkeypatch):
    run = tmp_path / "run"
    real = Path.mkdir

    def racing(self, *a, **k):
        if self == run.absolute() and not self.exists():
            real(self)  # the other process makes it first
            (self / "theirs.txt").write_text("x")
        return real(self, *a, **k)

    monkeypatch.setattr(Path, "mkdir", racing)
    with pytest.raises(UserError), creating_run_dir(run):
        raise UserError("a check before the first step")
    monkeypatch.undo()
    assert (run / "theirs.txt").exists()  # only what this run added is gone


def test_a_directory_whose_marker_another_run_is_writing_is_one_of_ours(tmp_path):
    """The other run made the directory and is between its marker's temp file and the rename: this run
    waits for the marker instead of calling the directory foreign; a temp left by a killed writer is
    kdistill's too."""
    import threading

    from kdistill.rundir import read_marker

    run = tmp_path / "run"
    run.mkdir()
    body = json.dumps({"kdistill_run": "theirs", "created": "now", "pid": 1}) + "\n"
    tmp = run / f".{MARKER_NAME}.abcd1234.tmp"
    tmp.write_text(body)
    renamer = threading.Timer(0.05, os.replace, (tmp, run / MARKER_NAME))
    renamer.start()
    with creating_run_dir(run) as made:
        pass
    renamer.join()
    assert made.run_id == "theirs" == read_marker(run)
    left = tmp_path / "left"
    left.mkdir()
    (left / f".{MARKER_NAME}.zyxw9876.tmp").write_text(body)
    with creating_run_dir(left) as made:  # after the wait: a killed writer's temp
        pass
    assert has_marker(left) and made.run_id != "theirs"
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "notes.txt").write_text("x")
    with pytest.raises(UserError, match="not a kdistill run directory"):
        with creating_run_dir(tmp_path / "foreign"):
            pass
