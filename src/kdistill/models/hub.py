"""Hugging Face Hub names for model paths: `org/name` and `org/name@revision` to a local directory.

    m = resolve_model_path("Qwen/Qwen2.5-0.5B-Instruct", field="teacher.path")
    m.path      # .../hub/models--Qwen--Qwen2.5-0.5B-Instruct/snapshots/<commit>
    m.commit    # the 40-hex commit the run used, for the run manifest
    resolve_model_path("out/student", field="student.path").path   # an existing local path: as is
    resolve_run_models(cfg)   # teacher.path, every teachers[i].path and student.path of a run config

Order of resolution:
1. An existing local file or directory is the answer, whatever it looks like.
2. `org/name[@revision]` (revision: a branch, a tag or a commit hash; default `main`) is looked up in
   the Hugging Face cache (`HF_HUB_CACHE`, else `HF_HOME/hub`, else `~/.cache/huggingface/hub`), laid
   out as huggingface_hub lays it out: `models--org--name/refs/<revision>` holds the commit and
   `models--org--name/snapshots/<commit>/` the files. A complete snapshot there is used without any
   network access.
3. Otherwise, unless `HF_HUB_OFFLINE=1`, the model is downloaded into that cache with
   `huggingface_hub.snapshot_download`, limited to what kdistill reads: safetensors weights and their
   index, config.json, generation_config.json and the tokenizer files (top-level files only).

Every failure is one line (`UserError`) naming the field, the model id, the revision and the cache
searched. huggingface_hub is optional (the `hub` extra): without it only local paths work.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kdistill.config import RunConfig
from kdistill.errors import UserError
from kdistill.models.presets import PRESETS

# Files kdistill reads from a model repository (fnmatch patterns, top level only: see IGNORE_PATTERNS).
ALLOW_PATTERNS = [
    "*.safetensors",
    "*.safetensors.index.json",
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
]
# fnmatch's `*` crosses `/`: without this, `*.safetensors` would also fetch variants in subfolders.
IGNORE_PATTERNS = ["*/*"]

INDEX_NAME = "model.safetensors.index.json"
_NAME_PART = r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?"
_HUB_NAME = re.compile(rf"^(?P<repo>{_NAME_PART}/{_NAME_PART})(?:@(?P<rev>[A-Za-z0-9._][A-Za-z0-9._/-]*))?$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_TRUE = {"1", "ON", "YES", "TRUE"}


@dataclass(frozen=True)
class ResolvedModel:
    """Where a model path or Hub name points.

    Attributes:
        path: the local directory (or file) to read the model from.
        repo_id: `org/name` when the model came from the Hub (its cache), else None.
        revision: the revision asked for (`main` when none was given), else None.
        commit: the 40-hex commit of the snapshot used, else None.
    """

    path: Path
    repo_id: str | None = None
    revision: str | None = None
    commit: str | None = None

    def manifest(self) -> dict[str, Any]:
        """The entry a run manifest records for this model (JSON-ready)."""
        return {
            "path": str(self.path),
            "repo_id": self.repo_id,
            "revision": self.revision,
            "commit": self.commit,
        }


def parse_hub_name(text: str) -> tuple[str, str | None] | None:
    """(repo_id, revision or None) when `text` reads as `org/name[@revision]`, else None.

    Only the form is checked: whether a local path of that name exists is the caller's question.
    """
    m = _HUB_NAME.match(text.strip())
    if m is None:
        return None
    repo, rev = m.group("repo"), m.group("rev")
    if ".." in repo or "--" in repo or (rev is not None and (".." in rev or rev.endswith("/"))):
        return None
    return repo, rev


def is_hub_name(text: str) -> bool:
    """True when `text` is not an existing local path and reads as `org/name[@revision]`."""
    return not Path(text).expanduser().exists() and parse_hub_name(text) is not None


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache, read from the environment now (as huggingface_hub does at import)."""
    env = os.environ
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if env.get(var):
            return Path(env[var]).expanduser()
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(home).expanduser() / "hub"


def hub_offline() -> bool:
    """True when HF_HUB_OFFLINE asks for no network access."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in _TRUE


def resolve_model_path(text: str, *, field: str) -> ResolvedModel:
    """A model path or Hugging Face Hub name, resolved to a local directory.

    Args:
        text: a local file or directory, or `org/name`, or `org/name@revision`.
        field: the config field it came from (`teacher.path`), named in every error.

    Returns:
        ResolvedModel: the local path, and for a Hub name its id, revision and snapshot commit.

    Raises:
        UserError: (one line) a path that does not exist and is no Hub name; a Hub name without
            huggingface_hub installed; a model neither cached nor downloadable.
    """
    text = str(text).strip()
    if not text:
        raise UserError(f"{field} is empty, expected a model directory or a Hugging Face name org/name")
    local = Path(text).expanduser()
    if local.exists():
        return ResolvedModel(path=local)
    parsed = parse_hub_name(text)
    if parsed is None:
        raise UserError(
            f"{field}: no such file or directory: {text} (expected a model directory, "
            "or a Hugging Face name org/name[@revision])"
        )
    repo_id, rev = parsed
    revision = rev or "main"
    try:
        import huggingface_hub
    except ImportError:
        raise UserError(
            f"{field}: {text} is not a local path, and reading Hugging Face names needs huggingface_hub: "
            "pip install 'kdistill[hub]'"
        ) from None

    cache = hub_cache_dir()
    what = f"{field}: Hugging Face model {repo_id} (revision {revision})"
    snapshot = _cached_snapshot(cache, repo_id, revision)
    missing = _missing_files(snapshot) if snapshot is not None else ["the snapshot"]
    if not missing:
        return ResolvedModel(path=snapshot, repo_id=repo_id, revision=revision, commit=snapshot.name)

    if hub_offline() or getattr(getattr(huggingface_hub, "constants", None), "HF_HUB_OFFLINE", False):
        if snapshot is None:
            raise UserError(
                f"{what} is not in the cache {cache} and HF_HUB_OFFLINE=1 forbids downloading it "
                f"(download it once online, e.g. `hf download {repo_id}`)"
            )
        raise UserError(
            f"{what}: the cached snapshot {snapshot} lacks {', '.join(missing)} and HF_HUB_OFFLINE=1 "
            "forbids downloading it"
        )

    try:
        got = huggingface_hub.snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=str(cache),
            allow_patterns=ALLOW_PATTERNS,
            ignore_patterns=IGNORE_PATTERNS,
        )
    except Exception as exc:  # noqa: BLE001 - every Hub failure becomes the one-line error below
        raise UserError(
            f"{what} could not be found or downloaded into the cache {cache}: {_why(exc)}"
        ) from exc
    path = Path(got)
    still = _missing_files(path)
    if still:
        raise UserError(
            f"{what} has no {', '.join(still)} (kdistill reads safetensors weights and config.json)"
        )
    commit = path.name if _COMMIT.match(path.name) else _read_ref(cache, repo_id, revision)
    return ResolvedModel(path=path, repo_id=repo_id, revision=revision, commit=commit)


def resolve_run_models(cfg: RunConfig) -> dict[str, ResolvedModel]:
    """Resolve Hub names in `teacher.path`, every `teachers[i].path` and `student.path` in place; return
    what each came from.

    Presets come first (`qwen2.5-0.5b` is a preset, never a Hub name), then Hub names; local paths
    (already rebased against the config's folder by `load_config`) stay as they are. The config's path
    becomes the snapshot directory, so the saved config.yaml resumes from the very same commit. A
    mixture's first teacher is also teacher.path (RunConfig.validate): both become its snapshot.

    Returns:
        {"teacher": ResolvedModel, "student": ResolvedModel, "teachers[1]": ResolvedModel, ...} for the
        fields that were Hub names (a mixture's first teacher under "teacher").
    """
    out: dict[str, ResolvedModel] = {}
    for i, entry in enumerate(cfg.teachers):
        resolved = _resolve_field(entry.path, f"teachers[{i}].path")
        if resolved is None:
            continue
        if i == 0 and cfg.teacher.path == entry.path:
            cfg.teacher.path = str(resolved.path)
        entry.path = str(resolved.path)
        out["teacher" if i == 0 else f"teachers[{i}]"] = resolved
    for name in ("teacher", "student"):
        section = getattr(cfg, name)
        resolved = _resolve_field(section.path, f"{name}.path")
        if resolved is not None:
            section.path = str(resolved.path)
            out[name] = resolved
    return out


def _resolve_field(path: str, field: str) -> ResolvedModel | None:
    """The snapshot of a config path that is a Hub name, else None (a preset or a local path)."""
    text = str(path).strip()
    if not text or text.lower() in PRESETS or not is_hub_name(text):
        return None
    return resolve_model_path(text, field=field)


def _repo_folder(cache: Path, repo_id: str) -> Path:
    return cache / ("models--" + repo_id.replace("/", "--"))


def _read_ref(cache: Path, repo_id: str, revision: str) -> str | None:
    ref = _repo_folder(cache, repo_id) / "refs" / revision
    try:
        commit = ref.read_text().strip()
    except OSError:
        return None
    return commit if _COMMIT.match(commit) else None


def _cached_snapshot(cache: Path, repo_id: str, revision: str) -> Path | None:
    """The cached snapshot folder of repo_id at revision (a commit, or a ref naming one), if any."""
    commit = revision if _COMMIT.match(revision) else _read_ref(cache, repo_id, revision)
    if commit is None:
        return None
    snap = _repo_folder(cache, repo_id) / "snapshots" / commit
    return snap if snap.is_dir() else None


def _missing_files(snapshot: Path) -> list[str]:
    """What a snapshot lacks to be read as a model: config.json and its safetensors weights.

    `is_file` follows the cache's symlinks into blobs/, so a dangling link counts as missing.
    """
    missing = [] if (snapshot / "config.json").is_file() else ["config.json"]
    index = snapshot / INDEX_NAME
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
            return [*missing, f"a readable {INDEX_NAME}"]
        missing += [s for s in shards if not (snapshot / s).is_file()]
    elif not any(p.is_file() for p in snapshot.glob("*.safetensors")):
        missing.append("*.safetensors weights")
    return missing


def _why(exc: BaseException) -> str:
    """The first line of an exception, with its class name (Hub errors carry multi-line messages)."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return f"{type(exc).__name__}: {lines[0] if lines else ''}".rstrip(": ")[:300]
