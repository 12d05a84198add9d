"""The teacher's side of the loss as one interface, whatever its source: a step is batch -> targets -> loss.

    batch = MicroBatch(input_ids, labels, position_ids, doc_ids, n_tokens=n)
    source = target_source(teacher, mixture=..., cache=..., cross=...)   # a TargetSource
    extras = extra_terms(cfg)                                            # a LayerMap, or None
    r = batch_loss(student, batch, source, cfg, amp, extras)             # a KDLossResult

A TargetSource turns a micro-batch into `Targets`, the teacher's side of the KD head, without
gradients; none of the sources knows about the others:

    LiveTeacher            one frozen decoder: its final hidden states and lm_head (the head computes the
                           logits chunk by chunk); with a layer map, the mapped blocks' outputs too
    Mixture                several live teachers, weighted in probability space
    CachedTargets          a teacher cache's rows (exact log-probs, or top-k / sampled sparse rows),
                           fetched by the batch's dataset rows before the forward is queued
    CrossTokenizerTargets  a teacher with another tokenizer: its hidden states at the positions aligned
                           by character offsets (the ULD loss)
    CrossChatTargets       the same over conversations: the teacher runs on its own rendering of them
                           (kdistill.data.cross_chat), positions paired by the learned messages' text

The batch itself may come from the data or from the student (kdistill.train.onpolicy: the student's
samples of the data's prompts, graded by any live source). Extra terms (kd.layer_map's hidden-state
and attention-map losses) are added to the loss; they read what the two forwards kept.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from kdistill import dispatch
from kdistill.config import RunConfig
from kdistill.data.cross_chat import T_DOC, T_EXACT, T_IDS, T_PAIR, T_POS
from kdistill.models.decoder import Decoder
from kdistill.ops import kd_sparse
from kdistill.ops.onpolicy_loss import sampled_reverse_kl
from kdistill.train.cross_tok import CrossTokenizer, uld_loss
from kdistill.train.layers import LayerMap, forward_collect

OBJECTIVES = ("divergence", "sampled_reverse_kl")


def head_operands(hidden: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The KD head's GEMM operands: under autocast both go to the autocast dtype, as every other
    linear of the model does (fp32 master weights would otherwise make the lm_head GEMMs fp32). The
    head still accumulates logits and the lm_head gradient in fp32."""
    dev = hidden.device.type
    if torch.is_autocast_enabled(dev):
        dt = torch.get_autocast_dtype(dev)
        return hidden.to(dt), weight.to(dt)
    return hidden, weight


@dataclasses.dataclass
class MicroBatch:
    """One micro-batch on the device. input_ids, labels (B, T); position_ids, doc_ids (B, T) for packed
    conversations (None for raw text); n_tokens: the labels' count from their host copy (the loss then
    never waits for the GPU; None: counted on the device); cached: a teacher cache's rows of the batch
    (B, T, X), fetched by CachedTargets.fetch before the forward is queued; rows: instead of n_tokens, the
    KD head's fixed row count (a generated step captured as a CUDA graph: the count stays on the device)."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor | None = None
    doc_ids: torch.Tensor | None = None
    n_tokens: int | None = None
    cached: torch.Tensor | None = None
    rows: int | None = None

    @property
    def docs(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return self.position_ids, self.doc_ids


@dataclasses.dataclass
class Targets:
    """The teacher's side of one micro-batch, as the KD head consumes it; exactly one kind is set.

    hidden (N, Ht), weight (Vt, Ht): a live teacher's final hidden states and lm_head;
    mixture: [(hidden (N, Ht_i), lm_head (Vt_i, Ht_i), weight), ...] of several teachers;
    logprobs (N, V): an exact teacher cache's rows; sparse (N, X): top-k or sampled rows (mode, k);
    aligned: a cross-tokenizer teacher's `hidden` rows (n, Ht) at the batch's n labelled positions.
    With none set (alpha = 0 and no terms) the loss is the student's CE alone. states and qk: the
    mapped teacher blocks' outputs and attention (q, k) for a layer map."""

    hidden: torch.Tensor | None = None
    weight: torch.Tensor | None = None
    mixture: list[tuple[torch.Tensor, torch.Tensor, float]] | None = None
    logprobs: torch.Tensor | None = None
    sparse: torch.Tensor | None = None
    mode: str = "exact"
    k: int = 0
    aligned: bool = False
    exact: torch.Tensor | None = None  # aligned: (n,) bool, the rows of the exact term
    shared: Any = None  # aligned: the tokens both vocabularies share (cross_tok.SharedVocab)
    states: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)
    qk: dict[int, tuple[torch.Tensor, torch.Tensor]] = dataclasses.field(default_factory=dict)


class TargetSource:
    """Gives the teacher's side of the loss for a micro-batch. `teachers`: the decoders it runs (for
    resharding under torchrun; none for a cache); `live`: whether it can score text it has never seen
    (a student's samples)."""

    teachers: list[Decoder] = []
    live = True

    def fetch(self, indices: np.ndarray, rows: slice | None, device: torch.device) -> torch.Tensor | None:
        """What the source needs of the batch's dataset rows `indices` before the forward (a cache's
        rows on the device, this process's `rows` of them under torchrun); None for a live teacher."""
        return None

    def generated(
        self, prompts: list[int], labels: torch.Tensor, device: torch.device
    ) -> torch.Tensor | None:
        """What the source needs of generated rows (the prompt pool's indices `prompts`, the rows' labels
        (B, T) on the host: the completion tokens) before they are scored; None for a live teacher."""
        return None

    def targets(
        self, batch: MicroBatch, cfg: RunConfig, amp: contextlib.AbstractContextManager, extras: Any = None
    ) -> Targets:
        raise NotImplementedError


class LiveTeacher(TargetSource):
    """One frozen decoder's final hidden states and lm_head (and, for a layer map, its mapped blocks)."""

    def __init__(self, teacher: Decoder | None) -> None:
        self.teacher = teacher
        self.teachers = [teacher] if teacher is not None else []

    def targets(
        self,
        batch: MicroBatch,
        cfg: RunConfig,
        amp: contextlib.AbstractContextManager,
        extras: Any = None,
        forward: Callable[[Decoder, torch.Tensor, contextlib.AbstractContextManager], torch.Tensor]
        | None = None,
    ) -> Targets:
        """forward: how the teacher's final hidden states of plain causal rows are computed instead of
        its own forward (a captured run's scoring graphs, kdistill.train.graph.ScoringGraphs)."""
        teacher = self.teacher
        if teacher is None:
            return Targets()
        if isinstance(extras, LayerMap):
            with torch.no_grad():
                hidden, states, qk = forward_collect(
                    teacher, batch.input_ids, amp, *batch.docs, extras.teacher_layers, extras.attention
                )
            if cfg.kd.alpha == 0:
                return Targets(states=states, qk=qk)
            return Targets(hidden=hidden.flatten(0, 1), weight=teacher.lm_head_weight, states=states, qk=qk)
        if cfg.kd.alpha == 0:
            return Targets()
        if forward is not None and batch.docs == (None, None):
            return Targets(
                hidden=forward(teacher, batch.input_ids, amp).flatten(0, 1), weight=teacher.lm_head_weight
            )
        with torch.no_grad(), amp:
            hidden = teacher(batch.input_ids, *batch.docs).flatten(0, 1)  # (N, Ht)
        return Targets(hidden=hidden, weight=teacher.lm_head_weight)


def teacher_operands(
    mixture: list[tuple[Decoder, float]],
    input_ids: torch.Tensor,
    amp: contextlib.AbstractContextManager,
    *docs: torch.Tensor | None,
) -> list[tuple[torch.Tensor, torch.Tensor, float]]:
    """[(hidden (N, Ht_i), lm_head (Vt_i, Ht_i), weight), ...] of each teacher (forward without grad)."""
    parts = []
    for teacher, weight in mixture:
        with torch.no_grad(), amp:
            h = teacher(input_ids, *docs).flatten(0, 1)  # (N, Ht_i)
            h, w = head_operands(h, teacher.lm_head_weight)
        parts.append((h, w, weight))
    return parts


class Mixture(TargetSource):
    """Several live teachers [(teacher, weight), ...]: their mixture in probability space is the target."""

    def __init__(self, mixture: list[tuple[Decoder, float]]) -> None:
        self.mixture = mixture
        self.teachers = [t for t, _ in mixture]

    def targets(
        self, batch: MicroBatch, cfg: RunConfig, amp: contextlib.AbstractContextManager, extras: Any = None
    ) -> Targets:
        if cfg.kd.alpha == 0:
            return Targets()
        return Targets(mixture=teacher_operands(self.mixture, batch.input_ids, amp, *batch.docs))


class CachedTargets(TargetSource):
    """A teacher cache (kdistill.teacher_cache.TeacherCache): its rows of the batch's dataset rows."""

    live = False
    teachers: list[Decoder] = []

    def __init__(self, cache: Any) -> None:
        self.cache = cache

    def fetch(self, indices: np.ndarray, rows: slice | None, device: torch.device) -> torch.Tensor | None:
        targets = self.cache.targets(indices)  # (B, T, X) on the host
        if rows is not None:
            targets = targets[rows]
        # on the device before the forward is queued: copied later (inside the loss) the host would
        # wait for the student's forward first
        return targets.to(device, non_blocking=True)

    def targets(
        self, batch: MicroBatch, cfg: RunConfig, amp: contextlib.AbstractContextManager, extras: Any = None
    ) -> Targets:
        assert batch.cached is not None, "CachedTargets needs the batch's rows (fetch) first"
        flat = batch.cached.flatten(0, 1)  # (N, X)
        if self.cache.mode == "exact":
            return Targets(logprobs=flat)
        return Targets(sparse=flat, mode=self.cache.mode, k=self.cache.k)


class CrossTokenizerTargets(TargetSource):
    """A teacher with another tokenizer (kd.cross_tokenizer): each row re-encoded with the teacher's
    tokenizer, the teacher's hidden states at the positions aligned to the batch's labelled ones."""

    def __init__(self, teacher: Decoder, cross: CrossTokenizer) -> None:
        self.teacher, self.cross = teacher, cross
        self.teachers = [teacher]

    def targets(
        self, batch: MicroBatch, cfg: RunConfig, amp: contextlib.AbstractContextManager, extras: Any = None
    ) -> Targets:
        valid = batch.labels != cfg.kd.ignore_index  # (B, T)
        if cfg.kd.alpha == 0:
            return Targets(aligned=True)
        t_ids, pairs, exact = self.cross.teacher_batch(batch.input_ids)  # (B, Lt), (B, T), (B, T)
        if not bool(valid.any()):
            return Targets(aligned=True)
        with torch.no_grad(), amp:
            t_hidden = self.teacher(t_ids)  # (B, Lt, Ht)
        b_idx = torch.arange(len(t_ids), device=t_ids.device)[:, None].expand_as(pairs)
        rows = t_hidden[b_idx[valid], pairs[valid]].float()  # (n, Ht)
        weight = self.teacher.lm_head_weight
        shared = self.cross.shared(weight.shape[0], weight.device)
        return Targets(hidden=rows, weight=weight, aligned=True, exact=exact[valid], shared=shared)


class CrossChatTargets(TargetSource):
    """Conversations across tokenizers (kd.cross_tokenizer over packed conversations): the teacher runs
    on its own rendering of the batch's conversations (kdistill.data.cross_chat.AlignedRows, packed
    like the student's rows, documents masked), and its hidden states at the positions paired with the
    batch's labelled ones are the targets of the ULD loss."""

    def __init__(self, teacher: Decoder, cross: CrossTokenizer) -> None:
        self.teacher, self.cross, self.rows = teacher, cross, cross.rows
        self.teachers = [teacher]

    def fetch(self, indices: np.ndarray, rows: slice | None, device: torch.device) -> torch.Tensor | None:
        side = torch.from_numpy(np.ascontiguousarray(self.rows.teacher[indices]))  # (B, 5, T)
        if rows is not None:
            side = side[rows]
        return side.to(device, non_blocking=True)

    def generated(
        self, prompts: list[int], labels: torch.Tensor, device: torch.device
    ) -> torch.Tensor | None:
        """On-policy: the teacher's side of the student's completions (kdistill.data.cross_chat.
        CompletionSide: each completion's text rendered by the teacher's template after its prompt)."""
        side = self.cross.completions
        assert side is not None, "CrossChatTargets scores generated rows once given their CompletionSide"
        rows = side.rows(prompts, labels.numpy(), self.cross.ignore_index)
        return torch.from_numpy(rows).to(device, non_blocking=True)

    def targets(
        self, batch: MicroBatch, cfg: RunConfig, amp: contextlib.AbstractContextManager, extras: Any = None
    ) -> Targets:
        assert batch.cached is not None, "CrossChatTargets needs the batch's teacher rows (fetch) first"
        valid = batch.labels != cfg.kd.ignore_index  # (B, T)
        if cfg.kd.alpha == 0 or not bool(valid.any()):
            return Targets(aligned=True)
        side = batch.cached
        with torch.no_grad(), amp:
            t_hidden = self.teacher(side[:, T_IDS], side[:, T_POS], side[:, T_DOC])  # (B, Tt, Ht)
        pairs = side[:, T_PAIR]  # (B, T)
        b_idx = torch.arange(len(pairs), device=pairs.device)[:, None].expand_as(pairs)
        rows = t_hidden[b_idx[valid], pairs[valid]].float()  # (n, Ht)
        weight = self.teacher.lm_head_weight
        shared = self.cross.shared(weight.shape[0], weight.device)
        exact = side[:, T_EXACT][valid] > 0  # (n,)
        return Targets(hidden=rows, weight=weight, aligned=True, exact=exact, shared=shared)


def target_source(
    teacher: Decoder | None,
    *,
    mixture: list[tuple[Decoder, float]] | None = None,
    cache: Any = None,
    cross: CrossTokenizer | None = None,
) -> TargetSource:
    """The run's source of targets: a teacher cache, a cross-tokenizer teacher, a mixture or one teacher."""
    if cache is not None:
        return CachedTargets(cache)
    if cross is not None:
        assert teacher is not None
        if cross.rows is not None:  # packed conversations, each model rendering its own
            return CrossChatTargets(teacher, cross)
        return CrossTokenizerTargets(teacher, cross)
    if mixture is not None:
        return Mixture(mixture)
    return LiveTeacher(teacher)


def extra_terms(cfg: RunConfig) -> LayerMap | None:
    """The loss's extra terms the config asks for: kd.layer_map's, or None."""
    return LayerMap(cfg) if cfg.kd.layers_on else None


def batch_loss(
    student: Decoder,
    batch: MicroBatch,
    source: TargetSource,
    cfg: RunConfig,
    amp: contextlib.AbstractContextManager,
    extras: LayerMap | None = None,
    objective: str = "divergence",
    targets: Targets | None = None,
) -> dispatch.KDLossResult:
    """batch -> targets (no grad) -> student forward -> loss. Returns a KDLossResult.

    objective "divergence": (1 - alpha) CE + alpha T^2 D(teacher_T || student_T) over the full
    vocabulary (kdistill.ops.kd_loss), or the sparse / ULD forms a source's targets call for, plus the
    extra terms; "sampled_reverse_kl": the policy-gradient form of the reverse KL on the batch's
    labels, which are the student's own samples (kdistill.ops.onpolicy_loss). targets: the batch's
    targets scored beforehand (a generated step scores every micro-batch before the update)."""
    if targets is None:
        targets = source.targets(batch, cfg, amp, extras)
    kd = cfg.kd
    if targets.aligned:
        with amp:
            s_hidden = student(batch.input_ids, *batch.docs)  # (B, T, Hs)
        return uld_loss(
            s_hidden, student.lm_head_weight, targets.hidden, targets.weight, batch.labels, cfg,
            targets.exact, targets.shared,
        )  # fmt: skip
    s_states: dict[int, torch.Tensor] = {}
    s_qk: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    if extras is not None:
        s_hidden, s_states, s_qk = forward_collect(
            student, batch.input_ids, amp, *batch.docs, extras.student_layers, extras.attention
        )
        with amp:
            s_hidden, s_weight = head_operands(s_hidden.flatten(0, 1), student.lm_head_weight)
    else:
        with amp:
            s_hidden = student(batch.input_ids, *batch.docs).flatten(0, 1)  # (N, Hs)
            s_hidden, s_weight = head_operands(s_hidden, student.lm_head_weight)
    labels = batch.labels.flatten()
    common: dict[str, Any] = dict(
        alpha=kd.alpha, temperature=kd.temperature, divergence=kd.divergence, beta=kd.beta,
        ignore_index=kd.ignore_index, chunk_size=kd.chunk_size,
    )  # fmt: skip
    t_hidden, t_weight = targets.hidden, targets.weight
    if t_hidden is not None:
        with amp:
            t_hidden, t_weight = head_operands(t_hidden, t_weight)  # type: ignore[arg-type]
    if batch.rows is not None and (
        objective != "divergence" or targets.sparse is not None or extras is not None
    ):
        raise ValueError("batch_loss: a fixed row count is for the dense divergence head alone")
    if objective == "sampled_reverse_kl":
        return sampled_reverse_kl(
            s_hidden, s_weight, t_hidden, t_weight, labels, temperature=kd.temperature,
            ignore_index=kd.ignore_index, chunk_size=kd.chunk_size, teacher_mixture=targets.mixture,
            n_tokens=batch.n_tokens,
        )  # fmt: skip
    if targets.sparse is not None:
        return kd_sparse.kd_loss_sparse(
            s_hidden, s_weight, targets.sparse, labels, mode=targets.mode, k=targets.k, **common
        )
    r = dispatch.kd_loss(
        s_hidden, s_weight, t_hidden, t_weight, labels, teacher_logprobs=targets.logprobs,
        teacher_mixture=targets.mixture, n_tokens=batch.n_tokens, logits_dtype=kd.logits_dtype,
        rows=batch.rows, **common,
    )  # fmt: skip
    if extras is not None:
        extra = extras.loss(student, s_states, s_qk, targets.states, targets.qk, batch.labels, batch.doc_ids)
        r = r._replace(loss=r.loss + extra.to(r.loss.dtype))
    return r
