"""Two-stage distillation end to end: `kdistill teacher-cache` then `kdistill run teacher.cache=DIR`.

An `exact` cache gives the live teacher's losses step by step (metrics.jsonl) and its held-out evals
(eval.jsonl: student CE, KL to the teacher, teacher CE), to bf16 rounding, and the teacher is never
loaded; `topk` and `sampled` caches train; a cache for another seq_len, data or teacher is a one-line
error naming the field; writing is resumable (complete shards are kept, a missing one is rewritten) and
the shard arrays are memory-mapped .npy files listed by the manifest. The held-out part of the cache:
tests/test_teacher_cache_heldout.py.
"""

from __future__ import annotations

import json
import shutil

import pytest
import yaml

from kdistill.train import recipe
from tests.test_train_kit import base_config, run_cli


def _losses(run_dir):
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [(r["loss"], r["ce"], r["kd"]) for r in rows]


def _evals(run_dir):
    rows = [json.loads(x) for x in (run_dir / "eval.jsonl").read_text().splitlines() if x.strip()]
    return [(r["step"], r["student_loss"], r["kl_to_teacher"], r["teacher_loss"]) for r in rows]


def _write(tmp_path, cfg, name="run.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def _cache(capsys, cfg_path, out, *extra):
    rc, stdout, err = run_cli(
        capsys, "teacher-cache", str(cfg_path), "--out", str(out), "--quiet", "--json", *extra
    )
    assert rc == 0, err
    return json.loads(stdout)


def test_exact_cache_gives_the_live_teachers_losses(tmp_path, capsys, monkeypatch):
    cfg = base_config(tmp_path / "live", steps=5, eval_every=2)
    live_path = _write(tmp_path, cfg)
    rc, _, err = run_cli(capsys, "run", str(live_path), "--quiet")
    assert rc == 0, err

    info = _cache(capsys, live_path, tmp_path / "tc", "--mode", "exact", "--shard-rows", "7")
    assert info["mode"] == "exact" and info["written_shards"] >= 2
    manifest = json.loads((tmp_path / "tc" / "manifest.json").read_text())
    assert (
        manifest["complete"]
        and manifest["seq_len"] == 32
        and len(manifest["shards"]) + len(manifest["heldout"]["shards"]) == info["written_shards"]
    )

    loaded = {}
    real = recipe.load_models

    def spy(*a, **kw):
        out = real(*a, **kw)
        loaded["teacher"] = out[0]
        return out

    monkeypatch.setattr(recipe, "load_models", spy)
    cfg["output"]["dir"] = str(tmp_path / "cached")
    rc, _, err = run_cli(
        capsys, "run", str(_write(tmp_path, cfg, "c.yaml")), f"teacher.cache={tmp_path / 'tc'}", "--quiet"
    )
    assert rc == 0, err
    assert loaded["teacher"] is None  # the teacher was never loaded
    live, cached = _losses(tmp_path / "live"), _losses(tmp_path / "cached")
    assert len(live) == len(cached) == 5
    for a, b in zip(live, cached):
        for x, y in zip(a, b):
            assert abs(x - y) <= 2e-2 * max(1.0, abs(x)), (a, b)
    # the held-out evals (steps 2, 4 and the final one) report the live run's fields and values
    live, cached = _evals(tmp_path / "live"), _evals(tmp_path / "cached")
    assert [r[0] for r in live] == [r[0] for r in cached] == [2, 4, 5]
    for a, b in zip(live, cached):
        for x, y in zip(a[1:3], b[1:3]):  # student CE and KL: the students differ by bf16-rounded targets
            assert abs(x - y) <= 1e-3 * max(1.0, abs(x)), (a, b)  # measured: 1e-4 after 5 steps
        assert abs(a[3] - b[3]) <= 1e-5 * abs(a[3]), (a, b)  # teacher CE: fp32 log-probs of the labels
    summary = json.loads((tmp_path / "cached" / "summary.json").read_text())
    assert summary["status"] == "completed"
    assert set(summary["heldout"]) == {"student_loss", "teacher_loss", "kl_to_teacher"}


@pytest.mark.parametrize("mode", ["topk", "sampled"])
def test_sparse_caches_train(tmp_path, capsys, mode):
    cfg = base_config(tmp_path / "run", steps=4)
    path = _write(tmp_path, cfg)
    info = _cache(capsys, path, tmp_path / "tc", "--mode", mode, "--k", "8")
    assert info["bytes_per_token"] < 8 * 8 + 8 + 200  # ids + values (+ rest) per token, plus .npy headers
    rc, _, err = run_cli(capsys, "run", str(path), f"teacher.cache={tmp_path / 'tc'}", "--quiet")
    assert rc == 0, err
    losses = _losses(tmp_path / "run")
    assert len(losses) == 4 and all(x[2] > 0 for x in losses)


def test_cache_for_another_config_is_refused(tmp_path, capsys):
    cfg = base_config(tmp_path / "run", steps=2)
    path = _write(tmp_path, cfg)
    _cache(capsys, path, tmp_path / "tc", "--mode", "topk", "--k", "4")
    rc, _, err = run_cli(
        capsys, "run", str(path), f"teacher.cache={tmp_path / 'tc'}", "data.seq_len=16", "--quiet"
    )
    assert rc == 2 and ("made for another data" in err or "made for another seq_len" in err), err
    assert len(err.strip().splitlines()) == 1
    rc, _, err = run_cli(
        capsys, "run", str(path), f"teacher.cache={tmp_path / 'tc'}", "kd.temperature=3", "--quiet"
    )
    assert rc == 2 and "made for another temperature" in err, err
    manifest = tmp_path / "tc" / "manifest.json"
    m = json.loads(manifest.read_text())
    m["teacher"] = "0" * 64
    manifest.write_text(json.dumps(m))
    rc, _, err = run_cli(capsys, "run", str(path), f"teacher.cache={tmp_path / 'tc'}", "--quiet")
    assert rc == 2 and "made for another teacher" in err, err
    rc, _, err = run_cli(capsys, "run", str(path), f"teacher.cache={tmp_path / 'nothing'}", "--quiet")
    assert rc == 2 and "no manifest.json" in err, err


def test_writing_is_resumable(tmp_path, capsys):
    cfg = base_config(tmp_path / "run", steps=2)
    path = _write(tmp_path, cfg)
    first = _cache(capsys, path, tmp_path / "tc", "--mode", "sampled", "--k", "4", "--shard-rows", "5")
    shards = sorted(p for p in (tmp_path / "tc").iterdir() if p.is_dir())
    kept = (shards[0] / "ids.npy").stat().st_mtime_ns
    before = (shards[1] / "ids.npy").read_bytes()
    shutil.rmtree(shards[1])  # as if interrupted before this shard was renamed into place
    again = _cache(capsys, path, tmp_path / "tc", "--mode", "sampled", "--k", "4", "--shard-rows", "5")
    assert again["written_shards"] == 1 and first["written_shards"] == len(shards)
    assert (shards[0] / "ids.npy").stat().st_mtime_ns == kept
    assert (shards[1] / "ids.npy").read_bytes() == before  # the draws depend on the shard, not the order
    rc, _, err = run_cli(
        capsys, "teacher-cache", str(path), "--out", str(tmp_path / "tc"), "--mode", "topk", "--quiet"
    )
    assert rc == 2 and "mode=sampled" in err, err
