"""Triton sampler and bookkeeping of a decode step: the next token of every row from the lm_head's
logits, and the row's state after it, in one launch: kernel, launcher, key functions, registered
KernelSpec.

    tok[b]  = argmax_v logits[b, v]                                   (GREEDY)
            = the first v with sum_{w <= v} p[b, w] > u[b]             (else: the inverse CDF at u[b])
              where p[b] = softmax(logits[b] / temperature)
    then, as DecodeEngine's bookkeeping: a done row's token is the pad id; the token goes to
    out[b, ngen[b]]; an active row's ngen and lens grow by one; it is done on a stop id, at its budget
    (ngen >= limit) or with a full cache (lens >= max_len); tok[b] is the token it feeds next.

Program (b, c) reads chunk c (CHUNK logits) of row b once: greedy, its maximum and the first index of
it; sampled, its maximum m_c and sum s_c = sum exp(x / T - m_c). The last program of a row to arrive
(an acquire-release count per row, set back to zero by it) reads the row's partials: greedy, the
largest maximum's first index (torch.argmax's token); sampled, the chunks' masses w_c = s_c exp(m_c -
M) searched for the first whose running sum passes u[b] times the total, then that chunk's logits
read again and their own running sum searched. The token is the two-level inverse CDF's of
ops.sample.inverse_cdf up to the rounding of the sums' orders (never a token of mass 0). It then does the
row's bookkeeping, so the step runs no argmax, no softmax over (rows, vocab) and none of the ~20 small
index and compare kernels of the reference's bookkeeping. Top-k and top-p sampling stay on the
reference (ops/sample.py).

The file reads top to bottom: kernel, launcher, key functions and tile policy, then the registered
KernelSpec. No backward.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kdistill.errors import KernelError
from kdistill.kernels import decode_gemv
from kdistill.kernels._triton import jit, tl
from kdistill.kernels.keys import KernelKey, dtype_name, launch_options, make_key, memoized, next_pow2
from kdistill.kernels.spec import Kernel, KernelSpec, tensor
from kdistill.ops.sample import Rows


@jit(do_not_specialize=["V", "NCHUNK", "SL", "SO", "NSTOP", "MAXLEN", "PAD"])
def decode_sample_kernel(
    LOGITS,
    U,
    PM,
    PS,
    PI,
    CNT,
    TOK,
    LENS,
    NGEN,
    LIMIT,
    DONE,
    OUT,
    STOPS,
    V,
    NCHUNK,
    SL,
    SO,
    NSTOP,
    MAXLEN,
    PAD,
    temperature,
    CHUNK: tl.constexpr,
    BLOCK_C: tl.constexpr,
    GREEDY: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    cols = c * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(LOGITS + b * SL + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
    at = b * NCHUNK + c
    if GREEDY:
        m, i = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
        tl.store(PM + at, m)
        tl.store(PI + at, c * CHUNK + i)
    else:
        x = x / temperature
        m = tl.max(x, axis=0)
        tl.store(PM + at, m)
        tl.store(PS + at, tl.sum(tl.exp(x - m), axis=0))
    tl.debug_barrier()
    arrived = tl.atomic_add(CNT + b, 1, sem="acq_rel", scope="gpu")
    if arrived == NCHUNK - 1:
        tl.debug_barrier()
        lanes = tl.arange(0, BLOCK_C)
        lmask = lanes < NCHUNK
        pm = tl.load(PM + b * NCHUNK + lanes, mask=lmask, other=float("-inf"), cache_modifier=".cg")
        top = tl.max(pm, axis=0)
        if GREEDY:
            pi = tl.load(PI + b * NCHUNK + lanes, mask=lmask, other=2147483647, cache_modifier=".cg")
            tok = tl.min(tl.where(pm == top, pi, 2147483647), axis=0)  # the first index of the maximum
        else:
            ps = tl.load(PS + b * NCHUNK + lanes, mask=lmask, other=0.0, cache_modifier=".cg")
            w = tl.where(lmask, ps * tl.exp(pm - top), 0.0)  # each chunk's mass, relative to exp(top)
            target = tl.load(U + b) * tl.sum(w, axis=0)
            j = tl.sum((tl.cumsum(w, axis=0) <= target).to(tl.int32), axis=0)  # first chunk past it
            j = tl.minimum(j, tl.max(tl.where(w > 0, lanes, 0), axis=0))  # rounding: a chunk of mass
            before = tl.sum(tl.where(lanes < j, w, 0.0), axis=0)
            n = tl.arange(0, CHUNK)
            cols = j * CHUNK + n
            y = tl.load(LOGITS + b * SL + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
            y = tl.exp(y / temperature - top)
            k = tl.sum((before + tl.cumsum(y, axis=0) <= target).to(tl.int32), axis=0)
            k = tl.minimum(k, tl.max(tl.where(y > 0, n, 0), axis=0))  # rounding: a token of mass
            tok = j * CHUNK + k
        # the row's bookkeeping (ops.sample.append)
        done = tl.load(DONE + b) != 0
        active = done == 0
        tok = tl.where(active, tok.to(tl.int64), PAD)
        ngen = tl.load(NGEN + b)
        tl.store(OUT + b * SO + ngen, tok)
        ngen += active.to(tl.int64)
        lens = tl.load(LENS + b)
        lens = tl.where(active, lens + 1, lens)
        s = tl.arange(0, 16)  # stop ids compared 16 at a time
        hits = 0
        for s0 in range(0, NSTOP, 16):
            ids = tl.load(STOPS + s0 + s, mask=s0 + s < NSTOP, other=-1)
            hits += tl.sum((ids == tok).to(tl.int32), axis=0)
        stop = (hits > 0) | (ngen >= tl.load(LIMIT + b)) | (lens >= MAXLEN)
        tl.store(NGEN + b, ngen)
        tl.store(LENS + b, lens)
        tl.store(DONE + b, done | (active & stop))
        tl.store(TOK + b, tok)
        tl.atomic_xchg(CNT + b, 0, sem="relaxed", scope="gpu")


def launch(key: KernelKey, logits: torch.Tensor, u: torch.Tensor, temperature: float, rows: Rows):
    """The kernel's (kernel, grid, args, kwargs, (tok,)) for logits (B, V) with contiguous rows, u (B,)
    fp32 and the rows' state (ops.sample.Rows: tok, lens, ngen, limit (B,) int64, done (B,) bool, out
    (B, N) int64 with contiguous rows, stops (S,) int64), updated in place."""
    tok, lens, ngen, limit, done, out, stops, pad_id, max_len = rows
    b, v = logits.shape
    chunk = int(key["CHUNK"])
    nchunk = -(-v // chunk)
    if nchunk > int(key["BLOCK_C"]) or logits.stride(1) != 1 or out.stride(1) != 1:
        raise KernelError(f"decode_sample: logits {tuple(logits.shape)} do not fit the key ({key})")
    if done.dtype != torch.bool or any(t.dtype != torch.int64 for t in (tok, lens, ngen, limit, out, stops)):
        raise KernelError("decode_sample: the rows' state is int64 (done: bool)")
    pm = torch.empty((b, nchunk), dtype=torch.float32, device=logits.device)  # the chunks' maxima
    ps = torch.empty_like(pm)  # sampled: their sums (unused when greedy)
    pi = torch.empty((b, nchunk), dtype=torch.int32, device=logits.device)  # greedy: their argmaxes
    cnt = decode_gemv.counters(logits.device, b)
    args = (logits, u, pm, ps, pi, cnt, tok, lens, ngen, limit, done, out, stops)
    args = (*args, v, nchunk, logits.stride(0), out.stride(0), stops.numel(), int(max_len), int(pad_id))
    args = (*args, 1.0 if key["GREEDY"] else float(temperature))
    kwargs = dict(CHUNK=chunk, BLOCK_C=int(key["BLOCK_C"]), GREEDY=bool(key["GREEDY"]), **launch_options(key))
    return decode_sample_kernel, (b, nchunk), args, kwargs, (tok,)


def run(spec) -> tuple:
    kernel, grid, args, kwargs, outs = spec
    kernel[grid](*args, **kwargs)
    return outs


# -- tile policy and key functions --------------------------------------------------------------
MAX_CHUNKS = 128  # partials a row's last program reads at once


def tiles(vocab: int) -> dict[str, int]:
    """2,048 logits a program (75 chunks for 151,936 tokens), more for a vocabulary past MAX_CHUNKS of
    them; BLOCK_C lanes hold a row's chunks."""
    chunk = max(2048, next_pow2(-(-int(vocab) // MAX_CHUNKS)))
    return {"CHUNK": chunk, "BLOCK_C": max(16, next_pow2(-(-int(vocab) // chunk)))}


@memoized
def sample_key(
    arch: str, *, vocab: int, dtype: str, greedy: bool, aligned: Sequence[bool] | None = None
) -> KernelKey:
    """The sampler over `vocab` logits in `dtype`: greedy (argmax) or the inverse CDF at a temperature.
    aligned: LOGITS, U, TOK, LENS, NGEN, LIMIT, DONE, OUT, STOPS."""
    return make_key(
        SAMPLE.op,
        arch,
        dtype=dtype_name(dtype),
        GREEDY=bool(greedy),
        align=SAMPLE.align(aligned),
        num_warps=4,
        num_stages=1,
        **tiles(vocab),
    )


def serves(top_k: int, top_p: float, vocab: int) -> bool:
    """Sampling the kernel runs: greedy, or a temperature without top-k and top-p."""
    return (top_k == 0 or top_k >= vocab) and top_p >= 1


def _warm(key: KernelKey, device: Any) -> tuple:
    """Two rows of a vocabulary of two chunks, aligned as `key` says."""
    al = [c == "A" for c in str(key["align"])]
    v = int(key["CHUNK"]) + 1
    logits = tensor((2, v), key["dtype"], device, al[0])
    u = tensor((2,), "fp32", device, al[1])

    def i64(n: int, aligned: bool) -> torch.Tensor:
        buf = torch.zeros(n + 2, dtype=torch.int64, device=device)
        return buf[:n] if aligned else buf[1 : n + 1]

    tok, lens, ngen, limit = (i64(2, a) for a in al[2:6])
    dbuf = torch.ones(18, dtype=torch.bool, device=device)
    done = dbuf[:2] if al[6] else dbuf[1:3]
    out = i64(6, al[7]).view(2, 3)
    stops = i64(1, al[8])
    return launch(key, logits, u, 1.0, Rows(tok, lens, ngen, limit, done, out, stops, 0, 4))


def plan(arch: str, *, grad: bool, vocab: int, dtype: str) -> set[KernelKey]:
    """Keys of a decode step's sampler: greedy and sampled (the plan does not know which a run takes:
    both are small)."""
    del grad
    return {sample_key(arch, vocab=vocab, dtype=dtype, greedy=g) for g in (True, False)}


SAMPLE = Kernel(
    "decode_sample",
    decode_sample_kernel,
    sample_key,
    _warm,
    {
        "LOGITS": "dtype",
        "U": "fp32",
        "PM": "fp32",
        "PS": "fp32",
        "PI": "i32",
        "CNT": "i32",
        "TOK": "i64",
        "LENS": "i64",
        "NGEN": "i64",
        "LIMIT": "i64",
        "DONE": "u1",
        "OUT": "i64",
        "STOPS": "i64",
    },
    outputs=("PM", "PS", "PI", "CNT"),
)
SPEC = KernelSpec(name="decode_sample", kernels=(SAMPLE,), tiles=tiles, plan=plan)
