"""Build the embedded demo teacher: a byte-level BPE tokenizer and a small Qwen2-style model.

    python scripts/make_demo_teacher.py tokenizer     # CPU, seconds: trains tokenizer.json
    python scripts/make_demo_teacher.py teacher       # GPU, minutes: trains the teacher on the stdlib

Both stages read the train split of the Python standard library (kdistill.train.corpus) and write into
src/kdistill/demo/assets/teacher/, which is committed (kept under 10 MB: bf16 weights).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from kdistill.train.corpus import stdlib_split

ASSETS = Path(__file__).resolve().parents[1] / "src" / "kdistill" / "demo" / "assets" / "teacher"
VOCAB = 4096
EOS = "<|endoftext|>"

# The teacher's architecture (about 4.2M parameters: 8.4 MB in bf16).
TEACHER_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "vocab_size": VOCAB,
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": True,
    "bos_token_id": 0,
    "eos_token_id": 0,
    "torch_dtype": "bfloat16",
    "hidden_act": "silu",
}


def train_tokenizer() -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    train, _ = stdlib_split()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=[EOS],
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([str(p) for p in train], trainer)
    ASSETS.mkdir(parents=True, exist_ok=True)
    tok.save(str(ASSETS / "tokenizer.json"))
    (ASSETS / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "eos_token": EOS,
                "bos_token": None,
                "model_max_length": 1024,
                "tokenizer_class": "PreTrainedTokenizerFast",
            },
            indent=2,
        )
        + "\n"
    )
    print(f"tokenizer: {tok.get_vocab_size()} tokens -> {ASSETS / 'tokenizer.json'}")


def _tokens(files: list[Path], tok) -> np.ndarray:
    eos = tok.token_to_id(EOS)
    out: list[int] = []
    texts = [p.read_text(encoding="utf-8", errors="replace") for p in files]
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        out.extend(enc.ids)
        out.append(eos)
    return np.asarray(out, dtype=np.int64)


def hash_bucket(name: str) -> int:
    """0..99 from a file name, salted differently from the held-out split."""
    import hashlib

    return int.from_bytes(hashlib.sha256(b"val:" + name.encode()).digest()[:8], "little") % 100


def _rows(tokens: np.ndarray, seq_len: int) -> torch.Tensor:
    n = len(tokens) // (seq_len + 1)
    return torch.from_numpy(tokens[: n * (seq_len + 1)]).view(n, seq_len + 1)


def train_teacher(
    minutes: float, seq_len: int, batch: int, lr: float, device: str, out: Path, max_steps: int
) -> None:
    from tokenizers import Tokenizer

    from kdistill.models.decoder import build_decoder
    from kdistill.models.hf_io import save_model
    from kdistill.models.spec import spec_from_hf_config

    torch.manual_seed(0)
    dev = torch.device(device)
    tok = Tokenizer.from_file(str(ASSETS / "tokenizer.json"))
    train_files, held_files = stdlib_split()
    val_files = [p for p in train_files if hash_bucket(p.name) < 5]
    train_files = [p for p in train_files if hash_bucket(p.name) >= 5]
    train, val, held = _tokens(train_files, tok), _tokens(val_files, tok), _tokens(held_files, tok)
    print(f"corpus: {len(train)} train tokens, {len(held)} held-out tokens")
    spec = spec_from_hf_config(TEACHER_CONFIG)
    model = build_decoder(spec, device=dev, dtype=torch.float32, seed=0)
    print(f"teacher: {spec.param_counts()['total'] / 1e6:.2f}M parameters")
    opt = torch.optim.AdamW(
        model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1, fused=dev.type == "cuda"
    )
    train_t = torch.from_numpy(train).to(dev)
    held_t = _rows(held, seq_len).to(dev)
    val_t = _rows(val, seq_len).to(dev)

    def loss_of(x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            h = model(x[:, :-1])
            logits = h @ model.lm_head_weight.t()  # (B, T, V): V is only 4096 here
        return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())

    # Early stopping on a validation split carved out of the TRAIN files (the held-out files stay
    # unseen): a 4M-parameter model memorises 3M tokens within a few epochs.
    start, step, best, best_state = time.time(), 0, float("inf"), None
    budget = minutes * 60
    eval_every = 250 if dev.type == "cuda" else 5
    while time.time() - start < budget and step < max_steps:
        frac = step / max_steps
        for g in opt.param_groups:
            g["lr"] = lr * min(1.0, (step + 1) / 200) * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * frac)))
        idx = torch.randint(0, len(train_t) - seq_len - 1, (batch,), device=dev)
        x = torch.stack([train_t[i : i + seq_len + 1] for i in idx.tolist()])
        loss = loss_of(x)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % eval_every == 0 or step == max_steps:
            with torch.no_grad():
                vl = torch.stack([loss_of(val_t[i : i + 64]) for i in range(0, len(val_t), 64)]).mean().item()
                hl = (
                    torch.stack([loss_of(held_t[i : i + 64]) for i in range(0, len(held_t), 64)])
                    .mean()
                    .item()
                )
            if vl < best:
                best = vl
                best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            print(
                f"step {step} {time.time() - start:.0f}s train {loss.item():.3f} val {vl:.3f} heldout {hl:.3f}",
                flush=True,
            )
    if best_state is not None:
        model.load_state_dict(best_state)
    print(f"kept the weights with the best validation loss {best:.3f}")
    model = model.to(torch.bfloat16).cpu()
    # save_model writes a whole model directory (tokenizer files copied from the assets), so write
    # it beside `out` and swap it in.
    staged = out.with_name(out.name + ".new")
    save_model(model, staged, source_dir=ASSETS)
    if out.exists():
        shutil.rmtree(out)
    staged.rename(out)
    print(f"saved teacher after {step} steps -> {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("stage", choices=["tokenizer", "teacher"])
    ap.add_argument("--minutes", type=float, default=4.0)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=4000)
    ap.add_argument("--out", default=str(ASSETS), help="output folder (default: the package assets)")
    a = ap.parse_args()
    if a.stage == "tokenizer":
        train_tokenizer()
    else:
        train_teacher(a.minutes, a.seq_len, a.batch, a.lr, a.device, Path(a.out), a.steps)


if __name__ == "__main__":
    main()
