"""Durable file writes and content hashes: the only copies in the package.

    atomic_write_text(path, text)       # temp file in the same folder, fsync, rename, fsync the folder
    atomic_write_json(path, obj)
    write_json_durable(path, obj)       # write + fsync in place (inside a temp folder renamed later)
    fsync_dir(folder)
    file_sha256(path)

Write faults become one line:

    with write_guard(ckpt_dir, what="write checkpoint", intact="last good checkpoint: step 2",
                     temps=[tmp_dir]):
        ...                              # ENOSPC/EROFS/EACCES/EDQUOT/... -> UserError, temps removed

`write_fault(exc)` is the one place that tells a write fault from a bug, whatever raised it: an OSError
with one of WRITE_FAULTS' errnos, numpy's short write (OSError "32768 requested and 22464 written", no
errno: the disk filled) and safetensors' SafetensorError ("... No space left on device (os error 28)").

Fault injection for tests: every write through this module (and every other write site that calls
`fault_point(path, lib)`) counts as one write; the N-th can be made to fail with a chosen errno, raised as
the library at that site raises it (`lib="safetensors"`: SafetensorError; `lib="numpy"`: numpy's short
write for ENOSPC; else OSError), in-process
(`inject_write_faults("ENOSPC", nth=3)`) or in a child process through the environment
(KDISTILL_TEST_WRITE_FAULT="ENOSPC@3", "EROFS@2-" for the 2nd and every later write, or a list
"ENOSPC@3,EACCES@5"). KDISTILL_TEST_WRITE_LOG=FILE appends one line per write (its number and path),
so a test can enumerate the write sites of a run and then fail each in turn.
"""

from __future__ import annotations

import contextlib
import errno as errno_mod
import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from safetensors import SafetensorError

from kdistill.errors import UserError

# ----------------------------------------------------------------------------------------------
# Fault injection (tests only; inert unless asked for)

FAULT_ENV = "KDISTILL_TEST_WRITE_FAULT"
WRITE_LOG_ENV = "KDISTILL_TEST_WRITE_LOG"


class _Faults:
    count = 0  # writes seen since the process started (or since the last inject_write_faults)
    rules: list[tuple[int, bool, int]] | None = None  # (nth, and_later, errno); None: read the env
    env_seen: str | None = None


def _parse_faults(spec: str) -> list[tuple[int, bool, int]]:
    rules = []
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        name, _, at = part.partition("@")
        code = getattr(errno_mod, name.strip().upper(), None)
        later = at.endswith("-")
        at = at.rstrip("-") or "1"
        if not isinstance(code, int) or not at.isdigit():
            raise ValueError(f"{FAULT_ENV}: bad rule {part!r} (expected e.g. ENOSPC@3 or EROFS@2-)")
        rules.append((int(at), later, code))
    return rules


def fault_point(path: Path | str, lib: str = "os") -> None:
    """Count one write to `path`; raise the injected fault if this write is the one chosen to fail, as
    the library `lib` that writes there raises it ("os", "safetensors" or "numpy": see `library_fault`).

    Called by every write in this module; other write sites (safetensors, numpy, appends) call it before
    they write so that tests can fail them too. A no-op costing one env lookup when no faults are set.
    """
    if _Faults.rules is None:
        spec = os.environ.get(FAULT_ENV, "")
        log = os.environ.get(WRITE_LOG_ENV, "")
        if not spec and not log:
            return
        if spec != _Faults.env_seen:
            _Faults.env_seen = spec
            _Faults.count = 0
        rules = _parse_faults(spec)
    else:
        rules = _Faults.rules
    _Faults.count += 1
    n = _Faults.count
    log = os.environ.get(WRITE_LOG_ENV, "")
    if log:
        with open(log, "a", encoding="utf-8") as f:
            f.write(f"{n}\t{path}\n")
    for nth, later, code in rules:
        if n == nth or (later and n > nth):
            raise library_fault(code, path, lib)


def library_fault(code: int, path: Path | str, lib: str = "os") -> BaseException:
    """The exception a library raises when the OS refuses its write with errno `code` (what a full or
    read-only filesystem really gives; tests/test_write_faults.py checks these on a full tmpfs):
    safetensors' save_file: SafetensorError('Error while serializing: I/O error: <reason> (os error N)');
    numpy's np.save into an open file on a full disk: OSError('<n> requested and <m> written'), no errno;
    anything else: OSError(errno, strerror, path)."""
    reason = os.strerror(code)
    if lib == "safetensors":
        return SafetensorError(f"Error while serializing: I/O error: {reason} (os error {code})")
    if lib == "numpy" and code == errno_mod.ENOSPC:
        return OSError("32768 requested and 22464 written")
    return OSError(code, reason, str(path))


@contextlib.contextmanager
def inject_write_faults(errno_name: str, nth: int = 1, *, and_later: bool = False) -> Iterator[None]:
    """Within the block, the `nth` write (counted from the block's start) raises OSError(errno_name);
    with and_later=True every write after it too. Restores the previous state on exit."""
    code = getattr(errno_mod, errno_name.upper())
    saved = (_Faults.rules, _Faults.count)
    _Faults.rules, _Faults.count = [(nth, and_later, code)], 0
    try:
        yield
    finally:
        _Faults.rules, _Faults.count = saved


def writes_counted() -> int:
    """Writes counted so far (in-process injection or with the env hooks set)."""
    return _Faults.count


# ----------------------------------------------------------------------------------------------
# Write faults as one line

# OS errors on a write that are the machine's state, not a bug: reported as one line.
WRITE_FAULTS = {
    errno_mod.ENOSPC,
    errno_mod.EDQUOT,
    errno_mod.EFBIG,
    errno_mod.EROFS,
    errno_mod.EACCES,
    errno_mod.EPERM,
    errno_mod.EIO,
}


# numpy's tofile/np.save into a file object when the OS took fewer bytes than asked (a full disk)
_SHORT_WRITE = re.compile(r"^\d+ requested and \d+ written$")
# safetensors (Rust) reports the OS error inside its message: "... (os error 28)"
_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")


def write_fault(exc: BaseException) -> str | None:
    """The OS reason ("No space left on device") when `exc` is a write fault as some library raises it
    (see the module docstring), else None: the one place that maps write failures."""
    if isinstance(exc, OSError):
        if exc.errno in WRITE_FAULTS:
            return exc.strerror or os.strerror(exc.errno)
        if exc.errno is None and _SHORT_WRITE.match(str(exc)):
            return f"{os.strerror(errno_mod.ENOSPC)}: the disk took only part of a write"
        return None
    if type(exc).__name__ == "SafetensorError":
        m = _RUST_OS_ERROR.search(str(exc))
        if m and int(m.group(1)) in WRITE_FAULTS:
            return os.strerror(int(m.group(1)))
    return None


def write_fault_error(path: Path | str, what: str, reason: str, intact: str | None = None) -> UserError:
    """The one line of a write fault: '<path>: cannot <what> (<reason>); <intact>'."""
    tail = f"; {intact}" if intact else ""
    return UserError(f"{path}: cannot {what} ({reason}){tail}")


def remove_quietly(paths: Iterable[Path | str]) -> None:
    """Remove files or folders (temp leftovers); errors ignored, since the caller is already failing."""
    for p in paths:
        p = Path(p)
        try:
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
        except OSError:
            pass


@contextlib.contextmanager
def write_guard(
    path: Path | str,
    *,
    what: str = "write",
    intact: str | None = None,
    temps: Iterable[Path | str] = (),
) -> Iterator[list[Path]]:
    """Turn a disk-full, quota, read-only or permission fault inside the block (as `write_fault` knows
    it, from the OS, numpy or safetensors) into one UserError: '<path>: cannot <what> (<OS reason>);
    <intact>', after removing `temps` (and any path appended to the yielded list inside the block).
    Other exceptions pass through; temps are removed for them too.

        with write_guard(out, what="write checkpoint", intact="earlier checkpoints are intact") as tmp:
            tmp.append(tmp_dir := out.with_name(out.name + ".tmp"))
            ...
    """
    made: list[Path] = [Path(t) for t in temps]
    try:
        yield made
    except Exception as e:
        remove_quietly(made)
        reason = write_fault(e)
        if reason is None:
            raise
        raise write_fault_error(path, what, reason, intact) from None
    except BaseException:
        remove_quietly(made)
        raise


def fsync_dir(path: Path) -> None:
    """Flush a directory entry (after a rename into it); a no-op where the OS does not allow it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_json_durable(path: Path, obj: Any, indent: int = 2) -> None:
    """Write JSON to `path` and fsync it (callers write into a temp folder that is renamed later)."""
    fault_point(path)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=indent)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def atomic_write_bytes(path: Path | str, data: bytes) -> None:
    """Replace `path` with `data` all at once: readers see the old file or the new one, never a part.
    The temp file lives in the same folder (so the rename is atomic) and is removed on any failure."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            fault_point(path)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def is_atomic_temp(entry: Path | str, name: str) -> bool:
    """`entry` is the temp file `atomic_write_bytes` makes for a file called `name` in the same folder
    (`.<name>.<8 random characters>.tmp`, as `tempfile.mkstemp` names it): kdistill's own, left behind
    only by a writer killed before its rename."""
    entry = Path(entry)
    pattern = rf"\.{re.escape(name)}\.[a-z0-9_]{{8}}\.tmp"
    return re.fullmatch(pattern, entry.name) is not None and entry.is_file() and not entry.is_symlink()


def atomic_write_text(path: Path | str, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: Path | str, obj: Any, indent: int = 2) -> None:
    atomic_write_text(path, json.dumps(obj, indent=indent, default=str) + "\n")


def file_sha256(path: Path | str, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file's bytes, read in 1 MiB pieces."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()
