"""Kernel packs under faults and bad input, without a GPU.

- A rebuild verifies what the pack holds: a binary of the build whose file is missing or damaged is
  replaced, a damaged kernel the build does not make is dropped from the manifest.
- An arch whose compile aborts the process (a real SIGABRT of the probing child) or that this Triton
  cannot target is one line, and no pack folder is touched (nothing staged, nothing created).
- A read-only --out (a real immutable folder), or a user's file named like an arch folder, is one line.
- Staging folders of a killed build (a real SIGKILL) are removed by the next build; a user's look-alikes
  and a live build's staging are kept.
- A deeply nested manifest, or a 2 MB kernel key or Triton version, is one bounded line.
- runtime.kernel_pack naming a missing path or a file is refused when the config is read, on a CPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

from kdistill.cli import main  # noqa: E402
from kdistill.errors import UserError  # noqa: E402
from kdistill.kernels import build, pack  # noqa: E402
from tests import test_kernel_pack  # noqa: E402
from tests.test_kernel_pack import PACKED, _copy, _edit_manifest  # noqa: E402
from tests.test_run_errors import _read_only_dir  # noqa: E402

built, cache_dir = test_kernel_pack.built, test_kernel_pack.cache_dir  # the pack tests' fixtures

SRC = Path(__file__).resolve().parents[1] / "src"
PAIR = "qwen2.5-1.5b:qwen2.5-0.5b"


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def _one_line(rc: int, err: str) -> str:
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _rebuild(folder: Path, keys) -> pack.PackWriter:
    writer = pack.PackWriter(folder, ["sm_90"])
    for key in keys:
        assert build.compile_key(key, writer).ok
    writer.commit()
    return writer


def _entry(folder: Path, key) -> pack.Entry:
    return pack.read_manifest(folder).kernels[str(key)]


@pytest.mark.parametrize("damage", ["binary_deleted", "byte_flipped", "folder_deleted"])
def test_a_rebuild_replaces_a_missing_or_damaged_binary(built, tmp_path, cache_dir, damage):
    folder = _copy(built, tmp_path)
    before = _tree(folder)
    entry = _entry(folder, PACKED[0])
    cubin = next(folder / entry.dir / n for n in entry.files if n.endswith(".cubin"))
    if damage == "binary_deleted":
        cubin.unlink()
    elif damage == "byte_flipped":
        data = bytearray(cubin.read_bytes())
        data[len(data) // 2] ^= 0xFF
        cubin.write_bytes(bytes(data))
    else:
        for p in (folder / entry.dir).iterdir():
            p.unlink()
        (folder / entry.dir).rmdir()
    with pytest.raises(UserError):
        pack.verified(folder, entry)
    writer = _rebuild(folder, PACKED)
    assert writer.repaired == (0 if damage == "folder_deleted" else 1) and not writer.dropped
    for key in PACKED:
        pack.verified(folder, _entry(folder, key))  # every file as the manifest says
    assert _tree(folder) == before  # the pack as it was built
    assert not list(folder.glob(".staging-*"))


def test_a_damaged_kernel_the_rebuild_does_not_make_is_dropped_from_the_manifest(built, tmp_path, cache_dir):
    folder = _copy(built, tmp_path)
    damaged = _entry(folder, PACKED[2])
    (folder / damaged.dir / next(iter(damaged.files))).write_bytes(b"not a binary")
    writer = _rebuild(folder, PACKED[:1])
    assert writer.dropped == [str(PACKED[2])]
    kernels = pack.read_manifest(folder).kernels
    assert sorted(kernels) == sorted(str(k) for k in PACKED[:2])
    assert not (folder / damaged.dir).exists()
    for key in PACKED[:2]:
        pack.verified(folder, kernels[str(key)])


@pytest.mark.parametrize("fresh", [False, True], ids=["into_a_pack", "into_a_new_folder"])
def test_an_arch_whose_compile_aborts_the_process_is_one_line_and_touches_no_pack(
    built, tmp_path, cache_dir, capsys, monkeypatch, fresh
):
    folder = tmp_path / "new" if fresh else _copy(built, tmp_path)
    before = {} if fresh else _tree(folder)
    monkeypatch.setenv("KDISTILL_TEST_KILL_AT", "SIGABRT@kernels.probe.sm_90")  # the child aborts there
    rc, _, err = _cli(capsys, "kernels", "build", "--arch", "sm_80,sm_90", PAIR, "--out", str(folder))
    msg = _one_line(rc, err)
    assert (
        "--arch sm_90: Triton" in msg
        and "cannot compile for it (the compiler aborted the process (SIGABRT)" in msg
    )
    assert not folder.exists() if fresh else _tree(folder) == before
    assert not list(tmp_path.rglob(".staging-*"))


def test_an_arch_this_triton_cannot_target_is_one_line(built, tmp_path, cache_dir, capsys):
    folder = _copy(built, tmp_path)
    before = _tree(folder)
    assert not pack.can_target("sm_99")
    rc, _, err = _cli(capsys, "kernels", "build", "--arch", "sm_99", PAIR, "--out", str(folder))
    assert "--arch sm_99: Triton" in _one_line(rc, err) and "drop it from --arch" in err and len(err) < 600
    assert _tree(folder) == before


@pytest.mark.parametrize("where", ["itself", "inside"])
def test_a_read_only_out_is_one_line(tmp_path, cache_dir, capsys, where):
    ro = tmp_path / "ro"
    with _read_only_dir(ro) as reason:
        out = ro if where == "itself" else ro / "pack"
        rc, _, err = _cli(capsys, "kernels", "build", "--arch", "sm_90", PAIR, "--out", str(out))
        assert f"cannot write the kernel pack ({reason})" in _one_line(rc, err)
        assert not any(ro.iterdir())


@pytest.mark.parametrize("kind", ["file", "symlink"])
def test_a_users_file_named_like_an_arch_folder_is_one_line(built, tmp_path, cache_dir, capsys, kind):
    folder = tmp_path / "out"
    folder.mkdir()
    if kind == "file":
        (folder / "sm_90").write_text("my notes\n")
    else:
        (folder / "sm_90").symlink_to(tmp_path)
    rc, _, err = _cli(capsys, "kernels", "build", "--arch", "sm_90", PAIR, "--out", str(folder))
    assert "sm_90 is not a folder, expected the pack's folder of sm_90 binaries" in _one_line(rc, err)
    assert sorted(p.name for p in folder.iterdir()) == ["sm_90"]
    if kind == "file":
        assert (folder / "sm_90").read_text() == "my notes\n"


def test_staging_folders_of_a_killed_build_are_removed_by_the_next_build(built, tmp_path, cache_dir):
    folder = _copy(built, tmp_path)
    killed = subprocess.run(
        [sys.executable, "-c", "import os, signal, sys; from kdistill.kernels import pack; "
         "pack.PackWriter(sys.argv[1], ['sm_90']); os.kill(os.getpid(), signal.SIGKILL)", str(folder)],
        env={**os.environ, "PYTHONPATH": str(SRC)},
        capture_output=True,
    )  # fmt: skip
    assert killed.returncode == -9, killed.stderr.decode()[-2000:]
    (stale,) = folder.glob(".staging-*")
    mine = [
        folder / ".staging-notes",  # a user's folder of a similar name
        folder / ".staging-123-0123abcd",  # the name of a staging folder, without a build's marker
    ]
    for p in mine:
        p.mkdir()
        (p / "keep.txt").write_text("mine\n")
    live = pack.PackWriter(folder)
    assert live.stale == [stale] and not stale.exists()
    assert all((p / "keep.txt").read_text() == "mine\n" for p in mine)
    writer = pack.PackWriter(folder)  # beside a build still running here: its staging stays
    assert writer.stale == [] and live.staging.is_dir()
    writer.abort()
    live.abort()
    assert sorted(p.name for p in folder.glob(".staging-*")) == sorted(p.name for p in mine)


@pytest.mark.parametrize("damage", ["nested", "huge_key", "huge_version"])
def test_a_nested_manifest_or_a_huge_value_is_one_bounded_line(built, tmp_path, cache_dir, capsys, damage):
    folder = _copy(built, tmp_path)
    if damage == "nested":
        (folder / pack.MANIFEST).write_text("[" * 100_000 + "]" * 100_000)
        expect = "not a readable JSON manifest (nested too deeply)"
    elif damage == "huge_key":
        _edit_manifest(folder, lambda d: d["kernels"].update({"k" * 2_000_000: {"arch": "sm_90"}}))
        expect = "expected the fields"
    else:
        _edit_manifest(folder, lambda d: d.update(triton="3." * 1_000_000))
        expect = "the pack was built with Triton 3.3."
    rc, _, err = _cli(capsys, "kernels", "build", "--arch", "sm_90", PAIR, "--out", str(folder))
    assert expect in _one_line(rc, err) and len(err) < 800, err[:1000]
    assert "characters)" in err or damage == "nested"
    with pytest.raises(UserError) as e:
        pack.install(folder, PACKED, "sm_90")
    assert len(str(e.value)) < 800


@pytest.mark.parametrize("what", ["missing", "file"])
def test_a_kernel_pack_that_names_no_folder_is_refused_on_a_cpu(tmp_path, capsys, what):
    path = tmp_path / "pack"
    if what == "file":
        path.write_text("not a pack\n")
    rc, _, err = _cli(capsys, "plan", PAIR, "runtime.device=cpu", f"runtime.kernel_pack={path}")
    want = "is not a folder" if what == "file" else "does not exist"
    assert (
        f"runtime.kernel_pack '{path}' {want}, expected the --out folder of kdistill kernels build"
        in _one_line(rc, err)
    )


def test_kernels_build_does_not_read_the_pack_the_config_names(tmp_path, cache_dir, capsys, monkeypatch):
    """The pack a run loads may be the one being built: the build does not refuse a config naming it."""
    monkeypatch.setattr(build, "jit_compile", lambda key: (_ for _ in ()).throw(RuntimeError("not here")))
    rc, out, err = _cli(
        capsys, "kernels", "build", "--arch", "sm_90", PAIR, f"runtime.kernel_pack={tmp_path / 'p'}", "--json"
    )
    assert rc == 1 and json.loads(out)["failed"] > 0, err
