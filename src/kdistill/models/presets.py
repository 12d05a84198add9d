"""Model presets: real shapes of public models by name, as their config.json files give them.

    PRESETS["qwen2.5-0.5b"]        # a config.json dict; load_spec("qwen2.5-0.5b") reads it as a ModelSpec

Pure data (no kdistill imports), so the spec, the planner and the tests share one table.
"""

from __future__ import annotations

from typing import Any


def _qwen2(
    v: int, h: int, i: int, n: int, heads: int, kv: int, tied: bool, max_pos: int = 32768, eps: float = 1e-6
) -> dict[str, Any]:
    return {
        "model_type": "qwen2",
        "architectures": ["Qwen2ForCausalLM"],
        "vocab_size": v,
        "hidden_size": h,
        "intermediate_size": i,
        "num_hidden_layers": n,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "rms_norm_eps": eps,
        "rope_theta": 1000000.0,
        "max_position_embeddings": max_pos,
        "tie_word_embeddings": tied,
        "torch_dtype": "bfloat16",
        "bos_token_id": 151643,
        "eos_token_id": 151643,
    }


def _qwen3(h: int, i: int, n: int, heads: int, kv: int, tied: bool) -> dict[str, Any]:
    return {
        "model_type": "qwen3",
        "architectures": ["Qwen3ForCausalLM"],
        "vocab_size": 151936,
        "hidden_size": h,
        "intermediate_size": i,
        "num_hidden_layers": n,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": 128,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 40960,
        "tie_word_embeddings": tied,
        "torch_dtype": "bfloat16",
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    }


def _llama3(
    h: int, i: int, n: int, heads: int, kv: int, head_dim: int, tied: bool, factor: float
) -> dict[str, Any]:
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 128256,
        "hidden_size": h,
        "intermediate_size": i,
        "num_hidden_layers": n,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": head_dim,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": factor,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "max_position_embeddings": 131072,
        "tie_word_embeddings": tied,
        "torch_dtype": "bfloat16",
        "bos_token_id": 128000,
        "eos_token_id": 128001,
    }


# Real shapes of public models, as their config.json files give them.
PRESETS: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": _qwen2(151936, 896, 4864, 24, 14, 2, True),
    "qwen2.5-1.5b": _qwen2(151936, 1536, 8960, 28, 12, 2, True),
    "qwen2.5-3b": _qwen2(151936, 2048, 11008, 36, 16, 2, True),
    "qwen2.5-7b": _qwen2(152064, 3584, 18944, 28, 28, 4, False, 131072),
    # The base models' config.json (the Instruct ones say rms_norm_eps 1e-6 and 32768 positions).
    "qwen2.5-14b": _qwen2(152064, 5120, 13824, 48, 40, 8, False, 131072, 1e-5),
    "qwen2.5-32b": _qwen2(152064, 5120, 27648, 64, 40, 8, False, 131072, 1e-5),
    "qwen2.5-72b": _qwen2(152064, 8192, 29568, 80, 64, 8, False, 131072, 1e-5),
    "qwen3-0.6b": _qwen3(1024, 3072, 28, 16, 8, True),
    "qwen3-1.7b": _qwen3(2048, 6144, 28, 16, 8, True),
    "qwen3-4b": _qwen3(2560, 9728, 36, 32, 8, True),
    "llama-3.2-1b": _llama3(2048, 8192, 16, 32, 8, 64, True, 32.0),
    "llama-3.2-3b": _llama3(3072, 8192, 28, 24, 8, 128, True, 32.0),
    "llama-3.1-8b": _llama3(4096, 14336, 32, 32, 8, 128, False, 8.0),
}
