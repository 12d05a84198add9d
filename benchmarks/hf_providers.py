"""The competition, measured in the same process as kdistill: transformers models distilled the way a
user would without kdistill.

Providers (each a `Provider`: build once, then `step(ids, labels)` = teacher forward without grad,
student forward, loss, backward, AdamW step):

  hf            transformers Qwen2/Llama/Qwen3 models, full [tokens x vocab] logits for teacher and
                student, log-softmax, forward KL at temperature T plus CE (what a user writes by hand);
                fp32 student master weights under bf16 autocast (kdistill's recipe)
  liger         transformers + Liger-Kernel: RoPE, RMSNorm and SwiGLU patched by
                `apply_liger_kernel_to_<model>`, and `LigerFusedLinearJSDLoss(beta=0)` (forward KL, fused
                with the lm_head, chunked) on the models' final hidden states; fp32 master weights under
                bf16 autocast
  liger-bf16    the same Liger set-up with pure bf16 student weights (no autocast, no master copy)

Random weights at the presets' real shapes (kdistill.models.presets), the same batches as kdistill's
providers. Liger-Kernel is imported only when a liger provider is asked for.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from kdistill.models.presets import PRESETS

HF_PROVIDERS = ("hf", "liger", "liger-bf16")


def _hf_config(name: str, attn: str = "sdpa") -> Any:
    import transformers

    raw = dict(PRESETS[name])
    kind = raw["model_type"]
    cls = {"qwen2": "Qwen2Config", "qwen3": "Qwen3Config", "llama": "LlamaConfig"}[kind]
    raw.pop("architectures", None)
    raw.pop("torch_dtype", None)
    cfg = getattr(transformers, cls)(**raw)
    cfg._attn_implementation = attn
    return cfg


def _liger_patch(kind: str) -> None:
    import liger_kernel.transformers as lk

    fn = {
        "qwen2": lk.apply_liger_kernel_to_qwen2,
        "qwen3": lk.apply_liger_kernel_to_qwen3,
        "llama": lk.apply_liger_kernel_to_llama,
    }[kind]
    fn(rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=False)


def _model(name: str, dtype: torch.dtype, seed: int) -> torch.nn.Module:
    import transformers

    torch.manual_seed(seed)
    with torch.device("cuda"):
        m = transformers.AutoModelForCausalLM.from_config(_hf_config(name), dtype=dtype)
    return m


def _head_weight(m: torch.nn.Module) -> torch.Tensor:
    return m.get_output_embeddings().weight


@dataclasses.dataclass
class Provider:
    name: str
    step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    modules: list[torch.nn.Module]


def make_provider(
    provider: str, teacher: str, student: str, *, alpha: float, temperature: float, lr: float = 1e-4
) -> Provider:
    """Build teacher and student for `provider` on the current CUDA device."""
    kind = PRESETS[student]["model_type"]
    if provider.startswith("liger"):
        _liger_patch(kind)
    t_model = _model(teacher, torch.bfloat16, 1).eval().requires_grad_(False)
    pure_bf16 = provider == "liger-bf16"
    s_model = _model(student, torch.bfloat16 if pure_bf16 else torch.float32, 2).train()
    opt = torch.optim.AdamW(s_model.parameters(), lr=lr)
    amp = torch.autocast("cuda", dtype=torch.bfloat16, enabled=not pure_bf16)
    T = float(temperature)

    if provider == "hf":

        def loss_fn(ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
                t_logits = t_model(input_ids=ids).logits
            with amp:
                s_logits = s_model(input_ids=ids).logits
            s = s_logits.float().flatten(0, 1)
            t = t_logits.float().flatten(0, 1)
            ce = F.cross_entropy(s, labels.flatten())
            kl = F.kl_div(
                F.log_softmax(s / T, -1), F.log_softmax(t / T, -1), log_target=True, reduction="batchmean"
            )
            return (1 - alpha) * ce + alpha * T * T * kl

    else:
        from liger_kernel.chunked_loss import LigerFusedLinearJSDLoss

        jsd = LigerFusedLinearJSDLoss(
            weight_hard_loss=1 - alpha, weight_soft_loss=alpha, beta=0.0, temperature=T, chunk_size=1024
        )

        def loss_fn(ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
                t_h = t_model.model(input_ids=ids).last_hidden_state.flatten(0, 1)
            with amp:
                s_h = s_model.model(input_ids=ids).last_hidden_state.flatten(0, 1)
                w = _head_weight(s_model)
                if not pure_bf16:  # the head's GEMMs in bf16, as autocast would run them
                    s_h, w = s_h.to(torch.bfloat16), w.to(torch.bfloat16)
                return jsd(s_h, w, t_h.to(torch.bfloat16), _head_weight(t_model), labels.flatten())

    def step(ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(ids, labels)
        loss.backward()
        opt.step()
        return loss.detach()

    return Provider(provider, step, [t_model, s_model])
