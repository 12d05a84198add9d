"""A teacher cache is verified when opened: the manifest's fields against each other (mode, k, vocab,
rows, the shard lists), every shard's dtype, shape and size against the manifest, and its sha256 against
the one the manifest records. Each damage is one line naming the shard (or field), never an mmap or
shape error from the loss.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import yaml

from kdistill.errors import UserError
from kdistill.teacher_cache import CHECKED, TeacherCache
from tests.test_train_kit import base_config, one_error_line, run_cli


@pytest.fixture(scope="module")
def caches(tmp_path_factory):
    """An exact and a topk cache of a small config (31 training rows, shards of 8 rows)."""
    from kdistill.cli import main

    root = tmp_path_factory.mktemp("tcv")
    cfg = base_config(root / "run", steps=1)
    cfg["data"]["max_tokens"] = 1024
    (root / "run.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    for mode in ("exact", "topk"):
        argv = ["teacher-cache", str(root / "run.yaml"), "--out", str(root / mode), "--quiet"]
        assert main([*argv, "--mode", mode, "--k", "4", "--shard-rows", "8"]) == 0
    return root


def _copy(caches, mode, tmp_path):
    out = tmp_path / mode
    shutil.copytree(caches / mode, out)
    return out


def _open(root):
    manifest = json.loads((root / "manifest.json").read_text())
    return TeacherCache.open(root, {f: manifest.get(f) for f in CHECKED})


def _edit(root, **fields):
    path = root / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest.update(fields)
    path.write_text(json.dumps(manifest))


def test_a_sound_cache_opens_and_records_a_sha256_per_shard_file(caches):
    for mode, files in (("exact", {"logp.npy"}), ("topk", {"ids.npy", "logp.npy", "rest.npy"})):
        manifest = json.loads((caches / mode / "manifest.json").read_text())
        assert all(set(s["sha256"]) == files for s in manifest["shards"])
        assert all(set(s["sha256"]) == files | {"label.npy"} for s in manifest["heldout"]["shards"])
        cache = _open(caches / mode)
        assert cache.targets(np.array([0, 30])).shape[:2] == (2, 32)


def test_a_truncated_shard_is_named(caches, tmp_path):
    root = _copy(caches, "exact", tmp_path)
    f = root / "shard-00001" / "logp.npy"
    size = f.stat().st_size
    with open(f, "r+b") as fh:
        fh.truncate(size // 2)
    with pytest.raises(
        UserError, match=rf"shard shard-00001: logp.npy is {size // 2} bytes, expected {size} \(truncated"
    ):
        _open(root)


def test_a_flipped_byte_fails_the_sha256(caches, tmp_path):
    root = _copy(caches, "topk", tmp_path)
    f = root / "heldout-00000" / "label.npy"
    data = bytearray(f.read_bytes())
    data[-3] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(UserError, match="shard heldout-00000: label.npy does not match its sha256"):
        _open(root)


@pytest.mark.parametrize(
    "mode,fields,needle",
    [
        ("exact", {"mode": "topk"}, "manifest k is 0 with mode topk, expected an integer in"),
        ("exact", {"k": 8}, "manifest k is 8 with mode exact, expected 0"),
        (
            "topk",
            {"k": 8},
            "shard shard-00000: ids.npy holds <i4 (8, 32, 4), the manifest implies <i4 (8, 32, 8)",
        ),
        (
            "topk",
            {"mode": "sampled"},
            "shard shard-00000: written with the files ids.npy, logp.npy, rest.npy, mode sampled reads ids.npy, logp.npy",
        ),
        ("exact", {"vocab": 99}, "shard shard-00000: logp.npy holds <u2 (8, 32,"),
        ("exact", {"rows": 40}, "manifest shards do not match its rows and shard_rows"),
        ("exact", {"shard_rows": "8"}, "manifest shard_rows is '8', expected a positive integer"),
        ("exact", {"mode": "dense"}, "manifest mode is 'dense', expected one of: exact, topk, sampled"),
    ],
)
def test_an_edited_manifest_is_named(caches, tmp_path, mode, fields, needle):
    root = _copy(caches, mode, tmp_path)
    _edit(root, **fields)
    with pytest.raises(UserError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        _open(root)


def test_a_run_on_a_truncated_cache_is_one_line(caches, tmp_path, capsys):
    root = _copy(caches, "exact", tmp_path)
    with open(root / "shard-00000" / "logp.npy", "r+b") as fh:
        fh.truncate(1000)
    cfg = yaml.safe_load((caches / "run.yaml").read_text())
    cfg["teacher"]["cache"] = str(root)
    cfg["output"]["dir"] = str(tmp_path / "run")
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    rc, _, err = run_cli(capsys, "run", str(tmp_path / "run.yaml"), "--quiet")
    assert rc == 2
    assert one_error_line(err) == (
        f"teacher.cache {root}: shard shard-00000: logp.npy is 1000 bytes, expected "
        f"{(caches / 'exact' / 'shard-00000' / 'logp.npy').stat().st_size} (truncated or damaged): remove the "
        "shard and run kdistill teacher-cache again with the same --out"
    )
    assert not (tmp_path / "run").exists()
