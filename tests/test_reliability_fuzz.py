"""Faults and mutants through the real CLI entry: every write site of a tiny run fails in turn with
ENOSPC then EROFS (one line, exit 2, no temp left, and the run resumes or reruns), and seeded mutants of
every file kdistill reads (run config, config.json, tokenizer.json, shard index, checkpoint state.json,
metrics.jsonl, summary.json) end in kdistill's one-line error or a success, never a traceback.

In-process (`cli.main`) for speed; a bounded number of mutants per file kind.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
from pathlib import Path

import pytest

from tests.fuzz_util import json_mutants, yaml_mutants
from tests.test_train_kit import assets, base_config, one_error_line, run_cli, write_config  # noqa: F401

PER_KIND = 25  # mutants per file kind


def _write_sites(tmp_path: Path, capsys) -> list[tuple[int, str]]:
    """(write number, site kind) of the first write of each kind in a 4-step run."""
    log = tmp_path / "writes.log"
    cfg = write_config(tmp_path / "probe", steps=2, checkpoint_every=1, eval_every=1)
    os.environ["KDISTILL_TEST_WRITE_LOG"] = str(log)
    try:
        assert (
            run_cli(capsys, "run", str(cfg), f"data.cache_dir={tmp_path / 'probe' / 'cache'}", "--quiet")[0]
            == 0
        )
    finally:
        del os.environ["KDISTILL_TEST_WRITE_LOG"]
    seen: dict[str, int] = {}
    for line in log.read_text().splitlines():
        n, path = line.split("\t", 1)
        kind = re.sub(r"step-\d+|tmp-[0-9a-f]+|\d{3,}", "#", Path(path).name)
        seen.setdefault(kind, int(n))
    return sorted((n, k) for k, n in seen.items())


def test_each_write_site_fails_with_one_line_and_nothing_is_lost(tmp_path, capsys):
    from kdistill.fileio import inject_write_faults
    from kdistill.train.checkpoint import list_checkpoints

    sites = _write_sites(tmp_path, capsys)
    assert len(sites) >= 8, sites
    # ENOSPC at every site, EROFS at every fourth one (the test's time stays bounded).
    cases = [(site, "ENOSPC") for site in sites] + [(site, "EROFS") for site in sites[1::4]]
    for i, ((nth, kind), errno_name) in enumerate(cases):
        root = tmp_path / f"f{i}"
        cfg = write_config(root, steps=2, checkpoint_every=1, eval_every=1)
        cache = f"data.cache_dir={root / 'cache'}"  # a fresh cache: every run writes the same sequence
        with inject_write_faults(errno_name, nth):
            rc, _, err = run_cli(capsys, "run", str(cfg), cache, "--quiet")
        if kind.endswith(".kdc"):  # the tokenized-data cache is optional: a warning, and the run goes on
            assert rc == 0, err
            continue
        assert rc == 2, (kind, errno_name, err)
        one_error_line(err)
        run = root / "run"
        left = [str(p) for p in root.rglob("*") if ".tmp" in p.name]
        assert not left, (kind, errno_name, left)
        if list_checkpoints(run):
            again = ["--resume", str(run)]
        else:  # failed before its first checkpoint: started afresh (--overwrite if steps were logged)
            again = [str(cfg), cache, "--overwrite"]
        rc, _, err = run_cli(capsys, "run", *again, "--quiet")
        assert rc == 0, (kind, errno_name, err)
        assert json.loads((run / "summary.json").read_text())["status"] == "completed"


def _only_user_errors(capsys, argv: list[str], label: str) -> None:
    rc, _, err = run_cli(capsys, *argv)
    assert "Traceback" not in err, (label, err[-2000:])
    if rc != 0:
        assert rc == 2, (label, rc, err[-500:])
        errors = [ln for ln in err.splitlines() if ln.startswith("kdistill: error: ")]
        assert len(errors) == 1 and err.strip().splitlines()[-1] == errors[0], (label, err[-500:])


def _sample(mutants, n: int = PER_KIND):
    return list(itertools.islice(mutants, 0, 7 * n, 7))  # lazily: the generators are long


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    from kdistill.cli import main

    root = tmp_path_factory.mktemp("fuzz-run")
    cfg = write_config(root, steps=2)
    assert main(["run", str(cfg), "--quiet"]) == 0
    return cfg, root / "run"


def test_fuzz_run_config(tmp_path, capsys):
    doc = base_config(tmp_path / "run", steps=1)
    doc["data"]["heldout"] = []
    for i, (label, text) in enumerate(_sample(yaml_mutants(doc, seed=1))):
        path = tmp_path / f"m{i}.yaml"
        path.write_text(text)
        _only_user_errors(capsys, ["plan", str(path), "--json"], label)


@pytest.mark.parametrize("name", ["config.json", "tokenizer.json"])
def test_fuzz_model_files(tmp_path, capsys, name):
    src = assets().teacher
    doc = json.loads((src / name).read_text())
    for i, (label, text) in enumerate(_sample(json_mutants(doc, seed=2), 12)):
        model = tmp_path / f"m{i}"
        shutil.copytree(src, model)
        (model / name).write_text(text)
        _only_user_errors(capsys, ["inspect", str(model), "--json"], f"{name} {label}")
        if name == "tokenizer.json":
            cfg = write_config(tmp_path / f"c{i}", steps=1)
            _only_user_errors(capsys, ["run", str(cfg), f"teacher.path={model}", "--quiet"], label)


def test_fuzz_shard_index(tmp_path, capsys):
    src = assets().teacher
    names = json.loads(json.dumps({"metadata": {}, "weight_map": {}}))
    from safetensors import safe_open

    with safe_open(str(src / "model.safetensors"), "pt") as f:
        names["weight_map"] = {k: "model.safetensors" for k in f.keys()}
    for i, (label, text) in enumerate(_sample(json_mutants(names, seed=3), 15)):
        model = tmp_path / f"m{i}"
        shutil.copytree(src, model)
        (model / "model.safetensors.index.json").write_text(text)
        _only_user_errors(capsys, ["inspect", str(model), "--json"], label)


@pytest.mark.parametrize("name", ["state.json", "metrics.jsonl", "summary.json"])
def test_fuzz_run_files(finished, tmp_path, capsys, name):
    _, run = finished
    rel = Path("checkpoints/step-0000002/state.json") if name == "state.json" else Path(name)
    original = (run / rel).read_text()
    if name == "metrics.jsonl":
        doc = {"rows": [json.loads(x) for x in original.splitlines()]}
    else:
        doc = json.loads(original)
    for i, (label, text) in enumerate(_sample(json_mutants(doc, seed=4), 12)):
        copy = tmp_path / f"r{i}"
        shutil.copytree(run, copy)
        if name == "metrics.jsonl":
            try:
                rows = json.loads(text)["rows"]
                text = "".join(json.dumps(r) + "\n" for r in rows) if isinstance(rows, list) else text
            except (ValueError, TypeError, KeyError):
                pass
        (copy / rel).write_text(text)
        _only_user_errors(capsys, ["report", str(copy), "--json"], f"{name} {label}")
        if name != "summary.json" and i < 4:  # resume runs setup: a few mutants only
            _only_user_errors(capsys, ["run", "--resume", str(copy), "schedule.steps=3", "--quiet"], label)
        shutil.rmtree(copy)
