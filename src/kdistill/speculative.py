"""Speculative decoding on the decode engine: a small draft model proposes K tokens per row, the target
(the teacher) checks all of them in one verify step of K + 1 tokens, and each row keeps its own
accepted prefix plus one token of the target's.

    dec = SpeculativeDecoder(teacher, student, draft_tokens=4, batch_size=8, max_len=256,
                             sampling=Sampling(max_new_tokens=64), stop_ids={eos})
    new = dec.generate(prompts)      # the teacher's own tokens (greedy) or distribution (sampled)
    dec.stats[i]                     # prompt i: (draft tokens accepted, verify steps)

Both models run on DecodeEngine's static buffers (decode.py): each keeps its KV cache of one batch
bucket; the target's slots hold every row's state (pending token, filled length, output, budget, done).
One round, all on the device with fixed shapes (captured as one CUDA graph per bucket on a GPU):

- draft: K steps. The first feeds two tokens per row, the last cached token again (its key and value
  rewritten as they were) and the pending token: a row whose K drafts were all accepted last round
  never fed its K-th draft to the draft model, and this fills that slot with no per-row branch; the
  other K - 1 steps feed one token each. q_j is the draft's distribution of draft token d_{j+1}.
- verify: the target's forward of [pending, d_1 .. d_K] at the row's slots -> p_0 .. p_K.
- accept: d_j is kept with probability min(1, p_{j-1}(d_j) / q_{j-1}(d_j)) (u q < p with one uniform
  u per draft token); n = the number kept before the first refusal. The row's next token is drawn from
  max(0, p_n - q_n) normalised (after a refusal) or from p_K (all K kept: the bonus token). The output
  then has exactly the target's distribution (Leviathan et al. 2023; Chen et al. 2023). Greedy: d_j is
  kept while it is the target's argmax, and the next token is the target's argmax after them: token for
  token what the target alone decodes.
- commit: each row appends its n + 1 tokens (cut at a stop token or its budget) and its filled length
  grows by its own count. Slots past it in both caches hold refused drafts; attention reads slots
  0..len only, and the next round overwrites them.

The sampling settings (temperature, top-k, top-p) shape p and q alike, as ops.sample.sample_tokens does.
The uniforms of a round are drawn before it (outside the graph) from one generator seeded by the
sampling seed. Vocabularies of different sizes (a padded embedding) are compared over the larger, the
missing rows with probability 0; a token past the draft's rows is fed to it as its last row. Attention
of a T-token step (the draft's two-token step, the verify step) is one launch per layer of the T-token
decode attention kernel (DecodeEngine.forward_at), planned beside the decode engine's keys
(kernels.plan.speculative_kernels).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from kdistill.decode import DecodeEngine, Sampling, _Slots, run_slots
from kdistill.errors import UserError
from kdistill.kernels.plan import speculative_kernels
from kdistill.kernels.seal import configure, prewarm, seal, unseal
from kdistill.models.decoder import Decoder
from kdistill.models.tokenizer import load_tokenizer
from kdistill.ops.sample import inverse_cdf

DEFAULT_DRAFT_TOKENS = 4
DEFAULT_SAMPLING = Sampling()  # greedy


def check_draft_tokens(k: Any, field: str = "--draft-tokens") -> int:
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= 64:
        raise UserError(f"{field} is {k!r}, expected an integer from 1 to 64")
    return k


def check_same_tokenizer(target_dir: str | Path, draft_dir: str | Path, field: str = "--draft") -> None:
    """Refuse, in one line, a draft whose tokenizer.json differs from the target's (compared by the
    tokenizers' identity, as a run compares teacher and student)."""
    target_dir, draft_dir = Path(target_dir), Path(draft_dir)
    if not (draft_dir / "tokenizer.json").is_file():
        raise UserError(
            f"{field} '{draft_dir}' has no tokenizer.json: a draft must share the model's tokenizer"
        )
    theirs, ours = load_tokenizer(draft_dir), load_tokenizer(target_dir)
    if theirs.identity != ours.identity:
        raise UserError(
            f"{draft_dir / 'tokenizer.json'}: tokenizer differs from {target_dir}'s "
            f"({theirs.identity[:12]} vs {ours.identity[:12]}): a draft must share the model's tokenizer"
        )


def token_probs(logits: torch.Tensor, s: Sampling, vocab: int) -> torch.Tensor:
    """The sampling distribution of logits (N, V) under s (temperature, then top-k, then top-p, as
    ops.sample.sample_tokens draws from) -> (N, vocab) fp32, rows beyond V zero. No host sync."""
    x = logits.float() / s.temperature
    v = x.shape[-1]
    top_k = s.top_k if s.top_k and s.top_k < v else 0
    if top_k or s.top_p < 1:
        vals, idx = torch.topk(x, top_k or v, dim=-1)  # sorted descending
        probs = vals.softmax(-1)
        if s.top_p < 1:  # the most probable tokens up to the first whose cumulative mass reaches p
            probs = probs.masked_fill(probs.cumsum(-1) - probs >= s.top_p, 0.0)
            probs = probs / probs.sum(-1, keepdim=True)
        probs = torch.zeros_like(x).scatter_(1, idx, probs)
    else:
        probs = x.softmax(-1)
    return F.pad(probs, (0, vocab - v)) if vocab > v else probs


def draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of probs (N, V) (any non-negative mass) by inverse CDF at u (N,) in [0, 1):
    the first token whose cumulative mass exceeds u times the total (never a token of mass 0)."""
    return inverse_cdf(probs, u)


@dataclasses.dataclass
class _Pair:
    """Static buffers of one batch bucket: both caches, the target's row state, and the round's own."""

    t: _Slots  # the target's cache and every row's state (pending token, lens, out, budget, done)
    d: _Slots  # the draft's cache (its state fields unused)
    prev: torch.Tensor  # (B,) the last cached token (slot lens - 1)
    u: torch.Tensor  # (B, 2K + 1) the round's uniforms: K draft draws, K acceptances, one resample
    accepted: torch.Tensor  # (B,) draft tokens accepted by the row's prompt so far
    rounds: torch.Tensor  # (B,) verify steps of the row's prompt so far
    graph: Any = None


class SpeculativeDecoder:
    """Speculative decoding of `target` with `draft` proposing draft_tokens (K) tokens per verify step;
    batched, per-row acceptance, slots refilled as rows finish (as DecodeEngine.generate).

    max_len: slots per row a prompt and its answer may fill (each cache has K + 1 more, for the drafts
    of a row near its end). cuda_graphs: "auto" (one graph of the whole round per bucket on a GPU),
    "on" or "off". sync_every: rounds between two reads of the done flags by the host."""

    def __init__(
        self,
        target: Decoder,
        draft: Decoder,
        *,
        draft_tokens: int = DEFAULT_DRAFT_TOKENS,
        batch_size: int,
        max_len: int,
        sampling: Sampling = DEFAULT_SAMPLING,
        stop_ids: Sequence[int] | set[int] = (),
        pad_id: int = 0,
        dtype: torch.dtype | None = None,
        cuda_graphs: str = "auto",
        sync_every: int = 2,
        prefill_tokens: int = 16384,
    ) -> None:
        self.k = check_draft_tokens(draft_tokens)
        if target.lm_head_weight.device != draft.lm_head_weight.device:
            raise UserError("the draft model must be on the target's device")
        common: dict[str, Any] = dict(
            batch_size=batch_size,
            max_len=int(max_len) + self.k + 1,
            sampling=sampling,
            stop_ids=stop_ids,
            pad_id=pad_id,
            dtype=dtype,
            prefill_tokens=prefill_tokens,
        )
        # The engines never capture their own one-token step here: the round is captured instead.
        self.target = DecodeEngine(target, cuda_graphs="off", **common)
        self.draft = DecodeEngine(draft, cuda_graphs="off", **common)
        on_gpu = self.target.device.type == "cuda"
        if cuda_graphs == "on" and not on_gpu:
            raise UserError("cuda_graphs is 'on' but the model is not on a CUDA device")
        self.graphs = on_gpu and cuda_graphs != "off"
        self.device = self.target.device
        self.room = int(max_len)
        self.sampling = sampling
        self.vocab = max(target.spec.vocab_size, draft.spec.vocab_size)
        self.draft_rows = draft.spec.vocab_size
        self.sync_every = max(1, int(sync_every))
        self.generator = self.target.generator  # seeded by sampling.seed; the target's prefill draws too
        self.pair: _Pair | None = None
        self.rounds = 0  # verify steps run
        self.stats: list[tuple[int, int]] = []  # per prompt of the last generate: (accepted, verify steps)

    # -- buffers ------------------------------------------------------------------------------
    def _pair_for(self, batch: int) -> _Pair:
        n = self.sampling.max_new_tokens
        pr = self.pair
        if pr is None or pr.t.batch != batch or pr.t.out.shape[1] != n + 1:
            self.pair = None  # free the old caches before the new ones
            m, dt, dev = self.target.max_len, self.target.dtype, self.device
            i64 = dict(dtype=torch.int64, device=dev)
            pr = _Pair(
                t=_Slots(self.target.spec, batch, m, n, dt, dev),
                d=_Slots(self.draft.spec, batch, m, 1, dt, dev),
                prev=torch.zeros(batch, **i64),
                u=torch.zeros((batch, 2 * self.k + 1), dtype=torch.float32, device=dev),
                accepted=torch.zeros(batch, **i64),
                rounds=torch.zeros(batch, **i64),
            )
            if self.graphs:
                pr.graph = capture(lambda: self._round(pr), self.device)
            self.pair = pr
        return pr

    # -- the round ----------------------------------------------------------------------------
    def _draft(self, pr: _Pair) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The draft's K tokens per row (B, K) and, when sampling, their distributions q_0..q_{K-1}."""
        st, eng, s = pr.t, self.draft, self.sampling
        # a token beyond the draft's embedding (a padded target vocabulary) reaches it as its last row:
        # only the draft's guesses can change, never the output
        fed = torch.stack([pr.prev, st.tok], 1).clamp(max=self.draft_rows - 1)  # (B, 2)
        h = eng.forward_at(pr.d, fed, st.lens - 1)[:, 1]  # (B, H)
        toks: list[torch.Tensor] = []
        qs: list[torch.Tensor] = []
        for j in range(self.k):
            if j:
                h = eng.forward_at(pr.d, toks[-1][:, None], st.lens + j)[:, 0]
            logits = F.linear(h, eng.weights.lm_head)  # (B, Vd)
            if s.greedy:
                toks.append(logits.argmax(-1))
            else:
                qs.append(token_probs(logits, s, self.vocab))
                toks.append(draw(qs[-1], pr.u[:, j]))
        return torch.stack(toks, 1), qs

    def _verify(
        self, pr: _Pair, d: torch.Tensor, qs: list[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(accepted count n (B,), the target's next token y (B,)) for drafts d (B, K)."""
        st, k, s = pr.t, self.k, self.sampling
        ids = torch.cat([st.tok[:, None], d], 1)  # (B, K + 1)
        h = self.target.forward_at(st, ids, st.lens)  # (B, K + 1, H)
        logits = F.linear(h, self.target.weights.lm_head)  # (B, K + 1, Vt)
        if s.greedy:
            best = logits.argmax(-1)  # (B, K + 1)
            n = (d == best[:, :k]).long().cumprod(1).sum(1)
            return n, best.gather(1, n[:, None])[:, 0]
        b, v = d.shape[0], self.vocab
        p = token_probs(logits.flatten(0, 1), s, v).view(b, k + 1, v)
        q = torch.stack(qs + [torch.zeros_like(qs[0])], 1)  # (B, K + 1, V): no draft for the bonus
        pd = p[:, :k].gather(2, d[..., None])[..., 0]  # (B, K)
        qd = q[:, :k].gather(2, d[..., None])[..., 0]
        n = (pr.u[:, k : 2 * k] * qd < pd).long().cumprod(1).sum(1)
        at = n[:, None, None].expand(b, 1, v)
        pn, qn = p.gather(1, at)[:, 0], q.gather(1, at)[:, 0]  # (B, V)
        rest = (pn - qn).clamp_(min=0)
        rest = torch.where(rest.sum(-1, keepdim=True) > 0, rest, pn)  # p = q: a refusal has probability 0
        return n, draw(rest, pr.u[:, 2 * k])

    def _round(self, pr: _Pair) -> None:
        """Draft, verify, accept and commit for every row, on the device (captured on a GPU)."""
        d, qs = self._draft(pr)
        n, y = self._verify(pr, d, qs)
        e = torch.cat([d, torch.zeros_like(y)[:, None]], 1).scatter_(1, n[:, None], y[:, None])
        self._commit(pr, e, n)  # e (B, K + 1): d_1 .. d_n, y, then refused drafts

    def _commit(self, pr: _Pair, e: torch.Tensor, n: torch.Tensor) -> None:
        """Append each row's first n + 1 tokens of e (cut after a stop token and at its budget)."""
        st = pr.t
        active = ~st.done
        j = torch.arange(self.k + 1, device=self.device)[None, :]  # (1, K + 1)
        stop = (e[..., None] == self.target.stops).any(-1) & (j <= n[:, None])  # (B, K + 1)
        first = torch.where(stop.any(1), stop.long().argmax(1), self.k + 1)
        count = torch.minimum(torch.minimum(n + 1, first + 1), st.limit - st.ngen)
        count = torch.where(active, count, 0)
        keep = j < count[:, None]
        cols = torch.where(keep, st.ngen[:, None] + j, st.out.shape[1] - 1)  # the last column: a dump
        st.out.scatter_(1, cols, e)
        ngen = st.ngen + count
        last = e.gather(1, (count - 1).clamp(min=0)[:, None])[:, 0]
        before = e.gather(1, (count - 2).clamp(min=0)[:, None])[:, 0]
        before = torch.where(count >= 2, before, st.tok)
        finished = (stop & keep).any(1) | (ngen >= st.limit)
        pr.prev.copy_(torch.where(active, before, pr.prev))
        st.tok.copy_(torch.where(active, last, st.tok))
        st.lens.add_(count)
        st.ngen.copy_(ngen)
        st.done.copy_(st.done | (active & finished))
        pr.accepted.add_(torch.where(active, n, 0))
        pr.rounds.add_(active.long())

    def _step(self, pr: _Pair) -> None:
        if not self.sampling.greedy:
            pr.u.uniform_(generator=self.generator)  # outside the graph
        if pr.graph is not None:
            pr.graph.replay()
        else:
            self._round(pr)
        self.rounds += 1

    def _prefill(self, pr: _Pair, slots: list[int], prompts: list[list[int]], limits: list[int]) -> None:
        """Both caches take the prompts; the target samples each row's first token (its bookkeeping)."""
        self.target._prefill(pr.t, slots, prompts, limits)
        top = self.draft_rows - 1
        _, rows, _ = self.draft.write_prompts(pr.d, slots, [[min(t, top) for t in p] for p in prompts])
        pr.prev[rows] = torch.tensor([p[-1] for p in prompts], dtype=torch.int64).to(self.device)
        pr.accepted[rows] = 0
        pr.rounds[rows] = 0

    # -- the loop -----------------------------------------------------------------------------
    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        on_finish: Callable[[int, list[int]], None] | None = None,
        on_tokens: Callable[[int, list[int]], None] | None = None,
    ) -> list[list[int]]:
        """New token ids per prompt, in prompt order, as DecodeEngine.generate (same callbacks); self.stats
        then holds each prompt's (draft tokens accepted, verify steps)."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("generate needs at least one prompt, each with at least one token")
        for i, p in enumerate(prompts):
            if len(p) >= self.room:
                raise UserError(f"prompt {i + 1} has {len(p)} tokens, expected fewer than {self.room}")
        n_new = self.sampling.max_new_tokens
        pr = self._pair_for(self.target.bucket(len(prompts)))
        pr.t.done.fill_(True)
        self.stats = [(0, 0)] * len(prompts)

        def done(i: int, f: torch.Tensor) -> None:
            self.stats[i] = (int(f[2]), int(f[3]))

        return run_slots(
            prompts,
            slots=pr.t.batch,
            limits=[min(n_new, self.room - len(p)) for p in prompts],
            prefill_tokens=self.target.prefill_tokens,
            prefill=lambda slots, rows, limits: self._prefill(pr, slots, rows, limits),
            flags=lambda: torch.stack([pr.t.done.long(), pr.t.ngen, pr.accepted, pr.rounds]),
            out=pr.t.out,
            step=lambda: self._step(pr),
            sync_every=self.sync_every,
            on_finish=on_finish,
            on_tokens=on_tokens,
            on_done=done,
        )

    # -- costs --------------------------------------------------------------------------------
    @torch.no_grad()
    def step_costs(self, repeats: int = 20) -> dict[str, float]:
        """Seconds of the target's one-token step, the draft's one-token step and the target's verify
        step (K + 1 tokens), each with its lm_head, at the last bucket (replayed CUDA graphs on a GPU,
        eager on a CPU; the median of `repeats`). Run after generate: the rows are done, and the
        slots written are past every row's filled length."""
        pr = self.pair
        if pr is None:
            raise RuntimeError("step_costs needs a bucket: run generate first")
        st = pr.t
        one = st.tok[:, None]
        many = one.expand(-1, self.k + 1).contiguous()

        def step(eng: DecodeEngine, slots: _Slots, ids: torch.Tensor) -> Callable[[], None]:
            return lambda: F.linear(eng.forward_at(slots, ids, st.lens), eng.weights.lm_head)

        fns = {
            "target_step_s": step(self.target, st, one),
            "draft_step_s": step(self.draft, pr.d, one),
            "verify_step_s": step(self.target, st, many),
        }
        return timed(fns, self.device, self.graphs, repeats)


def capture(fn: Callable[[], Any], device: torch.device) -> Any:
    """fn captured as a CUDA graph, after two eager runs on a side stream that load every kernel."""
    torch.cuda.synchronize(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        fn()
    torch.cuda.synchronize(device)
    return graph


def timed(
    fns: dict[str, Callable[[], Any]], device: torch.device, graphs: bool, repeats: int
) -> dict[str, float]:
    """Median seconds of one call of each fn (a graph replay where graphs is on), the calls interleaved
    so that a busy machine slows them alike."""
    runs = {name: (capture(fn, device).replay if graphs else fn) for name, fn in fns.items()}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for i in range(max(1, repeats) + 2):  # two rounds of warm-up
        for name, run in runs.items():
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            run()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i >= 2:
                times[name].append(time.perf_counter() - t0)
    return {name: sorted(t)[len(t) // 2] for name, t in times.items()}


# -- the kernels of `kdistill generate --draft` (kdistill.generate.build_speculative) ---------------
def prepare_speculative_kernels(
    target: Decoder,
    draft: Decoder,
    batch: int,
    prompt_len: int,
    max_len: int,
    draft_tokens: int,
    *,
    pack: str | Path | None = None,
) -> dict[str, Any]:
    """generate.prepare_kernels for a target and its draft: configure the dispatcher; on a GPU in triton
    mode prewarm kernels.plan.speculative_kernels (both models' decode plans, the draft's two-token
    step and the verify step, in bf16) and seal."""
    device = target.lm_head_weight.device
    rt = configure(kernels="auto", device=device)
    info: dict[str, Any] = {"mode": rt.mode, "arch": rt.arch}
    if rt.mode == "triton":
        plan = speculative_kernels(
            target.spec,
            draft.spec,
            rt.arch,
            "bf16",
            batch=batch,
            prompt_len=prompt_len,
            max_len=max_len,
            draft_tokens=draft_tokens,
        )
        report = prewarm(plan, device, pack=pack or None, arch=rt.arch)
        unseal()
        seal(strict=rt.strict)
        info.update(planned=len(plan), prewarm=report.line())
    return info
