"""Peak GPU memory of a training step, from the model specs and the run config alone.

    terms = estimate_memory(teacher_spec, student_spec, cfg)               # bytes by term, and "total"
    terms = estimate_memory(teacher_spec, student_spec, cfg, batch=2,      # one of 4 processes, teacher
                            layout=Layout(world=4, teacher_sharded=True))  # sharded, no checkpointing
    layout = choose_layout(teacher_spec, student_spec, cfg, budget, world=4, batch=2)   # the auto choices
    need = gpus_needed(teacher_spec, student_spec, cfg, gpu_bytes)         # smallest world that fits
    fit = fit_limits(teacher_spec, student_spec, cfg, budget_bytes)        # largest batch / seq_len
    slots = fit_rollout_batch(teacher_spec, student_spec, cfg, budget_bytes)   # kd.rollout_batch that fits

The memory model (bytes on one device, GPU path: bf16 teacher, fp32 student master weights with bf16
autocast, AdamW; runtime.precision=fp8: the student's block linears keep fp8 inputs for backward) is
written term by term, one function per part of the step (`resident_memory`: weights and optimizer state;
`forward_peak_memory`: the end of the student's forward; `layer_map_memory`, `on_policy_memory`,
`eval_beside_graph_pool`, `heldout_eval_memory`), over the sizes `StepShape` derives once; `estimate_memory`
adds them up and picks the peak phase. docs/memory.md compares it with `torch.cuda.max_memory_allocated`
on an H100.

Packed conversations (`StepShape.documents`: data.train holds conversation files, read from the config's
paths alone, `rows_carry_documents`) attend through a (rows, 1, T, T) additive bias in the compute dtype
(`document_mask_bytes`), one per forward, which the student keeps from its forward to its backward.
Generated rows (kd.on_policy, kd.seq_kd) are one prompt and its completion each: plain causal, no bias.
"""

from __future__ import annotations

import dataclasses
import functools

from kdistill.config import RunConfig
from kdistill.data.chat_data import is_conversation_data
from kdistill.errors import UserError
from kdistill.models.spec import ModelSpec
from kdistill.ops.attention import bias_row_stride

GIB = 1024**3

# Saved-for-backward bytes per token per layer, per unit of width, for the bf16-autocast student on
# the kernel path. Counted from the decoder's ops: two fp32 residual sums kept by the fused norms (8H)
# and three bf16 casts of normed inputs, one for the fused q/k/v GEMM and one each for gate and up
# (6H); q and SDPA's output (4 per unit of q width) and k, v at their own kv width (SDPA reads the
# shared heads itself: 4 per unit of kv width); gate and up (4I: the SwiGLU output is recomputed in
# backward, not kept).
# Checked against torch.cuda.max_memory_allocated on an H200 (docs/memory.md).
ACT_COEF_GPU = {"hidden": 14.0, "inter": 4.0, "q": 4.0, "kv": 4.0}
# runtime.precision=fp8 (kdistill.models.fp8_train): each block linear keeps its input for backward as
# an fp8 transposed copy (1 byte per element) instead of the bf16 one, so the three normed-input casts
# take 3H instead of 6H; o_proj's and down_proj's inputs add 1 per unit of q and of I (the bf16 path
# recomputes the SwiGLU output instead; the layout of SDPA's own saved tensors does not change).
ACT_COEF_GPU_FP8 = {"hidden": 11.0, "inter": 5.0, "q": 5.0, "kv": 4.0}
ACT_COEF_CPU = {"hidden": 28.0, "inter": 12.0, "q": 12.0, "kv": 24.0}  # fp32 everywhere, reference ops
# With activation checkpointing a block keeps only its inputs for backward: the previous block's MLP
# output (bf16 under autocast) and the fp32 residual stream; its own activations exist for one block
# at a time, while it is recomputed.
CKPT_INPUT_COEF = {"gpu": 6.0, "cpu": 8.0}


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a run is spread and what it keeps: processes, the teacher sharded (or a whole copy per
    process), the student's blocks recomputed in backward (activation checkpointing)."""

    world: int = 1
    teacher_sharded: bool = False
    checkpointing: bool = False
    # Under FSDP2: the student's blocks stay gathered from their forward to their backward (freed after
    # it: no all-gathers in backward, the whole student in the compute dtype at the peak), instead of
    # being freed after each block's forward and gathered again in backward.
    student_kept: bool = False
    # The student's MLPs keep their SwiGLU output for backward instead of recomputing it there
    # (runtime.activation_checkpointing=none; decoder.MLP.keep_swiglu): I more elements a token and layer.
    swiglu_kept: bool = False
    # Under torchrun: a whole student on every process (runtime.student_placement=replicate), beside a
    # replicated teacher: one process's terms at its share of the batch, plus the flat buffer its
    # gradients are averaged in (kdistill.train.distributed.GradAverage).
    student_replicated: bool = False

    def describe(self) -> str:
        parts = [f"{self.world} process{'es' if self.world > 1 else ''}"]
        if self.world > 1:
            parts.append("teacher sharded" if self.teacher_sharded else "teacher replicated")
            if self.student_replicated:
                parts.append("student replicated")
            else:
                parts.append(
                    "student gathered from forward to backward"
                    if self.student_kept
                    else "student regathered in backward"
                )
        if self.checkpointing:
            parts.append("activation checkpointing")
        else:
            parts.append("no recompute" if self.swiglu_kept else "SwiGLU outputs recomputed")
        return ", ".join(parts)

    @classmethod
    def of(
        cls,
        choice: str,
        world: int = 1,
        teacher_sharded: bool = False,
        student_kept: bool = False,
        student_replicated: bool = False,
    ) -> Layout:
        """The layout runtime.activation_checkpointing names (auto: as swiglu, its frugal middle)."""
        return cls(
            world, teacher_sharded, choice == "blocks", student_kept, choice == "none", student_replicated
        )


@dataclasses.dataclass(frozen=True)
class StepShape:
    """What every memory term of one device's training step reads: the models, the config, the layout,
    and the sizes derived from them once (see `estimate_memory`)."""

    teacher: ModelSpec
    student: ModelSpec
    cfg: RunConfig
    layout: Layout
    extra_teachers: tuple[ModelSpec, ...]
    gpu: bool
    rows: int  # sequences per micro-batch on this device
    n: int  # tokens per micro-batch on this device
    act_bytes: int  # 2 (bf16 on a GPU) or 4 (fp32 on the CPU)
    chunk: int  # tokens per KD-loss chunk
    trainable: int  # parameters that train: the whole student, or a LoRA student's adapters
    base_bytes: int  # bytes per weight of the student's base (fp32, or a LoRA base's dtype)
    cached: bool  # teacher.cache: no teacher weights, the cached targets instead
    documents: bool = False  # rows are packed conversations: attention takes a document bias

    @classmethod
    def of(
        cls,
        teacher: ModelSpec,
        student: ModelSpec,
        cfg: RunConfig,
        device: str = "cuda",
        batch: int | None = None,
        layout: Layout | None = None,
        extra_teachers: tuple[ModelSpec, ...] | list[ModelSpec] = (),
        documents: bool | None = None,
    ) -> StepShape:
        gpu = device != "cpu"
        rows = cfg.schedule.batch_size if batch is None else batch
        n = rows * cfg.data.seq_len
        lora = cfg.student.lora
        return cls(
            teacher=teacher,
            student=student,
            cfg=cfg,
            layout=Layout.of(cfg.runtime.activation_checkpointing) if layout is None else layout,
            extra_teachers=tuple(extra_teachers),
            gpu=gpu,
            rows=rows,
            n=n,
            act_bytes=2 if gpu else 4,
            chunk=min(cfg.kd.chunk_size, n),
            # A LoRA student: a frozen base (in lora.base_dtype, no gradient, no optimizer state, no cached
            # autocast copy: autocast caches casts of trainable leaves only) and fp32 adapters that train.
            trainable=trainable_params(student, cfg),
            base_bytes=(2 if lora.base_dtype != "float32" else 4) if lora.enabled else 4,
            cached=bool(cfg.teacher.cache),
            documents=rows_carry_documents(cfg) if documents is None else documents,
        )


def trainable_params(student: ModelSpec, cfg: RunConfig) -> int:
    """Parameters of the student that train: all of them, or a LoRA student's adapters."""
    lora = cfg.student.lora
    return student.lora_params(lora.rank, lora.targets) if lora.enabled else student.param_counts()["total"]


def projection_params(teacher: ModelSpec, student: ModelSpec, cfg: RunConfig) -> int:
    """Parameters of kd.layer_map's projections (student width x teacher width per mapped pair; none
    where the widths match or no layer map is on). They train and are checkpointed, never exported."""
    if not cfg.kd.layers_on or student.hidden_size == teacher.hidden_size:
        return 0
    return len(cfg.kd.layer_map) * student.hidden_size * teacher.hidden_size


def rows_carry_documents(cfg: RunConfig) -> bool:
    """Whether the run's data rows are packed conversations (attention masked by document), from the
    config alone: data.train's files are conversation files (their first record; no tokenizing). Paths
    that cannot be read count as conversations (the worst case; the run refuses them when it loads)."""
    return _conversation_files(tuple(str(p) for p in cfg.data.train))


@functools.lru_cache(maxsize=32)
def _conversation_files(paths: tuple[str, ...]) -> bool:
    # the embedded corpus ("stdlib:train", "stdlib:heldout") is raw text: it never makes a file list
    # conversations (beside conversation files it is refused as a mix when the run loads)
    files = [p for p in paths if not p.startswith("stdlib:")]
    if not files:
        return False
    try:
        return is_conversation_data(files)
    except (UserError, OSError):
        return True


def document_mask_bytes(rows: int, seq_len: int, act_bytes: int) -> int:
    """Bytes of one forward's document bias (kdistill.ops.attention.document_bias): rows x T x Tp in
    the compute dtype, Tp = T rounded up to the bias alignment."""
    return rows * seq_len * bias_row_stride(seq_len) * act_bytes


def every_step_generated(cfg: RunConfig) -> bool:
    """Whether every step trains on generated rows (kd.on_policy = 1, or kd.seq_kd = 1): no data step's
    forward with a document bias (the held-out evals still have one)."""
    return cfg.kd.on_policy >= 1 or cfg.kd.seq_kd >= 1


def estimate_memory(
    teacher: ModelSpec,
    student: ModelSpec,
    cfg: RunConfig,
    device: str = "cuda",
    batch: int | None = None,
    layout: Layout | None = None,
    extra_teachers: tuple[ModelSpec, ...] | list[ModelSpec] = (),
    documents: bool | None = None,
) -> dict[str, int]:
    """Peak memory of one training step on one device, by term, in bytes.

    `batch` is the number of sequences this device runs per micro-batch: cfg.schedule.batch_size in
    one process, batch_size / world under torchrun (each process trains its slice of the batch).
    `layout` (default: one process, checkpointing only when runtime.activation_checkpointing=blocks):
    under FSDP2 (world > 1) the student's weights, gradients and AdamW state are 1/world per process,
    plus the gathered (unsharded) parameters in use: the root (embeddings, lm_head), kept through the
    KD loss, and two decoder blocks (the one computing and the one prefetched), in the compute dtype
    (FSDP's mixed precision: no separate autocast copies). A sharded teacher is the same; a replicated
    one is whole. With checkpointing the student keeps each block's inputs and one block's activations.

    The peak is at the end of the student's forward pass, when everything below is live at once:
    weights, AdamW state and autocast's bf16 weight copies (`resident_memory`); the student's saved
    activations; the teacher's final hidden states; the KD head's gradient buffers for the hidden
    states and the lm_head; and two [chunk x vocab] logits buffers of the chunk being computed (fp32,
    or bf16 with kd.logits_dtype=compute) (`forward_peak_memory`). (The teacher's own forward runs
    before the student's activations exist, and the student's gradients replace its activations during
    the backward pass, so neither adds to this peak unless it is larger: `optimizer_phase` covers the
    end of the backward pass, `on_policy_memory` the generation of on-policy steps.)

    `extra_teachers`: the other teachers of a mixture (`teachers:`): their weights, their final hidden
    states, and two more [chunk x vocab] fp32 buffers (the mixture's running logaddexp and the
    teacher being added).

    `documents` (default: from the config, `rows_carry_documents`): the rows are packed conversations,
    whose forward keeps a document bias (`document_mask_bytes`); when every step is generated only the
    held-out evals have one (`heldout_eval_memory`, a phase of its own).
    """
    if layout is not None and layout.world > 1 and layout.student_replicated:
        # one process's step at this process's share of the batch, plus the gradients' flat buffer
        alone = dataclasses.replace(layout, world=1, teacher_sharded=False, student_kept=False)
        if not _graphed(cfg, layout.world, True):  # not captured under torchrun: an eager step's terms
            cfg = dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, cuda_graphs="off"))
        terms = estimate_memory(teacher, student, cfg, device, batch, alone, extra_teachers, documents)
        total = terms.pop("total")
        reduce_bytes = 2 if device != "cpu" and cfg.runtime.grad_reduce == "compute" else 4
        terms["gradient_average_buffer"] = trainable_params(student, cfg) * reduce_bytes
        terms["total"] = total + terms["gradient_average_buffer"]
        return terms
    s = StepShape.of(teacher, student, cfg, device, batch, layout, extra_teachers, documents)
    w = s.layout.world
    fixed = resident_memory(s)
    forward_peak = forward_peak_memory(s)
    if cfg.kd.layers_on:
        fixed["layer_projections"], forward_peak["layer_map"] = layer_map_memory(s)
    generation = on_policy_memory(s, fixed, forward_peak) if cfg.kd.generates else 0
    evaluation = 0
    if s.documents and every_step_generated(cfg):
        evaluation = heldout_eval_memory(s)
    elif s.documents:  # the student's bias of a data step, kept from its forward to its backward
        forward_peak["document_mask"] = document_mask_bytes(s.rows, cfg.data.seq_len, s.act_bytes)
    # the gradients, plus the multi-tensor AdamW's temporaries on a CPU; one GPU's fused AdamW has none
    # (the 7B -> 1.5B on-policy row's measured peak is the resident terms plus the gradients, NOTES.md
    # round twenty); under FSDP2 the term keeps its second copy (its layouts were measured with it)
    optimizer_phase = s.trainable * 4 * (1 if s.gpu and w == 1 else 2) // w
    live_forward = sum(forward_peak.values())
    # the training step's own peak: the end of its forward, or its optimizer phase when larger
    step_peak = dict(forward_peak)
    if optimizer_phase > live_forward:
        step_peak = {"gradients_and_optimizer_temporaries": optimizer_phase}
    terms = {**fixed, **forward_peak}
    if optimizer_phase > live_forward and optimizer_phase >= max(generation, evaluation):
        terms = {**fixed, **step_peak}
    elif generation > live_forward and generation >= evaluation:
        terms = {**fixed, "generation_kv_cache_and_logits": generation}
    elif evaluation > live_forward:
        terms = {**fixed, "heldout_eval_with_document_mask": evaluation}
    # the samples' engines: the teacher's before the first step, the student's at each eval (after a
    # step: its activations are free, but not a captured step's pool, which nothing else reuses)
    student_samples, teacher_samples = sample_engine_memory(s)
    graphed = s.gpu and _graphed(cfg, w)
    samples = teacher_samples if graphed else max(student_samples, teacher_samples)
    if samples > sum(v for k, v in terms.items() if k not in fixed):
        terms = {**fixed, "sample_engine": samples}
    if graphed:
        terms["eval_beside_graph_pool"] = max(eval_beside_graph_pool(s), student_samples)
        if cfg.kd.generates:  # the captured update's pool stays through the next writing and scoring
            terms = {**fixed, **step_peak, "eval_beside_graph_pool": terms["eval_beside_graph_pool"]}
            terms["generation_beside_graph_pool"] = generation_beside_graph_pool(s, generation)
    terms["total"] = sum(terms.values())
    return terms


def _teacher_weights(s: StepShape) -> int:
    """Bytes of every teacher's whole weights in the compute dtype (the fp8 teacher's block linears at
    1 byte per weight and 4 per output channel)."""
    pt = sum(t.param_counts()["total"] for t in (s.teacher, *s.extra_teachers))
    out = pt * s.act_bytes
    if s.cfg.teacher.precision == "fp8":
        for t in (s.teacher, *s.extra_teachers):
            linear = t.num_layers * sum(a * b for a, b in t.linear_shapes().values())
            channels = t.num_layers * sum(b for _, b in t.linear_shapes().values())
            out -= linear * (s.act_bytes - 1) - channels * 4
    return out


def resident_memory(s: StepShape) -> dict[str, int]:
    """The terms that stay through the whole step: the teachers' and the student's weights, AdamW's
    state and the compute-dtype copies of the student's weights; under FSDP2 (world > 1) the sharded
    states plus the gathered units in use (see `estimate_memory`)."""
    student, lora, w = s.student, s.cfg.student.lora, s.layout.world
    ps = student.param_counts()["total"]
    student_bytes = ps * s.base_bytes + (s.trainable * 4 if lora.enabled else 0)
    if w > 1:
        if s.cached:
            teacher_bytes = 0
        elif s.layout.teacher_sharded:
            pt = sum(t.param_counts()["total"] for t in (s.teacher, *s.extra_teachers))
            teacher_bytes = _gathered(s.teacher, s.act_bytes) + pt * s.act_bytes // w
        else:
            teacher_bytes = _teacher_weights(s)
        return {
            "teacher_weights": teacher_bytes,
            "student_weights": student_bytes // w,
            "optimizer_state": s.trainable * 8 // w,
            # a LoRA student is gathered as stored (its base in lora.base_dtype, the adapters fp32)
            "student_gathered_units": _gathered(
                student, s.base_bytes if lora.enabled else s.act_bytes, s.layout.student_kept, _unit_blocks(s)
            )
            + (_gathered_adapters(student, lora, s.layout.student_kept) if lora.enabled else 0),
            # the gradients of one unit as the reduce-scatter takes them (in fp32 or the compute dtype)
            "student_reduce_unit": _reduce_unit(s),
        }
    fixed = {
        "teacher_weights": 0 if s.cached else _teacher_weights(s),
        "student_weights": student_bytes,
        "optimizer_state": s.trainable * 8,
        "autocast_weight_copies": s.trainable * 2 if s.gpu else 0,
    }
    if s.cfg.runtime.precision == "fp8" and s.gpu:
        # The block linears are quantised from the fp32 masters at each call, never cast by autocast:
        # no bf16 copies of them. The stacked q/k/v and gate/up weights keep their fp8 W^T for backward
        # (1 byte per weight, every layer); one GEMM's operands exist at a time on top: the fp32
        # concatenation being quantised and its fp8 copy.
        block_linears = student.num_layers * sum(a * b for a, b in student.linear_shapes().values())
        fixed["autocast_weight_copies"] -= block_linears * 2
        h, i = student.hidden_size, student.intermediate_size
        stacked = (student.q_size + 2 * student.kv_size) * h + 2 * i * h  # per layer
        widest = max((student.q_size + 2 * student.kv_size) * h, 2 * i * h, student.q_size * h)
        fixed["fp8_weight_copies"] = student.num_layers * stacked + widest * (4 + 1)
    return fixed


def saved_per_token_layer(s: StepShape) -> float:
    """Bytes the student keeps for backward per token and decoder layer (see ACT_COEF_GPU): a LoRA
    student's frozen base keeps no GEMM input for a weight gradient, its adapters keep their own."""
    student, lora = s.student, s.cfg.student.lora
    fp8_student = s.cfg.runtime.precision == "fp8"
    coef = (ACT_COEF_GPU_FP8 if fp8_student else ACT_COEF_GPU) if s.gpu else ACT_COEF_CPU
    per_tok_layer = (
        coef["hidden"] * student.hidden_size
        + coef["inter"] * student.intermediate_size
        + coef["q"] * student.q_size
        + coef["kv"] * student.kv_size
    )
    if lora.enabled and s.gpu:
        # A frozen base keeps no GEMM input for a weight gradient: the normed-input copies (6H of
        # coef["hidden"]) go. An adapter keeps its own input: with dropout, its dropout output and mask
        # (lora_activations below); without, the norm's output itself, once for the targets that share it
        # (q/k/v read one normed input, gate/up another; o_proj's input is SDPA's output, kept anyway).
        per_tok_layer -= 6 * student.hidden_size
        if lora.dropout == 0:
            groups = [("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")]
            shared = sum(any(t in lora.targets for t in g) for g in groups)
            per_tok_layer += shared * student.hidden_size * 2
            if "down_proj" in lora.targets:  # its input, the SwiGLU output, kept for the adapter
                per_tok_layer += student.intermediate_size * 2
    return per_tok_layer


def student_activations(s: StepShape) -> int:
    """The student's saved activations at the end of its forward: every layer's (`saved_per_token_layer`),
    or with checkpointing every block's inputs and one block's activations being recomputed."""
    student, n = s.student, s.n
    per_tok_layer = saved_per_token_layer(s)
    if s.layout.checkpointing:
        inputs = CKPT_INPUT_COEF["gpu" if s.gpu else "cpu"] * student.hidden_size
        activations = n * student.num_layers * inputs + n * per_tok_layer
    else:
        activations = n * student.num_layers * per_tok_layer
        if s.layout.swiglu_kept and swiglu_recomputed(s.cfg) and not s.cfg.student.lora.enabled:
            # the SwiGLU output kept for down_proj's weight gradient (a frozen down_proj has none)
            activations += n * student.num_layers * student.intermediate_size * s.act_bytes
    return int(activations) + n * student.hidden_size * 4


def forward_peak_memory(s: StepShape) -> dict[str, int]:
    """The terms live at the end of the student's forward besides the resident ones (see
    `estimate_memory`)."""
    student, teacher, n, lora = s.student, s.teacher, s.n, s.cfg.student.lora
    vocab = student.vocab_size
    head_grad = 0 if lora.enabled else vocab * student.hidden_size * 4  # a frozen lm_head has none
    forward_peak = {
        "student_activations": student_activations(s),
        # teacher.cache: the batch's cached targets instead (bf16 log-probs of an exact cache, the
        # largest mode) and no teacher at all
        "teacher_hidden": n * vocab * 2 if s.cached else n * teacher.hidden_size * s.act_bytes,
        "loss_gradients": n * student.hidden_size * 4 + head_grad,
        # fp32 logits, or the compute dtype's with kd.logits_dtype=compute on a GPU (a mixture's own
        # running buffers stay fp32)
        "loss_chunk_logits": (
            2 * s.chunk * vocab * (s.act_bytes if s.cfg.kd.logits_dtype == "compute" else 4)
        )
        + (2 * s.chunk * vocab * 4 if s.extra_teachers else 0),
    }
    if s.extra_teachers:
        forward_peak["teacher_hidden"] += sum(n * t.hidden_size * s.act_bytes for t in s.extra_teachers)
    if s.cfg.kd.cross_tokenizer:
        # The teacher's hidden states count its own tokenization at data.seq_len tokens a row: packed
        # conversations are packed by the longer of their two tokenizations (kdistill.data.cross_chat).
        # Its rows at the aligned positions are copied to fp32 for the ULD term, which (train/cross_tok.py)
        # per chunk of aligned rows holds both models' fp32 logits, softmax and sorted copies (values
        # and int64 indices) over their own vocabularies, both padded to the larger and their |p - q|;
        # the student's CE head (two chunk x Vs buffers) runs before it, not beside it. The exact term
        # (kd.exact_weight) adds both models' log-softmax over the same logits and its gathers of them.
        vt = teacher.vocab_size
        uld = s.chunk * ((vocab + vt) * (3 * 4 + 8) + max(vocab, vt) * 3 * 4)
        if s.cfg.kd.exact_weight > 0:
            uld += s.chunk * (vocab + vt) * 4 * 2
        forward_peak["loss_chunk_logits"] = max(forward_peak["loss_chunk_logits"], uld)
        forward_peak["teacher_aligned_rows"] = n * teacher.hidden_size * 4
    if lora.enabled:  # per adapter: x A^T saved for B's gradient, and dropout's output and mask
        shapes = student.linear_shapes()
        per_tok = sum(
            lora.rank * s.act_bytes + (shapes[t][0] * (s.act_bytes + 1) if lora.dropout > 0 else 0)
            for t in lora.targets
        )
        forward_peak["lora_activations"] = n * student.num_layers * per_tok
    return forward_peak


def layer_map_memory(s: StepShape) -> tuple[int, int]:
    """kd.layer_map: (the projections' bytes, fp32 and trained: weights, AdamW moments, gradients; the
    forward's collected layer outputs and, with kd.attention_weight, attention maps)."""
    student, teacher, kd = s.student, s.teacher, s.cfg.kd
    pairs = len(kd.layer_map)
    proj = projection_params(teacher, student, s.cfg)
    states = s.n * pairs * (student.hidden_size + teacher.hidden_size) * 4  # fp32 copies compared
    # (B, H, T, T) fp32 scores, log-probs and the head-averaged map, student (kept for backward) and teacher
    maps = s.rows * s.cfg.data.seq_len**2 * (student.num_heads + teacher.num_heads) * 4 * 3 * pairs
    return proj * (4 + 8 + 4), states + (maps if kd.attention_weight > 0 else 0)


def on_policy_memory(s: StepShape, fixed: dict[str, int], forward_peak: dict[str, int]) -> int:
    """kd.on_policy / kd.seq_kd: the terms generation adds to `fixed` (on a GPU the decode engines'
    weights and static KV caches, kept across steps; under torchrun on the CPU the gathered writers) and
    to `forward_peak` (the scored targets kept until the update), and the bytes of the generation phase
    before the update (returned; reported as `generation_kv_cache_and_logits`: on a GPU the engine's
    prefill and sampler transients beside its kept cache, on the CPU the eager path's cache and logits).
    The generation phase never has a document bias: generated rows are plain causal."""
    student, teacher, kd, w, act_bytes = s.student, s.teacher, s.cfg.kd, s.layout.world, s.act_bytes
    # every micro-batch's teacher hidden states are scored before the update and kept until it
    forward_peak["scored_targets"] = (s.cfg.schedule.grad_accum - 1) * s.n * teacher.hidden_size * act_bytes
    # the teacher writes the seq_kd completions; under torchrun a sharded one is gathered whole to write
    teacher_gathered = kd.seq_kd > 0 and w > 1 and s.layout.teacher_sharded
    if act_bytes == 2:  # on a GPU the decode engines keep bf16 copies of the writers' weights
        fixed["decode_engine_weights"] = engine_weights(student, full=True)
        if kd.seq_kd > 0:
            fixed["decode_engine_weights"] += engine_weights(teacher, full=teacher_gathered)
    elif w > 1:  # on a CPU a gathered whole copy of each sharded writer is kept (its engine shares it)
        ps = student.param_counts()["total"]
        fixed["gathered_writers"] = (ps + (teacher.param_counts()["total"] if teacher_gathered else 0)) * 4
    rows = s.rows * s.cfg.schedule.grad_accum  # every micro-batch's rows are written in one generation
    writers = [student, teacher] if kd.seq_kd > 0 else [student]
    slots_per_row = s.cfg.data.seq_len + 1  # the engine's cache slots per row
    if act_bytes == 2:
        # the decode engines keep their static KV caches across steps (one engine per writer), at
        # kd.rollout_batch rows (a stopped row's slot takes the next prompt); writing adds the prefill's
        # transients and the sampler's buffers
        slots = kd.rollout_slots(rows)
        fixed["decode_engine_kv_cache"] = sum(
            kv_cache_bytes(m, slots, slots_per_row, act_bytes) for m in writers
        )
        prompt = s.cfg.data.seq_len + 1 - kd.max_new_tokens
        generation = max(engine_write_memory(m, slots, prompt) for m in writers)
        if slots * prompt <= PREFILL_GRAPH_TOKENS:  # each engine keeps its captured prefill's pool
            fixed["decode_engine_prefill_graphs"] = sum(
                engine_prefill_bytes(m, slots * prompt) for m in writers
            )
    else:  # the eager path's KV cache of every row, freed after the rollout
        generation = generation_memory(writers, rows, slots_per_row, act_bytes)
    if act_bytes == 2 and w > 1:
        # refreshing the engine of a sharded writer gathers one parameter at a time in its stored dtype
        # (the student's fp32 masters, a bf16 teacher) beside the engine's kept KV cache: at most an
        # embedding at once
        embed = student.vocab_size * student.hidden_size * 4
        if teacher_gathered:
            embed = max(embed, teacher.vocab_size * teacher.hidden_size * act_bytes)
        generation += embed
    return generation


def eval_beside_graph_pool(s: StepShape) -> int:
    """runtime.cuda_graphs: the captured step's memory is the graph's private pool, which nothing else
    can reuse; the held-out eval between steps allocates beside it: the final hidden states of both
    models, one block's transient activations and two [chunk x vocab] fp32 logits buffers."""
    student, teacher, n = s.student, s.teacher, s.n
    inter = max(student.intermediate_size, teacher.intermediate_size)
    return (
        n * (student.hidden_size + teacher.hidden_size) * s.act_bytes
        + n * 3 * inter * s.act_bytes
        + 2 * s.chunk * student.vocab_size * 4
        + (document_mask_bytes(s.rows, s.cfg.data.seq_len, s.act_bytes) if s.documents else 0)
    )


def generation_beside_graph_pool(s: StepShape, generation: int) -> int:
    """runtime.cuda_graphs with generated steps: writing (`generation`, the engine's transients) and the
    teacher's scoring run beside the captured update's pool, and the captured step keeps its own copy of
    every micro-batch's scored hidden states. The scoring forward is captured too (its own graph,
    kdistill.train.graph.ScoringGraphs), whose pool stays allocated: one block's transient activations
    of the teacher and its static rows and hidden states. Scoring holds every micro-batch's hidden
    states (copied out of that pool)."""
    teacher, n, m = s.teacher, s.n, s.cfg.schedule.grad_accum
    targets = m * n * teacher.hidden_size * s.act_bytes
    pool = n * (3 * teacher.hidden_size + 3 * teacher.intermediate_size) * s.act_bytes
    return pool + max(generation, targets) + targets


def heldout_eval_memory(s: StepShape) -> int:
    """A held-out eval of packed conversations when every training step is generated (no data step has
    a document bias): the forward's document bias beside the final hidden states of both models, one
    block's transient activations and two [chunk x vocab] fp32 logits buffers (`eval_beside_graph_pool`)."""
    return eval_beside_graph_pool(s)


def sample_engine_memory(s: StepShape) -> tuple[int, int]:
    """schedule.sample_prompts on a GPU (one process): the decode engines that write a run's samples
    (kdistill.samples), each built and dropped: (the student's, at each eval; the teacher's, once before
    the first step). Each is its bf16 weights (all of an fp32 student's; of a bf16 teacher only the
    stacked q/k/v and gate/up, the rest shared; all of an FP8 teacher's, dequantised), the KV cache of
    sample_prompts rows over seq_len + 1 + sample_tokens slots, and the sampler's logits."""
    sched, cfg = s.cfg.schedule, s.cfg
    if not s.gpu or not sched.sample_prompts or s.layout.world > 1:
        return 0, 0
    slots = cfg.data.seq_len + 1 + sched.sample_tokens

    def engine(spec: ModelSpec, full: bool) -> int:
        return engine_weights(spec, full) + generation_memory([spec], sched.sample_prompts, slots, 2)

    teacher = 0
    if not s.cached and not cfg.kd.cross_tokenizer:
        teacher = engine(s.teacher, cfg.teacher.precision == "fp8")
    return engine(s.student, True), teacher


def _graphed(cfg: RunConfig, world: int, replicated: bool = False) -> bool:
    """Whether a CUDA run of this config captures its training step (kdistill.train.graph)."""
    return cfg.runtime.cuda_graphs != "off" and capture_blocker(cfg, "cuda", world, replicated) is None


def capture_blocker(cfg: RunConfig, device_type: str, world: int, replicated: bool = False) -> str | None:
    """Why a run's training step cannot be captured as a CUDA graph (None: it can): the planner and
    the step (kdistill.train.graph) decide alike. replicated: under torchrun, the layout keeps a whole
    student and a whole teacher on every process (Layout.student_replicated)."""
    if device_type != "cuda":
        return "the run is not on a CUDA device"
    if world > 1 and not replicated:
        return "the run is under torchrun with a sharded student (FSDP2's collectives are not captured)"
    if world > 1 and not (cfg.kd.generates and every_step_generated(cfg)):
        return "the run is under torchrun and not every step is generated (data steps are not captured there)"
    if cfg.teacher.cache:
        return "the teacher is a cache (teacher.cache)"
    if cfg.kd.cross_tokenizer:
        return "the teacher has another tokenizer (kd.cross_tokenizer)"
    if cfg.kd.layers_on:
        return "a layer map adds terms (kd.layer_map)"
    if cfg.kd.generates:  # generated steps: their update is captured (the teacher scores eagerly)
        if not every_step_generated(cfg):
            return "steps alternate between generated and data rows (kd.on_policy and kd.seq_kd below 1)"
        if cfg.kd.on_policy > 0 and cfg.kd.on_policy_loss != "divergence":
            return f"kd.on_policy_loss is {cfg.kd.on_policy_loss} (captured: divergence only)"
        if len(cfg.teachers) > 1:
            return "several teachers (teachers:) score the generated rows"
    return None


def engine_weights(spec: ModelSpec, full: bool) -> int:
    """bf16 bytes of a decode engine's weights (kdistill.decode.DecodeWeights): all of them for an fp32
    student or a sharded model gathered (full), else the stacked q/k/v and gate/up copies (the rest is
    shared with a bf16 model)."""
    if full:
        return spec.param_counts()["total"] * 2
    h = spec.hidden_size
    return spec.num_layers * h * (spec.q_size + 2 * spec.kv_size + 2 * spec.intermediate_size) * 2


def kv_cache_bytes(spec: ModelSpec, rows: int, max_len: int, act_bytes: int) -> int:
    """Keys and values of every layer for `rows` rows of `max_len` slots (kdistill.decode._Slots)."""
    return 2 * spec.num_layers * rows * spec.kv_size * max_len * act_bytes


PREFILL_TOKENS = 16384  # padded prompt tokens a decode engine prefills at once (DecodeEngine's default)
# padded prompt tokens of a prefill the decode engine captures as a graph on a GPU (its pool stays
# allocated beside the engine's cache; kdistill.decode): every group the engine prefills at once (an
# eager prefill of 16 prompts of 128 tokens: ~19 ms of host work for ~3.4 ms on the device, Qwen2.5-0.5B
# on an H200, NOTES.md round fourteen; of 32 and 128 prompts, NOTES.md round twenty-five)
PREFILL_GRAPH_TOKENS = PREFILL_TOKENS


def engine_prefill_bytes(spec: ModelSpec, tokens: int) -> int:
    """A prefill of `tokens` padded tokens (bf16): its hidden states and one block's activations (q/k/v,
    attention output, gate/up and the SwiGLU output)."""
    h, i = spec.hidden_size, spec.intermediate_size
    return tokens * (3 * h + 2 * spec.q_size + 2 * spec.kv_size + 3 * i) * 2


def engine_write_memory(spec: ModelSpec, slots: int, prompt_len: int) -> int:
    """The decode engine's transient bytes while writing (bf16), beside its kept KV cache: the prefill of
    a group of prompts (at most PREFILL_TOKENS padded tokens, or one prompt); then per step the
    lm_head's (slots, vocab) logits and the sampler's fp32 copies of them."""
    tokens = max(min(slots * prompt_len, PREFILL_TOKENS), prompt_len)
    return engine_prefill_bytes(spec, tokens) + slots * spec.vocab_size * (2 + 3 * 4)


def generation_memory(writers: list[ModelSpec], rows: int, max_len: int, act_bytes: int) -> int:
    """Bytes of one step's generation on the eager path (kdistill.train.rollouts, CPU), the largest over
    the models that write:
    the KV cache of every row at max_len positions (keys and values of every layer) and a few (rows,
    vocab) fp32 buffers of the next-token logits and probabilities."""
    out = 0
    for spec in writers:
        out = max(out, kv_cache_bytes(spec, rows, max_len, act_bytes) + 3 * rows * spec.vocab_size * 4)
    return out


STUDENT_UNITS = 4  # FSDP2 units of decoder blocks a student kept gathered is sharded in (at most)


def student_unit_blocks(num_layers: int, kept: bool, lora: bool = False, configured: int = 0) -> int:
    """Decoder blocks per FSDP2 unit of a sharded student: `configured` (runtime.student_unit_blocks)
    when set, else one, or for a full-weight (not LoRA) student kept gathered from forward to backward
    (Layout.student_kept) num_layers / STUDENT_UNITS rounded up. A kept student's units are gathered once a step whatever
    their size, so fewer of them cost no memory and make fewer collectives a step, each a point where
    every process waits for the slowest (on-policy, 1.5B -> 0.5B, 2 x H200: 6 blocks a unit took the
    update 0.130 -> 0.091 s, benchmarks/NOTES.md round fourteen)."""
    if configured > 0:
        return min(int(configured), max(1, num_layers))
    return max(1, -(-num_layers // STUDENT_UNITS)) if kept and not lora else 1


def _unit_blocks(s: StepShape) -> int:
    """student_unit_blocks of a step's student."""
    return student_unit_blocks(
        s.student.num_layers,
        s.layout.student_kept,
        s.cfg.student.lora.enabled,
        s.cfg.runtime.student_unit_blocks,
    )


def _reduce_unit(s: StepShape) -> int:
    """Bytes of one FSDP2 unit's gradients as its reduce-scatter takes them: the unit's blocks
    (student_unit_blocks) of trainable weights (a LoRA student's adapters only), in fp32 or, with
    runtime.grad_reduce=compute, the compute dtype."""
    student, lora = s.student, s.cfg.student.lora
    per_layer = (
        s.trainable // max(1, student.num_layers) if lora.enabled else student.param_counts()["per_layer"]
    )
    return _unit_blocks(s) * per_layer * (s.act_bytes if s.cfg.runtime.grad_reduce == "compute" else 4)


def _gathered(spec: ModelSpec, nbytes: int, every_block: bool = False, unit: int = 1) -> int:
    """Bytes of a sharded model's parameters gathered at once: the root and two units of `unit` decoder
    blocks (the one computing and the one prefetched), or every block when they stay gathered until
    backward."""
    c = spec.param_counts()
    blocks = spec.num_layers if every_block else min(spec.num_layers, 2 * unit)
    return (c["embedding"] + c["lm_head"] + spec.hidden_size + blocks * c["per_layer"]) * nbytes


def _gathered_adapters(spec: ModelSpec, lora, every_block: bool = False) -> int:
    """Bytes of a LoRA student's fp32 adapters in the gathered decoder blocks (see `_gathered`)."""
    per_layer = spec.lora_params(lora.rank, lora.targets) // max(1, spec.num_layers)
    return (spec.num_layers if every_block else 2) * per_layer * 4


def swiglu_recomputed(cfg: RunConfig) -> bool:
    """Whether the student's MLP recomputes its SwiGLU output in backward unless told to keep it
    (decoder.MLP: the fused gate/up GEMM and a plain down_proj, `dispatch.swiglu_down`). An FP8 student
    keeps an fp8 copy of it (its down_proj's saved input) and adapters on gate, up or down keep it."""
    lora = cfg.student.lora
    wrapped = lora.enabled and any(t in ("gate_proj", "up_proj", "down_proj") for t in lora.targets)
    return cfg.runtime.precision != "fp8" and not wrapped


def choose_layout(
    teacher: ModelSpec,
    student: ModelSpec,
    cfg: RunConfig,
    budget: int,
    world: int = 1,
    batch: int | None = None,
    device: str = "cuda",
) -> Layout:
    """The layout runtime.teacher_placement, runtime.activation_checkpointing and
    runtime.student_reshard ask for, their `auto` resolved against `budget` bytes per device: the first
    that fits of (teacher replicated, no checkpointing), (sharded, none), (replicated, blocks),
    (sharded, blocks), each first with the student's blocks kept gathered from forward to backward
    (under torchrun), keeping only what the config allows; when none fits, the most frugal allowed (the
    caller refuses or fits the batch). One process never shards its teacher."""
    rt = cfg.runtime
    placements = [False, True] if world > 1 else [False]
    if world > 1 and rt.teacher_placement != "auto":
        placements = [rt.teacher_placement == "shard"]
    # (checkpointing, SwiGLU output kept), fastest first; keeping the SwiGLU output is the first thing
    # given up, before the teacher's placement and the student's gathering
    allowed = {
        "none": [(False, True)],
        "swiglu": [(False, False)],
        "blocks": [(True, False)],
        "auto": [(False, True), (False, False), (True, False)],
    }[rt.activation_checkpointing]
    kept = {"auto": [True, False], "after_backward": [True], "after_forward": [False]}[rt.student_reshard]
    if world == 1:
        kept = [False]
    candidates = [
        Layout(world, sharded, ck, keep, sk)
        for ck in sorted({ck for ck, _ in allowed})
        for sharded in placements
        for keep in kept
        for sk in (True, False)
        if (ck, sk) in allowed
    ]
    # a whole student on every process (runtime.student_placement): auto tries it first, without
    # checkpointing, for a student that writes completions, beside a whole teacher
    replicated = [
        Layout(world, False, ck, False, sk, student_replicated=True)
        for ck in sorted({ck for ck, _ in allowed})
        for sk in (True, False)
        if (ck, sk) in allowed
    ]
    if world > 1 and rt.student_placement == "replicate":
        candidates = replicated
    elif world > 1 and rt.student_placement == "auto" and replicate_first(cfg):
        candidates = [c for c in replicated if not c.checkpointing] + candidates
    for layout in candidates:
        if estimate_memory(teacher, student, cfg, device, batch, layout)["total"] <= budget:
            return layout
    return candidates[-1]


def replicate_first(cfg: RunConfig) -> bool:
    """Whether runtime.student_placement=auto tries a whole student on every process first: a student
    that writes completions (kd.on_policy, kd.seq_kd), beside a teacher that may be whole too. Such runs
    keep a whole copy of the student for writing anyway, and under FSDP2 their update cannot be captured
    (NOTES.md round twenty-one); off-policy runs keep FSDP2 (measured 2.03x on 2 GPUs, 3.96x on 4)."""
    return cfg.kd.generates and cfg.runtime.teacher_placement != "shard" and not cfg.teacher.cache


def gpus_needed(
    teacher: ModelSpec, student: ModelSpec, cfg: RunConfig, gpu_bytes: int, max_world: int = 64
) -> tuple[int, Layout] | None:
    """The fewest processes (1, 2, 4, ...) whose per-process plan fits 95% of `gpu_bytes`, each
    process running schedule.batch_size / world sequences, with the layout it would use; None when
    even max_world (or one sequence per process) does not fit."""
    budget = int(gpu_bytes * 0.95)
    world = 1
    while world <= max_world and cfg.schedule.batch_size // world >= 1:
        per = cfg.schedule.batch_size // world
        if cfg.schedule.batch_size % world == 0:
            layout = choose_layout(teacher, student, cfg, budget, world, per)
            if estimate_memory(teacher, student, cfg, batch=per, layout=layout)["total"] <= budget:
                return world, layout
        world *= 2
    return None


def fit_limits(
    teacher: ModelSpec,
    student: ModelSpec,
    cfg: RunConfig,
    budget: int,
    batch: int | None = None,
    layout: Layout | None = None,
    extra_teachers: tuple[ModelSpec, ...] | list[ModelSpec] = (),
) -> dict[str, int]:
    """Largest batch (at the configured seq_len) and seq_len (at the configured batch) that fit in
    `budget` bytes on one device. `batch` is the device's batch as in `estimate_memory` (default
    cfg.schedule.batch_size); the batch returned is per device too."""
    rows = cfg.schedule.batch_size if batch is None else batch

    def peak(bs: int, sl: int) -> int:
        c = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, seq_len=sl))
        return estimate_memory(teacher, student, c, batch=bs, layout=layout, extra_teachers=extra_teachers)[
            "total"
        ]

    best_bs = 0
    for bs in range(1, rows + 1):
        if peak(bs, cfg.data.seq_len) <= budget:
            best_bs = bs
    best_sl, sl = 0, 64
    while sl <= cfg.data.seq_len:
        if peak(rows, sl) <= budget:
            best_sl = sl
        sl *= 2
    return {"batch_size": best_bs, "seq_len": best_sl}


def fit_rollout_batch(
    teacher: ModelSpec,
    student: ModelSpec,
    cfg: RunConfig,
    budget: int,
    batch: int | None = None,
    layout: Layout | None = None,
    extra_teachers: tuple[ModelSpec, ...] | list[ModelSpec] = (),
) -> int | None:
    """The largest kd.rollout_batch (a power of two below the rows the engine writes now) whose plan fits
    `budget` bytes on one GPU, or None (no generation, or none fits: the KV cache is not what is over).
    The step's rows stay the same: fewer are written at once, a stopped row's slot taking the next."""
    if not cfg.kd.generates:
        return None
    rows = (cfg.schedule.batch_size if batch is None else batch) * cfg.schedule.grad_accum
    slots = 1 << (cfg.kd.rollout_slots(rows) - 1).bit_length()  # the next power of two >= the slots now
    while slots > 1:
        slots //= 2
        c = dataclasses.replace(cfg, kd=dataclasses.replace(cfg.kd, rollout_batch=slots))
        if (
            estimate_memory(teacher, student, c, batch=batch, layout=layout, extra_teachers=extra_teachers)[
                "total"
            ]
            <= budget
        ):
            return slots
    return None
