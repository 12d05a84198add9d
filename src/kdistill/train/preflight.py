"""Preflight: what a run checks before it reads data or loads a weight, from config files alone.

    device, dtype = resolve_device(cfg)
    teacher_spec, student_spec, tok, trim_rows = check_models(cfg, quiet)   # specs, tokenizer, vocab
    extras = check_teachers(cfg, tok, student_spec)                         # a mixture's other teachers
    cfg, layout = check_memory(cfg, teacher_spec, student_spec, device, quiet)   # refuse or auto-fit
    check_disk(cfg, teacher_spec, student_spec, run_dir)                    # checkpoints and export fit

Every check ends in a one-line UserError naming the field or file and what was expected.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
from pathlib import Path

import torch

from kdistill.config import RunConfig
from kdistill.dtypes import torch_dtype
from kdistill.errors import UserError
from kdistill.jsonio import short_repr
from kdistill.memory import (
    GIB,
    Layout,
    choose_layout,
    estimate_memory,
    fit_limits,
    fit_rollout_batch,
    projection_params,
    trainable_params,
)
from kdistill.models.hf_io import EXTRA_FILES, TOKENIZER_FILES
from kdistill.models.lora import check_lora
from kdistill.models.spec import ModelSpec, load_spec
from kdistill.models.tokenizer import Tokenizer, load_tokenizer
from kdistill.train import distributed as dist

log = logging.getLogger("kdistill")


def resolve_device(cfg: RunConfig) -> tuple[torch.device, torch.dtype]:
    """(device, compute dtype): bf16 on GPU and fp32 on CPU unless runtime.dtype says otherwise."""
    want = cfg.runtime.device
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    if want.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"runtime.device is '{want}', but no CUDA GPU is available (use runtime.device=cpu)")
    device = torch.device(want)
    if cfg.runtime.dtype == "auto":
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    else:
        dtype = torch_dtype(cfg.runtime.dtype)
    return device, dtype


def check_models(cfg: RunConfig, quiet: bool) -> tuple[ModelSpec, ModelSpec, Tokenizer, int | None]:
    """(teacher spec, student spec, tokenizer, teacher rows to trim to or None), from config.json and
    tokenizer.json alone: a teacher that is a model directory, one shared tokenizer, matching
    vocabularies and a seq_len both models support."""
    teacher_spec, student_spec = load_spec(cfg.teacher.path), load_spec(cfg.student.path)
    check_lora(cfg.student.lora, student_spec)  # a rank the student's linears can hold, before any plan
    if not Path(cfg.teacher.path).is_dir():
        raise UserError(
            f"teacher.path '{cfg.teacher.path}' is not a model directory: a run needs the teacher's weights "
            "and tokenizer.json (presets only describe shapes, for `kdistill plan`)"
        )
    tok = load_tokenizer(cfg.teacher.path)
    student_dir = Path(cfg.student.path)
    if cfg.kd.cross_tokenizer:
        return check_cross_tokenizer(cfg, teacher_spec, student_spec, tok)
    if student_dir.is_dir() and (student_dir / "tokenizer.json").exists():
        s_tok = load_tokenizer(student_dir)
        if s_tok.identity != tok.identity:
            raise UserError(
                f"{student_dir / 'tokenizer.json'}: tokenizer differs from the teacher's "
                f"({s_tok.identity[:12]} vs {tok.identity[:12]}): teacher and student must share a tokenizer"
            )
    trim_rows = check_vocab(tok.vocab_size, teacher_spec, student_spec)
    top, token = tok.largest_id()  # once, before training: every id must have an embedding row
    rows = min(student_spec.vocab_size, trim_rows or teacher_spec.vocab_size)
    if top >= rows:
        raise UserError(
            f"{tok.path}: token id {top} ({short_repr(token)}) is outside the models' embeddings "
            f"({rows} rows: student vocab_size {student_spec.vocab_size}, teacher {teacher_spec.vocab_size})"
        )
    if trim_rows is not None and cfg.kd.alpha > 0:
        log.info("teacher vocab %d trimmed to %d rows (padding)", teacher_spec.vocab_size, trim_rows)
        if not quiet:
            print(
                f"teacher embedding rows {teacher_spec.vocab_size} trimmed to {trim_rows} (padded vocabulary)"
            )
    if cfg.data.seq_len > student_spec.max_position_embeddings or (
        cfg.kd.alpha > 0 and cfg.data.seq_len > teacher_spec.max_position_embeddings
    ):
        limit = min(student_spec.max_position_embeddings, teacher_spec.max_position_embeddings)
        raise UserError(
            f"data.seq_len {cfg.data.seq_len} exceeds the models' max_position_embeddings ({limit})"
        )
    return teacher_spec, student_spec, tok, trim_rows


def check_cross_tokenizer(
    cfg: RunConfig, teacher_spec: ModelSpec, student_spec: ModelSpec, teacher_tok: Tokenizer
) -> tuple[ModelSpec, ModelSpec, Tokenizer, int | None]:
    """check_models for kd.cross_tokenizer: the data is tokenized with the student's own tokenizer
    (student.path must hold tokenizer.json); the teacher keeps its vocabulary (padding rows trimmed)."""
    student_dir = Path(cfg.student.path)
    if not (student_dir.is_dir() and (student_dir / "tokenizer.json").is_file()):
        raise UserError(
            f"kd.cross_tokenizer needs the student's tokenizer, but '{cfg.student.path}' has no tokenizer.json"
        )
    tok = load_tokenizer(student_dir)
    if student_spec.vocab_size < tok.vocab_size:
        raise UserError(
            f"student vocab_size {student_spec.vocab_size} is smaller than its tokenizer's vocabulary ({tok.vocab_size})"
        )
    limit = min(student_spec.max_position_embeddings, teacher_spec.max_position_embeddings)
    if cfg.data.seq_len > limit:
        raise UserError(
            f"data.seq_len {cfg.data.seq_len} exceeds the models' max_position_embeddings ({limit})"
        )
    trim = teacher_tok.vocab_size if teacher_spec.vocab_size > teacher_tok.vocab_size else None
    return teacher_spec, student_spec, tok, trim


def check_teachers(
    cfg: RunConfig, tok: Tokenizer, student_spec: ModelSpec
) -> list[tuple[ModelSpec, int | None]]:
    """The other teachers of a mixture (`teachers[1:]`): (spec, rows to trim to or None) each, after
    checking that each is a model directory with the first teacher's tokenizer and a vocabulary that
    covers the student's, and supports data.seq_len."""
    out = []
    for i, entry in enumerate(cfg.teachers[1:], start=1):
        where = f"teachers[{i}].path"
        if not Path(entry.path).is_dir():
            raise UserError(
                f"{where} '{entry.path}' is not a model directory (weights, config.json, tokenizer.json)"
            )
        spec = load_spec(entry.path)
        if not (Path(entry.path) / "tokenizer.json").is_file():
            raise UserError(
                f"{where} '{entry.path}' has no tokenizer.json: teachers must share the student's tokenizer"
            )
        theirs = load_tokenizer(entry.path)
        if theirs.identity != tok.identity:
            raise UserError(
                f"{Path(entry.path) / 'tokenizer.json'}: tokenizer differs from teachers[0]'s "
                f"({theirs.identity[:12]} vs {tok.identity[:12]}): every teacher must share one tokenizer"
            )
        trim = check_vocab(tok.vocab_size, spec, student_spec)
        if cfg.data.seq_len > spec.max_position_embeddings:
            raise UserError(
                f"data.seq_len {cfg.data.seq_len} exceeds {where}'s max_position_embeddings "
                f"({spec.max_position_embeddings})"
            )
        out.append((spec, trim))
    return out


def check_vocab(tok_vocab: int, teacher: ModelSpec, student: ModelSpec) -> int | None:
    """Rows to trim the teacher to (padded vocab), or None. Any other mismatch is an error."""
    if student.vocab_size < tok_vocab:
        raise UserError(
            f"student vocab_size {student.vocab_size} is smaller than the tokenizer's vocabulary ({tok_vocab})"
        )
    if teacher.vocab_size < student.vocab_size:
        raise UserError(
            f"teacher vocab_size {teacher.vocab_size} is smaller than the student's {student.vocab_size}: "
            "vocabularies must match (only teacher padding rows beyond the tokenizer are trimmed)"
        )
    if teacher.vocab_size > student.vocab_size:
        if student.vocab_size != tok_vocab and teacher.vocab_size != student.vocab_size:
            # Both padded, differently: the extra student rows would have no teacher target.
            log.info("student has %d padding rows beyond the tokenizer", student.vocab_size - tok_vocab)
        return student.vocab_size
    return None


def check_memory(
    cfg: RunConfig,
    teacher: ModelSpec,
    student: ModelSpec,
    device: torch.device,
    quiet: bool,
    extra_teachers: list[ModelSpec] | None = None,
) -> tuple[RunConfig, Layout]:
    """Compare the plan with the device's free memory (the GPU's, or the RAM a CPU run can still
    allocate) before loading anything: on a GPU resolve the auto choices (teacher placement,
    activation checkpointing: `memory.choose_layout`), then refuse, or with runtime.auto_fit lower
    schedule.batch_size until it fits (seq_len is never changed: the error names the largest seq_len
    that fits, for the user to choose); an on-policy run on a GPU first lowers kd.rollout_batch (the rows
    its decode engines write at once) when that alone fits. Under torchrun the plan is of one process's batch
    (batch_size / world), and the batch it fits to is a multiple of world. On a CPU `auto` means a
    sharded teacher and student (several processes; runtime.student_placement=replicate keeps both
    whole), no block checkpointing and the SwiGLU outputs recomputed."""
    world = dist.info().world
    per_process = cfg.schedule.batch_size // world
    gpu = device.type == "cuda"
    rt = cfg.runtime
    replicated = world > 1 and rt.student_placement == "replicate"
    layout = Layout.of(
        rt.activation_checkpointing,
        world,
        world > 1 and rt.teacher_placement != "replicate" and not replicated,
        world > 1 and rt.student_reshard == "after_backward" and not replicated,
        replicated,
    )
    if rt.gpu_memory_gib > 0:
        free: int | None = int(rt.gpu_memory_gib * GIB)
    elif gpu:
        free, _ = torch.cuda.mem_get_info(device)
    else:
        free = available_ram()
    if free is None:
        return cfg, layout
    budget = int(free * 0.95)
    kind = "cuda" if gpu else "cpu"
    extras = extra_teachers or []
    if gpu:
        layout = choose_layout(teacher, student, cfg, budget, world, per_process)
    need = estimate_memory(teacher, student, cfg, kind, per_process, layout, extra_teachers=extras)["total"]
    if need <= budget:
        return cfg, layout
    # on-policy on a GPU: fewer rows written at once (the engines' KV caches), before a smaller batch
    slots = fit_rollout_batch(teacher, student, cfg, budget, per_process, layout, extras) if gpu else None
    if cfg.runtime.auto_fit and slots is not None:
        if not quiet:
            now = cfg.kd.rollout_slots(per_process * cfg.schedule.grad_accum)
            print(
                f"runtime.auto_fit: kd.rollout_batch {now} -> {slots} "
                f"(plan {need / GIB:.1f} GiB > free {free / GIB:.1f} GiB)"
            )
        return dataclasses.replace(cfg, kd=dataclasses.replace(cfg.kd, rollout_batch=slots)), layout
    fit = fit_limits(teacher, student, cfg, budget, batch=per_process, layout=layout, extra_teachers=extras)
    fit_batch = fit["batch_size"] * world
    if cfg.runtime.auto_fit and fit_batch > 0:
        if not quiet:
            print(
                f"runtime.auto_fit: batch_size {cfg.schedule.batch_size} -> {fit_batch} "
                f"(plan {need / GIB:.1f} GiB > free {free / GIB:.1f} GiB)"
            )
        return dataclasses.replace(
            cfg, schedule=dataclasses.replace(cfg.schedule, batch_size=fit_batch)
        ), layout
    raise UserError(
        f"the plan needs {need / GIB:.1f} GiB per device ({layout.describe()}) but {free / GIB:.1f} GiB is "
        f"free: the largest that fit are schedule.batch_size={fit_batch} (at seq_len {cfg.data.seq_len}) or "
        f"data.seq_len={fit['seq_len']} (at batch {cfg.schedule.batch_size}); "
        + (f"or kd.rollout_batch={slots}; " if slots is not None else "")
        + "or set runtime.auto_fit=true"
    )


CHECKPOINT_EXTRA = 1 << 20  # a checkpoint's state.json (RNG states, data position) and tensor headers
EXPORT_EXTRA = 64 << 10  # an export's config.json, marker and tensor header


def disk_plan(
    cfg: RunConfig, student: ModelSpec, export_files: int = 0, teacher: ModelSpec | None = None
) -> dict[str, int]:
    """Bytes a run writes into output.dir at its largest, from the config alone: each checkpoint holds
    the student's fp32 weights (a LoRA student's adapters only) and AdamW's two fp32 moments of what
    trains (with kd.layer_map and the teacher's spec, its projections too: they are trained and
    checkpointed, not exported); the run writes one every schedule.checkpoint_every steps and one at the end, keeps
    output.keep_checkpoints of them, and writes the newest before the oldest is removed (so keep + 1
    exist at once); the export (the fp32 student, or a LoRA student's adapters, and `export_files`
    bytes of tokenizer files copied beside it) comes after the last checkpoint, beside the kept ones.
    Each also has a fixed allowance for its small files and headers (an upper bound: tests check it
    against a real run's files). Metrics, samples and the summary are small and not counted."""
    trainable = trainable_params(student, cfg)
    projections = projection_params(teacher, student, cfg) if teacher is not None else 0
    checkpoint = (trainable + projections) * 12 + CHECKPOINT_EXTRA
    export = trainable * 4 + export_files + EXPORT_EXTRA
    every, steps, keep = cfg.schedule.checkpoint_every, cfg.schedule.steps, cfg.output.keep_checkpoints
    written = (steps - 1) // every + 1 if every else 1
    at_once = min(written, keep + 1)
    need = max(at_once * checkpoint, min(written, keep) * checkpoint + export)
    return {"checkpoint": checkpoint, "at_once": at_once, "export": export, "total": need}


def _gib(n: int) -> str:
    return f"{n / GIB:.1f} GiB" if n >= GIB // 10 else f"{max(1, round(n / 1024))} KiB"


def _held(folder: Path) -> int:
    """Bytes of the files under `folder` (0 when it is not there)."""
    if not folder.is_dir():
        return 0
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def check_disk(cfg: RunConfig, teacher: ModelSpec, student: ModelSpec, run_dir: Path) -> None:
    """Refuse a run whose checkpoints and export cannot fit on output.dir's filesystem (`disk_plan`),
    before any weight is loaded: a run that would die at its first checkpoint, or at its export after
    all its steps, fails here instead. What the run directory already holds of checkpoints and an
    export (a resumed run) counts as free: the run rotates and replaces it. output.check_disk=false
    skips the check (a filesystem that reports no meaningful free space)."""
    if not cfg.output.check_disk:
        return
    source = Path(cfg.student.path if cfg.kd.cross_tokenizer else cfg.teacher.path)  # the export's tokenizer
    files = [source / name for name in (*TOKENIZER_FILES, *EXTRA_FILES)]
    plan = disk_plan(cfg, student, sum(f.stat().st_size for f in files if f.is_file()), teacher)
    where = Path(run_dir).absolute()
    while not where.exists() and where != where.parent:  # the filesystem the run directory will be on
        where = where.parent
    try:
        free = shutil.disk_usage(where).free
    except OSError:  # a filesystem that cannot say: nothing to check against
        return
    held = sum(_held(Path(run_dir) / name) for name in ("checkpoints", "student", "adapter"))
    if plan["total"] <= free + held:
        return
    keep = cfg.output.keep_checkpoints
    raise UserError(
        f"output.dir '{cfg.output.dir}': the run writes up to {_gib(plan['total'])} there "
        f"({plan['at_once']} checkpoint(s) of {_gib(plan['checkpoint'])} at once with "
        f"output.keep_checkpoints={keep}, then the {_gib(plan['export'])} export), but its filesystem has "
        f"{_gib(free + held)} free; free space, lower output.keep_checkpoints, choose another output.dir or "
        "set output.check_disk=false"
    )


def available_ram() -> int | None:
    """Bytes of RAM available to a new allocation (Linux MemAvailable), or None where unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_fp8_layout(cfg: RunConfig, teacher_sharded: bool) -> None:
    """teacher.precision=fp8 keeps a whole FP8 teacher per process: refused with a sharded teacher."""
    if teacher_sharded and cfg.teacher.precision == "fp8" and not cfg.teacher.cache:
        raise UserError(
            "teacher.precision=fp8 keeps a whole FP8 teacher on every process, but this run shards the "
            "teacher (runtime.teacher_placement): set runtime.teacher_placement=replicate"
        )
