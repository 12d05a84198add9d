"""A teacher cache: the teacher's targets for every packed training row and every evaluated held-out
row, written once, read by runs.

    kdistill teacher-cache run.yaml --out cache/ --mode exact|topk|sampled --k 64
    kdistill run run.yaml teacher.cache=cache/          # no teacher loaded

Layout of DIR (see docs/teacher_cache.md):

    manifest.json                  identity (teacher, tokenizer, data), seq_len, temperature, mode, k,
                                   rows, shard_rows, the shard list, heldout (its identity and shard
                                   list), complete
    shard-00000/                   rows [0, shard_rows): one .npy per array, memory-mapped at load
        logp.npy    exact    (R, T, V) uint16  bf16 bits of log_softmax(teacher logits) at T = 1
        ids.npy     topk     (R, T, k) int32   top-k ids of p_T;    sampled: k draws from p_T
        logp.npy    topk     (R, T, k) float32 log p_T(ids);        sampled: the same
        rest.npy    topk     (R, T)    float32 log(1 - sum p_T(ids)), the remaining mass
    heldout-00000/                 held-out rows [0, shard_rows): the same arrays at T = 1 (the
                                   held-out eval's temperature), and
        label.npy   every mode (R, T)  float32 log p(label) at T = 1 (0 where the label is ignored)

Row r of the cache is row r of the run's packed training data (data.train[r]): the index is the row's,
not the batch order's, so any seed or batch size reads the same targets. Held-out row r is row r of
data.heldout; the cache holds the rows the run's held-out eval reads (schedule.eval_batches batches of
schedule.batch_size: kdistill.data.heldout_batches). A shard is written to `shard-XXXXX.tmp/` and
renamed when complete; writing again skips complete shards (resumable). Each shard's entry in the
manifest records the sha256 of its files ("sha256": {"logp.npy": hex, ...}); opening a cache checks the
manifest's fields against each other and every shard's dtype, shape, size and sha256 against it. A cache without the held-out
part (written before it existed) still serves training; its runs' evals report the student's CE only.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import struct
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kdistill.data import heldout_batches
from kdistill.errors import UserError
from kdistill.fileio import fault_point, file_sha256, fsync_dir
from kdistill.jsonio import read_json

MODES = ("exact", "topk", "sampled")
FORMAT = 1
# Manifest fields a run checks against its own config, data and models, in the order it checks them.
CHECKED = ("format", "teacher", "tokenizer", "data", "seq_len", "temperature")
# The held-out part (manifest `heldout`, shards heldout-XXXXX): what a run checks of it. The rows its eval
# reads and their sha256; schedule.eval_batches and batch_size only name the cause when the rows differ.
HELDOUT_PREFIX = "heldout"
HELDOUT_CHECKED = ("rows", "data")


def teacher_identity(model_dir: str | Path) -> str:
    """sha256 of the teacher's config.json and its weights index: per safetensors file its name, size,
    header (names, dtypes, shapes, offsets) and the first and last MiB of its data. Cheap for a large
    teacher (no full read), and different for any retrained or re-saved checkpoint in practice."""
    d = Path(model_dir)
    h = hashlib.sha256()
    h.update((d / "config.json").read_bytes())
    for f in sorted(d.glob("*.safetensors")):
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with f.open("rb") as fh:
            head = fh.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
            h.update(fh.read(min(n, size)))
            h.update(fh.read(1 << 20))
            fh.seek(max(0, size - (1 << 20)))
            h.update(fh.read(1 << 20))
    return h.hexdigest()


def data_identity(train: Any, rows: int | None = None) -> str:
    """sha256 of the packed rows (raw windows, or the arrays of packed conversations); the first
    `rows` of them when given."""
    h = hashlib.sha256()
    parts = (
        [train.input_ids, train.labels, train.position_ids, train.doc_ids]
        if hasattr(train, "input_ids")
        else [train]
    )
    for p in parts:
        a = np.ascontiguousarray(p if rows is None else p[:rows])
        h.update(f"{a.dtype}{a.shape}".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def seq_len_of(train: Any) -> int:
    """Tokens per row the model sees (T)."""
    return int(train.input_ids.shape[1]) if hasattr(train, "input_ids") else int(train.shape[1]) - 1


def heldout_identity(heldout: Any, batch_size: int, eval_batches: int) -> dict[str, Any]:
    """The held-out rows a run evaluates (kdistill.data.heldout_batches: the first eval_batches batches
    of batch_size rows): their count, sha256, and the schedule behind them."""
    count = len(heldout_batches(heldout, batch_size, eval_batches))
    rows = min(len(heldout), count * batch_size)
    return {
        "rows": int(rows),
        "data": data_identity(heldout, rows),
        "batch_size": int(batch_size),
        "eval_batches": int(eval_batches),
    }


def run_identity(cfg: Any, tokenizer_identity: str, train: Any, heldout: Any = None) -> dict[str, Any]:
    """What a cache must match for a run config: teacher, tokenizer, data, seq_len, temperature, and
    with `heldout` (the run's packed held-out rows) the held-out rows its evals read."""
    out = {
        "format": FORMAT,
        "teacher": teacher_identity(cfg.teacher.path),
        "tokenizer": tokenizer_identity,
        "data": data_identity(train),
        "seq_len": seq_len_of(train),
        "temperature": float(cfg.kd.temperature),
    }
    if heldout is not None:
        out["heldout"] = heldout_identity(heldout, cfg.schedule.batch_size, cfg.schedule.eval_batches)
    return out


def shard_name(i: int, prefix: str = "shard") -> str:
    return f"{prefix}-{i:05d}"


def without_sums(shards: Any) -> Any:
    """A shard list without its recorded sha256s (what the rows and shard_rows imply)."""
    if not isinstance(shards, list):
        return shards
    return [{k: v for k, v in s.items() if k != "sha256"} if isinstance(s, dict) else s for s in shards]


def shard_list(rows: int, shard_rows: int, prefix: str = "shard") -> list[dict[str, Any]]:
    """[{name, start, stop}, ...]: rows [0, rows) in shards of shard_rows."""
    n = (rows + shard_rows - 1) // shard_rows
    return [
        {"name": shard_name(i, prefix), "start": i * shard_rows, "stop": min(rows, (i + 1) * shard_rows)}
        for i in range(n)
    ]


def make_manifest(
    *, teacher: str, tokenizer: str, data: str, seq_len: int, temperature: float, mode: str, k: int,
    vocab: int, rows: int, shard_rows: int, heldout: dict[str, Any] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """The manifest of a cache (complete=False until every shard is written). `heldout`: the
    held-out rows' identity (heldout_identity); its shards are listed with it."""
    out = {
        "format": FORMAT,
        "teacher": teacher,
        "tokenizer": tokenizer,
        "data": data,
        "seq_len": seq_len,
        "temperature": float(temperature),
        "mode": mode,
        "k": int(k),
        "vocab": int(vocab),
        "rows": int(rows),
        "shard_rows": int(shard_rows),
        "shards": shard_list(rows, shard_rows),
        "complete": False,
    }
    if heldout is not None:
        out["heldout"] = {
            **heldout,
            "temperature": 1.0,
            "shards": shard_list(heldout["rows"], shard_rows, HELDOUT_PREFIX),
        }
    return out


def arrays_of(mode: str, heldout: bool = False) -> tuple[str, ...]:
    """The .npy arrays a shard of `mode` holds (a held-out shard adds `label`)."""
    base = {"exact": ("logp",), "topk": ("ids", "logp", "rest"), "sampled": ("ids", "logp")}[mode]
    return (*base, "label") if heldout else base


def shard_complete(root: Path, name: str, mode: str, heldout: bool = False) -> bool:
    return all((root / name / f"{a}.npy").is_file() for a in arrays_of(mode, heldout))


def write_shard(root: Path, name: str, arrays: dict[str, np.ndarray]) -> dict[str, str]:
    """Write a shard's arrays under a temporary name, then rename it into place (atomic per shard; the
    caller holds the cache's lock, so a leftover temp folder is a killed writer's). Returns the sha256 of
    each array file ({"logp.npy": hex, ...}) for the manifest."""
    tmp = root / f"{name}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        tmp.mkdir()
        for key, arr in arrays.items():
            fault_point(tmp / f"{key}.npy", "numpy")
            with (tmp / f"{key}.npy").open("wb") as fh:
                np.save(fh, arr)
                fh.flush()
                os.fsync(fh.fileno())
        sums = {f"{key}.npy": file_sha256(tmp / f"{key}.npy") for key in arrays}
        fsync_dir(tmp)
        tmp.rename(root / name)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # nothing half-written stays (a disk fault, a signal)
        raise
    return sums


def expected_arrays(manifest: dict[str, Any], rows: int, heldout: bool) -> dict[str, tuple[str, tuple]]:
    """{array: (numpy dtype, shape)} a shard of `rows` rows must hold, from the manifest's mode, k,
    seq_len and vocab."""
    t, k, v = int(manifest["seq_len"]), int(manifest["k"]), int(manifest["vocab"])
    out = {
        "logp": ("<u2", (rows, t, v)) if manifest["mode"] == "exact" else ("<f4", (rows, t, k)),
        "ids": ("<i4", (rows, t, k)),
        "rest": ("<f4", (rows, t)),
        "label": ("<f4", (rows, t)),
    }
    return {a: out[a] for a in arrays_of(manifest["mode"], heldout)}


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def check_fields(manifest: dict[str, Any], where: str) -> None:
    """The manifest's fields against each other: mode, k (0 for exact, [1, vocab) otherwise), vocab,
    seq_len, rows, shard_rows, and the shard lists they imply. One line naming the first that is off."""
    mode = manifest.get("mode")
    if mode not in MODES:
        raise UserError(f"{where}: manifest mode is {mode!r}, expected one of: {', '.join(MODES)}")
    for field in ("vocab", "seq_len", "rows", "shard_rows"):
        if not _positive_int(manifest.get(field)):
            raise UserError(
                f"{where}: manifest {field} is {manifest.get(field)!r}, expected a positive integer"
            )
    k, vocab = manifest.get("k"), manifest["vocab"]
    if mode == "exact" and k != 0:
        raise UserError(f"{where}: manifest k is {k!r} with mode exact, expected 0 (the cache was edited)")
    if mode != "exact" and not (_positive_int(k) and k < vocab):
        raise UserError(
            f"{where}: manifest k is {k!r} with mode {mode}, expected an integer in [1, {vocab - 1}]"
        )
    if without_sums(manifest.get("shards")) != shard_list(manifest["rows"], manifest["shard_rows"]):
        raise UserError(
            f"{where}: manifest shards do not match its rows and shard_rows (the cache was edited)"
        )
    held = manifest.get("heldout")
    if held is not None:
        if not isinstance(held, dict) or not _positive_int(held.get("rows")):
            raise UserError(f"{where}: manifest heldout is malformed (expected its rows and shard list)")
        if without_sums(held.get("shards")) != shard_list(
            held["rows"], manifest["shard_rows"], HELDOUT_PREFIX
        ):
            raise UserError(
                f"{where}: manifest heldout shards do not match its rows and shard_rows (the cache was edited)"
            )


def verify_shard(root: Path, manifest: dict[str, Any], shard: dict[str, Any], heldout: bool) -> None:
    """Every array file of `shard`: present, its .npy header's dtype and shape those the manifest
    implies, its size header + data, and its sha256 the manifest's (when recorded). One line naming the
    shard and the array at fault."""
    name = shard["name"]
    where = f"teacher.cache {root}: shard {name}"
    sums = shard.get("sha256") or {}
    expected = expected_arrays(manifest, shard["stop"] - shard["start"], heldout)
    if sums and set(sums) != {f"{a}.npy" for a in expected}:
        raise UserError(
            f"{where}: written with the files {', '.join(sorted(sums))}, mode {manifest['mode']} reads "
            f"{', '.join(f'{a}.npy' for a in sorted(expected))} (the manifest's mode was edited)"
        )
    for array, (dtype, shape) in expected.items():
        path = root / name / f"{array}.npy"
        if not path.is_file():
            raise UserError(f"{where}: {array}.npy is missing (an unfinished or damaged cache)")
        try:
            with path.open("rb") as fh:
                version = np.lib.format.read_magic(fh)
                read = (
                    np.lib.format.read_array_header_1_0
                    if version == (1, 0)
                    else np.lib.format.read_array_header_2_0
                )
                got_shape, fortran, got_dtype = read(fh)
                offset = fh.tell()
        except (OSError, ValueError, SyntaxError) as e:
            raise UserError(f"{where}: {array}.npy is not a readable .npy file ({e})") from None
        if got_dtype.str != dtype or tuple(got_shape) != shape or fortran:
            raise UserError(
                f"{where}: {array}.npy holds {got_dtype.str} {tuple(got_shape)}, the manifest implies "
                f"{dtype} {shape} (the cache was edited or written for another mode, k or vocabulary)"
            )
        want_size = offset + int(np.prod(shape)) * np.dtype(dtype).itemsize
        size = path.stat().st_size
        if size != want_size:
            raise UserError(
                f"{where}: {array}.npy is {size} bytes, expected {want_size} (truncated or damaged): "
                "remove the shard and run kdistill teacher-cache again with the same --out"
            )
        want_sum = sums.get(f"{array}.npy")
        if want_sum is not None and file_sha256(path) != want_sum:
            raise UserError(
                f"{where}: {array}.npy does not match its sha256 in the manifest (damaged): remove the "
                "shard and run kdistill teacher-cache again with the same --out"
            )


def bf16_bits(x: torch.Tensor) -> np.ndarray:
    """A tensor as the uint16 bit patterns of its bf16 rounding (numpy has no bfloat16)."""
    return x.to(torch.bfloat16).cpu().view(torch.int16).numpy().view(np.uint16)


def from_bf16_bits(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)


def read_manifest(root: Path) -> dict[str, Any]:
    path = root / "manifest.json"
    if not path.is_file():
        raise UserError(
            f"teacher.cache {root}: no manifest.json (not a teacher cache; make one with kdistill teacher-cache)"
        )
    return read_json(path, max_bytes=64 << 20, what="a teacher cache manifest.json")


def check_manifest(found: dict[str, Any], want: dict[str, Any], where: str) -> None:
    """A one-line error naming the first field of CHECKED that differs (temperature: sparse modes only;
    an exact cache holds T = 1 log-probs and serves any kd.temperature)."""
    for field in CHECKED:
        if field == "temperature" and found.get("mode") == "exact":
            continue
        if found.get(field) != want.get(field):
            a, b = (
                v[:12] if isinstance(v, str) and len(v) == 64 else v
                for v in (found.get(field), want.get(field))
            )
            raise UserError(
                f"{where}: made for another {field} ({a}, this run has {b}): "
                "make the cache again with kdistill teacher-cache for this config"
            )


def check_heldout(found: dict[str, Any] | None, want: dict[str, Any], where: str) -> None:
    """A one-line error when the cache's held-out rows (manifest `heldout`) are not the ones this run
    evaluates, naming schedule.eval_batches or schedule.batch_size when one of them differs, else the
    held-out data. `found` None (a cache without the held-out part) passes: the caller reports it."""
    if found is None or all(found.get(f) == want.get(f) for f in HELDOUT_CHECKED):
        return
    for field in ("eval_batches", "batch_size"):
        if found.get(field) != want.get(field):
            a, b = found.get(field), want.get(field)
            label = f"schedule.{field}"
            break
    else:
        label = "held-out data"
        a, b = (f"{h.get('rows')} rows, {str(h.get('data'))[:12]}" for h in (found, want))
    raise UserError(
        f"{where}: held-out targets made for another {label} ({a}, this run has {b}): run kdistill "
        "teacher-cache again for this config with the same --out (it rewrites the held-out part only)"
    )


class TeacherCache:
    """A complete cache opened for reading (memory-mapped shards); `targets(rows)` per batch.

    `heldout` is the manifest's held-out section (None for a cache written without it); then
    `targets(rows, heldout=True)` and `label_logp(rows)` read the held-out rows' targets."""

    def __init__(self, root: Path, manifest: dict[str, Any]) -> None:
        self.root, self.manifest = root, manifest
        self.mode, self.k = manifest["mode"], int(manifest["k"])
        self.shard_rows = int(manifest["shard_rows"])
        self.heldout: dict[str, Any] | None = manifest.get("heldout")
        self.shards = self._open_shards(manifest["shards"], heldout=False)
        self.heldout_shards = self._open_shards(self.heldout["shards"], heldout=True) if self.heldout else []

    def _open_shards(self, listed: list[dict[str, Any]], heldout: bool) -> list[dict[str, np.ndarray]]:
        out = []
        for s in listed:
            if not (self.root / s["name"]).is_dir():
                raise UserError(
                    f"teacher.cache {self.root}: shard {s['name']} is missing (an unfinished cache)"
                )
            verify_shard(self.root, self.manifest, s, heldout)
            out.append(
                {
                    a: np.load(self.root / s["name"] / f"{a}.npy", mmap_mode="r")
                    for a in arrays_of(self.mode, heldout)
                }
            )
        return out

    @classmethod
    def open(cls, root: str | Path, want: dict[str, Any]) -> TeacherCache:
        """Open DIR, checking its manifest against `want` (teacher, tokenizer, data, seq_len, temperature;
        and the held-out rows when `want` has `heldout` and the cache a held-out part), its fields against
        each other (check_fields) and every shard against it (verify_shard: dtype, shape, size, sha256)."""
        root = Path(root)
        manifest = read_manifest(root)
        where = f"teacher.cache {root}"
        check_manifest(manifest, want, where)
        if "heldout" in want:
            check_heldout(manifest.get("heldout"), want["heldout"], where)
        check_fields(manifest, where)
        if not manifest.get("complete"):
            raise UserError(
                f"{where}: incomplete (run kdistill teacher-cache again with the same --out to finish it)"
            )
        return cls(root, manifest)

    def _gather(self, name: str, rows: np.ndarray, heldout: bool = False) -> np.ndarray:
        shards = self.heldout_shards if heldout else self.shards
        parts = [np.asarray(shards[r // self.shard_rows][name][r % self.shard_rows]) for r in rows.tolist()]
        return np.stack(parts)

    def targets(self, rows: np.ndarray, heldout: bool = False) -> torch.Tensor:
        """(B, T, V) bf16 log-probs (exact), (B, T, 2k + 1) fp32 [ids | log p | rest] (topk) or
        (B, T, 3k + 1) fp32 [ids | 1/k | log p | 0] (sampled), for dataset rows `rows` (of data.train,
        or with `heldout` of data.heldout, whose sparse targets are at T = 1)."""
        rows = np.asarray(rows, dtype=np.int64)
        if self.mode == "exact":
            return from_bf16_bits(self._gather("logp", rows, heldout))
        ids = torch.from_numpy(self._gather("ids", rows, heldout).astype(np.float32))
        logp = torch.from_numpy(self._gather("logp", rows, heldout).astype(np.float32))
        if self.mode == "topk":
            rest = torch.from_numpy(self._gather("rest", rows, heldout).astype(np.float32)).unsqueeze(-1)
            return torch.cat([ids, logp, rest], dim=-1)
        w = torch.full_like(logp, 1.0 / self.k)
        return torch.cat([ids, w, logp, torch.zeros_like(logp[..., :1])], dim=-1)

    def label_logp(self, rows: np.ndarray) -> torch.Tensor:
        """(B, T) fp32 teacher log-probs of the labels at T = 1 of held-out rows `rows` (0 where ignored)."""
        return torch.from_numpy(self._gather("label", np.asarray(rows, dtype=np.int64), heldout=True))
