"""Write faults as the libraries really raise them, on a real small filesystem (a tmpfs mounted with
size=...): a checkpoint, a saved model, a teacher-cache shard and an export that do not fit end in one
line naming the path and what is intact, with no temp folder left; a read-only remount is one line too.
The write-fault injector raises exactly what safetensors and numpy raise there.

Mounting needs root (or CAP_SYS_ADMIN); where it is not permitted these tests are skipped with the
reason. The injector-based tests (tests/test_write_faults.py) run everywhere.
"""

from __future__ import annotations

import errno
import os
import subprocess

import numpy as np
import pytest
import torch
import yaml

from kdistill.errors import UserError
from kdistill.fileio import library_fault, write_fault, write_guard
from kdistill.models.hf_io import load_model, save_model
from kdistill.train.checkpoint import list_checkpoints, save_checkpoint
from tests.test_train_kit import assets, base_config, one_error_line, run_cli


@pytest.fixture
def small_fs(tmp_path):
    """make(kib) -> a fresh folder with a tmpfs of that size mounted on it (unmounted afterwards)."""
    mounted = []

    def make(kib: int, name: str = "fs"):
        mnt = tmp_path / name
        mnt.mkdir()
        if os.geteuid() != 0:
            pytest.skip("mounting a small tmpfs needs root; run as root to test against a real full disk")
        r = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={kib}k", "tmpfs", str(mnt)], capture_output=True, text=True
        )
        if r.returncode != 0:
            pytest.skip(f"mounting a tmpfs is not permitted here ({r.stderr.strip() or r.returncode})")
        mounted.append(mnt)
        return mnt

    yield make
    for mnt in mounted:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _fill(folder, keep: int = 0):
    """Fill the filesystem of `folder` up to `keep` bytes left."""
    st = os.statvfs(folder)
    free = st.f_bavail * st.f_frsize - keep
    if free > 0:
        with open(folder / "filler", "wb") as f:
            try:
                f.write(b"\0" * free)
            except OSError:
                pass


def _raised(fn):
    try:
        fn()
    except Exception as e:  # what the library really raises
        return e
    raise AssertionError("the write did not fail")


def test_the_injector_raises_what_the_libraries_raise_on_a_full_disk(small_fs):
    mnt = small_fs(64)
    _fill(mnt, keep=4096)
    big = torch.zeros(64 * 1024)
    from safetensors.torch import save_file

    real = _raised(lambda: save_file({"a": big}, str(mnt / "x.safetensors")))
    fake = library_fault(errno.ENOSPC, mnt / "x.safetensors", "safetensors")
    assert type(real) is type(fake) and str(real) == str(fake)

    def np_save():
        with open(mnt / "y.npy", "wb") as fh:
            np.save(fh, np.zeros((64, 64, 64), np.float32))

    real = _raised(np_save)
    fake = library_fault(errno.ENOSPC, mnt / "y.npy", "numpy")
    assert type(real) is type(fake) and real.errno is None and fake.errno is None
    assert str(real).endswith("written") and str(fake).endswith("written")
    for e in (real, fake):
        assert write_fault(e).startswith("No space left on device")
    real = _raised(lambda: (mnt / "z.json").write_text("x" * 100_000))
    assert (
        type(real) is OSError
        and real.errno == errno.ENOSPC
        and write_fault(real) == "No space left on device"
    )


def test_a_read_only_remount_is_one_line_for_safetensors(small_fs):
    mnt = small_fs(256)
    (mnt / "d").mkdir()
    subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
    from safetensors.torch import save_file

    real = _raised(lambda: save_file({"a": torch.zeros(4)}, str(mnt / "d" / "x.safetensors")))
    assert type(real).__name__ == "SafetensorError"
    with pytest.raises(UserError, match=r"d: cannot write checkpoint \(Read-only file system\)$"):
        with write_guard(mnt / "d", what="write checkpoint"):
            raise real


def test_a_checkpoint_that_does_not_fit_keeps_the_last_good_one(small_fs):
    run_dir = small_fs(512)
    student = torch.nn.Linear(128, 128)  # 64 KiB of weights, 128 KiB of AdamW moments
    opt = torch.optim.AdamW(student.parameters())
    student(torch.ones(1, 128)).sum().backward()
    opt.step()
    save_checkpoint(run_dir, 1, student, opt, {"note": "fits"}, keep=3)
    _fill(run_dir, keep=100 * 1024)  # the weights fit, the optimizer state does not: safetensors fails
    with pytest.raises(UserError) as e:
        save_checkpoint(run_dir, 2, student, opt, {}, keep=3)
    final = run_dir / "checkpoints" / "step-0000002"
    assert (
        str(e.value)
        == f"{final}: cannot write checkpoint (No space left on device); last good checkpoint: step 1"
    )
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["step-0000001"]
    assert [p.name for p in list_checkpoints(run_dir)] == ["step-0000001"]


def test_a_model_that_does_not_fit_leaves_no_temp_folder(small_fs):
    mnt = small_fs(128)
    model = load_model(assets().student)
    with pytest.raises(UserError) as e:
        save_model(model, mnt / "student", source_dir=assets().student, intact="the run is intact")
    assert (
        str(e.value)
        == f"{mnt / 'student'}: cannot write the model (No space left on device); the run is intact"
    )
    assert os.listdir(mnt) == []


def _small_config(tmp_path):
    cfg = base_config(tmp_path / "run")
    cfg["data"]["max_tokens"] = 1024
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def test_a_teacher_cache_on_a_full_disk_is_one_line_and_keeps_complete_shards(small_fs, tmp_path, capsys):
    mnt = small_fs(160)  # the manifest and a first shard or two fit, not the whole cache
    out = mnt / "tc"
    cfg = _small_config(tmp_path)
    argv = ("teacher-cache", str(cfg), "--out", str(out), "--quiet", "--shard-rows", "1")
    rc, _, err = run_cli(capsys, *argv)
    line = one_error_line(err)
    assert rc == 2 and line.startswith(f"{out}: cannot write the teacher cache (No space left on device")
    assert line.endswith(
        "complete shards are kept: run kdistill teacher-cache again with the same --out to finish"
    )
    assert not list(out.glob("*.tmp")) and not list(out.glob(".*.tmp"))
    kept = sorted(p.name for p in out.glob("shard-*"))
    assert kept and "shard-00000" in kept


def test_export_merge_on_a_full_disk_is_one_line(small_fs, tmp_path, capsys):
    cfg = base_config(tmp_path / "run", steps=1)
    cfg["student"] = {
        "path": str(assets().student),
        "init": "pretrained",
        "lora": {"rank": 2, "targets": ["q_proj"]},
    }
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    rc, _, err = run_cli(capsys, "run", str(tmp_path / "run.yaml"), "--quiet")
    assert rc == 0, err
    mnt = small_fs(96, "export")
    rc, _, err = run_cli(capsys, "export", "--run", str(tmp_path / "run"), "--merge", "--out", str(mnt / "m"))
    assert rc == 2
    assert one_error_line(err) == (
        f"{mnt / 'm'}: cannot write the model (No space left on device); the run and its adapters in "
        f"{tmp_path / 'run' / 'adapter'} are intact"
    )
    assert os.listdir(mnt) == []


def test_a_run_is_refused_before_loading_when_its_checkpoint_and_export_do_not_fit(
    small_fs, tmp_path, capsys
):
    mnt = small_fs(512)  # the tiny pair's one checkpoint and export are planned at ~1.6 MiB
    cfg = base_config(mnt / "run")
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    rc, _, err = run_cli(capsys, "run", str(tmp_path / "run.yaml"), "--quiet")
    line = one_error_line(err)
    assert rc == 2 and line.startswith(f"output.dir '{mnt / 'run'}': the run writes up to ")
    assert "(1 checkpoint(s) of " in line and "KiB free; free space" in line
    assert os.listdir(mnt) == []  # refused before anything was written there


def test_a_resumed_runs_own_checkpoints_count_as_free_space(small_fs, tmp_path):
    from kdistill.config import load_config
    from kdistill.models.spec import load_spec
    from kdistill.train.preflight import check_disk, disk_plan

    mnt = small_fs(4096)
    run = mnt / "run"
    (run / "checkpoints" / "step-0000002").mkdir(parents=True)
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(base_config(run), sort_keys=False))
    cfg = load_config(tmp_path / "run.yaml").validate()
    spec = load_spec(assets().student_config)
    need = disk_plan(cfg, spec)["total"]
    _fill(mnt, keep=need + 64 * 1024)
    old = run / "checkpoints" / "step-0000002" / "optimizer.safetensors"
    with open(old, "wb") as f:
        f.write(b"\0" * (need * 3 // 4))  # an earlier checkpoint the run will rotate out: counted as free
    check_disk(cfg, load_spec(assets().teacher), spec, run)
    old.rename(mnt / "elsewhere")  # the same free space, its bytes no longer the run's: refused
    with pytest.raises(UserError, match=r"^output.dir '.*': the run writes up to "):
        check_disk(cfg, load_spec(assets().teacher), spec, run)
