"""Loading a run's inputs: its data, a teacher cache, the teacher(s) and the student.

    data = load_data(cfg, tok)                                           # PreparedData (cached tokens)
    cache = open_teacher_cache(cfg, tok, data)                           # teacher.cache, checked
    teacher, student, init = load_models(cfg, student_spec, device, dtype, trim_rows)
    mixture = load_mixture(cfg, teacher, trims, device, dtype)           # several teachers, or None

The teacher is frozen (eval, no gradients) in the compute dtype (FP8 linears with teacher.precision
fp8); the student is fp32 in train mode, pretrained, random or from teacher layers, with LoRA
adapters when student.lora asks for them (FP8 GEMMs over fp32 masters with runtime.precision fp8).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path

import torch

from kdistill.config import RunConfig
from kdistill.data import PreparedData, prepare_data
from kdistill.data.align import vocab_map
from kdistill.data.chat import Conversation
from kdistill.data.chat_data import is_conversation_data, prepare_chat_data
from kdistill.data.chat_template import ChatTemplate, load_chat_template, template_mismatch
from kdistill.data.cross_chat import AlignedRows, pack_aligned
from kdistill.dtypes import torch_dtype
from kdistill.errors import UserError
from kdistill.models import fp8
from kdistill.models.decoder import Decoder, build_decoder
from kdistill.models.fp8_train import convert_student_to_fp8
from kdistill.models.hf_io import has_weights, load_model
from kdistill.models.lora import apply_lora
from kdistill.models.spec import ModelSpec
from kdistill.models.tokenizer import Tokenizer, load_tokenizer
from kdistill.teacher_cache import TeacherCache, run_identity
from kdistill.train import distributed as dist
from kdistill.train.corpus import expand_data_paths

log = logging.getLogger("kdistill")


def load_data(cfg: RunConfig, tok: Tokenizer) -> PreparedData:
    """Train and held-out sequences. The held-out split does not depend on the training seed, so runs
    stay comparable; under torchrun rank 0 fills the token cache and the others read it."""
    data_cfg = dataclasses.replace(
        cfg.data, train=expand_data_paths(cfg.data.train), heldout=expand_data_paths(cfg.data.heldout)
    )
    if is_conversation_data(data_cfg.train):
        pack = cross_chat_packer(cfg, tok) if cfg.kd.cross_tokenizer else None
        return prepare_chat_data(
            data_cfg, tok, chat_template(cfg), seed=0, prompts=cfg.kd.generates, pack_train=pack
        )
    with dist.main_first():
        return prepare_data(data_cfg, tok, seed=0)


def open_teacher_cache(cfg: RunConfig, tok: Tokenizer, data: PreparedData) -> TeacherCache:
    """teacher.cache opened and checked against this run's teacher, tokenizer, packed rows, seq_len and
    the held-out rows its evals read (a one-line error naming the field that differs). A cache without
    held-out targets (written before they were cached) is used with one log line: its evals report the
    student's CE only."""
    if cfg.student.init == "teacher_layers":
        raise UserError(
            "student.init=teacher_layers needs the teacher's weights, but teacher.cache skips loading it"
        )
    cache = TeacherCache.open(cfg.teacher.cache, run_identity(cfg, tok.identity, data.train, data.heldout))
    if cache.heldout is None and dist.is_main():
        log.warning(
            "teacher.cache %s holds no held-out targets (written before they were cached): held-out evals "
            "report the student's CE only; run kdistill teacher-cache again with the same --out to add them",
            cfg.teacher.cache,
        )
    return cache


def cross_chat_packer(cfg: RunConfig, tok: Tokenizer) -> Callable[[list[Conversation]], AlignedRows]:
    """kd.cross_tokenizer over conversations: packs the training conversations rendered by both models,
    the student's with its template (chat_template) and tokenizer `tok`, the teacher's with its own
    template and tokenizer, aligned by the learned messages' text (kdistill.data.cross_chat)."""
    s_template, d = chat_template(cfg), cfg.data
    t_template = load_chat_template(cfg.teacher.path)
    t_tok = load_tokenizer(cfg.teacher.path)
    pad = tok.eos_id if tok.eos_id is not None else 0
    vmap = vocab_map(tok, t_tok)  # the exact positions' next tokens: the same text in both vocabularies
    return lambda convs: pack_aligned(
        convs, s_template, tok, t_template, t_tok, int(d.seq_len), pad_id=pad, train_on=d.train_on,
        template_kwargs=d.template_kwargs, max_tokens=int(d.max_tokens or 0), vmap=vmap,
    )  # fmt: skip


def chat_template(cfg: RunConfig) -> ChatTemplate:
    """The template conversations are rendered with: data.chat_template when set, else the teacher's.
    A student directory whose own template differs gets a warning naming both. With kd.cross_tokenizer
    this is the student's side (data.chat_template, else the student's own template): the teacher
    renders with its own (cross_chat_packer)."""
    if cfg.kd.cross_tokenizer:
        return load_chat_template(cfg.student.path, cfg.data.chat_template or None)
    template = load_chat_template(cfg.teacher.path, cfg.data.chat_template or None)
    student_dir = Path(cfg.student.path)
    if not cfg.data.chat_template and student_dir.is_dir():
        try:
            theirs = load_chat_template(student_dir)
        except UserError:  # a student without a template of its own: nothing to compare
            return template
        warning = template_mismatch(template, theirs)
        if warning:
            log.warning("%s", warning)
    return template


def exported_chat_template(cfg: RunConfig, conversations: bool) -> str | None:
    """The chat template a run's exported student carries in place of its source directory's own: the
    text of the template the run rendered its conversations with (data.chat_template, else the
    teacher's: the student answers in the format it learned), else None. The run's student/, a LoRA
    run's adapter/ and `kdistill export --merge` (whose base is the student's directory, with a template
    of its own) all take it from here.

    Raises:
        UserError: the template cannot be read or does not compile (naming the field and file).
    """
    if not conversations:
        return None
    return load_chat_template(cfg.teacher.path, cfg.data.chat_template or None).source


def teacher_precision(cfg: RunConfig, teacher: Decoder, device: torch.device) -> None:
    """teacher.precision=fp8: the frozen teacher's decoder linears become FP8 GEMMs (weights quantised
    here, once); refused on a GPU without FP8 matrix units."""
    if cfg.teacher.precision == "fp8":
        fp8.check_device(device)
        fp8.convert_to_fp8(teacher)


def student_precision(cfg: RunConfig, student: Decoder, device: torch.device) -> None:
    """runtime.precision=fp8: the student's decoder linears train through FP8 GEMMs (fp32 master
    weights kept; kdistill.models.fp8_train); refused on a GPU without FP8 matrix units."""
    if cfg.runtime.precision == "fp8":
        fp8.check_device(device, "runtime.precision")
        convert_student_to_fp8(student)


def load_mixture(
    cfg: RunConfig,
    teacher: Decoder | None,
    trims: list[int | None],
    device: torch.device,
    dtype: torch.dtype,
) -> list[tuple[Decoder, float]] | None:
    """Several teachers (`teachers:`): [(teacher, normalised weight), ...], the first being the one
    load_models loaded, the others loaded here, each frozen in the compute dtype. None for one teacher."""
    if len(cfg.teachers) < 2 or teacher is None:
        return None
    out = [(teacher, cfg.teachers[0].weight)]
    for entry, trim in zip(cfg.teachers[1:], trims):
        t = load_model(entry.path, device=device, dtype=dtype, vocab_rows=trim)
        t.eval().requires_grad_(False)
        teacher_precision(cfg, t, device)
        out.append((t, entry.weight))
    return out


def load_models(
    cfg: RunConfig,
    student_spec: ModelSpec,
    device: torch.device,
    dtype: torch.dtype,
    trim_rows: int | None,
    teacher_device: torch.device | None = None,
) -> tuple[Decoder | None, Decoder, str]:
    """(frozen teacher in the compute dtype, fp32 student in train mode, how the student began).
    The teacher is loaded even at alpha=0: held-out evals report its loss and the KL to it; onto
    teacher_device when given (the host, for a teacher that FSDP2 shards onto the GPUs). With
    teacher.cache it is not loaded at all (None): the cache holds its targets."""
    teacher = None
    if not cfg.teacher.cache:
        teacher = load_model(
            cfg.teacher.path, device=teacher_device or device, dtype=dtype, vocab_rows=trim_rows
        )
        teacher.eval().requires_grad_(False)
        teacher_precision(cfg, teacher, device)
    student_dir = Path(cfg.student.path) if Path(cfg.student.path).is_dir() else None
    init = cfg.student.init
    if init == "auto":
        init = "pretrained" if student_dir is not None and has_weights(student_dir) else "random"
    if init == "pretrained":
        if student_dir is None or not has_weights(student_dir):
            raise UserError(f"student.init=pretrained but '{cfg.student.path}' holds no weights")
        base_dtype = torch_dtype(cfg.student.lora.base_dtype) if cfg.student.lora.enabled else torch.float32
        student = load_model(student_dir, device=device, dtype=base_dtype)
    else:
        student = build_decoder(student_spec, device=device, dtype=torch.float32, seed=cfg.schedule.seed)
        if init == "teacher_layers":
            init_from_teacher_layers(student, teacher)
    if cfg.student.lora.enabled:
        lo = cfg.student.lora
        if init != "pretrained":
            raise UserError(
                f"student.lora needs a pretrained student, but '{cfg.student.path}' holds no weights"
            )
        if lo.base_dtype != "float32" and (device.type != "cuda" or dtype == torch.float32):
            raise UserError(
                f"student.lora.base_dtype is {lo.base_dtype} but the run computes in float32 (the CPU, or "
                "runtime.dtype=float32): a low-precision frozen base needs a GPU run under autocast"
            )
        apply_lora(
            student,
            rank=lo.rank,
            alpha=lo.alpha,
            dropout=lo.dropout,
            targets=lo.targets,
            seed=cfg.schedule.seed,
        )
        init = f"{init}, LoRA rank {lo.rank} on {','.join(lo.targets)}"
    student_precision(cfg, student, device)
    student.train()
    return teacher, student, init


def init_from_teacher_layers(student: Decoder, teacher: Decoder) -> None:
    """Copy evenly spaced teacher layers (and embeddings, norm, head) into the student."""
    s, t = student.spec, teacher.spec
    for field in (
        "hidden_size",
        "intermediate_size",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "attention_bias",
        "qk_norm",
    ):
        if getattr(s, field) != getattr(t, field):
            raise UserError(
                f"student.init=teacher_layers needs equal {field} (student {getattr(s, field)}, "
                f"teacher {getattr(t, field)})"
            )
    picks = [round(i * (t.num_layers - 1) / max(1, s.num_layers - 1)) for i in range(s.num_layers)]
    with torch.no_grad():
        rows = s.vocab_size
        student.model.embed_tokens.weight.copy_(teacher.model.embed_tokens.weight[:rows])
        student.model.norm.weight.copy_(teacher.model.norm.weight)
        if not s.tie_word_embeddings:
            student.lm_head.weight.copy_(teacher.lm_head_weight[:rows])
        for dst, src in zip(student.model.layers, picks):
            dst.load_state_dict(teacher.model.layers[src].state_dict())
    log.info("student initialised from teacher layers %s", picks)
