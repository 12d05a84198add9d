"""`kdistill data preview`: the first packed rows of conversation data as the student will see them.

    kdistill data preview --model DIR --data FILE [FILE ...] [-n 3] [--seq-len 512]
                          [--chat-template PATH] [--train-on assistant|last_assistant|all]
                          [--template-kwargs '{"enable_thinking": false}'] [--json]

Renders each conversation with the model's chat template (or --chat-template), tokenizes it with the
answers marked, packs the conversations into --seq-len rows as a run does, and prints the first n
rows: one header per conversation, the learned tokens coloured green on a terminal and wrapped in
[[ ]] otherwise. --json prints per row input_ids, labels (the ignore index, -100, where masked),
position_ids, cu_seqlens and the conversations' boundaries, plus the packing summary. A file whose
conversations carry reasoning or tool fields (or `tools`) that the template does not render gets one
warning (stderr; in --json also under "warnings"). Where conversations have tools, one line per file says
which they render with: the file's (its tools header or Parquet metadata), their own, or the run's
(--template-kwargs' `tools`), by tool name and count of conversations (in --json under "tools").
--seq-len may not exceed the model's context (max_position_embeddings in its config.json).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from kdistill.console import print_json
from kdistill.data.chat import (
    TRAIN_ON,
    Conversation,
    read_conversations,
    sniff_format,
    tokenize_conversation,
    tool_names,
    warn_unrendered,
)
from kdistill.data.chat_pack import pack_conversations, preview_json, render_preview
from kdistill.data.chat_template import load_chat_template
from kdistill.data.sources import expand_paths
from kdistill.errors import UserError
from kdistill.models.spec import load_spec
from kdistill.models.tokenizer import load_tokenizer

# Without the model's config.json, the longest row a preview packs: (rows, T) int64 arrays stay small.
PREVIEW_MAX_SEQ_LEN = 1 << 20


def check_seq_len(seq_len: int, model_dir: Path) -> None:
    """--seq-len against the model's context (max_position_embeddings of its config.json), before any
    row is allocated; a tokenizer-only folder is held to PREVIEW_MAX_SEQ_LEN."""
    if (model_dir / "config.json").is_file():
        limit = load_spec(str(model_dir)).max_position_embeddings
        if seq_len > limit:
            raise UserError(
                f"--seq-len is {seq_len}, expected at most {limit} (max_position_embeddings of "
                f"{model_dir / 'config.json'})"
            )
    elif seq_len > PREVIEW_MAX_SEQ_LEN:
        raise UserError(
            f"--seq-len is {seq_len}, expected at most {PREVIEW_MAX_SEQ_LEN} ({model_dir} has no config.json "
            "to read the model's context from)"
        )


def preview_command(args: Any) -> int:
    """Read --data, render, mask and pack it with --model's tokenizer and template; print n rows."""
    n, seq_len = int(args.n), int(args.seq_len)
    if n < 1:
        raise UserError(f"-n is {n}, expected a positive integer")
    if seq_len < 2:
        raise UserError(f"--seq-len is {seq_len}, expected an integer >= 2")
    if args.train_on not in TRAIN_ON:
        raise UserError(f"--train-on is '{args.train_on}', expected one of: {', '.join(TRAIN_ON)}")
    kwargs = _template_kwargs(getattr(args, "template_kwargs", None))
    model_dir = Path(args.model)
    if not model_dir.is_dir():
        raise UserError(
            f"--model {model_dir}: not a directory, expected a model directory with tokenizer.json"
        )
    check_seq_len(seq_len, model_dir)
    tok = load_tokenizer(model_dir)
    template = load_chat_template(model_dir, args.chat_template, field="--chat-template")
    convs = []
    for spec in expand_paths(args.data, "--data"):
        if sniff_format(spec.path) is None:
            raise UserError(
                f"--data {spec.path}: not a conversation file (expected JSONL/Parquet records with "
                "'messages' or 'prompt' + 'completion')"
            )
        convs.extend(read_conversations(spec.path))
    tokenized = [tokenize_conversation(c, template, tok, args.train_on, kwargs) for c in convs]
    warnings = warn_unrendered(tokenized, template)
    for line in warnings:
        print(f"kdistill: warning: {line}", file=sys.stderr)
    pad = tok.eos_id if tok.eos_id is not None else 0
    rows = pack_conversations(tokenized, seq_len, pad_id=pad)
    tools = tool_sources(convs, kwargs.get("tools"))
    if args.json:
        print_json(
            {
                "template": template.origin,
                "train_on": args.train_on,
                "seq_len": seq_len,
                "ignore_index": rows.ignore_index,
                "rows_total": len(rows),
                "packing_efficiency": rows.efficiency,
                "conversations": rows.conversations,
                "truncated": rows.truncated,
                "dropped": rows.dropped,
                "template_kwargs": kwargs,
                "warnings": warnings,
                "tools": tools,
                "rows": preview_json(rows, n),
            }
        )
        return 0
    print(f"{rows.summary()}; template {template.origin}; train_on={args.train_on}")
    for entry in tools:
        print(describe_tools(entry))
    for r in range(min(n, len(rows))):
        print(render_preview(rows, r, tok.decode))
    return 0


def tool_sources(convs: list[Conversation], run_tools: list[Any] | None) -> list[dict[str, Any]]:
    """Per file whose conversations render with tools: the file's own tool names (None: no file-wide
    tools) and how many conversations take their tools from the record, the file, the run or none."""
    files: dict[str, dict[str, Any]] = {}
    for conv in convs:
        name = conv.source.rsplit(":", 1)[0]
        entry = files.setdefault(
            name,
            {
                "file": name,
                "file_tools": None,
                "conversations": {"record": 0, "file": 0, "run": 0, "none": 0},
            },
        )
        source = conv.tools_from or ("run" if run_tools is not None else "none")
        entry["conversations"][source] += 1
        if source == "file":
            entry["file_tools"] = tool_names(conv.tools or ())
    run_names = tool_names(run_tools or [])
    out = []
    for entry in files.values():
        if entry["conversations"]["none"] < sum(entry["conversations"].values()):
            entry["run_tools"] = run_names if entry["conversations"]["run"] else None
            out.append(entry)
    return out


def describe_tools(entry: dict[str, Any]) -> str:
    """One line for a tool_sources entry, e.g. `tools in a.jsonl: the file's (get_weather) for 3
    conversations, their own for 1`."""
    counts = entry["conversations"]
    names = {"file": entry["file_tools"], "run": entry.get("run_tools")}
    parts = []
    for key, what in (
        ("file", "the file's"),
        ("record", "their own"),
        ("run", "the run's"),
        ("none", "none"),
    ):
        if counts[key]:
            listed = names.get(key)
            label = f"{what} ({', '.join(listed) or 'an empty list'})" if listed is not None else what
            parts.append(f"{label} for {counts[key]}")
    total = sum(counts.values())
    return (
        f"tools in {entry['file']}: "
        + ", ".join(parts)
        + (" conversation" if total == 1 else " conversations")
    )


def _template_kwargs(text: str | None) -> dict[str, Any]:
    """--template-kwargs: a JSON object of template variables."""
    if text is None or text == "":
        return {}
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        raise UserError(
            f"--template-kwargs is not valid JSON, expected an object such as {EXAMPLE}"
        ) from None
    if not isinstance(value, dict):
        raise UserError(f"--template-kwargs is not a JSON object, expected one such as {EXAMPLE}")
    for key in value:
        if not key.isidentifier() or key in ("messages", "add_generation_prompt"):
            raise UserError(
                f"--template-kwargs has key {key!r}, expected template variable names "
                "(not messages or add_generation_prompt)"
            )
    tools = value.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise UserError("--template-kwargs: 'tools' is not a list of tool definitions (objects)")
    return value


EXAMPLE = '{"enable_thinking": false}'
