"""The decode engine: static KV cache, one-token step captured as a CUDA graph, sampling on the device,
slots refilled as rows finish. Every generation goes through it: `kdistill generate` (and speculative
decoding), a run's samples (kdistill.samples) and on-policy rollouts (kdistill.train.rollouts), on a
GPU and on a CPU alike.

    engine = DecodeEngine(model, batch_size=32, max_len=640, sampling=Sampling(max_new_tokens=128),
                          stop_ids={eos})
    new = engine.generate(prompts)          # new token ids per prompt (a row's stop token last)
    engine.refresh(model)                   # the model's weights changed (a training step): copy them in

Layout. The engine keeps its weights in the decode dtype (bf16 on a GPU, the model's own on a CPU),
with q/k/v and gate/up stacked once (a decode step reads each weight once, and no concatenation runs
per step). A tensor of the model already in that dtype and device is shared, not copied (unless FSDP
manages it), so on a CPU only the stacked q/k/v and gate/up are copies. The KV cache is (B, Hkv, M, D) per layer, allocated once per
(batch bucket B, max length M); row b's slot i holds position i, so a prompt is written from slot 0
whatever its length (no left padding) and rows grow independently.

Step. Per row: the last sampled token goes to slot p = lens[b] at position p; the attention kernel
rotates its q and k at p (RoPE in the kernel, from the engine's tables), writes k and v there and reads
slots 0..p only (kernels/decode_attention.py, or its reference on a CPU), then the lm_head, the sampler and the bookkeeping run on the device: the
token is appended to the row's output unless the row is done, and the row becomes done on a stop
token, at its token budget, or when the cache is full. On a GPU the step is captured once per bucket
as a CUDA graph after prewarm (capture compiles nothing: the Triton binaries are already loaded by two
eager warm-up steps) and replayed; the host reads the done flags every `sync_every` steps. Such a round
of steps is itself one graph (the steps captured in order, no launch between them), after one launch that
draws every step's uniforms; a shorter round (a row's budget ends sooner) replays the one-step graph.

On a CPU. The same engine, the same layout and the same step, run eagerly: every op goes through the
dispatcher, which runs its PyTorch reference (and, when asked, records the key a GPU would launch: the
CPU tests prove the GPU's plan with the GPU's own code path). The CPU decodes in the model's dtype (fp32
as loaded on a CPU): the weights are shared rather than converted, and the tokens are those of the
model's own forward. Reading the done flags costs nothing there (no device to wait for), so the host
reads them after every step (sync_every 1): no step is run for rows that have already finished.

Slot refill. Prompts wait in order; whenever rows finish, the waiting prompts are prefilled into the
freed slots (a right-padded causal prefill of the new prompts only, written into their cache rows),
so a file of ragged prompts runs at a full batch until the queue is empty.

Prefill graphs. A prefill of a few prompts is host-bound (about 300 launches for a 24-block model, each
costing the host more than the device). On a GPU, a prefill shape (prompts x padded length, at most
PREFILL_GRAPH_TOKENS tokens) seen a second time is captured as a CUDA graph and replayed from then on
(`_PrefillGraphs`, kept with the cache they write into, _Slots: at most PREFILL_GRAPHS of them, one
memory pool shared by an engine's; the captured forward is the eager one, so the tokens are the same).

Sampling (`Sampling`): temperature below MIN_TEMPERATURE is greedy (argmax); otherwise logits /
temperature, then top-k, then top-p (the smallest set of most probable tokens reaching p), and one
uniform number per row from a torch.Generator seeded by `seed` picks the token by inverse CDF. The
same seed, prompts and settings give the same tokens on the same device. In the decode step the sampler
and every row's bookkeeping are one dispatcher call (dispatch.decode_sample: on a GPU one kernel,
kernels/decode_sample.py, for greedy or a temperature alone; the reference, ops/sample.py, otherwise).
"""

from __future__ import annotations

import dataclasses
import math
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as tdist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.profiler import record_function

from kdistill import dispatch
from kdistill.errors import UserError
from kdistill.kernels import decode_attention as decode_attention_kernel
from kdistill.kernels import decode_gemv
from kdistill.kernels.keys import step_bucket
from kdistill.memory import PREFILL_GRAPH_TOKENS  # prompts x padded length of a captured prefill
from kdistill.models.decoder import Decoder, rope_tables
from kdistill.models.fp8 import FP8Linear
from kdistill.models.lora import LoraLinear
from kdistill.models.spec import ModelSpec
from kdistill.ops.sample import Rows, append, sample_tokens

MIN_TEMPERATURE = 1e-5  # below this a temperature is greedy: 1 / T would overflow the logits' scale


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How tokens are chosen. temperature 0 (or below MIN_TEMPERATURE): greedy; top_k 0: off; top_p 1: off."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        def is_int(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v: Any) -> bool:
            return isinstance(v, int | float) and not isinstance(v, bool)

        if not is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise UserError(f"--max-new-tokens is {self.max_new_tokens!r}, expected an integer >= 1")
        if not is_num(self.temperature) or not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise UserError(f"--temperature is {self.temperature!r}, expected a number >= 0 (0: greedy)")
        if not is_int(self.top_k) or self.top_k < 0:
            raise UserError(f"--top-k is {self.top_k!r}, expected an integer >= 0 (0: off)")
        if not is_num(self.top_p) or not (0 < self.top_p <= 1):
            raise UserError(f"--top-p is {self.top_p!r}, expected a number in (0, 1] (1: off)")
        if not is_int(self.seed):
            raise UserError(f"--seed is {self.seed!r}, expected an integer")

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE


# -- the engine's weights -----------------------------------------------------------------------
def full_value(t: torch.Tensor) -> torch.Tensor:
    """A parameter's whole value, detached: an FSDP2 shard (a DTensor) all-gathered from every process
    (a collective: every process gathers the same parameters in the same order), a plain tensor as is."""
    t = t.detach()
    return t.full_tensor() if _is_dtensor(t) else t


_full = full_value  # the short name the layer code below uses


def _is_dtensor(t: torch.Tensor) -> bool:
    """Whether t is a DTensor (an FSDP2 shard: no storage of its own; its value is gathered)."""
    return hasattr(t, "full_tensor")


Copies = list[tuple[list[torch.Tensor], list[torch.Tensor]]]  # foreach groups: (destinations, sources)


@dataclasses.dataclass(frozen=True)
class _KeptCopies:
    """A refresh's copies kept for the next one: the parameters they were built from, their addresses
    then (a parameter whose .data is replaced moves), and the foreach groups (plain_copies)."""

    params: tuple[torch.Tensor, ...]
    addresses: tuple[int, ...]
    groups: Copies

    def serve(self, params: tuple[torch.Tensor, ...]) -> bool:
        """Whether these copies are `params`' own: the same tensors, one for one, at the same addresses."""
        return (
            len(self.params) == len(params)
            and all(a is b for a, b in zip(self.params, params))
            and tuple(p.data_ptr() for p in params) == self.addresses
        )


def _run_copies(groups: Copies) -> None:
    for dsts, srcs in groups:
        torch._foreach_copy_(dsts, srcs)


def _row_shard(t: torch.Tensor) -> bool:
    """Whether t is a DTensor sharded by rows over a one-dimensional mesh (FSDP2's parameters)."""
    placements = getattr(t, "placements", None)
    return placements is not None and len(placements) == 1 and placements[0].is_shard(0)


def _row_counts(rows: int, world: int) -> list[int]:
    """Rows of a tensor of `rows` rows on each of `world` processes when sharded by rows (torch.chunk's
    split, which FSDP2 uses: ceil(rows / world) each, the last ones shorter or empty)."""
    per = -(-rows // world)
    return [max(0, min(per, rows - r * per)) for r in range(world)]


def plain_copies(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> Copies:
    """The copies of (source, destination) pairs of whole tensors as foreach groups (destinations,
    sources), one per (source dtype, destination dtype, devices): a refresh issues one
    `torch._foreach_copy_` per group, where a `copy_` a parameter took ~300 launches from Python (the
    host's time, in which the device idles: ~5 ms a step on Qwen2.5-0.5B). A destination that is its
    source's own storage (an engine tensor shared with the model) is left out."""
    groups: dict[tuple[Any, ...], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for src, dst in pairs:
        value = full_value(src)
        if value.data_ptr() == dst.data_ptr():
            continue
        if value.shape != dst.shape:
            raise ValueError(
                f"a source of shape {tuple(value.shape)} for a destination of {tuple(dst.shape)}"
            )
        dsts, values = groups.setdefault((value.dtype, dst.dtype, value.device, dst.device), ([], []))
        dsts.append(dst)
        values.append(value)
    return list(groups.values())


@torch.no_grad()
def copy_whole(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy each source's whole value into its destination (same shape, the destination's dtype).

    Plain tensors are copied as they are. FSDP2 shards (DTensors sharded by rows on one mesh) are
    gathered in buckets: every process flattens its shards of a bucket's tensors, cast to the
    destinations' dtype (a bf16 engine gathers bf16: half the bytes of the fp32 masters), into one
    buffer, one all-gather brings every process's buffer, and each process's rows land in their
    destinations' rows. A bucket holds at most the largest tensor's bytes, so the gather's transient
    memory stays that of gathering the largest tensor in fp32 (one all-gather per parameter, before).
    A collective: every process calls it with the same tensors in the same order."""
    sharded = [(src, dst) for src, dst in pairs if _row_shard(src)]
    meshes = {id(src.device_mesh) for src, _ in sharded}  # type: ignore[attr-defined]
    if len(meshes) > 1:  # not FSDP2's layout: each tensor gathered alone
        sharded = []
    _run_copies(plain_copies([(src, dst) for src, dst in pairs if not (sharded and _row_shard(src))]))
    if not sharded:
        return
    cap = max(dst.numel() * dst.element_size() for _, dst in sharded)
    bucket: list[tuple[torch.Tensor, torch.Tensor]] = []
    size = 0
    for src, dst in sharded:
        nbytes = dst.numel() * dst.element_size()
        if bucket and (size + nbytes > cap or dst.dtype != bucket[0][1].dtype):
            _gather_bucket(bucket)
            bucket, size = [], 0
        bucket.append((src, dst))
        size += nbytes
    _gather_bucket(bucket)


def _gather_bucket(bucket: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """One all-gather of every process's shards of the bucket's tensors into their destinations."""
    group = bucket[0][0].device_mesh.get_group()  # type: ignore[attr-defined]
    world, rank = tdist.get_world_size(group), tdist.get_rank(group)
    dtype, device = bucket[0][1].dtype, bucket[0][0].to_local().device  # type: ignore[attr-defined]
    counts = [_row_counts(dst.shape[0], world) for _, dst in bucket]  # rows per process, per tensor
    widths = [dst[0].numel() if dst.dim() > 1 else 1 for _, dst in bucket]  # elements per row
    per_rank = [sum(c[r] * w for c, w in zip(counts, widths)) for r in range(world)]
    length = max(per_rank)  # every process's buffer padded to the longest
    local = []
    for (src, _), c in zip(bucket, counts):
        shard = src.to_local()  # type: ignore[attr-defined]
        if shard.shape[0] != c[rank]:
            raise RuntimeError(f"a shard has {shard.shape[0]} rows, expected {c[rank]} (not FSDP2's split)")
        local.append(shard.detach().reshape(-1).to(dtype))
    mine = torch.zeros(length, dtype=dtype, device=device)
    if local:
        flat = torch.cat(local)
        mine[: flat.numel()].copy_(flat)
    everyone = torch.empty(world * length, dtype=dtype, device=device)
    # all_gather_single is all_gather_into_tensor's newer name (the older one warns where both exist)
    gather = getattr(tdist, "all_gather_single", None) or tdist.all_gather_into_tensor
    gather(everyone, mine, group=group)
    targets, sources = [], []
    for r in range(world):
        offset = r * length
        for (_, dst), c, w in zip(bucket, counts, widths):
            start, n = sum(c[:r]), c[r]
            if n:
                targets.append(dst[start : start + n])
                sources.append(everyone[offset : offset + n * w].view(dst[start : start + n].shape))
            offset += n * w
    torch._foreach_copy_(targets, sources)


def dense_linear(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight (out, in), bias or None) of a linear layer as a plain matrix: an nn.Linear as is, a
    LoRA wrapper merged (W + scaling B A), an FP8 linear dequantised."""
    if isinstance(module, LoraLinear):
        base = module.base_layer
        w = _full(base.weight).float()
        delta = (_full(module.lora_B.weight).float() @ _full(module.lora_A.weight).float()) * module.scaling
        return w + delta.to(w.device), (_full(base.bias) if base.bias is not None else None)
    if isinstance(module, FP8Linear):
        w = module.weight.float() * module.weight_scale.float()[:, None]
        return w, module.bias
    return _full(module.weight), (_full(module.bias) if module.bias is not None else None)


@dataclasses.dataclass
class _Layer:
    ln1: torch.Tensor
    qkv: torch.Tensor  # (q_size + 2 kv_size, H)
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: torch.Tensor  # (H, q_size)
    ln2: torch.Tensor
    gate_up: torch.Tensor  # (2I, H)
    down: torch.Tensor  # (H, I)


def _layer_tensors(block: nn.Module) -> dict[str, torch.Tensor | None]:
    a, m = block.self_attn, block.mlp
    (wq, bq), (wk, bk), (wv, bv) = (dense_linear(p) for p in (a.q_proj, a.k_proj, a.v_proj))
    (wg, _), (wu, _), (wd, _) = (dense_linear(p) for p in (m.gate_proj, m.up_proj, m.down_proj))
    qn = _full(a.q_norm.weight) if hasattr(a, "q_norm") else None
    kn = _full(a.k_norm.weight) if hasattr(a, "k_norm") else None
    return {
        "ln1": _full(block.input_layernorm.weight),
        "qkv": torch.cat([wq.to(wk.dtype), wk, wv.to(wk.dtype)]),
        "qkv_bias": torch.cat([bq, bk, bv]) if bq is not None else None,
        "q_norm": qn,
        "k_norm": kn,
        "o": dense_linear(a.o_proj)[0],
        "ln2": _full(block.post_attention_layernorm.weight),
        "gate_up": torch.cat([wg, wu.to(wg.dtype)]),
        "down": wd,
    }


class DecodeWeights:
    """The decoder's weights in the decode dtype and layout, refreshed in place (graph-safe). Where the step
    folds a block's norms (decode_gemv.norm_folds), each block's gate/up rows hold the post-attention
    norm's weight folded into their inputs (W diag(w): the engine's own concatenated copy, scaled again at
    every refresh), and its q/k/v rows its input norm's weight; a folded norm runs with `ones` in its
    place."""

    def __init__(self, model: Decoder, dtype: torch.dtype, device: torch.device) -> None:
        self.spec: ModelSpec = model.spec
        self.dtype, self.device = dtype, device
        # a model's own tensor in the engine's dtype is shared, not copied (a bf16 teacher), unless FSDP
        # manages it: a sharded model's gathered tensors are freed when FSDP reshards it
        self._share = not any(isinstance(m, FSDPModule) for m in model.modules())
        self._copies: _KeptCopies | None = None  # the last refresh's, of plain parameters only
        conv = self._convert
        body = model.model
        self.embed = conv(_full(body.embed_tokens.weight))
        tied = model.spec.tie_word_embeddings
        self.lm_head = self.embed if tied else conv(_full(model.lm_head.weight))
        self.norm = conv(_full(body.norm.weight))
        self.layers = [
            _Layer(**{k: conv(v) if v is not None else None for k, v in _layer_tensors(b).items()})
            for b in body.layers
        ]
        s = self.spec
        self.fold_post, self.fold_input = decode_gemv.norm_folds(s.hidden_size, s.q_size, s.intermediate_size)
        self.ones = torch.ones(self.spec.hidden_size, dtype=dtype, device=device)
        self._fold()

    def _fold(self) -> None:
        """Fold each block's post-attention norm weight into its gate/up rows (`fold_post`) and its input
        norm weight into its q/k/v rows (`fold_input`): the engine's copies (never shared: the
        concatenations made them)."""
        # foreach: one call a fold, not one launch a layer from Python (the refresh's host time)
        if self.fold_post:
            torch._foreach_mul_([x.gate_up for x in self.layers], [x.ln2[None, :] for x in self.layers])
        if self.fold_input:
            torch._foreach_mul_([x.qkv for x in self.layers], [x.ln1[None, :] for x in self.layers])

    def ln1(self, layer: _Layer) -> torch.Tensor:
        """The input norm's weight as the engine applies it (`ones` where folded into q/k/v)."""
        return self.ones if self.fold_input else layer.ln1

    def ln2(self, layer: _Layer) -> torch.Tensor:
        """The post-attention norm's weight as the engine applies it (`ones` where folded into gate/up)."""
        return self.ones if self.fold_post else layer.ln2

    def _convert(self, t: torch.Tensor) -> torch.Tensor:
        out = t.to(device=self.device, dtype=self.dtype).contiguous()
        return out if self._share or out.data_ptr() != t.data_ptr() else out.clone()

    @torch.no_grad()
    def refresh(self, model: Decoder) -> None:
        """Copy the model's current weights into these tensors (their addresses stay: a captured graph
        reads the new values). Each parameter goes straight into its rows of the engine's tensors (no
        q/k/v or gate/up concatenation); an FSDP2-sharded model's shards are gathered a bucket at a time
        (`copy_whole`: a few all-gathers per refresh, not one per parameter). A LoRA or FP8 layer is
        merged or dequantised first (`dense_linear`), a parameter at a time."""
        params = tuple(model.parameters())
        if self._copies is not None and self._copies.serve(params):
            _run_copies(self._copies.groups)
            self._fold()
            return
        self._copies = None
        pairs = self._destinations(model)
        if pairs is not None:
            if any(_is_dtensor(src) for src, _ in pairs):  # FSDP2's shards: gathered each time
                copy_whole(pairs)
            else:
                # kept for the next refresh: an update changes the parameters in place, so the same
                # tensors at the same addresses are copied again without building the views again
                groups = plain_copies(pairs)
                _run_copies(groups)
                if not any(_is_dtensor(p) for p in params):
                    self._copies = _KeptCopies(params, tuple(p.data_ptr() for p in params), groups)
            self._fold()
            return
        body = model.model
        self.embed.copy_(_full(body.embed_tokens.weight))
        if not model.spec.tie_word_embeddings:
            self.lm_head.copy_(_full(model.lm_head.weight))
        self.norm.copy_(_full(body.norm.weight))
        for layer, block in zip(self.layers, body.layers):
            for name, value in _layer_tensors(block).items():
                if value is not None:
                    getattr(layer, name).copy_(value)
        self._fold()

    def _destinations(self, model: Decoder) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """(parameter, the view of an engine tensor its whole value fills, of its shape) for every weight
        the engine holds, or None when a linear layer is not a plain matrix (LoRA, FP8)."""
        body, s = model.model, self.spec
        pairs = [(body.embed_tokens.weight, self.embed), (body.norm.weight, self.norm)]
        if not s.tie_word_embeddings:
            pairs.append((model.lm_head.weight, self.lm_head))
        q, kv, inter = s.q_size, s.kv_size, s.intermediate_size
        for layer, block in zip(self.layers, body.layers):
            a, m = block.self_attn, block.mlp
            linears = (a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj)
            if any(isinstance(x, LoraLinear | FP8Linear) for x in linears):
                return None
            pairs += [
                (block.input_layernorm.weight, layer.ln1),
                (a.q_proj.weight, layer.qkv[:q]),
                (a.k_proj.weight, layer.qkv[q : q + kv]),
                (a.v_proj.weight, layer.qkv[q + kv :]),
                (a.o_proj.weight, layer.o),
                (block.post_attention_layernorm.weight, layer.ln2),
                (m.gate_proj.weight, layer.gate_up[:inter]),
                (m.up_proj.weight, layer.gate_up[inter:]),
                (m.down_proj.weight, layer.down),
            ]
            if layer.qkv_bias is not None:
                pairs += [
                    (a.q_proj.bias, layer.qkv_bias[:q]),
                    (a.k_proj.bias, layer.qkv_bias[q : q + kv]),
                    (a.v_proj.bias, layer.qkv_bias[q + kv :]),
                ]
            if layer.q_norm is not None:
                pairs += [(a.q_norm.weight, layer.q_norm), (a.k_norm.weight, layer.k_norm)]
        return pairs

    def nbytes(self) -> int:
        seen: set[int] = set()
        total = 0
        for t in [self.embed, self.lm_head, self.norm] + [
            v for layer in self.layers for v in dataclasses.astuple(layer) if v is not None
        ]:
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
        return total


def forward_tokens(
    w: DecodeWeights,
    ids: torch.Tensor,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    attend: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    step: bool = False,
) -> torch.Tensor:
    """The decoder's forward on ids (B, T) with RoPE tables (T, D) or per token (B, T, D) ->
    final-normed hidden states (B, T, H). attend(layer, q, k, v) with q (B, Hq, T, D) and k, v
    (B, Hkv, T, D) after RoPE returns attention's output (B, Hq, T, D) (and fills the cache). cos and
    sin None: q and k reach attend unrotated (views of the q/k/v output; the decode step's attention
    kernel rotates them itself). step: a one-token decode step (T = 1): the embedding lookup inside the
    first block's norm (dispatch.embed_rmsnorm: one launch), the block's products (q/k/v,
    o_proj, gate/up with its SwiGLU, down) go through dispatch.decode_linear (a matrix-vector kernel at
    small buckets), o_proj and down with the residual add + norm after them
    (dispatch.decode_linear_add_rmsnorm: a split product's partials summed by the norm)."""
    s = w.spec
    b, t = ids.shape
    eps = s.rms_eps
    gathered = step and len(w.layers) > 0  # the step's lookup is in its first norm (embed_rmsnorm)
    delta = None if gathered else F.embedding(ids, w.embed)  # (B, T, H)
    residual = None
    down = None  # step: the last block's down product (input, weight), left to the next add + norm
    qkv_n = s.q_size + 2 * s.kv_size
    qkv_epi = decode_gemv.EPI_BIAS if s.attention_bias else decode_gemv.EPI_NONE
    for i, layer in enumerate(w.layers):
        ss = None  # the sums of squares of a folded input norm (the down's): q/k/v scales by their rstd
        if gathered and residual is None:
            h, residual = dispatch.embed_rmsnorm(ids[:, 0], w.embed, w.ln1(layer), eps)
            h, residual = h.view(b, 1, -1), residual.view(b, 1, -1)
        elif residual is None:
            residual = delta
            h = dispatch.rmsnorm(delta, w.ln1(layer), eps)
        elif (
            down is not None
            and w.fold_input
            and dispatch.folds(b, s.hidden_size, s.intermediate_size, qkv_n, qkv_epi)
        ):
            summed, ss = dispatch.decode_linear_add_stats(*down, residual)
            h, residual = summed[:, None], summed.view(residual.shape)
        elif down is not None:
            h, residual = dispatch.decode_linear_add_rmsnorm(*down, residual, w.ln1(layer), eps)
        else:
            h, residual = dispatch.add_rmsnorm(delta, residual, w.ln1(layer), eps)
        if ss is not None:  # h un-normed: each row scaled by its rstd (the norm's weight in q/k/v's rows)
            qkv = dispatch.decode_linear_scaled(h[:, 0], layer.qkv, ss, eps, layer.qkv_bias)[:, None]
        elif step:  # (B, 1, H): the products at B rows
            qkv = dispatch.decode_linear(h[:, 0], layer.qkv, layer.qkv_bias)[:, None]
        else:
            qkv = F.linear(h, layer.qkv, layer.qkv_bias)  # (B, T, q + 2 kv)
        q, k, v = qkv.split([s.q_size, s.kv_size, s.kv_size], dim=-1)
        q = q.view(b, t, s.num_heads, s.head_dim)
        k = k.view(b, t, s.num_kv_heads, s.head_dim)
        v = v.view(b, t, s.num_kv_heads, s.head_dim)
        if layer.q_norm is not None:
            q, k = dispatch.rmsnorm(q, layer.q_norm, eps), dispatch.rmsnorm(k, layer.k_norm, eps)
        if cos is not None and sin is not None:
            q, k = dispatch.apply_rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)  # (B, H, T, D)
        else:
            q, k = q.transpose(1, 2), k.transpose(1, 2)
        o = attend(i, q, k, v.transpose(1, 2))  # (B, Hq, T, D)
        o = o.transpose(1, 2).reshape(b, t, s.q_size)
        if (
            step
            and w.fold_post
            and dispatch.folds(b, s.hidden_size, s.q_size, s.intermediate_size, decode_gemv.EPI_SWIGLU)
        ):
            # the norm inside the products: o_proj adds the residual and writes the sums of squares,
            # gate/up (the norm's weight folded into it) scales each row by its rstd
            summed, ss = dispatch.decode_linear_add_stats(o[:, 0], layer.o, residual)
            residual = summed.view(residual.shape)
            act = dispatch.decode_linear_scaled(summed, layer.gate_up, ss, eps, gate_up=True)
            down = (act, layer.down)
        elif step:
            x, residual = dispatch.decode_linear_add_rmsnorm(o[:, 0], layer.o, residual, w.ln2(layer), eps)
            act = dispatch.decode_linear(x[:, 0], layer.gate_up, gate_up=True)
            down = (act, layer.down)
        else:
            a = F.linear(o, layer.o)
            x, residual = dispatch.add_rmsnorm(a, residual, w.ln2(layer), eps)
            gate, up = F.linear(x, layer.gate_up).chunk(2, dim=-1)  # halves of one (B, T, 2I)
            delta = F.linear(dispatch.swiglu(gate, up), layer.down)
    if residual is None:
        return dispatch.rmsnorm(delta, w.norm, eps)
    if down is not None:
        return dispatch.decode_linear_add_rmsnorm(*down, residual, w.norm, eps)[0]
    return dispatch.add_rmsnorm(delta, residual, w.norm, eps)[0]


# -- prefill graphs ---------------------------------------------------------------------------------
PREFILL_GRAPHS = 4  # captured prefills an engine keeps: the least recently used is dropped first


@dataclasses.dataclass
class _PrefillGraph:
    """A captured prefill of one shape: its static inputs (ids (n, P), the slots and the prompts'
    lengths (n,)) and its output, each prompt's last hidden state (n, H)."""

    graph: Any
    ids: torch.Tensor
    rows: torch.Tensor
    lens: torch.Tensor
    last: torch.Tensor


class _PrefillGraphs:
    """Which prefill shapes (prompts, padded length) an engine captures, and the graphs it keeps.

    A shape is captured the second time it is seen, when it holds at most max_tokens tokens: a run's
    fixed-shape prefills (a benchmark's, an on-policy step's equal prompts) replay from their second
    call on, a shape seen once costs no capture. At most `keep` graphs are kept (the least recently used
    is dropped) and at most 4 * keep shapes remembered. A shape whose capture failed, or whose graph was
    dropped, is not captured again: a run cycling through more shapes than `keep` (a ragged file's
    prefill groups) would otherwise pay a capture (two forwards and two synchronizations) at each
    sighting of each shape and replay none."""

    def __init__(self, max_tokens: int = PREFILL_GRAPH_TOKENS, keep: int = PREFILL_GRAPHS) -> None:
        self.max_tokens, self.keep = int(max_tokens), int(keep)
        self.graphs: OrderedDict[tuple[int, int], _PrefillGraph] = OrderedDict()
        self.seen: OrderedDict[tuple[int, int], bool] = OrderedDict()  # shape -> capturable

    def get(self, shape: tuple[int, int]) -> _PrefillGraph | None:
        g = self.graphs.get(shape)
        if g is not None:
            self.graphs.move_to_end(shape)
        return g

    def wants(self, shape: tuple[int, int]) -> bool:
        """Whether to capture `shape` now (its second sighting, small enough, not failed before)."""
        if shape[0] * shape[1] > self.max_tokens:
            return False
        if shape in self.seen:
            self.seen.move_to_end(shape)
            return self.seen[shape]
        self.seen[shape] = True
        while len(self.seen) > 4 * self.keep:
            self.seen.popitem(last=False)
        return False

    def add(self, shape: tuple[int, int], graph: _PrefillGraph) -> None:
        self.graphs[shape] = graph
        while len(self.graphs) > self.keep:
            dropped, _ = self.graphs.popitem(last=False)
            self.seen[dropped] = False  # stays eager from now on (remembered while in `seen`)
            self.seen.move_to_end(dropped)

    def failed(self, shape: tuple[int, int]) -> None:
        self.seen[shape] = False

    def clear(self) -> None:
        """Forget every graph and shape."""
        self.graphs.clear()
        self.seen.clear()


# -- the slots: cache and per-row state of one batch bucket --------------------------------------
class _Slots:
    """Static buffers of one (batch B, max length M): the KV cache and every row's state. The decode
    step reads and writes only these, so it can be captured as a graph and replayed."""

    def __init__(
        self, spec: ModelSpec, batch: int, max_len: int, max_new: int, dtype, device, rounds: int = 1
    ) -> None:
        shape = (batch, spec.num_kv_heads, max_len, spec.head_dim)
        self.batch, self.max_len = batch, max_len
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(spec.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(spec.num_layers)]
        i64 = dict(dtype=torch.int64, device=device)
        self.tok = torch.zeros(batch, **i64)  # the token each row feeds next
        self.lens = torch.zeros(batch, **i64)  # filled slots: the next token goes to slot lens[b]
        self.ngen = torch.zeros(batch, **i64)  # new tokens written to `out`
        self.limit = torch.ones(batch, **i64)  # each row's budget of new tokens
        self.done = torch.ones(batch, dtype=torch.bool, device=device)
        self.out = torch.zeros((batch, max_new + 1), **i64)  # the last column takes done rows' writes
        # The sampler's uniforms: one row per step of a round (`rounds` steps), each row's start 16-byte
        # aligned (a multiple of 4 floats) so every row is the same kernel key as row 0. A single step
        # reads row 0 (`u`); a full round draws them all at once (DecodeEngine._run).
        self.uk = torch.zeros((max(1, rounds), -(-batch // 4) * 4), dtype=torch.float32, device=device)
        self.u = self.uk[0, :batch]
        self.graph: Any = None  # one step
        self.round_graph: Any = None  # a round of `rounds` steps (uk's rows in order), where rounds > 1
        self.prefill_graphs = _PrefillGraphs()  # captured prefills write into these caches: kept with them


class DecodeEngine:
    """Batched generation from a Decoder with a static cache, slot refill and (on a GPU) CUDA graphs.

    batch_size: the most rows decoded at once (a call with fewer prompts uses the smallest power-of-two
    bucket that holds them). max_len: cache slots per row (prompt + new tokens). cuda_graphs: "auto"
    (on a CUDA device), "on" or "off" (the same step run eagerly: the reference of the graph path).
    sync_every: decode steps between two reads of the done flags by the host (default 8 on a GPU, 1 on a
    CPU, where a read is free). generator: draws the
    sampler's uniforms (default: a new one seeded with sampling.seed)."""

    def __init__(
        self,
        model: Decoder,
        *,
        batch_size: int,
        max_len: int,
        sampling: Sampling = Sampling(),
        stop_ids: Sequence[int] | set[int] = (),
        pad_id: int = 0,
        dtype: torch.dtype | None = None,
        cuda_graphs: str = "auto",
        sync_every: int | None = None,
        prefill_tokens: int = 16384,
        generator: torch.Generator | None = None,
    ) -> None:
        if cuda_graphs not in ("auto", "on", "off"):
            raise UserError(f"cuda_graphs is '{cuda_graphs}', expected auto, on or off")
        if batch_size < 1:
            raise UserError(f"--batch-size is {batch_size}, expected an integer >= 1")
        self.device = model.lm_head_weight.device
        on_gpu = self.device.type == "cuda"
        if cuda_graphs == "on" and not on_gpu:
            raise UserError("cuda_graphs is 'on' but the model is not on a CUDA device")
        self.graphs = on_gpu and cuda_graphs != "off"
        self.dtype = dtype or (torch.bfloat16 if on_gpu else model.lm_head_weight.dtype)
        self.spec = model.spec
        self.weights = DecodeWeights(model, self.dtype, self.device)
        self.batch_size, self.max_len = int(batch_size), int(max_len)
        self.sampling = sampling
        self.stops = torch.tensor(sorted(set(stop_ids)) or [-1], dtype=torch.int64, device=self.device)
        self.pad_id = int(pad_id)
        self.sync_every = max(1, int(sync_every if sync_every is not None else 8 if on_gpu else 1))
        self.prefill_tokens = max(1, int(prefill_tokens))
        # The caller's generator (its state checkpointed with a run) or one seeded by sampling.seed.
        self.generator = generator or torch.Generator(device=self.device).manual_seed(int(sampling.seed))
        cos, sin = rope_tables(self.spec, self.max_len, self.device)  # (M, D) fp32
        self.cos, self.sin = cos, sin
        # RoPE inside the decode step's attention kernel where a head's halves fit its dots
        self.rope_in_attention = decode_attention_kernel.rope_supported(self.spec.head_dim)
        self.slots: _Slots | None = None
        self.prefill_pool: Any = None  # the memory pool of every captured prefill (graph_pool_handle)
        self.steps = 0  # decode steps run (for tokens/s and the fraction of the floor)

    # -- weights ------------------------------------------------------------------------------
    def refresh(self, model: Decoder) -> None:
        """The model's weights changed (an optimizer step): copy them into the engine's."""
        self.weights.refresh(model)

    def generator_state(self) -> torch.Tensor:
        return self.generator.get_state()

    def set_generator_state(self, state: torch.Tensor) -> None:
        self.generator.set_state(state)

    # -- the step -----------------------------------------------------------------------------
    def _decode_step(self, st: _Slots, u: torch.Tensor | None = None) -> None:
        """One token for every row, all on the device (captured as a graph on a GPU); u: the rows'
        uniforms (default st.u; a round's step i reads st.uk[i])."""
        h = self._step_hidden(st, 0, st.batch)  # (B, H)
        # the sampler and every row's bookkeeping: one kernel (kernels/decode_sample.py) or the reference
        u = st.u if u is None else u
        dispatch.decode_sample(F.linear(h, self.weights.lm_head), u, self.sampling, self._rows(st))

    def _step_hidden(self, st: _Slots, lo: int, hi: int) -> torch.Tensor:
        """The decode step's blocks for the bucket's rows lo..hi-1 -> their final-normed hidden states
        (hi - lo, H). A bucket's step takes them all; benchmarks/decode_profile.py --interleave runs
        groups of rows on streams of their own."""
        n = hi - lo
        pos = st.lens[lo:hi].clamp(max=st.max_len - 1)  # (n,): a full row rewrites its last slot (it is done)

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            # q and k (n, H, 1, D) unrotated: the attention rotates them at position pos[b] (the row's
            # slot) and writes k and v into that slot
            tables = (self.cos, self.sin) if self.rope_in_attention else (None, None)
            kc, vc = st.k[i][lo:hi], st.v[i][lo:hi]  # the rows' caches (contiguous: rows lead)
            o = dispatch.decode_attention(q[:, :, 0], kc, vc, pos, k[:, :, 0], v[:, :, 0], *tables)
            return o[:, :, None]  # (n, Hq, 1, D)

        tok = st.tok[lo:hi, None]
        # a small bucket's products are matrix-vector kernels: the whole block chains (runtime.chained)
        with dispatch.chained(n <= decode_gemv.step_rows(self.spec.hidden_size)):
            if self.rope_in_attention:
                return forward_tokens(self.weights, tok, None, None, attend, step=True)[:, 0]  # (n, H)
            # a head too narrow for the kernel's halves: the RoPE kernel first, at each row's position
            cos, sin = self.cos[pos][:, None], self.sin[pos][:, None]  # (n, 1, D)
            return forward_tokens(self.weights, tok, cos, sin, attend, step=True)[:, 0]

    def forward_at(self, st: _Slots, ids: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        """T new tokens per row through the static cache: ids (B, T) go to slots start[b] + j (at those
        positions; clamped to the last slot), their keys and values are written there, and token j
        attends slots 0..start[b] + j -> final-normed hidden states (B, T, H). No host sync and fixed
        shapes (graph-safe): T = 1 is the decode step's forward and attention (the one-token kernel);
        speculative decoding's draft and verify steps (kdistill.speculative) run T = 2 and K + 1, whose
        attention is one launch of the T-token kernel per layer (dispatch.decode_attention_multi), the
        same as the one-token kernel run T times in order. A start below 0 (the draft's two-token step
        on a row never filled) is taken as 0: such a row is done, and what it computes is unused."""
        t = ids.shape[1]
        last = st.max_len - 1
        start = start.clamp(min=0)
        # as the one-token step: RoPE inside the attention kernel where a head fits it
        tables = (self.cos, self.sin) if self.rope_in_attention else (None, None)

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            if t > 1:  # q, k, v (B, H, T, D)
                return dispatch.decode_attention_multi(q, st.k[i], st.v[i], start, k, v, *tables)
            pos = start.clamp(max=last)
            o = dispatch.decode_attention(q[:, :, 0], st.k[i], st.v[i], pos, k[:, :, 0], v[:, :, 0], *tables)
            return o[:, :, None]  # (B, Hq, 1, D)

        if self.rope_in_attention:
            return forward_tokens(self.weights, ids, None, None, attend)
        table = (start[:, None] + torch.arange(t, device=start.device)).clamp(max=last)  # (B, T)
        return forward_tokens(self.weights, ids, self.cos[table], self.sin[table], attend)

    def _rows(self, st: _Slots) -> Rows:
        """The slots' per-row state as the sampler's bookkeeping takes it (ops.sample.Rows)."""
        return Rows(st.tok, st.lens, st.ngen, st.limit, st.done, st.out, self.stops, self.pad_id, st.max_len)

    def _step(self, st: _Slots) -> None:
        if not self.sampling.greedy:
            st.u.uniform_(generator=self.generator)  # outside the graph: one launch per step
        if st.graph is not None:
            st.graph.replay()
        else:
            self._decode_step(st)
        self.steps += 1

    def _round_steps(self, st: _Slots) -> list[torch.Tensor]:
        """The uniforms of a round's steps, in order: st.uk's rows."""
        return [st.uk[i, : st.batch] for i in range(st.uk.shape[0])]

    def _run(self, st: _Slots, n: int) -> None:
        """n decode steps. A full round (n == sync_every > 1) draws every step's uniforms in one launch
        and runs the steps as one graph (st.round_graph), or eagerly reading the same rows in order: the
        graph and the eager path give the same tokens. A shorter round runs single steps."""
        if n != st.uk.shape[0] or n == 1:
            for _ in range(n):
                self._step(st)
            return
        if not self.sampling.greedy:
            st.uk.uniform_(generator=self.generator)  # outside the graph: one launch per round
        if st.round_graph is not None:
            st.round_graph.replay()
        else:
            for u in self._round_steps(st):
                self._decode_step(st, u)
        self.steps += n

    def _capture(self, st: _Slots) -> None:
        """Capture the decode step of this bucket (all rows done: warm-up and capture change nothing a
        prefill does not reset). Two eager warm-up steps on a side stream load every kernel first."""
        torch.cuda.synchronize(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._decode_step(st)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: under torchrun a process group's watchdog thread polls the events of earlier
        # collectives while this thread captures; in the default (global) mode such a query from another
        # thread would invalidate the capture. The step itself has no collective.
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            self._decode_step(st)
        torch.cuda.synchronize(self.device)
        st.graph = graph
        if st.uk.shape[0] > 1:
            # a round of steps in one graph: no launch between its steps (their uniforms are drawn once
            # before it). Its scratch shares the step's pool: the two graphs never run at once and
            # neither leaves a live tensor there.
            rnd = torch.cuda.CUDAGraph()
            with torch.cuda.graph(rnd, pool=graph.pool(), capture_error_mode="thread_local"):
                for u in self._round_steps(st):
                    self._decode_step(st, u)
            torch.cuda.synchronize(self.device)
            st.round_graph = rnd

    # -- prefill ------------------------------------------------------------------------------
    def write_prompts(
        self, st: _Slots, slots: list[int], prompts: list[list[int]]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Write the prompts into the caches of `slots` (a right-padded causal forward of the prompts
        alone: padding after a prompt is never attended by it) -> (each prompt's last hidden state (n, H),
        the slots (n,), the prompt lengths (n,)) on the device. On a GPU, through a captured graph of the
        shape when it has one (_PrefillGraphs)."""
        n, p = len(prompts), max(len(x) for x in prompts)
        host = np.full((n, p), self.pad_id, dtype=np.int64)  # numpy: a torch.tensor per row is ~10x slower
        for i, row in enumerate(prompts):
            host[i, : len(row)] = row
        ids = torch.from_numpy(host).to(self.device, non_blocking=True)
        rows = torch.tensor(slots, dtype=torch.int64).to(self.device, non_blocking=True)
        lens = torch.tensor([len(x) for x in prompts], dtype=torch.int64).to(self.device, non_blocking=True)
        if self.graphs:
            g = self._prefill_graph(st, ids, rows, lens)
            if g is not None:
                g.ids.copy_(ids)
                g.rows.copy_(rows)
                g.lens.copy_(lens)
                g.graph.replay()
                return g.last, rows, lens
        return self._prompt_forward(st, ids, rows, lens), rows, lens

    def _prompt_forward(
        self, st: _Slots, ids: torch.Tensor, rows: torch.Tensor, lens: torch.Tensor
    ) -> torch.Tensor:
        """The prefill's device work (no host sync: graph-safe): the forward of ids (n, P), its keys and
        values written into the cache rows `rows` -> each prompt's last hidden state (n, H)."""
        n, p = ids.shape
        cos, sin = self.cos[:p], self.sin[:p]

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            st.k[i][rows, :, :p] = k
            st.v[i][rows, :, :p] = v
            return dispatch.attention(q, k, v)  # causal over the prompt

        h = forward_tokens(self.weights, ids, cos, sin, attend)  # (n, P, H)
        return h[torch.arange(n, device=ids.device), lens - 1]

    def _prefill_graph(
        self, st: _Slots, ids: torch.Tensor, rows: torch.Tensor, lens: torch.Tensor
    ) -> _PrefillGraph | None:
        """The captured prefill of ids' shape: kept, captured now (its second sighting), or None (run
        it eagerly). The capture runs the forward once eagerly on a side stream first (it writes these
        prompts into their rows, as the replay then does again) so every kernel is loaded; a capture
        that fails leaves the shape to the eager path for good."""
        shape = (int(ids.shape[0]), int(ids.shape[1]))
        pg = st.prefill_graphs
        g = pg.get(shape)
        if g is not None or not pg.wants(shape):
            return g
        static = (ids.clone(), rows.clone(), lens.clone())
        try:
            torch.cuda.synchronize(self.device)
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                self._prompt_forward(st, *static)
            torch.cuda.current_stream(self.device).wait_stream(side)
            if self.prefill_pool is None:
                self.prefill_pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            # thread_local as the decode step's capture (a process group's watchdog thread may poll)
            with torch.cuda.graph(graph, pool=self.prefill_pool, capture_error_mode="thread_local"):
                last = self._prompt_forward(st, *static)
            torch.cuda.synchronize(self.device)
        except RuntimeError:  # a kernel that cannot be captured: this shape stays eager
            torch.cuda.synchronize(self.device)
            pg.failed(shape)
            return None
        g = _PrefillGraph(graph, *static, last)
        pg.add(shape, g)
        return g

    @record_function("kdistill.prefill")  # a range of its own in a profile (runtime.profile_steps)
    def _prefill(self, st: _Slots, slots: list[int], prompts: list[list[int]], limits: list[int]) -> None:
        """Write the prompts into the caches of `slots` and sample each row's first token."""
        n = len(prompts)
        last, rows, lens = self.write_prompts(st, slots, prompts)
        u = None
        if not self.sampling.greedy:
            u = torch.rand(n, generator=self.generator, device=self.device)
        tok = sample_tokens(F.linear(last, self.weights.lm_head), self.sampling, u)
        st.done[rows] = False
        st.ngen[rows] = 0
        st.lens[rows] = 0
        st.limit[rows] = torch.tensor(limits, dtype=torch.int64).to(self.device, non_blocking=True)
        append(tok, lens, self._rows(st), at=rows)

    # -- the loop -----------------------------------------------------------------------------
    def bucket(self, n: int) -> int:
        """Rows decoded at once for n prompts: the smallest power of two >= n, at most batch_size."""
        return step_bucket(n, self.batch_size)

    def _slots_for(self, batch: int) -> _Slots:
        n = self.sampling.max_new_tokens
        st = self.slots
        if st is None or st.batch != batch or st.out.shape[1] != n + 1:
            self.slots = None  # free the old cache before the new one
            st = _Slots(self.spec, batch, self.max_len, n, self.dtype, self.device, self.sync_every)
            if self.graphs:
                self._capture(st)
            self.slots = st
        return st

    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        on_finish: Callable[[int, list[int]], None] | None = None,
        on_tokens: Callable[[int, list[int]], None] | None = None,
    ) -> list[list[int]]:
        """New token ids per prompt (a row's stop token included, as its last id), in prompt order.

        prompts: token ids per row, each non-empty and shorter than max_len. Rows start as slots free
        up; on_finish(index, ids) is called as each prompt's answer is complete (in finishing order), and
        on_tokens(index, ids so far) after every round of steps for the rows still running (streaming;
        one more copy to the host per round)."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("generate needs at least one prompt, each with at least one token")
        too_long = [i for i, p in enumerate(prompts) if len(p) >= self.max_len]
        if too_long:
            i = too_long[0]
            raise UserError(
                f"prompt {i + 1} has {len(prompts[i])} tokens, expected fewer than the cache's {self.max_len}"
            )
        n_new = self.sampling.max_new_tokens
        st = self._slots_for(self.bucket(len(prompts)))
        st.done.fill_(True)
        return run_slots(
            prompts,
            slots=st.batch,
            limits=[min(n_new, self.max_len - len(p)) for p in prompts],
            prefill_tokens=self.prefill_tokens,
            prefill=lambda slots, rows, limits: self._prefill(st, slots, rows, limits),
            flags=lambda: torch.stack([st.done.long(), st.ngen]),
            out=st.out,
            step=lambda: self._step(st),
            sync_every=self.sync_every,
            steps=lambda n: self._run(st, n),
            on_finish=on_finish,
            on_tokens=on_tokens,
        )


class _Snapshot:
    """A device tensor copied to the host without blocking (pinned memory and an event on a GPU);
    read() waits for the copy alone."""

    def __init__(self, t: torch.Tensor) -> None:
        self.event = None
        if t.device.type == "cuda":
            self.host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            self.host.copy_(t, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = t.clone()

    def read(self) -> torch.Tensor:
        if self.event is not None:
            self.event.synchronize()
        return self.host


def run_slots(
    prompts: Sequence[Sequence[int]],
    *,
    slots: int,
    limits: Sequence[int],
    prefill_tokens: int,
    prefill: Callable[[list[int], list[list[int]], list[int]], None],
    flags: Callable[[], torch.Tensor],
    out: torch.Tensor,
    step: Callable[[], None],
    sync_every: int,
    on_finish: Callable[[int, list[int]], None] | None = None,
    on_tokens: Callable[[int, list[int]], None] | None = None,
    on_done: Callable[[int, torch.Tensor], None] | None = None,
    steps: Callable[[int], None] | None = None,
) -> list[list[int]]:
    """The host's loop over a static cache of `slots` rows (DecodeEngine.generate, speculative decoding):
    prompts wait in order and are prefilled into free slots in groups of at most prefill_tokens padded
    tokens (prefill(slots, rows, limits), limits[i]: prompt i's budget of new tokens); then rounds of
    sync_every steps. flags() gives a (K, slots) tensor on the device, row 0 each slot's done flag and
    row 1 the tokens it has written to `out` (slots, N + 1); it is copied to the host without waiting,
    and read one round later: the next round is queued before the host waits for the last one's flags,
    so the device never idles while the host reads (a done row's steps change nothing; a finished row is
    noticed one round after it stopped). A finished slot's tokens are its prompt's answer (on_finish(i,
    ids); on_done(i, flags[:, slot]) for any bookkeeping of the other rows) and the slot takes the next
    waiting prompts; on_tokens(i, ids so far) streams. A round runs at most the steps that the running
    rows' budgets (limits) leave, counted from the last flags read and the rounds queued since (each step
    adds at least one token to a running row): rows that all run to their budget cost no step beyond it.
    steps(n), when given, runs a round's n steps in place of n calls of step() (DecodeEngine: a full round
    as one graph)."""
    waiting = deque(range(len(prompts)))
    owner: list[int | None] = [None] * slots
    results: list[list[int] | None] = [None] * len(prompts)
    left = [0] * slots  # per slot: at most this many more steps write a token of its row

    def fill(free: list[int]) -> None:
        while free and waiting:
            group: list[int] = []
            longest = 0
            while len(group) < len(free) and waiting:
                nxt = len(prompts[waiting[0]])
                if group and max(longest, nxt) * (len(group) + 1) > prefill_tokens:
                    break
                longest = max(longest, nxt)
                group.append(waiting.popleft())
            taken = [free.pop(0) for _ in group]
            for s, i in zip(taken, group):
                owner[s] = i
                left[s] = int(limits[i])
            prefill(taken, [list(prompts[i]) for i in group], [int(limits[i]) for i in group])

    def steps_left() -> int:
        """Steps the next round runs: sync_every, or fewer where every running row's budget ends sooner."""
        return min(sync_every, max((left[s] for s, o in enumerate(owner) if o is not None), default=0))

    def round_(n: int) -> _Snapshot:
        if steps is not None:
            steps(n)
        else:
            for _ in range(n):
                step()
        for s, o in enumerate(owner):
            if o is not None:
                left[s] = max(0, left[s] - n)
        return _Snapshot(flags())

    fill(list(range(slots)))
    last: _Snapshot | None = None  # the flags after the last queued round, not yet read
    while any(o is not None for o in owner):
        if last is None:  # after a prefill: flags taken before it would show the old rows
            last = round_(max(1, steps_left()))
        # the device works on the next round while the host reads the last one's flags
        n = steps_left()
        queued = round_(n) if n else None
        f, last = last.read(), queued
        for s, o in enumerate(owner):  # the flags' token counts, less the round queued since
            if o is not None and not bool(f[0, s]):
                left[s] = min(left[s], max(0, int(limits[o]) - int(f[1, s]) - n))
        finished = [s for s, o in enumerate(owner) if o is not None and bool(f[0, s])]
        if finished:
            outs = out[finished].cpu()  # after the queued round: a finished row's tokens are final
            for j, s in enumerate(finished):
                i = owner[s]
                assert i is not None
                results[i] = outs[j, : int(f[1, s])].tolist()
                owner[s] = None
                if on_done is not None:
                    on_done(i, f[:, s])
                if on_finish is not None:
                    on_finish(i, results[i])
            if waiting:
                fill(finished)
                last = None
            continue
        if on_tokens is not None:
            running = [s for s, o in enumerate(owner) if o is not None]
            outs = out[running].cpu()
            for j, s in enumerate(running):
                on_tokens(owner[s], outs[j, : int(f[1, s])].tolist())
    return [r if r is not None else [] for r in results]
