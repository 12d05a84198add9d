"""`kdistill generate`'s job, read top to bottom: the flags, the model directory and the prompts become a
Job, the Job a decode engine, the engine's answers rows (printed, or a resumable answer file).

    rows = generate_texts("out/student", prompts=["Hello"], chat=True)    # [{"text", "token_ids", ...}]
    manifest = generate_to_file("TEACHER", "answers.jsonl", messages_file="prompts.jsonl")

1. The flags that need nothing read: --samples-per-prompt, --kernel-pack (its manifest against this
   process and GPU), --device, --out's folder.
2. prepare_job: the model's config.json (no weights), the --messages file, the tokenizer, the chat
   template (--chat-template PATH or the model's: kdistill.data.chat_template), every prompt rendered
   and encoded, the stop ids (EOS, the configs' eos ids, the template's end-of-turn token).
3. build_engine: the cache length and every size checked, the memory checked against the GPU's free
   memory, the model loaded, the decode engine's kernels prewarmed and sealed (kernels.plan.
   generation_kernels; a kernel pack's binaries loaded), the decode engine built (kdistill.decode).
4. run_job: (prompt, sample) pairs answered by the engine, each answer a row (answer_row).
   With --out the answer file (kdistill.answer_file) is checked and resumed around step 4: what is
   left to answer, chunks appended as answers finish, the file put in order and marked complete.

Greedy by default (decode.Sampling: temperature 0); a seed reproduces sampled tokens on the same device.
A row stops at its first stop token, the last of its `token_ids`; its `text` leaves the stop token out.
--draft: the same steps with a draft model beside the target (check_draft, build_speculative), whose
SpeculativeDecoder (kdistill.speculative) answers as the engine does.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from kdistill import answer_file
from kdistill.data.chat import (
    Conversation,
    check_unicode,
    conversation_from_record,
    end_of_turn_token,
    is_tools_header,
    tools_header,
    with_file_tools,
)
from kdistill.data.chat_template import ChatTemplate, load_chat_template
from kdistill.decode import DecodeEngine, Sampling
from kdistill.errors import UserError
from kdistill.kernels import pack as packs
from kdistill.kernels.plan import generation_kernels
from kdistill.kernels.runtime import resolve_arch, resolve_mode
from kdistill.kernels.seal import configure, jit_after_prewarm, prewarm, seal, unseal
from kdistill.models.decoder import Decoder
from kdistill.models.hf_io import load_model
from kdistill.models.spec import ModelSpec, load_spec
from kdistill.models.tokenizer import Tokenizer, load_tokenizer
from kdistill.speculative import (
    DEFAULT_DRAFT_TOKENS,
    SpeculativeDecoder,
    check_draft_tokens,
    check_same_tokenizer,
    prepare_speculative_kernels,
)

ROLES = ("system", "user", "assistant")
DEFAULT_SAMPLING = Sampling()  # greedy, 128 new tokens
MAX_SAMPLES_PER_PROMPT = 1024  # answers of one prompt in one call
MAX_ANSWERS = 1 << 22  # prompts x samples of one call (4,194,304): their bookkeeping stays in memory


# -- the entry points -------------------------------------------------------------------------------
def generate_texts(
    model_dir: str | Path,
    *,
    prompts: Sequence[str] = (),
    messages_file: str | Path | None = None,
    chat: bool = False,
    chat_template: str | Path | None = None,
    sampling: Sampling = DEFAULT_SAMPLING,
    device: str = "auto",
    on_text: Callable[[str], None] | None = None,
    batch_size: int = 32,
    max_length: int | None = None,
    samples_per_prompt: int = 1,
    on_row: Callable[[dict[str, Any]], None] | None = None,
    cuda_graphs: str = "auto",
    kernel_pack: str | Path | None = None,
) -> list[dict[str, Any]]:
    """Load a model directory and answer every prompt (and conversation of messages_file) with the
    decode engine: one row per prompt and sample, in order (see answer_row). on_text: the new text of
    a single prompt as it grows (streaming); on_row(row): each row as it is complete. kernel_pack: a
    kernel pack folder (`kdistill kernels build --out`) the decode kernels are loaded from on a GPU."""
    check_samples(samples_per_prompt)
    pack = check_kernel_pack(kernel_pack, resolve_device(device))  # before the model directory is read
    job = prepare_job(
        model_dir, prompts=prompts, messages_file=messages_file, chat=chat, chat_template=chat_template
    )
    check_samples(samples_per_prompt, len(job.ids))
    work = [(i, j) for i in range(len(job.ids)) for j in range(samples_per_prompt)]
    engine, _info = build_engine(
        job,
        sampling,
        device=device,
        batch_size=batch_size,
        max_length=max_length,
        cuda_graphs=cuda_graphs,
        kernel_pack=pack,
    )
    return run_job(job, engine, work, on_row=on_row, on_text=on_text)


def generate_to_file(
    model_dir: str | Path,
    out: str | Path,
    *,
    prompts: Sequence[str] = (),
    messages_file: str | Path | None = None,
    chat: bool = False,
    chat_template: str | Path | None = None,
    sampling: Sampling = DEFAULT_SAMPLING,
    samples_per_prompt: int = 1,
    device: str = "auto",
    batch_size: int = 32,
    max_length: int | None = None,
    progress: bool = True,
    on_row: Callable[[dict[str, Any]], None] | None = None,
    kernel_pack: str | Path | None = None,
) -> dict[str, Any]:
    """Answer every prompt into the answer file `out` (resuming an earlier start; see
    kdistill.answer_file); returns its final manifest. Nothing is written before every check has passed
    (the sizes, the memory, the model loaded)."""
    check_samples(samples_per_prompt)
    out = answer_file.check_out(out)
    pack = check_kernel_pack(kernel_pack, resolve_device(device))  # before the model directory is read
    job = prepare_job(
        model_dir, prompts=prompts, messages_file=messages_file, chat=chat, chat_template=chat_template
    )
    check_samples(samples_per_prompt, len(job.ids))
    current = answer_file.settings(job.model_dir, job.ids, sampling, samples_per_prompt, max_length, chat)
    with answer_file.locked(out):  # one process per output file
        left = answer_file.resume(out, current, len(job.ids), samples_per_prompt)
        if left.finished is not None:
            return left.finished
        built = None
        if left.work:
            built = build_engine(
                job, sampling, device=device, batch_size=batch_size, max_length=max_length, kernel_pack=pack
            )
        manifest = answer_file.start(out, left, current, len(job.ids) * samples_per_prompt)
        if built is not None:
            engine, info = built
            appender = answer_file.Appender(out, len(left.work), progress, on_row)
            with appender as add:
                run_job(job, engine, left.work, on_row=add)
            manifest.update(
                jit_after_prewarm=jit_after_prewarm(),
                device=info.get("arch") if info.get("mode") == "triton" else str(engine.device),
                batch_size=info["batch"],
                cache_length=info["max_len"],
                **appender.stats(),
            )
        return answer_file.finish(out, manifest)


def generate_texts_speculative(
    model_dir: str | Path,
    draft_dir: str | Path,
    *,
    draft_tokens: int = DEFAULT_DRAFT_TOKENS,
    prompts: Sequence[str] = (),
    messages_file: str | Path | None = None,
    chat: bool = False,
    chat_template: str | Path | None = None,
    sampling: Sampling = DEFAULT_SAMPLING,
    device: str = "auto",
    on_text: Callable[[str], None] | None = None,
    batch_size: int = 32,
    max_length: int | None = None,
    samples_per_prompt: int = 1,
    on_row: Callable[[dict[str, Any]], None] | None = None,
    cuda_graphs: str = "auto",
    kernel_pack: str | Path | None = None,
) -> list[dict[str, Any]]:
    """generate_texts with draft_dir's model proposing draft_tokens tokens per verify step of
    model_dir's: the same rows (the same tokens when greedy)."""
    if (
        isinstance(samples_per_prompt, bool)
        or not isinstance(samples_per_prompt, int)
        or samples_per_prompt < 1
    ):
        raise UserError(f"--samples-per-prompt is {samples_per_prompt!r}, expected an integer >= 1")
    check_draft_tokens(draft_tokens)
    pack = check_kernel_pack(kernel_pack, resolve_device(device))
    job = prepare_job(
        model_dir, prompts=prompts, messages_file=messages_file, chat=chat, chat_template=chat_template
    )
    work = [(i, j) for i in range(len(job.ids)) for j in range(samples_per_prompt)]
    dec, _info = build_speculative(
        job,
        draft_dir,
        sampling,
        draft_tokens=draft_tokens,
        device=device,
        batch_size=batch_size,
        max_length=max_length,
        cuda_graphs=cuda_graphs,
        kernel_pack=pack,
    )
    return run_job(job, dec, work, on_row=on_row, on_text=on_text)  # type: ignore[arg-type]


# -- 1. the flags that need nothing read --------------------------------------------------------
def check_samples(samples: Any, prompts: int | None = None) -> None:
    """--samples-per-prompt: an integer in [1, MAX_SAMPLES_PER_PROMPT] (checked before anything is
    read), and with the number of prompts known, at most MAX_ANSWERS answers in all."""
    if (
        isinstance(samples, bool)
        or not isinstance(samples, int)
        or not 1 <= samples <= MAX_SAMPLES_PER_PROMPT
    ):
        shown = repr(samples) if len(repr(samples)) <= 40 else repr(samples)[:40] + "..."
        raise UserError(
            f"--samples-per-prompt is {shown}, expected an integer from 1 to {MAX_SAMPLES_PER_PROMPT}"
        )
    if prompts is not None and prompts * samples > MAX_ANSWERS:
        raise UserError(
            f"--samples-per-prompt {samples} x {prompts} prompts is {prompts * samples:,} answers, expected at "
            f"most {MAX_ANSWERS:,} in one call: split the prompts over several calls"
        )


def resolve_device(name: str) -> torch.device:
    """--device: auto (cuda when available), cpu, cuda or cuda:N."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not (name in ("cpu", "cuda") or name.startswith("cuda:")):
        raise UserError(f"--device is '{name}', expected auto, cpu, cuda or cuda:N")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device is '{name}' but no CUDA GPU is available (use --device cpu)")
    return torch.device(name)


def decode_kernel_arch(device: torch.device) -> str | None:
    """The GPU arch the decode engine's Triton kernels are built for on `device` (e.g. 'sm_90'); None
    where it runs without them (the CPU, or no Triton: the PyTorch reference path)."""
    if resolve_mode("auto", device) != "triton":
        return None
    return resolve_arch("auto", device)


def check_kernel_pack(pack: str | Path | None, device: torch.device) -> str | None:
    """--kernel-pack: the folder's manifest (`kdistill kernels build --out`), and where the Triton
    kernels run, its Triton version and build, arch and CUDA against this process and GPU: read before
    any weight is loaded, each fault one line naming --kernel-pack. Returns the folder (None: no pack).
    Where no Triton kernel runs (the CPU) the pack is read, then left unused."""
    if pack is None or str(pack) == "":
        return None
    folder = Path(pack)
    try:
        manifest = packs.read_manifest(folder, what="--kernel-pack")
        arch = decode_kernel_arch(device)
        if arch is not None:
            packs.check(manifest, folder, arch, what="--kernel-pack")
    except UserError as e:
        msg = str(e)
        raise UserError(msg if msg.startswith("--kernel-pack") else f"--kernel-pack {msg}") from None
    return str(folder)


# -- 2. the job: prompts, template and stop ids (no weights read) -----------------------------
@dataclasses.dataclass
class Job:
    """The prompts of one generate call, encoded, and what answering them needs.

    convs[i]: prompt i as a conversation (chat: a prompt is one user turn; --messages: as read), None
    for a plain prompt; texts[i]: prompt i as given (plain) or as rendered (chat)."""

    model_dir: Path
    tokenizer: Tokenizer
    template: ChatTemplate | None
    spec: ModelSpec
    ids: list[list[int]]
    texts: list[str]
    convs: list[list[dict[str, Any]] | None]
    stops: set[int]
    tools: list[list[Any] | None] = dataclasses.field(default_factory=list)  # per prompt: its record's tools

    @property
    def context(self) -> int:
        return int(self.spec.max_position_embeddings)


def prepare_job(
    model_dir: str | Path,
    *,
    prompts: Sequence[str] = (),
    messages_file: str | Path | None = None,
    chat: bool = False,
    chat_template: str | Path | None = None,
) -> Job:
    """Read the model's config, tokenizer and template (chat_template: --chat-template PATH, else the
    model's) and encode every prompt (no weights loaded)."""
    model_dir = Path(model_dir)
    if not prompts and messages_file is None:
        raise UserError("expected --prompt TEXT or --messages FILE")
    spec = load_spec(model_dir)
    convs_in = read_messages_file(messages_file) if messages_file is not None else []
    tokenizer = load_tokenizer(model_dir)
    template = _template(model_dir, chat_template, needed=chat or bool(convs_in))
    ids = encode_prompts(tokenizer, template, prompts=prompts, conversations=convs_in, chat=chat)
    if chat or convs_in:
        convs: list[list[dict[str, Any]] | None] = [[{"role": "user", "content": p}] for p in prompts]
        convs += [[dict(m) for m in c.messages] for c in convs_in]
    else:
        convs = [None] * len(prompts)
    texts = [tokenizer.decode(r) for r in ids] if chat or convs_in else list(prompts)
    stops = stop_token_ids(model_dir, tokenizer, template)
    tools = [None] * len(prompts) + [list(c.tools) if c.tools is not None else None for c in convs_in]
    return Job(model_dir, tokenizer, template, spec, ids, texts, convs, stops, tools)


def read_messages_file(path: str | Path) -> list[Conversation]:
    """Conversations to answer from a JSONL file: per line a list of messages or an object with
    `messages` (and optionally `tools`). Every field of a message reaches the template as given (roles
    such as `tool`, `reasoning_content`, `tool_calls`); the last turn is not the assistant's (the
    answer is what comes next)."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(
            f"{path}: cannot read ({getattr(e, 'strerror', None) or e.__class__.__name__})"
        ) from None
    out = []
    file_tools = None  # a first record {"tools": [...]} alone: every conversation's without its own
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            rec = json.loads(line)
        except (ValueError, RecursionError):
            raise UserError(
                f'{where}: not valid JSON, expected a list of messages or {{"messages": [...]}}'
            ) from None
        if is_tools_header(rec) and not out and file_tools is None:
            file_tools = tools_header(rec, where)
            continue
        if isinstance(rec, list):
            rec = {"messages": rec}
        msgs = rec.get("messages") if isinstance(rec, dict) else None
        if not isinstance(msgs, list) or not msgs:
            raise UserError(f'{where}: expected a non-empty list of messages or {{"messages": [...]}}')
        # The training reader's checks (every field kept); a last user turn stands in for the answer
        # that format requires, and is dropped again.
        probe = {**rec, "messages": [*msgs, {"role": "assistant", "content": ""}]}
        conv = conversation_from_record(probe, "messages", where)
        last = msgs[-1].get("role")
        if last == "assistant":
            raise UserError(
                f"{where}: the last message is 'assistant', expected a turn to answer (user or tool)"
            )
        out.append(
            with_file_tools(
                dataclasses.replace(conv, messages=conv.messages[:-1], train=(False,) * len(msgs)),
                file_tools,
            )
        )
    if not out:
        raise UserError(f"{path}: no conversations (expected one JSON list of messages per line)")
    return out


def _template(model_dir: Path, override: str | Path | None, needed: bool) -> ChatTemplate | None:
    """The chat template: --chat-template PATH (override) when given, else the model's; None when it
    has none and none is needed (plain prompts)."""
    override = None if override is None or str(override) == "" else override
    try:
        return load_chat_template(model_dir, override, field="--chat-template")
    except UserError:
        if needed or override is not None:
            raise
        return None


def encode_prompts(
    tokenizer: Tokenizer,
    template: ChatTemplate | None,
    *,
    prompts: Sequence[str] = (),
    conversations: Sequence[Conversation | Sequence[Mapping[str, Any]]] = (),
    chat: bool = False,
    template_kwargs: Mapping[str, Any] | None = None,
) -> list[list[int]]:
    """Token ids of each prompt. Chat: a prompt becomes one user turn, and each conversation is
    rendered with the template, its tools (or template_kwargs' `tools`), the template variables and
    add_generation_prompt=True; plain prompts are encoded as they are."""
    if chat or conversations:
        if template is None:
            raise UserError("chat prompts need a chat template (give one with --chat-template PATH)")
        values = dict(template_kwargs or {})
        run_tools = values.pop("tools", None)
        items: list[tuple[list[Any], Any]] = [([{"role": "user", "content": p}], None) for p in prompts]
        for c in conversations:
            if isinstance(c, Conversation):
                items.append((list(c.messages), None if c.tools is None else list(c.tools)))
            else:
                items.append((list(c), None))
        texts = [
            template.render(m, add_generation_prompt=True, tools=run_tools if t is None else t, **values)
            for m, t in items
        ]
    else:
        texts = list(prompts)
    for i, text in enumerate(texts):
        check_unicode(text, f"prompt {i + 1}")
    ids = tokenizer.encode_batch(texts)
    for i, row in enumerate(ids):
        if not row:
            raise UserError(f"--prompt {i + 1} is empty (expected at least one token)")
    return ids


def stop_token_ids(
    model_dir: str | Path,
    tokenizer: Tokenizer,
    template: ChatTemplate | None,
    template_kwargs: Mapping[str, Any] | None = None,
) -> set[int]:
    """The tokenizer's EOS, the eos ids of config.json and generation_config.json, and the chat
    template's end-of-turn token (when the model has a template): the special token that follows an
    answer in the render diff of a probe conversation, never a word searched for in the text. A template
    that fails on the probe only means no end-of-turn stop (with a warning)."""
    ids = {i for i in _config_eos_ids(Path(model_dir)) if 0 <= i < tokenizer.vocab_size}
    if tokenizer.eos_id is not None:
        ids.add(tokenizer.eos_id)
    if template is not None:
        try:
            eot = end_of_turn_token(template, tokenizer, template_kwargs)
        except UserError as e:
            logging.getLogger("kdistill").warning("no end-of-turn stop token: %s", e)
            eot = None
        if eot is not None and tokenizer.token_to_id(eot) is not None:
            ids.add(tokenizer.token_to_id(eot))
    return ids


def _config_eos_ids(model_dir: Path) -> set[int]:
    out: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        try:
            value = json.loads((model_dir / name).read_text(encoding="utf-8")).get("eos_token_id")
        except (OSError, ValueError, AttributeError, RecursionError):
            continue  # an unreadable side file only means fewer stop ids
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, int) and not isinstance(v, bool):
                out.add(v)
    return out


# -- 3. the engine: sizes, memory, weights, kernels (and a draft's, for speculative decoding) ----------------------------------------
def build_engine(
    job: Job,
    sampling: Sampling,
    *,
    device: str = "auto",
    batch_size: int = 32,
    max_length: int | None = None,
    cuda_graphs: str = "auto",
    kernel_pack: str | Path | None = None,
) -> tuple[DecodeEngine, dict[str, Any]]:
    """Check sizes and memory, load the model, prewarm and seal the generation plan (kernel_pack: a
    pack folder its callers checked with check_kernel_pack before reading anything, whose binaries the
    prewarm loads), and build the decode engine (the loaded module is dropped: the engine keeps its
    own weights)."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise UserError(f"--batch-size is {batch_size!r}, expected an integer >= 1")
    max_len = cache_length(job, sampling, max_length)
    dev = resolve_device(device)
    batch = min(batch_size, 1 << max(0, len(job.ids) - 1).bit_length())
    prefill_tokens = 16384
    check_memory(job.spec, dev, batch, max_len, prefill_tokens)
    model = load_model(job.model_dir, dev, torch.bfloat16 if dev.type == "cuda" else torch.float32).eval()
    info = prepare_kernels(model, batch, max(len(r) for r in job.ids), max_len, pack=kernel_pack)
    pad = job.tokenizer.eos_id if job.tokenizer.eos_id is not None else 0
    engine = DecodeEngine(
        model,
        batch_size=batch,
        max_len=max_len,
        sampling=sampling,
        stop_ids=job.stops,
        pad_id=pad,
        cuda_graphs=cuda_graphs,
        prefill_tokens=prefill_tokens,
    )
    del model
    info.update(batch=batch, max_len=max_len)
    return engine, info


def build_speculative(
    job: Job,
    draft_dir: str | Path,
    sampling: Sampling,
    *,
    draft_tokens: int = DEFAULT_DRAFT_TOKENS,
    device: str = "auto",
    batch_size: int = 32,
    max_length: int | None = None,
    cuda_graphs: str = "auto",
    kernel_pack: str | Path | None = None,
) -> tuple[SpeculativeDecoder, dict[str, Any]]:
    """build_engine with a draft: check sizes, the draft and memory (both models, both caches)
    before any weight is read, load both, prewarm and seal, build the SpeculativeDecoder."""
    k = check_draft_tokens(draft_tokens)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise UserError(f"--batch-size is {batch_size!r}, expected an integer >= 1")
    draft_spec = check_draft(job, draft_dir)
    max_len = cache_length(job, sampling, max_length)
    dev = resolve_device(device)
    batch = min(batch_size, 1 << max(0, len(job.ids) - 1).bit_length())
    prefill_tokens = 16384
    if dev.type == "cuda":
        need = sum(
            generation_bytes(s, batch, max_len + k + 1, prefill_tokens) for s in (job.spec, draft_spec)
        )
        free, _total = torch.cuda.mem_get_info(dev)
        if need > free:
            raise UserError(
                f"speculative generation needs about {need / 2**30:.1f} GiB on {dev} (both models and their "
                f"KV caches) but {free / 2**30:.1f} GiB are free: lower --batch-size or --max-length"
            )
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    target = load_model(job.model_dir, dev, dtype).eval()
    draft = load_model(Path(draft_dir), dev, dtype).eval()
    longest = max(len(r) for r in job.ids)
    info = prepare_speculative_kernels(target, draft, batch, longest, max_len + k + 1, k, pack=kernel_pack)
    dec = SpeculativeDecoder(
        target,
        draft,
        draft_tokens=k,
        batch_size=batch,
        max_len=max_len,
        sampling=sampling,
        stop_ids=job.stops,
        pad_id=job.tokenizer.eos_id if job.tokenizer.eos_id is not None else 0,
        cuda_graphs=cuda_graphs,
        prefill_tokens=prefill_tokens,
    )
    del target, draft  # the decoder keeps its own copies of the weights
    info.update(batch=batch, max_len=max_len, draft_tokens=k)
    return dec, info


def check_draft(job: Job, draft_dir: str | Path) -> ModelSpec:
    """The draft's spec, after refusing in one line a draft that is not a model directory, does not
    share the target's tokenizer, or has fewer embedding rows than the tokenizer has tokens."""
    draft_dir = Path(draft_dir)
    if not draft_dir.is_dir():
        raise UserError(
            f"--draft '{draft_dir}' is not a model directory (config.json, weights, tokenizer.json)"
        )
    spec = load_spec(draft_dir)
    check_same_tokenizer(job.model_dir, draft_dir)
    if spec.vocab_size < job.tokenizer.vocab_size:
        raise UserError(
            f"{draft_dir / 'config.json'}: vocab_size {spec.vocab_size} is smaller than the tokenizer's "
            f"vocabulary ({job.tokenizer.vocab_size})"
        )
    return spec


def cache_length(job: Job, sampling: Sampling, max_length: int | None) -> int:
    """Cache slots per row: --max-length, else the longest prompt + --max-new-tokens, within the
    model's context. Every size is checked here, before anything is allocated."""
    ctx = job.context
    longest = max(len(r) for r in job.ids)
    if sampling.max_new_tokens >= ctx:
        raise UserError(
            f"--max-new-tokens is {sampling.max_new_tokens}, expected fewer than the model's context of "
            f"{ctx} tokens (max_position_embeddings in {job.model_dir / 'config.json'})"
        )
    if max_length is not None:
        if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 2:
            raise UserError(f"--max-length is {max_length!r}, expected an integer >= 2 (prompt + new tokens)")
        if max_length > ctx:
            raise UserError(
                f"--max-length is {max_length}, expected at most the model's context of {ctx} tokens"
            )
        limit = max_length
    else:
        limit = min(ctx, longest + sampling.max_new_tokens)
    for i, r in enumerate(job.ids):
        if len(r) >= limit:
            where = "--max-length" if max_length is not None else "the model's context"
            raise UserError(
                f"prompt {i + 1} has {len(r)} tokens, expected fewer than {limit} ({where}) to leave room for an answer"
            )
    return limit


def check_memory(
    spec: ModelSpec, device: torch.device, batch: int, max_len: int, prefill_tokens: int
) -> None:
    """Refuse in one line, before any weight is loaded, a generation that does not fit the GPU's free
    memory."""
    if device.type != "cuda":
        return
    need = generation_bytes(spec, batch, max_len, prefill_tokens)
    free, _total = torch.cuda.mem_get_info(device)
    if need > free:
        gib = 2**30
        raise UserError(
            f"generation needs about {need / gib:.1f} GiB on {device} (KV cache for --batch-size {batch} x "
            f"--max-length {max_len}, weights, logits) but {free / gib:.1f} GiB are free: lower --batch-size "
            "or --max-length"
        )


def generation_bytes(
    spec: ModelSpec, batch: int, max_len: int, prefill_tokens: int, dtype_bytes: int = 2
) -> int:
    """Device memory of generating (an upper estimate): the weights twice (the loaded model and the
    engine's stacked copy while it is built), the KV cache of batch x max_len slots, the sampler's
    fp32 logits (a few copies of batch x vocab) and a prefill's activations."""
    weights = spec.param_counts()["total"] * dtype_bytes
    kv = 2 * spec.num_layers * batch * spec.num_kv_heads * max_len * spec.head_dim * dtype_bytes
    logits = 4 * batch * spec.vocab_size * 4
    width = spec.q_size + 2 * spec.kv_size + 2 * spec.intermediate_size + 4 * spec.hidden_size
    prefill = prefill_tokens * width * dtype_bytes
    return 2 * weights + kv + logits + prefill


def prepare_kernels(
    model: Decoder, batch: int, prompt_len: int, max_len: int, *, pack: str | Path | None = None
) -> dict[str, Any]:
    """Configure the dispatcher; on a GPU in triton mode prewarm the decode engine's plan (prefill and
    one-token step in bf16: kernels.plan.generation_kernels) and seal. pack: a kernel pack folder
    (--kernel-pack, checked by check_kernel_pack) whose binaries the prewarm loads instead of compiling
    (keys it lacks are compiled, or refused under strict kernels)."""
    device = model.lm_head_weight.device
    rt = configure(kernels="auto", device=device)
    info: dict[str, Any] = {"mode": rt.mode, "arch": rt.arch}
    if rt.mode == "triton":  # kernels=auto: Triton only for a CUDA device
        dtype = "bf16"
        plan = generation_kernels(
            model.spec, rt.arch, dtype, batch=batch, prompt_len=prompt_len, max_len=max_len
        )
        report = prewarm(plan, device, pack=pack or None, arch=rt.arch)
        unseal()
        seal(strict=rt.strict)
        info.update(planned=len(plan), prewarm=report.line())
    return info


# -- 4. the answers -------------------------------------------------------------------------
def run_job(
    job: Job,
    engine: DecodeEngine,
    work: list[tuple[int, int]],
    *,
    on_row: Callable[[dict[str, Any]], None] | None = None,
    on_text: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """Answer (prompt index, sample) pairs with the engine; rows in the order of `work`."""
    rows: list[dict[str, Any] | None] = [None] * len(work)

    def finished(k: int, new: list[int]) -> None:
        rows[k] = answer_row(job, work[k][0], work[k][1], new)
        if on_row is not None:
            on_row(rows[k])

    on_tokens = None
    if on_text is not None and len(work) == 1:
        shown = [""]

        def on_tokens(_k: int, ids: list[int]) -> None:
            body = [t for t in ids if t not in job.stops]
            text = job.tokenizer.decode(body)
            if not text.endswith("\ufffd") and len(text) > len(shown[0]):  # a UTF-8 sequence waits whole
                on_text(text[len(shown[0]) :])
                shown[0] = text

    engine.generate([job.ids[i] for i, _ in work], on_finish=finished, on_tokens=on_tokens)
    return [r for r in rows if r is not None]


def answer_row(job: Job, index: int, sample: int, new: list[int]) -> dict[str, Any]:
    """One answer as a record: the new text (stop token left out), its ids and why it ended; with the
    conversation and the answer appended as an assistant turn (chat and --messages: the format a run
    trains on) or the prompt and its completion (plain prompts)."""
    stopped = bool(new) and new[-1] in job.stops
    text = job.tokenizer.decode(new[:-1] if stopped else new)
    row: dict[str, Any] = {"index": index, "sample": sample, "text": text, "token_ids": new}
    row["finish_reason"] = "stop" if stopped else "length"
    conv = job.convs[index]
    if conv is not None:
        row["messages"] = [*conv, {"role": "assistant", "content": text}]
        if job.tools and job.tools[index] is not None:
            row["tools"] = job.tools[index]
    else:
        row["prompt"], row["completion"] = job.texts[index], text
    return row
