"""`kdistill run`: distil a teacher into a student, top to bottom.

    kdistill run                                   # the embedded demo (CPU, offline, < 3 minutes)
    kdistill run run.yaml kd.temperature=2         # a config plus dotted overrides
    kdistill run --resume runs/a                   # continue exactly where runs/a stopped

The run: config -> plan and memory check -> kernels prewarmed and sealed (GPU) -> teacher and student
loaded -> steps (teacher forward without grad, student forward, chunked KD loss, backward, AdamW)
with a progress bar, metrics.jsonl, held-out evals and atomic checkpoints -> the student exported as
a Hugging Face directory, summary.json and loss.png.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import math
import os
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
import yaml

from kdistill.config import RunConfig, load_config
from kdistill.errors import UserError
from kdistill.models.decoder import Decoder, build_decoder
from kdistill.models.spec import ModelSpec, load_spec
from kdistill.train import checkpoint as ckpt
from kdistill.train import distributed as dist
from kdistill.train.evidence import (
    MetricsWriter,
    make_manifest,
    plot_comparison,
    plot_losses,
    read_metrics,
    smoke_contract,
    write_json,
)
from kdistill.train.optim import lr_at, make_optimizer

log = logging.getLogger("kdistill")

# Test hooks (tests/test_resume*.py, test_signals.py): KDISTILL_TEST_KILL_AT names points at which the
# process signals itself ("SIGNAL@POINT,..."; a bare POINT means SIGKILL). Points: "S" after step S's
# metrics line, "S.M" after micro-batch M's backward of step S, "S.saved" after the checkpoint of step S.
# KDISTILL_TEST_NAN_STEPS="3,4" makes the loss of those steps non-finite.
_KILL_ENV, _NAN_ENV = "KDISTILL_TEST_KILL_AT", "KDISTILL_TEST_NAN_STEPS"


def _test_hook(point: str) -> None:
    spec = os.environ.get(_KILL_ENV)
    if not spec:
        return
    for item in spec.split(","):
        name, _, at = item.rpartition("@")
        if at == point:
            os.kill(os.getpid(), signal.Signals[name or "SIGKILL"])


# ----------------------------------------------------------------------------------------------
# Set-up helpers
# ----------------------------------------------------------------------------------------------
def resolve_device(cfg: RunConfig) -> tuple[torch.device, torch.dtype]:
    """(device, compute dtype): bf16 on GPU and fp32 on CPU unless runtime.dtype says otherwise."""
    want = cfg.runtime.device
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    if want.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"runtime.device is '{want}', but no CUDA GPU is available (use runtime.device=cpu)")
    device = torch.device(want)
    names = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if cfg.runtime.dtype == "auto":
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    else:
        dtype = names[cfg.runtime.dtype]
    return device, dtype


def expand_data_paths(paths: list[str]) -> list[str]:
    """'stdlib:train' / 'stdlib:heldout' name the demo corpus; other entries pass through."""
    out: list[str] = []
    for p in paths:
        if p in ("stdlib:train", "stdlib:heldout"):
            from kdistill.demo.corpus import stdlib_split

            train, heldout = stdlib_split()
            out.extend(str(f) for f in (train if p.endswith("train") else heldout))
        else:
            out.append(p)
    return out


def prepare_output(run_dir: Path, overwrite: bool) -> None:
    """Refuse to clobber an existing run; check the folder is writable before any work."""
    if run_dir.exists() and not run_dir.is_dir():
        raise UserError(f"output.dir '{run_dir}' is a file, expected a directory")
    if run_dir.is_dir() and any(run_dir.iterdir()):
        holds_run = (run_dir / "manifest.json").exists() or (run_dir / "checkpoints").exists()
        if holds_run and not overwrite:
            raise UserError(
                f"output.dir '{run_dir}' already holds a run: use --resume {run_dir} to continue it, "
                "--overwrite to replace it, or another output.dir"
            )
        if holds_run:
            shutil.rmtree(run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / ".write-probe"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise UserError(f"output.dir '{run_dir}' is not writable ({e.strerror or e})") from None


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


def init_from_teacher_layers(student: Decoder, teacher: Decoder) -> None:
    """Copy evenly spaced teacher layers (and embeddings, norm, head) into the student."""
    s, t = student.spec, teacher.spec
    for field in (
        "hidden_size",
        "intermediate_size",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "attention_bias",
        "qk_norm",
    ):
        if getattr(s, field) != getattr(t, field):
            raise UserError(
                f"student.init=teacher_layers needs equal {field} (student {getattr(s, field)}, "
                f"teacher {getattr(t, field)})"
            )
    picks = [round(i * (t.num_layers - 1) / max(1, s.num_layers - 1)) for i in range(s.num_layers)]
    with torch.no_grad():
        rows = s.vocab_size
        student.model.embed_tokens.weight.copy_(teacher.model.embed_tokens.weight[:rows])
        student.model.norm.weight.copy_(teacher.model.norm.weight)
        if not s.tie_word_embeddings:
            student.lm_head.weight.copy_(teacher.lm_head_weight[:rows])
        for dst, src in zip(student.model.layers, picks):
            dst.load_state_dict(teacher.model.layers[src].state_dict())
    log.info("student initialised from teacher layers %s", picks)


class SignalGuard:
    """First SIGTERM/SIGINT: finish the step, checkpoint, exit 0. Second: exit at once."""

    def __init__(self) -> None:
        self.requested: str | None = None
        self._old: dict[int, Any] = {}

    def _handler(self, signum: int, frame: Any) -> None:
        if self.requested is not None:
            sys.stderr.write("\nkdistill: second signal, exiting now\n")
            os._exit(130)
        self.requested = signal.Signals(signum).name
        sys.stderr.write(
            f"\nkdistill: {self.requested} received: finishing this step and saving a checkpoint\n"
        )

    def __enter__(self) -> SignalGuard:
        for s in (signal.SIGTERM, signal.SIGINT):
            try:
                self._old[s] = signal.signal(s, self._handler)
            except ValueError:  # not the main thread
                pass
        return self

    def __exit__(self, *exc: Any) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)


# ----------------------------------------------------------------------------------------------
# Loss and evaluation
# ----------------------------------------------------------------------------------------------
def head_operands(hidden: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The KD head's GEMM operands: under autocast both go to the autocast dtype, as every other
    linear of the model does (fp32 master weights would otherwise make the lm_head GEMMs fp32). The
    head still accumulates logits and the lm_head gradient in fp32."""
    dev = hidden.device.type
    if torch.is_autocast_enabled(dev):
        dt = torch.get_autocast_dtype(dev)
        return hidden.to(dt), weight.to(dt)
    return hidden, weight


def compute_loss(
    student: Decoder,
    teacher: Decoder | None,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    cfg: RunConfig,
    amp: contextlib.AbstractContextManager,
):
    """Teacher forward (no grad), student forward, chunked KD loss. Returns a KDLossResult."""
    from kdistill.kernels.kd import kd_chunk
    from kdistill.ops.kd_loss import kd_loss

    kd = cfg.kd
    t_hidden, t_weight = None, None
    if teacher is not None and kd.alpha > 0:
        with torch.no_grad(), amp:
            t_hidden = teacher(input_ids).flatten(0, 1)  # (N, Ht)
        t_weight = teacher.lm_head_weight
    with amp:
        s_hidden = student(input_ids).flatten(0, 1)  # (N, Hs)
        s_hidden, s_weight = head_operands(s_hidden, student.lm_head_weight)
        if t_hidden is not None:
            t_hidden, t_weight = head_operands(t_hidden, t_weight)
    return kd_loss(
        s_hidden,
        s_weight,
        t_hidden,
        t_weight,
        labels.flatten(),
        alpha=kd.alpha,
        temperature=kd.temperature,
        divergence=kd.divergence,
        beta=kd.beta,
        ignore_index=kd.ignore_index,
        chunk_size=kd.chunk_size,
        chunk_fn=kd_chunk,
    )


@torch.no_grad()
def heldout_eval(
    student: Decoder,
    teacher: Decoder | None,
    batches: list,
    cfg: RunConfig,
    device: torch.device,
    amp: contextlib.AbstractContextManager,
    with_teacher_loss: bool,
) -> dict[str, float]:
    """Token-weighted held-out CE of the student, KL(teacher || student) at T=1, and teacher CE."""
    from kdistill.kernels.kd import kd_chunk
    from kdistill.ops.kd_loss import kd_loss

    tot = {"student": 0.0, "kl": 0.0, "teacher": 0.0}
    tokens = 0
    for input_ids, labels in batches:
        input_ids, labels = input_ids.to(device), labels.to(device)
        flat = labels.flatten()
        with amp:
            s_h, s_w = head_operands(student(input_ids).flatten(0, 1), student.lm_head_weight)
            t_h, t_w = None, None
            if teacher is not None:
                t_h, t_w = head_operands(teacher(input_ids).flatten(0, 1), teacher.lm_head_weight)
        common = dict(
            temperature=1.0,
            divergence="forward_kl",
            ignore_index=cfg.kd.ignore_index,
            chunk_size=cfg.kd.chunk_size,
            chunk_fn=kd_chunk,
        )
        if t_h is not None:
            r = kd_loss(s_h, s_w, t_h, t_w, flat, alpha=0.5, **common)
            tot["kl"] += float(r.kd) * r.tokens
            if with_teacher_loss:
                rt = kd_loss(t_h, t_w, None, None, flat, alpha=0.0, **common)
                tot["teacher"] += float(rt.ce) * rt.tokens
        else:
            r = kd_loss(s_h, s_w, None, None, flat, alpha=0.0, **common)
        tot["student"] += float(r.ce) * r.tokens
        tokens += r.tokens
    n = max(tokens, 1)
    out = {"student_loss": tot["student"] / n, "tokens": tokens}
    if teacher is not None:
        out["kl_to_teacher"] = tot["kl"] / n
        if with_teacher_loss:
            out["teacher_loss"] = tot["teacher"] / n
    return out


# ----------------------------------------------------------------------------------------------
# The run
# ----------------------------------------------------------------------------------------------
def train(
    cfg: RunConfig, run_dir: Path, *, resume: bool = False, quiet: bool = False, label: str = "kdistill"
) -> dict[str, Any]:
    """Run (or resume) one distillation into run_dir and return its summary."""
    from kdistill.models.checkpoint import has_weights, load_model, save_model
    from kdistill.models.tokenizer import load_tokenizer
    from kdistill.train.data import Batcher, check_batch, heldout_batches, prepare_data

    t_start = time.time()
    device, dtype = resolve_device(cfg)
    multi = dist.active()  # torchrun with several processes: FSDP2, a slice of each batch per process
    if multi:
        rows = dist.batch_slice(cfg.schedule.batch_size)
        if dist.info().device is not None:
            device = dist.info().device
        quiet = quiet or not dist.is_main()
    amp: Any = (
        torch.autocast("cuda", dtype=dtype)
        if device.type == "cuda" and dtype != torch.float32
        else contextlib.nullcontext()
    )
    seed = cfg.schedule.seed
    torch.manual_seed(seed)

    def stage(msg: str) -> None:
        if not quiet:
            print(f"[{time.time() - t_start:6.1f}s] {msg}", file=sys.stderr, flush=True)

    # -- plan: specs from config.json alone, tokenizers, vocab ------------------------------------
    teacher_spec, student_spec = load_spec(cfg.teacher.path), load_spec(cfg.student.path)
    if not Path(cfg.teacher.path).is_dir():
        raise UserError(
            f"teacher.path '{cfg.teacher.path}' is not a model directory: a run needs the teacher's weights "
            "and tokenizer.json (presets only describe shapes, for `kdistill plan`)"
        )
    tok = load_tokenizer(cfg.teacher.path)
    student_dir = Path(cfg.student.path) if Path(cfg.student.path).is_dir() else None
    if student_dir is not None and (student_dir / "tokenizer.json").exists():
        s_tok = load_tokenizer(student_dir)
        if s_tok.identity != tok.identity:
            raise UserError(
                f"{student_dir / 'tokenizer.json'}: tokenizer differs from the teacher's "
                f"({s_tok.identity[:12]} vs {tok.identity[:12]}): teacher and student must share a tokenizer"
            )
    trim_rows = check_vocab(tok.vocab_size, teacher_spec, student_spec)
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
    if device.type == "cuda":
        cfg = check_memory(cfg, teacher_spec, student_spec, device, quiet)

    data_cfg = dataclasses.replace(
        cfg.data, train=expand_data_paths(cfg.data.train), heldout=expand_data_paths(cfg.data.heldout)
    )
    # The held-out split does not depend on the training seed, so runs stay comparable.
    if multi:
        with dist.main_first():  # rank 0 fills the token cache, the others read it
            data = prepare_data(data_cfg, tok, seed=0)
    else:
        data = prepare_data(data_cfg, tok, seed=0)
    stage(f"data: {len(data.train)} train and {len(data.heldout)} held-out sequences of {cfg.data.seq_len}")

    # -- kernels: compiled and sealed before any weight is on the GPU -----------------------------
    kernels = setup_kernels(cfg, teacher_spec, student_spec, device, dtype, quiet)

    # -- load -------------------------------------------------------------------------------------
    # The teacher is loaded even at alpha=0: held-out evals report its loss and the KL to it.
    teacher = load_model(cfg.teacher.path, device=device, dtype=dtype, vocab_rows=trim_rows)
    teacher.eval().requires_grad_(False)
    init = cfg.student.init
    if init == "auto":
        init = "pretrained" if student_dir is not None and has_weights(student_dir) else "random"
    if init == "pretrained":
        if student_dir is None or not has_weights(student_dir):
            raise UserError(f"student.init=pretrained but '{cfg.student.path}' holds no weights")
        student = load_model(student_dir, device=device, dtype=torch.float32)
    else:
        student = build_decoder(student_spec, device=device, dtype=torch.float32, seed=seed)
        if init == "teacher_layers":
            init_from_teacher_layers(student, teacher)
    student.train()
    stage(f"loaded teacher ({teacher_spec.name}) and student ({init}) on {device}")
    if multi:
        dist.shard_student(student)
        if os.environ.get("KDISTILL_REPLICATE_TEACHER") != "1":
            dist.shard_teacher(teacher)
        stage(f"FSDP2 over {dist.info().world} processes: student and teacher sharded")
    opt = make_optimizer(student, cfg.optim)
    batcher = Batcher(data.train, cfg.schedule.batch_size, seed)
    held = heldout_batches(data.heldout, cfg.schedule.batch_size, cfg.schedule.eval_batches)

    # -- resume -----------------------------------------------------------------------------------
    start_step, counters = (
        0,
        {"nonfinite_skipped": 0, "degenerate_batches": 0, "tokens_seen": 0, "train_seconds": 0.0},
    )
    if resume:
        if multi:
            dist.run_on_main(lambda: ckpt.clean_partial(run_dir))
        else:
            ckpt.clean_partial(run_dir)
        found = ckpt.latest_loadable(run_dir)
        if found is not None:
            path, (weights, opt_tensors, state) = found
            try:
                own = student.state_dict()
                odd = sorted(set(own) ^ set(weights))
                if odd:
                    raise ValueError(f"{'unexpected' if odd[0] in weights else 'missing'} tensor {odd[0]!r}")
                for k, v in weights.items():
                    if v.shape != own[k].shape:
                        raise ValueError(
                            f"tensor {k!r} has shape {list(v.shape)}, expected {list(own[k].shape)}"
                        )
                if multi:
                    holder = dist.FullState({})
                    ckpt.load_optimizer_tensors(holder, opt_tensors, state["optimizer"])  # type: ignore[arg-type]
                    dist.load_full_state(student, opt, weights, holder.loaded)
                else:
                    student.load_state_dict({k: v.to(device) for k, v in weights.items()})
                    ckpt.load_optimizer_tensors(
                        opt, {k: v.to(device) for k, v in opt_tensors.items()}, state["optimizer"]
                    )
                batcher.load_state_dict(state["batcher"])
                torch.set_rng_state(torch.tensor(state["rng_cpu"], dtype=torch.uint8))
                start_step = state["step"]
                if type(start_step) is not int or not 0 <= start_step <= cfg.schedule.steps:
                    raise ValueError(f"step {start_step!r}")
                counters.update({k: type(v)(state["counters"][k]) for k, v in counters.items()})
            except (RuntimeError, KeyError, TypeError, ValueError, AttributeError) as e:
                # A damaged or foreign checkpoint: names, shapes or state that do not fit this run.
                what = str(e).splitlines()[0][:200] if str(e) else e.__class__.__name__
                raise UserError(f"{path}: checkpoint does not match this run ({what})") from None
            if dist.is_main():
                print(f"resuming from {path} (step {start_step})", file=sys.stderr)
    if multi and not dist.is_main():  # only rank 0 writes the run's files
        metrics = eval_log = _NoWriter()
    else:
        metrics = MetricsWriter(run_dir / "metrics.jsonl", keep_until_step=start_step if resume else None)
        eval_log = MetricsWriter(run_dir / "eval.jsonl", keep_until_step=start_step if resume else None)
    dist.barrier()

    teacher_heldout: float | None = None
    steps = cfg.schedule.steps
    status = "completed"
    consecutive_bad = 0
    from tqdm import tqdm

    bar = tqdm(
        total=steps,
        initial=start_step,
        disable=quiet,
        desc=label,
        unit="step",
        dynamic_ncols=True,
        file=sys.stderr,
    )
    last_eval: dict[str, float] = {}

    def save(step: int) -> None:
        state = {
            "batcher": batcher.state_dict(),
            "rng_cpu": torch.get_rng_state().tolist(),
            "counters": counters,
            "config": cfg.to_dict(),
        }
        if multi:  # gather full tensors (collective), rank 0 writes them with the same atomic writer
            weights, opt_state = dist.full_model_state(student), dist.full_optimizer_state(student, opt)
            if dist.is_main():
                ckpt.save_checkpoint(
                    run_dir,
                    step,
                    dist.FullState(weights),  # type: ignore[arg-type]
                    dist.FullState(opt_state),  # type: ignore[arg-type]
                    state,
                    cfg.output.keep_checkpoints,
                )
            dist.barrier()
            return
        ckpt.save_checkpoint(run_dir, step, student, opt, state, cfg.output.keep_checkpoints)

    def run_eval(step: int) -> dict[str, float]:
        nonlocal teacher_heldout
        student.eval()
        res = heldout_eval(
            student, teacher, held, cfg, device, amp, with_teacher_loss=teacher_heldout is None
        )
        student.train()
        if "teacher_loss" in res:
            teacher_heldout = res["teacher_loss"]
        res["teacher_loss"] = teacher_heldout
        res["step"] = step
        eval_log.write(res)
        return res

    step = start_step
    try:
        with SignalGuard() as guard:
            while step < steps:
                t0 = time.time()
                lr = lr_at(step, steps, cfg.optim)
                for g in opt.param_groups:
                    g["lr"] = lr
                opt.zero_grad(set_to_none=True)
                loss_sum = ce_sum = kd_sum = 0.0
                degenerate = False
                bad_cause = None
                step_tokens = 0
                for micro in range(cfg.schedule.grad_accum):
                    input_ids, labels = batcher.next()
                    reason = check_batch(labels, cfg.kd.ignore_index)
                    if reason:
                        degenerate = True
                        counters["degenerate_batches"] += 1
                        log.warning("step %d: degenerate batch (%s)", step + 1, reason)
                    if multi:
                        input_ids, labels = input_ids[rows], labels[rows]
                    input_ids, labels = input_ids.to(device), labels.to(device)
                    r = compute_loss(student, teacher, input_ids, labels, cfg, amp)
                    loss_value = float(r.loss.detach())
                    if os.environ.get(_NAN_ENV) and str(step + 1) in os.environ[_NAN_ENV].split(","):
                        loss_value = float("nan")
                    weight, ce_value, kd_value, tokens = 1.0, float(r.ce), float(r.kd), int(r.tokens)
                    if multi:  # token-weighted means over all processes (the same on every one)
                        weight, _ = dist.loss_weight(tokens)
                        sums = dist.all_reduce_sum(
                            [loss_value * tokens, ce_value * tokens, kd_value * tokens, tokens]
                        )
                        n = max(sums[3], 1.0)
                        loss_value, ce_value, kd_value = sums[0] / n, sums[1] / n, sums[2] / n
                        tokens = int(sums[3])
                    if not math.isfinite(loss_value):
                        bad_cause = f"loss is {loss_value}"
                        break
                    if multi:
                        (r.loss * (weight / cfg.schedule.grad_accum)).backward()
                        dist.reshard(teacher)  # after backward: the KD head's backward reads its lm_head
                    else:
                        (r.loss / cfg.schedule.grad_accum).backward()
                    loss_sum += loss_value
                    ce_sum += ce_value
                    kd_sum += kd_value
                    step_tokens += tokens
                    _test_hook(f"{step + 1}.{micro + 1}")
                grad_norm = None
                if bad_cause is None:
                    clip = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else float("inf")
                    norm = torch.nn.utils.clip_grad_norm_(student.parameters(), clip)
                    if multi and hasattr(norm, "full_tensor"):  # a DTensor: the norm over every shard
                        norm = norm.full_tensor()
                    grad_norm = float(norm)
                    if not math.isfinite(grad_norm):
                        bad_cause = f"gradient norm is {grad_norm}"
                if bad_cause is not None:
                    opt.zero_grad(set_to_none=True)
                    counters["nonfinite_skipped"] += 1
                    consecutive_bad += 1
                    if cfg.runtime.on_nonfinite == "stop":
                        raise UserError(
                            f"step {step + 1}: non-finite value ({bad_cause}); stopped "
                            "(runtime.on_nonfinite=stop); the last good checkpoint is kept"
                        )
                    if consecutive_bad >= cfg.runtime.max_nonfinite:
                        raise UserError(
                            f"step {step + 1}: {consecutive_bad} non-finite steps in a row "
                            f"({bad_cause}); stopped (runtime.max_nonfinite={cfg.runtime.max_nonfinite})"
                        )
                    log.warning("step %d: non-finite value (%s): batch skipped", step + 1, bad_cause)
                else:
                    opt.step()
                    consecutive_bad = 0
                step += 1
                if device.type == "cuda":
                    torch.cuda.synchronize()
                dt = time.time() - t0
                counters["train_seconds"] += dt
                counters["tokens_seen"] += step_tokens
                acc = cfg.schedule.grad_accum
                row = {
                    "step": step,
                    "loss": loss_sum / acc if bad_cause is None else None,
                    "ce": ce_sum / acc if bad_cause is None else None,
                    "kd": kd_sum / acc if bad_cause is None else None,
                    "lr": lr,
                    "grad_norm": grad_norm,
                    "tokens_per_s": step_tokens / dt if dt > 0 else None,
                    "jit_after_prewarm": kernels.jit_after_prewarm(),
                }
                if bad_cause is not None:
                    row["skipped"] = bad_cause
                if degenerate:
                    row["degenerate"] = True
                metrics.write(row)
                _test_hook(str(step))
                if bad_cause is None:
                    bar.set_postfix(
                        loss=f"{row['loss']:.3f}", tok_s=f"{row['tokens_per_s']:.0f}", refresh=False
                    )
                bar.update(1)
                if cfg.schedule.eval_every and step % cfg.schedule.eval_every == 0 and step < steps:
                    last_eval = run_eval(step)
                    if not quiet:
                        bar.write(
                            f"step {step}: held-out student {last_eval['student_loss']:.4f}"
                            + (
                                f", teacher {last_eval['teacher_loss']:.4f}"
                                if last_eval.get("teacher_loss")
                                else ""
                            )
                        )
                saved = False
                if (
                    cfg.schedule.checkpoint_every
                    and step % cfg.schedule.checkpoint_every == 0
                    and step < steps
                ):
                    save(step)
                    saved = True
                    _test_hook(f"{step}.saved")
                if multi and dist.any_rank(guard.requested is not None) and guard.requested is None:
                    guard.requested = "SIGTERM"  # another process got the signal: stop at the same step
                if guard.requested and step < steps:
                    if not saved:  # re-saving the same step would delete it before replacing it
                        save(step)
                    status = "interrupted"
                    break
    finally:
        bar.close()
        metrics.close()
    if status == "completed":
        last_eval = run_eval(step)
        save(step)
    eval_log.close()

    # -- finish -----------------------------------------------------------------------------------
    if status == "completed":
        if multi:
            plain = dist.unsharded_copy(student)  # collective; rank 0 gets the full student
            if plain is not None:
                save_model(plain, run_dir / "student", source_dir=Path(cfg.teacher.path))
            dist.barrier()
        else:
            save_model(student, run_dir / "student", source_dir=Path(cfg.teacher.path))
    rows = read_metrics(run_dir / "metrics.jsonl")
    initial, final, smoke = smoke_contract(rows)
    summary = {
        "status": status,
        "steps": step,
        "initial_loss": initial,
        "final_loss": final,
        "smoke_passed": smoke,
        "heldout": {
            k: last_eval.get(k) for k in ("student_loss", "teacher_loss", "kl_to_teacher") if k in last_eval
        },
        "tokens_per_s": counters["tokens_seen"] / counters["train_seconds"]
        if counters["train_seconds"]
        else None,
        "tokens_seen": counters["tokens_seen"],
        "nonfinite_skipped": counters["nonfinite_skipped"],
        "degenerate_batches": counters["degenerate_batches"],
        "jit_after_prewarm": kernels.jit_after_prewarm(),
        "kernels": kernels.summary(),
        "device": str(device),
        "wall_seconds": time.time() - t_start,
    }
    if device.type == "cuda":
        from kdistill.plan import GIB, estimate_memory

        summary["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / GIB
        summary["planned_memory_gib"] = estimate_memory(teacher_spec, student_spec, cfg)["total"] / GIB
    summary["heldout"]["student"] = summary["heldout"].get("student_loss")
    summary["heldout"]["teacher"] = summary["heldout"].get("teacher_loss")
    if multi:
        summary["world_size"] = dist.info().world
        if dist.is_main():
            write_json(run_dir / "summary.json", summary)
            plot_losses(run_dir, title=label)
        dist.barrier()
        return summary
    write_json(run_dir / "summary.json", summary)
    plot_losses(run_dir, title=label)
    return summary


class _NoWriter:
    """metrics/eval writer of the processes other than rank 0: writes nothing."""

    def write(self, row: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


# ----------------------------------------------------------------------------------------------
# Memory and kernels
# ----------------------------------------------------------------------------------------------
def check_memory(
    cfg: RunConfig, teacher: ModelSpec, student: ModelSpec, device: torch.device, quiet: bool
) -> RunConfig:
    """Compare the plan with the device's free memory before loading anything; refuse or auto-fit."""
    from kdistill.plan import GIB, estimate_memory, fit_limits

    if cfg.runtime.gpu_memory_gib > 0:
        free = int(cfg.runtime.gpu_memory_gib * GIB)
    else:
        free, _ = torch.cuda.mem_get_info(device)
    budget = int(free * 0.95)
    need = estimate_memory(teacher, student, cfg)["total"]
    if need <= budget:
        return cfg
    fit = fit_limits(teacher, student, cfg, budget)
    if cfg.runtime.auto_fit and fit["batch_size"] > 0:
        if not quiet:
            print(
                f"runtime.auto_fit: batch_size {cfg.schedule.batch_size} -> {fit['batch_size']} "
                f"(plan {need / GIB:.1f} GiB > free {free / GIB:.1f} GiB)"
            )
        return dataclasses.replace(
            cfg, schedule=dataclasses.replace(cfg.schedule, batch_size=fit["batch_size"])
        )
    raise UserError(
        f"the plan needs {need / GIB:.1f} GiB per device but {free / GIB:.1f} GiB is free: the largest that fit "
        f"are schedule.batch_size={fit['batch_size']} (at seq_len {cfg.data.seq_len}) or data.seq_len="
        f"{fit['seq_len']} (at batch {cfg.schedule.batch_size}); or set runtime.auto_fit=true"
    )


class _NoKernels:
    """Kernel state when the kernels package is not in use (reference path only)."""

    def jit_after_prewarm(self) -> int:
        return 0

    def summary(self) -> dict[str, Any]:
        return {"mode": "reference"}


def setup_kernels(
    cfg: RunConfig,
    teacher: ModelSpec,
    student: ModelSpec,
    device: torch.device,
    dtype: torch.dtype,
    quiet: bool,
) -> Any:
    """Configure the kernel dispatcher; on a GPU, prewarm every required kernel and seal the cache."""
    try:
        from kdistill.kernels import session
    except ImportError:
        return _NoKernels()
    return session.start(cfg, teacher, student, device, dtype, quiet=quiet)


# ----------------------------------------------------------------------------------------------
# Command
# ----------------------------------------------------------------------------------------------
def _print_config(cfg: RunConfig, quiet: bool) -> None:
    if not quiet:
        print("resolved config:")
        print("  " + yaml.safe_dump(cfg.to_dict(), sort_keys=False).replace("\n", "\n  ").rstrip())


def _start_run_dir(cfg: RunConfig, run_dir: Path, device: str) -> None:
    write_json(run_dir / "manifest.json", make_manifest(cfg.to_dict(), device, _device_name(device)))
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))


def _device_name(device: str) -> str:
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    import platform

    return platform.processor() or platform.machine()


def _resume_config(args: argparse.Namespace) -> tuple[RunConfig, Path]:
    """The config of the run in --resume RUN_DIR (its saved config.yaml plus any overrides)."""
    run_dir = Path(args.resume)
    cfg_path = run_dir / "config.yaml"
    if not cfg_path.is_file():
        raise UserError(f"--resume {run_dir}: no config.yaml there (not a kdistill run directory)")
    cfg = load_config(cfg_path, [*([args.config] if args.config else []), *args.overrides]).validate()
    if not ckpt.list_checkpoints(run_dir):
        raise UserError(f"--resume {run_dir}: no complete checkpoint to resume from")
    saved = load_config(cfg_path)
    if saved.schedule.steps != cfg.schedule.steps and not args.quiet and os.environ.get("RANK", "0") == "0":
        print(
            f"schedule.steps {saved.schedule.steps} -> {cfg.schedule.steps}: the learning-rate schedule follows "
            "the new total from here on",
            file=sys.stderr,
        )
    return cfg, run_dir


def _new_run_args(args: argparse.Namespace) -> tuple[str | None, list[str]]:
    """(config path, overrides): `kdistill run key=value ...` has no config file."""
    config_path, overrides = args.config, list(args.overrides)
    if config_path is not None and "=" in config_path and not Path(config_path).exists():
        overrides.insert(0, config_path)
        config_path = None
    return config_path, overrides


def _is_demo(config_path: str | None, overrides: list[str]) -> bool:
    """No config and no teacher: the embedded demo (overrides apply to it)."""
    return config_path is None and not any(o.startswith("teacher.path=") for o in overrides)


def run_command(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING, format="kdistill: %(message)s")
    if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
        return _run_distributed(args)
    if args.resume:
        cfg, run_dir = _resume_config(args)
        summary = train(cfg, run_dir, resume=True, quiet=args.quiet)
        _print_summary(summary, args.json)
        return 0
    config_path, overrides = _new_run_args(args)
    if _is_demo(config_path, overrides):
        return run_demo(overrides, quiet=args.quiet, as_json=args.json)
    cfg = load_config(config_path, overrides).validate()
    run_dir = Path(cfg.output.dir)
    fresh = not run_dir.exists()
    prepare_output(run_dir, args.overwrite)
    try:
        _print_config(cfg, args.quiet)
        device, _ = resolve_device(cfg)
        _start_run_dir(cfg, run_dir, str(device))
        summary = train(cfg, run_dir, quiet=args.quiet)
    except BaseException:
        _discard_unstarted(run_dir, fresh)
        raise
    _print_summary(summary, args.json)
    return 0


def _run_distributed(args: argparse.Namespace) -> int:
    """`torchrun --nproc_per_node=N -m kdistill run CONFIG`: every process trains its slice of each batch;
    rank 0 alone prepares the output folder, writes the run's files and prints the summary."""
    if args.resume:
        cfg, run_dir = _resume_config(args)
    else:
        config_path, overrides = _new_run_args(args)
        if _is_demo(config_path, overrides):
            raise UserError("the embedded demo runs in one process: give torchrun a run config (CONFIG)")
        cfg = load_config(config_path, overrides).validate()
        run_dir = Path(cfg.output.dir)
    device, _ = resolve_device(cfg)
    info = dist.init_from_env(device.type)
    if info.device is not None:
        device = info.device
    try:
        dist.batch_slice(cfg.schedule.batch_size)  # a one-line error before anything is written
    except UserError:
        dist.destroy()
        raise
    fresh = not run_dir.exists()
    try:
        if not args.resume:

            def start() -> None:
                prepare_output(run_dir, args.overwrite)
                _print_config(cfg, args.quiet)
                _start_run_dir(cfg, run_dir, str(device))

            dist.run_on_main(start)
        try:
            summary = train(cfg, run_dir, resume=bool(args.resume), quiet=args.quiet)
        except BaseException:
            if not args.resume and dist.is_main():
                _discard_unstarted(run_dir, fresh)
            raise
        if dist.is_main():
            _print_summary(summary, args.json)
    finally:
        dist.destroy()
    return 0


_RUN_FILES = ("manifest.json", "config.yaml", "metrics.jsonl", "eval.jsonl")


def _discard_unstarted(run_dir: Path, fresh: bool) -> None:
    """A run that failed before its first step leaves nothing behind (so a corrected rerun just works)."""
    if read_metrics(run_dir / "metrics.jsonl") or ckpt.list_checkpoints(run_dir):
        return
    for name in _RUN_FILES:
        (run_dir / name).unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        (run_dir / "checkpoints").rmdir()
    if fresh:
        with contextlib.suppress(OSError):
            run_dir.rmdir()


def _print_summary(summary: dict[str, Any], as_json: bool) -> None:
    from kdistill.cli import print_json

    if as_json:
        print_json(summary)
        return
    h = summary["heldout"]
    print(
        f"status {summary['status']}: {summary['steps']} steps, loss {summary['initial_loss']:.4f} -> "
        f"{summary['final_loss']:.4f}, held-out student {h.get('student_loss', float('nan')):.4f}, "
        f"jit_after_prewarm {summary['jit_after_prewarm']}"
    )


def run_demo(overrides: list[str], quiet: bool = False, as_json: bool = False) -> int:
    """The embedded default: KD student and CE-only student on the stdlib, then a held-out table."""
    from kdistill.cli import print_json
    from kdistill.demo import DEMO_YAML

    cfg = load_config(DEMO_YAML, overrides).validate()
    run_dir = Path(cfg.output.dir)
    prepare_output(run_dir, overwrite=True)  # the demo always starts afresh
    _print_config(cfg, quiet)
    device, _ = resolve_device(cfg)
    _start_run_dir(cfg, run_dir, str(device))
    kd_summary = train(cfg, run_dir, quiet=quiet, label="KD student")
    base_cfg = dataclasses.replace(
        cfg,
        kd=dataclasses.replace(cfg.kd, alpha=0.0),
        output=dataclasses.replace(cfg.output, dir=str(run_dir / "baseline_ce")),
    )
    base_dir = run_dir / "baseline_ce"
    prepare_output(base_dir, overwrite=True)
    _start_run_dir(base_cfg, base_dir, str(device))
    base_summary = train(base_cfg, base_dir, quiet=quiet, label="CE-only student")
    heldout = {
        "teacher": kd_summary["heldout"]["teacher_loss"],
        "student": kd_summary["heldout"]["student_loss"],
        "baseline_ce": base_summary["heldout"]["student_loss"],
        "kl_to_teacher_student": kd_summary["heldout"].get("kl_to_teacher"),
        "kl_to_teacher_baseline_ce": base_summary["heldout"].get("kl_to_teacher"),
    }
    kd_summary["heldout"].update(heldout)
    kd_summary["baseline_ce"] = {
        k: base_summary[k] for k in ("initial_loss", "final_loss", "steps", "smoke_passed")
    }
    kd_summary["kd_beats_baseline"] = heldout["student"] < heldout["baseline_ce"]
    write_json(run_dir / "summary.json", kd_summary)
    plot_comparison(
        {"KD student": run_dir, "CE-only student": base_dir},
        run_dir / "comparison.png",
        "held-out loss on the stdlib: KD vs hard labels only",
    )
    if as_json:
        print_json(kd_summary)
    else:
        print()
        print(f"held-out loss (nats/token) on {len(expand_data_paths(cfg.data.heldout))} stdlib files:")
        print(f"  {'teacher':28s}{heldout['teacher']:8.4f}")
        print(f"  {'KD student':28s}{heldout['student']:8.4f}")
        print(f"  {'CE-only student (alpha=0)':28s}{heldout['baseline_ce']:8.4f}")
        verdict = "beats" if kd_summary["kd_beats_baseline"] else "does NOT beat"
        print(
            f"KD student {verdict} the CE-only student by {heldout['baseline_ce'] - heldout['student']:+.4f} nats; "
            f"run in {run_dir}/ (summary.json, loss.png, comparison.png, student/)"
        )
    return 0
