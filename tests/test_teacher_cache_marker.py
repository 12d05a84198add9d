"""A `teacher-cache` killed while it writes its output marker leaves --out holding only the marker's temp
file: that file is kdistill's own, so a rerun recognizes it, removes it and writes the cache. Anything
else beside it is still refused as not written by kdistill.

The kill is a real SIGKILL of a `kdistill teacher-cache` child at the marker's write (after its temp file
is made, before the rename), so the folder holds exactly what the writer leaves.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys

import pytest
import yaml

from kdistill.errors import UserError
from kdistill.outputs import MARKER, check_target
from tests.test_train_kit import REPO, base_config, child_env, run_cli

# A child `kdistill teacher-cache` that kills itself with SIGKILL at the marker's write.
_KILLED_AT_MARKER = """
import os, signal, sys
from pathlib import Path
from kdistill import fileio
from kdistill.cli import main
real = fileio.fault_point
def fault_point(path, lib="os"):
    if Path(path).name == sys.argv[1]:
        os.kill(os.getpid(), signal.SIGKILL)
    return real(path, lib)
fileio.fault_point = fault_point
sys.exit(main(sys.argv[2:]))
"""


def _temps(folder):
    return [
        p.name for p in folder.iterdir() if re.fullmatch(r"\.\.kdistill-output\.[a-z0-9_]{8}\.tmp", p.name)
    ]


def test_a_cache_killed_while_writing_its_marker_is_finished_by_a_rerun(tmp_path, capsys):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump(base_config(tmp_path / "run", steps=2), sort_keys=False))
    out = tmp_path / "tc"
    argv = ["teacher-cache", str(cfg), "--out", str(out), "--quiet", "--json"]
    proc = subprocess.run(
        [sys.executable, "-c", _KILLED_AT_MARKER, MARKER, *argv],
        cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    left = sorted(p.name for p in out.iterdir())
    assert len(left) == 1 and _temps(out) == left  # only the marker's temp file, as the writer left it

    rc, stdout, err = run_cli(capsys, *argv)
    assert rc == 0, err
    assert json.loads(stdout)["rows"] > 0
    assert _temps(out) == []
    assert json.loads((out / MARKER).read_text())["kdistill_output"] == "teacher-cache"
    assert json.loads((out / "manifest.json").read_text())["complete"] is True


@pytest.mark.parametrize(
    "extra",
    [
        {"notes.txt": "mine"},  # a user's file beside the temp
        {"..kdistill-output.abc.tmp": "{}"},  # not a name the writer makes
        {".kdistill-output.abcdefgh.tmp": "{}"},
    ],
    ids=["foreign-file", "short-name", "other-prefix"],
)
def test_a_marker_temp_beside_anything_else_is_still_refused(tmp_path, extra):
    out = tmp_path / "tc"
    out.mkdir()
    (out / "..kdistill-output.k2x_9q0a.tmp").write_text('{"kdistill_output": "teacher-cache"}')
    assert check_target(out, "teacher-cache") == out  # alone, it is kdistill's own
    for name, text in extra.items():
        (out / name).write_text(text)
    with pytest.raises(UserError, match=r"was not written by kdistill \(no \.kdistill-output marker\)"):
        check_target(out, "teacher-cache")
