"""`kdistill teacher-cache`: run the teacher once over a run's packed training rows (and the held-out rows
its evals read) and write its targets.

    kdistill teacher-cache run.yaml --out cache/ --mode exact             # all log-probs (bf16)
    kdistill teacher-cache run.yaml --out cache/ --mode topk --k 64       # top-k + remaining mass
    kdistill teacher-cache run.yaml --out cache/ --mode sampled --k 64    # k draws from p_T
    kdistill run run.yaml teacher.cache=cache/                            # trains without the teacher
    kdistill teacher-cache teacher.path=T student.path=S data.train=[d/] --out cache/   # no CONFIG file

The rows are those `kdistill run` packs from the same config (data, seq_len, tokenizer); the held-out
rows are those its evals read (schedule.eval_batches batches of schedule.batch_size). The layout and
the manifest are described in kdistill.teacher_cache and docs/teacher_cache.md. Running it again with
the same --out keeps the complete shards and writes the rest; held-out shards made for other held-out
rows (another eval_batches, batch_size or held-out data) are replaced, the training shards kept. A
teacher.path given as a Hugging Face name (org/name[@revision]) is read as `kdistill run` reads it.
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kdistill import teacher_cache as tc
from kdistill.commands.common import split_config_args
from kdistill.config import RunConfig, load_config
from kdistill.console import print_json, progress_bar
from kdistill.data.batches import take
from kdistill.errors import UserError
from kdistill.fileio import atomic_write_json, file_sha256, is_atomic_temp, write_guard
from kdistill.kernels import seal
from kdistill.models.hf_io import load_model
from kdistill.models.hub import resolve_run_models
from kdistill.outputs import MARKER, check_target, output_lock, read_output_marker, write_output_marker
from kdistill.train.loading import load_data
from kdistill.train.preflight import check_models, resolve_device


def teacher_cache_command(args: argparse.Namespace) -> int:
    """Build (or finish) the cache in --out for the run CONFIG describes."""
    config_path, overrides = split_config_args(args.config, args.overrides)
    cfg = load_config(config_path, overrides)
    cfg = dataclasses.replace(cfg, teacher=dataclasses.replace(cfg.teacher, cache=""))
    cfg.validate()
    if cfg.teachers:
        raise UserError(
            "teachers: a teacher cache holds one teacher's targets and a run refuses teacher.cache with "
            "teachers; give the one teacher as teacher.path"
        )
    resolve_run_models(cfg)  # a Hub name in teacher.path (or student.path): its cached snapshot
    summary = build_cache(cfg, Path(args.out), args.mode, args.k, args.shard_rows, quiet=args.quiet)
    if args.json:
        print_json(summary)
    else:
        print(
            f"teacher cache {args.out}: {summary['rows']} rows x {summary['seq_len']} tokens and "
            f"{summary['heldout_rows']} held-out rows, mode {summary['mode']}, "
            f"{summary['bytes_per_token']:.1f} bytes per token"
        )
    return 0


def build_cache(
    cfg: RunConfig, out: Path, mode: str, k: int, shard_rows: int, *, quiet: bool = False
) -> dict[str, Any]:
    """Write every missing shard of the cache in `out` (training rows, then the held-out rows the run's
    evals read); return a summary (rows, bytes per token of the training part, held-out rows)."""
    if mode not in tc.MODES:
        raise UserError(f"--mode is '{mode}', expected one of: {', '.join(tc.MODES)}")
    if shard_rows < 1:
        raise UserError(f"--shard-rows is {shard_rows}, expected a positive integer")
    check_cache_target(cfg, out)
    teacher_spec, student_spec, tok, trim_rows = check_models(cfg, quiet=True)
    vocab = student_spec.vocab_size
    if mode != "exact" and not 0 < k < vocab:
        raise UserError(f"--k is {k}, expected an integer in [1, {vocab - 1}] for --mode {mode}")
    device, dtype = resolve_device(cfg)
    data = load_data(cfg, tok)
    want = tc.run_identity(cfg, tok.identity, data.train, data.heldout)
    manifest = tc.make_manifest(
        **{f: want[f] for f in ("teacher", "tokenizer", "data", "seq_len", "temperature", "heldout")},
        mode=mode, k=k if mode != "exact" else 0, vocab=vocab, rows=len(data.train), shard_rows=shard_rows,
    )  # fmt: skip
    with output_lock(out), write_guard(out, what="write the teacher cache", intact=INTACT):
        todo = write_cache(
            cfg, out, manifest, want, data, teacher_spec, trim_rows, k, vocab, device, dtype, quiet
        )

    def size(shards: list[dict[str, Any]]) -> int:
        return sum(f.stat().st_size for s in shards for f in (out / s["name"]).glob("*.npy"))

    train_bytes = size(manifest["shards"])
    tokens = manifest["rows"] * manifest["seq_len"]
    return {**{k_: manifest[k_] for k_ in ("rows", "seq_len", "mode", "k")}, "bytes": train_bytes,
            "bytes_per_token": train_bytes / max(tokens, 1), "heldout_rows": manifest["heldout"]["rows"],
            "heldout_bytes": size(manifest["heldout"]["shards"]), "written_shards": len(todo)}  # fmt: skip


# What a write fault leaves: the shards renamed into place are complete and kept.
INTACT = "complete shards are kept: run kdistill teacher-cache again with the same --out to finish"


def is_cache(path: Path) -> bool:
    """A folder holding a teacher cache (its manifest names a mode): one kdistill wrote, with or without
    the output marker (caches written before markers existed)."""
    try:
        return tc.read_manifest(path).get("mode") in tc.MODES
    except UserError:
        return False


def check_cache_target(cfg: RunConfig, out: Path) -> None:
    """--out must be absent, empty or a teacher cache, and none of the run's inputs (the teachers, the
    student, the data files); else one line, before the teacher is loaded."""
    inputs = [
        ("teacher.path", cfg.teacher.path),
        ("student.path", cfg.student.path),
        *(("data.train", f) for f in cfg.data.train),
        *(("data.heldout", f) for f in cfg.data.heldout),
    ]
    check_target(out, KIND, inputs=inputs, legacy=is_cache)


def clean_temps(out: Path) -> None:
    """Remove what a killed writer left in the cache folder: shard temp folders, temp manifests and the
    output marker's temp file (the caller holds the lock: no live writer owns them)."""
    for p in out.glob("*.tmp"):
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        elif is_atomic_temp(p, MARKER):
            p.unlink(missing_ok=True)
    for p in out.glob(".manifest.json.*.tmp"):
        p.unlink(missing_ok=True)


def write_cache(
    cfg: RunConfig, out: Path, manifest: dict[str, Any], want: dict[str, Any], data: Any, teacher_spec: Any,
    trim_rows: Any, k: int, vocab: int, device: torch.device, dtype: torch.dtype, quiet: bool,
) -> list[Any]:  # fmt: skip
    """Under the cache's lock: write every missing shard of `manifest` into `out` and mark it complete;
    returns the shards written."""
    mode = manifest["mode"]
    out.mkdir(parents=True, exist_ok=True)
    clean_temps(out)
    if read_output_marker(out) != KIND:
        write_output_marker(out, KIND)
    if (out / "manifest.json").is_file():
        old = tc.read_manifest(out)
        tc.check_manifest(old, want, f"--out {out}")
        for field in ("mode", "k", "shard_rows", "rows"):
            if old.get(field) != manifest[field]:
                raise UserError(
                    f"--out {out}: holds a cache with {field}={old.get(field)}, asked for {manifest[field]} "
                    "(use another --out)"
                )
        old_held = old.get("heldout")
        if (
            not isinstance(old_held, dict)
            or {**old_held, "shards": tc.without_sums(old_held.get("shards"))} != (manifest["heldout"])
        ):
            # other held-out rows (eval_batches, batch_size or held-out data): before the new manifest
            # lists shards of the same names, so that no old shard passes for a complete new one
            drop_heldout_shards(out)
        else:
            carry_sums(old_held.get("shards"), manifest["heldout"]["shards"])
        carry_sums(old.get("shards"), manifest["shards"])
    atomic_write_json(out / "manifest.json", manifest)
    todo = [(s, False) for s in manifest["shards"] if not tc.shard_complete(out, s["name"], mode)]
    todo += [
        (s, True)
        for s in manifest["heldout"]["shards"]
        if not tc.shard_complete(out, s["name"], mode, heldout=True)
    ]
    total = manifest["rows"] + manifest["heldout"]["rows"]
    if todo:
        seal.start(cfg, teacher_spec, teacher_spec, device, dtype, quiet=True, batch=cfg.schedule.batch_size,
                   documents=data.documents)  # fmt: skip
        teacher = load_model(cfg.teacher.path, device=device, dtype=dtype, vocab_rows=trim_rows)
        teacher.eval().requires_grad_(False)
        left = sum(s["stop"] - s["start"] for s, _ in todo)
        bar = progress_bar(total=total, initial=total - left, desc="teacher-cache", disable=quiet)
        for s, held in todo:
            rows = data.heldout if held else data.train
            arrays = shard_targets(
                teacher, rows, s["start"], s["stop"], cfg, mode, k, vocab, device, bar, heldout=held
            )
            s["sha256"] = tc.write_shard(out, s["name"], arrays)
            atomic_write_json(out / "manifest.json", manifest)  # the shard's sums, kept if killed later
        bar.close()
    for s in [*manifest["shards"], *manifest["heldout"]["shards"]]:
        if "sha256" not in s:  # complete shards of a cache written before sums were recorded
            s["sha256"] = {
                f"{a}.npy": file_sha256(out / s["name"] / f"{a}.npy")
                for a in tc.arrays_of(mode, s["name"].startswith(tc.HELDOUT_PREFIX))
            }
    manifest["complete"] = True
    atomic_write_json(out / "manifest.json", manifest)
    return todo


def carry_sums(old: Any, new: list[dict[str, Any]]) -> None:
    """The sha256s an earlier manifest recorded for shards of the same name and rows."""
    if not isinstance(old, list):
        return
    by_name = {s.get("name"): s for s in old if isinstance(s, dict)}
    for s in new:
        o = by_name.get(s["name"])
        if (
            o
            and o.get("start") == s["start"]
            and o.get("stop") == s["stop"]
            and isinstance(o.get("sha256"), dict)
        ):
            s["sha256"] = o["sha256"]


def drop_heldout_shards(out: Path) -> None:
    """Remove the held-out shards (complete or not) of the cache in `out`; its training shards stay."""
    for path in sorted(out.glob(f"{tc.HELDOUT_PREFIX}-*")):
        if path.is_dir():
            shutil.rmtree(path)


KIND = "teacher-cache"  # the output marker's kind

# Added to the sampling seed of a held-out shard: its draws are not those of the training shard that
# starts at the same row.
HELDOUT_SEED = 1 << 40


@torch.no_grad()
def shard_targets(
    teacher: Any, rows: Any, start: int, stop: int, cfg: RunConfig, mode: str, k: int, vocab: int,
    device: torch.device, bar: Any, *, heldout: bool = False,
) -> dict[str, np.ndarray]:  # fmt: skip
    """The arrays of rows [start, stop) of `rows` (data.train, or data.heldout with `heldout`): teacher
    forward per batch, targets per chunk of tokens. Training rows: targets at kd.temperature (exact:
    T = 1 log-probs). Held-out rows: at T = 1, the held-out eval's temperature, plus `label`, the
    teacher's log-prob of each label (0 where the label is ignored)."""
    temperature = 1.0 if heldout else cfg.kd.temperature
    parts: dict[str, list[np.ndarray]] = {a: [] for a in tc.arrays_of(mode, heldout)}
    # sampled: one generator per shard, seeded by (seed, shard start): the draws do not depend on order
    gen = torch.Generator().manual_seed(
        cfg.schedule.seed * 1_000_003 + start + (HELDOUT_SEED if heldout else 0)
    )
    weight = teacher.lm_head_weight[:vocab]
    for b0 in range(start, stop, cfg.schedule.batch_size):
        b1 = min(stop, b0 + cfg.schedule.batch_size)
        input_ids, labels, *docs = (t.to(device) for t in take(rows, slice(b0, b1)))
        hidden = teacher(input_ids, *docs)  # (B, T, Ht)
        shape = hidden.shape[:2]
        flat, flat_labels = hidden.flatten(0, 1), labels.flatten()
        chunks: dict[str, list[torch.Tensor]] = {a: [] for a in parts}
        for c0 in range(0, flat.shape[0], cfg.kd.chunk_size):
            logits = flat[c0 : c0 + cfg.kd.chunk_size].float() @ weight.float().t()  # (c, V) fp32
            got = chunk_targets(logits, mode, k, temperature, gen)
            if heldout:
                got["label"] = label_logp(
                    logits, flat_labels[c0 : c0 + cfg.kd.chunk_size], cfg.kd.ignore_index
                )
            for key, val in got.items():
                chunks[key].append(val)
        for key, vals in chunks.items():
            t = torch.cat(vals).reshape(*shape, *vals[0].shape[1:])
            parts[key].append(tc.bf16_bits(t) if (mode == "exact" and key == "logp") else t.cpu().numpy())
        bar.update(b1 - b0)
    return {key: np.concatenate(v) for key, v in parts.items()}


def label_logp(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """(c,) fp32 log softmax(logits)[label] at T = 1 of a (c, V) chunk; 0 where the label is ignored."""
    valid = labels != ignore_index
    picked = logits.gather(1, labels.clamp(0, logits.shape[1] - 1).unsqueeze(1)).squeeze(1)
    return torch.where(valid, picked - torch.logsumexp(logits, dim=-1), torch.zeros_like(picked))


def chunk_targets(
    logits: torch.Tensor, mode: str, k: int, temperature: float, gen: torch.Generator
) -> dict[str, torch.Tensor]:
    """Targets of a (c, V) chunk of teacher logits: exact log-probs at T = 1, or sparse ones at T."""
    if mode == "exact":
        return {"logp": torch.log_softmax(logits, dim=-1)}
    logp = torch.log_softmax(logits / temperature, dim=-1)  # (c, V)
    if mode == "topk":
        vals, ids = logp.topk(k, dim=-1)
        rest = torch.logsumexp(logp.scatter(1, ids, float("-inf")), dim=-1)  # log of the remaining mass
        return {"ids": ids.to(torch.int32), "logp": vals, "rest": rest}
    ids = torch.multinomial(logp.exp().cpu(), k, replacement=True, generator=gen).to(logp.device)  # (c, k)
    return {"ids": ids.to(torch.int32), "logp": logp.gather(1, ids)}
