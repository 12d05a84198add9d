"""Batches of packed sequences: shuffled and resumable for training, fixed for held-out evaluation.

batches = Batcher(data.train, batch_size=8, seed=0)
input_ids, labels = batches.next()                  # (B, T) int64 tensors, labels = inputs shifted by one
for input_ids, labels in heldout_batches(data.heldout, 8, max_batches=4): ...

Over packed conversations (a PackedRows, see kdistill.data.chat_pack) a batch is
(input_ids, labels, position_ids, doc_ids), each (B, T) int64, labels already shifted and masked.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from kdistill.data.chat_pack import PackedRows
from kdistill.errors import UserError


def take(sequences: Any, idx: np.ndarray | slice) -> tuple[torch.Tensor, ...]:
    """The batch of rows `idx`: (input_ids, labels) from raw (N, T + 1) windows, or (input_ids,
    labels, position_ids, doc_ids) from PackedRows."""
    if isinstance(sequences, PackedRows):
        parts = (sequences.input_ids, sequences.labels, sequences.position_ids, sequences.doc_ids)
        return tuple(torch.from_numpy(np.ascontiguousarray(p[idx], dtype=np.int64)) for p in parts)
    rows = np.asarray(sequences[idx], dtype=np.int64)  # (B, T + 1)
    batch = torch.from_numpy(np.ascontiguousarray(rows))
    return batch[:, :-1].contiguous(), batch[:, 1:].contiguous()


class Batcher:
    """Deterministic shuffled batches over packed sequences, resumable exactly.

    The order is an endless stream of permutations, one per epoch, each drawn from (seed, epoch); a batch
    takes the next batch_size indices of that stream (crossing into the next epoch when needed, so a
    batch size above the number of sequences still works). `state_dict()` is (epoch, position).
    """

    def __init__(self, sequences: np.ndarray, batch_size: int, seed: int = 0) -> None:
        if batch_size < 1:
            raise UserError(f"batch size is {batch_size}, expected a positive integer")
        if len(sequences) == 0:
            raise UserError("no training sequences to batch (empty dataset)")
        self.sequences = sequences
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.epoch = 0
        self.position = 0
        self._order = self._permutation(0)
        self.last_indices = np.zeros(0, dtype=np.int64)  # the dataset rows of the latest batch

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.sequences))

    def next_indices(self) -> np.ndarray:
        out = []
        need = self.batch_size
        while need:
            take = self._order[self.position : self.position + need]
            out.append(take)
            need -= len(take)
            self.position += len(take)
            if self.position >= len(self._order):
                self.epoch += 1
                self.position = 0
                self._order = self._permutation(self.epoch)
        self.last_indices = np.concatenate(out)
        return self.last_indices

    def next(self) -> tuple[torch.Tensor, ...]:
        """(input_ids, labels), each (B, T) int64; packed conversations add position_ids, doc_ids."""
        return take(self.sequences, self.next_indices())

    def __iter__(self) -> Batcher:
        return self

    def __next__(self) -> tuple[torch.Tensor, ...]:
        return self.next()

    def state_dict(self) -> dict[str, int]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "batch_size": self.batch_size,
            "num_sequences": int(len(self.sequences)),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly where `state` was taken. The data and batch size must be the same."""
        try:
            epoch, position = int(state["epoch"]), int(state["position"])
            n, b = int(state["num_sequences"]), int(state["batch_size"])
            seed = int(state["seed"])
        except (KeyError, TypeError, ValueError):
            raise UserError(
                "data position in the checkpoint is incomplete (expected epoch, position, seed, "
                "batch_size, num_sequences)"
            ) from None
        if n != len(self.sequences):
            raise UserError(
                f"cannot resume: the data now packs into {len(self.sequences)} sequences, the "
                f"checkpoint was taken with {n} (data, tokenizer or seq_len changed)"
            )
        if b != self.batch_size:
            raise UserError(f"cannot resume: batch size is {self.batch_size}, the checkpoint used {b}")
        if not (epoch >= 0 and 0 <= position < max(1, n)):
            raise UserError(f"cannot resume: data position epoch={epoch} position={position} is out of range")
        self.seed, self.epoch, self.position = seed, epoch, position
        self._order = self._permutation(epoch)


class HeldoutBatches:
    """Re-iterable (input_ids, labels) batches over the first sequences in fixed order.

    Each iteration yields the same batches; the last one may be short. len() is the number of batches.
    """

    def __init__(self, sequences: np.ndarray, batch_size: int, max_batches: int | None = None) -> None:
        if batch_size < 1:
            raise UserError(f"batch size is {batch_size}, expected a positive integer")
        self.sequences = sequences
        self.batch_size = int(batch_size)
        count = (len(sequences) + self.batch_size - 1) // self.batch_size
        self.count = min(count, max_batches) if max_batches else count

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        for b in range(self.count):
            yield take(self.sequences, slice(b * self.batch_size, (b + 1) * self.batch_size))


def heldout_batches(sequences: np.ndarray, batch_size: int, max_batches: int | None = None) -> HeldoutBatches:
    """Held-out batches in fixed order (at most max_batches; None or 0: all), iterable any number of times."""
    return HeldoutBatches(sequences, batch_size, max_batches)


def check_batch(labels: torch.Tensor | np.ndarray, ignore_index: int = -100) -> str | None:
    """Why a batch is degenerate (every target ignored, or one token repeated), else None."""
    t = torch.as_tensor(labels)
    valid = t[t != ignore_index]
    if valid.numel() == 0:
        return f"every target is ignore_index ({ignore_index})"
    first = valid.reshape(-1)[0]
    if bool((valid == first).all()):
        return f"every one of the {valid.numel()} targets is token {int(first)}"
    return None
