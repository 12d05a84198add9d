"""Teacher-written data: `kdistill generate --out answers.jsonl`, resumable, with a manifest.

    kdistill generate --model TEACHER --messages prompts.jsonl --out answers.jsonl --samples-per-prompt 4

The file's side of `kdistill generate --out` (kdistill.generate.generate_to_file drives it: check_out,
settings, locked, resume, start, Appender, finish); nothing here loads a model or generates.

Each line of the output is one answer (answer_row in kdistill.generate): for conversations, the
conversation with the model's answer appended as an assistant turn ({"messages": [...]}, the format
`kdistill run` trains on), for plain prompts {"prompt", "completion"}; with "index" (the prompt's line),
"sample", "finish_reason" and the new "token_ids".

Resumable: answers are appended in chunks as they finish (each chunk one write, flushed to disk), so a
killed process loses at most the chunk it was writing; a torn last line is dropped on the next start,
which answers only what is missing. When every answer is written, the file is rewritten in prompt order
(a temp file renamed over it), then marked complete; a start that finds every answer written finishes
that (a kill between the last chunk and the mark loses nothing). Beside it, `answers.jsonl.manifest.json`
records the model (its path and its content: model_identity), the prompts' sha256, the sampling settings
and seed, and the progress; a second start with other settings or other weights is refused in one line
(greedy answers of a resumed file equal an uninterrupted run's; sampled ones are valid samples, not the
same draws), and so is a file whose answers do not fit the prompts (an index beyond them, a duplicate, a
complete file with answers missing). Nothing is written before every check has passed (the sizes, the
memory, the model loaded). An existing file without a manifest is not kdistill's and is never touched.
One process per output file (a lock beside it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

from kdistill import __version__
from kdistill.decode import Sampling
from kdistill.errors import UserError
from kdistill.outputs import output_lock
from kdistill.train import faults

KIND = "kdistill-generate"
CHUNK_ROWS = 64  # answers per append
CHUNK_SECONDS = 10.0  # or this long since the last append
FULL_HASH_BYTES = 256 << 20  # model files up to this size are hashed whole; larger ones are sampled
SAMPLE_CHUNKS, SAMPLE_BYTES = 64, 64 << 10  # a large weight file: 64 chunks of 64 KiB, evenly spread


def manifest_path(out: Path) -> Path:
    return out.with_name(out.name + ".manifest.json")


def _write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise UserError(f"{path}: cannot write ({e.strerror or e.__class__.__name__})") from None


def _file_digest(path: Path, size: int) -> str:
    """sha256 of a model file: whole up to FULL_HASH_BYTES; for a larger .safetensors file its header
    (every tensor's name, dtype, shape and offsets), its mtime and SAMPLE_CHUNKS chunks spread over it
    (a few MiB read of a multi-GB file); for another large file its mtime."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        if size <= FULL_HASH_BYTES:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
            return h.hexdigest()
        h.update(f"{size}:{path.stat().st_mtime_ns}".encode())
        if path.suffix == ".safetensors":
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else 0
            h.update(head + f.read(min(n, 100 << 20)))
            step = max(1, (size - SAMPLE_BYTES) // max(1, SAMPLE_CHUNKS - 1))
            for k in range(SAMPLE_CHUNKS):
                f.seek(min(k * step, max(0, size - SAMPLE_BYTES)))
                h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()


def model_identity(model_dir: Path) -> dict[str, str]:
    """What identifies the model's content, per file of its folder (hidden files aside): config,
    tokenizer, chat template and generation config hashed whole, weights by _file_digest. Weights
    replaced in place (other values, same shapes and names) give another identity."""
    out: dict[str, str] = {}
    try:
        for path in sorted(model_dir.iterdir()):
            if path.name.startswith(".") or not path.is_file():
                continue
            out[path.name] = f"{path.stat().st_size}:{_file_digest(path, path.stat().st_size)}"
    except OSError as e:
        raise UserError(f"--model {model_dir}: cannot read ({e.strerror or e.__class__.__name__})") from None
    return out


def check_out(out: str | Path) -> Path:
    """--out: a file path in an existing directory (checked before anything is read)."""
    out = Path(out)
    if out.is_dir():
        raise UserError(f"--out '{out}' is a directory, expected a .jsonl file path")
    if not out.parent.is_dir():
        raise UserError(f"--out '{out}': its directory does not exist")
    return out


def settings(
    model_dir: Path,
    ids: Sequence[Sequence[int]],
    sampling: Sampling,
    samples: int,
    max_length: int | None,
    chat: bool,
) -> dict[str, Any]:
    """What the manifest records of a call (its prompts as the sha256 of their token ids), and what a
    later start must match to resume the file."""
    digest = hashlib.sha256()
    for row in ids:
        digest.update(json.dumps(row).encode())
        digest.update(b"\n")
    return {
        "model": str(model_dir.resolve()),
        "model_files": model_identity(model_dir),
        "prompts": len(ids),
        "prompts_sha256": digest.hexdigest(),
        "chat": bool(chat),
        "sampling": dataclasses.asdict(sampling),
        "samples_per_prompt": samples,
        "max_length": max_length,
    }


def read_rows(out: Path) -> tuple[list[dict[str, Any]], int]:
    """Complete answer lines of an earlier start, and the byte length they take (a torn last line, a
    write cut by a kill, is after it)."""
    try:
        data = out.read_bytes()
    except FileNotFoundError:
        return [], 0
    except OSError as e:
        raise UserError(f"{out}: cannot read ({e.strerror or e.__class__.__name__})") from None
    rows, good = [], 0
    for n, line in enumerate(data.split(b"\n"), 1):
        end = good + len(line) + 1
        if end > len(data):  # no newline: a torn last line
            break
        try:
            row = json.loads(line)
        except (ValueError, RecursionError):
            raise UserError(f"{out}:{n}: not a JSON answer line (the file was changed by hand?)") from None
        if not isinstance(row, dict) or not all(
            isinstance(row.get(k), int) and not isinstance(row.get(k), bool) for k in ("index", "sample")
        ):
            raise UserError(f'{out}:{n}: expected an answer with integer "index" and "sample"')
        rows.append(row)
        good = end
    return rows, good


@contextlib.contextmanager
def locked(out: Path) -> Iterator[None]:
    """One process per output file (a lock beside it); a killed start's temp files are removed first."""
    with output_lock(out):
        for stale in [
            *out.parent.glob(f".{out.name}.tmp-*"),
            *out.parent.glob(f".{out.name}.manifest.json.tmp-*"),
        ]:
            stale.unlink(missing_ok=True)  # a killed start's rewrite or manifest, never renamed
        yield


def _read_manifest(mpath: Path) -> dict[str, Any]:
    try:
        manifest = json.loads(mpath.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        raise UserError(
            f"{mpath}: unreadable manifest; move it and its answers aside to start again"
        ) from None
    if not isinstance(manifest, dict) or manifest.get("kind") != KIND:
        raise UserError(f"{mpath}: not a kdistill generate manifest")
    return manifest


def _check_settings(manifest: dict[str, Any], settings: dict[str, Any], out: Path) -> None:
    """One line naming the first setting the file was written with that differs (the model's files:
    the first file that differs)."""
    for k, v in settings.items():
        old = manifest.get(k)
        if old == v:
            continue
        if k == "model_files":
            if not isinstance(old, dict):
                raise UserError(
                    f"--out {out} records no model content (an older kdistill wrote it): use another --out"
                )
            name = next(n for n in sorted({*old, *v}) if old.get(n) != v.get(n))
            what = "is new" if name not in old else "is gone" if name not in v else "changed"
            raise UserError(
                f"--out {out} was written by other weights: {name} of the model {what} since; use another "
                "--out for the new model's answers"
            )
        shown = json.dumps(old)
        shown = shown if len(shown) <= 200 else shown[:200] + "..."
        raise UserError(
            f"--out {out} was written with other settings ({k}: {shown}, now {json.dumps(v)}): use "
            "another --out, or the same settings to resume"
        )


def check_rows(out: Path, rows: list[dict[str, Any]], prompts: int, samples: int) -> set[tuple[int, int]]:
    """The (index, sample) pairs of an earlier start's answers, each within the prompts and samples and
    written once (the file's line named otherwise)."""
    done: set[tuple[int, int]] = set()
    for n, r in enumerate(rows, 1):
        i, j = r["index"], r["sample"]
        if not 0 <= i < prompts:
            shown = str(i) if len(str(i)) <= 40 else f"{str(i)[:40]}..."
            raise UserError(
                f"{out}:{n}: answer index {shown} is outside the {prompts} prompts (expected 0..{prompts - 1}: "
                "the file was changed by hand, or written for other prompts)"
            )
        if not 0 <= j < samples:
            shown = str(j) if len(str(j)) <= 40 else f"{str(j)[:40]}..."
            raise UserError(
                f"{out}:{n}: answer sample {shown} is outside 0..{samples - 1} (--samples-per-prompt)"
            )
        if (i, j) in done:
            raise UserError(f"{out}:{n}: a second answer of prompt {i} sample {j} (expected each once)")
        done.add((i, j))
    return done


@dataclasses.dataclass
class Resume:
    """What an earlier start left: `work`, the (prompt, sample) pairs still to answer, in order;
    `finished`, the manifest of a file that is complete and in order (nothing to do); `good`, the bytes
    of its complete lines; `written`, how many answers they hold."""

    work: list[tuple[int, int]]
    finished: dict[str, Any] | None = None
    good: int = 0
    written: int = 0


def resume(out: Path, current: dict[str, Any], prompts: int, samples: int) -> Resume:
    """Check an earlier start's manifest and answers against this call's settings (one line naming the
    first difference) and say what is left to answer. Reads only; call it under `locked`."""
    mpath = manifest_path(out)
    old: dict[str, Any] | None = None
    if mpath.exists():
        old = _read_manifest(mpath)
        _check_settings(old, current, out)
    elif out.exists():
        raise UserError(
            f"--out {out} exists and was not written by kdistill generate (no {mpath.name}): choose another path"
        )
    rows, good = read_rows(out)
    done = check_rows(out, rows, prompts, samples)
    total = prompts * samples
    if old is not None and old.get("status") == "complete" and len(done) < total:
        first = next((i, j) for i in range(prompts) for j in range(samples) if (i, j) not in done)
        raise UserError(
            f"{out}: marked complete but {total - len(done)} of its {total} answers are missing (the first: "
            f"prompt {first[0]} sample {first[1]}); the file was changed by hand: move it and {mpath.name} aside"
        )
    order = [(r["index"], r["sample"]) for r in rows]
    if old is not None and old.get("status") == "complete" and order == sorted(order) and good == _size(out):
        return Resume(work=[], finished=old)  # nothing to do, nothing changed
    work = [(i, j) for i in range(prompts) for j in range(samples) if (i, j) not in done]
    return Resume(work=work, good=good, written=len(done))


def start(out: Path, left: Resume, current: dict[str, Any], total: int) -> dict[str, Any]:
    """The first write of a start (after every check has passed and the model is loaded): drop a torn
    last line, then record the manifest as running. Returns the manifest."""
    if left.good < _size(out):  # drop a torn last line
        with open(out, "r+b") as f:
            f.truncate(left.good)
    manifest = {"kind": KIND, "kdistill": __version__, **current, "rows": total}
    manifest.update(written=left.written, status="running")
    _write_json_atomic(manifest_path(out), manifest)
    return manifest


def finish(out: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """Every answer is written: the file rewritten in prompt order, then the manifest marked complete.
    Returns the final manifest."""
    rows, _ = read_rows(out)
    faults.at("generate.rewrite")  # every answer written, not yet in order
    _rewrite_in_order(out, rows)
    faults.at("generate.mark")  # in order, not yet marked complete
    manifest.update(written=len(rows), status="complete")
    _write_json_atomic(manifest_path(out), manifest)
    return manifest


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


class Appender:
    """Answers appended to `out` in chunks (CHUNK_ROWS rows or CHUNK_SECONDS, each chunk one write
    flushed to disk), with a progress bar of `total` answers on stderr.

        with Appender(out, len(work), show=True, on_row=None) as add:
            ...add(row) for each answer as it is complete...
        appender.stats()   # new tokens, seconds, tokens/s
    """

    def __init__(
        self, out: Path, total: int, show: bool, on_row: Callable[[dict[str, Any]], None] | None
    ) -> None:
        self.out, self.on_row = out, on_row
        self.pending: list[str] = []
        self.chunk_rows = int(os.environ.get(faults.GENERATE_CHUNK_ENV) or CHUNK_ROWS)
        self.chunks = 0
        self.tokens = 0
        self.t0 = self.last = time.monotonic()
        self.seconds = 0.0
        self.bar = tqdm(
            total=total, desc="generate", unit="answer", file=sys.stderr, disable=not show, leave=True
        )

    def __enter__(self) -> Callable[[dict[str, Any]], None]:
        return self.add

    def __exit__(self, *exc: object) -> None:
        try:
            self.flush()
        finally:
            self.bar.close()
            self.seconds = time.monotonic() - self.t0

    def add(self, row: dict[str, Any]) -> None:
        self.pending.append(json.dumps(row, ensure_ascii=False) + "\n")
        self.tokens += len(row["token_ids"])
        self.bar.update(1)
        rate = self.tokens / max(time.monotonic() - self.t0, 1e-9)
        self.bar.set_postfix_str(f"{rate:,.0f} tok/s", refresh=False)
        if self.on_row is not None:
            self.on_row(row)
        if len(self.pending) >= self.chunk_rows or time.monotonic() - self.last > CHUNK_SECONDS:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        data = "".join(self.pending).encode()
        try:
            with open(self.out, "ab") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            raise UserError(
                f"{self.out}: cannot write ({e.strerror or e.__class__.__name__}); the answers written so far "
                "are kept: run the same command again to resume"
            ) from None
        self.pending.clear()
        self.last = time.monotonic()
        self.chunks += 1
        faults.at(f"generate.{self.chunks}")

    def stats(self) -> dict[str, Any]:
        return {
            "new_tokens": self.tokens,
            "seconds": round(self.seconds, 3),
            "tokens_per_s": round(self.tokens / max(self.seconds, 1e-9), 1),
        }


def _rewrite_in_order(out: Path, rows: list[dict[str, Any]]) -> None:
    """The answers in prompt order (a temp file renamed over `out`); nothing to do when they are."""
    order = [(r["index"], r["sample"]) for r in rows]
    if order == sorted(order):
        return
    rows = sorted(rows, key=lambda r: (r["index"], r["sample"]))
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise UserError(
            f"{out}: cannot write ({e.strerror or e.__class__.__name__}); rerun to finish"
        ) from None
