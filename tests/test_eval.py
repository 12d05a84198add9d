"""kdistill.scoring and `kdistill eval` (kdistill.commands.eval): cross-entropy equals transformers' loss with
labels=input_ids."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest
import torch

from kdistill.cli import main
from kdistill.models.hf_io import load_model
from kdistill.models.tokenizer import load_tokenizer
from kdistill.scoring import evaluate
from tests.tiny import corpus_text, load_hf, make_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("m"), family="qwen2", tokenizer_vocab=320, seed=3)


@pytest.fixture(scope="module")
def hf(model_dir):
    return load_hf(model_dir)


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KDISTILL_CACHE_DIR", str(tmp_path / "cache"))


def _hf_loss(hf, ids):
    t = torch.tensor([list(map(int, ids))])
    with torch.no_grad():
        return float(hf(t, labels=t).loss)


def _eval_json(capsys, *argv):
    rc = main(["eval", "--device", "cpu", "--json", *argv])
    out = capsys.readouterr()
    assert rc == 0, out.err
    return json.loads(out.out)


def test_single_line_equals_transformers(model_dir, hf, tmp_path, capsys):
    text = corpus_text(60, seed=5)
    (tmp_path / "one.jsonl").write_text(json.dumps({"text": text}) + "\n")
    ids = load_tokenizer(model_dir).encode(text)[:64]
    r = _eval_json(
        capsys,
        "--model",
        str(model_dir),
        "--data",
        str(tmp_path / "one.jsonl"),
        "--no-pack",
        "--seq-len",
        "64",
    )
    assert r["tokens"] == len(ids) - 1
    assert abs(r["loss"] - _hf_loss(hf, ids)) < 1e-4
    assert abs(r["perplexity"] - math.exp(r["loss"])) < 1e-6 * r["perplexity"]


def test_many_lines_token_weighted_like_transformers(model_dir, hf, tmp_path, capsys):
    rng = np.random.default_rng(0)
    lines = [rng.integers(0, 320, size=n).tolist() for n in (2, 5, 17, 40, 40, 90, 3)]
    p = tmp_path / "ids.jsonl"
    p.write_text("".join(json.dumps({"input_ids": x}) + "\n" for x in lines))
    seq_len = 33  # the 40- and 90-token lines are truncated
    r = _eval_json(
        capsys,
        "--model",
        str(model_dir),
        "--data",
        str(p),
        "--no-pack",
        "--seq-len",
        str(seq_len),
        "--batch-size",
        "2",
    )
    cut = [x[:seq_len] for x in lines]
    weights = [len(x) - 1 for x in cut]
    want = sum(_hf_loss(hf, x) * w for x, w in zip(cut, weights)) / sum(weights)
    assert r["tokens"] == sum(weights) and r["sequences"] == len(lines)
    assert abs(r["loss"] - want) < 1e-4


def test_packed_equals_transformers_over_windows(model_dir, hf, tmp_path, capsys):
    (tmp_path / "d").mkdir()
    for i in range(3):
        (tmp_path / "d" / f"{i}.txt").write_text(corpus_text(40, seed=i))
    tok = load_tokenizer(model_dir)
    stream = []
    for i in range(3):
        stream += tok.encode(corpus_text(40, seed=i)) + [tok.eos_id]
    seq_len = 48
    windows = [stream[lo : lo + seq_len + 1] for lo in range(0, len(stream) - 1, seq_len)]
    windows = [w for w in windows if len(w) >= 2]
    want = sum(_hf_loss(hf, w) * (len(w) - 1) for w in windows) / (len(stream) - 1)
    r = _eval_json(
        capsys, "--model", str(model_dir), "--data", str(tmp_path / "d"), "--seq-len", str(seq_len)
    )
    assert r["packed"] and r["tokens"] == len(stream) - 1
    assert abs(r["loss"] - want) < 1e-4


def test_evaluate_api_array_and_list_agree(model_dir):
    model = load_model(model_dir)
    rng = np.random.default_rng(1)
    seqs = rng.integers(0, 320, size=(5, 17)).astype(np.int64)
    a = evaluate(model, seqs, batch_size=2, device="cpu")
    b = evaluate(model, [s for s in seqs], batch_size=3, device="cpu")
    c = evaluate(model, torch.from_numpy(seqs), batch_size=5, device="cpu")
    assert a["tokens"] == b["tokens"] == c["tokens"] == 5 * 16
    assert abs(a["loss"] - b["loss"]) < 1e-5 and abs(a["loss"] - c["loss"]) < 1e-5


def test_evaluate_chunked_logits(model_dir, monkeypatch):
    import kdistill.scoring as E

    model = load_model(model_dir)
    seqs = np.random.default_rng(2).integers(0, 320, size=(3, 20)).astype(np.int64)
    full = evaluate(model, seqs, 3, "cpu")
    monkeypatch.setattr(E, "LOGITS_BUDGET", 320 * 7)  # 7 tokens per logits chunk
    assert abs(evaluate(model, seqs, 3, "cpu")["loss"] - full["loss"]) < 1e-5


def test_table_output_and_no_progress_bar_off_tty(model_dir, tmp_path, capsys):
    (tmp_path / "t.txt").write_text(corpus_text(80))
    rc = main(["eval", "--model", str(model_dir), "--data", str(tmp_path / "t.txt"), "--seq-len", "32"])
    out = capsys.readouterr()
    assert rc == 0 and out.err == ""  # stderr is not a terminal: no bar
    assert "loss" in out.out and "perplexity" in out.out and "nats/token" in out.out


def test_max_tokens(model_dir, tmp_path, capsys):
    (tmp_path / "t.txt").write_text(corpus_text(200))
    r = _eval_json(
        capsys,
        "--model",
        str(model_dir),
        "--data",
        str(tmp_path / "t.txt"),
        "--seq-len",
        "16",
        "--max-tokens",
        "50",
    )
    assert r["tokens"] == 50


def test_model_without_tokenizer_reads_token_ids(model_dir, hf, tmp_path, capsys):
    bare = tmp_path / "bare"
    shutil.copytree(model_dir, bare)
    (bare / "tokenizer.json").unlink()
    ids = list(range(1, 30))
    (tmp_path / "ids.jsonl").write_text(json.dumps({"input_ids": ids}) + "\n")
    r = _eval_json(
        capsys, "--model", str(bare), "--data", str(tmp_path / "ids.jsonl"), "--no-pack", "--seq-len", "64"
    )
    assert abs(r["loss"] - _hf_loss(hf, ids)) < 1e-4
    (tmp_path / "t.txt").write_text("words")
    rc = main(["eval", "--model", str(bare), "--data", str(tmp_path / "t.txt"), "--seq-len", "8"])
    err = capsys.readouterr().err
    assert rc == 2 and "no tokenizer.json" in err


def test_multiple_data_paths_and_bin(model_dir, hf, tmp_path, capsys):
    from kdistill.data import write_bin

    a, b = list(range(1, 12)), list(range(100, 130))
    write_bin(tmp_path / "s.bin", a)
    (tmp_path / "b.jsonl").write_text(json.dumps({"input_ids": b}) + "\n")
    r = _eval_json(
        capsys,
        "--model",
        str(model_dir),
        "--data",
        str(tmp_path / "s.bin"),
        str(tmp_path / "b.jsonl"),
        "--no-pack",
        "--seq-len",
        "64",
    )
    want = (_hf_loss(hf, a) * 10 + _hf_loss(hf, b) * 29) / 39
    assert r["tokens"] == 39 and abs(r["loss"] - want) < 1e-4


def test_default_seq_len_fits_the_model_and_progress_bar_on_tty(model_dir, tmp_path, capsys, monkeypatch):
    import argparse
    import sys

    from kdistill.commands.eval import eval_command

    (tmp_path / "t.txt").write_text(corpus_text(400))
    args = argparse.Namespace(
        model=str(model_dir),
        data=[str(tmp_path / "t.txt")],
        seq_len=None,
        batch_size=4,
        no_pack=False,
        device="cpu",
        max_tokens=None,
        json=True,
    )
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert eval_command(args) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["seq_len"] == 256  # the tiny model's max_position_embeddings
    assert "eval" in out.err  # the tqdm bar
