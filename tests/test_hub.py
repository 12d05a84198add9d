"""Hugging Face Hub names resolved offline, from a cache laid out exactly as huggingface_hub lays it out:

<HF_HUB_CACHE>/models--org--name/blobs/<sha256>            file contents
<HF_HUB_CACHE>/models--org--name/refs/<branch>              a commit hash
<HF_HUB_CACHE>/models--org--name/snapshots/<commit>/<file>  symlink -> ../../blobs/<sha256>
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path

import pytest

from kdistill.errors import UserError
from kdistill.models import hub
from kdistill.models.hub import ResolvedModel, parse_hub_name, resolve_model_path
from tests.tiny import make_tiny_model

MAIN = "a" * 39 + "1"
DEV = "b" * 39 + "2"


def add_snapshot(cache: Path, repo_id: str, commit: str, src: Path, refs: tuple[str, ...] = ()) -> Path:
    """Put the files of `src` into the cache as the snapshot `commit` of `repo_id`, named by `refs`."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    blobs, snap = repo / "blobs", repo / "snapshots" / commit
    blobs.mkdir(parents=True, exist_ok=True)
    snap.mkdir(parents=True)
    for f in sorted(src.iterdir()):
        data = f.read_bytes()
        blob = blobs / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snap / f.name).symlink_to(Path("..") / ".." / "blobs" / blob.name)
    for ref in refs:
        (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)  # huggingface_hub writes no trailing newline
    return snap


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), family="qwen2", name="m")


@pytest.fixture
def cache(tmp_path: Path, tiny: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "hf" / "hub"
    add_snapshot(cache, "org/tiny", MAIN, tiny, refs=("main",))
    other = tmp_path / "other"
    shutil.copytree(tiny, other)
    cfg = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 1}))
    add_snapshot(cache, "org/tiny", DEV, other, refs=("dev", "v1.0"))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def layers(path: Path) -> int:
    return json.loads((path / "config.json").read_text())["num_hidden_layers"]


def test_a_name_resolves_to_the_main_snapshot(cache: Path, tiny: Path) -> None:
    m = resolve_model_path("org/tiny", field="teacher.path")
    assert m == ResolvedModel(
        path=cache / "models--org--tiny" / "snapshots" / MAIN,
        repo_id="org/tiny",
        revision="main",
        commit=MAIN,
    )
    assert (m.path / "model.safetensors").read_bytes() == (tiny / "model.safetensors").read_bytes()
    assert m.manifest() == {"path": str(m.path), "repo_id": "org/tiny", "revision": "main", "commit": MAIN}


@pytest.mark.parametrize("rev", ["dev", "v1.0", DEV])
def test_a_revision_resolves_by_branch_tag_or_commit(cache: Path, rev: str) -> None:
    m = resolve_model_path(f"org/tiny@{rev}", field="student.path")
    assert (m.repo_id, m.revision, m.commit) == ("org/tiny", rev, DEV)
    assert layers(m.path) == 1
    assert layers(resolve_model_path(f"org/tiny@{MAIN}", field="student.path").path) == 2


def test_hf_home_is_honoured_when_hf_hub_cache_is_unset(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert resolve_model_path("org/tiny", field="teacher.path").commit == MAIN


def test_the_model_loads_from_the_resolved_snapshot(cache: Path, tiny: Path) -> None:
    from transformers import AutoConfig

    m = resolve_model_path("org/tiny", field="teacher.path")
    assert AutoConfig.from_pretrained(m.path).num_hidden_layers == 2


def one_line_error(text: str, field: str = "teacher.path") -> str:
    with pytest.raises(UserError) as e:
        resolve_model_path(text, field=field)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_a_missing_model_offline_is_one_line_naming_id_revision_and_cache(cache: Path) -> None:
    msg = one_line_error("org/absent")
    assert "teacher.path" in msg and "org/absent" in msg and "revision main" in msg and str(cache) in msg
    assert "HF_HUB_OFFLINE" in msg
    msg = one_line_error("org/tiny@nope", field="student.path")
    assert "student.path" in msg and "org/tiny" in msg and "revision nope" in msg and str(cache) in msg


def test_an_incomplete_cached_snapshot_offline_names_what_is_missing(cache: Path) -> None:
    snap = cache / "models--org--tiny" / "snapshots" / MAIN
    (snap / "model.safetensors").unlink()
    msg = one_line_error("org/tiny")
    assert "safetensors" in msg and str(snap) in msg and "HF_HUB_OFFLINE" in msg


def test_online_a_missing_model_is_downloaded_with_only_the_files_kdistill_reads(
    cache: Path, tiny: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import huggingface_hub

    calls: list[dict] = []

    def fake_snapshot_download(repo_id: str, **kw):
        calls.append({"repo_id": repo_id, **kw})
        return str(add_snapshot(Path(kw["cache_dir"]), repo_id, "c" * 40, tiny, refs=(kw["revision"],)))

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    m = resolve_model_path("org/new@v2", field="teacher.path")
    assert (m.repo_id, m.revision, m.commit) == ("org/new", "v2", "c" * 40)
    (call,) = calls
    assert call["cache_dir"] == str(cache) and call["revision"] == "v2"
    allow = set(call["allow_patterns"])
    assert {"*.safetensors", "*.safetensors.index.json", "config.json", "generation_config.json"} <= allow
    assert {
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "chat_template.jinja",
    } <= allow
    assert not any("bin" in p or "pt" in p.split(".")[-1] for p in allow)
    # cached now: a second resolution needs no download
    assert resolve_model_path("org/new@v2", field="teacher.path").commit == "c" * 40
    assert len(calls) == 1


def test_online_a_hub_failure_is_one_line(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub

    def fails(repo_id: str, **kw):
        raise huggingface_hub.errors.LocalEntryNotFoundError("Cannot find the requested files.\nmore text")

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fails)
    msg = one_line_error("org/absent")
    assert "org/absent" in msg and "revision main" in msg and str(cache) in msg
    assert "LocalEntryNotFoundError" in msg


def test_a_local_path_wins_and_is_returned_as_is(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "org" / "tiny").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert resolve_model_path("org/tiny", field="teacher.path") == ResolvedModel(path=Path("org/tiny"))
    assert resolve_model_path(str(tmp_path), field="teacher.path").repo_id is None


def test_a_missing_local_path_is_not_read_as_a_name(cache: Path) -> None:
    for text in ("./org/tiny", "/no/such/dir", "a/b/c", "model", "org/../tiny", "org/tiny@../x"):
        msg = one_line_error(text)
        assert "no such file or directory" in msg and text in msg


def test_without_huggingface_hub_a_name_asks_for_the_extra(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # import raises ImportError
    msg = one_line_error("org/tiny")
    assert "kdistill[hub]" in msg and "org/tiny" in msg
    assert resolve_model_path(str(tmp_path), field="teacher.path").path == tmp_path  # local paths still work


def test_parse_hub_name() -> None:
    assert parse_hub_name("Qwen/Qwen2.5-0.5B-Instruct") == ("Qwen/Qwen2.5-0.5B-Instruct", None)
    assert parse_hub_name("org/name@refs/pr/1") == ("org/name", "refs/pr/1")
    for bad in ("name", "a/b/c", "/abs/path", "org/na--me", "-org/x", "org/x@", "org/x@a..b"):
        assert parse_hub_name(bad) is None, bad
    assert hub.hub_cache_dir().name  # defined without any env
