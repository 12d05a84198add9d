"""The kernel plan: every kernel key a run launches, from the two specs and the run config alone.

    keys = required_kernels(teacher_spec, student_spec, run, "sm_90")    # pure; no GPU, no weights
    keys = required_kernels(..., documents=True)     # packed conversations: document-masked attention
    keys = generation_kernels(spec, "sm_90", "bf16", batch=4, prompt_len=40, max_len=168)   # generate

It calls the same key functions as the dispatcher (each kernel's registered plan function), walking the decoder's op
sequence with the dtypes the training loop uses (`precision`): the teacher in the compute dtype
without grad; the student with fp32 master weights under autocast (bf16 on a GPU), forward with and
without grad (training and eval) and backward; the KD loss head for training and held-out eval
(kd.cross_tokenizer: the student's CE head and the ULD term's lm_head GEMMs, `cross_tokenizer_kernels`);
FP8 linears: the teacher's quantisation and GEMMs (`fp8_kernels`, teacher.precision=fp8), the student's
forward and backward ones (`fp8_student_kernels`, runtime.precision=fp8).
The property test in tests/test_contract.py proves plan ⊇ launched keys for random specs and runs.
"""

from __future__ import annotations

import dataclasses

import torch

from kdistill.dtypes import torch_dtype
from kdistill.errors import UserError
from kdistill.kernels import decode_gemv, keys, library, registry
from kdistill.models.spec import ModelSpec
from kdistill.ops.kd_loss import HELDOUT_TEMPERATURE


@dataclasses.dataclass(frozen=True)
class Precision:
    """Dtypes of a run, as the training loop sets them (train/loop.py resolve_device and loading)."""

    compute: str  # autocast dtype of the linears on a GPU ("fp32": no autocast)
    teacher_weights: str  # the teacher is loaded in the compute dtype
    student_weights: str  # fp32 master weights

    @property
    def autocast(self) -> bool:
        return self.compute != "fp32"


def precision(run, arch: str, sharded: bool = False) -> Precision:
    """runtime.dtype auto -> bf16 for a GPU arch, fp32 for 'cpu'. sharded: the student is under FSDP2,
    whose mixed-precision policy gathers its parameters in the compute dtype (fp32 masters stay
    sharded), so its layers see weights in the compute dtype."""
    d = run.runtime.dtype
    compute = ("fp32" if arch == "cpu" else "bf16") if d == "auto" else keys.dtype_name(d)
    lora = run.student.lora
    student = keys.dtype_name(lora.base_dtype) if lora.enabled else "fp32"  # a LoRA student's frozen base
    if sharded and not lora.enabled:
        student = compute
    return Precision(compute=compute, teacher_weights=compute, student_weights=student)


def _bits(dtype: str) -> int:
    return torch.finfo(torch_dtype(dtype)).bits


def _linear_out(x: str, w: str, prec: Precision) -> str:
    """Dtype of nn.Linear's output: the autocast dtype under autocast, else the promotion."""
    return prec.compute if prec.autocast else keys.promote(x, w)


def model_kernels(
    spec: ModelSpec,
    arch: str,
    prec: Precision,
    weights: str,
    *,
    grad: bool,
    batch: int,
    seq: int,
    masked: bool = False,
) -> set[keys.KernelKey]:
    """Keys of one decoder's forward (and backward if grad), following Decoder.forward op by op: each
    call site asks its kernel's registered plan function for the keys it launches. masked: attention
    takes a document mask (packed conversations; RoPE's per-token tables launch the same key)."""
    out: set[keys.KernelKey] = set()
    h, eps, w = spec.hidden_size, spec.rms_eps, weights

    def call(name: str, **problem) -> None:
        out.update(registry.by_name(name).plan(arch, grad=grad, **problem))

    def norm(x: str, residual: str | None, hidden: int, to_gemm: bool = False) -> str:
        """Adds the rmsnorm keys of one call; returns y's dtype. to_gemm: a hidden-size norm, whose
        output feeds GEMMs only, written in the autocast dtype under autocast (dispatch._gemm_dtype)."""
        y = keys.promote(keys.promote(x, residual) if residual is not None else x, w)
        y_dtype = None
        if to_gemm and prec.autocast and _bits(prec.compute) < _bits(y):
            y_dtype = prec.compute
        call("rmsnorm", hidden=hidden, eps=eps, dtype=x, w_dtype=w, r_dtype=residual, y_dtype=y_dtype)
        return y_dtype or y

    x = residual = weights  # embedding output dtype (autocast leaves embeddings alone)
    if spec.num_layers == 0:
        norm(x, None, h, to_gemm=True)
        return out
    x = norm(x, None, h, to_gemm=True)
    for _ in range(min(spec.num_layers, 2)):  # dtypes are the same from the second layer on
        q = _linear_out(x, w, prec)  # q_proj, k_proj: same dtype
        if spec.qk_norm:
            q = norm(q, None, spec.head_dim)
        call("rope", head_dim=spec.head_dim, q_heads=spec.num_heads, kv_heads=spec.num_kv_heads, dtype=q)
        out.add(
            library.sdpa_key(
                arch,
                batch=batch,
                q_heads=spec.num_heads,
                kv_heads=spec.num_kv_heads,
                seq=seq,
                head_dim=spec.head_dim,
                dtype=q,
                grad=grad,
                masked=masked,
            )
        )
        a = _linear_out(q, w, prec)  # o_proj
        x = norm(a, residual, h, to_gemm=True)
        residual = keys.promote(a, residual)
        gate = _linear_out(x, w, prec)  # gate_proj, up_proj
        call("swiglu", inter=spec.intermediate_size, dtype=gate)
        m = _linear_out(gate, w, prec)  # down_proj
        x = norm(m, residual, h, to_gemm=True)  # the next block's input norm, or the final norm
        residual = keys.promote(m, residual)
    return out


def linear_shapes(spec: ModelSpec) -> set[tuple[int, int]]:
    """(N, K) of the decoder's block GEMMs: q/k/v as one GEMM against [Wq; Wk; Wv] (models/decoder.py
    Attention.project_qkv), o_proj, gate/up as one against [W_gate; W_up] (MLP.forward), down_proj."""
    h, i = spec.hidden_size, spec.intermediate_size
    return {(spec.q_size + 2 * spec.kv_size, h), (h, spec.q_size), (2 * i, h), (h, i)}


def gemm_kernels(
    spec: ModelSpec, arch: str, dtype: str, *, grad: bool, tokens: int, chunk: int, linears: bool = True
) -> set[keys.KernelKey]:
    """Library keys for the decoder's linears at the run's token count and the lm_head chunk GEMMs.
    linears=False: the lm_head's alone (an FP8 student's block linears are `fp8_student_kernels`)."""
    h, i = spec.hidden_size, spec.intermediate_size
    # gate and up separate where adapters wrap them
    shapes = linear_shapes(spec) | {(i, h)} if linears else set()
    out = {library.gemm_key(arch, m=tokens, n=n, k=k, dtype=dtype, grad=grad) for n, k in shapes}
    out.add(library.gemm_key(arch, m=min(chunk, tokens), n=spec.vocab_size, k=h, dtype=dtype, grad=grad))
    return out


def fp8_kernels(spec: ModelSpec, arch: str, dtype: str, *, tokens: int) -> set[keys.KernelKey]:
    """An FP8 teacher (teacher.precision=fp8, kdistill.models.fp8): the row-wise quantisation of each
    GEMM input width (the block's input norm for q/k/v and gate/up, attention's output for o_proj,
    SwiGLU's for down_proj) and the scaled FP8 GEMMs at the run's token count."""
    h, i, q = spec.hidden_size, spec.intermediate_size, spec.q_size
    quant = registry.by_name("fp8_quant")
    out: set[keys.KernelKey] = set()
    for k in {h, q, i}:
        out |= quant.plan(arch, grad=False, k=k, dtype=dtype)
    for n, k in {(q + 2 * spec.kv_size, h), (h, q), (2 * i, h), (h, i)}:
        out.add(library.fp8_gemm_key(arch, m=tokens, n=n, k=k, dtype=dtype))
    return out


def fp8_student_kernels(spec: ModelSpec, arch: str, prec: Precision, *, tokens: int) -> set[keys.KernelKey]:
    """An FP8 student (runtime.precision=fp8, kdistill.models.fp8_train), for every block GEMM (N, K):
    forward: x (tokens, K) per row in the compute dtype, W (N, K) per row in the weights' dtype;
    backward: x^T and W^T (width K) per column, gy (tokens, N) per row and gy^T (width N) per column,
    gy in the linear's output dtype; and the three scaled FP8 GEMMs of each shape (y, grad_x, grad_W).
    The quantisation keys depend on widths and dtypes only, so eval and generation at other token
    counts launch the same ones."""
    rows, cols = registry.by_name("fp8_quant"), registry.by_name("fp8_quant_cols")
    # fp8_train_linear casts x to the dtype nn.Linear computes in: the autocast dtype, else the
    # weights' (fp32 student, no autocast); its output and gradient are in that dtype too
    x = prec.compute if prec.autocast else keys.promote(prec.compute, prec.student_weights)
    w = prec.student_weights
    out: set[keys.KernelKey] = set()
    for n, k in linear_shapes(spec):
        out |= rows.plan(arch, grad=True, k=k, dtype=x) | rows.plan(arch, grad=True, k=k, dtype=w)
        out |= cols.plan(arch, grad=True, c=k, dtype=x) | cols.plan(arch, grad=True, c=k, dtype=w)
        out |= rows.plan(arch, grad=True, k=n, dtype=x) | cols.plan(arch, grad=True, c=n, dtype=x)
        out.add(library.fp8_gemm_key(arch, m=tokens, n=n, k=k, dtype="bf16"))  # y
        out.add(library.fp8_gemm_key(arch, m=tokens, n=k, k=n, dtype="bf16"))  # grad_x
        out.add(library.fp8_gemm_key(arch, m=n, n=k, k=tokens, dtype="bf16"))  # grad_W
    return out


def check_fp8(arch: str, field: str = "teacher.precision") -> None:
    """{teacher,runtime}.precision=fp8 compiles FP8 conversions: Ada (sm_89), Hopper (sm_90) or
    newer, or the CPU's emulation."""
    if arch != "cpu" and keys.arch_capability(arch) < 89:
        raise UserError(
            f"{field}=fp8 needs FP8 matrix units (compute capability 8.9 or newer); the plan "
            f"is for {arch}: use {field}=auto"
        )


def lora_gemm_kernels(spec: ModelSpec, run, arch: str, dtype: str, *, tokens: int) -> set[keys.KernelKey]:
    """Library keys of a LoRA student's adapter GEMMs: x A^T (tokens x in -> rank) and then
    (x A^T) B^T (rank -> out) for each target shape, with their backward GEMMs."""
    lora = run.student.lora
    if not lora.enabled:
        return set()
    shapes = spec.linear_shapes()
    out: set[keys.KernelKey] = set()
    for t in lora.targets:
        fan_in, fan_out = shapes[t]
        out.add(library.gemm_key(arch, m=tokens, n=lora.rank, k=fan_in, dtype=dtype, grad=True))
        out.add(library.gemm_key(arch, m=tokens, n=fan_out, k=lora.rank, dtype=dtype, grad=True))
    return out


def kd_kernels(
    teacher: ModelSpec, student: ModelSpec, run, arch: str, prec: Precision
) -> set[keys.KernelKey]:
    """The KD loss head: training (the run's divergence, with grad) and held-out eval (no grad)."""
    head = registry.by_name("kd_loss")
    kd = run.kd
    # The step casts the head's operands to the autocast dtype, so the logits gradient is written in
    # the compute dtype; fp32 when there is no autocast. Training logits are fp32 (GEMMs accumulate in
    # fp32), or with kd.logits_dtype=compute in the operands' dtype, which the gradient then overwrites.
    grad_dtype = prec.compute if prec.autocast else prec.student_weights
    logits_dtype = grad_dtype if kd.logits_dtype == "compute" else "fp32"
    v_s = student.vocab_size
    out = head.plan(
        arch,
        grad=True,
        vocab_size=v_s,
        divergence=kd.divergence,
        logits_dtype=logits_dtype,
        has_kd=kd.alpha > 0,
        grad_dtype=grad_dtype,
        unit_t=float(kd.temperature) == 1.0,
    )
    for v in {
        v_s,
        teacher.vocab_size,
    }:  # held-out eval (temperature 1): KL and CE of the student, CE of the teacher
        for has_kd in (True, False):
            out |= head.plan(
                arch,
                grad=False,
                vocab_size=v,
                divergence="forward_kl",
                logits_dtype="fp32",
                has_kd=has_kd,
                unit_t=HELDOUT_TEMPERATURE == 1.0,
            )
    return out


def cross_tokenizer_kernels(
    teacher: ModelSpec, student: ModelSpec, run, arch: str, prec: Precision, *, tokens: int
) -> set[keys.KernelKey]:
    """kd.cross_tokenizer (train/cross_tok.py): the keys of the loss's own lm_head work, which the KD
    head's plan (`kd_kernels`, `gemm_kernels`) does not hold. The student's CE runs through the KD head
    without KD (its alpha is 0; the run's alpha weighs the ULD term) on the lm_head as stored, not cast
    to the autocast dtype: logits fp32, gradient written in the student weights' dtype, and its GEMM in
    that dtype. The ULD term's fp32 GEMMs, per chunk of kd.chunk_size aligned rows: the student's logits
    over its vocabulary (with grad, recomputed in backward) and the teacher's over its own (no grad; a
    teacher padded beyond its tokenizer runs at the tokenizer's rows, a shape warmed lazily). The
    teacher's forward runs at its own row length, which varies per batch: its GEMM and SDPA shapes are
    warmed lazily; its Triton keys do not depend on the token count (`model_kernels`)."""
    kd = run.kd
    m = min(kd.chunk_size, tokens)
    hs, vs = student.hidden_size, student.vocab_size
    out = registry.by_name("kd_loss").plan(
        arch,
        grad=True,
        vocab_size=vs,
        divergence="forward_kl",
        logits_dtype="fp32",
        has_kd=False,
        grad_dtype=prec.student_weights,
    )
    out.add(library.gemm_key(arch, m=m, n=vs, k=hs, dtype=prec.student_weights, grad=True))
    if kd.alpha > 0:
        out.add(library.gemm_key(arch, m=m, n=vs, k=hs, dtype="fp32", grad=True))
        out.add(
            library.gemm_key(arch, m=m, n=teacher.vocab_size, k=teacher.hidden_size, dtype="fp32", grad=False)
        )
    return out


def required_kernels(
    teacher_spec: ModelSpec,
    student_spec: ModelSpec,
    run,
    arch: str,
    *,
    batch: int | None = None,
    documents: bool = False,
    sharded: bool = False,
    extra_teachers: tuple[ModelSpec, ...] | list[ModelSpec] = (),
) -> set[keys.KernelKey]:
    """Every kernel key (Triton and library) the run launches: teacher forward without grad, student
    forward with and without grad and its backward (no teacher forward with teacher.cache) (a LoRA student: its frozen base in
    student.lora.base_dtype and the adapters' GEMMs), the KD loss head (kd.cross_tokenizer: also its
    loss's own, `cross_tokenizer_kernels`); for `arch` (e.g. 'sm_90').
    batch: the per-process batch (under torchrun batch_size / world); default run.schedule.batch_size.
    documents: the data is packed conversations (attention masked by document).
    sharded: the student is sharded with FSDP2 (torchrun), its weights gathered in the compute dtype.
    extra_teachers: the other teachers of a mixture (`teachers:`), each run forward without grad."""
    arch = arch if arch == "cpu" else keys.normalize_arch(arch)
    prec = precision(run, arch, sharded)
    b, t = batch or run.schedule.batch_size, run.data.seq_len
    m = dict(batch=b, seq=t, masked=documents)
    cached = bool(getattr(run.teacher, "cache", ""))  # a teacher cache: no teacher forward at all
    out = set() if cached else model_kernels(teacher_spec, arch, prec, prec.teacher_weights, grad=False, **m)
    fp8 = not cached and getattr(run.teacher, "precision", "auto") == "fp8"
    if fp8:
        check_fp8(arch)
        for ts in (teacher_spec, *extra_teachers):
            out |= fp8_kernels(ts, arch, prec.compute, tokens=b * t)
    out |= model_kernels(student_spec, arch, prec, prec.student_weights, grad=False, **m)
    out |= model_kernels(student_spec, arch, prec, prec.student_weights, grad=True, **m)
    if not cached:
        out |= gemm_kernels(
            teacher_spec, arch, prec.compute, grad=False, tokens=b * t, chunk=run.kd.chunk_size
        )
    fp8_student = getattr(run.runtime, "precision", "auto") == "fp8"
    if fp8_student:
        check_fp8(arch, "runtime.precision")
        out |= fp8_student_kernels(student_spec, arch, prec, tokens=b * t)
    out |= gemm_kernels(
        student_spec,
        arch,
        prec.compute,
        grad=True,
        tokens=b * t,
        chunk=run.kd.chunk_size,
        linears=not fp8_student,
    )
    out |= lora_gemm_kernels(student_spec, run, arch, prec.compute, tokens=b * t)
    out |= kd_kernels(teacher_spec, student_spec, run, arch, prec)
    if getattr(run.kd, "cross_tokenizer", False):
        out |= cross_tokenizer_kernels(teacher_spec, student_spec, run, arch, prec, tokens=b * t)
    for extra in extra_teachers:  # the KD head's key depends on the student's vocab only
        out |= model_kernels(extra, arch, prec, prec.teacher_weights, grad=False, **m)
        out |= gemm_kernels(extra, arch, prec.compute, grad=False, tokens=b * t, chunk=run.kd.chunk_size)
    kd = run.kd
    if getattr(kd, "on_policy", 0) > 0 or getattr(kd, "seq_kd", 0) > 0:
        # generated steps (kdistill.train.rollouts): every micro-batch's rows decoded at once by the
        # decode engine (generation_kernels: prefill at the longest prompt, the one-token step over
        # seq_len + 1 cache slots), in bf16 on a GPU and in the writer's own dtype on a CPU.
        rows, prompt = b * run.schedule.grad_accum, t + 1 - kd.max_new_tokens
        writers = [student_spec] + ([teacher_spec] if kd.seq_kd > 0 and not cached else [])
        on_cpu = arch == "cpu" or getattr(run.runtime, "device", "auto") == "cpu"
        for spec in writers:
            w = prec.student_weights if spec is student_spec else prec.teacher_weights
            dt = w if on_cpu else "bf16"
            slots = min(getattr(kd, "rollout_batch", 0) or rows, rows)  # kd.rollout_slots: the engine's rows
            out |= generation_kernels(spec, arch, dt, batch=slots, prompt_len=prompt, max_len=t + 1)
        if documents:  # generated rows are not packed: the update's forward attends without documents,
            # as does the scoring of one tokenizer's live teacher (across tokenizers it scores its own
            # packed rendering: masked, above)
            plain = dict(m, masked=False)
            out |= model_kernels(student_spec, arch, prec, prec.student_weights, grad=True, **plain)
            if not cached and not getattr(kd, "cross_tokenizer", False):
                out |= model_kernels(teacher_spec, arch, prec, prec.teacher_weights, grad=False, **plain)
    if getattr(run.schedule, "sample_prompts", 0) and not sharded:
        # a run's samples at each eval (kdistill.samples): a decode engine of sample_prompts rows over
        # seq_len + 1 + sample_tokens slots for the student and, once, the teacher (one of the
        # student's tokenizer, live), in bf16 on a GPU and in the model's own dtype on a CPU
        on_cpu = arch == "cpu" or getattr(run.runtime, "device", "auto") == "cpu"
        rows, slots = run.schedule.sample_prompts, t + 1 + run.schedule.sample_tokens
        writers = [(student_spec, prec.student_weights)]
        if not cached and not getattr(kd, "cross_tokenizer", False):
            writers.append((teacher_spec, prec.teacher_weights))
        for spec, w in writers:
            dt = w if on_cpu else "bf16"
            out |= generation_kernels(spec, arch, dt, batch=rows, prompt_len=min(t, 16), max_len=slots)
    return out


def generation_kernels(
    spec: ModelSpec, arch: str, dtype: str, *, batch: int, prompt_len: int, max_len: int
) -> set[keys.KernelKey]:
    """Every kernel key of the decode engine (kdistill.decode) for a model whose weights are in `dtype`
    (no autocast): the decoder's forward without grad, whose Triton keys do not depend on the token
    count, so the prefill and the one-token step launch the same ones; the decode step's attention
    over the static cache of max_len slots (kernels/decode_attention.py), its sampler and bookkeeping
    (kernels/decode_sample.py); and the library shapes: the
    prefill's causal SDPA at prompt_len, the linears at batch x prompt_len and at batch tokens, the
    lm_head at batch rows. Prefills of other lengths are other library shapes, run unwarmed: library
    calls compile nothing, so the seal (which counts Triton compiles) is unaffected."""
    arch = arch if arch == "cpu" else keys.normalize_arch(arch)
    dt = keys.dtype_name(dtype)
    prec = Precision(compute=dt, teacher_weights=dt, student_weights=dt)
    fwd = model_kernels(spec, arch, prec, dt, grad=False, batch=batch, seq=prompt_len, masked=True)
    out = {k for k in fwd if not k.is_library}
    out |= _decode_attention(spec, arch, dt, max_len, rows=batch)
    out |= _step_norms(spec, arch, dt, batch)
    out |= registry.by_name("decode_sample").plan(arch, grad=False, vocab=spec.vocab_size, dtype=dt)
    out |= registry.by_name("decode_gemv").plan(
        arch,
        grad=False,
        hidden=spec.hidden_size,
        q_size=spec.q_size,
        kv_size=spec.kv_size,
        intermediate=spec.intermediate_size,
        qkv_bias=spec.attention_bias,
        dtype=dt,
        rows=batch,
        eps=spec.rms_eps,
    )
    out.add(
        library.sdpa_key(
            arch,
            batch=batch,
            q_heads=spec.num_heads,
            kv_heads=spec.num_kv_heads,
            seq=prompt_len,
            head_dim=spec.head_dim,
            dtype=dt,
            grad=False,
            masked=False,
        )
    )
    for tokens in {batch * prompt_len, batch}:
        out |= gemm_kernels(spec, arch, dt, grad=False, tokens=tokens, chunk=batch)
    return out


def _step_norms(spec: ModelSpec, arch: str, dt: str, batch: int) -> set[keys.KernelKey]:
    """The norms of a small bucket's decode step (runtime.chained: their keys launch with programmatic
    dependent launch): the first block's input norm with the embedding lookup (gather), the add + norms
    after it (and the final one), the add + norms that sum a split o_proj's or down's partials, and
    Qwen3's per-head q/k norms; and the gathering norm unchained when the engine has buckets of more
    rows than chain (batch > decode_gemv.step_rows)."""
    norm = registry.by_name("rmsnorm").plan
    eps, h = spec.rms_eps, spec.hidden_size
    if spec.num_layers == 0:  # no block: the step norms the embedding alone
        return norm(arch, grad=False, hidden=h, eps=eps, dtype=dt, w_dtype=dt, chained=True)
    out: set[keys.KernelKey] = set()
    for chain in {True, batch <= decode_gemv.step_rows(h)}:
        out |= norm(arch, grad=False, hidden=h, eps=eps, dtype=dt, w_dtype=dt, chained=chain, gather=True)
    out |= norm(arch, grad=False, hidden=h, eps=eps, dtype=dt, w_dtype=dt, r_dtype=dt, chained=True)
    if spec.qk_norm:
        out |= norm(arch, grad=False, hidden=spec.head_dim, eps=eps, dtype=dt, w_dtype=dt, chained=True)
    for k in (spec.q_size, spec.intermediate_size):  # o_proj's and down's split partials, summed here
        if decode_gemv.serves(1, k, decode_gemv.EPI_NONE, h) and decode_gemv.split(h, k) > 1:
            parts = decode_gemv.split(h, k)
            out |= norm(
                arch,
                grad=False,
                hidden=h,
                eps=eps,
                dtype=dt,
                w_dtype=dt,
                r_dtype=dt,
                chained=True,
                parts=parts,
            )
    return out


def _decode_attention(
    spec: ModelSpec, arch: str, dt: str, max_len: int, tokens: tuple[int, ...] = (), rows: int = 1
) -> set[keys.KernelKey]:
    """The decode attention's keys for spec's heads over caches of max_len slots (tokens=(T,): the
    T-token kernel's) for an engine of `rows` rows."""
    return registry.by_name("decode_attention").plan(
        arch,
        grad=False,
        head_dim=spec.head_dim,
        q_heads=spec.num_heads,
        kv_heads=spec.num_kv_heads,
        dtype=dt,
        max_len=max_len,
        tokens=tokens,
        rows=rows,
    )


def speculative_kernels(
    target: ModelSpec,
    draft: ModelSpec,
    arch: str,
    dtype: str,
    *,
    batch: int,
    prompt_len: int,
    max_len: int,
    draft_tokens: int,
) -> set[keys.KernelKey]:
    """Every kernel key of speculative decoding (kdistill.speculative): each model's decode plan over
    caches of max_len slots, the T-token attention kernel of the draft's two-token step and of the
    target's verify step of draft_tokens + 1 tokens per row (their other Triton keys are the one-token
    step's), plus those two steps' library shapes (the verify step's lm_head on all of its tokens)."""
    out = generation_kernels(target, arch, dtype, batch=batch, prompt_len=prompt_len, max_len=max_len)
    out |= generation_kernels(draft, arch, dtype, batch=batch, prompt_len=prompt_len, max_len=max_len)
    arch = arch if arch == "cpu" else keys.normalize_arch(arch)
    dt = keys.dtype_name(dtype)
    for spec, tokens in ((target, draft_tokens + 1), (draft, 2)):
        out |= _decode_attention(spec, arch, dt, max_len, tokens=(tokens,))
    verify = batch * (draft_tokens + 1)
    out |= gemm_kernels(target, arch, dt, grad=False, tokens=verify, chunk=verify)
    out |= gemm_kernels(draft, arch, dt, grad=False, tokens=2 * batch, chunk=batch)
    return out


def triton_keys(plan: set[keys.KernelKey]) -> list[keys.KernelKey]:
    """The plan's Triton kernels (library keys left out), in a stable order."""
    return sorted(k for k in plan if not k.is_library)
