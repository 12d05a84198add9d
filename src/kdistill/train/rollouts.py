"""Rollouts: a model writes completions for a batch of prompts, in one batched call.

    gen = torch.Generator(device).manual_seed(seed)             # its state goes in the checkpoint
    out = rollout(student, prompts, RolloutSampling(128, 1.0), stop_ids={0}, generator=gen)
    out.completions[i]        # new token ids of prompt i (its stop token last, when it stopped)
    out.stopped[i]            # whether row i stopped at a stop token (else it ran to max_new_tokens)

The on-policy step's one generation (kdistill.train.onpolicy). Given `engines` (a dict the caller
keeps; on a GPU), the decode engine (kdistill.decode: a bf16 copy of the writer's weights refreshed
before each rollout, a static KV cache of max_len slots, the CUDA-graph step, sampling on the device)
writes the completions and stays cached for the next step. Otherwise the eager path: the prompts
left-padded (kdistill.generate.left_pad), one prefill, then one token per step through the decoder's
KV cache (Decoder.forward_cached), of a whole model (under torchrun a sharded writer's gathered
copy: distributed.gathered_copy). `batch` caps the engine's rows decoded at once (a row that stops
frees its slot for the next prompt, in order: kdistill.decode.run_slots; kd.rollout_batch).
Both sample with the caller's generator, so that a resumed run
draws the same tokens from the generator state it saved. The model runs in eval mode (no dropout)
and without gradients, in the caller's autocast.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence

import torch

from kdistill.decode import MIN_TEMPERATURE, DecodeEngine, Sampling
from kdistill.generate import left_pad
from kdistill.models.decoder import Decoder, KVCache
from kdistill.train import distributed as dist


@dataclasses.dataclass(frozen=True)
class RolloutSampling:
    """max_new_tokens >= 1; temperature >= decode.MIN_TEMPERATURE samples softmax(logits / temperature),
    a lower one (0 included) is greedy: the decode engine's rule, so both paths write the same tokens."""

    max_new_tokens: int
    temperature: float = 1.0


@dataclasses.dataclass
class Rollout:
    """completions: new ids per prompt; stopped: whether each ended at a stop token."""

    completions: list[list[int]]
    stopped: list[bool]

    @property
    def tokens(self) -> int:
        return sum(len(c) for c in self.completions)


def _next_token(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> torch.Tensor:
    """(B, V) fp32 logits -> (B,) token ids: argmax below MIN_TEMPERATURE (1 / T would overflow the
    logits' scale), else a draw from softmax(logits / T)."""
    if temperature < MIN_TEMPERATURE:
        return logits.argmax(-1)
    probs = (logits / temperature).softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)


@torch.no_grad()
def rollout(
    model: Decoder,
    prompts: Sequence[Sequence[int]],
    sampling: RolloutSampling,
    stop_ids: set[int] | Sequence[int],
    generator: torch.Generator | None,
    *,
    pad_id: int = 0,
    amp: contextlib.AbstractContextManager | None = None,
    engines: dict[int, DecodeEngine] | None = None,
    max_len: int | None = None,
    batch: int | None = None,
) -> Rollout:
    """Completions of every prompt (each non-empty) by `model`, in one batch (see the module docstring).
    engines: the decode engines of earlier rollouts, by model (None: the eager path); max_len: the
    engine's cache slots per row (at least the longest prompt + max_new_tokens); batch: the engine's
    rows decoded at once (None: every prompt's)."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("rollout needs at least one prompt, each with at least one token")
    if engines is None and dist.is_sharded(model):  # each forward would gather: processes must agree
        raise ValueError("the eager rollout writes with a whole model: pass distributed.gathered_copy(model)")
    if engines is not None:  # the engine copies a sharded model's weights whole (decode.full_value)
        slots = min(batch, len(prompts)) if batch else len(prompts)
        return _engine_rollout(model, prompts, sampling, stop_ids, generator, pad_id, engines, max_len, slots)
    was_training = model.training
    threads = torch.get_num_threads()
    cpu = model.lm_head_weight.device.type == "cpu"
    model.eval()
    try:
        if cpu:  # a decode step's ops are too small to split: threads would only wait on each other
            torch.set_num_threads(1)
        with amp if amp is not None else contextlib.nullcontext():
            return _decode(model, prompts, sampling, stop_ids, generator, pad_id)
    finally:
        model.train(was_training)
        if cpu:
            torch.set_num_threads(threads)


def _engine_rollout(
    model: Decoder,
    prompts: Sequence[Sequence[int]],
    sampling: RolloutSampling,
    stop_ids: set[int] | Sequence[int],
    generator: torch.Generator | None,
    pad_id: int,
    engines: dict[int, DecodeEngine],
    max_len: int | None,
    slots: int,
) -> Rollout:
    need = max(len(p) for p in prompts) + sampling.max_new_tokens
    eng = engines.get(id(model))
    if eng is None or eng.batch_size < slots or eng.max_len < need or eng.generator is not generator:
        engines.pop(id(model), None)  # free the old cache first
        eng = DecodeEngine(
            model,
            batch_size=slots,
            max_len=max(need, max_len or 0),
            sampling=Sampling(
                max_new_tokens=sampling.max_new_tokens, temperature=float(sampling.temperature)
            ),
            stop_ids=stop_ids,
            pad_id=pad_id,
            generator=generator,
        )
        engines[id(model)] = eng
    else:
        eng.refresh(model)  # the weights of the last optimizer step
    stops = set(stop_ids)
    new = eng.generate(prompts)
    return Rollout(new, [bool(r) and r[-1] in stops for r in new])


def _decode(
    model: Decoder,
    prompts: Sequence[Sequence[int]],
    sampling: RolloutSampling,
    stop_ids: set[int] | Sequence[int],
    generator: torch.Generator | None,
    pad_id: int,
) -> Rollout:
    device = model.lm_head_weight.device
    ids, pos, valid = left_pad(prompts, pad_id, device)  # (B, P) each
    b, p = ids.shape
    n = sampling.max_new_tokens
    dtype = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None
    cache = KVCache.empty(
        model.spec, batch=b, max_len=p + n, device=device, dtype=dtype or model.lm_head_weight.dtype
    )
    stops = torch.tensor(sorted(set(stop_ids)) or [-1], dtype=torch.long, device=device)
    w = model.lm_head_weight  # (V, H)
    h = model.forward_cached(ids, pos, valid, cache)[:, -1]  # (B, H)
    next_pos = pos[:, -1:] + 1  # (B, 1)
    ones = torch.ones((b, 1), dtype=torch.bool, device=device)
    done = torch.zeros(b, dtype=torch.bool, device=device)
    steps: list[torch.Tensor] = []  # (B,) per step, kept on the device until the end
    alive: list[torch.Tensor] = []  # (B,) whether the row was still writing at that step
    for step in range(n):
        tok = _next_token((h @ w.t().to(h.dtype)).float(), sampling.temperature, generator)  # (B,)
        tok = torch.where(done, torch.full_like(tok, pad_id), tok)
        alive.append(~done)
        done = done | torch.isin(tok, stops)
        steps.append(tok)
        # one host read per 16 steps: stop early when every row has stopped
        if step == n - 1 or (step % 16 == 15 and bool(done.all())):
            break
        h = model.forward_cached(tok[:, None], next_pos, ones, cache)[:, -1]
        next_pos = next_pos + 1
    toks = torch.stack(steps, 1).tolist()  # (B, steps)
    keep = torch.stack(alive, 1).tolist()
    completions = [[t for t, k in zip(row, ks) if k] for row, ks in zip(toks, keep)]
    return Rollout(completions, done.tolist())
