"""RunConfig: the run's options as small dataclasses that validate themselves.

A run config is YAML with these sections (every field has a default except the model paths):

    teacher:  {path: DIR, cache: DIR (a teacher cache: the teacher is not loaded), precision: auto|fp8}
    teachers: [{path: DIR, weight: W}, ...]  (instead of teacher.path: a mixture of several teachers)
    student:  {path: DIR | config.json | preset, init: auto|pretrained|random|teacher_layers,
               lora: {rank, alpha, dropout, targets, base_dtype}}
    data:     {train: [PATH, ...], heldout: [PATH, ...], heldout_fraction, seq_len, max_tokens}
    kd:       {alpha, temperature, divergence, beta, chunk_size, logits_dtype, ignore_index, layer_map,
               hidden_weight, hidden_loss, attention_weight, cross_tokenizer, uld_weight, exact_weight, on_policy,
               seq_kd, on_policy_loss,
               sample_temperature, max_new_tokens, samples_per_prompt, rollout_batch}
    optim:    {lr, min_lr_ratio, warmup_steps, weight_decay, beta1, beta2, eps, grad_clip}
    schedule: {steps, batch_size, grad_accum, eval_every, eval_batches, checkpoint_every, log_every, seed}
    output:   {dir, keep_checkpoints, report_to: [tensorboard, wandb, mlflow], check_disk}
    runtime:  {device, dtype, precision: auto|fp8, kernels, strict_kernels, arch, kernel_pack, on_nonfinite,
               max_nonfinite, auto_fit, gpu_memory_gib, teacher_placement, student_placement,
               activation_checkpointing,
               student_reshard, student_unit_blocks, grad_reduce, profile_steps, profile_shapes,
               cuda_graphs}
              (runtime.precision=fp8: the student's block linears train through row-wise scaled FP8
              GEMMs over fp32 master weights; compute capability 8.9 or newer, emulated on the CPU)

Command-line overrides are dotted: `kd.temperature=2 output.dir=runs/a`. Unknown keys are one-line
errors that name the key and the closest valid one.
"""

from __future__ import annotations

import dataclasses
import datetime
import difflib
import math
import os
import types
import typing
from pathlib import Path
from typing import Any

from kdistill.dtypes import LONG_NAMES
from kdistill.errors import UserError
from kdistill.jsonio import check_seed, cut, parse_yaml, plain_value, read_yaml, short_repr
from kdistill.rundir import check_path_value

DIVERGENCES = ("forward_kl", "reverse_kl", "jsd", "tvd", "skew_kl", "skew_reverse_kl")
# kd.attention_weight builds (batch, heads, seq_len, seq_len) attention maps: refused above this length
ATTENTION_MAX_SEQ_LEN = 1024
TRACKERS = ("tensorboard", "wandb", "mlflow")  # output.report_to (kdistill.train.trackers opens them)
ON_POLICY_LOSSES = ("divergence", "sampled_reverse_kl")  # kd.on_policy_loss
LOGITS_DTYPES = ("float32", "compute")  # kd.logits_dtype


@dataclasses.dataclass
class TeacherConfig:
    path: str = ""
    # A teacher cache (kdistill teacher-cache --out DIR): train on its targets, the teacher never loaded
    cache: str = ""
    # auto: the teacher's linears in the compute dtype; fp8: row-wise scaled FP8 GEMMs (kdistill.models.fp8),
    # on GPUs of compute capability 8.9 or newer (the CPU runs the dequantised reference)
    precision: str = "auto"

    def validate(self) -> None:
        _choice("teacher.precision", self.precision, ("auto", "fp8"))


@dataclasses.dataclass
class TeacherEntry:
    """One of several teachers (`teachers:`): its model directory and its weight in the mixture."""

    path: str = ""
    weight: float = 1.0


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass
class LoraConfig:
    """LoRA adapters on a frozen student: rank 0 (the default) trains the whole student instead."""

    rank: int = 0
    alpha: float = 16.0  # the update is scaled by alpha / rank
    dropout: float = 0.0
    targets: list[str] = dataclasses.field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    base_dtype: str = "float32"  # the frozen base's weights: float32 | bfloat16 (adapters stay fp32)

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    def validate(self) -> None:
        if self.rank < 0:
            raise UserError(f"student.lora.rank is {self.rank}, expected 0 (off) or a positive integer")
        _positive("student.lora.alpha", self.alpha)
        if not 0 <= self.dropout < 1:
            raise UserError(f"student.lora.dropout is {self.dropout}, expected a number in [0, 1)")
        if not self.targets:
            raise UserError(f"student.lora.targets is empty, expected some of: {', '.join(LORA_TARGETS)}")
        for t in self.targets:
            if t not in LORA_TARGETS:
                raise UserError(
                    f"student.lora.targets has {short_repr(t)}, expected some of: {', '.join(LORA_TARGETS)}"
                )
        if len(set(self.targets)) != len(self.targets):
            raise UserError(f"student.lora.targets lists a name twice: {', '.join(self.targets)}")
        _choice("student.lora.base_dtype", self.base_dtype, ("float32", "bfloat16"))


@dataclasses.dataclass
class StudentConfig:
    path: str = ""
    init: str = "auto"  # auto: pretrained if path holds weights, else random
    lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)

    def validate(self) -> None:
        _choice("student.init", self.init, ("auto", "pretrained", "random", "teacher_layers"))
        self.lora.validate()
        if self.lora.enabled and self.init not in ("auto", "pretrained"):
            raise UserError(
                f"student.init is '{self.init}' with student.lora: LoRA trains adapters on a pretrained "
                "student (student.init auto or pretrained, and weights in student.path)"
            )


@dataclasses.dataclass
class DataConfig:
    train: list[str] = dataclasses.field(default_factory=list)
    heldout: list[str] = dataclasses.field(default_factory=list)
    heldout_fraction: float = 0.05
    seq_len: int = 512
    max_tokens: int = 0  # 0: no cap on tokenized training tokens
    cache_dir: str = ""  # default: ~/.cache/kdistill/data
    # Conversation files (JSONL/Parquet with `messages` or `prompt` + `completion`):
    train_on: str = "assistant"  # assistant: every answer; last_assistant: the last answer; all: every token
    chat_template: str = ""  # a .jinja file (or model directory) to render with; default: the teacher's
    # Template variables (e.g. {enable_thinking: false}); a `tools` list here is the tools of records
    # without their own.
    template_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)

    def validate(self) -> None:
        _positive("data.seq_len", self.seq_len)
        _choice("data.train_on", self.train_on, ("assistant", "last_assistant", "all"))
        if not isinstance(self.template_kwargs, dict):
            raise UserError(
                f"data.template_kwargs is {short_repr(self.template_kwargs)}, expected a mapping of template "
                "variables (e.g. {enable_thinking: false})"
            )
        for key in self.template_kwargs:
            if (
                not isinstance(key, str)
                or not key.isidentifier()
                or key in ("messages", "add_generation_prompt")
            ):
                raise UserError(
                    f"data.template_kwargs has key {short_repr(key)}, expected template variable names "
                    "(not messages or add_generation_prompt)"
                )
        tools = self.template_kwargs.get("tools")
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise UserError("data.template_kwargs.tools is not a list of tool definitions (objects)")
        if not 0 <= self.heldout_fraction < 1:
            raise UserError(f"data.heldout_fraction is {self.heldout_fraction}, expected a number in [0, 1)")
        if self.max_tokens < 0:
            raise UserError(
                f"data.max_tokens is {self.max_tokens}, expected 0 (no cap) or a positive integer"
            )


@dataclasses.dataclass
class KDConfig:
    alpha: float = 0.5
    temperature: float = 2.0
    divergence: str = "forward_kl"
    beta: float = 0.5  # JSD mixing / skew weight
    chunk_size: int = 1024  # tokens per lm_head chunk in the loss
    # The dtype the KD head's lm_head GEMMs write the training logits in: float32 (rounded once, from the
    # fp32 accumulator) | compute (the GEMM operands' dtype: bf16 on a GPU, as Liger-Kernel and
    # transformers write them; 40% fewer bytes through the head; the loss is still computed in fp32)
    logits_dtype: str = "float32"
    ignore_index: int = -100
    # Intermediate layers: [[teacher_layer, student_layer], ...] (0-based, the output of that block);
    # hidden_weight * hidden_loss(student -> projection, teacher) is added to the loss.
    layer_map: list[list[int]] = dataclasses.field(default_factory=list)
    hidden_weight: float = 1.0
    hidden_loss: str = "mse"  # mse | cosine
    attention_weight: float = 0.0  # attention-map transfer on the mapped layers (0: off)
    # Teacher and student with different tokenizers: ULD loss over character-aligned positions
    cross_tokenizer: bool = False
    uld_weight: float = 1.0  # kd.cross_tokenizer: the ULD term's weight in the KD term
    exact_weight: float = 1.0  # kd.cross_tokenizer: the exact term's (positions whose text maps one to one)
    # On-policy distillation (kdistill.train.onpolicy): the fraction of optimizer steps whose completions
    # the current student writes for the data's prompts (GKD's lambda); the rest train on the data.
    on_policy: float = 0.0
    seq_kd: float = 0.0  # the fraction of the other steps trained on teacher-written completions
    on_policy_loss: str = "divergence"  # divergence (kd.divergence, full vocabulary) | sampled_reverse_kl
    sample_temperature: float = 0.0  # sampling temperature; 0: kd.temperature (one for both)
    max_new_tokens: int = 128  # tokens a completion may have (it stops earlier at EOS)
    samples_per_prompt: int = 1  # completions per prompt (batch_size rows = prompts x samples)
    # Rows the decode engine writes at once in a generated step (0: every row of the step); a row that
    # stops frees its slot for the step's next prompt. The generation phase's memory scales with it.
    rollout_batch: int = 0

    def validate(self) -> None:
        if not 0 <= self.alpha <= 1:
            raise UserError(f"kd.alpha is {self.alpha}, expected a number in [0, 1]")
        for name in ("uld_weight", "exact_weight"):
            if not 0 <= getattr(self, name) < float("inf"):
                raise UserError(f"kd.{name} is {getattr(self, name)}, expected a finite number >= 0")
        for name in ("on_policy", "seq_kd"):
            if not 0 <= getattr(self, name) <= 1:
                raise UserError(f"kd.{name} is {getattr(self, name)}, expected a number in [0, 1]")
        _choice("kd.on_policy_loss", self.on_policy_loss, ON_POLICY_LOSSES)
        if not self.sample_temperature >= 0:
            raise UserError(
                f"kd.sample_temperature is {self.sample_temperature}, expected a number >= 0 (0: kd.temperature)"
            )
        _positive("kd.max_new_tokens", self.max_new_tokens)
        _positive("kd.samples_per_prompt", self.samples_per_prompt)
        if (
            isinstance(self.rollout_batch, bool)
            or not isinstance(self.rollout_batch, int)
            or self.rollout_batch < 0
        ):
            raise UserError(
                f"kd.rollout_batch is {short_repr(self.rollout_batch)}, expected an integer >= 0 (0: every "
                "row of the step at once)"
            )
        _positive("kd.temperature", self.temperature)
        _choice("kd.divergence", self.divergence, DIVERGENCES)
        if not 0 < self.beta < 1:
            raise UserError(f"kd.beta is {self.beta}, expected a number in (0, 1)")
        _positive("kd.chunk_size", self.chunk_size)
        _choice("kd.logits_dtype", self.logits_dtype, LOGITS_DTYPES)
        for i, pair in enumerate(self.layer_map):
            if len(pair) != 2 or any(x < 0 for x in pair):
                raise UserError(
                    f"kd.layer_map[{i}] is {short_repr(pair)}, expected a pair [teacher_layer, "
                    "student_layer] of layer indices >= 0"
                )
        _choice("kd.hidden_loss", self.hidden_loss, ("mse", "cosine"))
        for name in ("hidden_weight", "attention_weight"):
            if not getattr(self, name) >= 0:
                raise UserError(f"kd.{name} is {getattr(self, name)}, expected a number >= 0")
        if self.attention_weight > 0 and not self.layer_map:
            raise UserError(
                f"kd.attention_weight is {self.attention_weight} but kd.layer_map is empty: attention "
                "maps are transferred on mapped layers only"
            )

    @property
    def generates(self) -> bool:
        """Some steps train on generated completions: the student's (on_policy) or the teacher's (seq_kd)."""
        return self.on_policy > 0 or self.seq_kd > 0

    def rollout_slots(self, rows: int) -> int:
        """Rows the decode engine writes at once for a generation of `rows` rows (kd.rollout_batch)."""
        return min(self.rollout_batch, rows) if self.rollout_batch else rows

    @property
    def sampling_temperature(self) -> float:
        """The temperature completions are sampled at: kd.sample_temperature, or kd.temperature when 0."""
        return self.sample_temperature or self.temperature

    @property
    def layers_on(self) -> bool:
        """Intermediate-layer distillation is on: a layer map with a positive hidden or attention weight."""
        return bool(self.layer_map) and (self.hidden_weight > 0 or self.attention_weight > 0)


@dataclasses.dataclass
class OptimConfig:
    lr: float = 3e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # 0: no clipping

    def validate(self) -> None:
        _positive("optim.lr", self.lr)
        if not 0 <= self.min_lr_ratio <= 1:
            raise UserError(f"optim.min_lr_ratio is {self.min_lr_ratio}, expected a number in [0, 1]")
        for name in ("warmup_steps", "weight_decay", "grad_clip"):
            if getattr(self, name) < 0:
                raise UserError(f"optim.{name} is {getattr(self, name)}, expected a number >= 0")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise UserError(f"optim.{name} is {getattr(self, name)}, expected a number in [0, 1)")
        _positive("optim.eps", self.eps)


@dataclasses.dataclass
class ScheduleConfig:
    steps: int = 1000
    batch_size: int = 8
    grad_accum: int = 1
    eval_every: int = 200  # 0: only at the end
    eval_batches: int = 8
    checkpoint_every: int = 500  # 0: only at the end
    log_every: int = 1
    seed: int = 0
    sample_prompts: int = 4  # held-out prompts the student answers at each eval (samples.jsonl); 0: off
    sample_tokens: int = 32  # new tokens per sample answer (greedy)

    def validate(self) -> None:
        for name in ("steps", "batch_size", "grad_accum", "eval_batches", "log_every", "sample_tokens"):
            _positive(f"schedule.{name}", getattr(self, name))
        for name in ("eval_every", "checkpoint_every", "sample_prompts"):
            if getattr(self, name) < 0:
                raise UserError(f"schedule.{name} is {getattr(self, name)}, expected 0 or a positive integer")
        check_seed("schedule.seed", self.seed)


@dataclasses.dataclass
class OutputConfig:
    dir: str = "runs/kdistill"
    keep_checkpoints: int = 2
    report_to: list[str] = dataclasses.field(default_factory=list)  # tensorboard, wandb, mlflow
    # refuse, before loading, a run whose checkpoints and export do not fit on output.dir's filesystem
    check_disk: bool = True

    def validate(self) -> None:
        check_path_value("output.dir", self.dir)  # empty or blank would mean the working directory
        _positive("output.keep_checkpoints", self.keep_checkpoints)
        for name in self.report_to:
            if name not in TRACKERS:
                raise UserError(
                    f"output.report_to has {short_repr(name)}, expected a list of: {', '.join(TRACKERS)} "
                    "(or [] for none)"
                )


@dataclasses.dataclass
class RuntimeConfig:
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto (bf16 on GPU, fp32 on CPU) | float32 | bfloat16 | float16
    # auto: the student's linears in the compute dtype; fp8: its q/k/v/o and gate/up/down GEMMs, forward
    # and backward, as row-wise scaled FP8 GEMMs over fp32 masters (kdistill.models.fp8_train), on GPUs
    # of compute capability 8.9 or newer (the CPU runs the FP8 emulation)
    precision: str = "auto"
    kernels: str = "auto"  # auto (Triton on GPU) | triton | reference
    # A compile after the seal, or a kernel failure, is an error. Default: off, or KDISTILL_STRICT_KERNELS=1
    # (the test suite sets it, so tests run strict unless they say otherwise).
    strict_kernels: bool = dataclasses.field(
        default_factory=lambda: os.environ.get("KDISTILL_STRICT_KERNELS", "") not in ("", "0")
    )
    arch: str = "auto"  # GPU arch for kernel keys when no GPU is present, e.g. sm_90
    # A kernel pack (kdistill kernels build --out DIR): prewarm loads its binaries instead of compiling.
    kernel_pack: str = ""
    on_nonfinite: str = "skip"  # skip | stop
    max_nonfinite: int = 5  # stop after this many non-finite steps in a row
    # When the memory plan does not fit the GPU: lower schedule.batch_size to the largest that fits
    # instead of refusing. seq_len is never changed (the refusal names the largest seq_len that fits).
    auto_fit: bool = False
    gpu_memory_gib: float = 0.0  # 0: read the device; else plan against this much memory
    # Under torchrun: the frozen teacher sharded with FSDP2 like the student, or a whole copy on every
    # process (no gathers at all); auto: replicate when the memory plan says a whole teacher fits.
    teacher_placement: str = "auto"  # auto | shard | replicate
    # Under torchrun: the student sharded with FSDP2 (its weights, gradients and AdamW state 1/world per
    # process) or a whole copy on every process, its gradients averaged by one all-reduce a step (no
    # gathers; beside a replicated teacher, a run whose every step is generated captures its update as a
    # CUDA graph, the all-reduce inside); auto: replicate a student that writes completions (kd.on_policy,
    # kd.seq_kd) when the memory plan says it and a whole teacher fit, else shard.
    student_placement: str = "auto"  # auto | shard | replicate
    # What the student recomputes in backward instead of keeping: none (keep every activation), swiglu
    # (the MLP's SwiGLU output only: I elements a token and layer less, one elementwise pass more),
    # blocks (each decoder block: keeps only its inputs); auto: the first of none, swiglu, blocks whose
    # memory plan fits the GPU (swiglu on the CPU, never blocks there).
    activation_checkpointing: str = "auto"  # auto | none | swiglu | blocks
    # Under torchrun: when the student's decoder blocks free their gathered parameters: after each
    # block's forward (FSDP2's default: gathered again in backward) or after its backward (kept from
    # forward to backward: half the all-gathers, the whole student in bf16 at the peak); auto: after
    # the backward when the memory plan says it fits.
    student_reshard: str = "auto"  # auto | after_forward | after_backward
    # Under torchrun: consecutive decoder blocks of the student sharded as one FSDP unit (one all-gather
    # and one reduce-scatter for them all); 0 (auto): a student kept gathered from forward to backward in
    # 4 units, otherwise one block a unit (memory.student_unit_blocks). A LoRA student: 0 or 1.
    student_unit_blocks: int = 0
    # Under torchrun: the dtype the student's gradients are reduce-scattered (a whole student's: all-reduced)
    # in: fp32 (their sums exact to fp32) or compute (the compute dtype, bf16 on a GPU: half the bytes on
    # the link; each sum of bf16 gradients rounded to bf16 once).
    grad_reduce: str = "fp32"  # fp32 | compute
    # Profile this many training steps right after the warm-up steps (torch.profiler; every process
    # writes profile/rank{R}.txt and .json into the run directory); 0: off.
    profile_steps: int = 0
    # The profile records each op's input shapes: the top kernels' launchers name the shapes they ran on
    # (the host runs slower while it records, so the idle table reads larger gaps).
    profile_shapes: bool = False
    # The training step captured as one CUDA graph and replayed (kdistill.train.graph): the host no
    # longer queues every kernel of every step. auto: on a CUDA device in one process (under torchrun: the
    # generated steps of a run whose student and teacher are whole on every process) with live teachers
    # (not with a teacher cache, cross-tokenizer teacher or layer map; generated steps when every step is
    # generated, scored by one teacher with the divergence loss); on: the same, refused in one line where
    # it cannot be done; off: every step eager.
    cuda_graphs: str = "auto"  # auto | on | off

    def validate(self) -> None:
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise UserError(
                f"runtime.device is {short_repr(self.device)}, expected auto, cpu, cuda or cuda:N"
            )
        _choice("runtime.dtype", self.dtype, ("auto", *LONG_NAMES))
        _choice("runtime.precision", self.precision, ("auto", "fp8"))
        _choice("runtime.kernels", self.kernels, ("auto", "triton", "reference"))
        _choice("runtime.on_nonfinite", self.on_nonfinite, ("skip", "stop"))
        _positive("runtime.max_nonfinite", self.max_nonfinite)
        _choice("runtime.teacher_placement", self.teacher_placement, ("auto", "shard", "replicate"))
        _choice("runtime.student_placement", self.student_placement, ("auto", "shard", "replicate"))
        if self.student_placement == "replicate" and self.teacher_placement == "shard":
            raise UserError(
                "runtime.student_placement=replicate keeps a whole student on every process beside a whole "
                "teacher, but runtime.teacher_placement is shard: set runtime.teacher_placement to "
                "replicate or auto"
            )
        _choice(
            "runtime.activation_checkpointing",
            self.activation_checkpointing,
            ("auto", "none", "swiglu", "blocks"),
        )
        _choice("runtime.student_reshard", self.student_reshard, ("auto", "after_forward", "after_backward"))
        if self.student_unit_blocks < 0:
            raise UserError(
                f"runtime.student_unit_blocks is {self.student_unit_blocks}, expected 0 (auto) or a positive "
                "number of decoder blocks a unit"
            )
        _choice("runtime.cuda_graphs", self.cuda_graphs, ("auto", "on", "off"))
        _choice("runtime.grad_reduce", self.grad_reduce, ("fp32", "compute"))
        if self.profile_steps < 0:
            raise UserError(
                f"runtime.profile_steps is {self.profile_steps}, expected 0 (off) or a positive integer"
            )


@dataclasses.dataclass
class RunConfig:
    teacher: TeacherConfig = dataclasses.field(default_factory=TeacherConfig)
    teachers: list[TeacherEntry] = dataclasses.field(default_factory=list)
    student: StudentConfig = dataclasses.field(default_factory=StudentConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    kd: KDConfig = dataclasses.field(default_factory=KDConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    schedule: ScheduleConfig = dataclasses.field(default_factory=ScheduleConfig)
    output: OutputConfig = dataclasses.field(default_factory=OutputConfig)
    runtime: RuntimeConfig = dataclasses.field(default_factory=RuntimeConfig)

    def validate(self, need_paths: bool = True) -> RunConfig:
        self.check_values()
        for f in dataclasses.fields(self):
            section = getattr(self, f.name)
            parts = section if isinstance(section, list) else [section]  # `teachers` is a list of entries
            for i, part in enumerate(parts):
                if dataclasses.is_dataclass(part):
                    _check_numbers(part, f"{f.name}[{i}]" if isinstance(section, list) else f.name)
            if hasattr(section, "validate"):
                section.validate()
        self._validate_teachers()
        self._validate_kd_options()
        if self.runtime.student_unit_blocks > 1 and self.student.lora.enabled:
            raise UserError(
                f"runtime.student_unit_blocks is {self.runtime.student_unit_blocks}, but a LoRA student "
                "(student.lora) is sharded one decoder block a unit: expected 0 or 1"
            )
        if self.runtime.precision == "fp8" and self.student.lora.enabled:
            raise UserError(
                "runtime.precision=fp8 trains the student's own linears in FP8, but student.lora freezes "
                "them: use runtime.precision=auto with student.lora"
            )
        if need_paths:
            if not self.teacher.path:
                raise UserError("teacher.path is empty, expected a model directory or preset name")
            if not self.student.path:
                raise UserError("student.path is empty, expected a model directory, config.json or preset")
            pack = self.runtime.kernel_pack
            if pack and not Path(pack).is_dir():  # on any device: the same config must run on a GPU
                what = "is not a folder" if Path(pack).exists() else "does not exist"
                raise UserError(
                    f"runtime.kernel_pack '{pack[:200]}{'...' if len(pack) > 200 else ''}' {what}, expected "
                    "the --out folder of kdistill kernels build"
                )
        return self

    def check_values(self) -> None:
        """Every value is one config.yaml, manifest.json and state.json can hold (see `check_writable`),
        checked before anything is written; a one-line error names the field otherwise."""
        for f in dataclasses.fields(self):
            section = getattr(self, f.name)
            parts = section if isinstance(section, list) else [section]
            for i, part in enumerate(parts):
                name = f"{f.name}[{i}]" if isinstance(section, list) else f.name
                if not dataclasses.is_dataclass(part):
                    check_writable(part, name)
                    continue
                for g in dataclasses.fields(part):
                    value = getattr(part, g.name)
                    if dataclasses.is_dataclass(value):  # student.lora
                        for h in dataclasses.fields(value):
                            check_writable(getattr(value, h.name), f"{name}.{g.name}.{h.name}")
                    else:
                        check_writable(value, f"{name}.{g.name}")

    def _validate_teachers(self) -> None:
        """`teachers:` (several teachers) stands instead of teacher.path: the first teacher becomes
        teacher.path (its tokenizer, chat template and config are the run's), weights are normalised."""
        if not self.teachers:
            return
        first = self.teachers[0].path
        if self.teacher.path and self.teacher.path != first:
            raise UserError(
                "teacher.path and teachers are both set: give one teacher as teacher.path, or several as "
                "teachers: [{path, weight}, ...]"
            )
        if self.teacher.cache:
            raise UserError("teacher.cache holds one teacher's targets: it cannot be combined with teachers")
        for i, t in enumerate(self.teachers):
            if not t.path:
                raise UserError(f"teachers[{i}].path is empty, expected a model directory")
            if not (t.weight > 0 and t.weight < float("inf")):
                raise UserError(f"teachers[{i}].weight is {t.weight}, expected a positive number")
        total = sum(t.weight for t in self.teachers)
        for t in self.teachers:
            t.weight = t.weight / total
        self.teacher.path = first

    def _validate_kd_options(self) -> None:
        """What layer maps and cross-tokenizer distillation need from the rest of the config."""
        kd = self.kd
        if kd.attention_weight > 0 and self.data.seq_len > ATTENTION_MAX_SEQ_LEN:
            raise UserError(
                f"kd.attention_weight is {kd.attention_weight} with data.seq_len {self.data.seq_len}: attention "
                f"maps are (seq_len x seq_len) per head, supported up to seq_len {ATTENTION_MAX_SEQ_LEN}"
            )
        live = "one live teacher (teacher.path, no teacher.cache or teachers)"
        if kd.layers_on and (self.teacher.cache or self.teachers):
            raise UserError(f"kd.layer_map needs {live}: its hidden states are read at every step")
        if kd.cross_tokenizer and (self.teacher.cache or self.teachers):
            raise UserError(f"kd.cross_tokenizer needs {live}")
        if kd.cross_tokenizer and kd.layers_on:
            raise UserError("kd.cross_tokenizer and kd.layer_map cannot be combined (positions differ)")
        if kd.generates:
            what = "kd.on_policy" if kd.on_policy > 0 else "kd.seq_kd"
            if self.teacher.cache:
                raise UserError(
                    f"{what} needs a live teacher, but teacher.cache is set: a cache cannot score new samples"
                )
            if kd.cross_tokenizer and kd.seq_kd > 0:
                raise UserError(
                    "kd.seq_kd and kd.cross_tokenizer cannot be combined (the teacher's completions are in "
                    "its own tokens; kd.on_policy grades the student's across tokenizers)"
                )
            if kd.cross_tokenizer and kd.on_policy_loss != "divergence":
                raise UserError(
                    f"kd.on_policy_loss={kd.on_policy_loss} and kd.cross_tokenizer cannot be combined (the "
                    "teacher has no log-prob of the student's token); use divergence"
                )
            if kd.layers_on:
                raise UserError(
                    f"{what} and kd.layer_map cannot be combined (generated steps train the head only)"
                )
            if kd.max_new_tokens >= self.data.seq_len:
                raise UserError(
                    f"kd.max_new_tokens is {kd.max_new_tokens}, expected fewer than data.seq_len "
                    f"({self.data.seq_len}): a prompt and its completion fit in one row"
                )
            if self.schedule.batch_size % kd.samples_per_prompt:
                raise UserError(
                    f"schedule.batch_size {self.schedule.batch_size} is not a multiple of kd.samples_per_prompt "
                    f"({kd.samples_per_prompt}): a micro-batch holds every sample of its prompts"
                )

    @property
    def teacher_paths(self) -> list[str]:
        """Every teacher's path: the teachers of a mixture, or teacher.path alone."""
        return [t.path for t in self.teachers] if self.teachers else [self.teacher.path]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


WRITABLE = "a string, number, true/false, null, list or mapping with string keys (what config.yaml holds)"


def check_writable(value: Any, where: str, depth: int = 0) -> None:
    """Refuse, in one line naming the field, a value that JSON and YAML cannot hold as plain data: a set,
    a date object, bytes, an arbitrary object, a mapping with a non-string key (exact types only: a str or
    float subclass is refused too, since the YAML writer refuses it)."""
    if value is None or type(value) in (str, int, float, bool):
        return
    if depth > 64:
        raise UserError(f"{where} is nested more than 64 levels deep, expected plain data")
    if type(value) is list:
        for i, v in enumerate(value):
            check_writable(v, f"{where}[{i}]", depth + 1)
        return
    if type(value) is dict:
        for k, v in value.items():
            if type(k) is not str:
                raise UserError(
                    f"{where} has the key {short_repr(k)} (a Python {type(k).__name__}), expected string keys"
                )
            check_writable(v, f"{where}.{cut(k, 40)}", depth + 1)
        return
    raise UserError(f"{where} is {short_repr(value)} (a Python {type(value).__name__}), expected {WRITABLE}")


# Integers beyond this are no sane step count, size or id; they would only overflow a tensor or a range.
_INT_LIMIT = 2**62


def _check_numbers(section: Any, prefix: str) -> None:
    """Every float option finite (NaN would pass every `<` check: grad_clip=nan must not mean 'no
    clipping'), every integer option within int64 range, before the per-field ranges."""
    for f in dataclasses.fields(section):
        v = getattr(section, f.name)
        if isinstance(v, float) and not math.isfinite(v):
            raise UserError(f"{prefix}.{f.name} is {v}, expected a finite number")
        if isinstance(v, int) and not isinstance(v, bool) and abs(v) >= _INT_LIMIT:
            raise UserError(f"{prefix}.{f.name} is {short_repr(v)}, expected an integer below 2**62")


def _positive(name: str, value: Any) -> None:
    if not value > 0:
        raise UserError(f"{name} is {short_repr(value)}, expected a positive number")


def _choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise UserError(f"{name} is {short_repr(value)}, expected one of: {', '.join(choices)}")


def _closest(name: str, options: list[str]) -> str:
    best = difflib.get_close_matches(cut(name, 200), options, n=1, cutoff=0.5)
    return f" (did you mean '{best[0]}'?)" if best else f" (valid: {', '.join(options)})"


def _coerce(value: Any, hint: Any, where: str) -> Any:
    """Convert a YAML or command-line value to the field's type, with a one-line error."""
    origin = typing.get_origin(hint)
    item = (typing.get_args(hint) or (str,))[0]
    if origin is list and item is not str:  # a list of sections (teachers) or of lists (kd.layer_map)
        if not isinstance(value, list):
            raise UserError(f"{where} is {short_repr(value)}, expected a list")
        return [_coerce_item(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is list:
        if isinstance(value, str):
            value = [v for v in value.split(",") if v]
        if not isinstance(value, list):
            raise UserError(f"{where} is {short_repr(value)}, expected a list")
        return [str(_coerce(v, str, where)) for v in value]
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
            return value.lower() in ("true", "1", "yes", "on")
        raise UserError(f"{where} is {short_repr(value)}, expected true or false")
    if hint is int:
        if isinstance(value, bool):
            raise UserError(f"{where} is {short_repr(value)}, expected an integer")
        if isinstance(value, float) and value.is_integer():
            return int(value)
        try:
            return int(value) if not isinstance(value, float) else _fail_int(where, value)
        except (TypeError, ValueError, OverflowError):
            raise UserError(f"{where} is {short_repr(value)}, expected an integer") from None
    if hint is float:
        if isinstance(value, bool):
            raise UserError(f"{where} is {short_repr(value)}, expected a number")
        try:
            return float(value)
        except (TypeError, ValueError, OverflowError):
            raise UserError(f"{where} is {short_repr(value)}, expected a number") from None
    if hint is str:
        if value is not None and not isinstance(value, str | int | float | datetime.date | os.PathLike):
            raise UserError(f"{where} is {short_repr(value)}, expected a string")
        return "" if value is None else str(value)
    value = plain_value(value)  # a free-form value (template variables): yes/no/on/off are booleans here
    check_writable(value, where)
    return value


def _coerce_item(value: Any, hint: Any, where: str) -> Any:
    """One item of a list field: a section (a mapping of its fields) or a value of the item's type."""
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise UserError(f"{where} is {short_repr(value)}, expected a mapping of its fields")
        obj = hint()
        _apply(obj, value, f"{where}.")
        return obj
    if typing.get_origin(hint) is list and not isinstance(value, list):
        raise UserError(f"{where} is {short_repr(value)}, expected a list")
    return _coerce(value, hint, where)


def _fail_int(where: str, value: Any) -> int:
    raise UserError(f"{where} is {short_repr(value)}, expected an integer")


def _apply(obj: Any, data: dict[str, Any], prefix: str) -> None:
    hints = typing.get_type_hints(type(obj))
    names = [f.name for f in dataclasses.fields(obj)]
    for key, value in data.items():
        where = f"{prefix}{key}"
        if key not in names:
            raise UserError(f"unknown config key '{cut(where, 80)}'{_closest(str(key), names)}")
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise UserError(f"{where} is {short_repr(value)}, expected a mapping of its fields")
            _apply(current, value, f"{where}.")
        else:
            hint = hints[key]
            if isinstance(hint, types.UnionType):
                hint = str
            setattr(obj, key, _coerce(value, hint, where))


def parse_override(text: str) -> tuple[list[str], Any]:
    """'kd.temperature=2' -> (['kd', 'temperature'], 2): values parsed as YAML scalars."""
    if "=" not in text:
        raise UserError(f"override {short_repr(text)} is not of the form key=value (e.g. kd.temperature=2)")
    key, raw = text.split("=", 1)
    if not key or any(not part for part in key.split(".")):
        raise UserError(f"override {short_repr(text)} has an empty key")
    try:
        value = parse_yaml(raw, where=f"override '{cut(key, 80)}'") if raw.strip() else ""
    except UserError:
        value = raw  # not a YAML scalar: the text itself (type checks follow)
    return key.split("."), value


def load_config(
    path: str | Path | None, overrides: list[str] | tuple[str, ...] = (), base: dict[str, Any] | None = None
) -> RunConfig:
    """Read YAML (or start from `base`), apply dotted overrides, validate types. Paths stay as given."""
    cfg = RunConfig()
    if base:
        _apply(cfg, base, "")
    if path is not None:
        p = Path(path)
        if not p.exists():
            raise UserError(f"{p}: no such config file")
        data = read_yaml(p, what="a YAML run config")  # duplicate keys (sections given twice) refused
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise UserError(
                f"{p}: expected a mapping of sections (teacher, student, data, kd, ...) at the top"
            )
        # Relative model and data paths are relative to the config file's folder.
        _apply(cfg, data, "")
        _rebase_paths(cfg, p.parent)
    for item in overrides:
        keys, value = parse_override(item)
        nested: Any = value
        for k in reversed(keys):
            nested = {k: nested}
        _apply(cfg, nested, "")
    return cfg


def _rebase_paths(cfg: RunConfig, folder: Path) -> None:
    def rebase(p: str) -> str:
        if not p or Path(p).is_absolute():
            return p
        candidate = folder / p
        return str(candidate) if candidate.exists() else p

    cfg.teacher.path = rebase(cfg.teacher.path)
    cfg.teacher.cache = rebase(cfg.teacher.cache)
    cfg.runtime.kernel_pack = rebase(cfg.runtime.kernel_pack)
    for t in cfg.teachers:
        t.path = rebase(t.path)
    cfg.student.path = rebase(cfg.student.path)
    cfg.data.train = [rebase(p) for p in cfg.data.train]
    cfg.data.heldout = [rebase(p) for p in cfg.data.heldout]
    cfg.data.chat_template = rebase(cfg.data.chat_template)  # a file or model folder (not a literal)
