"""Kernel packs: the binaries of a kernel plan, compiled once without a GPU, installed on every GPU.

    kdistill kernels build --arch sm_80,sm_90 CONFIG --out pack/     # writes (or adds to) the pack
    kdistill prewarm CONFIG --pack pack/                             # or runtime.kernel_pack=pack/

A pack is a folder:

    manifest.json                     format, Triton version, and per kernel key: arch, Triton and CUDA
                                      (ptxas) versions, the binary's folder, sha256 of every file
    sm_90/swiglu_fwd-1f2e.../         one folder per kernel key: the cubin and Triton's metadata JSON
        swiglu_fwd_kernel.cubin
        swiglu_fwd_kernel.json

Nothing in it names a path of the machine that built it: Triton's cache groups (`__grp__*.json`,
absolute paths) are not copied, and the metadata's library paths (libdevice) keep their file name only.

The build compiles each key through Triton's own JIT warmup (the launch prewarm makes, on CPU tensors)
with a stand-in driver that names the target arch (`jit_compile`), so each binary sits under the very
cache key a GPU's JIT computes for that launch. That key covers Triton's own files (`triton_build`), so
a pack serves the Triton install that made it, or one identical to it (same version and wheel).

A build stages its binaries in `.staging-<pid>-<hex>/` inside the pack (with a marker file naming the
process and host) and moves them in at commit; a later build removes the staging folders of builds
that were killed (its own kind only: the name, the marker and a dead process on this host). Committing
verifies what the pack holds: a binary of this build whose folder is missing or damaged is replaced,
and a damaged kernel of the manifest that this build does not rebuild is dropped from it (prewarm
compiles it, or a later build adds it again). Messages quote at most ~200 characters of any value.

Installing (`install`, called by prewarm before it warms anything) checks the pack against this
process: the exact Triton version and build, the GPU's architecture, the CUDA version of the ptxas
Triton uses for it, and every file's sha256; each mismatch is one line naming both sides. It then
writes each needed binary into Triton's cache under its key, with a group file that points at the real
cache folder. Prewarm's JIT warmup then finds every packed kernel in the cache and compiles none of
them. A key the pack lacks is compiled as before, or refused up front under `runtime.strict_kernels`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from kdistill.errors import KernelCacheMiss, UserError
from kdistill.fileio import atomic_write_json, remove_quietly, write_guard
from kdistill.kernels import registry
from kdistill.kernels.keys import KernelKey, arch_capability

MANIFEST = "manifest.json"
FORMAT = 1
BINARY_EXT = "cubin"
STAGING_PREFIX = ".staging-"
STAGING_MARKER = ".kdistill-staging"  # in every staging folder: "<pid> <host>" of the build
_STAGING_NAME = re.compile(r"\.staging-(\d+)-[0-9a-f]{8}")
QUOTE = 200  # characters of a value a message quotes at most


def quote(value: Any, limit: int = QUOTE) -> str:
    """str(value) for a one-line message, cut to `limit` characters (the length said after)."""
    text = " ".join(str(value).split())
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"


# -- the toolchain of this process ----------------------------------------------------------------
def triton_version() -> str:
    import triton

    return str(triton.__version__)


@functools.cache
def _ptxas(cap: int) -> Any:
    """The ptxas tool Triton runs for compute capability `cap` (Triton >= 3.6 has one for Blackwell)."""
    from triton.backends.nvidia import compiler as nv

    try:
        return nv.get_ptxas(cap)
    except TypeError:  # a Triton whose get_ptxas takes no arch
        return nv.get_ptxas()


@functools.cache
def cuda_version(arch: str) -> str:
    """The CUDA version of the ptxas Triton assembles `arch` with, e.g. '12.9.86' (what the binaries
    were made by; part of Triton's cache key)."""
    from triton.backends.nvidia import compiler as nv

    cap = arch_capability(arch)
    try:
        text = nv.get_ptxas_version(cap)
    except TypeError:
        text = nv.get_ptxas_version()
    text = text.decode() if isinstance(text, bytes) else str(text)
    m = re.search(r"V(\d+\.\d+(?:\.\d+)?)", text) or re.search(r"release (\d+\.\d+)", text)
    return m.group(1) if m else " ".join(text.split())


@functools.cache
def can_target(arch: str) -> bool:
    """Whether the installed Triton can compile for `arch`: the ptxas it uses for that arch knows the
    arch (sm_103 and sm_121 need the Blackwell ptxas of Triton 3.6 or newer, CUDA 12.9)."""
    cap = arch_capability(arch)
    try:
        path = _ptxas(cap).path
        out = subprocess.run([path, "--help"], capture_output=True, text=True, timeout=120).stdout
    except Exception:  # no Triton, no NVIDIA backend, or a ptxas that does not run here
        return False
    return re.search(rf"\bsm_{cap}a?\b", out) is not None


@functools.cache
def triton_build() -> str:
    """A digest of this Triton build as its cache keys see it (version, compiler sources, libtriton):
    two installs with the same digest compute the same cache key for the same kernel."""
    from triton.runtime.cache import triton_key

    return hashlib.sha256(triton_key().encode("utf-8")).hexdigest()[:16]


class _TargetDriver:
    """Stands in for Triton's CUDA driver while compiling without a GPU: the "current device" is the
    target arch's capability (so the JIT keeps one binder per target) and the current target is it."""

    def __init__(self, cap: int) -> None:
        self.cap = cap

    def get_current_device(self) -> int:
        return self.cap

    def get_current_stream(self, device: Any = None) -> int:
        return 0

    def get_current_target(self) -> Any:
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", self.cap, 32)


@contextlib.contextmanager
def targeting(arch: str) -> Iterator[None]:
    """Inside the block, Triton's JIT compiles for `arch` (no GPU needed; nothing can be launched)."""
    from triton.runtime.driver import driver

    saved = dict(vars(driver))  # whatever this Triton keeps there (the active driver, lazily made)
    driver.set_active(_TargetDriver(arch_capability(arch)))
    try:
        yield
    finally:
        vars(driver).clear()
        vars(driver).update(saved)


def jit_compile(key: KernelKey) -> Any:
    """Compile `key` through Triton's own JIT (the warmup prewarm runs, on CPU tensors) for its arch:
    the cache entry is the one a GPU's JIT looks up for this key, so a pack made of it is found by
    prewarm. Returns Triton's CompiledKernel."""
    kernel, grid, args, kwargs, _ = registry.kernel_of(key).launch(key, "cpu")
    with targeting(key.arch):
        return kernel.warmup(*args, grid=grid, **kwargs)


# -- the manifest -----------------------------------------------------------------------------------
@dataclasses.dataclass
class Entry:
    """One kernel key's binary in a pack."""

    key: str
    arch: str
    triton: str
    cuda: str
    dir: str  # folder inside the pack, relative
    name: str  # the kernel's name (Triton's file stem)
    triton_hash: str  # Triton's cache key (hex): the binary's folder in Triton's cache
    files: dict[str, str]  # file name -> sha256

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out.pop("key")
        return out


@dataclasses.dataclass
class Manifest:
    triton: str  # Triton's version
    build: str  # triton_build() of the Triton that made it
    kernels: dict[str, Entry]

    def archs(self) -> list[str]:
        return sorted({e.arch for e in self.kernels.values()}, key=arch_capability)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "triton": self.triton,
            "triton_build": self.build,
            "kernels": {k: self.kernels[k].to_json() for k in sorted(self.kernels)},
        }


def _bad(path: Path, what: str) -> UserError:
    return UserError(f"{path}: {what}")


def read_manifest(folder: Path | str, *, what: str = "kernel pack") -> Manifest:
    """The pack's manifest, checked field by field (one-line errors naming the file and field)."""
    folder = Path(folder)
    path = folder / MANIFEST
    if not folder.is_dir():
        raise UserError(
            f"{what} {folder}: not a folder (expected the --out folder of kdistill kernels build)"
        )
    if not path.is_file():
        raise UserError(
            f"{what} {folder}: no {MANIFEST} (expected the --out folder of kdistill kernels build)"
        )
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except RecursionError:
        raise _bad(path, "not a readable JSON manifest (nested too deeply)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _bad(path, f"not a readable JSON manifest ({e.__class__.__name__}: {quote(e)})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise _bad(path, f"expected a kernel pack manifest with format {FORMAT}, got {quote(data, 80)}")
    if (
        not isinstance(data.get("triton"), str)
        or not isinstance(data.get("triton_build"), str)
        or not isinstance(data.get("kernels"), dict)
    ):
        raise _bad(path, "expected the fields 'triton' (a version), 'triton_build' and 'kernels' (a mapping)")
    kernels = {}
    fields = [f.name for f in dataclasses.fields(Entry) if f.name != "key"]
    for key, raw in data["kernels"].items():
        if not isinstance(raw, dict) or any(f not in raw for f in fields):
            raise _bad(path, f"kernel '{quote(key)}': expected the fields {', '.join(fields)}")
        text = [f for f in fields if f != "files" and not isinstance(raw[f], str)]
        if text:
            raise _bad(
                path, f"kernel '{quote(key)}': '{text[0]}' is {quote(raw[text[0]], 80)}, expected a string"
            )
        files = raw["files"]
        if not isinstance(files, dict) or not files or not all(isinstance(v, str) for v in files.values()):
            raise _bad(path, f"kernel '{quote(key)}': 'files' must map file names to sha256 digests")
        rel = Path(str(raw["dir"]))
        for part in (rel, *map(Path, files)):
            if part.is_absolute() or ".." in part.parts:
                raise _bad(path, f"kernel '{quote(key)}': '{quote(part)}' is not a path inside the pack")
        kernels[key] = Entry(key=key, **{f: raw[f] for f in fields})
    return Manifest(triton=data["triton"], build=data["triton_build"], kernels=kernels)


# -- writing a pack (kdistill kernels build --out) --------------------------------------------------
def _folder_name(key: KernelKey, files: dict[str, str]) -> str:
    """<arch>/<op>-<key digest>-<content digest>: a rebuilt binary never overwrites the one the current
    manifest names (the manifest switches to it in one rename)."""
    content = hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()[:8]
    return f"{key.arch}/{key.op}-{hashlib.sha256(str(key).encode()).hexdigest()[:12]}-{content}"


def portable_metadata(data: bytes) -> bytes:
    """Triton's metadata JSON with its library paths reduced to file names (no path of this machine)."""
    meta = json.loads(data)
    libs = meta.get("extern_libs")
    if libs:
        meta["extern_libs"] = [[name, os.path.basename(str(p))] for name, p in libs]
    return json.dumps(meta, sort_keys=True).encode("utf-8")


def _intact(folder: Path, entry: Entry) -> bool:
    """Whether the entry's folder holds each of its files with the sha256 the manifest records."""
    for name, want in entry.files.items():
        try:
            data = (folder / entry.dir / name).read_bytes()
        except OSError:
            return False
        if hashlib.sha256(data).hexdigest() != want:
            return False
    return True


def _binary_dir(folder: Path, rel: str) -> bool:
    """Whether `rel` names a binary's folder as a build makes them (<arch>/<op>-<digest>-<digest>), so
    that a manifest edited by hand can never make a build remove anything else."""
    parts = Path(rel).parts
    return (
        len(parts) == 2
        and re.fullmatch(r"sm_\d+", parts[0]) is not None
        and re.fullmatch(r"[A-Za-z0-9_]+-[0-9a-f]{12}-[0-9a-f]{8}", parts[1]) is not None
        and (folder / rel).is_dir()
        and not (folder / rel).is_symlink()
    )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: alive
        return True
    return True


def stale_staging(folder: Path) -> list[Path]:
    """The staging folders in the pack `folder` that a killed build left: named as a build names them,
    holding its marker, written on this host by a process that no longer runs. Nothing else (a user's
    file or folder of any other name, a live build's staging) is ever listed."""
    out: list[Path] = []
    try:
        entries = sorted(folder.iterdir())
    except OSError:
        return out
    host = socket.gethostname()
    for p in entries:
        m = _STAGING_NAME.fullmatch(p.name)
        if m is None or p.is_symlink() or not p.is_dir():
            continue
        try:
            pid, _, who = (p / STAGING_MARKER).read_text(encoding="utf-8").strip().partition(" ")
        except (OSError, UnicodeDecodeError):
            continue
        if pid == m.group(1) and who == host and not _alive(int(pid)):
            out.append(p)
    return out


class PackWriter:
    """Collects compiled kernels and adds them to the pack at `folder` in one step.

        writer = PackWriter(out, archs)     # reads an existing manifest (same Triton build only)
        writer.add(key, compiled_kernel)    # the CompiledKernel jit_compile(key) returned
        writer.commit()                     # moves the binaries in, then replaces the manifest

    Until `commit` everything is staged in a hidden folder inside the pack, removed by `abort` (or on
    any failure of commit), so an interrupted or failed build leaves the pack as it was (a folder it
    created is removed again if it stayed empty). Opening the writer checks that the pack's folder and
    the folder of each arch in `archs` can be folders (not a file of the user's), removes the staging
    folders of killed builds, and makes its own staging folder: a read-only --out is one line here."""

    def __init__(self, folder: Path | str, archs: Iterable[str] = ()) -> None:
        self.folder = Path(folder)
        if self.folder.exists() and not self.folder.is_dir():
            raise UserError(f"--out {self.folder}: exists and is not a folder, expected a kernel pack folder")
        for arch in archs:
            sub = self.folder / arch
            if sub.is_symlink() or (sub.exists() and not sub.is_dir()):
                raise UserError(
                    f"--out {self.folder}: {arch} is not a folder, expected the pack's folder of {arch} "
                    "binaries there: move it aside or build into another folder"
                )
        here, build = triton_version(), triton_build()
        if (self.folder / MANIFEST).exists():
            self.manifest = read_manifest(self.folder, what="--out")
            if (self.manifest.triton, self.manifest.build) != (here, build):
                raise UserError(
                    f"--out {self.folder}: the pack was built with Triton {quote(self.manifest.triton)} (build "
                    f"{quote(self.manifest.build)}), this is Triton {here} (build {build}); build into a new folder"
                )
        else:
            self.manifest = Manifest(triton=here, build=build, kernels={})
        self.created = not self.folder.exists()
        self.staging = self.folder / f"{STAGING_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.added: dict[str, Entry] = {}
        self.repaired = 0  # binaries of this build whose folder in the pack was missing or damaged
        self.dropped: list[str] = []  # damaged kernels of the manifest this build did not rebuild
        self.stale = stale_staging(self.folder) if not self.created else []
        for p in self.stale:
            shutil.rmtree(p, ignore_errors=True)
        with write_guard(self.folder, what="write the kernel pack", intact="the pack is as it was"):
            try:
                self.staging.mkdir(parents=True)
                (self.staging / STAGING_MARKER).write_text(
                    f"{os.getpid()} {socket.gethostname()}\n", encoding="utf-8"
                )
            except BaseException:
                self.abort()
                raise

    def add(self, key: KernelKey, compiled: Any) -> None:
        """Stage the binary and metadata of `compiled` (a triton CompiledKernel for `key`)."""
        group = dict(compiled.metadata_group)
        names = [n for n in group if n.endswith(".json") or n.endswith("." + BINARY_EXT)]
        if not any(n.endswith("." + BINARY_EXT) for n in names) or not any(
            n.endswith(".json") for n in names
        ):
            raise RuntimeError(f"{key}: Triton's cache entry has no {BINARY_EXT} and metadata")
        staged = {}
        for n in sorted(names):
            data = Path(group[n]).read_bytes()
            staged[n] = portable_metadata(data) if n.endswith(".json") else data
        files = {n: hashlib.sha256(data).hexdigest() for n, data in staged.items()}
        rel = _folder_name(key, files)
        dest = self.staging / rel
        dest.mkdir(parents=True, exist_ok=True)
        for n, data in staged.items():
            (dest / n).write_bytes(data)
        # Triton's group is named after its metadata file (<kernel name>.json)
        name = Path(next(n for n in names if n.endswith(".json"))).stem
        self.added[str(key)] = Entry(
            key=str(key),
            arch=key.arch,
            triton=self.manifest.triton,
            cuda=cuda_version(key.arch),
            dir=rel,
            name=name,
            triton_hash=str(compiled.hash),
            files=files,
        )

    def commit(self) -> int:
        """Move the staged binaries into the pack, then replace the manifest (one rename); returns the
        number of kernels added or rebuilt. A binary whose folder the pack already has is checked: a
        missing or damaged one is replaced (counted in `repaired`); a kernel of the old manifest this
        build did not rebuild and whose files are damaged is left out of the new one (`dropped`). On a
        failure the pack is as it was: its manifest is the old one and the folders moved in for the new
        one are removed."""
        moved: list[Path] = []
        with write_guard(self.folder, what="write the kernel pack", intact="the pack is as it was"):
            try:
                kernels = {}
                for key, entry in self.manifest.kernels.items():
                    if key in self.added or _intact(self.folder, entry):
                        kernels[key] = entry
                    else:
                        self.dropped.append(key)
                for key, entry in self.added.items():
                    final = self.folder / entry.dir
                    if final.is_dir() and not final.is_symlink() and not _intact(self.folder, entry):
                        shutil.rmtree(final)  # a damaged copy of this very binary: replaced below
                        self.repaired += 1
                    elif final.exists() and not final.is_dir():
                        final.unlink()
                        self.repaired += 1
                    if not final.exists():  # else: the same key with the same files is in the pack
                        final.parent.mkdir(parents=True, exist_ok=True)
                        os.replace(self.staging / entry.dir, final)
                        moved.append(final)
                    kernels[key] = entry
                atomic_write_json(
                    self.folder / MANIFEST,
                    Manifest(self.manifest.triton, self.manifest.build, kernels).to_json(),
                )
            except BaseException:
                remove_quietly(moved)
                remove_quietly(p.parent for p in moved if p.parent.is_dir() and not any(p.parent.iterdir()))
                remove_quietly([self.staging])
                self._drop_if_empty()
                raise
            remove_quietly([self.staging])
        old = {e.dir for e in self.manifest.kernels.values()} - {e.dir for e in kernels.values()}
        remove_quietly(self.folder / d for d in old if _binary_dir(self.folder, d))  # replaced or dropped
        self.manifest.kernels = kernels
        return len(self.added)

    def abort(self) -> None:
        remove_quietly([self.staging])
        self._drop_if_empty()

    def _drop_if_empty(self) -> None:
        if self.created and self.folder.is_dir() and not any(self.folder.iterdir()):
            remove_quietly([self.folder])


# -- installing a pack into Triton's cache (prewarm) ------------------------------------------------
@dataclasses.dataclass
class Installed:
    """What `install` did: the keys whose binaries came from the pack, and the keys it lacks."""

    folder: str
    keys: set[KernelKey] = dataclasses.field(default_factory=set)
    missing: list[KernelKey] = dataclasses.field(default_factory=list)


def check(manifest: Manifest, folder: Path, arch: str, *, what: str = "kernel pack") -> None:
    """Refuse a pack made with another Triton, for other archs, or by another CUDA's ptxas. what: how
    the messages name the pack (a command's flag, e.g. '--kernel-pack')."""
    here, build = triton_version(), triton_build()
    if manifest.triton != here:
        raise UserError(
            f"{what} {folder}: built with Triton {quote(manifest.triton)}, this is Triton {here}; rebuild it "
            f"with this Triton (kdistill kernels build --arch {arch} CONFIG --out {folder})"
        )
    if manifest.build != build:  # same version, another build (another Python's libtriton, say)
        raise UserError(
            f"{what} {folder}: built with Triton {manifest.triton} build {quote(manifest.build)}, this is "
            f"Triton {here} build {build} (their cache keys differ); rebuild the pack with this install"
        )
    archs = manifest.archs()
    if arch not in archs:
        raise UserError(
            f"{what} {folder}: built for {quote(', '.join(archs)) or 'no arch'}, this GPU is {arch}; add it with "
            f"kdistill kernels build --arch {arch} CONFIG --out {folder}"
        )
    cudas = sorted({e.cuda for e in manifest.kernels.values() if e.arch == arch})
    local = cuda_version(arch)
    if cudas != [local]:
        raise UserError(
            f"{what} {folder}: its {arch} binaries were made by CUDA {quote(', '.join(cudas))} (ptxas), this "
            f"Triton uses CUDA {local} for {arch}; rebuild the pack here"
        )


def verified(folder: Path, entry: Entry) -> dict[str, bytes]:
    """The entry's files, each checked against its sha256 in the manifest."""
    out = {}
    for name, want in sorted(entry.files.items()):
        path = folder / entry.dir / name
        try:
            data = path.read_bytes()
        except OSError as e:
            raise UserError(
                f"kernel pack {folder}: cannot read {quote(entry.dir)}/{quote(name)} ({e.strerror})"
            ) from None
        got = hashlib.sha256(data).hexdigest()
        if got != want:
            raise UserError(
                f"kernel pack {folder}: {quote(entry.dir)}/{quote(name)} has sha256 {got}, the manifest says "
                f"{quote(want, 80)} (kernel {quote(entry.key)}); rebuild the pack"
            )
        out[name] = data
    return out


def _put(entry: Entry, files: dict[str, bytes], key: KernelKey) -> None:
    """Write one kernel into Triton's cache where this Triton's JIT looks for `key` (same Triton build:
    the same cache key as where it was built)."""
    from triton.runtime.cache import get_cache_manager

    manager = get_cache_manager(entry.triton_hash)
    group = {}
    for name, data in files.items():
        if name.endswith(".json"):
            meta = json.loads(data)
            meta["extern_libs"] = _local_libs(key.arch) or meta.get("extern_libs")
            data = json.dumps(meta).encode("utf-8")
        group[name] = manager.put(data, name, binary=True)
    # Triton's group file names every file by its absolute path in this cache
    manager.put_group(f"{entry.name}.json", group)


def _local_libs(arch: str) -> list[list[str]] | None:
    """The library paths (libdevice) this Triton's options name, as its metadata records them."""
    try:
        from triton.compiler.compiler import make_backend

        libs = (
            make_backend(_TargetDriver(arch_capability(arch)).get_current_target())
            .parse_options({})
            .extern_libs
        )
        return [list(x) for x in libs] if libs else None
    except Exception:  # informational only: the pack's file names stay
        return None


def install(folder: Path | str, keys: Iterable[KernelKey], arch: str, *, strict: bool = False) -> Installed:
    """Install the pack's binaries for the Triton keys among `keys` (all for `arch`) into Triton's
    cache (setup_cache_dir must have run). strict: a key the pack lacks is an error, before anything
    is written."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    check(manifest, folder, arch)
    wanted = sorted(k for k in set(keys) if not k.is_library)
    result = Installed(folder=str(folder))
    found = []
    for key in wanted:
        entry = manifest.kernels.get(str(key))
        if entry is None:
            result.missing.append(key)
        else:
            found.append((key, entry))
    if strict and result.missing:
        first = result.missing[0]
        raise KernelCacheMiss(
            f"kernel pack {folder} has no binary for {quote(first)} ({len(result.missing)} of {len(wanted)} planned "
            f"kernels missing) and runtime.strict_kernels forbids compiling it; add them with kdistill kernels "
            f"build --arch {arch} CONFIG --out {folder}"
        )
    checked = [(key, entry, verified(folder, entry)) for key, entry in found]  # every hash before any write
    from triton import knobs

    with write_guard(knobs.cache.dir or "Triton's cache", what="install the kernel pack"):
        for key, entry, files in checked:
            _put(entry, files, key)
            result.keys.add(key)
    return result


__all__ = [
    "MANIFEST",
    "Entry",
    "Installed",
    "Manifest",
    "PackWriter",
    "can_target",
    "check",
    "cuda_version",
    "install",
    "jit_compile",
    "quote",
    "read_manifest",
    "stale_staging",
    "targeting",
    "triton_build",
    "triton_version",
]
