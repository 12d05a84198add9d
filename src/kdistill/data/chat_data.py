"""Conversation data for a run: detected by file, rendered, masked, split by conversation and packed.

    if is_conversation_data(cfg.data.train):                          # every file holds conversations
        data = prepare_chat_data(cfg.data, tokenizer, template, seed=0)   # PreparedData of PackedRows
    data.train.batch(np.array([0, 1]))   # (input_ids, labels, position_ids, doc_ids), (B, seq_len) each

Each file of data.train (and data.heldout) is read as conversations (kdistill.data.chat), rendered
with `template` and data.template_kwargs and tokenized with its answers marked (data.train_on; a
warning once per file whose reasoning or tool fields the template does not render), then packed whole into
seq_len-token rows (kdistill.data.chat_pack): labels are already the shifted targets, with the ignore
index on masked tokens, so a row is seq_len tokens, not seq_len + 1 as raw text windows are.

Held-out split as for raw text: a conversation is held out when split_score(key, seed) is below
data.heldout_fraction, key = its path relative to the directory or glob it came from (the file name
when given directly) + ":LINE" (":row N" for Parquet); or data.heldout paths give the held-out side.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kdistill.data.chat import (
    Conversation,
    TokenizedConversation,
    read_conversations,
    sniff_format,
    tokenize_conversation,
    warn_unrendered,
)
from kdistill.data.chat_pack import PackedRows, pack_conversations
from kdistill.data.chat_template import ChatTemplate
from kdistill.data.packing import PreparedData, split_score
from kdistill.data.sources import FileSpec, expand_paths
from kdistill.errors import UserError

log = logging.getLogger("kdistill.data")


def is_conversation_data(paths: Sequence[str | Path], field: str = "data.train") -> bool:
    """True when every file of `paths` holds conversations, False when none does.

    Raises:
        UserError: a missing path (see expand_paths), or conversations mixed with other files.
    """
    if not paths:
        return False
    specs = expand_paths(paths, field)
    chat = [s for s in specs if sniff_format(s.path) is not None]
    if not chat:
        return False
    if len(chat) != len(specs):
        other = next(s for s in specs if sniff_format(s.path) is None)
        raise UserError(
            f"{field}: {other.path} is not a conversation file but {chat[0].path} is: a run reads "
            "either conversations or raw text, expected every file to be the same kind"
        )
    return True


def _read(specs: list[FileSpec]) -> list[tuple[str, Conversation]]:
    """(split key, conversation) for every conversation of the files, in order."""
    out = []
    for spec in specs:
        name = str(spec.path)
        for conv in read_conversations(spec.path):
            where = conv.source[len(name) + 1 :] if conv.source.startswith(name + ":") else conv.source
            out.append((f"{spec.key}:{where}", conv))
    return out


def _tokenize(
    convs: list[Conversation],
    template: ChatTemplate,
    tokenizer: Any,
    train_on: str,
    max_tokens: int = 0,
    template_kwargs: Mapping[str, Any] | None = None,
    prompts: list[int] | None = None,
) -> list[TokenizedConversation]:
    """Tokenize `convs` (up to max_tokens tokens); `prompts`, when given, receives each one's prompt
    length (prompt_tokens)."""
    out: list[TokenizedConversation] = []
    total = 0
    for conv in convs:
        if max_tokens and total >= max_tokens:
            break
        tc = tokenize_conversation(conv, template, tokenizer, train_on, template_kwargs)
        out.append(tc)
        total += len(tc)
        if prompts is not None:
            prompts.append(prompt_tokens(conv, tc, template, tokenizer, template_kwargs))
    for line in warn_unrendered(out, template):  # once per file: nothing dropped silently
        log.warning("%s", line)
    return out


def prompt_tokens(
    conv: Conversation,
    tc: TokenizedConversation,
    template: ChatTemplate,
    tokenizer: Any,
    template_kwargs: Mapping[str, Any] | None = None,
) -> int:
    """Tokens of the conversation's prompt in `tc` (however it was marked): everything before its first
    answer, the answer's generation prompt included, where train_on=assistant puts the answer (render
    diffs); where the template renders no answer that can be located, the first half of its tokens."""
    try:
        marked = tokenize_conversation(conv, template, tokenizer, "assistant", template_kwargs)
    except UserError:
        marked = None
    if marked is not None and np.array_equal(marked.input_ids, tc.input_ids) and marked.trained.any():
        return max(1, int(np.argmax(marked.trained)))
    return max(1, len(tc) // 2)


def prepare_chat_data(
    cfg: Any,
    tokenizer: Any,
    template: ChatTemplate,
    *,
    seed: int = 0,
    require_heldout: bool = True,
    prompts: bool = False,
    pack_train: Callable[[list[Conversation]], PackedRows] | None = None,
) -> PreparedData:
    """Read, render, mask, split and pack the conversations of `cfg` (a DataConfig). prompts: mark
    where each training conversation's prompt ends (PackedRows.prompt_ends) for on-policy steps, which
    train_on=all needs (the held-out side's are marked for the run's samples).

    `pack_train`: packs the training conversations in place of rendering them with `template` alone
    (kd.cross_tokenizer: both models' renderings, aligned; kdistill.data.cross_chat).

    Returns PreparedData whose .train and .heldout are PackedRows; stats add packing_efficiency
    (real tokens / slots of the training rows), conversations, truncated and dropped counts.

    Raises:
        UserError: a malformed conversation file (see kdistill.data.chat), a template that cannot
            mark the answers, no training rows, or an empty held-out side when required.
    """
    seq_len = int(cfg.seq_len)
    frac = float(cfg.heldout_fraction)
    pad = tokenizer.eos_id if tokenizer.eos_id is not None else 0
    train_pairs = _read(expand_paths(cfg.train, "data.train"))
    if cfg.heldout:
        train_convs = [c for _, c in train_pairs]
        held_convs = [c for _, c in _read(expand_paths(cfg.heldout, "data.heldout"))]
        split, need_held = "paths", require_heldout
    else:
        scores = np.array([split_score(k, seed) for k, _ in train_pairs])
        held = scores < frac
        if frac > 0 and not held.any() and len(scores) >= 2:
            held[int(np.argmin(scores))] = True  # few conversations: hold out the lowest score
        train_convs = [c for (_, c), h in zip(train_pairs, held) if not h]
        held_convs = [c for (_, c), h in zip(train_pairs, held) if h]
        split, need_held = "hash", require_heldout and frac > 0
    ignore = -100
    kwargs = dict(getattr(cfg, "template_kwargs", None) or {})
    # train_on=all learns every token, so the labels do not show where a prompt ends: the prompts of
    # on-policy steps (train side, when asked for) and of the run's samples (held-out side) are marked
    every = cfg.train_on == "all"
    train_prompts: list[int] | None = [] if every and prompts else None
    held_prompts: list[int] | None = [] if every else None
    max_tokens = int(cfg.max_tokens or 0)
    if pack_train is not None:  # across tokenizers (train_on=all is refused there)
        train = pack_train(train_convs)
    else:
        train_tok = _tokenize(
            train_convs, template, tokenizer, cfg.train_on, max_tokens, kwargs, train_prompts
        )
        train = pack_conversations(
            train_tok, seq_len, pad_id=pad, ignore_index=ignore, prompt_lens=train_prompts
        )
    held_tok = _tokenize(held_convs, template, tokenizer, cfg.train_on, 0, kwargs, held_prompts)
    heldout = pack_conversations(held_tok, seq_len, pad_id=pad, ignore_index=ignore, prompt_lens=held_prompts)
    if len(train) == 0:
        raise UserError(
            f"data.train: no training rows from {len(train_convs)} conversations (none has an answer "
            "to learn; check data.train_on and the files' assistant turns)"
        )
    if need_held and len(heldout) == 0:
        raise UserError(
            f"data: the held-out side has no conversation with an answer to learn ({len(held_convs)} "
            "held out; add conversations, raise data.heldout_fraction, or give data.heldout paths)"
        )
    stats = _stats(train, heldout, seq_len, split, template, cfg.train_on)
    stats["eos_id"] = tokenizer.eos_id
    return PreparedData(train, heldout, stats)


def _stats(
    train: PackedRows, heldout: PackedRows, seq_len: int, split: str, template: ChatTemplate, train_on: str
) -> dict[str, Any]:
    return {
        "format": "conversations",
        "seq_len": seq_len,
        "split": split,
        "chat_template": template.origin,
        "train_on": train_on,
        "train_tokens": int(train.real_tokens),
        "heldout_tokens": int(heldout.real_tokens),
        "train_sequences": len(train),
        "heldout_sequences": len(heldout),
        "train_documents": train.conversations,
        "heldout_documents": heldout.conversations,
        "train_learned_tokens": train.learned_tokens(),
        "packing_efficiency": train.efficiency,
        "heldout_packing_efficiency": heldout.efficiency,
        "truncated": train.truncated + heldout.truncated,
        "dropped": train.dropped + heldout.dropped,
        "cache_hits": 0,
        "cache_misses": 0,
    }
