"""Intermediate-layer distillation (kd.layer_map): projections, hidden-state and attention-map losses.

    attach_projections(student, teacher_spec, cfg)     # before the optimizer: kd_layer_proj modules
    extra, s_hidden, t_hidden = layer_kd(student, teacher, input_ids, labels, cfg, amp, pos, doc)
    terms = LayerMap(cfg)                              # the same, as an extra term of the loss

For each pair [t, s] of kd.layer_map the student's output of block s, through a learned linear map
(Hs -> Ht, no bias) when the widths differ, is compared with the teacher's output of block t (see
kdistill.ops.layer_kd): kd.hidden_weight * mean over pairs of the hidden loss (mse or cosine), plus
kd.attention_weight * mean over pairs of KL between the head-averaged attention maps. The
projections live in the student as `kd_layer_proj` (trained by the same optimizer, saved in
checkpoints, a LoRA student's too, left out of the exported model: models.decoder.KD_ONLY_PREFIX).
Under torchrun each projection is its own FSDP2 unit (`distributed.shard_beside`), so its gradient is
averaged over the processes like the student's and it is sharded in checkpoints.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from kdistill.config import RunConfig
from kdistill.errors import UserError
from kdistill.models.decoder import Decoder
from kdistill.models.spec import ModelSpec
from kdistill.ops.attention import document_mask
from kdistill.ops.layer_kd import attention_map_loss, hidden_state_loss
from kdistill.train import distributed as dist


def check_layer_map(cfg: RunConfig, teacher: ModelSpec, student: ModelSpec) -> None:
    """Every mapped layer exists in its model (a one-line error naming the pair otherwise)."""
    for i, (t, s) in enumerate(cfg.kd.layer_map):
        if t >= teacher.num_layers or s >= student.num_layers:
            raise UserError(
                f"kd.layer_map[{i}] is [{t}, {s}], expected teacher layers < {teacher.num_layers} and "
                f"student layers < {student.num_layers}"
            )


def attach_projections(student: Decoder, teacher: ModelSpec, cfg: RunConfig, seed: int = 0) -> None:
    """A Linear(Hs, Ht) per mapped student layer when the widths differ, as student.kd_layer_proj."""
    hs, ht = student.spec.hidden_size, teacher.hidden_size
    if not cfg.kd.layers_on or cfg.kd.hidden_weight == 0 or hs == ht:
        return
    dev = student.lm_head_weight.device
    g = torch.Generator().manual_seed(seed)
    proj = nn.ModuleDict()
    for _, s in cfg.kd.layer_map:
        lin = nn.Linear(hs, ht, bias=False)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(ht, hs, generator=g) / hs**0.5)
        proj[str(s)] = lin
    student.kd_layer_proj = proj.to(dev)
    # a sharded student: each projection its own FSDP2 unit (its gradient reduced); a replicated one's
    # are averaged with its other gradients (distributed.GradAverage)
    if dist.active() and dist.is_sharded(student):
        for lin in proj.values():
            dist.shard_beside(lin)


def _capture(model: Decoder, layers: set[int], on: bool) -> None:
    for i in layers:
        model.model.layers[i].self_attn.capture = [] if on else None


def forward_collect(
    model: Decoder,
    input_ids: torch.Tensor,
    amp: contextlib.AbstractContextManager,
    position_ids: torch.Tensor | None,
    doc_ids: torch.Tensor | None,
    layers: set[int],
    attention: bool,
) -> tuple[torch.Tensor, dict[int, torch.Tensor], dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    """One forward that keeps what the layer terms read: (final hidden (B, T, H), the outputs of
    blocks `layers` {i: (B, T, H)}, with `attention` their (q, k) {i: (q, k)}, else {}). Gradients as
    the caller's grad mode says (the teacher's forward runs under no_grad)."""
    try:
        if attention:
            _capture(model, layers, True)
        with amp:
            hidden, states = model(input_ids, position_ids, doc_ids, collect=layers)
        qk = {i: model.model.layers[i].self_attn.capture[0] for i in layers} if attention else {}
    finally:
        _capture(model, layers, False)
    return hidden, states, qk


class LayerMap:
    """kd.layer_map as an extra term of the loss: which blocks each model's forward keeps, and the
    weighted hidden-state and attention-map loss between them (see the module docstring)."""

    def __init__(self, cfg: RunConfig) -> None:
        self.kd = cfg.kd
        self.teacher_layers = {t for t, _ in cfg.kd.layer_map}
        self.student_layers = {s for _, s in cfg.kd.layer_map}
        self.attention = cfg.kd.attention_weight > 0

    def loss(
        self,
        student: Decoder,
        s_states: dict[int, torch.Tensor],
        s_qk: dict[int, tuple[torch.Tensor, torch.Tensor]],
        t_states: dict[int, torch.Tensor],
        t_qk: dict[int, tuple[torch.Tensor, torch.Tensor]],
        labels: torch.Tensor,
        doc_ids: torch.Tensor | None,
    ) -> torch.Tensor:
        """kd.hidden_weight x mean hidden loss + kd.attention_weight x mean attention loss over the pairs."""
        kd = self.kd
        valid = labels != kd.ignore_index  # (B, T)
        proj = getattr(student, "kd_layer_proj", None)
        device = next(iter(s_states.values())).device if s_states else labels.device
        hidden = attention = torch.zeros((), device=device)
        mask = document_mask(doc_ids) if doc_ids is not None else None
        for t, s in kd.layer_map:
            if kd.hidden_weight > 0:
                hs = s_states[s].float()
                if proj is not None:
                    hs = proj[str(s)](hs)
                hidden = hidden + hidden_state_loss(hs, t_states[t], valid, kd.hidden_loss)
            if self.attention:
                attention = attention + attention_map_loss(*s_qk[s], *t_qk[t], valid, mask)
        pairs = len(kd.layer_map)
        return (kd.hidden_weight * hidden + kd.attention_weight * attention) / pairs


def layer_kd(
    student: Decoder,
    teacher: Decoder,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    cfg: RunConfig,
    amp: contextlib.AbstractContextManager,
    position_ids: torch.Tensor | None = None,
    doc_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the weighted layer loss, student final hidden (B, T, Hs), teacher final hidden (B, T, Ht))."""
    terms = LayerMap(cfg)
    with torch.no_grad():
        t_hidden, t_states, t_qk = forward_collect(
            teacher, input_ids, amp, position_ids, doc_ids, terms.teacher_layers, terms.attention
        )
    s_hidden, s_states, s_qk = forward_collect(
        student, input_ids, amp, position_ids, doc_ids, terms.student_layers, terms.attention
    )
    extra = terms.loss(student, s_states, s_qk, t_states, t_qk, labels, doc_ids)
    return extra, s_hidden, t_hidden
