"""Conversations across tokenizers (kd.cross_tokenizer): each model renders a conversation with its own
chat template, and the learned messages' text aligns the two renderings.

    ac = align_conversation(conv, s_template, s_tok, t_template, t_tok, vmap=vmap)   # AlignedConversation
    ac.student.input_ids, ac.teacher_ids        # the two tokenizations of the conversation
    ac.pairs[i], ac.exact[i]                    # teacher position graded against student position i, and
                                                # whether their text maps one to one (the exact term)
    rows = pack_aligned(convs, ...)             # AlignedRows: the student's PackedRows + the teacher's side
    prompts, where = cross_prompt_pool(rows)    # on-policy: the student's prompts and their conversations
    side = CompletionSide(where, stops, ...)    # the teacher's side of the student's completions

The learned spans are the same messages in both renderings, each found by that template's own render
diffs (kdistill.data.chat.locate_answers), never by searching the text. Within an answer the two
renderings are put side by side by the answer's text: the text between the end of the generation
prompt and the end of the answer's body (`start`..`body_end`) of one rendering is matched character by
character with the other's (the identity when the templates write the answer alike; otherwise the
longest matching blocks, and offsets between blocks spread evenly over the other side's gap); the
end-of-turn after it maps onto the other's end-of-turn. Student position i, whose token ends at
character e of the student's rendering and predicts a learned token of answer k, is paired with the
teacher token that ends at the mapped offset of e in the teacher's rendering of answer k (or the nearest
one, ties to the earlier: kdistill.data.align.align_ends). So the position before an answer's first
token is paired with the teacher's position before it (both end their generation prompts), and the
position of the answer's last character with the teacher's, before each writes its end-of-turn.

Packing: a conversation takes the room of the longer of its two tokenizations, so the teacher's side of
a row is never longer than data.seq_len either (the memory plan counts it so). A conversation longer
than a row is cut: the student's side to seq_len tokens, and a learned position whose teacher partner
falls beyond seq_len is no longer learned; what the teacher needs is its tokens up to the last partner.

On-policy (CompletionSide): a completion's text (decoded by the student's tokenizer) becomes the answer
of its prompt's conversation, rendered by the teacher's template, and is aligned the same way.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from kdistill.data.align import align_ends, exact_positions, token_ends
from kdistill.data.chat import (
    Answer,
    Conversation,
    TokenizedConversation,
    check_unicode,
    locate_answers,
    special_token_strings,
    tokenize_conversation,
    warn_unrendered,
)
from kdistill.data.chat_pack import PackedRows, pack_conversations
from kdistill.data.chat_template import ChatTemplate
from kdistill.errors import UserError

log = logging.getLogger("kdistill.data")

# the rows of AlignedRows.teacher: teacher ids, their positions, their documents, the pairs, exact
T_IDS, T_POS, T_DOC, T_PAIR, T_EXACT = range(5)


@dataclasses.dataclass(frozen=True)
class AlignedConversation:
    """One conversation in both tokenizations.

    Attributes:
        student: the student's rendering, tokenized, its answers marked (as a same-tokenizer run has it).
        teacher_ids: (m,) int64 token ids of the teacher's rendering (its own template and tokenizer).
        pairs: (n,) int64, per student position, the teacher position graded against it; -1 where the
            student position has no label.
        exact: (n,) bool, the paired positions whose text maps one to one (the same point of the text
            and the same next token: kdistill.data.align.exact_positions).
        first_answer: the message index of the first learned answer (-1: none).
    """

    student: TokenizedConversation
    teacher_ids: np.ndarray
    pairs: np.ndarray
    exact: np.ndarray
    first_answer: int = -1


def offset_map(a: str, b: str) -> np.ndarray:
    """(len(a) + 1,) int64: for each character offset of `a`, the corresponding offset of `b`.

    Equal strings map to themselves; otherwise inside the longest matching blocks (difflib, no junk
    heuristic) offsets map one to one, and the offsets of a gap between blocks spread evenly over the
    gap of `b` between the same blocks. Monotone, from 0 to len(b)."""
    if a == b:
        return np.arange(len(a) + 1, dtype=np.int64)
    out = np.empty(len(a) + 1, dtype=np.int64)
    pa = pb = 0  # where the previous block ended in a and b
    for i, j, n in difflib.SequenceMatcher(None, a, b, autojunk=False).get_matching_blocks():
        gap = np.arange(pa, i + 1)
        out[pa : i + 1] = pb + ((gap - pa) * (j - pb)) // max(i - pa, 1)
        out[i : i + n + 1] = j + np.arange(n + 1)
        pa, pb = i + n, j + n
    out[-1] = len(b)
    return out


def _offsets(tok: Any, text: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ids, starts, ends) of `text` as the tokenizer encodes it (no special tokens added)."""
    enc = getattr(tok, "_tk", tok).encode(text, add_special_tokens=False)
    offsets = np.asarray(enc.offsets, dtype=np.int64).reshape(-1, 2)
    return np.asarray(enc.ids, dtype=np.int64), offsets[:, 0], offsets[:, 1]


def _to_teacher(e: np.ndarray, sa: Answer, ta: Answer, body: np.ndarray) -> np.ndarray:
    """Offsets `e` of the student's rendering (inside answer sa's reach) as offsets of the teacher's
    (answer ta): before the answer -> its start, in the answer's text -> through `body`, in the
    end-of-turn -> as far into the teacher's end-of-turn, at or past its end -> the teacher's end."""
    inside = body[np.clip(e - sa.start, 0, len(body) - 1)] + ta.start
    tail = np.minimum(ta.body_end + (e - sa.body_end), ta.end)
    return np.where(
        e <= sa.start, ta.start, np.where(e <= sa.body_end, inside, np.where(e >= sa.end, ta.end, tail))
    )


def align_conversation(
    conv: Conversation,
    s_template: ChatTemplate,
    s_tok: Any,
    t_template: ChatTemplate,
    t_tok: Any,
    train_on: str = "assistant",
    template_kwargs: Mapping[str, Any] | None = None,
    vmap: np.ndarray | None = None,
) -> AlignedConversation:
    """Render `conv` with each model's template, tokenize each with its own tokenizer, and pair every
    learned student position with a teacher position (see the module docstring). vmap: student id ->
    teacher id of the same text (kdistill.data.align.vocab_map), for the exact positions (none without).

    Raises:
        UserError: train_on=all (the templates' own text has no counterpart to align), or a template
            that cannot mark the answers (kdistill.data.chat.locate_answers).
    """
    if train_on == "all":
        raise UserError(
            "data.train_on=all cannot be aligned across tokenizers (each template writes its own text "
            "around the messages); use assistant or last_assistant with kd.cross_tokenizer"
        )
    student = tokenize_conversation(conv, s_template, s_tok, train_on, template_kwargs)
    s_text, s_answers = locate_answers(
        conv, s_template, special_token_strings(s_tok), template_kwargs, train_on
    )
    t_text, t_answers = locate_answers(
        conv, t_template, special_token_strings(t_tok), template_kwargs, train_on
    )
    check_unicode(t_text, f"{conv.source}: the teacher's rendered conversation")
    if [a.message for a in s_answers] != [a.message for a in t_answers]:  # both learn by message index
        raise UserError(f"{conv.source}: the two chat templates learn different messages")
    ids, starts, ends = _offsets(s_tok, s_text)
    t_ids, _, t_ends = _offsets(t_tok, t_text)
    n = len(ids)
    pairs = np.full(n, -1, dtype=np.int64)
    exact = np.zeros(n, dtype=bool)
    first = s_answers[0].message if s_answers else -1
    if n < 2 or not len(t_ids):
        return AlignedConversation(student, t_ids, pairs, exact, first)
    target = student.trained[1:]  # position i predicts token i + 1
    for sa, ta in zip(s_answers, t_answers):
        body = offset_map(s_text[sa.start : sa.body_end], t_text[ta.start : ta.body_end])
        # the positions whose next token is learned in this answer: it overlaps the answer's span (the
        # rule tokenize_conversation marks learned tokens by)
        a, b, s1, e1 = sa.start, sa.end, starts[1:], ends[1:]
        mine = np.flatnonzero(target & (((e1 > a) & (s1 < b)) | ((s1 == e1) & (s1 >= a) & (s1 < b))))
        if len(mine):
            points = _to_teacher(ends[mine], sa, ta, body)
            pairs[mine] = align_ends(points.tolist(), t_ends.tolist())
            if vmap is not None:
                nxt = _to_teacher(ends[mine + 1], sa, ta, body)
                exact[mine] = exact_positions(ids[mine + 1], points, nxt, pairs[mine], t_ids, t_ends, vmap)
    assert not (target & (pairs[:-1] < 0)).any(), f"{conv.source}: a learned token outside every answer"
    return AlignedConversation(student, t_ids, pairs, exact, first)


def fit_row(ac: AlignedConversation, seq_len: int) -> tuple[AlignedConversation, bool]:
    """The conversation cut to one row: the student's side to seq_len tokens, learned positions whose
    teacher partner lies beyond seq_len unlearned, the teacher's side to its last partner. Returns
    (the fitted conversation, whether anything was cut)."""
    s = ac.student
    n = min(len(s.input_ids), seq_len)
    pairs = ac.pairs[:n].copy()
    if n:
        pairs[-1] = -1  # the last position's target is cut off (or there is none)
    pairs[pairs >= seq_len] = -1
    trained = s.trained[:n].copy()
    trained[1:] &= pairs[:-1] >= 0
    need = int(pairs.max()) + 1 if len(pairs) else 0
    cut = n < len(s.input_ids) or bool((s.trained[1:n] != trained[1:]).any())
    student = dataclasses.replace(s, input_ids=s.input_ids[:n], trained=trained)
    exact = ac.exact[:n] & (pairs >= 0)  # (the partner's logits do not need its next token in the row)
    fitted = dataclasses.replace(
        ac, student=student, teacher_ids=ac.teacher_ids[:need], pairs=pairs, exact=exact
    )
    return fitted, cut


@dataclasses.dataclass
class AlignedRows(PackedRows):
    """Packed student rows (PackedRows) with the teacher's side of each: teacher (R, 5, seq_len) int64,
    its rows T_IDS (teacher token ids, padding 0), T_POS (positions, restarting per conversation),
    T_DOC (conversation per token, -1 on padding), T_PAIR (per student position, the teacher
    position of the same row graded against it; -1 without a label) and T_EXACT (1 where that pair's
    text maps one to one). `aligned`: the conversations packed (by `members`), in their order."""

    teacher: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros((0, 5, 0), dtype=np.int64))
    teacher_tokens: int = 0  # teacher tokens placed (padding excluded)
    aligned: list[tuple[Conversation, AlignedConversation]] = dataclasses.field(default_factory=list)


def pack_aligned(
    convs: Sequence[Conversation],
    s_template: ChatTemplate,
    s_tok: Any,
    t_template: ChatTemplate,
    t_tok: Any,
    seq_len: int,
    *,
    pad_id: int = 0,
    ignore_index: int = -100,
    train_on: str = "assistant",
    template_kwargs: Mapping[str, Any] | None = None,
    max_tokens: int = 0,
    vmap: np.ndarray | None = None,
) -> AlignedRows:
    """Align every conversation (align_conversation), fit each to a row (fit_row) and pack them by the
    longer of their two tokenizations; the teacher's side of each row is laid out like the student's."""
    fitted: list[AlignedConversation] = []
    used: list[Conversation] = []
    total = truncated = 0
    for conv in convs:
        if max_tokens and total >= max_tokens:
            break
        ac = align_conversation(conv, s_template, s_tok, t_template, t_tok, train_on, template_kwargs, vmap)
        ac, cut = fit_row(ac, seq_len)
        fitted.append(ac)
        used.append(conv)
        total += len(ac.student)
        truncated += cut
    for line in warn_unrendered([ac.student for ac in fitted], s_template):
        log.warning("%s", line)
    packed = pack_conversations(
        [ac.student for ac in fitted], seq_len, pad_id=pad_id, ignore_index=ignore_index,
        sizes=[len(ac.teacher_ids) for ac in fitted],
    )  # fmt: skip
    teacher = np.zeros((len(packed), 5, seq_len), dtype=np.int64)
    teacher[:, T_DOC] = -1
    teacher[:, T_PAIR] = -1
    placed = 0
    for r, members in enumerate(packed.members):
        s_at = t_at = 0
        for d, k in enumerate(members):
            ac = fitted[k]
            m, n = len(ac.teacher_ids), len(ac.student)
            teacher[r, T_IDS, t_at : t_at + m] = ac.teacher_ids
            teacher[r, T_POS, t_at : t_at + m] = np.arange(m)
            teacher[r, T_DOC, t_at : t_at + m] = d
            teacher[r, T_PAIR, s_at : s_at + n] = np.where(ac.pairs >= 0, ac.pairs + t_at, -1)
            teacher[r, T_EXACT, s_at : s_at + n] = ac.exact
            s_at, t_at = s_at + n, t_at + m
        teacher[r, T_POS, t_at:] = np.arange(seq_len - t_at)
        placed += t_at
    learned = packed.labels != ignore_index
    assert bool((teacher[:, T_PAIR][learned] >= 0).all()), "a learned position without a teacher partner"
    fields = {f.name: getattr(packed, f.name) for f in dataclasses.fields(PackedRows)}
    fields["truncated"] = truncated
    return AlignedRows(**fields, teacher=teacher, teacher_tokens=placed, aligned=list(zip(used, fitted)))


def cross_prompt_pool(rows: AlignedRows) -> tuple[list[list[int]], list[tuple[Conversation, int]]]:
    """On-policy prompts of packed conversations across tokenizers: the student's tokens of each
    conversation up to its first learned token (as kdistill.train.onpolicy.prompt_pool takes them, in
    the same order), and beside each, its conversation and the message index of that answer: what the
    teacher renders the student's completion after."""
    prompts: list[list[int]] = []
    where: list[tuple[Conversation, int]] = []
    for r, members in enumerate(rows.members):
        doc, labels, ids = rows.doc_ids[r], rows.labels[r], rows.input_ids[r]
        for d, k in enumerate(members):
            at = np.flatnonzero(doc == d)
            learned = at[labels[at] != rows.ignore_index]
            if len(learned):
                conv, ac = rows.aligned[k]
                prompts.append([int(t) for t in ids[at[0] : learned[0] + 1]])
                where.append((conv, ac.first_answer))
    return prompts, where


@dataclasses.dataclass
class CompletionSide:
    """What the teacher needs to grade the student's completions of conversations (on-policy across
    tokenizers): the prompts' conversations (cross_prompt_pool), the student's stop tokens, the
    teacher's template and tokenizer, the template variables, the row width and the vocabulary map."""

    where: list[tuple[Conversation, int]]
    stops: set[int]
    s_tok: Any
    t_template: ChatTemplate
    t_tok: Any
    template_kwargs: Mapping[str, Any] | None
    seq_len: int
    vmap: np.ndarray

    def row(self, prompt: int, completion: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(teacher ids (m,), the teacher position paired with the position before each completion
        token (len(completion),), exact (len(completion),) bool) of one completion of prompt `prompt`.

        The completion's text (its tokens before the first stop token, decoded by the student's
        tokenizer) becomes the answer of the prompt's conversation, rendered by the teacher's template;
        the answer's offsets in both are matched as for conversations (module docstring): the position
        before token c ends where tokens 0..c-1 end in the text, the one before a stop token at the end of
        the text (the teacher's before its end-of-turn). Teacher renderings longer than seq_len keep
        their last seq_len tokens."""
        conv, k = self.where[prompt]
        stop = next((c for c, t in enumerate(completion) if t in self.stops), len(completion))
        body = completion[:stop]
        # where each token ends in the text: its offsets when re-encoding the text gives these very tokens,
        # else the lengths of decoded prefixes (tokens the student's tokenizer would have merged otherwise)
        text, token_end = token_ends(self.s_tok, body) if body else ("", [])
        ends = np.asarray(token_end, dtype=np.int64)
        ends = np.clip(np.maximum.accumulate(ends), 0, len(text)) if len(ends) else ends
        answer = {"role": "assistant", "content": text}
        conv = Conversation(
            messages=(*conv.messages[:k], answer), train=(False,) * k + (True,),
            source=f"{conv.source} (a completion)", tools=conv.tools,
        )  # fmt: skip
        specials = special_token_strings(self.t_tok)
        t_text, (ta,) = locate_answers(
            conv, self.t_template, specials, self.template_kwargs, "last_assistant"
        )
        t_ids, _, t_ends = _offsets(self.t_tok, t_text)
        body_map = offset_map(text, t_text[ta.start : ta.body_end])
        n = len(completion)
        before = np.concatenate([[0], ends])[:n] if n else np.zeros(0, dtype=np.int64)  # rel. end, position c
        before = np.concatenate([before, np.full(max(n - len(before), 0), len(text))]).astype(np.int64)
        points = ta.start + body_map[before]
        after = np.concatenate([ends, np.full(max(n - len(ends), 0), -1)])[:n]  # next token's end, or stop
        nxt = np.where(after >= 0, ta.start + body_map[np.clip(after, 0, len(text))], ta.end)
        pairs = np.asarray(align_ends(points.tolist(), t_ends.tolist()), dtype=np.int64)
        exact = exact_positions(
            np.asarray(completion, dtype=np.int64), points, nxt, pairs, t_ids, t_ends, self.vmap
        )
        cut = max(len(t_ids) - self.seq_len, 0)  # the prompt's start, when the rendering is too long
        return t_ids[cut:], np.maximum(pairs - cut, 0), exact & (pairs - cut >= 0)

    def rows(self, prompts: Sequence[int], labels: np.ndarray, ignore_index: int) -> np.ndarray:
        """(B, 5, seq_len) int64: the teacher's side of generated rows (labels (B, seq_len): the
        completion tokens at the positions before them), laid out as AlignedRows.teacher."""
        out = np.zeros((len(prompts), 5, self.seq_len), dtype=np.int64)
        out[:, T_DOC] = -1
        out[:, T_PAIR] = -1
        for b, p in enumerate(prompts):
            at = np.flatnonzero(labels[b] != ignore_index)
            t_ids, pairs, exact = self.row(int(p), [int(t) for t in labels[b][at]])
            m = len(t_ids)
            out[b, T_IDS, :m] = t_ids
            out[b, T_POS] = np.concatenate([np.arange(m), np.arange(self.seq_len - m)])
            out[b, T_DOC, :m] = 0
            out[b, T_PAIR, at] = pairs
            out[b, T_EXACT, at] = exact
        return out
