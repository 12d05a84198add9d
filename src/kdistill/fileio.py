"""Durable file writes and content hashes: the only copies in the package.

atomic_write_text(path, text)       # temp file in the same folder, fsync, rename, fsync the folder
atomic_write_json(path, obj)
write_json_durable(path, obj)       # write + fsync in place (inside a temp folder renamed later)
fsync_dir(folder)
file_sha256(path)
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any


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
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


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
