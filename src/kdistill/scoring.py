"""Held-out cross-entropy and perplexity of a model (the library part of `kdistill eval`), and the held-out
eval of a run that trains from a teacher cache.

    result = evaluate(model, sequences, batch_size=8, device="cpu")   # {"loss", "perplexity", "tokens"}
    seqs = eval_sequences(files, eos_id, seq_len=512, packed=True)   # what `kdistill eval` scores
    res = heldout_eval_cached(student, cache, held, cfg, device, amp)  # a run with teacher.cache

`loss` is the mean next-token cross-entropy in nats over every scored token (token-weighted across
sequences), from an fp32 log-softmax. Packed (default): the documents are joined with EOS and cut into
windows of seq_len + 1 tokens (stride seq_len; the last, shorter window is scored too), so every token but
the first is scored once. With --no-pack each document (each JSONL line) is scored on its own, truncated to
seq_len tokens, exactly as transformers scores `model(input_ids, labels=input_ids)`: the mean over the
shifted tokens of all sequences together.

`heldout_eval_cached` is the held-out eval of `kdistill run ... teacher.cache=DIR` (kdistill.train.step's
`heldout_eval` with the cache's held-out targets for the teacher): student_loss, kl_to_teacher (KL(p || q)
at T = 1: exact from an exact cache to bf16 rounding, the (k + 1)-bucket KL from a topk cache, the
k-sample estimate from a sampled one) and teacher_loss (from the teacher's log-prob of each label, stored
in fp32 in every mode: exact). See docs/teacher_cache.md.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from kdistill import dispatch
from kdistill.config import RunConfig
from kdistill.data import HeldoutBatches, LoadedFile, stream_tokens
from kdistill.errors import UserError
from kdistill.ops import kd_sparse
from kdistill.ops.kd_loss import HELDOUT_TEMPERATURE, check_token_ids
from kdistill.teacher_cache import TeacherCache
from kdistill.train import distributed as dist
from kdistill.train.step import head_operands

LOGITS_BUDGET = 1 << 24  # fp32 logits per chunk (64 MiB): no (tokens x vocab) tensor for the whole batch


def _as_list(data: np.ndarray | Sequence[Any]) -> list[np.ndarray]:
    if isinstance(data, np.ndarray) and data.ndim == 2:
        return [data[i] for i in range(len(data))]
    if isinstance(data, torch.Tensor) and data.dim() == 2:
        return [data[i].cpu().numpy() for i in range(data.shape[0])]
    return [np.asarray(d.cpu() if isinstance(d, torch.Tensor) else d) for d in data]


@torch.inference_mode()
def evaluate(
    model: Any,
    sequences: np.ndarray | Sequence[Any],
    batch_size: int = 8,
    device: str | torch.device = "cpu",
    *,
    progress: bool | None = None,
) -> dict[str, float]:
    """Mean next-token cross-entropy (nats), perplexity and scored-token count of `model` on `sequences`.

    Args:
        model: a kdistill Decoder (model(ids) -> (B, T, H) hidden states; model.lm_head_weight (V, H)).
        sequences: packed sequences (N, T + 1), or a list of 1-D token arrays of any lengths; each sequence
            s is scored on targets s[1:] given s[:-1]. Sequences shorter than 2 tokens score nothing.
        batch_size: sequences per forward pass (equal-length sequences are batched together).
        device: where to run the model's inputs (the model must already be there).
        progress: show a tqdm bar on stderr (default: when stderr is a terminal).

    Returns:
        {"loss": nats per token, "perplexity": exp(loss), "tokens": number of scored tokens}.
    """
    if batch_size < 1:
        raise UserError(f"--batch-size is {batch_size}, expected a positive integer")
    seqs = [s for s in _as_list(sequences) if len(s) >= 2]
    # Group equal lengths (stable) so batches need no padding; packed data is a single group.
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    batches: list[list[int]] = []
    for i in order:
        if batches and len(batches[-1]) < batch_size and len(seqs[batches[-1][0]]) == len(seqs[i]):
            batches[-1].append(i)
        else:
            batches.append([i])
    if progress is None:
        progress = sys.stderr.isatty()
    weight = model.lm_head_weight  # (V, H)
    vocab = weight.shape[0]
    check_token_ids(([s] for s in seqs), vocab, where="--data")  # before any embedding lookup
    chunk = max(1, LOGITS_BUDGET // vocab)
    total_nll = 0.0
    total = 0
    for idx in tqdm(batches, desc="eval", unit="batch", file=sys.stderr, disable=not progress, leave=False):
        rows = torch.from_numpy(np.stack([np.asarray(seqs[i], dtype=np.int64) for i in idx])).to(device)
        inputs, labels = rows[:, :-1], rows[:, 1:]  # (B, T)
        hidden = model(inputs).flatten(0, 1)  # (B*T, H)
        flat = labels.flatten()
        for lo in range(0, flat.numel(), chunk):
            logits = (hidden[lo : lo + chunk] @ weight.t()).float()  # (chunk, V), fp32 log-softmax
            total_nll += float(
                F.cross_entropy(logits, flat[lo : lo + chunk], reduction="sum", ignore_index=-100)
            )
        total += int(flat.numel())
    if total == 0:
        raise UserError(
            "nothing to score: every sequence is shorter than 2 tokens (lower --seq-len or add data)"
        )
    loss = total_nll / total
    return {"loss": loss, "perplexity": _ppl(loss), "tokens": total}


def _ppl(loss: float) -> float:
    try:
        return math.exp(loss)
    except OverflowError:
        return float("inf")


def eval_sequences(
    files: Sequence[LoadedFile], eos_id: int | None, seq_len: int, packed: bool = True, max_tokens: int = 0
) -> list[np.ndarray]:
    """The sequences `kdistill eval` scores: packed windows or one per document, capped at max_tokens.

    Packed: the documents joined with EOS, cut into windows of seq_len + 1 (stride seq_len, the last one
    possibly shorter). Not packed: each document truncated to seq_len tokens. max_tokens > 0 keeps
    sequences until that many targets are scored.
    """
    if packed:
        stream = stream_tokens([(f.docs, np.arange(f.docs.num_docs)) for f in files], eos_id)
        seqs = _windows(stream, seq_len)
    else:
        seqs = [f.docs.doc(i)[:seq_len] for f in files for i in range(f.docs.num_docs)]
    if max_tokens:
        seqs = _cap(seqs, max_tokens)
    return seqs


def _windows(stream: np.ndarray, seq_len: int) -> list[np.ndarray]:
    """Windows of seq_len + 1 with stride seq_len, the last one possibly shorter (>= 2 tokens)."""
    out = []
    for lo in range(0, max(len(stream) - 1, 0), seq_len):
        w = stream[lo : lo + seq_len + 1]
        if len(w) >= 2:
            out.append(w)
    return out


def _cap(seqs: list[np.ndarray], max_tokens: int) -> list[np.ndarray]:
    """Keep sequences until max_tokens targets are scored (the last one truncated)."""
    out, left = [], max_tokens
    for s in seqs:
        if left <= 0:
            break
        take = s[: left + 1]
        if len(take) >= 2:
            out.append(take)
            left -= len(take) - 1
    return out


@torch.no_grad()
def heldout_eval_cached(
    student: Any,
    cache: TeacherCache,
    batches: HeldoutBatches,
    cfg: RunConfig,
    device: torch.device,
    amp: Any,
) -> dict[str, float]:
    """The held-out eval of a run with a teacher cache that holds the held-out part (cache.heldout):
    token-weighted student CE, KL(teacher || student) at T = 1 and teacher CE, the fields of a live
    run's eval (kdistill.train.step.heldout_eval), with the cache's targets for the teacher.

    Args:
        student: the student Decoder (in eval mode).
        cache: an open TeacherCache whose held-out rows are the ones `batches` reads (checked at open).
        batches: the run's fixed held-out batches (kdistill.data.heldout_batches over data.heldout).
        cfg: the run config (kd.ignore_index, kd.chunk_size).
        device, amp: where the student runs, and its autocast context.

    Returns:
        {"student_loss", "kl_to_teacher", "teacher_loss", "tokens"}. kl_to_teacher is exact (to the bf16
        rounding of the cached log-probs) from an exact cache; from a topk cache the KL between the
        (k + 1)-bucket distributions (top-k ids and the remaining mass), a lower bound of the KL; from
        a sampled cache the mean over its k draws x_j ~ p of log p(x_j) - log q(x_j), an unbiased
        estimate. teacher_loss is exact in every mode (the teacher's fp32 log-prob of each label).

    Under torchrun each process scores its contiguous share of every batch's rows and the sums are
    added over the processes, as heldout_eval does.
    """
    tot = {"student": 0.0, "kl": 0.0, "teacher": 0.0}
    tokens = 0
    multi = dist.active()
    ignore = cfg.kd.ignore_index
    common: dict[str, Any] = dict(
        alpha=0.5,
        temperature=HELDOUT_TEMPERATURE,
        divergence="forward_kl",
        ignore_index=ignore,
        chunk_size=cfg.kd.chunk_size,
    )
    check_token_ids(batches, int(student.lm_head_weight.shape[0]), ignore)  # as training does
    for b, batch in enumerate(batches):
        rows = np.arange(b * batches.batch_size, b * batches.batch_size + batch[0].shape[0])
        count = True
        if multi:  # this process's contiguous share; none: a stand-in row, run for the collectives only
            mine = np.array_split(np.arange(len(rows)), dist.info().world)[dist.info().rank]
            count = len(mine) > 0
            pick = mine if count else np.arange(1)
            rows, batch = rows[pick], tuple(t[torch.from_numpy(pick)] for t in batch)
        input_ids, labels, *docs = (t.to(device) for t in batch)
        with amp:
            s_h, s_w = head_operands(student(input_ids, *docs).flatten(0, 1), student.lm_head_weight)
        if not count:
            continue
        flat = labels.flatten()  # (N,)
        targets = cache.targets(rows, heldout=True).to(device).flatten(0, 1)  # (N, V) or (N, X)
        if cache.mode == "exact":
            r = dispatch.kd_loss(s_h, s_w, None, None, flat, teacher_logprobs=targets, **common)
        else:
            r = kd_sparse.kd_loss_sparse(s_h, s_w, targets, flat, mode=cache.mode, k=cache.k, **common)
        label_logp = cache.label_logp(rows).to(device).flatten()  # (N,) fp32, 0 where ignored
        tot["student"] += float(r.ce) * r.tokens
        tot["kl"] += float(r.kd) * r.tokens
        tot["teacher"] -= float(label_logp[flat != ignore].double().sum())
        tokens += r.tokens
    if multi:
        dist.reshard(student)  # FSDP2 keeps a root gathered after forward; no backward follows here
        sums = dist.all_reduce_sum([tot["student"], tot["kl"], tot["teacher"], float(tokens)])
        tot = {"student": sums[0], "kl": sums[1], "teacher": sums[2]}
        tokens = int(sums[3])
    n = max(tokens, 1)
    return {
        "student_loss": tot["student"] / n,
        "tokens": tokens,
        "kl_to_teacher": tot["kl"] / n,
        "teacher_loss": tot["teacher"] / n,
    }
