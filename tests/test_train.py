"""End-to-end training runs of tiny models saved by transformers, in process via kdistill.cli.main.

A run produces a student that transformers loads and whose held-out loss (computed by transformers) beats
its initial weights, for a student given as an HF directory with weights and as a config.json (random
init); the run directory holds manifest.json, metrics.jsonl, loss.png, summary.json and a report; a padded
teacher vocabulary is trimmed; student.init=teacher_layers copies the teacher's layers; every divergence
trains; checkpoints rotate.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from tests.test_train_kit import assets, base_config, read_summary, run_cli, write_config
from tests.tiny import make_tiny_model


def _heldout_loss_hf(model_dir: Path, seq_len: int = 32) -> float:
    """Mean next-token CE of transformers' own model on the held-out text, packed like kdistill packs."""
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    tok = Tokenizer.from_file(str(assets().teacher / "tokenizer.json"))
    # As kdistill packs the held-out side: the document, EOS, windows of seq_len + 1 with stride seq_len;
    # its held-out eval reads eval_batches (2) x batch_size (4) = 8 of them.
    ids = tok.encode(assets().heldout.read_text()).ids + [tok.token_to_id("<|endoftext|>")]
    n = min(8, (len(ids) - 1) // seq_len)
    rows = torch.tensor([ids[i * seq_len : i * seq_len + seq_len + 1] for i in range(n)])
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=rows[:, :-1]).logits  # (N, T, V)
    return float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten()))


def _write(tmp_path: Path, cfg: dict) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


@pytest.mark.parametrize("student", ["hf-dir", "config-json"])
def test_tiny_run_beats_initial_weights_and_leaves_evidence(tmp_path, capsys, student):
    a = assets()
    cfg = base_config(tmp_path / "run", steps=30, eval_every=10, checkpoint_every=10)
    if student == "hf-dir":
        cfg["student"] = {"path": str(a.student), "init": "auto"}  # weights present: pretrained
        initial = _heldout_loss_hf(a.student)
    else:
        cfg["student"] = {"path": str(a.student_config), "init": "random"}
        # The random init the run starts from (seed 0), exported so transformers scores it.
        from kdistill.models.decoder import build_decoder
        from kdistill.models.hf_io import save_model
        from kdistill.models.spec import load_spec

        init = build_decoder(load_spec(a.student_config), device="cpu", dtype=torch.float32, seed=0)
        save_model(init, tmp_path / "init", source_dir=a.teacher)
        initial = _heldout_loss_hf(tmp_path / "init")
    rc, out, err = run_cli(capsys, "run", str(_write(tmp_path, cfg)), "--quiet")
    assert rc == 0, err
    run = tmp_path / "run"
    assert "status completed: 30 steps" in out

    # The student: a Hugging Face directory transformers loads, better than where it started.
    final = _heldout_loss_hf(run / "student")
    assert final < initial - 0.3, (initial, final)
    summary = read_summary(run)
    assert summary["heldout"]["student_loss"] == pytest.approx(final, rel=1e-4)  # kdistill agrees with HF

    # manifest.json
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["torch"] == torch.__version__ and manifest["device"] == "cpu"
    assert manifest["config"]["schedule"]["steps"] == 30
    assert set(manifest["teacher_files"]) >= {"config.json", "model.safetensors", "tokenizer.json"}
    assert all(len(h) == 64 for h in manifest["teacher_files"].values())
    # metrics.jsonl: one line per step with the fields.
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 31))
    for r in rows:
        for k in ("loss", "ce", "kd", "lr", "grad_norm", "tokens_per_s"):
            assert isinstance(r[k], float) and math.isfinite(r[k]), (k, r)
        assert r["loss"] == pytest.approx(0.5 * r["ce"] + 0.5 * r["kd"], rel=1e-5)  # kd includes T^2
    assert rows[0]["lr"] == pytest.approx(1.5e-3) and rows[1]["lr"] == pytest.approx(3e-3)  # warmup 2
    # loss.png
    png = (run / "loss.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    # summary.json
    assert summary["status"] == "completed" and summary["steps"] == 30
    assert summary["initial_loss"] == rows[0]["loss"]
    assert summary["final_loss"] == pytest.approx(np.mean([r["loss"] for r in rows[-3:]]))
    assert summary["smoke_passed"] is True and summary["final_loss"] < summary["initial_loss"]
    assert summary["tokens_per_s"] > 0 and summary["tokens_seen"] == 30 * 4 * 32
    h = summary["heldout"]
    assert set(h) == {"student_loss", "teacher_loss", "kl_to_teacher"} and h["teacher_loss"] > 0
    assert "arch" not in summary["kernels"]  # no GPU ran
    assert h["kl_to_teacher"] > 0
    assert summary["nonfinite_skipped"] == 0
    # On the CPU nothing compiles (the kernels run on the GPU only): the run reports the reference
    # path, and the compile counter is present in the summary and in every metrics line.
    assert summary["kernels"]["mode"] == "reference" and isinstance(summary["jit_after_prewarm"], int)
    assert all("jit_after_prewarm" in r for r in rows)
    # kdistill report
    rc, out, _ = run_cli(capsys, "report", str(run))
    assert rc == 0
    assert "status      completed" in out and "steps       30" in out and "smoke passed" in out
    assert "checkpoints step-0000020, step-0000030" in out


def test_padded_teacher_vocab_is_trimmed(tmp_path, capsys):
    """Teacher embedding rows = tokenizer + 16 (padding); student rows = tokenizer: trimmed and logged."""
    a = assets()
    teacher = make_tiny_model(tmp_path, "qwen2", tied=False, vocab_pad=16, seed=5, name="padded")
    cfg = base_config(tmp_path / "run", steps=3)
    cfg["teacher"]["path"] = str(teacher)
    rc, out, err = run_cli(capsys, "run", str(_write(tmp_path, cfg)))
    assert rc == 0, err
    from tests.tiny import tokenizer_vocab_size

    v = tokenizer_vocab_size(a.teacher)
    assert f"teacher embedding rows {v + 16} trimmed to {v} (padded vocabulary)" in out
    assert read_summary(tmp_path / "run")["heldout"]["kl_to_teacher"] > 0


@pytest.fixture(scope="module")
def deep_teacher(tmp_path_factory):
    """A 3-layer teacher whose layer shapes a 2-layer student can take."""
    return make_tiny_model(
        tmp_path_factory.mktemp("deep"), "qwen2", tied=True, seed=7, name="t3", num_hidden_layers=3
    )


def test_student_init_from_teacher_layers(tmp_path, capsys, deep_teacher):
    from kdistill.models.decoder import build_decoder
    from kdistill.models.hf_io import load_model
    from kdistill.models.spec import load_spec
    from kdistill.train.loading import init_from_teacher_layers

    student_cfg = tmp_path / "s" / "config.json"
    student_cfg.parent.mkdir()
    hf = json.loads((deep_teacher / "config.json").read_text())
    hf["num_hidden_layers"] = 2
    student_cfg.write_text(json.dumps(hf))
    # The copy itself: layers 0 and 2 of the teacher, embeddings and norm.
    teacher = load_model(deep_teacher, device="cpu", dtype=torch.float32)
    student = build_decoder(load_spec(student_cfg), device="cpu", dtype=torch.float32, seed=0)
    init_from_teacher_layers(student, teacher)
    for dst, src in ((0, 0), (1, 2)):
        sd_s, sd_t = student.model.layers[dst].state_dict(), teacher.model.layers[src].state_dict()
        assert all(torch.equal(sd_s[k], sd_t[k]) for k in sd_t)
    assert torch.equal(student.model.embed_tokens.weight, teacher.model.embed_tokens.weight)
    # Through `kdistill run`: starts near the teacher (its first KD term is small), and trains.
    cfg = base_config(tmp_path / "run", steps=3)
    cfg["teacher"]["path"] = str(deep_teacher)
    cfg["student"] = {"path": str(student_cfg), "init": "teacher_layers"}
    rc, _, err = run_cli(capsys, "run", str(_write(tmp_path, cfg)), "--quiet")
    assert rc == 0, err
    assert read_summary(tmp_path / "run")["steps"] == 3


@pytest.mark.parametrize(
    "divergence", ["forward_kl", "reverse_kl", "jsd", "tvd", "skew_kl", "skew_reverse_kl"]
)
def test_every_divergence_trains(tmp_path, capsys, divergence):
    cfg = write_config(tmp_path, steps=2, grad_accum=2)
    rc, _, err = run_cli(capsys, "run", str(cfg), f"kd.divergence={divergence}", "kd.beta=0.3", "--quiet")
    assert rc == 0, err
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(math.isfinite(r["loss"]) and r["kd"] >= 0 for r in rows)
    assert rows[0]["kd"] > 0


@pytest.mark.parametrize("alpha", ["0", "1"])
def test_alpha_extremes(tmp_path, capsys, alpha):
    cfg = write_config(tmp_path, steps=2)
    rc, _, err = run_cli(capsys, "run", str(cfg), f"kd.alpha={alpha}", "--quiet")
    assert rc == 0, err
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    expect = row["ce"] if alpha == "0" else row["kd"]
    assert row["loss"] == pytest.approx(expect, rel=1e-5)


@pytest.mark.parametrize("keep", [1, 3])
def test_checkpoints_rotate(tmp_path, capsys, keep):
    cfg = write_config(tmp_path, steps=5, checkpoint_every=1)
    rc, _, err = run_cli(capsys, "run", str(cfg), f"output.keep_checkpoints={keep}", "--quiet")
    assert rc == 0, err
    names = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert names == [f"step-{s:07d}" for s in range(6 - keep, 6)]
