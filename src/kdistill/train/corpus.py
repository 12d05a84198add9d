"""Named corpora a data config may list: 'stdlib:train' and 'stdlib:heldout', the Python standard
library source of the interpreter running kdistill (the embedded demo's corpus).

It is always present offline. Files are split into train and held-out by a hash of their path
relative to the stdlib root, so the split is deterministic and the same on every machine that has
the same Python version (and nearly the same across versions: the hash is per file).

    train, heldout = stdlib_split()
    paths = expand_data_paths(["stdlib:train", "more/data.jsonl"])   # files of the split, then the rest
"""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

# Folders left out: tests and demos are large, repetitive, and not what the library "is".
_EXCLUDE = {
    "test",
    "tests",
    "idlelib",
    "site-packages",
    "dist-packages",
    "lib2to3",
    "turtledemo",
    "__pycache__",
    "ensurepip",
    "pydoc_data",
    "unittest",
}
HELDOUT_PERCENT = 5


def stdlib_root() -> Path:
    """Folder of the running interpreter's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files() -> list[Path]:
    """All .py files of the stdlib (sorted, tests and demos excluded)."""
    root = stdlib_root()
    out = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root)
        if any(part in _EXCLUDE for part in rel.parts[:-1]):
            continue
        out.append(p)
    return out


def is_heldout(rel_path: str) -> bool:
    """Deterministic held-out membership of a file by its stdlib-relative path."""
    h = int.from_bytes(hashlib.sha256(rel_path.encode()).digest()[:8], "little")
    return h % 100 < HELDOUT_PERCENT


def stdlib_split() -> tuple[list[Path], list[Path]]:
    """(train files, held-out files) of the stdlib corpus."""
    root = stdlib_root()
    train, heldout = [], []
    for p in stdlib_files():
        (heldout if is_heldout(p.relative_to(root).as_posix()) else train).append(p)
    return train, heldout


def expand_data_paths(paths: list[str]) -> list[str]:
    """'stdlib:train' / 'stdlib:heldout' name the stdlib corpus's files; other entries pass through."""
    out: list[str] = []
    for p in paths:
        if p in ("stdlib:train", "stdlib:heldout"):
            train, heldout = stdlib_split()
            out.extend(str(f) for f in (train if p.endswith("train") else heldout))
        else:
            out.append(p)
    return out
