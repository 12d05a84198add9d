"""On-policy distillation: steps whose completions the student writes and the teacher grades token by token.

    op = OnPolicy(cfg, prompts, stop_ids, pad_id, device, rows=None)   # rows: this process's, torchrun
    kind = op.kind(step)                                       # "on_policy", "seq_kd" or "data"
    means, tokens, stats, stops = generated_accumulate(ctx, op, step, kind)   # not the data's batches
    state = op.state_dict(); op.load_state_dict(state)         # in every checkpoint: exact resume

A step is on-policy with probability kd.on_policy (GKD's lambda), drawn from (seed, step) alone so a
resumed run makes the same choices; otherwise, with probability kd.seq_kd, its completions are the
teacher's; else it trains on the data as any run does. A generated step has three phases:

1. generation: the prompts of all its micro-batches (schedule.grad_accum x batch_size rows, each
   prompt kd.samples_per_prompt times) completed in one batched call (kdistill.train.rollouts) from
   the current weights, sampled at kd.sampling_temperature with the run's generator; the decode engine
   writes at most kd.rollout_batch rows at once (0: all), a stopped row's slot taking the next prompt;
2. scoring: the teacher's targets of every micro-batch, without gradients (any live TargetSource);
3. update: the student's forward and the loss on the completion tokens (the prompt's labels are the
   ignore index), normalised by the number of completion tokens, then backward.

On-policy steps train on the divergence alone (kd.alpha = 1: the CE of a sample the student wrote
itself would only reinforce it), with kd.divergence over the full vocabulary at every completion
position, or with kd.on_policy_loss=sampled_reverse_kl the policy-gradient form that needs the
teacher's log-prob of the sampled token only (kdistill.ops.onpolicy_loss). Teacher-written (seq_kd)
steps train with the run's own kd.alpha and divergence, as on the data.

Rows are right-padded to data.seq_len, so every micro-batch has the training shapes the kernel plan
was warmed at; a prompt longer than seq_len + 1 - kd.max_new_tokens keeps its last tokens.

Under torchrun every process draws the same prompts (the prompt order is the run's) and completes its own
rows of each micro-batch (`rows`, the slice of the batch off-policy steps take), with a sampling generator
of its own (seeded from the run's seed and its rank; every process's state goes in the checkpoint). The
writer is whole on every process while it writes, and writing has no collective, so processes that
stop early wait for nobody: the decode engine (GPU) gathers a sharded writer's weights into its own copy
once per generation (kdistill.decode.copy_whole: a few bucketed all-gathers in bf16, each parameter
written straight into the engine's rows; or, with the student's blocks kept gathered from forward to
backward, FSDP's own gather of the whole student, which the update's forward then uses without
gathering again); on a CPU the engine of each rollout writes with a gathered plain copy
(distributed.gathered_copy), whose tensors it shares.
Each process scores its own rows, then one all-reduce of the completion-token counts (after scoring: a
process that wrote faster scores while the others still write): each process's loss is
weighted by its share of the micro-batch's tokens over all processes (as off-policy steps weigh theirs),
so the gradient is that of the loss over every process's samples, normalised by all their completion
tokens. Scoring and update are forwards of the sharded models at the same shapes on every process
(rows padded to seq_len), and the logged means and sample counts are over all processes.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch.profiler import record_function

from kdistill.config import RunConfig
from kdistill.data import Batcher
from kdistill.data.chat_pack import PackedRows
from kdistill.decode import MIN_TEMPERATURE
from kdistill.errors import UserError
from kdistill.generate import stop_token_ids
from kdistill.ops.kd_loss import label_count
from kdistill.samples import sample_prompts
from kdistill.train import distributed as dist
from kdistill.train import faults
from kdistill.train.profiling import PHASE_PREFIX
from kdistill.train.rollouts import Rollout, RolloutSampling, rollout
from kdistill.train.targets import LiveTeacher, MicroBatch, batch_loss

KINDS = ("data", "on_policy", "seq_kd")
PHASES = ("generate", "wait", "score", "update")  # metrics.jsonl's phase_s: every process's seconds of each
log = logging.getLogger("kdistill")


class WindowPrompts(Sequence[list[int]]):
    """The prompts of raw text: the first half (at least one token) of each training window (N, T + 1),
    read from the windows when drawn (no copy of the data)."""

    def __init__(self, windows: np.ndarray) -> None:
        self.windows = windows
        self.length = max(1, windows.shape[1] // 2)

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return [int(t) for t in self.windows[i, : self.length]]


def prompt_pool(train: Any) -> Sequence[list[int]]:
    """Every prompt of the training data: each conversation up to its first answer, the template's
    header of the answer included, whatever data.train_on learns (train_on=all: where packing marked
    it, kdistill.data.chat_data.prompt_tokens); for raw text, the first half of each window
    (WindowPrompts: the text the completion continues)."""
    if not isinstance(train, PackedRows):
        windows = np.asarray(train)
        if windows.ndim != 2 or len(windows) == 0 or windows.shape[1] < 2:
            raise UserError("kd.on_policy and kd.seq_kd need prompts, but data.train has no text windows")
        return WindowPrompts(windows)
    prompts = sample_prompts(train, len(train) * max(1, int(train.doc_ids.max()) + 1))
    if not prompts:
        raise UserError(
            "kd.on_policy and kd.seq_kd need prompts, but data.train has no learned answer tokens"
        )
    return prompts


def rollout_stop_ids(cfg: RunConfig, tokenizer: Any, template: Any) -> set[int]:
    """The stop tokens of generated steps: the writer's EOS ids (the teacher's; across tokenizers the
    student's, whose tokens the completions are) and, for conversations, the template's end-of-turn token
    rendered with data.template_kwargs (the variables the data is rendered with)."""
    writer = cfg.student.path if cfg.kd.cross_tokenizer else cfg.teacher.path
    return stop_token_ids(writer, tokenizer, template, cfg.data.template_kwargs)


def generator_seed(seed: int, rank: int) -> int:
    """The seed of a process's sampling generator: seed + 1 in one process (and on rank 0), a stream of
    its own for each other rank."""
    if rank == 0:
        return int(seed) + 1
    return int(np.random.SeedSequence([int(seed), rank, 21]).generate_state(1, dtype=np.uint64)[0] >> 1)


class OnPolicy:
    """Which steps train on generated completions, the prompts they draw and the sampling generator.
    rows: this process's rows of each micro-batch under torchrun (distributed.batch_slice), else None."""

    def __init__(
        self,
        cfg: RunConfig,
        prompts: Sequence[list[int]],
        stop_ids: set[int],
        pad_id: int,
        device: torch.device,
        rows: slice | None = None,
        student_kept: bool = False,
    ) -> None:
        kd, sched = cfg.kd, cfg.schedule
        self.cfg = cfg
        self.prompts = prompts
        self.stop_ids = stop_ids
        self.pad_id = pad_id
        self.device = device
        self.rows = rows
        self.last_prompts: list[list[int]] = []  # the pool's prompt of each row of the last generation
        # under torchrun with the student's blocks kept gathered from forward to backward
        # (memory.Layout.student_kept): the student is gathered once before it writes and stays so for the
        # update's forward, which then gathers nothing (one all-gather of the student per step, not two)
        self.share_gather = rows is not None and student_kept
        self.per_micro = sched.batch_size // kd.samples_per_prompt  # prompts per micro-batch
        # the prompts of a whole step are drawn at once, in a resumable shuffled order of their own
        self.batcher = Batcher(np.arange(len(prompts)), self.per_micro * sched.grad_accum, sched.seed)
        self.rank = dist.info().rank if rows is not None else 0
        self.generator = torch.Generator(device=device).manual_seed(generator_seed(sched.seed, self.rank))
        # under torchrun on a CPU: the gathered plain copy of each sharded writer (kept across steps)
        self.copies: dict[int, torch.nn.Module] = {}
        self.sampling = RolloutSampling(kd.max_new_tokens, kd.sampling_temperature)
        self.prompt_len = cfg.data.seq_len + 1 - kd.max_new_tokens  # the longest prompt kept
        # on a GPU the decode engine writes the completions (one per writing model, kept across steps)
        self.engines: dict[int, Any] | None = {} if device.type == "cuda" else None
        # the run's totals over its generated steps (saved with the checkpoint, for the summary)
        self.totals: dict[str, float] = {
            "on_policy_steps": 0, "seq_kd_steps": 0, "gen_seconds": 0.0, "score_seconds": 0.0,
            "update_seconds": 0.0, "completion_tokens": 0, "completions": 0, "eos": 0, "sample_kl_sum": 0.0,
        }  # fmt: skip

    def describe(self) -> str:
        kd = self.cfg.kd
        t = kd.sampling_temperature
        how = "greedy" if t < MIN_TEMPERATURE else f"at temperature {t:g}"
        return f"lambda {kd.on_policy:g}, seq_kd {kd.seq_kd:g}, {kd.on_policy_loss}, {kd.max_new_tokens} new tokens {how}"

    def kind(self, step: int) -> str:
        """Step `step` (0-based): "on_policy", "seq_kd" or "data", drawn from (seed, step) alone."""
        kd = self.cfg.kd
        u, v = np.random.default_rng([self.cfg.schedule.seed, step, 20]).random(2)
        if kd.on_policy > 0 and u < kd.on_policy:
            return "on_policy"
        if kd.seq_kd > 0 and v < kd.seq_kd:
            return "seq_kd"
        return "data"

    def generate(
        self, writer: torch.nn.Module, amp: Any, trains: bool = False
    ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], Rollout]:
        """One step's generation: grad_accum micro-batches (input_ids, labels) (batch_size, seq_len) on
        the host, and the rollout they came from; under torchrun this process's rows of each micro-batch
        (rows, seq_len) and its rollout of them (collective when the writer is sharded: see the module
        docstring). trains: the writer is the model this step updates (its gather may be shared)."""
        idx = self.batcher.next_indices()
        spp = self.cfg.kd.samples_per_prompt
        which = [i for i in idx.tolist() for _ in range(spp)]  # the pool's index of each row's prompt
        b = self.cfg.schedule.batch_size
        if self.rows is not None:  # this process's rows of each micro-batch, micro-batch after micro-batch
            r = self.rows
            which = [p for i in range(0, len(which), b) for p in which[i : i + b][r]]
            b = r.stop - r.start
        prompts = [self.prompts[i][-self.prompt_len :] for i in which]
        self.last_prompts = [which[i : i + b] for i in range(0, len(which), b)]  # per micro-batch
        if self.rows is not None:
            if trains and self.share_gather and dist.is_sharded(writer):
                dist.unshard(writer)  # the copies below read whole tensors; the update's forward too
            if self.engines is None and dist.is_sharded(writer):
                writer = self.copies[id(writer)] = dist.gathered_copy(writer, self.copies.get(id(writer)))
        out = rollout(
            writer,
            prompts,
            self.sampling,
            self.stop_ids,
            self.generator,
            pad_id=self.pad_id,
            amp=amp,
            engines=self.engines,
            max_len=self.cfg.data.seq_len + 1,
            batch=self.cfg.kd.rollout_slots(len(prompts)),  # the memory plan's generation rows
        )
        with record_function(PHASE_PREFIX + "generate.rows"):
            ids, labels = completion_rows(
                prompts, out.completions, self.cfg.data.seq_len, self.pad_id, self.cfg.kd.ignore_index
            )
        return [(ids[i : i + b], labels[i : i + b]) for i in range(0, len(prompts), b)], out

    def head_rows(self, rows: int) -> int:
        """The most completion tokens a micro-batch of `rows` generated rows can hold: the KD head's row
        count when the update is captured as a CUDA graph (kdistill.train.graph)."""
        return rows * min(self.cfg.kd.max_new_tokens, self.cfg.data.seq_len)

    def record(self, row: dict[str, Any], seconds: float) -> None:
        """Add a generated step's metrics row (with its update_s and, on-policy, sample_kl) to the totals."""
        t = self.totals
        t[f"{row['policy']}_steps"] += 1
        t["gen_seconds"] += row["gen_s"]
        t["score_seconds"] += row["score_s"]
        t["update_seconds"] += row["update_s"]
        t["completion_tokens"] += row["completion_tokens"]
        t["completions"] += row["completions"]
        t["eos"] += round(row["eos_fraction"] * row["completions"])
        if row.get("sample_kl") is not None:
            t["sample_kl_sum"] += row["sample_kl"]

    def summary(self) -> dict[str, Any]:
        """summary.json's `on_policy`: steps of each kind, time per phase, the samples' length, EOS
        fraction and the teacher's per-token KL on them, completion tokens per second of generated steps."""
        t = self.totals
        seconds = t["gen_seconds"] + t["score_seconds"] + t["update_seconds"]
        done = max(t["completions"], 1)
        return {
            "on_policy_steps": int(t["on_policy_steps"]),
            "seq_kd_steps": int(t["seq_kd_steps"]),
            "gen_seconds": t["gen_seconds"],
            "score_seconds": t["score_seconds"],
            "update_seconds": t["update_seconds"],
            "mean_completion_len": t["completion_tokens"] / done,
            "eos_fraction": t["eos"] / done,
            "sample_kl": t["sample_kl_sum"] / t["on_policy_steps"] if t["on_policy_steps"] else None,
            "completion_tokens_per_s": t["completion_tokens"] / seconds if seconds else None,
        }

    def state_dict(self) -> dict[str, Any]:
        """The prompt order, the sampling generator's state ("generator"; under torchrun every process's,
        in rank order: "generators", gathered, so every process calls it) and the totals."""
        state: dict[str, Any] = {"prompts": self.batcher.state_dict(), "totals": dict(self.totals)}
        mine = self.generator.get_state().tolist()
        if self.rows is None:
            state["generator"] = mine
        else:
            state["generators"] = dist.all_gather_object(mine)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Put a checkpoint's state back. A checkpoint of another number of processes has no generator
        for this one: each process then draws from a new stream derived from the seed, its rank and the
        samples drawn so far (deterministic, but not the samples the saved run would have drawn)."""
        self.batcher.load_state_dict(state["prompts"])
        self.totals.update({k: type(v)(state["totals"][k]) for k, v in self.totals.items()})
        world = dist.info().world if self.rows is not None else 1
        saved = state["generators"] if "generators" in state else [state["generator"]]
        if len(saved) == world:
            self.generator.set_state(torch.tensor(saved[self.rank], dtype=torch.uint8))
            return
        seed = np.random.SeedSequence(
            [int(self.cfg.schedule.seed), self.rank, int(self.totals["completions"]), 22]
        )
        self.generator.manual_seed(int(seed.generate_state(1, dtype=np.uint64)[0] >> 1))
        if self.rank == 0:
            log.warning(
                "kd.on_policy: the checkpoint holds the sampling generators of %d process(es), this run has "
                "%d: each process samples from a new stream from here on",
                len(saved),
                world,
            )


def completion_rows(
    prompts: list[list[int]], completions: list[list[int]], seq_len: int, pad_id: int, ignore_index: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, labels), each (rows, seq_len) int64: prompt + completion shifted by one, right-padded;
    labels only on the completion's tokens (the ignore index on the prompt and the padding). Built in
    numpy: the device waits for these rows, and a torch.tensor of a list per row took ten times longer
    (16 rows of 1,152 tokens: ~5 ms of host time against ~0.5)."""
    ids = np.full((len(prompts), seq_len), pad_id, dtype=np.int64)
    labels = np.full((len(prompts), seq_len), ignore_index, dtype=np.int64)
    for r, (p, c) in enumerate(zip(prompts, completions)):
        seq = np.array(list(p) + list(c), dtype=np.int64)[: seq_len + 1]
        ids[r, : len(seq) - 1] = seq[:-1]
        labels[r, len(p) - 1 : len(seq) - 1] = seq[len(p) :]
    return torch.from_numpy(ids), torch.from_numpy(labels)


@dataclasses.dataclass
class GeneratedStats:
    """What a generated step reports (metrics.jsonl): its kind, phase times and its samples."""

    kind: str
    gen_s: float
    score_s: float
    completion_tokens: int
    completions: int
    eos: int
    wait_s: float = 0.0  # for the other processes' samples, after scoring (0 in one process)

    def row(self) -> dict[str, Any]:
        return {
            "policy": self.kind,
            "gen_s": self.gen_s,
            "score_s": self.score_s,
            "completion_len": self.completion_tokens / max(self.completions, 1),
            "eos_fraction": self.eos / max(self.completions, 1),
            "completion_tokens": self.completion_tokens,
            "completions": self.completions,
            "wait_s": self.wait_s,
        }

    @staticmethod
    def phases(row: dict[str, Any], seconds: float) -> list[float]:
        """This process's [generate, wait, score, update] seconds of a generated step that took `seconds`
        (its metrics row, update_s not yet set): its generation, the wait after scoring for the other
        processes' samples (0 in one process), the teacher's scoring, and the rest of the step."""
        rest = max(seconds - row["gen_s"] - row["score_s"], 0.0)  # update_s: the wait and the update
        return [row["gen_s"], row["wait_s"], row["score_s"], max(rest - row["wait_s"], 0.0)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclasses.dataclass
class Scored:
    """A generated step's micro-batches on the device with the teacher's targets, before the update.
    counts: this process's completion tokens of each micro-batch; totals: over every process (the
    same in one process); cfg and objective: the step's (kd.alpha = 1 and kd.on_policy_loss on
    on-policy steps)."""

    batches: list[MicroBatch]
    targets: list[Any]
    counts: list[int]
    totals: list[int]
    stats: GeneratedStats
    cfg: RunConfig
    objective: str
    stop_any: bool = False  # under torchrun: some process had been asked to stop (summed with the counts)


def generate_and_score(
    ctx: Any, op: OnPolicy, step: int, kind: str, stop_requested: Callable[[], bool] = lambda: False
) -> Scored:
    """A generated step's first two phases (see the module docstring): the completions written, the
    rows built and scored by the teacher; under torchrun the token counts summed over processes, and
    with them whether any process's `stop_requested()` was true."""
    cfg = ctx.cfg
    multi = op.rows is not None
    writer = ctx.student if kind == "on_policy" else ctx.teacher
    t0 = time.perf_counter()
    with record_function(PHASE_PREFIX + "generate"):  # the phase's range in a profile (runtime.profile_steps)
        micro, out = op.generate(writer, ctx.amp, trains=kind == "on_policy")
    vocab = ctx.student.lm_head_weight.shape[0]
    counts = [label_count(labels.flatten(), vocab, cfg.kd.ignore_index) for _, labels in micro]
    samples = [out.tokens, len(out.completions), sum(out.stopped)]
    _sync(ctx.device)
    t1 = time.perf_counter()
    objective = "divergence"
    step_cfg = cfg
    if kind == "on_policy":
        step_cfg = dataclasses.replace(cfg, kd=dataclasses.replace(cfg.kd, alpha=1.0))
        objective = cfg.kd.on_policy_loss
    # a source that needs more of generated rows than their tokens (across tokenizers: the teacher's own
    # rendering of each completion) makes it here, on the host
    with record_function(PHASE_PREFIX + "score"):
        sides = [
            ctx.source.generated(p, labels, ctx.device) for p, (_, labels) in zip(op.last_prompts, micro)
        ]
        batches = [
            MicroBatch(ids.to(ctx.device), labels.to(ctx.device), n_tokens=n, cached=side)
            for (ids, labels), n, side in zip(micro, counts, sides)
        ]
        if (
            getattr(ctx, "graph", None) is not None
            and ctx.device.type == "cuda"
            and type(ctx.source) is LiveTeacher
        ):
            # a run that captures its update captures the teacher's scoring forward too (train/graph.py)
            scored = [ctx.source.targets(b, step_cfg, ctx.amp, forward=ctx.graph.scoring) for b in batches]
        else:
            scored = [ctx.source.targets(b, step_cfg, ctx.amp) for b in batches]
    _sync(ctx.device)
    t2 = time.perf_counter()
    # every process's token counts (the losses' weights) and samples, only now: a process that finished
    # writing first has scored its rows (a whole teacher) while the others were still writing
    totals = list(counts)
    stop_any = False
    if multi:
        summed = dist.all_reduce_sum([float(c) for c in counts + samples] + [float(stop_requested())])
        totals = [int(c) for c in summed[: len(counts)]]
        samples, stop_any = [int(c) for c in summed[len(counts) : -1]], summed[-1] > 0
    waited = time.perf_counter() - t2
    stats = GeneratedStats(
        kind, t1 - t0, t2 - t1, samples[0], samples[1], samples[2], waited if multi else 0.0
    )
    return Scored(batches, scored, counts, totals, stats, step_cfg, objective, stop_any)


def generated_accumulate(
    ctx: Any, op: OnPolicy, step: int, kind: str, stop_requested: Callable[[], bool] = lambda: False
) -> tuple[torch.Tensor, int | torch.Tensor, GeneratedStats, torch.Tensor | None]:
    """A generated step's micro-batches (see the module docstring), forward and backward: (their loss,
    ce, kd means (M, 3) on the device, float64, token-weighted over the processes under torchrun; the
    completion tokens trained on, over all processes as a device scalar under torchrun; the step's stats,
    of every process's samples; under torchrun the number of processes whose `stop_requested()` was
    true, a device scalar, else None), as train/step.py's `_accumulate` returns them for data steps."""
    return scored_update(ctx, op, generate_and_score(ctx, op, step, kind), step, stop_requested)


def scored_update(
    ctx: Any, op: OnPolicy, sc: Scored, step: int, stop_requested: Callable[[], bool] = lambda: False
) -> tuple[torch.Tensor, int | torch.Tensor, GeneratedStats, torch.Tensor | None]:
    """A scored generated step's forward and backward, its KD head counting the labels on the host
    (`generated_accumulate`'s third phase; returns what it returns)."""
    cfg = ctx.cfg
    multi = op.rows is not None
    batches, scored, counts, totals = sc.batches, sc.targets, sc.counts, sc.totals
    step_cfg, objective, stats = sc.cfg, sc.objective, sc.stats
    rows, tokens = [], 0
    acc = cfg.schedule.grad_accum
    for i, (b, targets) in enumerate(zip(batches, scored)):
        r = batch_loss(ctx.student, b, ctx.source, step_cfg, ctx.amp, None, objective, targets)
        if multi:  # this process's share of the micro-batch's completion tokens over all processes
            weight, _ = dist.loss_weight(counts[i], totals[i])
            (r.loss * (weight / acc)).backward()
        else:
            (r.loss / acc).backward()
        values = torch.stack([r.loss.detach(), r.ce, r.kd]).double()
        if faults.nan_step(step + 1) and i == 0:
            values[0] = float("nan")
        if multi:  # summed over processes as loss x tokens, then divided by all their tokens
            values = torch.cat([values * r.tokens, values.new_full((1,), float(r.tokens))])
        rows.append(values)
        tokens += int(r.tokens)
        faults.at(f"{step + 1}.{i + 1}")
    stacked = torch.stack(rows)  # (M, 3), or (M, 4) with the token counts under torchrun
    if not multi:
        return stacked, tokens, stats, None
    # every micro-batch's targets read the teacher's gathered lm_head until its backward: freed only now
    for teacher in ctx.source.teachers:
        dist.reshard(teacher)
    flag = stacked.new_zeros((1, 4))  # one more row: this process's stop request, summed with the rest
    if stop_requested():
        flag[0, 0] = 1.0
    both = dist.all_reduce_tensor(torch.cat([stacked, flag]))
    sums = both[:-1]
    return sums[:, :3] / sums[:, 3:].clamp(min=1.0), sums[:, 3].sum(), stats, both[-1, 0]
