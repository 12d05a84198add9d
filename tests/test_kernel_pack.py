"""Kernel packs without a GPU: the manifest a build writes, a second build adding to it, and prewarm
loading a pack in a fresh process through Triton's own JIT lookup (its driver standing in for an sm_90
GPU: nothing is launched) with nothing compiled; packs of another Triton version or build, another
arch or CUDA, or with a damaged binary refused in one line; missing keys compiled, or refused under
strict_kernels before anything is written; a failed or interrupted build leaving the pack as it was."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

from kdistill.commands.kernels import build_command  # noqa: E402
from kdistill.config import load_config  # noqa: E402
from kdistill.errors import KernelCacheMiss, UserError  # noqa: E402
from kdistill.fileio import inject_write_faults  # noqa: E402
from kdistill.kernels import build, keys, pack, seal  # noqa: E402
from kdistill.kernels import rmsnorm as rms_kernel  # noqa: E402
from kdistill.kernels import swiglu as swiglu_kernel  # noqa: E402

SRC = Path(__file__).resolve().parents[1] / "src"

# Three small kernels for sm_90 (a pack needs no whole plan to be tested), and one the pack lacks.
PACKED = [
    swiglu_kernel.fwd_key("sm_90", inter=64, dtype="bf16"),
    swiglu_kernel.bwd_key("sm_90", inter=64, dtype="bf16"),
    rms_kernel.fwd_key("sm_90", hidden=64, eps=1e-6, dtype="bf16", w_dtype="fp32", residual=False),
]
MISSING = swiglu_kernel.fwd_key("sm_90", inter=96, dtype="bf16")


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """Triton's cache in a fresh folder for the test."""
    monkeypatch.setenv("KDISTILL_CACHE_DIR", str(tmp_path / "kdc"))
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    return Path(seal.setup_cache_dir())


def _write(folder: Path, key_list) -> pack.PackWriter:
    writer = pack.PackWriter(folder)
    for key in key_list:
        result = build.compile_key(key, writer)
        assert result.ok, result.error
    writer.commit()
    return writer


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A pack of PACKED, built once for the module (its own Triton cache)."""
    root = tmp_path_factory.mktemp("pack")
    saved = {k: os.environ.get(k) for k in ("KDISTILL_CACHE_DIR", "TRITON_CACHE_DIR")}
    os.environ["KDISTILL_CACHE_DIR"] = str(root / "build-cache")
    os.environ.pop("TRITON_CACHE_DIR", None)
    try:
        seal.setup_cache_dir()
        _write(root / "pack", PACKED)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return root / "pack"


def _copy(built: Path, tmp_path: Path) -> Path:
    out = tmp_path / "copy"
    shutil.copytree(built, out)
    return out


def _edit_manifest(folder: Path, change) -> None:
    path = folder / pack.MANIFEST
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def _strings(obj):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield str(k)
            yield from _strings(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _strings(v)
    elif isinstance(obj, str):
        yield obj


# -- what a build writes ------------------------------------------------------------------------------
def test_manifest_names_key_arch_versions_and_the_sha256_of_every_file(built):
    data = json.loads((built / pack.MANIFEST).read_text())
    assert data["format"] == 1 and data["triton"] == pack.triton_version()
    assert data["triton_build"] == pack.triton_build()
    assert sorted(data["kernels"]) == sorted(str(k) for k in PACKED)
    for entry in data["kernels"].values():
        assert entry["arch"] == "sm_90" and entry["triton"] == pack.triton_version()
        assert entry["cuda"] == pack.cuda_version("sm_90") and entry["cuda"][0].isdigit()
        names = sorted(entry["files"])
        assert [n.rsplit(".", 1)[1] for n in names] == ["cubin", "json"], names
        for name, digest in entry["files"].items():
            assert hashlib.sha256((built / entry["dir"] / name).read_bytes()).hexdigest() == digest
    # every file of the pack is in the manifest (no Triton cache group, no IR)
    listed = {f"{e['dir']}/{n}" for e in data["kernels"].values() for n in e["files"]}
    on_disk = {str(p.relative_to(built)) for p in built.rglob("*") if p.is_file()} - {pack.MANIFEST}
    assert on_disk == listed


def test_pack_names_no_path_of_the_building_machine(built):
    """Triton's groups hold absolute paths and its metadata the libdevice path: neither is in a pack."""
    texts = [json.loads((built / pack.MANIFEST).read_text())]
    texts += [json.loads(p.read_text()) for p in built.rglob("*.json") if p.name != pack.MANIFEST]
    assert len(texts) == 1 + len(PACKED)
    for text in texts:
        assert not [s for s in _strings(text) if s.startswith("/") or str(SRC.parent) in s]
    assert not list(built.rglob("__grp__*"))


def test_a_second_build_adds_to_the_pack_and_keeps_what_it_had(built, tmp_path, cache_dir):
    folder = _copy(built, tmp_path)
    before = json.loads((folder / pack.MANIFEST).read_text())["kernels"]
    _write(folder, [MISSING, PACKED[0]])  # one new key, one the pack has (same binary: not duplicated)
    after = json.loads((folder / pack.MANIFEST).read_text())["kernels"]
    assert sorted(after) == sorted([*before, str(MISSING)])
    assert all(after[k] == before[k] for k in before)
    assert len([p for p in (folder / "sm_90").iterdir()]) == len(after)
    assert not list(folder.glob(".staging-*"))


def test_a_pack_of_another_triton_build_is_not_extended(built, tmp_path, cache_dir):
    folder = _copy(built, tmp_path)
    _edit_manifest(folder, lambda d: d.update(triton="3.0.0"))
    with pytest.raises(UserError, match=f"Triton 3.0.0 .*this is Triton {pack.triton_version()}"):
        pack.PackWriter(folder)


def test_a_failed_build_leaves_the_pack_as_it_was(built, tmp_path, cache_dir, monkeypatch, capsys):
    folder = _copy(built, tmp_path)
    manifest = (folder / pack.MANIFEST).read_bytes()

    def broken(key):
        raise RuntimeError("ptxas failed")

    monkeypatch.setattr(build, "jit_compile", broken)
    args = argparse.Namespace(
        config="qwen2.5-1.5b:qwen2.5-0.5b", overrides=[], arch="sm_90", json=False, out=str(folder)
    )
    assert build_command(args) == 1
    assert "not written" in capsys.readouterr().out
    assert (folder / pack.MANIFEST).read_bytes() == manifest
    assert not list(folder.glob(".staging-*"))
    args.out = str(tmp_path / "new")  # a folder the failed build would have created
    assert build_command(args) == 1
    assert not (tmp_path / "new").exists()


def test_a_full_disk_while_writing_the_manifest_leaves_the_pack_as_it_was(built, tmp_path, cache_dir):
    folder = _copy(built, tmp_path)
    manifest = (folder / pack.MANIFEST).read_bytes()
    dirs = sorted(p.name for p in (folder / "sm_90").iterdir())
    writer = pack.PackWriter(folder)
    assert build.compile_key(MISSING, writer).ok
    with inject_write_faults("ENOSPC", nth=1), pytest.raises(UserError) as e:
        writer.commit()
    assert "cannot write the kernel pack" in str(e.value) and "the pack is as it was" in str(e.value)
    assert (folder / pack.MANIFEST).read_bytes() == manifest
    assert sorted(p.name for p in (folder / "sm_90").iterdir()) == dirs
    assert not list(folder.glob(".staging-*"))


# -- what an install refuses --------------------------------------------------------------------------
def _empty(cache: Path) -> bool:
    return not cache.exists() or not any(cache.iterdir())


def test_another_triton_version_is_refused_naming_both(built, tmp_path, cache_dir):
    folder = _copy(built, tmp_path)
    _edit_manifest(folder, lambda d: d.update(triton="3.0.0"))
    with pytest.raises(UserError) as e:
        pack.install(folder, PACKED, "sm_90")
    msg = str(e.value)
    assert "built with Triton 3.0.0, this is Triton " + pack.triton_version() in msg and "\n" not in msg
    assert _empty(cache_dir)


def test_another_triton_build_of_the_same_version_is_refused(built, tmp_path, cache_dir):
    folder = _copy(built, tmp_path)
    _edit_manifest(folder, lambda d: d.update(triton_build="0123456789abcdef"))
    with pytest.raises(UserError, match=f"build 0123456789abcdef, this is .* build {pack.triton_build()}"):
        pack.install(folder, PACKED, "sm_90")


def test_another_arch_is_refused_naming_both(built, cache_dir):
    other = [swiglu_kernel.fwd_key("sm_80", inter=64, dtype="bf16")]
    with pytest.raises(UserError, match="built for sm_90, this GPU is sm_80"):
        pack.install(built, other, "sm_80")


def test_binaries_of_another_cuda_are_refused_naming_both(built, tmp_path, cache_dir):
    folder = _copy(built, tmp_path)
    _edit_manifest(folder, lambda d: [e.update(cuda="11.8.89") for e in d["kernels"].values()])
    with pytest.raises(UserError, match=f"made by CUDA 11.8.89 .*uses CUDA {pack.cuda_version('sm_90')}"):
        pack.install(folder, PACKED, "sm_90")


def test_a_binary_whose_sha256_differs_is_refused_before_anything_is_written(built, tmp_path, cache_dir):
    folder = _copy(built, tmp_path)
    cubin = sorted(folder.rglob("*.cubin"))[-1]
    data = bytearray(cubin.read_bytes())
    data[len(data) // 2] ^= 0xFF
    cubin.write_bytes(bytes(data))
    with pytest.raises(UserError) as e:
        pack.install(folder, PACKED, "sm_90")
    assert f"{cubin.parent.name}/{cubin.name} has sha256" in str(e.value) and "the manifest says" in str(
        e.value
    )
    assert _empty(cache_dir)


@pytest.mark.parametrize(
    "damage,expect",
    [
        (lambda p: p.write_text(p.read_text()[:40]), "not a readable JSON manifest"),
        (lambda p: p.write_text('{"format": 7}'), "expected a kernel pack manifest with format 1"),
        (lambda p: p.unlink(), "no manifest.json"),
    ],
)
def test_a_damaged_manifest_is_one_line_naming_it(built, tmp_path, cache_dir, damage, expect):
    folder = _copy(built, tmp_path)
    damage(folder / pack.MANIFEST)
    with pytest.raises(UserError) as e:
        pack.install(folder, PACKED, "sm_90")
    assert expect in str(e.value) and str(folder) in str(e.value) and "\n" not in str(e.value)


def test_strict_mode_refuses_a_missing_key_before_anything_is_written(built, cache_dir):
    with pytest.raises(KernelCacheMiss, match=r"has no binary for swiglu_fwd\[sm_90\].*I=96.*strict_kernels"):
        pack.install(built, [*PACKED, MISSING], "sm_90", strict=True)
    assert _empty(cache_dir)


def test_install_writes_groups_that_point_into_the_real_cache(built, cache_dir):
    done = pack.install(built, [*PACKED, MISSING], "sm_90")
    assert done.keys == set(PACKED) and done.missing == [MISSING]
    groups = sorted(cache_dir.rglob("__grp__*.json"))
    assert len(groups) == len(PACKED)
    for g in groups:
        paths = json.loads(g.read_text())["child_paths"].values()
        assert all(Path(p).is_file() and Path(p).parent == g.parent for p in paths)


# -- prewarm from a pack, in a fresh process, through Triton's JIT --------------------------------------
PREWARM = """
import json, os, sys
from kdistill.kernels import pack, seal
from kdistill.kernels.keys import KernelKey
for phase in json.loads(sys.argv[2]):   # [[keys, strict, environment], ...], one prewarm each
    os.environ.update(phase[2])
    seal.configure(kernels="triton", strict=phase[1], arch="sm_90", device="cpu")
    with pack.targeting("sm_90"):   # Triton's JIT, with its driver standing in for an sm_90 GPU
        r = seal.prewarm([KernelKey.parse(k) for k in phase[0]], "cpu", pack=sys.argv[1], arch="sm_90")
    print(json.dumps({"line": r.line(), "from_pack": r.from_pack, "compiled": r.compiled,
                      "from_cache": r.from_cache, "missing": r.pack_missing, "failed": r.failed}))
"""


def _prewarm(folder: Path, phases, cache: Path) -> list[dict]:
    env = {**os.environ, "KDISTILL_CACHE_DIR": str(cache), "PYTHONPATH": str(SRC)}
    env.pop("TRITON_CACHE_DIR", None)
    arg = json.dumps([[[str(k) for k in key_list], strict, environ] for key_list, strict, environ in phases])
    out = subprocess.run(
        [sys.executable, "-c", PREWARM, str(folder), arg],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return [json.loads(line) for line in out.stdout.strip().splitlines()[-len(phases) :]], out.stderr


def test_prewarm_in_a_fresh_process_loads_the_pack_and_compiles_nothing(built, tmp_path):
    """An empty Triton cache, Triton's own JIT warmup for every key (strict): each is found where the
    pack put it. Then a key the pack lacks is compiled as without a pack (not strict); and under an
    environment variable Triton keys its cache on, a packed kernel is compiled anyway, with a warning."""
    first_keys = PACKED[:2]  # PACKED[2] is left for the third prewarm (not yet in the JIT's memory)
    phases = [
        (first_keys, True, {}),
        ([*first_keys, MISSING], False, {}),
        (PACKED[2:], False, {"TRITON_DEFAULT_FP_FUSION": "0"}),
    ]
    (first, second, third), err = _prewarm(built, phases, tmp_path / "fresh")
    got = (first["from_pack"], first["compiled"], first["from_cache"], first["failed"])
    assert got == (2, 0, 0, []), first["line"]
    assert "(from pack 2, compiled 0, 0 from cache)" in first["line"], first["line"]
    assert (second["from_pack"], second["compiled"], second["missing"]) == (2, 1, 1), second["line"]
    assert (third["from_pack"], third["compiled"]) == (0, 1), third["line"]
    assert "1 packed kernels were compiled anyway (Triton's cache key differs here" in err, err[-2000:]
    assert str(PACKED[2]) in err


# -- archs and configuration --------------------------------------------------------------------------
def test_default_archs_add_sm_103_and_sm_121_where_this_triton_targets_them():
    archs = build.default_archs()
    assert set(keys.ARCHS) <= set(archs) and archs == sorted(archs, key=keys.arch_capability)
    for arch in build.NEWER_ARCHS:
        assert (arch in archs) == pack.can_target(arch)
    major, minor = (int(x) for x in pack.triton_version().split(".")[:2])
    if (major, minor) >= (3, 6):  # its Blackwell ptxas (CUDA 12.9) knows both
        assert {"sm_103", "sm_121"} <= set(archs)
        for arch in ("sm_103", "sm_121"):
            r = build.compile_key(swiglu_kernel.fwd_key(arch, inter=64, dtype="bf16"))
            assert r.ok, r.error


def test_kernel_pack_path_is_relative_to_the_config_file(tmp_path):
    (tmp_path / "packs" / "p").mkdir(parents=True)
    cfg_path = tmp_path / "run.yaml"
    cfg_path.write_text("teacher: {path: t}\nstudent: {path: s}\nruntime: {kernel_pack: packs/p}\n")
    cfg = load_config(str(cfg_path))
    assert cfg.runtime.kernel_pack == str(tmp_path / "packs" / "p")
    assert load_config(None, ["runtime.kernel_pack=elsewhere"]).runtime.kernel_pack == "elsewhere"


def test_nproc_builds_the_plan_of_a_torchrun_process(monkeypatch, capsys, cache_dir):
    """Under torchrun FSDP2 gathers the student in the compute dtype: other keys than one process's."""
    from kdistill.commands.common import resolve_run
    from kdistill.kernels.plan import required_kernels, triton_keys

    seen = []

    def record(key):  # the keys the build would compile (nothing compiled: the test is about the plan)
        seen.append(str(key))
        raise RuntimeError("not compiled here")

    monkeypatch.setattr(build, "jit_compile", record)
    args = argparse.Namespace(
        config="qwen2.5-1.5b:qwen2.5-0.5b", overrides=[], arch="sm_90", json=True, nproc=2
    )
    assert build_command(args) == 1
    capsys.readouterr()
    cfg, t, s = resolve_run("qwen2.5-1.5b:qwen2.5-0.5b")
    sharded = [str(k) for k in triton_keys(required_kernels(t, s, cfg, "sm_90", sharded=True))]
    single = [str(k) for k in triton_keys(required_kernels(t, s, cfg, "sm_90"))]
    assert seen == sharded and set(sharded) != set(single)
    args.nproc = 0
    with pytest.raises(UserError, match="--nproc 0: expected the number of torchrun processes"):
        build_command(args)
