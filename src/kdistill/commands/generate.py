"""`kdistill generate`: answer prompts with a model directory (our decoder, a KV cache, batched).

    kdistill generate --model DIR --prompt "Hello" [--prompt ...] [--chat] [--max-new-tokens 128]
    kdistill generate --model DIR --messages chats.jsonl --json       # one {"text", "token_ids"} per line
    kdistill generate --model DIR --prompt "Hi" --temperature 0.8 --top-p 0.9 --seed 1
    kdistill generate --model DIR --prompt "Hi" --chat --chat-template chat.jinja   # another template

Greedy by default (temperature 0). A single prompt streams to the terminal as tokens come; several
prompts run as one left-padded batch and print in order. See kdistill.generate.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from kdistill.data.chat_template import using_chat_template
from kdistill.generate import Sampling, generate_texts


def generate_command(args: Any) -> int:
    """Validate the flags, generate, print text (streamed for one prompt) or JSON lines."""
    sampling = Sampling(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
    )
    prompts = list(args.prompt or [])
    single = len(prompts) == 1 and args.messages is None
    stream = single and not args.json

    streamed: list[str] = []

    def on_text(piece: str) -> None:
        streamed.append(piece)
        sys.stdout.write(piece)
        sys.stdout.flush()

    with using_chat_template(getattr(args, "chat_template", None)):
        rows = generate_texts(
            args.model,
            prompts=prompts,
            messages_file=args.messages,
            chat=args.chat,
            sampling=sampling,
            device=args.device,
            on_text=on_text if stream else None,
        )
    if args.json:
        for row in rows:
            print(json.dumps(row, ensure_ascii=False))
    elif stream:
        print(rows[0]["text"][len("".join(streamed)) :])  # a tail the stream held back, if any
    else:
        for i, row in enumerate(rows):
            print(f"--- {i + 1}")
            print(row["text"])
    return 0
