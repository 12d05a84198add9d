"""Distillation across tokenizers (kd.cross_tokenizer=true): the ULD loss over character-aligned positions,
plus an exact term where the two tokenizations agree.

    cross = CrossTokenizer(student_tok, teacher_tok, teacher_max_len)
    t_ids, pairs, exact = cross.teacher_batch(input_ids)   # the teacher's ids, its position per student
                                                           # one, the positions whose text maps one to one
    r = uld_loss(s_hidden, s_weight, t_rows, t_weight, labels, cfg, exact, cross.shared)   # a KDLossResult

The data is tokenized with the student's tokenizer. Per micro-batch each row's text (decoded by the
student's tokenizer) is encoded by the teacher's; each student position is paired with the teacher
position whose token ends at the same (or the nearest) character offset (kdistill.data.align); packed
conversations are aligned once by the messages' text (kdistill.data.cross_chat). Then

    loss = (1 - alpha) * CE(student) + alpha * KD
    KD   = kd.uld_weight * mean_i ULD(student_T[i], teacher_T[pair(i)])
         + kd.exact_weight * T^2 * sum_{i exact} D(teacher_T[pair(i)] || student_T[i]) / n

over the n tokens with a label (kdistill.ops.uld; `kd` in the result is KD). A position is exact when it
and its partner end at the same point of the text and their next tokens are the same text (one token in
each vocabulary: kdistill.data.align.vocab_map); there D is kd.divergence over the K tokens the two
vocabularies share (the same text) plus one bucket for the rest of each vocabulary's mass. The terms
run in chunks of kd.chunk_size rows, each recomputed in backward (activation checkpointing), so the
logits held at once stay O(chunk x vocab).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch
from torch.utils.checkpoint import checkpoint

from kdistill import dispatch
from kdistill.config import RunConfig
from kdistill.data.align import align_ends, exact_positions, token_ends, vocab_map
from kdistill.ops.kd_loss import divergence_rows
from kdistill.ops.uld import uld_rows


@dataclasses.dataclass
class SharedVocab:
    """The tokens both vocabularies have (the same text): student ids s (K,), teacher ids t (K,), and
    the rest of each vocabulary, s_rest and t_rest, as index tensors."""

    s: torch.Tensor
    t: torch.Tensor
    s_rest: torch.Tensor
    t_rest: torch.Tensor

    @classmethod
    def of(cls, vmap: np.ndarray, teacher_vocab: int) -> SharedVocab:
        s = np.flatnonzero(vmap >= 0)
        t = vmap[s]
        keep_t = np.ones(teacher_vocab, dtype=bool)
        keep_t[t[t < teacher_vocab]] = False
        keep_s = np.ones(len(vmap), dtype=bool)
        keep_s[s] = False
        parts = (s, t, np.flatnonzero(keep_s), np.flatnonzero(keep_t))
        return cls(*(torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)) for a in parts))

    def to(self, device: torch.device) -> SharedVocab:
        return SharedVocab(*(x.to(device) for x in (self.s, self.t, self.s_rest, self.t_rest)))


@dataclasses.dataclass
class CrossTokenizer:
    """The two tokenizers of a cross-tokenizer run and the longest teacher row (its positions)."""

    student_tok: Any
    teacher_tok: Any
    teacher_max_len: int
    # packed conversations: the teacher's side of the training rows (kdistill.data.cross_chat.AlignedRows),
    # rendered and aligned once when the data is read; None for raw text (aligned per batch here)
    rows: Any = None
    vmap: np.ndarray | None = None  # student id -> teacher id of the same text, or -1 (vocab_map)
    # on-policy: how the teacher's side of the student's completions is made (cross_chat.CompletionSide)
    completions: Any = None
    ignore_index: int = -100
    _shared: Any = dataclasses.field(default=None, repr=False)  # ((teacher vocab, device), SharedVocab)

    def __post_init__(self) -> None:
        if self.vmap is None:
            self.vmap = vocab_map(self.student_tok, self.teacher_tok)

    def shared(self, teacher_vocab: int, device: torch.device) -> SharedVocab:
        """The shared tokens as index tensors on `device` (teacher ids below teacher_vocab)."""
        key = (teacher_vocab, str(device))
        cached = self._shared
        if cached is None or cached[0] != key:
            assert self.vmap is not None
            vmap = np.where(self.vmap < teacher_vocab, self.vmap, -1)
            self._shared = (key, SharedVocab.of(vmap, teacher_vocab).to(device))
        return self._shared[1]

    def teacher_batch(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(teacher ids (B, Lt) padded with 0, teacher position per student position (B, T), exact (B, T)
        bool: the positions whose text maps one to one; the last of a row is never: its next token is
        not in the row)."""
        assert self.vmap is not None
        rows, pairs, exact = [], [], []
        for ids in input_ids.tolist():
            text, s_ends = token_ends(self.student_tok, ids)
            t_ids, t_ends = self.teacher_tok.encode_offsets(text)
            if not t_ids:  # an empty text: one teacher token stands in (its logits are still a distribution)
                t_ids, t_ends = [0], [0]
            t_ids, t_ends = t_ids[: self.teacher_max_len], t_ends[: self.teacher_max_len]
            pair = np.minimum(np.asarray(align_ends(s_ends, t_ends), dtype=np.int64), len(t_ids) - 1)
            s_ends_a = np.asarray(s_ends, dtype=np.int64)
            nxt = np.append(np.asarray(ids[1:], dtype=np.int64), -1)
            nxt_ends = np.append(s_ends_a[1:], -1)
            t_ids_a, t_ends_a = np.asarray(t_ids, dtype=np.int64), np.asarray(t_ends, dtype=np.int64)
            rows.append(t_ids)
            pairs.append(pair)
            exact.append(exact_positions(nxt, s_ends_a, nxt_ends, pair, t_ids_a, t_ends_a, self.vmap))
        width = max(len(r) for r in rows)
        t = torch.zeros(len(rows), width, dtype=torch.long)
        for b, r in enumerate(rows):
            t[b, : len(r)] = torch.tensor(r, dtype=torch.long)
        dev = input_ids.device
        return (
            t.to(dev),
            torch.from_numpy(np.stack(pairs)).to(dev),
            torch.from_numpy(np.stack(exact)).to(dev),
        )


def exact_rows(
    s_logits: torch.Tensor, t_logits: torch.Tensor, shared: SharedVocab, cfg: RunConfig
) -> torch.Tensor:
    """Per row (c,): kd.divergence(teacher_T || student_T) over the shared tokens plus one bucket each
    for the rest of the vocabulary (dropped when a vocabulary has no rest)."""
    kd = cfg.kd
    ls = torch.log_softmax(s_logits / kd.temperature, dim=-1)  # (c, Vs)
    with torch.no_grad():
        lt = torch.log_softmax(t_logits / kd.temperature, dim=-1)  # (c, Vt)
    logq, logp = ls[:, shared.s], lt[:, shared.t]  # (c, K)
    if len(shared.s_rest) or len(shared.t_rest):
        neg = torch.full((len(ls), 1), float("-inf"), device=ls.device, dtype=ls.dtype)
        rest_q = ls[:, shared.s_rest].logsumexp(-1, keepdim=True) if len(shared.s_rest) else neg
        rest_p = lt[:, shared.t_rest].logsumexp(-1, keepdim=True) if len(shared.t_rest) else neg
        logq, logp = torch.cat([logq, rest_q], -1), torch.cat([logp, rest_p], -1)
    # an empty bucket on both sides (-inf, -inf) adds nothing; on one side only, the divergence is what
    # its definition gives (inf for a KL whose support is missed)
    logq = logq.clamp(min=torch.finfo(logq.dtype).min)
    logp = logp.clamp(min=torch.finfo(logp.dtype).min)
    d, _ = divergence_rows(logp, logq, kd.divergence, kd.beta, need_grad=False)
    return d


def _chunk_sums(
    hs: torch.Tensor,
    ws: torch.Tensor,
    ht: torch.Tensor,
    wt: torch.Tensor,
    exact: torch.Tensor,
    shared: SharedVocab | None,
    cfg: RunConfig,
) -> torch.Tensor:
    """(2,): the chunk's ULD sum and its exact term's sum (over its exact rows)."""
    s_logits, t_logits = hs @ ws.t(), ht @ wt.t()
    uld = uld_rows(s_logits, t_logits, cfg.kd.temperature).sum()
    if shared is None or not bool(exact.any()):
        return torch.stack([uld, uld.new_zeros(())])
    ex = exact_rows(s_logits[exact], t_logits[exact], shared, cfg).sum()
    return torch.stack([uld, ex])


def uld_loss(
    s_hidden: torch.Tensor,
    s_weight: torch.Tensor,
    t_rows: torch.Tensor | None,
    t_weight: torch.Tensor | None,
    labels: torch.Tensor,
    cfg: RunConfig,
    exact: torch.Tensor | None = None,
    shared: SharedVocab | None = None,
) -> dispatch.KDLossResult:
    """(1 - alpha) CE + alpha KD from the student's hidden states s_hidden (B, T, Hs) and the teacher's
    rows t_rows (n, Ht) aligned to the n labelled positions of labels (B, T) (None at alpha = 0 or
    with no labelled position); exact (n,) bool marks the rows of the exact term (kd.exact_weight) over
    the shared tokens `shared` (none: no exact term)."""
    kd = cfg.kd
    valid = labels != kd.ignore_index  # (B, T)
    s_rows = s_hidden[valid]  # (n, Hs)
    ce = dispatch.kd_loss(
        s_rows, s_weight, None, None, labels[valid], alpha=0.0, temperature=1.0,
        divergence="forward_kl", ignore_index=kd.ignore_index, chunk_size=kd.chunk_size,
    )  # fmt: skip
    n = s_rows.shape[0]
    term = torch.zeros((), device=s_hidden.device)
    if kd.alpha > 0 and n and t_rows is not None and t_weight is not None:
        # fp32 GEMMs on both sides (the plan's ULD shapes): a student lm_head stored or gathered in a
        # lower precision (a LoRA base_dtype, FSDP2's compute-dtype gathers) is cast, not mixed with hs
        ws, wt = s_weight.float(), t_weight.float()
        if exact is None or kd.exact_weight == 0:
            exact, shared = torch.zeros(n, dtype=torch.bool, device=s_hidden.device), None
        sums = torch.zeros(2, device=s_hidden.device)
        for start in range(0, n, kd.chunk_size):
            end = min(start + kd.chunk_size, n)
            hs = s_rows[start:end].float()
            sums = sums + checkpoint(
                _chunk_sums, hs, ws, t_rows[start:end], wt, exact[start:end], shared, cfg, use_reentrant=False
            )
        term = kd.uld_weight * sums[0] / n + kd.exact_weight * kd.temperature**2 * sums[1] / n
    loss = (1 - kd.alpha) * ce.loss + kd.alpha * term
    return dispatch.KDLossResult(loss, ce.ce, term.detach(), ce.tokens)
