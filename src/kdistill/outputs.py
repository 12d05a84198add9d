"""Output folders kdistill writes (exports, the run's student, teacher caches, generations): never a folder
kdistill did not write, never one of the run's inputs, never half-written.

    check_target(out, "export-merged", inputs=[("student.path", base)])   # before any work: one line
    with output_lock(out):                  # one writer per output (a lock file beside it)
        with staged_output(out, "export-merged", what="write the merged model") as tmp:
            ...                             # write into tmp (a sibling of out); on success tmp gets the
                                            # marker and replaces out in one rename; on any failure tmp is
                                            # removed and a write fault is one line (fileio.write_guard)

The marker `.kdistill-output` ({"kdistill_output": KIND, "created": ...}) says which kind of output
kdistill wrote there; a folder holding nothing but the marker's temp file (its writer killed before the
rename) counts as empty. An existing target is replaced only when it carries the marker of the same kind
(or `legacy(out)` vouches for it: an output written before markers existed, inside a folder kdistill
owns); anything else is refused, whatever the options. A target that is, or contains, one of the inputs
(student.path, a teacher, the run directory) is refused too.

Temp folders are named `.<name>.tmp-<pid>-<hex>` and the previous output, while it is swapped,
`.<name>.old-<pid>-<hex>`. `staged_output` removes those left by a killed writer (it holds the lock, so
no live writer owns them; an output cut between its two renames is put back first).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from kdistill import signals
from kdistill.errors import UserError
from kdistill.fileio import atomic_write_text, fsync_dir, is_atomic_temp, write_guard
from kdistill.rundir import RunLock, _read_small_json

MARKER = ".kdistill-output"


def read_output_marker(out: Path | str) -> str | None:
    """The kind in `out`'s marker, or None (no marker, or not one of ours)."""
    obj = _read_small_json(Path(out) / MARKER)
    kind = obj.get("kdistill_output") if obj else None
    return kind if isinstance(kind, str) else None


def write_output_marker(folder: Path | str, kind: str) -> None:
    body = {"kdistill_output": kind, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    atomic_write_text(Path(folder) / MARKER, json.dumps(body) + "\n")


def _label(name: str, out: Path | str) -> str:
    """How an error names the output: '--out DIR', or the path alone when `name` is empty."""
    return f"{name} {out}" if name else str(out)


def _same_or_inside(inner: Path, outer: Path) -> bool:
    return inner == outer or inner.is_relative_to(outer)


def check_inputs(out: Path | str, inputs: Iterable[tuple[str, str | Path]], name: str = "--out") -> None:
    """One line when `out` is, or contains, one of `inputs` ((label, path) pairs, those that exist):
    writing there would replace what the run reads."""
    target = Path(out).absolute().resolve()
    for label, value in inputs:
        if not value or not Path(value).exists():  # a Hub name, stdlib:train, ...: nothing to replace
            continue
        src = Path(value).absolute().resolve()
        if _same_or_inside(src, target):
            what = "is" if src == target else "contains"
            raise UserError(
                f"{_label(name, out)}: {what} {label} ({value}), an input of the run; refusing to write there "
                "(choose a new folder)"
            )


def check_target(
    out: Path | str,
    kind: str,
    *,
    name: str = "--out",
    inputs: Iterable[tuple[str, str | Path]] = (),
    legacy: Callable[[Path], bool] | None = None,
) -> Path:
    """`out` as a Path if kdistill may write `kind` there: absent, empty, or carrying the marker of an
    earlier `kind` (or vouched for by `legacy`), and not one of `inputs`; else a one-line UserError."""
    out = Path(out)
    check_inputs(out, inputs, name)
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise UserError(f"{_label(name, out)}: exists and is not a folder; refusing to replace it")
    if not out.is_dir():
        return out
    try:
        # empty, or holding only the temp file of a marker whose writer was killed (kdistill's own)
        empty = all(is_atomic_temp(p, MARKER) for p in out.iterdir())
    except OSError as e:
        raise UserError(f"{_label(name, out)}: cannot read it ({e.strerror})") from None
    if empty:
        return out
    found = read_output_marker(out)
    if found == kind or (found is None and legacy is not None and legacy(out)):
        return out
    made = (
        f"holds kdistill's {found} output" if found else f"was not written by kdistill (no {MARKER} marker)"
    )
    raise UserError(
        f"{_label(name, out)}: {made}, not an earlier {kind}; refusing to replace it (choose a new folder)"
    )


def lock_path(out: Path | str) -> Path:
    """The lock file of output `out`: beside it, since `out` itself is replaced by a rename."""
    out = Path(out).absolute()
    return out.parent / f".{out.name}.kdistill-lock"


def output_lock(out: Path | str, name: str = "--out") -> RunLock:
    """One writer per output: a lock file beside `out` (O_EXCL, holding pid and host; a dead writer's
    lock is taken over with a warning, a live one is a one-line error). Use as a context manager.
    The parent folder is made if missing."""
    out = Path(out).absolute()
    with write_guard(out.parent, what="make the output's folder"):
        out.parent.mkdir(parents=True, exist_ok=True)
    return RunLock(out, name=name or "output", path=lock_path(out))


def _temp_names(out: Path) -> tuple[str, str]:
    return f".{out.name}.tmp-", f".{out.name}.old-"


def clean_stale(out: Path | str) -> list[Path]:
    """Remove the temp folders of `out` a killed writer left (the caller holds `output_lock(out)`); if
    the writer was killed between moving the old output aside and renaming the new one in, the old one is
    put back first. Returns what was removed."""
    out = Path(out).absolute()
    if not out.parent.is_dir():
        return []
    tmp_prefix, old_prefix = _temp_names(out)
    removed = []
    for p in sorted(out.parent.iterdir()):
        if p.name.startswith(old_prefix) and not out.exists():
            with contextlib.suppress(OSError):
                os.rename(p, out)
                continue
        if p.name.startswith((tmp_prefix, old_prefix)):
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
            removed.append(p)
    return removed


@contextlib.contextmanager
def staged_output(
    out: Path | str,
    kind: str,
    *,
    name: str = "--out",
    what: str = "write the output",
    intact: str | None = None,
    inputs: Iterable[tuple[str, str | Path]] = (),
    legacy: Callable[[Path], bool] | None = None,
    lock: bool = True,
) -> Iterator[Path]:
    """Yield a temp folder beside `out`; when the block ends, mark it `kind` and rename it to `out`
    (an earlier output of the same kind is replaced only then). See the module docstring. `lock=False`
    when the caller already holds `output_lock(out)` or a lock covering it (a run directory's)."""
    out = Path(out)
    check_target(out, kind, name=name, inputs=inputs, legacy=legacy)
    held = output_lock(out, name).acquire() if lock else None
    try:
        clean_stale(out)
        parent = out.absolute().parent
        tag = f"{os.getpid()}-{secrets.token_hex(4)}"
        tmp_prefix, old_prefix = _temp_names(out)
        tmp, old = parent / f"{tmp_prefix}{tag}", parent / f"{old_prefix}{tag}"
        with write_guard(out, what=what, intact=intact, temps=[tmp]):
            tmp.mkdir()
            yield tmp
            write_output_marker(tmp, kind)
            fsync_dir(tmp)
            check_target(out, kind, name=name, inputs=inputs, legacy=legacy)  # nothing new appeared
            try:
                with signals.deferred():  # the two renames are not cut apart by a signal
                    if out.exists():
                        os.rename(out, old)
                        try:
                            os.rename(tmp, out)
                        except OSError:
                            os.rename(old, out)
                            raise
                    else:
                        os.rename(tmp, out)
            finally:  # also when a signal that arrived during the renames is raised at their end
                shutil.rmtree(old, ignore_errors=True)
            fsync_dir(parent)
    finally:
        if held is not None:
            held.release()
