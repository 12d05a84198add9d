"""`kdistill eval`: held-out cross-entropy and perplexity of a model directory on data files.

    kdistill eval --model DIR --data FILE [FILE ...] [--seq-len 512] [--no-pack] [--json]
    kdistill eval --model STUDENT --draft-for TEACHER --data FILE [--draft-tokens 4] [--json]

Loads the model and its tokenizer (or, without tokenizer.json, reads token-id data only), reads the data
through the token cache, scores it with kdistill.scoring and prints a table or one JSON object.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from kdistill.acceptance import measure_draft
from kdistill.console import print_json
from kdistill.data import TokenCache, cache_dir, load_files
from kdistill.dtypes import long_name
from kdistill.errors import UserError
from kdistill.generate import resolve_device
from kdistill.models.hf_io import load_model
from kdistill.models.spec import load_spec
from kdistill.models.tokenizer import IdsOnlyTokenizer, load_tokenizer
from kdistill.scoring import eval_sequences, evaluate
from kdistill.speculative import DEFAULT_DRAFT_TOKENS
from kdistill.train.corpus import expand_data_paths


def eval_command(args: Any) -> int:
    """`kdistill eval`: load --model and its tokenizer, read --data, score, print a table or JSON; with
    --draft-for TEACHER, the model's acceptance as TEACHER's draft instead (kdistill.acceptance)."""
    if getattr(args, "draft_for", None):
        return draft_command(args)
    if getattr(args, "draft_tokens", None) is not None:
        raise UserError("--draft-tokens needs --draft-for TEACHER (the model the drafts are for)")
    out = evaluate_model(
        args.model,
        list(args.data),
        seq_len=getattr(args, "seq_len", None),
        batch_size=args.batch_size,
        packed=not args.no_pack,
        device=getattr(args, "device", "auto") or "auto",
        max_tokens=getattr(args, "max_tokens", None),
    )
    if args.json:
        print_json(out)
    else:
        seq_len = out["seq_len"]
        mode = f"packed, seq_len {seq_len}" if out["packed"] else f"one per document, truncated to {seq_len}"
        rows = [
            ("model", out["model"]),
            ("data", ", ".join(out["data"])),
            ("sequences", f"{out['sequences']} ({mode})"),
            ("tokens", f"{out['tokens']:,}"),
            ("loss", f"{out['loss']:.4f} nats/token"),
            ("perplexity", f"{out['perplexity']:.3f}"),
        ]
        for k, v in rows:
            print(f"{k:<11} {v}")
    return 0


def draft_command(args: Any) -> int:
    """`kdistill eval --model STUDENT --draft-for TEACHER --data FILE`: alpha, tokens per verify step and
    the predicted speed-up, greedy and at T = 1, as a table or one JSON object."""
    out = measure_draft(
        args.model,
        args.draft_for,
        list(args.data),
        draft_tokens=DEFAULT_DRAFT_TOKENS if args.draft_tokens is None else args.draft_tokens,
        prompts=args.prompts,
        max_new_tokens=args.max_new_tokens,
        device=getattr(args, "device", "auto") or "auto",
    )
    if args.json:
        print_json(out)
        return 0
    k = out["draft_tokens"]
    print(f"{'draft':<11} {out['model']} for {out['draft_for']} (K = {k} draft tokens per verify step)")
    for mode in [m for m in out if m == "greedy" or m.startswith("t=")]:
        r = out[mode]
        se, tse = r["alpha_se"], r["tokens_per_verify_se"]
        line = (
            f"alpha {r['alpha']:.3f} ± {'n/a' if se is None else f'{se:.3f}'}, tokens per verify "
            f"{r['tokens_per_verify']:.2f} ± {'n/a' if tse is None else f'{tse:.2f}'} (of {k + 1}), "
            f"{r['prompts']} prompts"
        )
        if "predicted_speedup" in r:
            line += (
                f", predicted speed-up {r['predicted_speedup']:.2f}x "
                f"({r['speedup_from_tokens_per_verify']:.2f}x from the measured tokens per verify)"
            )
        print(f"{mode:<11} {line}")
    c = out["costs"]
    print(
        f"{'step costs':<11} draft {c['c_draft']:.2f}, verify {c['c_verify']:.2f} (teacher's one-token step = 1)"
    )
    return 0


def evaluate_model(
    model: str | Path,
    data: list[str],
    *,
    seq_len: int | None = None,
    batch_size: int = 8,
    packed: bool = True,
    device: str = "auto",
    max_tokens: int | None = None,
) -> dict[str, Any]:
    """Score a model directory on data files (`kdistill eval` and `kdistill.evaluate`): loss,
    perplexity, tokens, sequences and what was scored, as one dict."""
    seq_len = None if seq_len is None else int(seq_len)
    batch_size = int(batch_size)
    if seq_len is not None and seq_len < 1:
        raise UserError(f"--seq-len is {seq_len}, expected a positive integer")
    if batch_size < 1:
        raise UserError(f"--batch-size is {batch_size}, expected a positive integer")
    if max_tokens is not None and max_tokens < 1:
        raise UserError(f"--max-tokens is {max_tokens}, expected a positive integer")
    dev = resolve_device(device)
    model_dir = Path(model)
    if not model_dir.is_dir():
        load_model(model_dir)  # raises the loader's one-line error (missing, pickle, GGUF, ...)
    spec = load_spec(model_dir)
    if seq_len is None:  # no --seq-len: 512 or the model's context, whichever is shorter
        seq_len = min(512, spec.max_position_embeddings)
    if seq_len > spec.max_position_embeddings:
        raise UserError(
            f"--seq-len {seq_len} exceeds the model's max_position_embeddings "
            f"({spec.max_position_embeddings}) in {model_dir / 'config.json'}"
        )
    if (model_dir / "tokenizer.json").exists():
        tok: Any = load_tokenizer(model_dir)
        if tok.vocab_size > spec.vocab_size:
            raise UserError(
                f"{model_dir}: tokenizer has {tok.vocab_size} tokens but the model only "
                f"{spec.vocab_size} embedding rows"
            )
    else:
        tok = IdsOnlyTokenizer(spec.vocab_size, str(model_dir))

    # stdlib:heldout / stdlib:train name the demo corpus's splits, as in a run config.
    files, _ = load_files(expand_data_paths(list(data)), tok, TokenCache(cache_dir()), field="--data")
    seqs = eval_sequences(files, tok.eos_id, seq_len, packed=packed, max_tokens=max_tokens or 0)

    dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16
    decoder = load_model(model_dir, device=dev, dtype=dtype)
    decoder.eval()
    result = evaluate(decoder, seqs, batch_size, dev)
    return {
        "loss": result["loss"],
        "perplexity": result["perplexity"],
        "tokens": result["tokens"],
        "sequences": len(seqs),
        "packed": packed,
        "seq_len": seq_len,
        "model": str(model_dir),
        "data": [str(d) for d in data],
        "device": str(dev),
        "dtype": long_name(dtype),
    }
