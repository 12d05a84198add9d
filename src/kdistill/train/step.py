"""One training step and the held-out evaluation.

    r = compute_loss(student, teacher, input_ids, labels, cfg, amp)     # KDLossResult (loss, ce, kd, tokens)
    r = compute_loss(..., position_ids=pos, doc_ids=doc)                # packed conversations
    r = batch_loss(student, batch, source, cfg, amp, extras)            # any TargetSource (train/targets.py)
    out = train_step(ctx, batcher, step, counters, policy)              # one optimizer step
    res = heldout_eval(student, teacher, batches, cfg, device, amp, with_teacher_loss=True)

A step: the learning rate of the schedule; grad_accum micro-batches (teacher forward without grad,
student forward, chunked KD loss, backward of loss / grad_accum); under torchrun the logged values
are token-weighted means over all processes; gradient clipping; then AdamW, unless the loss or the
gradient norm is not finite, in which case the non-finite policy skips the batch or stops the run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import record_function

from kdistill import dispatch
from kdistill.config import RunConfig
from kdistill.data import Batcher, check_batch
from kdistill.errors import UserError
from kdistill.models.decoder import Decoder
from kdistill.ops.kd_loss import HELDOUT_TEMPERATURE, check_token_ids, label_count
from kdistill.train import distributed as dist
from kdistill.train import faults
from kdistill.train.graph import StepGraph, signature
from kdistill.train.onpolicy import OnPolicy, generate_and_score, generated_accumulate, scored_update
from kdistill.train.optim import lr_at
from kdistill.train.profiling import PHASE_PREFIX
from kdistill.train.targets import (
    MicroBatch,
    Targets,
    TargetSource,
    batch_loss,
    extra_terms,
    head_operands,
    target_source,
    teacher_operands,
)

log = logging.getLogger("kdistill")


def compute_loss(
    student: Decoder,
    teacher: Decoder | None,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    cfg: RunConfig,
    amp: contextlib.AbstractContextManager,
    position_ids: torch.Tensor | None = None,
    doc_ids: torch.Tensor | None = None,
    *,
    cross: Any = None,
) -> dispatch.KDLossResult:
    """The loss of one live teacher (or, with `cross`, a cross-tokenizer teacher) on a batch: the
    step's batch -> targets -> loss (kdistill.train.targets) for callers holding tensors, with the
    config's layer map. position_ids, doc_ids (B, T): packed conversations; None for raw text."""
    batch = MicroBatch(input_ids, labels, position_ids, doc_ids)
    source = target_source(teacher, cross=cross)
    return batch_loss(student, batch, source, cfg, amp, extra_terms(cfg) if cross is None else None)


@torch.no_grad()
def heldout_eval(
    student: Decoder,
    teacher: Decoder | None,
    batches: list,
    cfg: RunConfig,
    device: torch.device,
    amp: contextlib.AbstractContextManager,
    with_teacher_loss: bool,
    mixture: list[tuple[Decoder, float]] | None = None,
) -> dict[str, float]:
    """Token-weighted held-out CE of the student, KL(teacher || student) at T=1, and teacher CE.
    A batch is (input_ids, labels) or, packed conversations, (input_ids, labels, position_ids, doc_ids).
    Under torchrun each process evaluates its share of every batch's rows and the sums (loss x tokens,
    tokens) are added over the processes: the one-process result, in 1/world of the time.
    A mixture (several teachers): the KL is to their mixture; the teacher CE is the first teacher's."""
    tot = {"student": 0.0, "kl": 0.0, "teacher": 0.0}
    tokens = 0
    multi = dist.active()
    check_token_ids(batches, int(student.lm_head_weight.shape[0]), cfg.kd.ignore_index)  # as training does
    for batch in batches:
        count = True
        if multi:
            batch, count = _eval_rows(tuple(batch))
        input_ids, labels, *docs = (t.to(device) for t in batch)
        flat = labels.flatten()
        with amp:
            s_h, s_w = head_operands(student(input_ids, *docs).flatten(0, 1), student.lm_head_weight)
            t_h, t_w = None, None
            if teacher is not None:
                t_h, t_w = head_operands(teacher(input_ids, *docs).flatten(0, 1), teacher.lm_head_weight)
        common: dict[str, Any] = dict(
            temperature=HELDOUT_TEMPERATURE,
            divergence="forward_kl",
            ignore_index=cfg.kd.ignore_index,
            chunk_size=cfg.kd.chunk_size,
        )
        # a mixture's teachers run forward on every process (their collectives), scored rows or not
        parts = teacher_operands(mixture, input_ids, amp, *docs) if t_h is not None and mixture else None
        if not count:  # this process had no rows of the batch: it ran a stand-in row for the collectives
            continue
        if parts is not None:
            r = dispatch.kd_loss(s_h, s_w, None, None, flat, alpha=0.5, teacher_mixture=parts, **common)
        elif t_h is not None:
            r = dispatch.kd_loss(s_h, s_w, t_h, t_w, flat, alpha=0.5, **common)
        if t_h is not None:
            tot["kl"] += float(r.kd) * r.tokens
            if with_teacher_loss:
                rt = dispatch.kd_loss(t_h, t_w, None, None, flat, alpha=0.0, **common)
                tot["teacher"] += float(rt.ce) * rt.tokens
        else:
            r = dispatch.kd_loss(s_h, s_w, None, None, flat, alpha=0.0, **common)
        tot["student"] += float(r.ce) * r.tokens
        tokens += r.tokens
    if multi:
        dist.reshard(student)  # FSDP2 keeps a root gathered after forward; no backward follows here
        if teacher is not None:
            dist.reshard(teacher)
        sums = dist.all_reduce_sum([tot["student"], tot["kl"], tot["teacher"], float(tokens)])
        tot = {"student": sums[0], "kl": sums[1], "teacher": sums[2]}
        tokens = int(sums[3])
    n = max(tokens, 1)
    out = {"student_loss": tot["student"] / n, "tokens": tokens}
    if teacher is not None:
        out["kl_to_teacher"] = tot["kl"] / n
        if with_teacher_loss:
            out["teacher_loss"] = tot["teacher"] / n
    return out


def _eval_rows(batch: tuple[torch.Tensor, ...]) -> tuple[tuple[torch.Tensor, ...], bool]:
    """This process's contiguous share of a held-out batch's rows, and whether it has any. A process
    without rows (a last batch smaller than world) runs the first row and leaves it out of the sums:
    every process must run every forward of a sharded model (each is a collective)."""
    info = dist.info()
    parts = torch.arange(batch[0].shape[0]).tensor_split(info.world)
    mine = parts[info.rank]
    if mine.numel() == 0:
        return tuple(t[:1] for t in batch), False
    lo, hi = int(mine[0]), int(mine[-1]) + 1
    return tuple(t[lo:hi] for t in batch), True


# ----------------------------------------------------------------------------------------------
# The optimizer step
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass
class StepContext:
    """What every step works on. `rows`: this process's slice of each batch under torchrun, else None."""

    cfg: RunConfig
    student: Decoder
    teacher: Decoder | None  # None with a teacher cache
    opt: torch.optim.Optimizer
    device: torch.device
    amp: contextlib.AbstractContextManager
    rows: slice | None
    cache: Any = None  # a kdistill.teacher_cache.TeacherCache (teacher.cache), else None
    mixture: list[tuple[Decoder, float]] | None = None  # several teachers: [(teacher, weight), ...]
    cross: Any = None  # kd.cross_tokenizer: a kdistill.train.cross_tok.CrossTokenizer
    source: TargetSource | None = None  # the teacher's side of the loss (default: from the fields above)
    onpolicy: OnPolicy | None = None  # kd.on_policy / kd.seq_kd: the steps that train on generated text
    extras: Any = None  # the loss's extra terms (kd.layer_map: a kdistill.train.layers.LayerMap)
    graph: StepGraph | None = None  # runtime.cuda_graphs: the data steps captured and replayed
    # torch's fused AdamW on one device reads the learning rate from this device scalar, captured or not
    # (a captured update cannot take a host float that changes every step; eager steps use the same
    # kernel so a captured run's values equal an eager run's bit for bit)
    lr_device: torch.Tensor | None = None
    # under torchrun with a whole student on every process (runtime.student_placement=replicate): its
    # gradients' average over the processes, before clipping (kdistill.train.distributed.GradAverage)
    grad_average: dist.GradAverage | None = None

    def __post_init__(self) -> None:
        if self.source is None:
            self.source = target_source(
                self.teacher, mixture=self.mixture, cache=self.cache, cross=self.cross
            )
        if self.extras is None and self.cross is None:
            self.extras = extra_terms(self.cfg)
        if self.lr_device is None and type(self.opt) is torch.optim.AdamW and self.opt.defaults.get("fused"):
            self.lr_device = torch.zeros((), dtype=torch.float32, device=self.device)


@dataclasses.dataclass
class StepResult:
    """One step's means over its micro-batches (None when skipped), and what the metrics line shows."""

    lr: float
    loss: float | None
    ce: float | None
    kd: float | None
    grad_norm: float | None
    tokens: int
    skipped: str | None  # why the batch was skipped (a non-finite loss or gradient norm)
    degenerate: bool  # a micro-batch had too few scored tokens (see data.check_batch)
    stop_any: bool = False  # under torchrun: some process had been asked to stop (a signal)
    generated: dict[str, Any] = dataclasses.field(default_factory=dict)  # a generated step's stats


class NonFinitePolicy:
    """runtime.on_nonfinite and runtime.max_nonfinite: skip a non-finite step with a warning, or stop."""

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.consecutive = 0

    def good(self) -> None:
        self.consecutive = 0

    def bad(self, step: int, cause: str, counters: dict[str, Any]) -> None:
        """Step `step` (1-based) had a non-finite value: count it, then warn or raise a UserError."""
        counters["nonfinite_skipped"] += 1
        self.consecutive += 1
        rt = self.cfg.runtime
        if rt.on_nonfinite == "stop":
            raise UserError(
                f"step {step}: non-finite value ({cause}); stopped "
                "(runtime.on_nonfinite=stop); the last good checkpoint is kept"
            )
        if self.consecutive >= rt.max_nonfinite:
            raise UserError(
                f"step {step}: {self.consecutive} non-finite steps in a row "
                f"({cause}); stopped (runtime.max_nonfinite={rt.max_nonfinite})"
            )
        log.warning("step %d: non-finite value (%s): batch skipped", step, cause)


def train_step(
    ctx: StepContext,
    batcher: Batcher,
    step: int,
    counters: dict[str, Any],
    policy: NonFinitePolicy,
    stop_requested: Callable[[], bool] = lambda: False,
) -> StepResult:
    """Optimizer step `step` (0-based): accumulate grad_accum micro-batches, clip, then AdamW or skip.

    The step waits for the GPU once, at its end, when it reads back its logged values. Everything it
    decides on before that stays on the device: the losses' finiteness and the gradient norm make the
    fused AdamW's `found_inf` flag, which skips the update in the kernel (a skipped step changes no
    weight, moment or step count, as before). An optimizer without that flag (the CPU's multi-tensor
    AdamW) reads the flag back before its step instead.

    Under torchrun `stop_requested()` (this process got a signal) rides on the step's all-reduce, and
    `stop_any` says whether any process had: every process reads the same answer, so all stop after the
    same step without a collective of their own."""
    with record_function(PHASE_PREFIX + "step"):  # the step's range in a profile (runtime.profile_steps)
        return _train_step(ctx, batcher, step, counters, policy, stop_requested)


def _train_step(
    ctx: StepContext,
    batcher: Batcher,
    step: int,
    counters: dict[str, Any],
    policy: NonFinitePolicy,
    stop_requested: Callable[[], bool],
) -> StepResult:
    """train_step's body."""
    cfg, opt = ctx.cfg, ctx.opt
    lr = lr_at(step, cfg.schedule.steps, cfg.optim)
    for g in opt.param_groups:
        g["lr"] = lr
    if ctx.lr_device is not None:
        ctx.lr_device.fill_(lr)  # a fill: no wait for the GPU
    kind = ctx.onpolicy.kind(step) if ctx.onpolicy is not None else "data"
    generated: dict[str, Any] = {}
    stops = None
    stop_any = False  # under torchrun: some process had been asked to stop (read back below, or from scoring)
    if kind == "data" and ctx.graph is not None:
        packed, tokens, degenerate = _graphed(ctx, ctx.graph, batcher, step, counters)
    elif ctx.graph is not None:  # a generated step of a run that captures them (kdistill.train.graph)
        assert ctx.onpolicy is not None
        packed, tokens, stats, stop_any = _generated_graphed(
            ctx, ctx.graph, ctx.onpolicy, step, kind, stop_requested
        )
        degenerate, generated = False, stats.row()
    else:
        if ctx.graph is None or not ctx.graph.restore_grads():
            opt.zero_grad(set_to_none=True)
        if kind == "data":
            means, tokens, degenerate, stops = _accumulate(ctx, batcher, step, counters, stop_requested)
        else:  # the student's (or the teacher's) completions of the data's prompts (train/onpolicy.py)
            assert ctx.onpolicy is not None
            means, tokens, stats, stops = generated_accumulate(ctx, ctx.onpolicy, step, kind, stop_requested)
            degenerate, generated = False, stats.row()
        parts = _update(ctx, means)
        if isinstance(tokens, torch.Tensor):  # under torchrun: the tokens and the stop requests, summed
            parts += [tokens.reshape(1), stops.reshape(1)]  # type: ignore[union-attr]
        packed = torch.cat(parts + [means[:, 0]])
    # the step's one read-back: [loss, ce, kd] summed over the micro-batches, the norm, the flags,
    # (under torchrun) the tokens and stop requests, then each micro-batch's loss
    out = packed.tolist()
    loss_sum, ce_sum, kd_sum, grad_norm, loss_finite, good = out[:6]
    micro_losses = out[6:]
    if isinstance(tokens, torch.Tensor):
        tokens, stop_any = int(out[6]), out[7] > 0
        micro_losses = out[8:]
    cause = None
    if not loss_finite:
        bad = next(v for v in micro_losses if not math.isfinite(v))
        cause, grad_norm = f"loss is {bad}", None
    elif not good:
        cause = f"gradient norm is {grad_norm}"
    if cause is not None:
        if ctx.graph is None or not ctx.graph.restore_grads():
            opt.zero_grad(set_to_none=True)
        policy.bad(step + 1, cause, counters)
    else:
        policy.good()
    acc = cfg.schedule.grad_accum
    sums = [loss_sum, ce_sum, kd_sum]
    mean = [None if cause is not None else v / acc for v in sums]
    return StepResult(
        lr, mean[0], mean[1], mean[2], grad_norm, tokens, cause, degenerate, stop_any, generated
    )


def _update(ctx: StepContext, means: torch.Tensor) -> list[torch.Tensor]:
    """Clip, test and update, all on the device: [the micro-batches' (loss, ce, kd) summed, the
    gradient norm, (loss finite, step good)] as float64 tensors. means (M, 3): the micro-batches' values.
    A non-finite loss or gradient norm skips the update: the fused AdamW's `found_inf` flag skips it
    inside the kernel; an optimizer without the flag (the CPU's) reads the flag back first."""
    cfg, opt = ctx.cfg, ctx.opt
    loss_ok = torch.isfinite(means[:, 0]).all()
    clip = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else float("inf")
    if ctx.grad_average is not None:
        ctx.grad_average(ctx.student)
    fused = bool(opt.defaults.get("fused"))
    if fused:
        # the fused kernel divides each gradient by `grad_scale` as it reads it: clipping without a
        # pass of its own over the gradients (1 when the norm is within the clip)
        norm = gradient_norm(ctx.student)
        opt.grad_scale = clip_divisor(norm, clip)  # type: ignore[attr-defined]
    else:
        norm = clip_gradients(ctx.student, clip)
    ok = loss_ok & torch.isfinite(norm)
    if fused:
        opt.found_inf = (~ok).float()  # type: ignore[attr-defined]
        if ctx.lr_device is not None:
            lrs = [g["lr"] for g in opt.param_groups]
            for g in opt.param_groups:
                g["lr"] = ctx.lr_device
            try:
                opt.step()
            finally:
                for g, v in zip(opt.param_groups, lrs, strict=True):
                    g["lr"] = v  # the state dict keeps a float
        else:
            opt.step()
    elif bool(ok):
        opt.step()
    return [means.sum(0), norm.double().reshape(1), torch.stack([loss_ok, ok]).double()]


def _packed(ctx: StepContext, means: torch.Tensor) -> torch.Tensor:
    """A one-process step's update and its read-back values, as train_step reads them: `_update`'s
    parts, then each micro-batch's loss. means (M, 3)."""
    return torch.cat(_update(ctx, means) + [means[:, 0]])


def _fresh_grads(ctx: StepContext, graph: StepGraph) -> None:
    """Before an eager step of a run that captures: the graph's gradients zeroed in place (after capture),
    else freed."""
    if not graph.restore_grads():
        ctx.opt.zero_grad(set_to_none=True)


def _micro(ctx: StepContext, micro_batch: MicroBatch) -> torch.Tensor:
    """One micro-batch's forward and backward (of loss / grad_accum) in one process, as `_accumulate`
    runs it: its (loss, ce, kd), float64 on the device."""
    r = batch_loss(ctx.student, micro_batch, ctx.source, ctx.cfg, ctx.amp, ctx.extras)  # type: ignore[arg-type]
    (r.loss / ctx.cfg.schedule.grad_accum).backward()
    return torch.stack([r.loss.detach(), r.ce, r.kd]).double()


def _graphed(
    ctx: StepContext, graph: StepGraph, batcher: Batcher, step: int, counters: dict[str, Any]
) -> tuple[torch.Tensor, int, bool]:
    """A data step of a run that captures its step (kdistill.train.graph): the micro-batches taken and
    counted on the host, then the step replayed, captured, or (another shape) run eagerly on the same
    code. Returns (the read-back values as the eager step packs them, the scored tokens, degenerate)."""
    cfg = ctx.cfg
    acc = cfg.schedule.grad_accum
    vocab = ctx.student.lm_head_weight.shape[0]
    host: list[tuple[tuple[torch.Tensor, ...], int | None]] = []
    degenerate = False
    for _ in range(acc):
        batch = batcher.next()
        reason = check_batch(batch[1], cfg.kd.ignore_index)
        if reason:
            degenerate = True
            counters["degenerate_batches"] += 1
            log.warning("step %d: degenerate batch (%s)", step + 1, reason)
        tensors = tuple(torch.as_tensor(t) for t in batch)
        host.append((tensors, label_count(tensors[1].flatten(), vocab, cfg.kd.ignore_index)))
    tokens = sum(n for _, n in host if n is not None)
    sig = signature(host)

    def body(inputs: list[tuple[torch.Tensor, ...]]) -> torch.Tensor:
        rows = [_micro(ctx, MicroBatch(*t, n_tokens=n)) for t, (_, n) in zip(inputs, host, strict=True)]
        return _packed(ctx, torch.stack(rows))  # (M, 3) means

    nan = faults.nan_step(step + 1)  # a test's NaN loss is a host decision: that step runs eagerly
    faults.poison(step + 1, ctx.student)  # in place: the graph reads the poisoned weight
    if graph.ready(sig) and not nan:
        packed = graph.replay(host)
    elif graph.capture_now(sig) and not nan:
        packed = graph.capture(host, ctx.opt, ctx.student, body)
    else:
        graph.note_eager(sig)
        _fresh_grads(ctx, graph)
        inputs = [tuple(t.to(ctx.device, non_blocking=True) for t in tensors) for tensors, _ in host]
        if nan:
            rows = [_micro(ctx, MicroBatch(*t, n_tokens=n)) for t, (_, n) in zip(inputs, host, strict=True)]
            rows[0][0] = float("nan")
            packed = _packed(ctx, torch.stack(rows))
        else:
            packed = body(inputs)
    for micro in range(acc):
        faults.at(f"{step + 1}.{micro + 1}")
    return packed, tokens, degenerate


# a generated step is captured or replayed when its completion tokens fill at least this share of the
# KD head's fixed rows (OnPolicy.head_rows): below, the ignored rows' GEMMs would cost more than the
# host time the graph saves (NOTES.md round twenty: ~50 ms a step on the 7B -> 1.5B row)
MIN_FILL = 0.5


def _generated_graphed(
    ctx: StepContext,
    graph: StepGraph,
    op: OnPolicy,
    step: int,
    kind: str,
    stop_requested: Callable[[], bool] = lambda: False,
) -> tuple[torch.Tensor, int, Any, bool]:
    """A generated step of a run that captures them (kdistill.train.graph): written and scored eagerly,
    then its update replayed, captured, or (another signature: the other kind of generated step) run
    eagerly in the same form; a step whose completions fill less than MIN_FILL of the head's rows runs
    eagerly with the labels counted on the host. Returns (the read-back values as the eager step packs
    them, the completion tokens over every process, the step's GeneratedStats, whether any process was
    asked to stop).

    Under torchrun (a whole student on every process, runtime.student_placement): each micro-batch's
    loss weight (its share of the completion tokens over every process, as the eager step weighs it) is
    one more input of the graph, the logged means are summed over the processes inside it (each weighted
    by its share) and the gradients averaged there (distributed.GradAverage): every collective of the
    update is captured. Every process takes the same branch (the fill is of the tokens over all of them)."""
    sc = generate_and_score(ctx, op, step, kind, stop_requested)
    acc = ctx.cfg.schedule.grad_accum
    multi = op.rows is not None
    world = dist.info().world if multi else 1
    weight = sc.targets[0].weight
    heads = [op.head_rows(b.labels.shape[0]) for b in sc.batches]
    if any(c > n for c, n in zip(sc.counts, heads, strict=True)):
        raise RuntimeError(f"generated rows hold {sc.counts} completion tokens, more than the heads' {heads}")
    if sum(sc.totals) < MIN_FILL * sum(heads) * world:
        # short completions (reasoning-length runs whose rows stopped early): the fixed head would
        # compute mostly ignored rows; this step counts its rows on the host and runs eagerly
        graph.note_eager(("counted", kind))
        _fresh_grads(ctx, graph)
        means, _, stats, _ = scored_update(ctx, op, sc, step)
        return _packed(ctx, means), sum(sc.totals), stats, sc.stop_any
    host: list[tuple[tuple[torch.Tensor, ...], int | None]] = []
    for b, t, n, c, total in zip(sc.batches, sc.targets, heads, sc.counts, sc.totals, strict=True):
        hidden = () if t.hidden is None else (t.hidden,)
        # under torchrun: this process's share of the micro-batch's completion tokens (dist.loss_weight)
        share = (torch.tensor([dist.loss_weight(c, total)[0]], dtype=torch.float32),) if multi else ()
        host.append(((b.input_ids, b.labels, *hidden, *share), n))
    sig = signature(host, kind)

    def body(inputs: list[tuple[torch.Tensor, ...]], nan: bool = False) -> torch.Tensor:
        rows = []
        for tensors, (_, n) in zip(inputs, host, strict=True):
            ids, labels, *rest = tensors
            share = rest.pop()[0] if multi else None
            targets = Targets(hidden=rest[0], weight=weight) if rest else Targets()
            micro = MicroBatch(ids, labels, rows=n)
            r = batch_loss(ctx.student, micro, ctx.source, sc.cfg, ctx.amp, None, sc.objective, targets)  # type: ignore[arg-type]
            values = torch.stack([r.loss.detach(), r.ce, r.kd]).double()
            if share is None:
                (r.loss / acc).backward()
            else:  # weighted as the eager step weighs it; the means summed over processes below
                (r.loss * (share / acc)).backward()
                values = values * (share.double() / world)
            rows.append(values)
        if nan:
            rows[0][0] = float("nan")
        means = torch.stack(rows)  # (M, 3)
        if multi:
            means = dist.all_reduce_tensor(means)
        return _packed(ctx, means)

    nan = faults.nan_step(step + 1)  # a test's NaN loss is a host decision: that step runs eagerly
    faults.poison(step + 1, ctx.student)
    if graph.ready(sig) and not nan:
        packed = graph.replay(host)
    elif graph.capture_now(sig) and not nan:
        packed = graph.capture(host, ctx.opt, ctx.student, body, sig)
    else:
        graph.note_eager(sig)
        _fresh_grads(ctx, graph)
        packed = body([tuple(t.to(ctx.device) for t in tensors) for tensors, _ in host], nan)
    for micro in range(acc):
        faults.at(f"{step + 1}.{micro + 1}")
    return packed, sum(sc.totals), sc.stats, sc.stop_any


def clip_gradients(model: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """clip_grad_norm_ over the model's gradients, as a device scalar, without waiting for the GPU.
    Sharded gradients (FSDP2's DTensors) are clipped through their local shards (`gradient_norm`)."""
    params = [p for p in model.parameters() if p.grad is not None]
    if not params:
        return gradient_norm(model)  # 0
    if not hasattr(params[0].grad, "to_local"):
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    local = _local_grads([p.grad for p in params])  # type: ignore[misc]
    norm = _sharded_norm(local, params[0].device)
    if local and math.isfinite(max_norm):
        torch._foreach_mul_(local, (max_norm / (norm + 1e-6)).clamp(max=1.0).to(local[0].dtype))
    return norm


def clip_divisor(norm: torch.Tensor, max_norm: float) -> torch.Tensor | None:
    """What the fused AdamW divides the gradients by (its `grad_scale`) to clip them to max_norm:
    max(1, (norm + 1e-6) / max_norm), float32 on the norm's device; None with no clip (max_norm inf)."""
    if not math.isfinite(max_norm):
        return None
    return ((norm.float() + 1e-6) / max_norm).clamp(min=1.0)


def gradient_norm(model: torch.nn.Module) -> torch.Tensor:
    """The L2 norm of the model's gradients, a float32 device scalar, without waiting for the GPU (0 with no
    gradient). Sharded gradients (FSDP2's DTensors) through their local shards: one all-reduce of the
    squared norm instead of DTensor's dispatch for every tensor."""
    params = [p for p in model.parameters() if p.grad is not None]
    if not params:
        return torch.zeros((), device=next(model.parameters()).device)
    grads: list[torch.Tensor] = [p.grad for p in params]  # type: ignore[misc]
    if not hasattr(grads[0], "to_local"):
        return torch.nn.utils.get_total_norm(grads).float()
    return _sharded_norm(_local_grads(grads), params[0].device)


def _local_grads(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """FSDP2's sharded gradients (DTensors) as their local shards, empty ones left out."""
    if not all(hasattr(g, "to_local") for g in grads):
        raise RuntimeError("gradients partly sharded: the student's parameters are all FSDP2 units or none")
    return [g for g in (s.to_local() for s in grads) if g.numel()]  # type: ignore[attr-defined]


def _sharded_norm(local: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The norm over every process's local shards: their squared norms summed, one all-reduce."""
    square = torch.zeros((), dtype=torch.float32, device=local[0].device if local else device)
    if local:
        square = torch.stack([n.float() for n in torch._foreach_norm(local)]).square().sum()
    dist.all_reduce_tensor(square)
    return square.sqrt()


def _accumulate(
    ctx: StepContext,
    batcher: Batcher,
    step: int,
    counters: dict[str, Any],
    stop_requested: Callable[[], bool],
) -> tuple[torch.Tensor, int | torch.Tensor, bool, torch.Tensor | None]:
    """The micro-batches of one step, forward and backward: (their loss, ce, kd means (M, 3) on the
    device, float64, token-weighted over the processes under torchrun; the scored tokens, over all
    processes as a device scalar under torchrun; whether a micro-batch was degenerate; under torchrun
    the number of processes whose `stop_requested()` was true, a device scalar, else None).

    Nothing here waits for the GPU: the scored tokens are counted on the batch's host copy before the
    forward (under torchrun, on the global batch, so every process knows every process's count and the
    weight of its own loss without a collective), and the means are combined on the device (one
    all-reduce under torchrun)."""
    cfg, multi = ctx.cfg, ctx.rows is not None
    step_tokens = 0
    degenerate = False
    rows: list[torch.Tensor] = []
    vocab = ctx.student.lm_head_weight.shape[0]
    ignore = cfg.kd.ignore_index
    for micro in range(cfg.schedule.grad_accum):
        batch = batcher.next()  # (input_ids, labels[, position_ids, doc_ids]), on the host
        reason = check_batch(batch[1], ignore)
        if reason:
            degenerate = True
            counters["degenerate_batches"] += 1
            log.warning("step %d: degenerate batch (%s)", step + 1, reason)
        weight = 1.0
        if multi:
            everyone = int((torch.as_tensor(batch[1]) != ignore).sum())
            batch = tuple(t[ctx.rows] for t in batch)
        n_tokens = None
        if ctx.cross is None:
            n_tokens = label_count(torch.as_tensor(batch[1]).flatten(), vocab, ignore)
        if multi:  # this process's share of the tokens over all processes weighs its mean loss
            mine = n_tokens if n_tokens is not None else int((torch.as_tensor(batch[1]) != ignore).sum())
            weight, _ = dist.loss_weight(mine, everyone)
        assert ctx.source is not None
        cached = ctx.source.fetch(batcher.last_indices, ctx.rows, ctx.device)  # a teacher cache's rows
        input_ids, labels, *docs = (t.to(ctx.device, non_blocking=True) for t in batch)
        faults.poison(step + 1, ctx.student)
        micro_batch = MicroBatch(input_ids, labels, *docs, n_tokens=n_tokens, cached=cached)
        r = batch_loss(ctx.student, micro_batch, ctx.source, cfg, ctx.amp, ctx.extras)
        if multi:
            (r.loss * (weight / cfg.schedule.grad_accum)).backward()
            for teacher in ctx.source.teachers:
                dist.reshard(teacher)  # after backward: the KD head's backward reads its lm_head
        else:
            (r.loss / cfg.schedule.grad_accum).backward()
        # Device tensors only: a host value copied to the GPU (torch.tensor(..., device=), new_tensor)
        # waits for the stream, that is for this micro-batch's backward; fills do not.
        values = torch.stack([r.loss.detach(), r.ce, r.kd]).double()
        if faults.nan_step(step + 1) and micro == 0:
            values[0] = float("nan")
        if multi:  # summed over processes as loss x tokens, then divided by all their tokens
            values = torch.cat([values * r.tokens, values.new_full((1,), float(r.tokens))])
        rows.append(values)
        step_tokens += int(r.tokens)
        faults.at(f"{step + 1}.{micro + 1}")
    stacked = torch.stack(rows)  # (M, 3), or (M, 4) with the token counts under torchrun
    if not multi:
        return stacked, step_tokens, degenerate, None
    flag = stacked.new_zeros((1, 4))  # one more row: this process's stop request, summed with the rest
    if stop_requested():
        flag[0, 0] = 1.0
    both = dist.all_reduce_tensor(torch.cat([stacked, flag]))
    sums = both[:-1]
    return sums[:, :3] / sums[:, 3:].clamp(min=1.0), sums[:, 3].sum(), degenerate, both[-1, 0]
