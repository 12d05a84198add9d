"""Our Llama-family decoder: Llama 3.x, Qwen2/Qwen2.5 and Qwen3 from one ModelSpec.

Module and parameter names equal Hugging Face's (`model.layers.{i}.self_attn.q_proj.weight`, ...),
so the checkpoint weight map is the identity and an exported student loads in transformers as is.

    model = Decoder(spec)                   # built on the current default device (use meta, then to_empty)
    hidden = model(input_ids)               # (B, T, H): final-normed hidden states, no logits
    logits = model.logits(input_ids)        # (B, T, V): only for eval/tests; the KD loss never needs them

Every op goes through kdistill.ops, which dispatches to a Triton kernel or to the PyTorch reference.
"""

from __future__ import annotations

import torch
from torch import nn

from kdistill.models.spec import ModelSpec
from kdistill.ops.attention import attention
from kdistill.ops.rmsnorm import add_rmsnorm, rmsnorm
from kdistill.ops.rope import apply_rope, rope_tables
from kdistill.ops.swiglu import swiglu


class RMSNorm(nn.Module):
    """Holds the weight; the math lives in kdistill.ops.rmsnorm."""

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

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        s = self.spec
        q = self.q_proj(x).view(b, t, s.num_heads, s.head_dim)  # (B, T, Hq, D)
        k = self.k_proj(x).view(b, t, s.num_kv_heads, s.head_dim)
        v = self.v_proj(x).view(b, t, s.num_kv_heads, s.head_dim)
        if s.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, T, D)
        q, k = apply_rope(q, k, cos, sin, theta=s.rope_theta)
        o = attention(q, k, v)  # (B, Hq, T, D)
        return self.o_proj(o.transpose(1, 2).reshape(b, t, s.q_size))


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.up_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


class Layer(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_eps)
        self.self_attn = Attention(spec)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_eps)
        self.mlp = MLP(spec)


class Body(nn.Module):
    """The `model.` prefix of HF names: embeddings, layers, final norm."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(Layer(spec) for _ in range(spec.num_layers))
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

    def rope(self, seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        key = (seq_len, str(device))
        if key not in self._rope_cache:
            self._rope_cache[key] = rope_tables(self.spec, seq_len, device)
        return self._rope_cache[key]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids (B, T) -> final-normed hidden states (B, T, H)."""
        s = self.spec
        cos, sin = self.rope(input_ids.shape[1], input_ids.device)
        residual = self.model.embed_tokens(input_ids)  # (B, T, H)
        layers = self.model.layers
        x = rmsnorm(residual, layers[0].input_layernorm.weight, s.rms_eps) if len(layers) else residual
        for i, layer in enumerate(layers):
            a = layer.self_attn(x, cos, sin)
            x, residual = add_rmsnorm(a, residual, layer.post_attention_layernorm.weight, s.rms_eps)
            m = layer.mlp(x)
            nxt = layers[i + 1].input_layernorm.weight if i + 1 < len(layers) else self.model.norm.weight
            x, residual = add_rmsnorm(m, residual, nxt, s.rms_eps)
        if not len(layers):
            x = rmsnorm(residual, self.model.norm.weight, s.rms_eps)
        return x

    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Full logits (B, T, V). For evaluation and tests only."""
        return self(input_ids) @ self.lm_head_weight.t()

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
    """Build on meta, materialise on `device` in `dtype`, and (if seed is not None) random-init."""
    with torch.device("meta"):
        model = Decoder(spec)
    model = model.to_empty(device=device).to(dtype)
    if seed is not None:
        model.init_weights(seed)
    return model
