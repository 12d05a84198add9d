"""Packing conversations without cross-talk: positions restart per conversation, labels never cross a
boundary, the document mask makes packed attention equal to each conversation run alone, truncation
is counted (or an error), and the preview shows what is learned."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from kdistill.data.chat import TokenizedConversation, conversation_from_record, tokenize_conversation
from kdistill.data.chat_pack import (
    TRAIN_CLOSE,
    TRAIN_OPEN,
    document_attention_mask,
    pack_conversations,
    preview_json,
    render_preview,
)
from kdistill.data.chat_template import load_chat_template
from kdistill.errors import UserError
from kdistill.models.tokenizer import load_tokenizer
from tests.chat_tiny import make_chat_model_dir

IGNORE = -100


def _conv(n: int, learn_from: int, source: str, base: int = 10) -> TokenizedConversation:
    """n tokens (ids base, base+1, ...), learned from token `learn_from` on."""
    trained = np.zeros(n, dtype=bool)
    trained[learn_from:] = True
    ids = np.arange(base, base + n, dtype=np.int64)
    return TokenizedConversation(ids, trained, "", [], source)


def test_rows_positions_labels_and_boundaries():
    convs = [_conv(5, 3, "a:1", 10), _conv(4, 2, "a:2", 20), _conv(6, 1, "a:3", 30)]
    rows = pack_conversations(convs, seq_len=10, pad_id=0, ignore_index=IGNORE)
    # best fit: a:1 (5) opens row 0, a:2 (4) fits row 0 (room 5), a:3 (6) opens row 1
    assert rows.sources == [["a:1", "a:2"], ["a:3"]]
    assert rows.input_ids[0].tolist() == [10, 11, 12, 13, 14, 20, 21, 22, 23, 0]
    assert rows.position_ids[0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 0]
    assert rows.doc_ids[0].tolist() == [0, 0, 0, 0, 0, 1, 1, 1, 1, -1]
    # labels[i] = input_ids[i+1] where that token is learned; never across a boundary or into padding
    assert rows.labels[0].tolist() == [IGNORE, IGNORE, 13, 14, IGNORE, IGNORE, 22, 23, IGNORE, IGNORE]
    assert rows.cu_seqlens(0).tolist() == [0, 5, 9, 10]
    assert rows.cu_seqlens(1).tolist() == [0, 6, 10]
    assert rows.position_ids[1].tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2, 3]
    assert rows.real_tokens == 15 and rows.efficiency == pytest.approx(15 / 20)
    assert "packing efficiency 75.0%" in rows.summary()


def test_best_fit_fills_rows():
    rng = np.random.default_rng(0)
    convs = [_conv(int(n), 1, f"f:{i}") for i, n in enumerate(rng.integers(20, 400, size=300))]
    rows = pack_conversations(convs, seq_len=1024)
    assert rows.conversations == 300 and rows.real_tokens == sum(len(c) for c in convs)
    assert rows.efficiency > 0.95
    for r in range(len(rows)):  # every conversation whole, in one row
        cu = rows.cu_seqlens(r)
        assert (np.diff(cu) > 0).all() and cu[-1] == 1024


def test_long_conversation_truncated_or_error():
    # A 1 MB single turn tokenizes far past seq_len: cut to its first seq_len tokens and counted.
    long = _conv(300_000, 2, "big.jsonl:7")
    short = _conv(8, 2, "big.jsonl:8", 5)
    rows = pack_conversations([long, short], seq_len=64)
    assert rows.truncated == 1 and len(rows) == 2 and rows.real_tokens == 72
    assert rows.labels[0, -1] == IGNORE  # its cut-off target is not learned
    assert "1 truncated to seq_len" in rows.summary()
    with pytest.raises(
        UserError, match=r"big.jsonl:7: conversation is 300000 tokens, longer than seq_len 64"
    ) as e:
        pack_conversations([long], seq_len=64, truncate=False)
    assert "\n" not in str(e.value)
    # cut before any answer: nothing to learn is left, dropped and counted
    late = _conv(100, 90, "late:1")
    rows = pack_conversations([late, short], seq_len=64)
    assert rows.dropped == 1 and rows.truncated == 1 and rows.sources == [["big.jsonl:8"]]
    with pytest.raises(UserError, match="seq_len is 1, expected at least 2"):
        pack_conversations([short], seq_len=1)


def _attention(x: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """A rotary single-head attention over (T, D) features: depends on positions and on the mask."""
    T, D = x.shape
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    ang = pos[:, None].double() * inv[None, :]  # (T, D/2)
    cos, sin = ang.cos(), ang.sin()
    x1, x2 = x[:, ::2], x[:, 1::2]
    rx = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).reshape(T, D)
    scores = (rx @ rx.T) / D**0.5
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ x


def test_packed_attention_equals_each_conversation_alone():
    convs = [_conv(7, 2, "a:1", 3), _conv(5, 1, "a:2", 40), _conv(9, 4, "a:3", 80)]
    rows = pack_conversations(convs, seq_len=24)
    assert len(rows) == 1
    emb = torch.randn(128, 16, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    ids = torch.from_numpy(rows.input_ids)
    mask = document_attention_mask(torch.from_numpy(rows.doc_ids))  # (1, T, T)
    packed = _attention(emb[ids[0]], mask[0], torch.from_numpy(rows.position_ids[0]))
    cu = rows.cu_seqlens(0)
    for d, conv in enumerate(convs):
        a, b = int(cu[d]), int(cu[d + 1])
        n = len(conv)
        alone = _attention(
            emb[torch.from_numpy(conv.input_ids)], torch.ones(n, n, dtype=torch.bool).tril(), torch.arange(n)
        )
        assert torch.allclose(packed[a:b], alone, atol=1e-12, rtol=0)
    # and a mask without document boundaries would differ (the test can see cross-talk)
    causal = torch.ones(24, 24, dtype=torch.bool).tril()
    leaky = _attention(emb[ids[0]], causal, torch.from_numpy(rows.position_ids[0]))
    assert not torch.allclose(leaky[7:12], packed[7:12])


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    folder = make_chat_model_dir(tmp_path_factory.mktemp("qwen"), "qwen2.5")
    return load_chat_template(folder), load_tokenizer(folder)


def _tokenized(qwen, n=3):
    template, tok = qwen
    out = []
    for i in range(n):
        rec = {
            "messages": [
                {"role": "user", "content": f"Hi {i}"},
                {"role": "assistant", "content": f"Hello {i}"},
            ]
        }
        out.append(
            tokenize_conversation(
                conversation_from_record(rec, "messages", f"c.jsonl:{i + 1}"), template, tok
            )
        )
    return out


def test_preview_json(qwen):
    tcs = _tokenized(qwen)
    rows = pack_conversations(tcs, seq_len=256, ignore_index=IGNORE)
    out = preview_json(rows, n=5)
    assert len(out) == 1
    row = json.loads(json.dumps(out[0]))  # plain JSON types
    assert set(row) == {
        "row",
        "input_ids",
        "labels",
        "position_ids",
        "cu_seqlens",
        "conversations",
        "learned_tokens",
        "pad_tokens",
    }
    assert len(row["input_ids"]) == len(row["labels"]) == 256
    assert [c["source"] for c in row["conversations"]] == ["c.jsonl:1", "c.jsonl:2", "c.jsonl:3"]
    ends = [c["end"] for c in row["conversations"]]
    assert row["cu_seqlens"] == [0, *ends, 256] and row["pad_tokens"] == 256 - ends[-1]
    for c, tc in zip(row["conversations"], tcs):
        assert row["input_ids"][c["start"] : c["end"]] == tc.input_ids.tolist()
        assert row["labels"][c["start"] : c["end"]] == tc.labels(IGNORE).tolist()
    assert row["learned_tokens"] == sum(int(tc.trained.sum()) for tc in tcs)


def test_render_preview_markers_and_colour(qwen):
    _, tok = qwen
    rows = pack_conversations(_tokenized(qwen, 2), seq_len=256)
    plain = render_preview(rows, 0, tok.decode, color=False)
    lines = plain.splitlines()
    assert lines[0].startswith("--- row 0, conversation 1: c.jsonl:1 (tokens 0..")
    assert (
        f"{TRAIN_OPEN}Hello 0<|im_end|>{TRAIN_CLOSE}" in plain
        and f"{TRAIN_OPEN}Hello 1<|im_end|>{TRAIN_CLOSE}" in plain
    )
    assert plain.count(TRAIN_OPEN) == 2 and "\x1b[" not in plain and "padding tokens ---" in lines[-1]
    coloured = render_preview(rows, 0, tok.decode, color=True)
    assert "\x1b[32mHello 0<|im_end|>\x1b[0m" in coloured and TRAIN_OPEN not in coloured
