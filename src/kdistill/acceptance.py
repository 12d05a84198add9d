"""A student as a draft model: how many of its tokens its teacher accepts (kdistill.speculative), and
the speed-up that predicts. `kdistill eval --model STUDENT --draft-for TEACHER` and a run's summary.

    out = measure_draft("out/student", "teacher/", ["heldout.txt"], draft_tokens=4)   # the eval's dict
    summary["draft"] = run_acceptance(run)              # a finished run's greedy alpha (bounded)
    row = acceptance(decoder, prompts)                  # α and tokens per verify of one decoder's run
    speedup(alpha, k, c_draft, c_verify)                # the standard prediction

Definitions (per verify step of a row: the draft proposes K tokens, n of them are kept, n + 1 tokens
are produced):
- alpha: the fraction of draft tokens accepted, sum(n) / (K x verify steps), over all prompts;
- accepted_per_verify: mean n, in 0..K (a draft identical to its teacher: K);
- tokens_per_verify: mean n + 1, the tokens one verify step yields (identical draft: K + 1).
A verify step cut short by a stop token or the budget still counts its n. Standard errors treat each
prompt as one sample (a ratio estimator over prompts: tokens of one answer are not independent).

Predicted speed-up (Leviathan et al. 2023) from alpha and the measured step costs, in units of the
teacher's one-token step: expected tokens per verify E = (1 - alpha^(K+1)) / (1 - alpha) (K + 1 at
alpha = 1), and speed-up = E / (K c_draft + c_verify), c_draft and c_verify the times of a draft step
and of a verify step of K + 1 tokens over the teacher's one-token step (replayed CUDA graphs on a GPU).
The i.i.d. E assumes each draft token is accepted independently; a draft's refusals often come in runs
(where it and its teacher part ways), and then the measured tokens per verify step is the better input:
speedup_from_tokens_per_verify = tokens_per_verify / (K c_draft + c_verify).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from kdistill.data import TokenCache, cache_dir, load_files
from kdistill.decode import Sampling
from kdistill.errors import UserError
from kdistill.generate import resolve_device
from kdistill.kernels import runtime
from kdistill.models.decoder import Decoder
from kdistill.models.hf_io import load_model
from kdistill.models.spec import load_spec
from kdistill.models.tokenizer import load_tokenizer
from kdistill.samples import RAW_PROMPT_TOKENS, sample_prompts
from kdistill.scoring import eval_sequences
from kdistill.speculative import (
    DEFAULT_DRAFT_TOKENS,
    SpeculativeDecoder,
    check_draft_tokens,
    check_same_tokenizer,
    prepare_speculative_kernels,
)
from kdistill.train import distributed as dist
from kdistill.train.corpus import expand_data_paths


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens per verify step when each draft token is accepted with probability alpha (independently)."""
    if alpha >= 1:
        return float(k + 1)
    return (1 - alpha ** (k + 1)) / (1 - alpha)


def speedup(alpha: float, k: int, c_draft: float, c_verify: float) -> float:
    """Predicted speed-up over the teacher alone: expected_tokens / (K c_draft + c_verify)."""
    return expected_tokens(alpha, k) / (k * c_draft + c_verify)


def _ratio(num: Sequence[float], den: Sequence[float]) -> tuple[float, float | None]:
    """sum(num) / sum(den) and its standard error over the samples (the delta method; None for one)."""
    total = sum(den)
    r = sum(num) / total
    n = len(num)
    if n < 2:
        return r, None
    var = sum((a - r * b) ** 2 for a, b in zip(num, den)) * n / (n - 1)
    return r, math.sqrt(var) / total


def acceptance(dec: SpeculativeDecoder, prompts: Sequence[Sequence[int]]) -> dict[str, Any]:
    """Run the decoder on the prompts and summarise its acceptance (see the module docstring)."""
    dec.generate(prompts)
    rows = [(a, r) for a, r in dec.stats if r > 0]
    if not rows:
        raise UserError("no verify step ran: every answer ended at its first token (raise --max-new-tokens)")
    k = dec.k
    acc = [float(a) for a, _ in rows]
    rounds = [float(r) for _, r in rows]
    alpha, alpha_se = _ratio(acc, [k * r for r in rounds])
    per, per_se = _ratio(acc, rounds)
    return {
        "alpha": alpha,
        "alpha_se": alpha_se,
        "accepted_per_verify": per,
        "accepted_per_verify_se": per_se,
        "tokens_per_verify": per + 1,
        "tokens_per_verify_se": per_se,
        "verify_steps": int(sum(rounds)),
        "prompts": len(rows),
    }


def heldout_prompts(windows: Sequence[Sequence[int]], n: int) -> list[list[int]]:
    """Up to n prompts: the first min(16, half) tokens of each held-out window."""
    out = []
    for w in windows:
        if len(w) >= 4 and len(out) < n:
            out.append([int(t) for t in w[: min(RAW_PROMPT_TOKENS, len(w) // 2)]])
    return out


def draft_report(
    teacher: Decoder,
    student: Decoder,
    prompts: list[list[int]],
    *,
    draft_tokens: int,
    max_new_tokens: int,
    stop_ids: set[int],
    pad_id: int = 0,
    temperatures: Sequence[float] = (0.0, 1.0),
    seed: int = 0,
    costs: bool = True,
    cuda_graphs: str = "auto",
) -> dict[str, Any]:
    """Acceptance of `student` drafting for `teacher` on the prompts at each temperature ("greedy" for 0,
    else "t=<T>"), and with costs the step costs and each mode's predicted speed-up."""
    max_len = max(len(p) for p in prompts) + max_new_tokens
    batch = min(32, 1 << max(0, len(prompts) - 1).bit_length())
    out: dict[str, Any] = {"draft_tokens": draft_tokens, "max_new_tokens": max_new_tokens}
    cost: dict[str, float] | None = None
    for t in temperatures:
        s = Sampling(max_new_tokens=max_new_tokens, temperature=t, seed=seed)
        dec = SpeculativeDecoder(
            teacher,
            student,
            draft_tokens=draft_tokens,
            batch_size=batch,
            max_len=max_len,
            sampling=s,
            stop_ids=stop_ids,
            pad_id=pad_id,
            cuda_graphs=cuda_graphs,
        )
        out["greedy" if s.greedy else f"t={t:g}"] = acceptance(dec, prompts)
        if costs and cost is None:
            cost = dec.step_costs()
        del dec
    if cost is not None:
        c_draft = cost["draft_step_s"] / cost["target_step_s"]
        c_verify = cost["verify_step_s"] / cost["target_step_s"]
        ms = {name[: -len("_s")] + "_ms": v * 1e3 for name, v in cost.items()}
        out["costs"] = {"c_draft": c_draft, "c_verify": c_verify, **ms}
        for key in [k for k in out if k == "greedy" or k.startswith("t=")]:
            row = out[key]
            row["predicted_tokens_per_verify"] = expected_tokens(row["alpha"], draft_tokens)
            row["predicted_speedup"] = speedup(row["alpha"], draft_tokens, c_draft, c_verify)
            row["speedup_from_tokens_per_verify"] = row["tokens_per_verify"] / (
                draft_tokens * c_draft + c_verify
            )
    return out


def measure_draft(
    model: str | Path,
    teacher: str | Path,
    data: list[str],
    *,
    draft_tokens: int = DEFAULT_DRAFT_TOKENS,
    prompts: int = 32,
    max_new_tokens: int = 64,
    device: str = "auto",
    seed: int = 0,
) -> dict[str, Any]:
    """`kdistill eval --model STUDENT --draft-for TEACHER --data FILE`: the student's acceptance as a
    draft of the teacher on held-out prompts (the first 16 tokens of consecutive windows of the data),
    greedy and at T = 1, with the measured step costs and the predicted speed-ups."""
    k = check_draft_tokens(draft_tokens)
    for name, v in (("--prompts", prompts), ("--max-new-tokens", max_new_tokens)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise UserError(f"{name} is {v!r}, expected an integer >= 1")
    model_dir, teacher_dir = Path(model), Path(teacher)
    for field, d in (("--model", model_dir), ("--draft-for", teacher_dir)):
        if not (d / "tokenizer.json").is_file():
            raise UserError(f"{field} '{d}' has no tokenizer.json (a model directory with its tokenizer)")
    check_same_tokenizer(teacher_dir, model_dir, field="--model")
    spec, t_spec = load_spec(model_dir), load_spec(teacher_dir)
    tok = load_tokenizer(teacher_dir)
    context = min(spec.max_position_embeddings, t_spec.max_position_embeddings)
    if RAW_PROMPT_TOKENS + max_new_tokens + k + 1 > context:
        raise UserError(f"--max-new-tokens is {max_new_tokens}, expected at most {context - k - 1 - 16}")
    files, _ = load_files(expand_data_paths(list(data)), tok, TokenCache(cache_dir()), field="--data")
    windows = eval_sequences(files, tok.eos_id, 2 * RAW_PROMPT_TOKENS, packed=True)
    rows = heldout_prompts(windows, prompts)
    if not rows:
        raise UserError("--data: no held-out prompt (expected at least 4 tokens of text)")
    dev = resolve_device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    student = load_model(model_dir, dev, dtype).eval()
    teach = load_model(teacher_dir, dev, dtype).eval()
    batch = min(32, 1 << max(0, len(rows) - 1).bit_length())
    max_len = max(len(r) for r in rows) + max_new_tokens
    prepare_speculative_kernels(teach, student, batch, max(len(r) for r in rows), max_len + k + 1, k)
    stops = {tok.eos_id} if tok.eos_id is not None else set()
    out = draft_report(
        teach,
        student,
        rows,
        draft_tokens=k,
        max_new_tokens=max_new_tokens,
        stop_ids=stops,
        pad_id=tok.eos_id or 0,
        seed=seed,
    )
    out.update(model=str(model_dir), draft_for=str(teacher_dir), data=[str(d) for d in data], device=str(dev))
    return out


# -- a run's summary ------------------------------------------------------------------------------
SUMMARY_PROMPTS = 8  # held-out prompts (the first ones, as the run's samples take them)
SUMMARY_NEW_TOKENS = 32  # new tokens per prompt
SUMMARY_DRAFT_TOKENS = 4  # K


def run_acceptance(run: Any) -> dict[str, Any]:
    """summary.json's `draft`: the trained student's greedy acceptance as its teacher's draft on the
    first SUMMARY_PROMPTS held-out prompts, SUMMARY_NEW_TOKENS tokens each, K = SUMMARY_DRAFT_TOKENS, on
    the PyTorch reference path (no kernel is compiled after the seal). Skipped, with the reason, when the
    teacher is a cache, has another tokenizer, the student is sharded (torchrun) or there is no held-out
    text; for a mixture, against teachers[0]."""
    ctx = run.ctx
    setting: dict[str, Any] = {
        "mode": "greedy",
        "draft_tokens": SUMMARY_DRAFT_TOKENS,
        "max_new_tokens": SUMMARY_NEW_TOKENS,
    }
    why = None
    prompts: list[list[int]] = []
    if ctx.cache is not None or ctx.teacher is None:
        why = "the teacher is a cache (teacher.cache): no teacher model to verify drafts"
    elif ctx.cross is not None:
        why = "the teacher has another tokenizer (kd.cross_tokenizer): it cannot verify the student's tokens"
    elif dist.active():
        why = "the student is sharded (torchrun)"
    else:
        held = getattr(run.held, "sequences", None)
        prompts = sample_prompts(held, SUMMARY_PROMPTS) if held is not None else []
        if not prompts:
            why = "no held-out prompts"
    if why is not None:
        return {**setting, "skipped": why}
    tok = run.tokenizer
    eos = getattr(tok, "eos_id", None)
    was_training = ctx.student.training
    ctx.student.eval()
    try:
        with runtime.using(mode="reference"), torch.no_grad():
            res = draft_report(
                ctx.teacher,
                ctx.student,
                prompts,
                draft_tokens=SUMMARY_DRAFT_TOKENS,
                max_new_tokens=SUMMARY_NEW_TOKENS,
                stop_ids={eos} if eos is not None else set(),
                pad_id=eos or 0,
                temperatures=(0.0,),
                costs=False,
                cuda_graphs="off",  # a few rounds: no graph pools beside the run's
            )["greedy"]
    except torch.OutOfMemoryError:
        return {**setting, "skipped": "out of device memory for the decode copies of the weights"}
    finally:
        ctx.student.train(was_training)
    return {**setting, **res}
