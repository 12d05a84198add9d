"""Output folders: written to a temp folder and renamed; an existing target replaced only when kdistill
wrote it as the same kind (its marker); a run's inputs never an output; one writer per output; what a
killed writer left is removed by the next one. Through `kdistill export` (with and without --merge) on a
real LoRA run, and `kdistill teacher-cache` with two writers racing on one --out.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import yaml

from kdistill.errors import UserError
from kdistill.outputs import MARKER, check_target, clean_stale, lock_path, read_output_marker, staged_output
from tests.test_train_kit import assets, base_config, child_env, one_error_line, run_cli, start_proc


def _user_folder(path):
    path.mkdir(parents=True)
    (path / "notes.txt").write_text("mine")
    (path / "config.json").write_text("{}")  # looks like a model folder, but kdistill did not write it
    return {p.name: p.read_bytes() for p in path.iterdir()}


def _contents(path):
    return {p.name: p.read_bytes() for p in path.iterdir()}


def test_staged_output_marks_renames_and_replaces_only_its_own_kind(tmp_path):
    out = tmp_path / "out"
    with staged_output(out, "export-merged") as tmp:
        assert tmp.parent == tmp_path and tmp.name.startswith(".out.tmp-") and not out.exists()
        (tmp / "a").write_text("1")
    assert read_output_marker(out) == "export-merged" and (out / "a").read_text() == "1"
    with staged_output(out, "export-merged") as tmp:
        (tmp / "a").write_text("2")
    assert (out / "a").read_text() == "2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temp, no old copy, no lock left
    with pytest.raises(
        UserError, match="holds kdistill's export-merged output, not an earlier teacher-cache"
    ):
        check_target(out, "teacher-cache")


def test_a_folder_kdistill_did_not_write_is_never_replaced(tmp_path):
    mine = tmp_path / "mine"
    before = _user_folder(mine)
    with pytest.raises(UserError) as e:
        with staged_output(mine, "export-merged"):
            raise AssertionError("the block must not run")
    assert str(e.value) == (
        f"--out {mine}: was not written by kdistill (no {MARKER} marker), not an earlier export-merged; "
        "refusing to replace it (choose a new folder)"
    )
    assert _contents(mine) == before and sorted(p.name for p in tmp_path.iterdir()) == ["mine"]


def test_a_failure_inside_leaves_the_old_output_and_no_temp(tmp_path):
    out = tmp_path / "out"
    with staged_output(out, "generate") as tmp:
        (tmp / "a").write_text("old")
    with pytest.raises(RuntimeError):
        with staged_output(out, "generate") as tmp:
            (tmp / "a").write_text("half")
            raise RuntimeError("boom")
    assert (out / "a").read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


@pytest.mark.parametrize("where", ["same", "parent"])
def test_an_input_is_never_an_output(tmp_path, where):
    base = tmp_path / "models" / "base"
    base.mkdir(parents=True)
    (base / "config.json").write_text("{}")
    (base / MARKER).write_text(json.dumps({"kdistill_output": "export-merged"}))  # even one kdistill wrote
    out = base if where == "same" else base.parent
    verb = "is" if where == "same" else "contains"
    with pytest.raises(UserError, match=f"--out {out}: {verb} student.path .*an input of the run"):
        check_target(out, "export-merged", inputs=[("student.path", str(base))])


def test_leftovers_of_a_killed_writer_are_removed_and_a_swapped_out_output_put_back(tmp_path):
    out = tmp_path / "out"
    (tmp_path / ".out.tmp-999999-abcd").mkdir()
    (tmp_path / ".out.tmp-999999-abcd" / "model.safetensors").write_bytes(b"half")
    old = tmp_path / ".out.old-999999-abcd"
    old.mkdir()
    (old / "a").write_text("previous")
    (tmp_path / ".other.tmp-1-ab").mkdir()  # another output's: not ours to remove
    clean_stale(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".other.tmp-1-ab", "out"]
    assert (out / "a").read_text() == "previous"


def test_one_writer_per_output(tmp_path):
    out = tmp_path / "out"
    holder = subprocess.Popen(
        [sys.executable, "-c", f"from kdistill.outputs import output_lock\nimport time\noutput_lock({str(out)!r}).acquire()\nprint('held', flush=True)\ntime.sleep(60)"],
        env=child_env(),
        stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(UserError, match=f"is in use by another kdistill run \\(pid {holder.pid}"):
            with staged_output(out, "generate"):
                pass
    finally:
        holder.kill()
        holder.wait()
    with staged_output(out, "generate") as tmp:  # a dead holder's lock is taken over
        (tmp / "a").write_text("x")
    assert not lock_path(out).exists() and (out / "a").is_file()


# ------------------------------------------------------------------------------------------------
# kdistill export on a LoRA run


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    from kdistill.cli import main

    root = tmp_path_factory.mktemp("lora")
    cfg = base_config(root / "run", steps=2)
    cfg["student"] = {
        "path": str(assets().student),
        "init": "pretrained",
        "lora": {"rank": 2, "alpha": 4, "targets": ["q_proj"]},
    }
    (root / "run.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    assert main(["run", str(root / "run.yaml"), "--quiet"]) == 0
    return root / "run"


def test_export_merge_never_replaces_a_user_folder(lora_run, tmp_path, capsys):
    mine = tmp_path / "mine"
    before = _user_folder(mine)
    rc, _, err = run_cli(capsys, "export", "--run", str(lora_run), "--merge", "--out", str(mine))
    assert rc == 2 and "was not written by kdistill" in one_error_line(err)
    assert _contents(mine) == before
    rc, _, err = run_cli(capsys, "export", "--run", str(lora_run), "--out", str(mine))
    assert rc == 2 and "was not written by kdistill" in one_error_line(err)
    assert _contents(mine) == before


def test_export_merge_never_writes_over_the_base_student(lora_run, tmp_path, capsys):
    base = assets().student
    before = {p.name: p.stat().st_mtime_ns for p in base.iterdir()}
    for extra in (["--merge"], []):
        rc, _, err = run_cli(capsys, "export", "--run", str(lora_run), *extra, "--out", str(base))
        assert rc == 2 and "is student.path" in one_error_line(err)
        assert {p.name: p.stat().st_mtime_ns for p in base.iterdir()} == before
    rc, _, err = run_cli(capsys, "export", "--run", str(lora_run), "--merge", "--out", str(lora_run / "m"))
    assert rc == 2 and "inside the run directory" in one_error_line(err)


def test_export_again_replaces_its_own_earlier_export(lora_run, tmp_path, capsys):
    for extra, kind in ((["--merge"], "export-merged"), ([], "export-adapter")):
        out = tmp_path / kind
        for _ in range(2):
            rc, _, err = run_cli(capsys, "export", "--run", str(lora_run), *extra, "--out", str(out))
            assert rc == 0, err
        assert read_output_marker(out) == kind
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export-adapter", "export-merged"]
    rc, _, err = run_cli(capsys, "export", "--run", str(lora_run), "--out", str(tmp_path / "export-merged"))
    assert rc == 2 and "holds kdistill's export-merged output" in one_error_line(err)


def test_a_killed_exports_temp_folder_is_removed_by_the_next_export(lora_run, tmp_path, capsys):
    out = tmp_path / "merged"
    left = tmp_path / f".merged.tmp-{2**22 + 7}-dead"
    left.mkdir()
    (left / "model.safetensors").write_bytes(b"partial")
    rc, _, err = run_cli(capsys, "export", "--run", str(lora_run), "--merge", "--out", str(out))
    assert rc == 0, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["merged"]


# ------------------------------------------------------------------------------------------------
# kdistill teacher-cache


def _small_config(run_dir):
    cfg = base_config(run_dir)
    cfg["data"]["max_tokens"] = 1024  # 31 training rows: a cache in a second or two
    return cfg


def test_teacher_cache_refuses_a_user_folder_and_the_teacher(tmp_path, capsys):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump(_small_config(tmp_path / "run"), sort_keys=False))
    mine = tmp_path / "mine"
    before = _user_folder(mine)
    rc, _, err = run_cli(capsys, "teacher-cache", str(cfg), "--out", str(mine), "--quiet")
    assert rc == 2 and "was not written by kdistill" in one_error_line(err)
    assert _contents(mine) == before
    rc, _, err = run_cli(capsys, "teacher-cache", str(cfg), "--out", str(assets().teacher), "--quiet")
    assert rc == 2 and "is teacher.path" in one_error_line(err)


def test_two_teacher_cache_writers_on_one_out(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump(_small_config(tmp_path / "run"), sort_keys=False))
    out = tmp_path / "tc"
    argv = ["teacher-cache", str(cfg), "--out", str(out), "--quiet", "--shard-rows", "4"]
    procs = [start_proc(argv), start_proc(argv)]
    results = [(p.wait(timeout=300), p.communicate()) for p in procs]
    codes = sorted(rc for rc, _ in results)
    assert codes[0] == 0, results
    for rc, (_, err) in results:
        if rc:  # the loser is refused while the winner holds the lock, with one line
            assert rc == 2 and "is in use by another kdistill run" in one_error_line(err)
    assert not list(out.glob("*.tmp")) and not list(out.glob(".*.tmp"))
    assert not lock_path(out).exists()
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["complete"] and all(len(s["sha256"]) == 1 for s in manifest["shards"])


def test_a_killed_teacher_cache_leaves_nothing_the_next_one_keeps(tmp_path, capsys):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump(_small_config(tmp_path / "run"), sort_keys=False))
    out = tmp_path / "tc"
    rc, _, err = run_cli(capsys, "teacher-cache", str(cfg), "--out", str(out), "--quiet", "--shard-rows", "4")
    assert rc == 0, err
    shutil.rmtree(out / "shard-00001")
    (out / "shard-00001.tmp").mkdir()  # a killed writer's shard and temp manifest, and its stale lock
    (out / "shard-00001.tmp" / "logp.npy").write_bytes(b"half")
    (out / ".manifest.json.x1y2.tmp").write_text("{")
    lock_path(out).write_text(json.dumps({"pid": 2**22 + 11, "host": os.uname().nodename, "token": "t"}))
    time.sleep(0.01)
    rc, _, err = run_cli(capsys, "teacher-cache", str(cfg), "--out", str(out), "--quiet", "--shard-rows", "4")
    assert rc == 0, err
    assert (out / "shard-00001" / "logp.npy").is_file()
    assert not list(out.glob("*.tmp")) and not list(out.glob(".*.tmp")) and not lock_path(out).exists()


def test_a_run_never_writes_over_its_inputs(tmp_path, capsys):
    shutil.copytree(assets().student, tmp_path / "models" / "student")
    cfg = base_config(tmp_path / "models")  # output.dir holds the student it starts from
    cfg["student"] = {"path": str(tmp_path / "models" / "student"), "init": "pretrained"}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    before = _contents(tmp_path / "models" / "student")
    rc, _, err = run_cli(capsys, "run", str(tmp_path / "run.yaml"), "--overwrite", "--quiet")
    assert rc == 2 and one_error_line(err).startswith(
        f"output.dir {tmp_path / 'models'}: contains student.path"
    )
    assert _contents(tmp_path / "models" / "student") == before
