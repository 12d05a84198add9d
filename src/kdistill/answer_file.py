"""Teacher-written data: `kdistill generate --out answers.jsonl`, resumable, with a manifest.

    kdistill generate --model TEACHER --messages prompts.jsonl --out answers.jsonl --samples-per-prompt 4

Each line of the output is one answer (answer_row in kdistill.generate): for conversations, the
conversation with the model's answer appended as an assistant turn ({"messages": [...]}, the format
`kdistill run` trains on), for plain prompts {"prompt", "completion"}; with "index" (the prompt's line),
"sample", "finish_reason" and the new "token_ids".

Resumable: answers are appended in chunks as they finish (each chunk one write, flushed to disk), so a
killed process loses at most the chunk it was writing; a torn last line is dropped on the next start,
which answers only what is missing. When every answer is written, the file is rewritten in prompt order
(a temp file renamed over it). Beside it, `answers.jsonl.manifest.json` records the model, the
prompts' sha256, the sampling settings and seed, and the progress; a second start with other settings is
refused in one line (greedy answers of a resumed file equal an uninterrupted run's; sampled ones are
valid samples, not the same draws). An existing file without a manifest is not kdistill's and is never
touched. One process per output file (a lock beside it).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from kdistill import __version__
from kdistill.decode import Sampling
from kdistill.errors import UserError
from kdistill.generate import Job, build_engine, check_kernel_pack, prepare_job, resolve_device, run_job
from kdistill.kernels.seal import jit_after_prewarm
from kdistill.outputs import output_lock
from kdistill.train import faults

KIND = "kdistill-generate"
GREEDY = Sampling()
CHUNK_ROWS = 64  # answers per append
CHUNK_SECONDS = 10.0  # or this long since the last append


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


def _settings(
    job: Job, sampling: Sampling, samples: int, max_length: int | None, chat: bool
) -> dict[str, Any]:
    digest = hashlib.sha256()
    for row in job.ids:
        digest.update(json.dumps(row).encode())
        digest.update(b"\n")
    return {
        "model": str(job.model_dir.resolve()),
        "prompts": len(job.ids),
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
        except ValueError:
            raise UserError(f"{out}:{n}: not a JSON answer line (the file was changed by hand?)") from None
        if (
            not isinstance(row, dict)
            or not isinstance(row.get("index"), int)
            or not isinstance(row.get("sample"), int)
        ):
            raise UserError(f'{out}:{n}: expected an answer with integer "index" and "sample"')
        rows.append(row)
        good = end
    return rows, good


def generate_to_file(
    model_dir: str | Path,
    out: str | Path,
    *,
    prompts: tuple[str, ...] | list[str] = (),
    messages_file: str | Path | None = None,
    chat: bool = False,
    sampling: Sampling = GREEDY,
    samples_per_prompt: int = 1,
    device: str = "auto",
    batch_size: int = 32,
    max_length: int | None = None,
    progress: bool = True,
    on_row: Any = None,
    kernel_pack: str | Path | None = None,
) -> dict[str, Any]:
    """Answer every prompt into `out` (resuming an earlier start); returns the final manifest.
    kernel_pack: a kernel pack folder the decode kernels are loaded from on a GPU (checked before
    anything is read or written)."""
    out = Path(out)
    if (
        isinstance(samples_per_prompt, bool)
        or not isinstance(samples_per_prompt, int)
        or samples_per_prompt < 1
    ):
        raise UserError(f"--samples-per-prompt is {samples_per_prompt!r}, expected an integer >= 1")
    if out.is_dir():
        raise UserError(f"--out '{out}' is a directory, expected a .jsonl file path")
    if not out.parent.is_dir():
        raise UserError(f"--out '{out}': its directory does not exist")
    pack = check_kernel_pack(kernel_pack, resolve_device(device))
    job = prepare_job(model_dir, prompts=prompts, messages_file=messages_file, chat=chat)
    settings = _settings(job, sampling, samples_per_prompt, max_length, chat)
    with output_lock(out):  # one process per output file
        for stale in [
            *out.parent.glob(f".{out.name}.tmp-*"),
            *out.parent.glob(f".{out.name}.manifest.json.tmp-*"),
        ]:
            stale.unlink(missing_ok=True)  # a killed start's rewrite or manifest, never renamed
        return _generate_locked(job, out, settings, sampling, samples_per_prompt, device, batch_size,
                                max_length, progress, on_row, pack)  # fmt: skip


def _generate_locked(
    job: Job,
    out: Path,
    settings: dict[str, Any],
    sampling: Sampling,
    samples: int,
    device: str,
    batch_size: int,
    max_length: int | None,
    progress: bool,
    on_row: Any,
    pack: str | None,
) -> dict[str, Any]:
    mpath = manifest_path(out)
    manifest: dict[str, Any] | None = None
    if mpath.exists():
        try:
            manifest = json.loads(mpath.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            raise UserError(f"{mpath}: unreadable manifest; move it and {out} aside to start again") from None
        if not isinstance(manifest, dict) or manifest.get("kind") != KIND:
            raise UserError(f"{mpath}: not a kdistill generate manifest")
        for k, v in settings.items():
            if manifest.get(k) != v:
                raise UserError(
                    f"--out {out} was written with other settings ({k}: {json.dumps(manifest.get(k))}, now "
                    f"{json.dumps(v)}): use another --out, or the same settings to resume"
                )
    elif out.exists():
        raise UserError(
            f"--out {out} exists and was not written by kdistill generate (no {mpath.name}): choose another path"
        )
    rows, good = read_rows(out)
    if out.exists() and good < out.stat().st_size:  # drop a torn last line
        with open(out, "r+b") as f:
            f.truncate(good)
    done = {(r["index"], r["sample"]) for r in rows}
    work = [(i, j) for i in range(len(job.ids)) for j in range(samples) if (i, j) not in done]
    manifest = {"kind": KIND, "kdistill": __version__, **settings, "rows": len(job.ids) * samples}
    manifest.update(written=len(done), status="running" if work else "complete")
    _write_json_atomic(mpath, manifest)
    if work:
        manifest.update(
            _answer(job, out, work, sampling, device, batch_size, max_length, progress, on_row, pack)
        )
        rows, _ = read_rows(out)
        _rewrite_in_order(out, rows)
        manifest.update(written=len(rows), status="complete")
        _write_json_atomic(mpath, manifest)
    return manifest


def _answer(
    job: Job,
    out: Path,
    work: list[tuple[int, int]],
    sampling: Sampling,
    device: str,
    batch_size: int,
    max_length: int | None,
    show: bool,
    on_row: Any,
    pack: str | None,
) -> dict[str, Any]:
    engine, info = build_engine(
        job, sampling, device=device, batch_size=batch_size, max_length=max_length, kernel_pack=pack
    )
    pending: list[str] = []
    chunk_rows = int(os.environ.get(faults.GENERATE_CHUNK_ENV) or CHUNK_ROWS)
    chunks = [0]
    last = [time.monotonic()]
    tokens = [0]
    t0 = time.monotonic()
    bar = tqdm(total=len(work), desc="generate", unit="answer", file=sys.stderr, disable=not show, leave=True)

    def flush() -> None:
        if not pending:
            return
        data = "".join(pending).encode()
        try:
            with open(out, "ab") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            raise UserError(
                f"{out}: cannot write ({e.strerror or e.__class__.__name__}); the answers written so far "
                "are kept: run the same command again to resume"
            ) from None
        pending.clear()
        last[0] = time.monotonic()
        chunks[0] += 1
        faults.at(f"generate.{chunks[0]}")

    def row_done(row: dict[str, Any]) -> None:
        pending.append(json.dumps(row, ensure_ascii=False) + "\n")
        tokens[0] += len(row["token_ids"])
        bar.update(1)
        bar.set_postfix_str(f"{tokens[0] / max(time.monotonic() - t0, 1e-9):,.0f} tok/s", refresh=False)
        if on_row is not None:
            on_row(row)
        if len(pending) >= chunk_rows or time.monotonic() - last[0] > CHUNK_SECONDS:
            flush()

    try:
        run_job(job, engine, work, on_row=row_done)
    finally:
        flush()
        bar.close()
    seconds = time.monotonic() - t0
    return {
        "jit_after_prewarm": jit_after_prewarm(),
        "device": info.get("arch") if info.get("mode") == "triton" else str(engine.device),
        "batch_size": info["batch"],
        "cache_length": info["max_len"],
        "new_tokens": tokens[0],
        "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens[0] / max(seconds, 1e-9), 1),
    }


def _rewrite_in_order(out: Path, rows: list[dict[str, Any]]) -> None:
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
