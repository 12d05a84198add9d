"""Distillation across tokenizers (kd.cross_tokenizer=true): the ULD loss over character-aligned positions.

    cross = CrossTokenizer(student_tok, teacher_tok, teacher_max_len)
    t_ids, pairs = cross.teacher_batch(input_ids)      # the teacher's ids, its position per student one
    r = uld_loss(s_hidden, s_weight, t_rows, t_weight, labels, cfg)   # a KDLossResult

The data is tokenized with the student's tokenizer. Per micro-batch each row's text (decoded by the
student's tokenizer) is encoded by the teacher's; each student position is paired with the teacher
position whose token ends at the same (or the nearest) character offset (kdistill.data.align). Then

    loss = (1 - alpha) * CE(student) + alpha * mean_i ULD(student_T[i], teacher_T[pair(i)])

over the tokens with a label (kdistill.ops.uld; `kd` in the result is the ULD mean). The ULD term runs
in chunks of kd.chunk_size rows, each recomputed in backward (activation checkpointing), so the logits
held at once stay O(chunk x vocab).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from kdistill import dispatch
from kdistill.config import RunConfig
from kdistill.data.align import retokenize
from kdistill.ops.uld import uld_rows


@dataclasses.dataclass
class CrossTokenizer:
    """The two tokenizers of a cross-tokenizer run and the longest teacher row (its positions)."""

    student_tok: Any
    teacher_tok: Any
    teacher_max_len: int
    # packed conversations: the teacher's side of the training rows (kdistill.data.cross_chat.AlignedRows),
    # rendered and aligned once when the data is read; None for raw text (aligned per batch here)
    rows: Any = None

    def teacher_batch(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(teacher ids (B, Lt) padded with 0, teacher position per student position (B, T))."""
        rows, pairs = [], []
        for ids in input_ids.tolist():
            t_ids, pair = retokenize(self.student_tok, self.teacher_tok, ids)
            t_ids = t_ids[: self.teacher_max_len]
            rows.append(t_ids)
            pairs.append([min(j, len(t_ids) - 1) for j in pair])
        width = max(len(r) for r in rows)
        t = torch.zeros(len(rows), width, dtype=torch.long)
        for b, r in enumerate(rows):
            t[b, : len(r)] = torch.tensor(r, dtype=torch.long)
        return t.to(input_ids.device), torch.tensor(pairs, dtype=torch.long, device=input_ids.device)


def _uld_sum(hs: torch.Tensor, ws: torch.Tensor, ht: torch.Tensor, wt: torch.Tensor, temperature: float):
    return uld_rows(hs @ ws.t(), ht @ wt.t(), temperature).sum()


def uld_loss(
    s_hidden: torch.Tensor,
    s_weight: torch.Tensor,
    t_rows: torch.Tensor | None,
    t_weight: torch.Tensor | None,
    labels: torch.Tensor,
    cfg: RunConfig,
) -> dispatch.KDLossResult:
    """(1 - alpha) CE + alpha ULD from the student's hidden states s_hidden (B, T, Hs) and the teacher's
    rows t_rows (n, Ht) aligned to the n labelled positions of labels (B, T) (None at alpha = 0 or
    with no labelled position)."""
    kd = cfg.kd
    valid = labels != kd.ignore_index  # (B, T)
    s_rows = s_hidden[valid]  # (n, Hs)
    ce = dispatch.kd_loss(
        s_rows, s_weight, None, None, labels[valid], alpha=0.0, temperature=1.0,
        divergence="forward_kl", ignore_index=kd.ignore_index, chunk_size=kd.chunk_size,
    )  # fmt: skip
    n = s_rows.shape[0]
    uld = torch.zeros((), device=s_hidden.device)
    if kd.alpha > 0 and n and t_rows is not None and t_weight is not None:
        # fp32 GEMMs on both sides (the plan's ULD shapes): a student lm_head stored or gathered in a
        # lower precision (a LoRA base_dtype, FSDP2's compute-dtype gathers) is cast, not mixed with hs
        ws, wt = s_weight.float(), t_weight.float()
        for start in range(0, n, kd.chunk_size):
            end = min(start + kd.chunk_size, n)
            hs = s_rows[start:end].float()
            uld = uld + checkpoint(
                _uld_sum, hs, ws, t_rows[start:end], wt, kd.temperature, use_reentrant=False
            )
        uld = uld / n
    loss = (1 - kd.alpha) * ce.loss + kd.alpha * uld
    return dispatch.KDLossResult(loss, ce.ce, uld.detach(), ce.tokens)
