"""Our Llama-family decoder: Llama 3.x, Qwen2/Qwen2.5 and Qwen3 from one ModelSpec.

Module and parameter names equal Hugging Face's (`model.layers.{i}.self_attn.q_proj.weight`, ...),
so the checkpoint weight map is the identity and an exported student loads in transformers as is.

    model = Decoder(spec)                   # built on the current default device (use meta, then to_empty)
    hidden = model(input_ids)               # (B, T, H): final-normed hidden states, no logits
    hidden = model(input_ids, position_ids, doc_ids)   # packed conversations: positions restart per
                                                       # conversation, attention stays inside it
    logits = model.logits(input_ids)        # (B, T, V): only for eval/tests; the KD loss never needs them
    hidden, states = model(input_ids, collect={0, 2})   # and {layer: that block's output (B, T, H)}

Generation does not run through this module's forward: the decode engine (kdistill.decode) runs the
same weights through its own static-cache step.

Every op goes through kdistill.dispatch, which picks a Triton kernel or the PyTorch reference.

The residual add before each norm is fused into the norm (`add_rmsnorm`). The hidden-size norms feed
GEMMs only (the projections, the lm_head), so under autocast they write their output in the autocast
dtype (`to_gemm`): the values autocast would have cast to, without the cast kernels and their
gradients' casts back; the residual stream keeps the weights' dtype. A `Block` is self-contained
(FSDP can wrap it whole): it starts with the fused add + input norm of the residual stream and returns
its MLP output unadded, so the next block (or the final norm) fuses that add into its own norm:

    block 0:   h = rmsnorm(emb)                              residual = emb
    block i:   h, residual = add_rmsnorm(delta, residual)    (delta: block i-1's MLP output)
               a = attn(h);  x, residual = add_rmsnorm(a, residual);  delta = mlp(x)
    final:     out = add_rmsnorm(delta, residual, model.norm)

The q/k/v and gate/up projections are one GEMM each. A built or loaded model keeps each group's weights
(and the q/k/v biases) adjacent in one storage (`join_projections`: the parameters are views of it), so the
GEMM reads them as one matrix (`joined`) instead of concatenating them at every forward; weights that were
given storage of their own (adapters, FP8 layers, FSDP2's shards, a dtype change) are concatenated as before.

Activation checkpointing (`model.checkpoint_blocks(True)`): each block keeps only its inputs for
backward and is recomputed there (torch.utils.checkpoint, non-reentrant), through the same dispatch
calls, so the kernels it launches are the same keys as without it. Without it, the MLP recomputes its
SwiGLU output in backward (`dispatch.swiglu_down`) unless `model.keep_swiglu(True)` keeps it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from kdistill.dispatch import (
    add_rmsnorm,
    apply_rope,
    attention,
    rmsnorm,
    swiglu,
    swiglu_down,
    swiglu_halves,
)
from kdistill.models.fp8 import FP8Linear, fp8_linear, fused
from kdistill.models.fp8_train import FP8TrainLinear, fp8_train_linear
from kdistill.models.spec import ModelSpec, rope_inv_freq
from kdistill.ops.attention import document_bias

# Modules of the student that exist for distillation only (e.g. `kd_layer_proj`, the layer map's
# projections): trained and checkpointed with the student, left out of every exported model.
KD_ONLY_PREFIX = "kd_"


def _adjacent(ts: list[torch.Tensor]) -> bool:
    """Whether ts are contiguous blocks of rows of one storage, one after the other, in order."""
    first = ts[0]
    if not all(hasattr(t, "untyped_storage") and not hasattr(t, "to_local") for t in ts):
        return False  # an FSDP2 shard (DTensor) or a meta tensor's stand-in
    try:
        ptr = first.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # no storage to share (a fake or functional tensor)
        return False
    offset = first.storage_offset()
    for t in ts:
        if (
            t.device != first.device
            or t.dtype != first.dtype
            or t.shape[1:] != first.shape[1:]
            or not t.is_contiguous()
            or t.untyped_storage().data_ptr() != ptr
            or t.storage_offset() != offset
        ):
            return False
        offset += t.numel()
    return ptr != 0


def _as_one(ts: Sequence[torch.Tensor]) -> torch.Tensor:
    """Adjacent tensors (`_adjacent`) as the one tensor they make up: a view of their storage."""
    first = ts[0]
    shape = (sum(t.shape[0] for t in ts), *first.shape[1:])
    return first.as_strided(shape, first.stride() if first.dim() > 1 else (1,), first.storage_offset())


class _Rows(torch.autograd.Function):
    """Tensors that are adjacent blocks of rows of one storage, as one tensor (a view, no copy); its
    gradient goes back to each as its block of rows (as torch.cat's would)."""

    @staticmethod
    def forward(ctx, *ts: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.rows = [t.shape[0] for t in ts]
        return _as_one(ts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        return tuple(grad.split(ctx.rows))


def joined(ts: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat(ts) for tensors of equal trailing shape, without the copy where they are already
    adjacent in one storage (`join_projections`): a view, whose gradient reaches each tensor."""
    if len(ts) > 1 and _adjacent(ts):
        if torch.is_grad_enabled() and any(t.requires_grad for t in ts):
            return _Rows.apply(*ts)
        return _as_one(ts)
    return torch.cat(ts)


def join_projections(model: nn.Module) -> int:
    """Give each block's [q; k; v] and [gate; up] weights (and q/k/v biases) one storage each, the
    parameters becoming views of it (the same Parameter objects, values unchanged), so that the fused
    projections read them as one matrix (`joined`) instead of concatenating them at every forward: for a
    Qwen2.5-7B that is ~17 GB of copies a forward. Plain linears only (adapters, FP8 layers and FSDP2's
    shards keep concatenating). Returns the number of groups joined."""
    groups: list[list[torch.Tensor]] = []
    for mod in model.modules():
        if isinstance(mod, Attention):
            linears = [mod.q_proj, mod.k_proj, mod.v_proj]
        elif isinstance(mod, MLP):
            linears = [mod.gate_proj, mod.up_proj]
        else:
            continue
        if not all(type(x) is nn.Linear for x in linears):
            continue
        groups.append([x.weight for x in linears])
        if all(x.bias is not None for x in linears):
            groups.append([x.bias for x in linears])
    done = 0
    with torch.no_grad():
        for ps in groups:
            first = ps[0]
            if _adjacent(ps) or first.is_meta or hasattr(first, "to_local"):
                continue
            if any(
                p.dtype != first.dtype or p.device != first.device or p.shape[1:] != first.shape[1:]
                for p in ps
            ):
                continue
            buf = torch.cat([p.detach() for p in ps])
            start = 0
            for p in ps:
                p.data = buf[start : start + p.shape[0]]
                start += p.shape[0]
            done += 1
    return done


def rope_tables(
    spec: ModelSpec, seq_len: int, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables (T, D) in fp32 for positions 0..T-1, llama3 scaling included."""
    inv = torch.tensor(rope_inv_freq(spec), dtype=torch.float32, device=device)  # (D/2,)
    pos = torch.arange(seq_len, dtype=torch.float32, device=device)
    freqs = torch.outer(pos, inv)  # (T, D/2)
    emb = torch.cat([freqs, freqs], dim=-1)  # (T, D)
    return emb.cos(), emb.sin()


class RMSNorm(nn.Module):
    """Holds the weight; the math lives in kdistill.ops.rmsnorm (dispatched by kdistill.dispatch)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rmsnorm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        h, bias = spec.hidden_size, spec.attention_bias
        self.spec = spec
        self.q_proj = nn.Linear(h, spec.q_size, bias=bias)
        self.k_proj = nn.Linear(h, spec.kv_size, bias=bias)
        self.v_proj = nn.Linear(h, spec.kv_size, bias=bias)
        self.o_proj = nn.Linear(spec.q_size, h, bias=False)
        if spec.qk_norm:
            self.q_norm = RMSNorm(spec.head_dim, spec.rms_eps)
            self.k_norm = RMSNorm(spec.head_dim, spec.rms_eps)
        self.capture: list | None = None  # attention-map transfer: (q, k) after RoPE appended here

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q (B, T, q_size), k and v (B, T, kv_size) from one GEMM against [Wq; Wk; Wv].

        One GEMM instead of three (the k/v ones are narrow: kv_size columns), and x has a single
        consumer: under autocast it is cast to bf16 once, not once per projection, and only that one
        copy is kept for backward, where the three input gradients come out of one GEMM. The
        parameters stay the three HF linears; wrapped projections (adapters) run as modules."""
        projs = (self.q_proj, self.k_proj, self.v_proj)
        if all(type(p) is FP8Linear for p in projs):  # an FP8 teacher: one FP8 GEMM
            qkv = fp8_linear(x, *fused(list(projs)))
        elif all(type(p) is nn.Linear for p in projs) or all(type(p) is FP8TrainLinear for p in projs):
            w = joined([p.weight for p in projs])  # (q_size + 2 kv_size, H)
            bias = joined([p.bias for p in projs]) if self.q_proj.bias is not None else None
            # (B, T, q_size + 2 kv_size); an FP8 student (runtime.precision=fp8): one FP8 GEMM
            linear = fp8_train_linear if type(self.q_proj) is FP8TrainLinear else F.linear
            qkv = linear(x, w, bias)
        else:
            return self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q, k, v = qkv.split([self.spec.q_size, self.spec.kv_size, self.spec.kv_size], dim=-1)
        # q and k stay views: RoPE reads them with their strides and writes new tensors. k is copied
        # out only where it would not start 16-byte aligned (the RoPE kernel is specialised on pointer
        # alignment, and the plan assumes aligned inputs). v goes to attention as is, except when it
        # is kept for backward (attention saves it: a view would keep the whole qkv buffer alive) or
        # unaligned.
        fresh = torch.contiguous_format  # clone: a new allocation even where the view looks contiguous
        es = qkv.element_size()
        if (self.spec.q_size * es) % 16:
            k = k.clone(memory_format=fresh)
        if qkv.requires_grad or ((self.spec.q_size + self.spec.kv_size) * es) % 16:
            v = v.clone(memory_format=fresh)
        return q, k, v

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x (B, T, H); cos/sin (T, D) or per token (B, T, D); mask None (causal) or (B, 1, T, T), a
        bool mask or an additive bias (ops.attention.document_bias)."""
        b, t, _ = x.shape
        s = self.spec
        q, k, v = self.project_qkv(x)
        q = q.view(b, t, s.num_heads, s.head_dim)  # (B, T, Hq, D)
        k = k.view(b, t, s.num_kv_heads, s.head_dim)
        v = v.view(b, t, s.num_kv_heads, s.head_dim)
        if s.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, T, D)
        q, k = apply_rope(q, k, cos, sin)
        if self.capture is not None:
            self.capture.append((q, k))  # (B, Hq, T, D), (B, Hkv, T, D)
        o = attention(q, k, v, mask)  # (B, Hq, T, D)
        return self.o_proj(o.transpose(1, 2).reshape(b, t, s.q_size))


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        # keep the SwiGLU output for backward instead of recomputing it (Decoder.keep_swiglu)
        self.keep_swiglu = False
        self.gate_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.up_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, T, H) -> (B, T, H).

        gate and up come from one GEMM against [W_gate; W_up] (as q/k/v do): x has one consumer, and
        the SwiGLU kernels read the two halves of its (B, T, 2I) output in place and write their
        gradients back as the halves of one tensor, so nothing is concatenated in backward. Wrapped
        projections (adapters) run as modules."""
        plain = all(type(p) is nn.Linear and p.bias is None for p in (self.gate_proj, self.up_proj))
        if all(type(p) is FP8Linear for p in (self.gate_proj, self.up_proj)):  # an FP8 teacher
            gate, up = fp8_linear(x, *fused([self.gate_proj, self.up_proj])).chunk(2, dim=-1)
        elif all(type(p) is FP8TrainLinear and p.bias is None for p in (self.gate_proj, self.up_proj)):
            # an FP8 student: [gate, up] from one FP8 GEMM, SwiGLU on its halves (their gradient
            # written as one (B, T, 2I) tensor); the down_proj module (FP8TrainLinear) keeps its
            # fp8 input for backward, so the SwiGLU output is not recomputed
            w = torch.cat([self.gate_proj.weight, self.up_proj.weight])  # (2I, H)
            return self.down_proj(swiglu_halves(fp8_train_linear(x, w)))
        elif plain:
            gu = F.linear(x, joined([self.gate_proj.weight, self.up_proj.weight]))  # (B, T, 2I)
            if type(self.down_proj) is nn.Linear and self.down_proj.bias is None:
                if self.keep_swiglu:  # the SwiGLU output kept for down_proj's weight gradient
                    return F.linear(swiglu_halves(gu), self.down_proj.weight)
                return swiglu_down(gu, self.down_proj.weight)  # SwiGLU output recomputed in backward
            gate, up = gu.chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)  # (B, T, I)
        return self.down_proj(swiglu(gate, up))  # a wrapped down_proj (adapters) runs as a module


class Block(nn.Module):
    """One decoder layer (`model.layers.N`): input norm, attention, post-attention norm, MLP."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.eps = spec.rms_eps
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_eps)
        self.self_attn = Attention(spec)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_eps)
        self.mlp = MLP(spec)
        self.checkpointed = False  # recompute in backward (Decoder.checkpoint_blocks)

    def forward(
        self,
        delta: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """delta (B, T, H): the previous block's MLP output, or the embeddings when residual is None
        (block 0). Returns (this block's MLP output (B, T, H), the residual stream before it)."""
        if self.checkpointed and torch.is_grad_enabled():
            # Inside the module's call, so FSDP's hooks stay outside the recomputed region.
            return checkpoint(self.layer, delta, residual, cos, sin, mask, use_reentrant=False)
        return self.layer(delta, residual, cos, sin, mask)

    def layer(
        self,
        delta: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The block's computation (see forward)."""
        if residual is None:
            residual = delta
            h = rmsnorm(delta, self.input_layernorm.weight, self.eps, to_gemm=True)
        else:
            h, residual = add_rmsnorm(delta, residual, self.input_layernorm.weight, self.eps, to_gemm=True)
        a = self.self_attn(h, cos, sin, mask)
        x, residual = add_rmsnorm(a, residual, self.post_attention_layernorm.weight, self.eps, to_gemm=True)
        return self.mlp(x), residual


class Body(nn.Module):
    """The `model.` prefix of HF names: embeddings, layers, final norm."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(Block(spec) for _ in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_eps)


class Decoder(nn.Module):
    """A causal decoder that returns final hidden states; the lm_head is applied by the loss."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.model = Body(spec)
        if not spec.tie_word_embeddings:
            self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        self._rope_cache: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """(V, H): the output projection (the embedding matrix when tied)."""
        if self.spec.tie_word_embeddings:
            return self.model.embed_tokens.weight
        return self.lm_head.weight

    def checkpoint_blocks(self, on: bool = True) -> None:
        """Activation checkpointing per decoder block: keep each block's inputs, recompute the rest in
        backward. Off by default; forward values and gradients are the same either way."""
        for block in self.model.layers:
            block.checkpointed = on

    def keep_swiglu(self, on: bool = True) -> None:
        """The MLPs keep their SwiGLU output (N, I) for down_proj's backward instead of recomputing it
        there from [gate, up] (one elementwise pass a layer less, I elements a token and layer more).
        Off by default; values and gradients are the same either way."""
        for block in self.model.layers:
            block.mlp.keep_swiglu = on

    def rope(self, seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        key = (seq_len, str(device))
        if key not in self._rope_cache:
            self._rope_cache[key] = rope_tables(self.spec, seq_len, device)
        return self._rope_cache[key]

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        doc_ids: torch.Tensor | None = None,
        collect: set[int] | frozenset[int] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """input_ids (B, T) -> final-normed hidden states (B, T, H).

        position_ids (B, T): per-token positions (restarting per packed conversation), None: 0..T-1.
        doc_ids (B, T): document of each token (-1: padding); attention never crosses documents.
        None: plain causal attention over the whole row.
        collect: layer indices whose outputs (the residual stream after that block, as transformers'
        hidden_states[i + 1]) are returned too: (hidden, {i: (B, T, H)}). None: hidden alone."""
        eps = self.spec.rms_eps
        cos, sin = self.rope(input_ids.shape[1], input_ids.device)  # (T, D) each
        if position_ids is not None:
            cos, sin = cos[position_ids], sin[position_ids]  # (B, T, D): gathered per token
        mask = None  # (B, 1, T, T) additive bias in the attention's dtype, shared by every layer
        if doc_ids is not None:  # q's dtype: autocast's, else the residual stream's (the embeddings')
            kind = input_ids.device.type
            on = torch.is_autocast_enabled(kind)
            dtype = torch.get_autocast_dtype(kind) if on else self.model.embed_tokens.weight.dtype
            mask = document_bias(doc_ids, dtype)
        delta = self.model.embed_tokens(input_ids)  # (B, T, H)
        residual = None
        states: dict[int, torch.Tensor] = {}
        for i, block in enumerate(self.model.layers):
            delta, residual = block(delta, residual, cos, sin, mask)
            if collect is not None and i in collect:
                states[i] = delta + residual  # (B, T, H): this block's output
        if residual is None:  # no layers
            out = rmsnorm(delta, self.model.norm.weight, eps, to_gemm=True)
        else:
            out = add_rmsnorm(delta, residual, self.model.norm.weight, eps, to_gemm=True)[0]
        return out if collect is None else (out, states)

    def logits(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        doc_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Full logits (B, T, V). For evaluation and tests only."""
        return self(input_ids, position_ids, doc_ids) @ self.lm_head_weight.t()

    @torch.no_grad()
    def init_weights(self, seed: int = 0, std: float = 0.02) -> None:
        """Random init (normal(0, std) for matrices, ones for norms, zeros for biases), deterministic."""
        g = torch.Generator(device="cpu").manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32) * std)


def build_decoder(
    spec: ModelSpec,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int | None = 0,
) -> Decoder:
    """Build on meta, materialise on `device` in `dtype` (never in float32 first: a 32B model in bf16
    takes its 65 GB, not 130), and (if seed is not None) random-init."""
    with torch.device("meta"):
        model = Decoder(spec)
    model = model.to(dtype).to_empty(device=device)
    if seed is not None:
        model.init_weights(seed)
    join_projections(model)
    return model
