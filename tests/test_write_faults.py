"""Write faults as one line, and the write-fault injector that lets a test fail each write in turn."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kdistill.errors import UserError
from kdistill.fileio import (
    atomic_write_json,
    atomic_write_text,
    inject_write_faults,
    write_guard,
    write_json_durable,
    writes_counted,
)

SRC = Path(__file__).resolve().parents[1] / "src"


def test_the_nth_write_fails_and_leaves_no_temp_file(tmp_path):
    with inject_write_faults("ENOSPC", nth=2):
        atomic_write_text(tmp_path / "a.txt", "one")
        with pytest.raises(OSError) as e:
            atomic_write_json(tmp_path / "b.json", {"x": 1})
        assert e.value.errno == errno.ENOSPC
        write_json_durable(tmp_path / "c.json", {"y": 2})  # only the 2nd fails
        assert writes_counted() == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "c.json"]


def test_and_later_fails_every_write_after(tmp_path):
    with inject_write_faults("EROFS", nth=1, and_later=True):
        for name in ("a", "b"):
            with pytest.raises(OSError, match="Read-only file system"):
                atomic_write_text(tmp_path / name, "x")
    atomic_write_text(tmp_path / "after", "x")  # the injector is gone after the block
    assert [p.name for p in tmp_path.iterdir()] == ["after"]


@pytest.mark.parametrize(
    "name,reason",
    [
        ("ENOSPC", "No space left on device"),
        ("EROFS", "Read-only file system"),
        ("EACCES", "Permission denied"),
        ("EDQUOT", "Disk quota exceeded"),
    ],
)
def test_write_guard_turns_write_faults_into_one_line(tmp_path, name, reason):
    ckpt = tmp_path / "checkpoints" / "step-0000004"
    tmp_dir = tmp_path / "checkpoints" / ".step-0000004.tmp"
    tmp_dir.mkdir(parents=True)
    (tmp_dir / "student.safetensors").write_bytes(b"partial")
    with pytest.raises(UserError) as e:
        with write_guard(
            ckpt, what="write checkpoint", intact="last good checkpoint: step 2", temps=[tmp_dir]
        ):
            with inject_write_faults(name):
                atomic_write_json(tmp_dir / "state.json", {"step": 4})
    assert str(e.value) == f"{ckpt}: cannot write checkpoint ({reason}); last good checkpoint: step 2"
    assert not tmp_dir.exists()
    assert e.value.__cause__ is None and e.value.__suppress_context__


def test_write_guard_passes_other_errors_and_still_cleans_up(tmp_path):
    tmp = tmp_path / "x.tmp"
    with pytest.raises(OSError) as e:
        with write_guard(tmp_path / "x", temps=()) as temps:
            temps.append(tmp)
            tmp.write_text("half")
            raise OSError(errno.EBADF, "Bad file descriptor")
    assert e.value.errno == errno.EBADF and not tmp.exists()
    with pytest.raises(KeyboardInterrupt):
        with write_guard(tmp_path / "x", temps=[tmp]):
            tmp.write_text("half")
            raise KeyboardInterrupt
    assert not tmp.exists()
    with write_guard(tmp_path / "x", temps=[tmp]):  # success keeps everything
        tmp.write_text("whole")
    assert tmp.read_text() == "whole"


def test_env_injection_and_write_log_in_a_child(tmp_path):
    log = tmp_path / "writes.log"
    code = (
        "import sys\n"
        "from kdistill.fileio import atomic_write_text\n"
        "for i in range(4):\n"
        "    try:\n"
        f"        atomic_write_text({str(tmp_path)!r} + f'/f{{i}}', 'x')\n"
        "    except OSError as e:\n"
        "        print(i, e.errno)\n"
    )
    env = {
        **os.environ,
        "PYTHONPATH": str(SRC),
        "KDISTILL_TEST_WRITE_FAULT": "ENOSPC@2,EROFS@4-",
        "KDISTILL_TEST_WRITE_LOG": str(log),
    }
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[:2] == [f"1 {errno.ENOSPC}", f"3 {errno.EROFS}"]
    lines = log.read_text().splitlines()
    assert [ln.split("\t")[0] for ln in lines] == ["1", "2", "3", "4"]
    assert lines[0].endswith("/f0")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f0", "f2", "writes.log"]


def test_the_injector_raises_each_librarys_own_exception_and_the_guard_maps_it(tmp_path):
    from safetensors import SafetensorError

    from kdistill.fileio import fault_point, write_fault

    cases = [
        (
            "safetensors",
            SafetensorError,
            "Error while serializing: I/O error: No space left on device (os error 28)",
        ),
        ("numpy", OSError, "32768 requested and 22464 written"),
    ]
    for lib, kind, text in cases:
        with inject_write_faults("ENOSPC"):
            with pytest.raises(kind) as e:
                fault_point(tmp_path / "x", lib)
        assert type(e.value) is kind and str(e.value) == text
        assert write_fault(e.value).startswith("No space left on device")
        with pytest.raises(UserError, match=r"x: cannot write \(No space left on device"):
            with write_guard(tmp_path / "x"):
                raise e.value
    with inject_write_faults("EROFS"):
        with pytest.raises(SafetensorError, match=r"Read-only file system \(os error 30\)"):
            fault_point(tmp_path / "x", "safetensors")
    assert write_fault(ValueError("No space left on device (os error 28)")) is None  # not a write fault
    assert write_fault(OSError("something else")) is None


def test_a_checkpoint_whose_safetensors_write_fails_is_one_line(tmp_path):
    import torch

    from kdistill.train.checkpoint import save_checkpoint

    student = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(student.parameters())
    save_checkpoint(tmp_path, 1, student, opt, {}, keep=2)
    with inject_write_faults("ENOSPC", nth=3):  # the root, student.safetensors, optimizer.safetensors
        with pytest.raises(UserError) as e:
            save_checkpoint(tmp_path, 2, student, opt, {}, keep=2)
    final = tmp_path / "checkpoints" / "step-0000002"
    assert (
        str(e.value)
        == f"{final}: cannot write checkpoint (No space left on device); last good checkpoint: step 1"
    )
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-0000001"]
