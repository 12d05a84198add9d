"""Intermediate-layer distillation (kd.layer_map): projections, hidden-state and attention-map losses.

    attach_projections(student, teacher_spec, cfg)     # before the optimizer: kd_layer_proj modules
    extra, s_hidden, t_hidden = layer_kd(student, teacher, input_ids, labels, cfg, amp, pos, doc)

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
    if dist.active():  # a sharded student: each projection its own FSDP2 unit (its gradient reduced)
        for lin in proj.values():
            dist.shard_beside(lin)


def _capture(model: Decoder, layers: set[int], on: bool) -> None:
    for i in layers:
        model.model.layers[i].self_attn.capture = [] if on else None


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
    kd = cfg.kd
    t_layers = {t for t, _ in kd.layer_map}
    s_layers = {s for _, s in kd.layer_map}
    attn = kd.attention_weight > 0
    try:
        if attn:
            _capture(teacher, t_layers, True)
            _capture(student, s_layers, True)
        with torch.no_grad(), amp:
            t_hidden, t_states = teacher(input_ids, position_ids, doc_ids, collect=t_layers)
        with amp:
            s_hidden, s_states = student(input_ids, position_ids, doc_ids, collect=s_layers)
        t_qk = {i: teacher.model.layers[i].self_attn.capture[0] for i in t_layers} if attn else {}
        s_qk = {i: student.model.layers[i].self_attn.capture[0] for i in s_layers} if attn else {}
    finally:
        _capture(teacher, t_layers, False)
        _capture(student, s_layers, False)
    valid = labels != kd.ignore_index  # (B, T)
    proj = getattr(student, "kd_layer_proj", None)
    hidden = attention = torch.zeros((), device=s_hidden.device)
    mask = document_mask(doc_ids) if doc_ids is not None else None
    for t, s in kd.layer_map:
        if kd.hidden_weight > 0:
            hs = s_states[s].float()
            if proj is not None:
                hs = proj[str(s)](hs)
            hidden = hidden + hidden_state_loss(hs, t_states[t], valid, kd.hidden_loss)
        if attn:
            attention = attention + attention_map_loss(*s_qk[s], *t_qk[t], valid, mask)
    pairs = len(kd.layer_map)
    extra = (kd.hidden_weight * hidden + kd.attention_weight * attention) / pairs
    return extra, s_hidden, t_hidden
