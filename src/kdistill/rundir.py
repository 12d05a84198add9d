"""Run directories: made by kdistill (a marker proves it), one run at a time (a lock), removed only when
proven ours.

    check_path_value("output.dir", value)        # empty or whitespace-only: one-line error
    with creating_run_dir(path) as made:          # mkdir + marker; if the block raises (or a signal
        ...                                       # raises Interrupted) only what it made is removed
    with RunLock(path):                           # O_EXCL lock file holding pid and host; a stale lock
        ...                                       # (dead pid on this host) is reported and taken over
    safe_remove_run_dir(path)                     # --overwrite: only a directory carrying our marker,
                                                  # never cwd, a parent of it, home or /

The marker `.kdistill-run` is a small JSON file ({"kdistill_run": <random id>, "created": <time>});
the lock `.kdistill-lock` holds {"pid", "host", "start", "token", "since"}.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import secrets
import shutil
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kdistill.errors import UserError
from kdistill.fileio import atomic_write_text, fault_point, fsync_dir

log = logging.getLogger(__name__)

MARKER_NAME = ".kdistill-run"
LOCK_NAME = ".kdistill-lock"
_MAX_SMALL = 4096  # marker and lock files are a few dozen bytes


def check_path_value(name: str, value: Any) -> Path:
    """A path option as a Path; empty or whitespace-only (which would mean the working directory) is an
    error, as is a value with a NUL byte."""
    text = os.fspath(value) if isinstance(value, str | os.PathLike) else value
    if not isinstance(text, str):
        raise UserError(f"{name} is {type(value).__name__}, expected a directory path")
    if not text.strip():
        raise UserError(f"{name} is empty, expected a directory path")
    if "\0" in text:
        raise UserError(f"{name} contains a NUL byte, expected a directory path")
    return Path(text)


def _read_small_json(path: Path) -> dict[str, Any] | None:
    """A small JSON object file, or None if absent, a symlink, too big or not a JSON object."""
    try:
        if path.is_symlink() or not path.is_file():
            return None
        with open(path, "rb") as f:
            raw = f.read(_MAX_SMALL + 1)
        if len(raw) > _MAX_SMALL:
            return None
        obj = json.loads(raw.decode("utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    return obj if isinstance(obj, dict) else None


# ----------------------------------------------------------------------------------------------
# The marker


def write_marker(run_dir: Path | str) -> str:
    """Write the marker into `run_dir` (which kdistill has just created); returns the run id."""
    run_id = secrets.token_hex(8)
    body = {"kdistill_run": run_id, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "pid": os.getpid()}
    atomic_write_text(Path(run_dir) / MARKER_NAME, json.dumps(body) + "\n")
    return run_id


def read_marker(run_dir: Path | str) -> str | None:
    """The run id in `run_dir`'s marker, or None when there is no valid marker."""
    obj = _read_small_json(Path(run_dir) / MARKER_NAME)
    rid = obj.get("kdistill_run") if obj else None
    return rid if isinstance(rid, str) and rid else None


def has_marker(run_dir: Path | str) -> bool:
    return read_marker(run_dir) is not None


# ----------------------------------------------------------------------------------------------
# Removal


def protected_reason(resolved: Path) -> str | None:
    """Why `resolved` must never be removed, or None."""
    if resolved == Path(resolved.anchor):
        return "it is the filesystem root"
    home = Path.home().resolve()
    if resolved == home:
        return "it is the home directory"
    if home.is_relative_to(resolved):
        return "it contains the home directory"
    try:
        cwd = Path.cwd().resolve()
    except OSError:
        cwd = None
    if cwd is not None and resolved == cwd:
        return "it is the current working directory"
    if cwd is not None and cwd.is_relative_to(resolved):
        return "it contains the current working directory"
    return None


def check_removable(path: Path | str, name: str = "output.dir") -> Path:
    """The resolved path if kdistill may remove it, else a one-line UserError saying why not."""
    p = check_path_value(name, path)
    if p.is_symlink():
        raise UserError(f"{name} '{p}' is a symbolic link; refusing to remove it (give the real directory)")
    resolved = p.resolve()
    why = protected_reason(resolved)
    if why:
        raise UserError(f"{name} '{p}': refusing to remove it ({why})")
    if not resolved.exists():
        return resolved
    if not resolved.is_dir():
        raise UserError(f"{name} '{p}' is a file, expected a directory")
    if not has_marker(resolved):
        raise UserError(
            f"{name} '{p}' was not created by kdistill (no {MARKER_NAME} marker); refusing to remove it: "
            "delete it yourself or choose another directory"
        )
    return resolved


def safe_remove_run_dir(path: Path | str, *, keep: tuple[str, ...] = (), name: str = "output.dir") -> None:
    """Remove a run directory kdistill made (see `check_removable`). With `keep` (e.g. (LOCK_NAME,
    MARKER_NAME) while holding the run's lock), empty it but leave those entries and the directory."""
    resolved = check_removable(path, name)
    if not resolved.exists():
        return
    try:
        if not keep:
            shutil.rmtree(resolved)
            return
        for entry in resolved.iterdir():
            if entry.name in keep:
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
    except OSError as e:
        raise UserError(f"{name} '{path}': cannot remove it ({e.strerror or e.__class__.__name__})") from None


# ----------------------------------------------------------------------------------------------
# Creation that completes or removes what it made


class DirectoryInUse(UserError):
    """Another kdistill run holds the directory's lock (or took it while this one tried)."""


@dataclass
class MadeRunDir:
    path: Path
    run_id: str
    created: list[Path] = field(default_factory=list)  # directories this process made, outermost first
    before: set[str] | None = None  # entries of a directory that existed already (None: we made it)


@contextlib.contextmanager
def creating_run_dir(path: Path | str, *, name: str = "output.dir") -> Iterator[MadeRunDir]:
    """Make the run directory (parents included) and its marker; if the block raises anything
    (UserError, Interrupted from a signal, KeyboardInterrupt), remove only what this made: the
    directories it created, or, in a directory that existed already, the entries that were not there.

    An existing directory is accepted only when it is empty or already one of ours (carries a marker);
    anything else is an error and nothing is touched. A DirectoryInUse from the block (another run holds
    the directory's lock) removes nothing: the directory and whatever appeared in it are that run's,
    even where this process made the directory or its marker a moment before the other took the lock.
    """
    p = check_path_value(name, path)
    if p.exists() and not p.is_dir():
        raise UserError(f"{name} '{p}' is a file, expected a directory")
    created: list[Path] = []
    before: set[str] | None = None
    if p.is_dir():
        before = _entries(p, name)
        # another kdistill run may have made it a moment ago and be writing its marker (a temp file, then
        # a rename): wait for the rename rather than call the directory foreign
        deadline = time.monotonic() + 1.0
        while before and MARKER_NAME not in before and all(map(_marker_temp, before)):
            if time.monotonic() > deadline:
                break  # a marker's temp file left by a killed kdistill: the directory is one of ours
            time.sleep(0.01)
            before = _entries(p, name)
        if before and MARKER_NAME not in before and not all(map(_marker_temp, before)):
            raise UserError(f"{name} '{p}' exists and is not empty, and is not a kdistill run directory")
    made = MadeRunDir(path=p, run_id="", created=created, before=before)
    try:
        missing = []
        q = p.absolute()
        while not q.exists():
            missing.append(q)
            q = q.parent
        for d in reversed(missing):
            fault_point(d)
            try:
                d.mkdir()
            except FileExistsError:  # another process made it since: not ours to remove
                if not d.is_dir():
                    raise
                if d == p.absolute() and made.before is None:
                    made.before = _entries(d, name)
                continue
            created.append(d)
        fsync_dir(q)
        made.run_id = read_marker(p) or write_marker(p)
        yield made
    except DirectoryInUse:
        raise
    except BaseException:
        _undo(made)
        raise


def _marker_temp(entry: str) -> bool:
    """The name of the temp file `write_marker` renames into the marker (fileio.atomic_write_bytes)."""
    return re.fullmatch(rf"\.{re.escape(MARKER_NAME)}\.[a-z0-9_]{{8}}\.tmp", entry) is not None


def _entries(p: Path, name: str) -> set[str]:
    try:
        return {e.name for e in p.iterdir()}
    except OSError as e:
        raise UserError(f"{name} '{p}' is not readable ({e.strerror})") from None


def _undo(made: MadeRunDir) -> None:
    """Remove what `creating_run_dir` made; errors ignored (the caller is already failing)."""
    if made.created:
        shutil.rmtree(made.created[0], ignore_errors=True)
        return
    if made.before is None:
        return
    with contextlib.suppress(OSError):
        for entry in made.path.iterdir():
            if entry.name in made.before:
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)


# ----------------------------------------------------------------------------------------------
# One run per directory


def _proc_start(pid: int) -> str | None:
    """The kernel's start time of `pid` (Linux /proc), to tell a reused pid from the lock's owner."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode("ascii", "replace")
        return stat.rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive(pid: int, start: str | None) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    except OSError:
        return False
    if start is not None:
        now = _proc_start(pid)
        if now is not None and now != start:
            return False  # the pid was reused by another process
    return True


class RunLock:
    """Exclusive use of a run directory: `<dir>/.kdistill-lock`, created with O_CREAT | O_EXCL.

    A lock whose pid is dead (on this host) is stale: it is reported with a warning and taken over. A
    live one is a one-line UserError naming the pid and host. Released on exit (context manager or
    `release()`); a process killed with SIGKILL leaves a lock that the next run finds stale.
    """

    def __init__(self, run_dir: Path | str, *, name: str = "output.dir", path: Path | None = None) -> None:
        self.dir = Path(run_dir)
        # `path`: a lock file elsewhere (outputs.output_lock: beside an output written by a rename)
        self.path = Path(path) if path is not None else self.dir / LOCK_NAME
        self.name = name
        self.token = secrets.token_hex(8)
        self.held = False
        self.took_over: dict[str, Any] | None = None

    def _body(self) -> str:
        return json.dumps(
            {
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "start": _proc_start(os.getpid()),
                "token": self.token,
                "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            }
        )

    def _try_create(self) -> bool:
        try:
            fault_point(self.path)
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        except FileNotFoundError:
            raise UserError(f"{self.name} '{self.dir}' does not exist (cannot lock it)") from None
        except OSError as e:
            raise UserError(
                f"{self.name} '{self.dir}' is not writable ({e.strerror or e.__class__.__name__})"
            ) from None
        try:
            os.write(fd, self._body().encode())
            os.fsync(fd)
        except OSError as e:
            os.close(fd)
            self.path.unlink(missing_ok=True)
            raise UserError(f"{self.path}: cannot write the lock ({e.strerror})") from None
        os.close(fd)
        return True

    def acquire(self) -> RunLock:
        for _ in range(5):
            if self._try_create():
                self.held = True
                return self
            info = _read_small_json(self.path)
            if info is None:
                # Unreadable or half-written (its writer was killed between create and write): stale if
                # it stays so for a moment, else another run is just writing it.
                time.sleep(0.2)
                info = _read_small_json(self.path)
                if info is None and self.path.exists():
                    self._take_over(None)
                continue
            pid, host = info.get("pid"), info.get("host")
            start = info.get("start") if isinstance(info.get("start"), str) else None
            pid_ok = isinstance(pid, int) and not isinstance(pid, bool)
            if host == socket.gethostname() and pid_ok and not _alive(pid, start):
                self._take_over(info)
                continue
            if (
                pid_ok
                and host == socket.gethostname()
                and pid == os.getpid()
                and info.get("token") != self.token
            ):
                raise DirectoryInUse(f"{self.name} '{self.dir}' is already locked by this process")
            who = f"pid {pid}" + (f" on host {host}" if isinstance(host, str) else "")
            raise DirectoryInUse(
                f"{self.name} '{self.dir}' is in use by another kdistill run ({who}); wait for it to end "
                f"or choose another directory (if that run is gone, remove {self.path})"
            )
        raise DirectoryInUse(f"{self.name} '{self.dir}': could not take the lock {self.path} (contended)")

    def _take_over(self, info: dict[str, Any] | None) -> None:
        """Remove a stale lock, unless someone replaced it meanwhile (re-read under a rename)."""
        aside = self.path.with_name(f"{self.path.name}.stale-{self.token}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return  # another process took it over first
        now = _read_small_json(aside)
        if now != info:
            # Not the stale lock we judged (a fresh one replaced it): put it back if we still can.
            with contextlib.suppress(OSError):
                os.link(aside, self.path)
            aside.unlink(missing_ok=True)
            return
        aside.unlink(missing_ok=True)
        self.took_over = info or {}
        who = f"pid {info.get('pid')} on host {info.get('host')}" if info else "an unreadable lock"
        log.warning("%s: took over a stale lock (%s, no longer running)", self.dir, who)

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        info = _read_small_json(self.path)
        if info is not None and info.get("token") == self.token:
            with contextlib.suppress(OSError):
                self.path.unlink()

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()
