"""The held-out part of a teacher cache: `kdistill teacher-cache` writes the teacher's targets for the
held-out rows a run evaluates, and the run's evals then report the live run's fields from them.

- On the same student, the cached eval gives the live teacher's numbers: `exact` the student CE, the KL
  and the teacher CE (to bf16 rounding); `topk` and `sampled` the exact teacher CE, and a KL that is the
  bucket lower bound (exact when k = V - 1) or an unbiased k-sample estimate.
- A cache made for other held-out rows (schedule.eval_batches, schedule.batch_size, the held-out data)
  is a one-line error; `teacher-cache` again on the same --out rewrites the held-out part only.
- A cache written without the held-out part still trains; its evals report the student's CE with one
  log line saying why, and `teacher-cache` again adds the held-out part.
- Held-out shards are written like training shards: atomic, resumable, the same draws when rewritten.
- Under torchrun (4 processes, gloo on the CPU) the cached eval gives the one-process numbers.

Run: .venv/bin/python -m pytest tests/test_teacher_cache_heldout.py -q
"""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml

from kdistill.config import load_config
from kdistill.data import heldout_batches
from kdistill.models.decoder import build_decoder
from kdistill.models.hf_io import load_model
from kdistill.scoring import heldout_eval_cached
from kdistill.teacher_cache import TeacherCache, run_identity
from kdistill.train import recipe
from kdistill.train.step import heldout_eval
from tests.test_distributed import torchrun
from tests.test_train_kit import assets, base_config, one_error_line, run_cli

CPU = torch.device("cpu")


def _config(tmp_path: Path, **schedule: Any) -> tuple[Path, dict[str, Any]]:
    """A run config of the tiny pair over few training rows (data.max_tokens), 3 held-out batches."""
    cfg = base_config(tmp_path / "run", **{"steps": 2, "eval_batches": 3, **schedule})
    cfg["data"]["max_tokens"] = 640
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path, cfg


def _cache(capsys, cfg_path: Path, out: Path, *extra: str, overrides: tuple[str, ...] = ()) -> dict[str, Any]:
    rc, stdout, err = run_cli(
        capsys, "teacher-cache", str(cfg_path), *overrides, "--out", str(out), "--quiet", "--json", *extra
    )
    assert rc == 0, err
    return json.loads(stdout)


def _live_and_cached(cfg_path: Path, cache_dir: Path) -> tuple[dict[str, float], dict[str, float]]:
    """Held-out eval of one random student against the live teacher and against the cache."""
    cfg = load_config(str(cfg_path)).validate()
    _, student_spec, tok, trim = recipe.check_models(cfg, quiet=True)
    data = recipe.load_data(cfg, tok)
    teacher = load_model(cfg.teacher.path, device=CPU, dtype=torch.float32, vocab_rows=trim)
    teacher.eval().requires_grad_(False)
    student = build_decoder(student_spec, device=CPU, dtype=torch.float32, seed=0).eval()
    held = heldout_batches(data.heldout, cfg.schedule.batch_size, cfg.schedule.eval_batches)
    amp = contextlib.nullcontext()
    live = heldout_eval(student, teacher, held, cfg, CPU, amp, with_teacher_loss=True)
    cache = TeacherCache.open(cache_dir, run_identity(cfg, tok.identity, data.train, data.heldout))
    return live, heldout_eval_cached(student, cache, held, cfg, CPU, amp)


def test_exact_cache_eval_is_the_live_teachers(tmp_path, capsys):
    path, _ = _config(tmp_path)
    info = _cache(capsys, path, tmp_path / "tc", "--mode", "exact", "--shard-rows", "5")
    assert info["heldout_rows"] == 12  # 3 batches of 4 rows
    manifest = json.loads((tmp_path / "tc" / "manifest.json").read_text())
    held = manifest["heldout"]
    assert (held["rows"], held["batch_size"], held["eval_batches"], held["temperature"]) == (12, 4, 3, 1.0)
    assert [s["name"] for s in held["shards"]] == ["heldout-00000", "heldout-00001", "heldout-00002"]
    label = np.load(tmp_path / "tc" / "heldout-00000" / "label.npy", mmap_mode="r")
    assert label.shape == (5, 32) and label.dtype == np.float32
    live, cached = _live_and_cached(path, tmp_path / "tc")
    assert set(cached) == set(live) == {"student_loss", "kl_to_teacher", "teacher_loss", "tokens"}
    assert cached["tokens"] == live["tokens"] == 12 * 32
    assert cached["student_loss"] == pytest.approx(live["student_loss"], rel=1e-6)
    assert cached["teacher_loss"] == pytest.approx(live["teacher_loss"], rel=1e-6)
    # the cached log-probs are bf16: the KL differs by their rounding only
    assert cached["kl_to_teacher"] == pytest.approx(live["kl_to_teacher"], rel=2e-3)


@pytest.mark.parametrize("mode, k", [("topk", 8), ("topk", 383), ("sampled", 32)])
def test_sparse_cache_evals(tmp_path, capsys, mode, k):
    path, _ = _config(tmp_path)
    _cache(capsys, path, tmp_path / "tc", "--mode", mode, "--k", str(k))
    live, cached = _live_and_cached(path, tmp_path / "tc")
    assert cached["student_loss"] == pytest.approx(live["student_loss"], rel=1e-6)
    # the teacher's fp32 log-prob of each label is cached in every mode: its CE is exact
    assert cached["teacher_loss"] == pytest.approx(live["teacher_loss"], rel=1e-6)
    kl, want = cached["kl_to_teacher"], live["kl_to_teacher"]
    if mode == "topk" and k == 383:  # V - 1 ids and the one-token remainder: every bucket is one token
        assert kl == pytest.approx(want, rel=1e-4)
    elif mode == "topk":  # the (k + 1)-bucket KL is a lower bound of the KL (data processing)
        assert 0 < kl < want
    else:  # an unbiased k-sample estimate over 384 tokens (seeded draws: deterministic)
        assert kl == pytest.approx(want, rel=0.1)


def _run(capsys, path: Path, cache_dir: Path, run_dir: Path, *overrides: str) -> tuple[int, str]:
    rc, _, err = run_cli(
        capsys, "run", str(path), f"teacher.cache={cache_dir}", f"output.dir={run_dir}", "--quiet", *overrides
    )
    return rc, err


def _eval_rows(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (run_dir / "eval.jsonl").read_text().splitlines() if x.strip()]


def test_a_cache_for_other_heldout_rows_is_one_line(tmp_path, capsys):
    path, cfg = _config(tmp_path)
    tc = tmp_path / "tc"
    _cache(capsys, path, tc, "--mode", "topk", "--k", "4", "--shard-rows", "5")
    rc, err = _run(capsys, path, tc, tmp_path / "a", "schedule.eval_batches=2")
    assert rc == 2
    line = one_error_line(err)
    assert "held-out targets made for another schedule.eval_batches (3, this run has 2)" in line, line
    rc, err = _run(capsys, path, tc, tmp_path / "b", "schedule.batch_size=2")
    assert rc == 2 and "another schedule.batch_size (4, this run has 2)" in one_error_line(err)
    other = tmp_path / "other.txt"
    other.write_text(assets().heldout.read_text(encoding="utf-8")[::-1], encoding="utf-8")
    rc, err = _run(capsys, path, tc, tmp_path / "c", f"data.heldout=[{other}]")
    assert rc == 2 and "another held-out data (12 rows" in one_error_line(err)
    # eval_batches beyond the held-out data (12 batches) evaluate the same 47 rows whatever their number
    info = _cache(capsys, path, tmp_path / "all", "--mode", "exact", overrides=("schedule.eval_batches=20",))
    assert info["heldout_rows"] == 47
    rc, err = _run(capsys, path, tmp_path / "all", tmp_path / "d", "schedule.eval_batches=100")
    assert rc == 0, err

    # teacher-cache again on the same --out for the new eval_batches: the held-out part only
    kept = {p.parent.name: p.stat().st_mtime_ns for p in tc.glob("shard-*/ids.npy")}
    info = _cache(
        capsys,
        path,
        tc,
        "--mode",
        "topk",
        "--k",
        "4",
        "--shard-rows",
        "5",
        overrides=("schedule.eval_batches=2",),
    )
    assert info["heldout_rows"] == 8 and info["written_shards"] == 2
    assert {p.parent.name: p.stat().st_mtime_ns for p in tc.glob("shard-*/ids.npy")} == kept
    assert sorted(p.name for p in tc.glob("heldout-*")) == ["heldout-00000", "heldout-00001"]
    rc, err = _run(capsys, path, tc, tmp_path / "e", "schedule.eval_batches=2")
    assert rc == 0, err
    assert _eval_rows(tmp_path / "e")[-1]["teacher_loss"] > 0


def test_a_cache_without_heldout_targets_reports_the_students_ce(tmp_path, capsys, caplog):
    path, _ = _config(tmp_path)
    tc = tmp_path / "tc"
    _cache(capsys, path, tc, "--mode", "sampled", "--k", "4")
    manifest = json.loads((tc / "manifest.json").read_text())
    for s in manifest.pop("heldout")["shards"]:  # as written before the held-out part existed
        shutil.rmtree(tc / s["name"])
    (tc / "manifest.json").write_text(json.dumps(manifest))
    caplog.clear()
    rc, err = _run(capsys, path, tc, tmp_path / "old")
    assert rc == 0, err
    lines = [r.getMessage() for r in caplog.records if "held-out" in r.getMessage()]
    assert len(lines) == 1 and "holds no held-out targets" in lines[0] and "--out" in lines[0], lines
    row = _eval_rows(tmp_path / "old")[-1]
    assert "student_loss" in row and "teacher_loss" not in row and "kl_to_teacher" not in row

    info = _cache(capsys, path, tc, "--mode", "sampled", "--k", "4")  # adds the held-out part only
    assert info["written_shards"] == 1 and info["heldout_rows"] == 12
    caplog.clear()
    rc, err = _run(capsys, path, tc, tmp_path / "new")
    assert rc == 0, err
    assert not [r for r in caplog.records if "held-out" in r.getMessage()]
    row = _eval_rows(tmp_path / "new")[-1]
    assert row["kl_to_teacher"] > 0 and row["teacher_loss"] > 0
    summary = json.loads((tmp_path / "new" / "summary.json").read_text())
    assert set(summary["heldout"]) == {"student_loss", "teacher_loss", "kl_to_teacher"}


def test_heldout_shards_are_resumable(tmp_path, capsys):
    path, _ = _config(tmp_path)
    tc = tmp_path / "tc"
    first = _cache(capsys, path, tc, "--mode", "sampled", "--k", "4", "--shard-rows", "5")
    before = {a: (tc / "heldout-00001" / f"{a}.npy").read_bytes() for a in ("ids", "logp", "label")}
    kept = (tc / "heldout-00000" / "ids.npy").stat().st_mtime_ns
    shutil.rmtree(tc / "heldout-00001")  # as if interrupted before this shard was renamed into place
    (tc / "heldout-00001.tmp").mkdir()  # with its half-written temporary folder left behind
    (tc / "heldout-00001.tmp" / "ids.npy").write_bytes(b"partial")
    again = _cache(capsys, path, tc, "--mode", "sampled", "--k", "4", "--shard-rows", "5")
    assert again["written_shards"] == 1 and first["written_shards"] > 1
    assert (tc / "heldout-00000" / "ids.npy").stat().st_mtime_ns == kept
    after = {a: (tc / "heldout-00001" / f"{a}.npy").read_bytes() for a in ("ids", "logp", "label")}
    assert after == before  # the draws depend on the shard, not the order
    assert not (tc / "heldout-00001.tmp").exists()
    # the held-out draws are not the training shard's that starts at the same row
    assert before["ids"] != (tc / "shard-00001" / "ids.npy").read_bytes()


@pytest.mark.slow
def test_cached_evals_under_torchrun_match_one_process(tmp_path, capsys):
    # every held-out row: 12 batches of 4, the last of 3 rows, so one of 4 processes has no row of it
    path, _ = _config(tmp_path, eval_batches=20)
    _cache(capsys, path, tmp_path / "tc", "--mode", "topk", "--k", "8")
    rc, err = _run(capsys, path, tmp_path / "tc", tmp_path / "one")
    assert rc == 0, err
    argv = [
        "run",
        str(path),
        f"teacher.cache={tmp_path / 'tc'}",
        f"output.dir={tmp_path / 'four'}",
        "--quiet",
    ]
    r = torchrun(argv, nproc=4)
    assert r.returncode == 0, r.stderr[-3000:]
    one, four = _eval_rows(tmp_path / "one")[-1], _eval_rows(tmp_path / "four")[-1]
    assert four["tokens"] == one["tokens"] == 47 * 32
    for key in ("student_loss", "kl_to_teacher", "teacher_loss"):
        assert four[key] == pytest.approx(one[key], rel=1e-5), key
