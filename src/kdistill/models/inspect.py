"""What a model is, from its files, without loading any weights (the library part of `kdistill inspect`).

    info = inspect_model("path/to/hf_dir")     # JSON-ready dict
    info = inspect_model("qwen2.5-0.5b")       # a preset: architecture and parameter counts only

For a directory: architecture (from config.json), parameter counts (from the spec), the dtype(s) the
weights are stored in and the embedding rows (from the safetensors headers alone), and the tokenizer's
vocabulary size and identity (sha256 of its vocabulary, merges and added tokens, canonicalised).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

from kdistill.dtypes import SAFETENSORS, long_name
from kdistill.models.hf_io import checkpoint_index
from kdistill.models.presets import PRESETS
from kdistill.models.spec import ModelSpec, load_spec
from kdistill.models.tokenizer import load_tokenizer


def _architecture(spec: ModelSpec) -> dict[str, Any]:
    arch = {
        "arch": spec.arch,
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_layers": spec.num_layers,
        "num_heads": spec.num_heads,
        "num_kv_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "rms_eps": spec.rms_eps,
        "rope_theta": spec.rope_theta,
        "rope_scaling": dataclasses.asdict(spec.rope_scaling) if spec.rope_scaling else None,
        "max_position_embeddings": spec.max_position_embeddings,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "attention_bias": spec.attention_bias,
        "qk_norm": spec.qk_norm,
    }
    return arch


def inspect_model(path_or_preset: str | Path) -> dict[str, Any]:
    """Describe a model directory or preset as a JSON-ready dict.

    Keys: source ("preset" | "directory"), name, architecture, params (spec.param_counts()), and for a
    directory also: weights_dtype (e.g. "bfloat16", or several joined by ","), weight_files,
    tensors, embedding_rows, stored_params, tokenizer_vocab_size, tokenizer_identity (None without a
    tokenizer.json) and vocab_padding (embedding rows beyond the tokenizer's vocabulary).

    Raises:
        UserError: not a preset nor a readable model directory, or a corrupt weight/tokenizer file.
    """
    ref = str(path_or_preset)
    spec = load_spec(ref)
    info: dict[str, Any] = {
        "source": "preset" if ref.lower() in PRESETS and not Path(ref).exists() else "directory",
        "name": spec.name if ref.lower() in PRESETS and not Path(ref).exists() else str(Path(ref)),
        "architecture": _architecture(spec),
        "params": spec.param_counts(),
    }
    if info["source"] == "preset":
        return info
    model_dir = Path(ref) if Path(ref).is_dir() else Path(ref).parent
    entries = checkpoint_index(model_dir)
    dtypes = sorted({long_name(SAFETENSORS[e.dtype]) for e in entries.values()})
    embed = entries.get("model.embed_tokens.weight")
    info.update(
        weights_dtype=",".join(dtypes),
        weight_files=sorted({e.file.name for e in entries.values()}),
        tensors=len(entries),
        stored_params=sum(math.prod(e.shape) for e in entries.values()),
        embedding_rows=embed.shape[0] if embed is not None and embed.shape else None,
        tokenizer_vocab_size=None,
        tokenizer_identity=None,
        vocab_padding=None,
    )
    if (model_dir / "tokenizer.json").is_file():
        tok = load_tokenizer(model_dir)
        info["tokenizer_vocab_size"] = tok.vocab_size
        info["tokenizer_identity"] = tok.identity
        if info["embedding_rows"] is not None:
            info["vocab_padding"] = info["embedding_rows"] - tok.vocab_size
    return info
