"""`kdistill generate`: answer prompts with a model directory (the decode engine: static KV cache,
CUDA-graph steps on a GPU, slots refilled as rows finish).

    kdistill generate --model DIR --prompt "Hello" [--prompt ...] [--chat] [--max-new-tokens 128]
    kdistill generate --model DIR --messages chats.jsonl --json       # one JSON line per answer
    kdistill generate --model DIR --prompt "Hi" --temperature 0.8 --top-p 0.9 --seed 1
    kdistill generate --model TEACHER --messages prompts.jsonl --out answers.jsonl --samples-per-prompt 4
    kdistill generate --model DIR --prompt "Hi" --chat --chat-template chat.jinja   # another template
    kdistill generate --model DIR --prompt "Hi" --kernel-pack pack/    # decode kernels from a kernel pack
    kdistill generate --model TEACHER --draft STUDENT --prompt "Hi" [--draft-tokens 4]   # speculative

Greedy by default (temperature 0). A single prompt streams to the terminal as tokens come; --json
prints each answer as a JSON line as soon as it is complete (its "index" says which prompt); --out
writes a resumable file of conversations with the answers appended (kdistill.answer_file) with a
progress bar on stderr. See kdistill.generate and kdistill.decode.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from kdistill.decode import Sampling
from kdistill.errors import UserError
from kdistill.generate import generate_texts, generate_texts_speculative, generate_to_file
from kdistill.speculative import DEFAULT_DRAFT_TOKENS


def generate_command(args: Any) -> int:
    """Validate the flags, generate, print text (streamed for one prompt) or JSON lines, or write --out;
    with --chat-template PATH, every rendering uses that template."""
    sampling = Sampling(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
    )
    prompts = list(args.prompt or [])
    common = dict(
        prompts=prompts,
        messages_file=args.messages,
        chat=args.chat,
        chat_template=getattr(args, "chat_template", None),
        sampling=sampling,
        device=args.device,
        batch_size=args.batch_size,
        max_length=args.max_length,
        samples_per_prompt=args.samples_per_prompt,
        kernel_pack=getattr(args, "kernel_pack", None),
    )
    draft = getattr(args, "draft", None)
    draft_tokens = getattr(args, "draft_tokens", None)
    if draft is None and draft_tokens is not None:
        raise UserError("--draft-tokens needs --draft DIR (the model that drafts)")
    if draft is not None:
        if args.out:
            raise UserError("--draft does not combine with --out (answer files are written by --model alone)")
    if args.out:

        def print_row(row: dict[str, Any]) -> None:
            print(json.dumps(row, ensure_ascii=False), flush=True)

        m = generate_to_file(
            args.model, args.out, progress=not args.quiet, on_row=print_row if args.json else None, **common
        )
        print(
            f"kdistill: {m['written']} answers in {args.out} ({m.get('tokens_per_s', 0):,.0f} new tokens/s); "
            f"manifest: {args.out}.manifest.json",
            file=sys.stderr,
        )
        return 0
    single = len(prompts) * args.samples_per_prompt == 1 and args.messages is None
    stream = single and not args.json

    streamed: list[str] = []

    def on_text(piece: str) -> None:
        streamed.append(piece)
        sys.stdout.write(piece)
        sys.stdout.flush()

    def on_row(row: dict[str, Any]) -> None:
        print(json.dumps(row, ensure_ascii=False), flush=True)

    callbacks: dict[str, Any] = dict(
        on_text=on_text if stream else None, on_row=on_row if args.json else None
    )
    if draft is not None:
        rows = generate_texts_speculative(
            args.model,
            draft,
            draft_tokens=DEFAULT_DRAFT_TOKENS if draft_tokens is None else draft_tokens,
            **callbacks,
            **common,
        )
    else:
        rows = generate_texts(args.model, **callbacks, **common)
    if args.json:
        return 0
    if stream:
        print(rows[0]["text"][len("".join(streamed)) :])  # a tail the stream held back, if any
    else:
        for i, row in enumerate(rows):
            print(f"--- {i + 1}")
            print(row["text"])
    return 0
