"""Held-out cross-entropy and perplexity of a model (the library part of `kdistill eval`).

    result = evaluate(model, sequences, batch_size=8, device="cpu")   # {"loss", "perplexity", "tokens"}
    seqs = eval_sequences(files, eos_id, seq_len=512, packed=True)   # what `kdistill eval` scores

`loss` is the mean next-token cross-entropy in nats over every scored token (token-weighted across
sequences), from an fp32 log-softmax. Packed (default): the documents are joined with EOS and cut into
windows of seq_len + 1 tokens (stride seq_len; the last, shorter window is scored too), so every token but
the first is scored once. With --no-pack each document (each JSONL line) is scored on its own, truncated to
seq_len tokens, exactly as transformers scores `model(input_ids, labels=input_ids)`: the mean over the
shifted tokens of all sequences together.
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

from kdistill.data import LoadedFile, stream_tokens
from kdistill.errors import UserError

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
