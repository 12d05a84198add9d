"""Rollouts: a model writes completions for a batch of prompts, in one batched call.

    gen = torch.Generator(device).manual_seed(seed)             # its state goes in the checkpoint
    out = rollout(student, prompts, RolloutSampling(128, 1.0), stop_ids={0}, generator=gen)
    out.completions[i]        # new token ids of prompt i (its stop token last, when it stopped)
    out.stopped[i]            # whether row i stopped at a stop token (else it ran to max_new_tokens)

The on-policy step's one generation (kdistill.train.onpolicy), written by the decode engine
(kdistill.decode) on every device: a copy of the writer's weights in the decode dtype (bf16 on a GPU; on
a CPU the model's own dtype, sharing every tensor it does not stack), a static KV cache of max_len slots,
the step (a CUDA graph on a GPU, eager on a CPU) and sampling on the device. Given `engines` (a dict the
caller keeps) the engine stays cached for the next step and is refreshed from the weights before each
rollout; without it the engine serves this call alone. Under torchrun the engine gathers a sharded
writer's weights itself (decode.copy_whole); a call without `engines` wants a whole model (a sharded
writer's gathered copy: distributed.gathered_copy). The engine samples with the caller's generator, so a
resumed run draws the same tokens from the generator state it saved. `batch` caps the engine's rows
decoded at once (a row that stops frees its slot for the next prompt, in order: kdistill.decode.run_slots;
kd.rollout_batch). The writer's mode and autocast
do not matter: the engine's weights are plain copies (LoRA merged, FP8 dequantised) in its own dtype.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence

import torch
from torch.profiler import record_function

from kdistill.decode import DecodeEngine, Sampling
from kdistill.models.decoder import Decoder
from kdistill.train import distributed as dist
from kdistill.train.profiling import PHASE_PREFIX


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
    engines: the decode engines of earlier rollouts, by model (None: an engine for this call alone);
    max_len: the engine's cache slots per row (at least the longest prompt + max_new_tokens); batch: the
    engine's rows decoded at once (None: every prompt's). amp: the caller's autocast, which the engine
    does not need (it decodes in its own dtype)."""
    del amp
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("rollout needs at least one prompt, each with at least one token")
    if engines is None and dist.is_sharded(model):  # each call would gather the whole model again
        raise ValueError(
            "a rollout without engines writes with a whole model: pass distributed.gathered_copy(model)"
        )
    slots = min(batch, len(prompts)) if batch else len(prompts)
    threads = torch.get_num_threads()
    cpu = model.lm_head_weight.device.type == "cpu"
    try:
        if cpu:  # a decode step's ops are too small to split: threads would only wait on each other
            torch.set_num_threads(1)
        kept = {} if engines is None else engines
        return _engine_rollout(model, prompts, sampling, stop_ids, generator, pad_id, kept, max_len, slots)
    finally:
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
        with record_function(PHASE_PREFIX + "generate.refresh"):
            eng.refresh(model)  # the weights of the last optimizer step
    stops = set(stop_ids)
    with record_function(PHASE_PREFIX + "generate.decode"):
        new = eng.generate(prompts)
    return Rollout(new, [bool(r) and r[-1] in stops for r in new])
