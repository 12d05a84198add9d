"""`kdistill inspect DIR|PRESET`: what a model is, from its files, without loading any weights.

    kdistill inspect path/to/hf_dir            # readable table
    kdistill inspect qwen2.5-0.5b --json       # a preset: architecture and parameter counts only

The facts come from kdistill.models.inspect.inspect_model; this module prints them.
"""

from __future__ import annotations

import argparse
from typing import Any

from kdistill.console import print_json
from kdistill.models.inspect import inspect_model


def inspect_command(args: argparse.Namespace) -> int:
    """`kdistill inspect DIR [--json]`: print inspect_model() as a table or as one JSON object."""
    info = inspect_model(args.model)
    if getattr(args, "json", False):
        print_json(info)
    else:
        print(format_table(info))
    return 0


def format_table(info: dict[str, Any]) -> str:
    """inspect_model() as aligned "name  value" rows."""
    rows: list[tuple[str, Any]] = [("model", info["name"]), ("source", info["source"])]
    a = info["architecture"]
    rows += [
        ("architecture", a["arch"]),
        ("layers", a["num_layers"]),
        ("hidden / intermediate", f"{a['hidden_size']} / {a['intermediate_size']}"),
        ("heads (q / kv) x head_dim", f"{a['num_heads']} / {a['num_kv_heads']} x {a['head_dim']}"),
        ("rope theta", f"{a['rope_theta']:g}" + (" (llama3 scaling)" if a["rope_scaling"] else "")),
        ("rms eps", f"{a['rms_eps']:g}"),
        ("tied embeddings", a["tie_word_embeddings"]),
        ("q/k/v bias, qk-norm", f"{a['attention_bias']}, {a['qk_norm']}"),
        ("vocab (config)", a["vocab_size"]),
    ]
    p = info["params"]
    rows += [
        ("params total", f"{p['total']:,}"),
        ("params non-embedding", f"{p['non_embedding']:,}"),
        ("params embedding / lm_head", f"{p['embedding']:,} / {p['lm_head']:,}"),
    ]
    if info["source"] == "directory":
        rows += [
            ("weights dtype", info["weights_dtype"]),
            ("weight files", ", ".join(info["weight_files"])),
            ("tensors / stored params", f"{info['tensors']} / {info['stored_params']:,}"),
            ("embedding rows", info["embedding_rows"]),
            (
                "tokenizer vocab",
                info["tokenizer_vocab_size"] if info["tokenizer_vocab_size"] is not None else "none",
            ),
            ("vocab padding", info["vocab_padding"] if info["vocab_padding"] is not None else "-"),
            ("tokenizer identity", info["tokenizer_identity"] or "none (no tokenizer.json)"),
        ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
