"""Sampling from our decoder with a KV cache: `kdistill generate` and the run's eval samples.

    model = load_model("out/student")                       # Decoder (kdistill.models.hf_io)
    new = generate_ids(model, [[1, 2, 3], [4, 5]], Sampling(max_new_tokens=32), stop_ids={0})
    rows = generate_texts("out/student", prompts=["Hello"], chat=True)   # [{"text", "token_ids"}]
    prompts = sample_prompts(heldout, 4)     # a run's fixed held-out prompts (conversations or raw text)

Batching: prompts of different lengths are left-padded to the longest; padding slots are excluded from
attention by the KV cache's mask and each row's positions start at 0 on its first real token (as
transformers' `generate` does with an attention mask), so a row's tokens do not depend on its batch.
The prompt is run once (prefill), then one token per step through the same dispatch ops as training
(rmsnorm, rope, attention over the cache, swiglu): the Triton kernels on a GPU.

Sampling: temperature 0 is greedy (argmax); otherwise logits / temperature, then top-k, then top-p
(the smallest set of tokens whose probability reaches p), sampled with a torch.Generator seeded by
`seed`, so a seed reproduces its tokens on the same device. A row stops at its first stop token (EOS,
the config's eos ids, the chat template's end-of-turn token), which is the last of its `token_ids`;
its `text` leaves the stop token out.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kdistill.data.chat import Conversation, check_unicode, conversation_from_record, end_of_turn_token
from kdistill.data.chat_pack import PackedRows
from kdistill.data.chat_template import CHAT_TEMPLATE_OVERRIDE, ChatTemplate, load_chat_template
from kdistill.dtypes import dtype_name
from kdistill.errors import UserError
from kdistill.kernels.plan import generation_kernels
from kdistill.kernels.seal import configure, prewarm, seal, unseal
from kdistill.models.decoder import Decoder, KVCache
from kdistill.models.hf_io import load_model
from kdistill.models.tokenizer import Tokenizer, load_tokenizer

ROLES = ("system", "user", "assistant")


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How tokens are chosen. temperature 0: greedy; top_k 0: off; top_p 1: off."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int):
            raise UserError(f"--max-new-tokens is {self.max_new_tokens!r}, expected an integer >= 1")
        if self.max_new_tokens < 1:
            raise UserError(f"--max-new-tokens is {self.max_new_tokens}, expected an integer >= 1")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise UserError(f"--temperature is {self.temperature}, expected a number >= 0 (0: greedy)")
        if self.top_k < 0:
            raise UserError(f"--top-k is {self.top_k}, expected an integer >= 0 (0: off)")
        if not (0 < self.top_p <= 1):
            raise UserError(f"--top-p is {self.top_p}, expected a number in (0, 1] (1: off)")


def _pick(logits: torch.Tensor, s: Sampling, gen: torch.Generator | None) -> torch.Tensor:
    """Next token per row from fp32 logits (B, V) -> (B,)."""
    if s.temperature == 0:
        return logits.argmax(-1)
    logits = logits / s.temperature
    if s.top_k:
        kth = torch.topk(logits, min(s.top_k, logits.shape[-1])).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if s.top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs >= s.top_p  # tokens after the first ones that reach p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
    return torch.multinomial(logits.softmax(-1), 1, generator=gen).squeeze(1)


def left_pad(
    prompts: Sequence[Sequence[int]], pad_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, positions, valid), each (B, P): prompts right-aligned, padding positions 0 and invalid."""
    p = max(len(x) for x in prompts)
    ids = torch.full((len(prompts), p), pad_id, dtype=torch.long)
    valid = torch.zeros((len(prompts), p), dtype=torch.bool)
    for i, row in enumerate(prompts):
        if row:
            ids[i, p - len(row) :] = torch.tensor(list(row), dtype=torch.long)
            valid[i, p - len(row) :] = True
    pos = (valid.long().cumsum(1) - 1).clamp(min=0)
    return ids.to(device), pos.to(device), valid.to(device)


@torch.no_grad()
def generate_ids(
    model: Decoder,
    prompts: Sequence[Sequence[int]],
    sampling: Sampling = Sampling(),
    stop_ids: Sequence[int] | set[int] = (),
    *,
    pad_id: int = 0,
    on_step: Callable[[list[int], list[bool]], None] | None = None,
) -> list[list[int]]:
    """New token ids per prompt (a row's stop token included, as its last id).

    prompts: token ids per row (each non-empty). on_step(tokens, done): after each step, that step's
    token per row and whether the row has stopped (a stopped row's later tokens are not its own)."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate_ids needs at least one prompt, each with at least one token")
    device = model.lm_head_weight.device
    ids, pos, valid = left_pad(prompts, pad_id, device)
    b, p = ids.shape
    n = sampling.max_new_tokens
    cache = KVCache.empty(model.spec, batch=b, max_len=p + n, device=device, dtype=model.lm_head_weight.dtype)
    gen = None
    if sampling.temperature > 0:
        gen = torch.Generator(device=device).manual_seed(int(sampling.seed))
    stops = torch.tensor(sorted(set(stop_ids)) or [-1], dtype=torch.long, device=device)
    w = model.lm_head_weight  # (V, H)
    h = model.forward_cached(ids, pos, valid, cache)[:, -1]  # (B, H)
    next_pos = pos[:, -1:] + 1  # (B, 1)
    out: list[list[int]] = [[] for _ in range(b)]
    done = torch.zeros(b, dtype=torch.bool, device=device)
    ones = torch.ones((b, 1), dtype=torch.bool, device=device)
    for step in range(n):
        tok = _pick((h @ w.t()).float(), sampling, gen)  # (B,)
        tok = torch.where(done, torch.full_like(tok, pad_id), tok)
        was_done = done.tolist()
        done = done | torch.isin(tok, stops)
        toks, flags = tok.tolist(), done.tolist()
        for i in range(b):
            if not was_done[i]:
                out[i].append(toks[i])
        if on_step is not None:
            on_step(toks, flags)
        if all(flags) or step == n - 1:
            break
        h = model.forward_cached(tok[:, None], next_pos, ones, cache)[:, -1]
        next_pos = next_pos + 1
    return out


# -- model directories, prompts and conversations ---------------------------------------------------
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
            Conversation(
                messages=conv.messages[:-1], train=(False,) * len(msgs), source=where, tools=conv.tools
            )
        )
    if not out:
        raise UserError(f"{path}: no conversations (expected one JSON list of messages per line)")
    return out


def _template(model_dir: Path, needed: bool) -> ChatTemplate | None:
    """The chat template: `--chat-template PATH` when given (kdistill.data.chat_template.
    using_chat_template), else the model's; None when it has none and none is needed (plain prompts)."""
    override = CHAT_TEMPLATE_OVERRIDE.get()
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


def prepare_kernels(model: Decoder, batch: int, prompt_len: int, max_len: int) -> dict[str, Any]:
    """Configure the dispatcher; on a GPU in triton mode prewarm the generation plan (the prefill at
    the prompt length, decoding at one token: kernels.plan.generation_kernels) and seal."""
    device = model.lm_head_weight.device
    rt = configure(kernels="auto", device=device)
    info: dict[str, Any] = {"mode": rt.mode, "arch": rt.arch}
    if rt.mode == "triton" and device.type == "cuda":
        dtype = dtype_name(model.lm_head_weight.dtype)
        plan = generation_kernels(
            model.spec, rt.arch, dtype, batch=batch, prompt_len=prompt_len, max_len=max_len
        )
        report = prewarm(plan, device)
        unseal()
        seal(strict=rt.strict)
        info.update(planned=len(plan), prewarm=report.line())
    return info


def resolve_device(name: str) -> torch.device:
    """--device: auto (cuda when available), cpu, cuda or cuda:N."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not (name in ("cpu", "cuda") or name.startswith("cuda:")):
        raise UserError(f"--device is '{name}', expected auto, cpu, cuda or cuda:N")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device is '{name}' but no CUDA GPU is available (use --device cpu)")
    return torch.device(name)


def generate_texts(
    model_dir: str | Path,
    *,
    prompts: Sequence[str] = (),
    messages_file: str | Path | None = None,
    chat: bool = False,
    sampling: Sampling = Sampling(),
    device: str = "auto",
    on_text: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """Load a model directory and answer every prompt (and conversation of messages_file) in one batch:
    [{"text": new text without the stop token, "token_ids": new ids}] per prompt. on_text: the new
    text of a single prompt as it grows (streaming), piece by piece."""
    model_dir = Path(model_dir)
    if not prompts and messages_file is None:
        raise UserError("expected --prompt TEXT or --messages FILE")
    convs = read_messages_file(messages_file) if messages_file is not None else []
    tokenizer = load_tokenizer(model_dir)
    template = _template(model_dir, needed=chat or bool(convs))
    ids = encode_prompts(tokenizer, template, prompts=prompts, conversations=convs, chat=chat)
    dev = resolve_device(device)
    model = load_model(model_dir, dev, torch.bfloat16 if dev.type == "cuda" else torch.float32).eval()
    stops = stop_token_ids(model_dir, tokenizer, template)
    p = max(len(x) for x in ids)
    prepare_kernels(model, len(ids), p, p + sampling.max_new_tokens)
    pad = tokenizer.eos_id if tokenizer.eos_id is not None else 0
    on_step = None
    if on_text is not None and len(ids) == 1:
        seen: list[int] = []
        shown = [""]

        def on_step(toks: list[int], done: list[bool]) -> None:
            if toks[0] in stops:
                return
            seen.append(toks[0])
            text = tokenizer.decode(seen)
            if not text.endswith("\ufffd"):  # an incomplete UTF-8 sequence waits for its next byte
                on_text(text[len(shown[0]) :])
                shown[0] = text

    new = generate_ids(model, ids, sampling, stops, pad_id=pad, on_step=on_step)
    out = []
    for row in new:
        body = row[:-1] if row and row[-1] in stops else row
        out.append({"text": tokenizer.decode(body), "token_ids": row})
    return out


# -- the run's samples --------------------------------------------------------------------------
RAW_PROMPT_TOKENS = 16  # raw-text held-out rows: the first tokens (at most half the row) are the prompt


def sample_prompts(heldout: Any, n: int) -> list[list[int]]:
    """The first n fixed prompts of a held-out set: for packed conversations, each conversation up to
    its first learned token (the template's header of the first answer included); for raw windows
    (N, T + 1), the first min(16, T // 2) tokens of the first n rows."""
    out: list[list[int]] = []
    if isinstance(heldout, PackedRows):
        for r in range(len(heldout)):
            doc, labels, ids = heldout.doc_ids[r], heldout.labels[r], heldout.input_ids[r]
            for d in range(int(doc.max()) + 1 if (doc >= 0).any() else 0):
                where = np.flatnonzero(doc == d)
                learned = where[labels[where] != heldout.ignore_index]
                if len(learned) and len(out) < n:
                    out.append([int(t) for t in ids[where[0] : learned[0] + 1]])
        return out
    rows = np.asarray(heldout)
    k = max(1, min(RAW_PROMPT_TOKENS, (rows.shape[1] - 1) // 2)) if rows.ndim == 2 else 0
    return [[int(t) for t in rows[i, :k]] for i in range(min(n, len(rows)))]


def answer_rows(
    model: Decoder, prompts: list[list[int]], tokens: int, stops: set[int], decode: Callable[[list[int]], str]
) -> list[dict[str, Any]]:
    """Greedy answers, as {"prompt", "answer", "answer_ids"} rows (the stop token left out of the text)."""
    new = generate_ids(model, prompts, Sampling(max_new_tokens=tokens), stops, pad_id=min(stops, default=0))
    out = []
    for p, row in zip(prompts, new):
        body = row[:-1] if row and row[-1] in stops else row
        out.append({"prompt": decode(p), "answer": decode(body), "answer_ids": row})
    return out
