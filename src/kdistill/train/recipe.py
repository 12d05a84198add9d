"""The distillation recipe, top to bottom: setup -> train loop -> finish.

    summary = train(cfg, run_dir)                   # a new run (run_dir prepared by the caller)
    summary = train(cfg, run_dir, resume=True)      # continue from its newest loadable checkpoint

setup:  devices and dtypes; teacher and student specs from config.json alone, tokenizers and vocab
        checked; the memory plan against free GPU memory (refuse or auto-fit the batch); data read,
        tokenized (cached) and packed; kernels prewarmed and sealed (GPU) before any weight is on
        the device; teacher (frozen) and student loaded; under torchrun both sharded with FSDP2;
        optimizer, batches; a resumed run's checkpoint restored.
loop:   `step.train_step` per step, a metrics.jsonl line, the progress bar, held-out evals, periodic
        checkpoints; SIGTERM/SIGINT finish the step, checkpoint and stop.
finish: a final eval and checkpoint; the student exported as a Hugging Face directory;
        summary.json and loss.png.

Under torchrun (`distributed.active()`) every process runs this recipe on its slice of each batch;
rank 0 alone writes the run's files and prints. The checks before loading live in preflight.py, the
loading of data, cache and models in loading.py, the loss of a batch in targets.py and step.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import torch

from kdistill import signals
from kdistill.acceptance import run_acceptance
from kdistill.config import RunConfig
from kdistill.console import progress_bar
from kdistill.data import Batcher, heldout_batches
from kdistill.data.chat_pack import PackedRows
from kdistill.data.chat_template import load_chat_template
from kdistill.data.cross_chat import AlignedRows, CompletionSide, cross_prompt_pool
from kdistill.dtypes import torch_dtype
from kdistill.errors import UserError
from kdistill.fileio import atomic_write_json, write_guard
from kdistill.generate import stop_token_ids
from kdistill.kernels import seal
from kdistill.memory import GIB, Layout, estimate_memory
from kdistill.models.hf_io import save_model
from kdistill.models.lora import has_lora, save_adapter
from kdistill.models.spec import ModelSpec
from kdistill.models.tokenizer import Tokenizer, load_tokenizer
from kdistill.samples import answer_rows, sample_prompts
from kdistill.scoring import heldout_eval_cached
from kdistill.train import checkpoint as ckpt
from kdistill.train import distributed as dist
from kdistill.train import faults
from kdistill.train.cross_tok import CrossTokenizer
from kdistill.train.evidence import MetricsWriter, NullWriter, plot_losses, read_metrics, smoke_contract
from kdistill.train.graph import StepGraph
from kdistill.train.graph import wanted as graph_wanted
from kdistill.train.layers import attach_projections, check_layer_map
from kdistill.train.loading import (
    chat_template,
    exported_chat_template,
    load_data,
    load_mixture,
    load_models,
    open_teacher_cache,
)
from kdistill.train.onpolicy import PHASES, GeneratedStats, OnPolicy, prompt_pool, rollout_stop_ids
from kdistill.train.optim import make_optimizer
from kdistill.train.preflight import (
    check_disk,
    check_fp8_layout,
    check_memory,
    check_models,
    check_teachers,
    resolve_device,
)
from kdistill.train.profiling import StepProfiler
from kdistill.train.resume import new_counters, restore_state, save_state
from kdistill.train.signals import SignalGuard
from kdistill.train.step import NonFinitePolicy, StepContext, StepResult, heldout_eval, train_step
from kdistill.train.trackers import Trackers, open_trackers

log = logging.getLogger("kdistill")


def train(
    cfg: RunConfig, run_dir: Path, *, resume: bool = False, quiet: bool = False, label: str = "kdistill"
) -> dict[str, Any]:
    """Run (or resume) one distillation into run_dir and return its summary."""
    with signals.stage("setup"):  # a signal here raises Interrupted; the caller removes what setup made
        run = setup(cfg, run_dir, resume=resume, quiet=quiet, label=label)
    try:
        status, step, last_eval = train_loop(run)
        summary = finish(run, status, step, last_eval)
    except BaseException:
        run.trackers.close(failed=True)
        with contextlib.suppress(Exception):  # the run's own error is the one to report
            release_graphs(run)
        raise
    release_graphs(run)
    run.trackers.close()
    return summary


def release_graphs(run: Any) -> None:
    """The run's CUDA graphs destroyed before the process group goes (graph.StepGraph.release)."""
    if run.ctx.graph is not None:
        run.ctx.graph.release()


# ----------------------------------------------------------------------------------------------
# setup
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Run:
    """Everything the loop and finish work on, as setup leaves it."""

    cfg: RunConfig
    run_dir: Path
    label: str
    quiet: bool
    t_start: float
    device: torch.device
    teacher_spec: ModelSpec
    student_spec: ModelSpec
    kernels: seal.KernelSession
    layout: Layout  # processes, teacher placement, activation checkpointing
    ctx: StepContext  # student, teacher, optimizer, device, autocast, this process's rows
    batcher: Batcher
    held: Any  # the fixed held-out batches
    counters: dict[str, Any]
    start_step: int
    metrics: MetricsWriter | NullWriter
    eval_log: MetricsWriter | NullWriter
    trackers: Trackers  # output.report_to, open on rank 0 only (none elsewhere)
    data_stats: dict[str, Any] = dataclasses.field(default_factory=dict)  # conversations: packing
    tokenizer: Any = None  # decodes the eval samples (samples.jsonl)
    extra_specs: list[ModelSpec] = dataclasses.field(default_factory=list)  # teachers[1:] of a mixture
    # this process's steps after its first WARMUP_STEPS: [seconds, tokens, steps] (not resumed)
    steady: list[float] = dataclasses.field(default_factory=lambda: [0.0, 0.0, 0.0])
    # steps run under runtime.profile_steps' profiler: left out of the steady rate (their time holds the
    # profiler's overhead)
    profiled_steps: list[int] = dataclasses.field(default_factory=list)
    # bytes the process held on the device before the run began (an earlier run's in the same process):
    # left out of the run's peak, which the memory plan is checked against
    memory_base: int = 0


# Steps of each process left out of the steady-state rate: the first ones pay one-time costs
# (allocator growth, library autotuning, lazy CUDA context work) that the rest of the run does not.
# runtime.profile_steps profiles the steps right after them.
WARMUP_STEPS = 2


def stage(t_start: float, quiet: bool, msg: str) -> None:
    """A timed set-up line on stderr: `[   6.2s] data: ...`."""
    if not quiet:
        print(f"[{time.time() - t_start:6.1f}s] {msg}", file=sys.stderr, flush=True)


def setup(cfg: RunConfig, run_dir: Path, *, resume: bool, quiet: bool, label: str) -> Run:
    """Plan, check, read the data, prewarm, load and (under torchrun) shard; restore a resumed run."""
    t_start = time.time()
    device, dtype = resolve_device(cfg)
    multi = dist.active()  # torchrun with several processes: FSDP2, a slice of each batch per process
    if multi:
        if dist.info().device is not None:
            device = dist.info().device
        quiet = quiet or not dist.is_main()
    amp: Any = (
        torch.autocast("cuda", dtype=dtype)
        if device.type == "cuda" and dtype != torch.float32
        else contextlib.nullcontext()
    )
    torch.manual_seed(cfg.schedule.seed)
    memory_base = 0
    if device.type == "cuda":  # the run's own peak: not what an earlier run in this process left behind
        torch.cuda.reset_peak_memory_stats(device)
        memory_base = torch.cuda.memory_allocated(device)

    teacher_spec, student_spec, tok, trim_rows = check_models(cfg, quiet)
    if cfg.kd.layers_on:
        check_layer_map(cfg, teacher_spec, student_spec)
    extras = check_teachers(cfg, tok, student_spec)  # teachers[1:] of a mixture: [(spec, trim rows)]
    extra_specs = [spec for spec, _ in extras]
    cfg, layout = check_memory(cfg, teacher_spec, student_spec, device, quiet, extra_specs)  # GPU or RAM
    # runtime.cuda_graphs (`on` refused here, before loading): under torchrun only with a replicated student
    graphs = graph_wanted(cfg, device, dist.info().world if multi else 1, layout.student_replicated)
    sharded = multi and not layout.student_replicated  # the student under FSDP2
    check_disk(cfg, teacher_spec, student_spec, run_dir)  # its checkpoints and export fit on output.dir
    rows = dist.batch_slice(cfg.schedule.batch_size) if multi else None
    per_process = cfg.schedule.batch_size // dist.info().world
    data = load_data(cfg, tok)
    prompts, where = None, None
    if cfg.kd.generates:  # kd.on_policy / kd.seq_kd: the data's prompts, refused before any prewarm
        prompts = prompt_pool(data.train)
        if isinstance(data.train, AlignedRows):  # across tokenizers: each prompt's conversation too
            prompts, where = cross_prompt_pool(data.train)
        elif cfg.kd.cross_tokenizer:
            raise UserError(
                "kd.on_policy with kd.cross_tokenizer needs conversation data: the teacher renders each "
                "completion in its prompt's conversation with its own chat template (data.train is raw text)"
            )
    stage(
        t_start,
        quiet,
        data.summary()
        if data.documents
        else f"data: {len(data.train)} train and {len(data.heldout)} held-out sequences of {cfg.data.seq_len}",
    )

    # Kernels are compiled and sealed before any weight is on the GPU, at this process's batch.
    kernels = seal.start(
        cfg,
        teacher_spec,
        student_spec,
        device,
        dtype,
        quiet=quiet,
        batch=per_process,
        documents=data.documents,
        sharded=sharded,
        extra_teachers=extra_specs,
    )

    cache = open_teacher_cache(cfg, tok, data) if cfg.teacher.cache else None
    # A teacher to be sharded is read into host memory: fully_shard moves it to the GPU one block at a
    # time, so no process ever holds a whole teacher that does not fit there.
    teacher_device = torch.device("cpu") if multi and layout.teacher_sharded else device
    check_fp8_layout(cfg, multi and layout.teacher_sharded)
    if multi and cfg.student.lora.enabled:  # one this torch's FSDP2 cannot shard: refused before loading
        dist.check_lora_sharding(torch_dtype(cfg.student.lora.base_dtype))
    teacher, student, init = load_models(cfg, student_spec, device, dtype, trim_rows, teacher_device)
    mixture = load_mixture(cfg, teacher, [trim for _, trim in extras], device, dtype)
    who = f"teacher cache ({cache.mode}, {cfg.teacher.cache})" if cache else f"teacher ({teacher_spec.name})"
    if mixture is not None:
        who = f"{len(mixture)} teachers ({', '.join(f'{w:.3g}' for _, w in mixture)})"
    stage(t_start, quiet, f"loaded {who} and student ({init}) on {device}")
    student.checkpoint_blocks(layout.checkpointing)
    student.keep_swiglu(layout.swiglu_kept)
    reduce = dtype if cfg.runtime.grad_reduce == "compute" else torch.float32
    # a whole student on every process (runtime.student_placement): its gradients averaged each step
    average = dist.GradAverage(reduce) if multi and layout.student_replicated else None
    if sharded:
        dist.shard_student(  # a LoRA student: its base and adapters gathered as stored
            student,
            dtype,
            keep_gathered=layout.student_kept,
            reduce_dtype=reduce,
            unit_blocks=cfg.runtime.student_unit_blocks,
        )
    if multi and teacher is not None and layout.teacher_sharded:
        for t in [t for t, _ in mixture] if mixture else [teacher]:
            dist.shard_teacher(t)
    if multi or layout.checkpointing:
        stage(t_start, quiet, f"layout: {layout.describe()}")
    if cfg.kd.layers_on:  # kd.layer_map: the student's projections train with it
        attach_projections(student, teacher_spec, cfg, seed=cfg.schedule.seed)
    opt = make_optimizer(student, cfg.optim)
    batcher = Batcher(data.train, cfg.schedule.batch_size, cfg.schedule.seed)
    held = heldout_batches(data.heldout, cfg.schedule.batch_size, cfg.schedule.eval_batches)

    onpolicy = None
    if prompts is not None:
        template = chat_template(cfg) if data.documents else None
        stops = rollout_stop_ids(cfg, tok, template)
        pad = tok.eos_id if tok.eos_id is not None else 0
        onpolicy = OnPolicy(cfg, prompts, stops, pad, device, rows=rows, student_kept=layout.student_kept)
        stage(t_start, quiet, f"on-policy: {len(prompts)} prompts, {onpolicy.describe()}")
    counters = new_counters()
    start_step = (
        restore_state(run_dir, student, opt, batcher, counters, cfg, device, onpolicy) if resume else 0
    )
    if multi and not dist.is_main():  # only rank 0 writes the run's files
        metrics: MetricsWriter | NullWriter = NullWriter()
        eval_log: MetricsWriter | NullWriter = NullWriter()
    else:
        keep = start_step if resume else None
        metrics = MetricsWriter(run_dir / "metrics.jsonl", keep_until_step=keep)
        eval_log = MetricsWriter(run_dir / "eval.jsonl", keep_until_step=keep)
    dist.barrier()
    cross = None
    if cfg.kd.cross_tokenizer:  # conversations: the teacher's side was rendered and aligned with the data
        aligned = data.train if isinstance(data.train, AlignedRows) else None
        t_tok = load_tokenizer(cfg.teacher.path)
        cross = CrossTokenizer(
            tok, t_tok, teacher_spec.max_position_embeddings, rows=aligned, ignore_index=cfg.kd.ignore_index
        )
        if where is not None and onpolicy is not None:  # the teacher grades the student's completions
            cross.completions = CompletionSide(
                where, onpolicy.stop_ids, tok, load_chat_template(cfg.teacher.path), t_tok,
                cfg.data.template_kwargs, cfg.data.seq_len, cross.vmap,
            )  # fmt: skip
    graph = StepGraph(device) if graphs else None
    ctx = StepContext(
        cfg, student, teacher, opt, device, amp, rows, cache, mixture, cross, onpolicy=onpolicy, graph=graph,
        grad_average=average,
    )  # fmt: skip
    # Last in setup, so nothing after it can fail before train() takes over closing them.
    trackers = Trackers()
    if cfg.output.report_to and dist.is_main():
        trackers = open_trackers(cfg.output.report_to, run_dir, cfg.to_dict(), run_name=run_dir.name)
    return Run(
        cfg, run_dir, label, quiet, t_start, device, teacher_spec, student_spec, kernels, layout, ctx, batcher,
        held, counters, start_step, metrics, eval_log, trackers, data.stats if data.documents else {}, tok,
        extra_specs, memory_base=memory_base,
    )  # fmt: skip


# ----------------------------------------------------------------------------------------------
# train loop
# ----------------------------------------------------------------------------------------------
def train_loop(run: Run) -> tuple[str, int, dict[str, Any]]:
    """Steps from run.start_step to schedule.steps: (status "completed" or "interrupted", the last
    step done, the last held-out eval)."""
    cfg, steps = run.cfg, run.cfg.schedule.steps
    evaluator = Evaluator(run)
    policy = NonFinitePolicy(cfg)
    bar = progress_bar(total=steps, initial=run.start_step, desc=run.label, disable=run.quiet)
    last_eval: dict[str, Any] = {}
    status, step = "completed", run.start_step
    prof = make_profiler(run, bar)
    try:
        with SignalGuard() as guard:
            while step < steps:
                if prof is not None:
                    prof.begin(step + 1)
                t0 = time.time()
                out = train_step(
                    run.ctx, run.batcher, step, run.counters, policy, lambda: guard.requested is not None
                )
                step += 1
                if run.device.type == "cuda":
                    torch.cuda.synchronize()
                dt = time.time() - t0
                if prof is not None and prof.end(step, dt):  # after its last step: the profile written
                    run.profiled_steps.append(step)
                row = log_step(run, step, out, dt)
                faults.at(str(step))
                if out.skipped is None:
                    bar.set_postfix(
                        loss=f"{row['loss']:.3f}", tok_s=f"{row['tokens_per_s']:.0f}", refresh=False
                    )
                bar.update(1)
                if cfg.schedule.eval_every and step % cfg.schedule.eval_every == 0 and step < steps:
                    last_eval = evaluator(step)
                    if not run.quiet:
                        bar.write(eval_line(step, last_eval))
                saved = False
                if (
                    cfg.schedule.checkpoint_every
                    and step % cfg.schedule.checkpoint_every == 0
                    and step < steps
                ):
                    save(run, step)
                    saved = True
                    faults.at(f"{step}.saved")
                # Under torchrun only the step's agreed answer counts (a signal that came after this
                # step's all-reduce stops every process after the next one); alone, the signal itself.
                stop = out.stop_any if dist.active() else guard.requested is not None
                if stop and step < steps:
                    if not saved:  # re-saving the same step would delete it before replacing it
                        save(run, step)
                    status = "interrupted"
                    break
    finally:
        if prof is not None:
            prof.close()
        bar.close()
        run.metrics.close()
    if status == "completed":
        last_eval = evaluator(step)
        if step > run.start_step:  # a resume from the last step's checkpoint: it is kept as written
            save(run, step)
    run.eval_log.close()
    return status, step, last_eval


def make_profiler(run: Run, bar: Any) -> StepProfiler | None:
    """runtime.profile_steps: a profiler over the steps right after this process's WARMUP_STEPS (as many
    as the run has left), or None when off. Rank 0 prints the result line above the progress bar."""
    count = run.cfg.runtime.profile_steps
    if not count:
        return None
    first = run.start_step + WARMUP_STEPS + 1
    window = range(first, min(first + count, run.cfg.schedule.steps + 1))
    if not window:
        log.warning(
            "runtime.profile_steps=%d: the run has no step after its first %d (warm-up); nothing profiled",
            count,
            WARMUP_STEPS,
        )
        return None
    announce = None if run.quiet else lambda line: bar.write(line, file=sys.stderr)
    info = dist.info()
    return StepProfiler(
        window,
        run.device,
        run.run_dir / "profile",
        info.rank,
        info.world,
        announce,
        run.cfg.runtime.profile_shapes,
    )


def log_step(run: Run, step: int, out: StepResult, seconds: float) -> dict[str, Any]:
    """Add the step to the counters and write its metrics.jsonl line (returned). Profiled steps
    (runtime.profile_steps) are marked and left out of the steady rate."""
    run.counters["train_seconds"] += seconds
    run.counters["tokens_seen"] += out.tokens
    profiled = step in run.profiled_steps
    if step - run.start_step > WARMUP_STEPS and not profiled:
        run.steady[0] += seconds
        run.steady[1] += out.tokens
        run.steady[2] += 1
    row: dict[str, Any] = {
        "step": step,
        "loss": out.loss,
        "ce": out.ce,
        "kd": out.kd,
        "lr": out.lr,
        "grad_norm": out.grad_norm,
        "tokens_per_s": out.tokens / seconds if seconds > 0 else None,
        "jit_after_prewarm": run.kernels.jit_after_prewarm(),
    }
    if run.device.type == "cuda":
        row["peak_memory_gib"] = (torch.cuda.max_memory_allocated(run.device) - run.memory_base) / GIB
    if out.skipped is not None:
        row["skipped"] = out.skipped
    if out.degenerate:
        row["degenerate"] = True
    if profiled:
        row["profiled"] = True
    if out.generated and run.ctx.onpolicy is not None:  # a generated step: its phases and samples
        row.update(out.generated)
        # every process's phases, gathered to every process (one small collective; rank 0 writes them)
        mine = GeneratedStats.phases(row, seconds)
        del row["wait_s"]
        row["update_s"] = max(seconds - row["gen_s"] - row["score_s"], 0.0)
        ranks = dist.all_gather_floats(mine)
        row["phase_s"] = {name: [r[i] for r in ranks] for i, name in enumerate(PHASES)}
        if row["policy"] == "on_policy":
            row["sample_kl"] = out.kd  # the divergence to the teacher per token of the student's samples
        run.ctx.onpolicy.record(row, seconds)
    run.metrics.write(row)
    run.trackers.log(step, {TRACKER_KEYS.get(k, k): v for k, v in row.items() if k in TRACKER_KEYS})
    return row


# metrics.jsonl and eval.jsonl names -> tracker scalar names
TRACKER_KEYS = {
    "loss": "train/loss",
    "ce": "train/ce",
    "kd": "train/kd",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "tokens_per_s": "perf/tokens_per_s",
    "peak_memory_gib": "perf/peak_memory_gib",
    "jit_after_prewarm": "kernels/jit_after_prewarm",
    "student_loss": "heldout/student_loss",
    "teacher_loss": "heldout/teacher_loss",
    "kl_to_teacher": "heldout/kl_to_teacher",
}


def eval_line(step: int, res: dict[str, Any]) -> str:
    """The line printed above the progress bar after a periodic eval."""
    teacher = f", teacher {res['teacher_loss']:.4f}" if res.get("teacher_loss") else ""
    return f"step {step}: held-out student {res['student_loss']:.4f}" + teacher


class Evaluator:
    """Held-out eval at a step, written to eval.jsonl. The teacher's loss does not change, so it is
    computed once and repeated in every row. With teacher.cache the cache's held-out targets stand in
    for the teacher (scoring.heldout_eval_cached; a cache without them: the student's CE only). Then
    the student answers schedule.sample_prompts fixed held-out prompts greedily (samples.jsonl; the
    teacher's answers once, at the first eval)."""

    def __init__(self, run: Run) -> None:
        self.run = run
        self.teacher_loss: float | None = None
        self.samples = Samples(run)

    def __call__(self, step: int) -> dict[str, Any]:
        run, ctx = self.run, self.run.ctx
        ctx.student.eval()
        teacher = None if ctx.cross is not None else ctx.teacher  # other vocabulary: the student's CE only
        if ctx.cache is not None and ctx.cache.heldout is not None:
            res: dict[str, Any] = heldout_eval_cached(
                ctx.student, ctx.cache, run.held, run.cfg, ctx.device, ctx.amp
            )
        else:
            res = heldout_eval(
                ctx.student, teacher, run.held, run.cfg, ctx.device, ctx.amp,
                with_teacher_loss=self.teacher_loss is None, mixture=ctx.mixture,
            )  # fmt: skip
        ctx.student.train()
        if "teacher_loss" in res:
            self.teacher_loss = res["teacher_loss"]
        if self.teacher_loss is not None:  # none without a teacher (a cache without held-out targets)
            res["teacher_loss"] = self.teacher_loss
        res["step"] = step
        run.eval_log.write(res)
        held = ("student_loss", "teacher_loss", "kl_to_teacher")
        run.trackers.log(step, {TRACKER_KEYS[k]: res[k] for k in held if k in res})
        self.samples(step)
        return res


class Samples:
    """What the student says: at each eval, greedy answers (schedule.sample_tokens new tokens) to the
    first schedule.sample_prompts held-out prompts, appended to samples.jsonl as {step, model, prompt,
    answer, answer_ids}; the teacher's answers once, with the first eval's. Off under torchrun (a
    sharded student) and for data read as token ids without a tokenizer.

    Each model answers through a decode engine of its own (kdistill.samples), dropped after. The
    teacher answers here, before the first step, while the memory the step's activations, optimizer
    state and captured graph will take is still free (its engine's copy of a big teacher's stacked
    weights would not fit beside them: memory.sample_engine_memory); the student at each eval."""

    def __init__(self, run: Run) -> None:
        self.run = run
        sched = run.cfg.schedule
        self.prompts: list[list[int]] = []
        if sched.sample_prompts and not dist.active() and isinstance(run.tokenizer, Tokenizer):
            self.prompts = sample_prompts(run.held.sequences, sched.sample_prompts)
        self.path = run.run_dir / "samples.jsonl"
        done = self.path.is_file() and any(r.get("model") == "teacher" for r in read_metrics(self.path))
        self.teacher_rows: list[dict[str, Any]] = []  # written with the first eval's
        teacher, cross = run.ctx.teacher, run.ctx.cross
        if self.prompts and not done and teacher is not None and cross is None:
            self.teacher_rows = self.answers(teacher)

    def stops(self) -> set[int]:
        tok, cfg = self.run.tokenizer, self.run.cfg
        template = None
        model = cfg.student.path if cfg.kd.cross_tokenizer else cfg.teacher.path  # whose template renders
        if isinstance(self.run.held.sequences, PackedRows):
            template = load_chat_template(model, cfg.data.chat_template or None)
        return stop_token_ids(model, tok, template, cfg.data.template_kwargs)

    def answers(self, model: torch.nn.Module) -> list[dict[str, Any]]:
        tokens = self.run.cfg.schedule.sample_tokens
        cache = self.run.cfg.data.seq_len + 1 + tokens  # the cache length the kernel plan holds
        return answer_rows(
            model, self.prompts, tokens, self.stops(), self.run.tokenizer.decode, max_len=cache
        )

    def __call__(self, step: int) -> None:
        if not self.prompts:
            return
        rows = [("student", r) for r in self.answers(self.run.ctx.student)]
        rows += [("teacher", r) for r in self.teacher_rows]
        self.teacher_rows = []
        lines = [json.dumps({"step": step, "model": name, **r}, ensure_ascii=False) for name, r in rows]
        with open(self.path, "a", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")


def save(run: Run, step: int) -> None:
    """Checkpoint the run at `step` (see resume.py for what is saved)."""
    ctx = run.ctx
    save_state(run.run_dir, step, ctx.student, ctx.opt, run.batcher, run.counters, run.cfg, ctx.onpolicy)


# ----------------------------------------------------------------------------------------------
# finish
# ----------------------------------------------------------------------------------------------
def finish(run: Run, status: str, step: int, last_eval: dict[str, Any]) -> dict[str, Any]:
    """Export the student (a completed run), then write summary.json and loss.png; return the summary.

    A signal during the export stops it (no temp folder left) and the run ends "interrupted" with its
    final checkpoint: `--resume` goes straight to the export. A write fault is one line naming what is
    intact."""
    run_dir = run.run_dir
    export = None
    if status == "completed":
        try:
            with signals.stage("export"):
                export_student(run)
        except signals.Interrupted as e:
            status, export = "interrupted", "interrupted"
            print(
                f"kdistill: {e.signame} received during the export: training is complete (checkpoint at "
                f"step {step}); `kdistill run --resume {run_dir}` writes the export",
                file=sys.stderr,
            )
        except UserError as e:
            raise UserError(
                f"{e}; training is complete, {ckpt.intact_text(run_dir)} (--resume writes the export)"
            ) from None
    summary = make_summary(run, status, step, last_eval)
    if status == "completed":
        summary["draft"] = run_acceptance(run)  # the student as its teacher's draft: alpha (acceptance.py)
    if export:
        summary["export"] = export
    if dist.active():
        summary["world_size"] = dist.info().world
        if dist.is_main():
            write_summary(run_dir, summary, run.label)
        dist.barrier()
        return summary
    write_summary(run_dir, summary, run.label)
    return summary


def write_summary(run_dir: Path, summary: dict[str, Any], label: str) -> None:
    """summary.json and loss.png, as one line on a disk-full, read-only or permission fault."""
    with write_guard(run_dir / "summary.json", what="write the summary", intact=ckpt.intact_text(run_dir)):
        atomic_write_json(run_dir / "summary.json", summary)
        plot_losses(run_dir, title=label)


def export_student(run: Run) -> None:
    """The student as a Hugging Face directory in run_dir/student (rank 0 under torchrun); a LoRA
    student's adapters in PEFT's layout in run_dir/adapter (`kdistill export --merge` folds them in),
    under torchrun gathered whole (collective) and written by rank 0."""
    # the tokenizer files (and template) of the model whose tokenizer the student has
    out = run.run_dir / "student"
    source = Path(run.cfg.student.path if run.cfg.kd.cross_tokenizer else run.cfg.teacher.path)
    template = exported_chat_template(run.cfg, run.data_stats.get("format") == "conversations")
    if has_lora(run.ctx.student):
        student, adapter = run.ctx.student, run.run_dir / "adapter"
        base = str(Path(run.cfg.student.path).resolve())
        full = dist.full_model_state(student, trainable_only=True) if dist.active() else None
        dist.run_on_main(
            lambda: save_adapter(student, adapter, base_model=base, tensors=full, chat_template=template)
        )
        return
    if dist.active():
        plain = dist.unsharded_copy(run.ctx.student)  # collective; rank 0 gets the full student
        if plain is not None:
            save_model(plain, out, source_dir=source, chat_template=template)
        dist.barrier()
    else:
        save_model(run.ctx.student, out, source_dir=source, chat_template=template)


def make_summary(run: Run, status: str, step: int, last_eval: dict[str, Any]) -> dict[str, Any]:
    """summary.json: status, losses (smoke contract), held-out, throughput, counters, kernels, device."""
    counters, device = run.counters, run.device
    initial, final, smoke = smoke_contract(read_metrics(run.run_dir / "metrics.jsonl"))
    summary: dict[str, Any] = {
        "status": status,
        "steps": step,
        "initial_loss": initial,
        "final_loss": final,
        "smoke_passed": smoke,
        # No held-out data (or no eval yet): null, never 0.0.
        "heldout": {
            k: last_eval.get(k) if last_eval.get("tokens", 1) else None
            for k in ("student_loss", "teacher_loss", "kl_to_teacher")
            if k in last_eval
        },
        "tokens_per_s": counters["tokens_seen"] / counters["train_seconds"]
        if counters["train_seconds"]
        else None,
        # training steps only (no evals, checkpoints or set-up), after each process's first steps and
        # without the profiled ones
        "tokens_per_s_steady": run.steady[1] / run.steady[0] if run.steady[0] else None,
        "tokens_seen": counters["tokens_seen"],
        "nonfinite_skipped": counters["nonfinite_skipped"],
        "degenerate_batches": counters["degenerate_batches"],
        "jit_after_prewarm": run.kernels.jit_after_prewarm(),
        "kernels": run.kernels.summary(),
        "device": str(device),
        "layout": dataclasses.asdict(run.layout),
        "wall_seconds": time.time() - run.t_start,
    }
    if device.type == "cuda":
        per_process = run.cfg.schedule.batch_size // dist.info().world
        planned = estimate_memory(
            run.teacher_spec,
            run.student_spec,
            run.cfg,
            batch=per_process,
            layout=run.layout,
            extra_teachers=run.extra_specs,
        )["total"]
        summary["peak_memory_gib"] = (torch.cuda.max_memory_allocated(device) - run.memory_base) / GIB
        summary["peak_reserved_gib"] = torch.cuda.max_memory_reserved(device) / GIB  # graph pools included
        summary["planned_memory_gib"] = planned / GIB
    else:
        summary["kernels"].pop("arch", None)  # the arch of a GPU that did not run: only on a GPU run
    if run.ctx.onpolicy is not None:
        summary["on_policy"] = run.ctx.onpolicy.summary()
    # runtime.cuda_graphs: steps captured, replayed and run eagerly; "off" when the step is never captured
    summary["cuda_graphs"] = run.ctx.graph.summary() if run.ctx.graph is not None else "off"
    if run.cfg.runtime.profile_steps:
        summary["profiled_steps"] = list(run.profiled_steps)  # [] when the run never reached them
    if run.data_stats:  # conversations: how full the packed rows are and what is learned
        keys = (
            "format",
            "packing_efficiency",
            "train_learned_tokens",
            "train_documents",
            "truncated",
            "dropped",
        )
        summary["data"] = {k: run.data_stats[k] for k in keys}
        summary["data"]["chat_template"] = run.data_stats["chat_template"]
        summary["data"]["train_on"] = run.data_stats["train_on"]
    return summary
