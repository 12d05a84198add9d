"""Bad inputs through `kdistill run`, in process via kdistill.cli.main.

Each case: exit 2, exactly one line on stderr, `kdistill: error: <message>` with the exact message listed
in docs/errors.md, no traceback, nothing half-written in the output directory (a fresh run that fails
leaves no directory at all) and no earlier checkpoint touched.
"""

from __future__ import annotations

import array
import contextlib
import errno
import fcntl
import hashlib
import json
import os
from pathlib import Path

import pytest
import torch
import yaml

from tests.test_train_kit import assets, base_config, one_error_line, run_cli, write_config
from tests.tiny import make_tiny_model, tokenizer_vocab_size


def _snapshot(folder: Path) -> dict[str, str]:
    """sha256 of every file below folder (relative names): to prove nothing changed."""
    if not folder.exists():
        return {}
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _cfg(tmp_path: Path, **changes) -> Path:
    """Write a config with dotted changes applied to base_config (a value of ... deletes the key)."""
    cfg = base_config(tmp_path / "run")
    for key, value in changes.items():
        *parents, leaf = key.split(".")
        d = cfg
        for k in parents:
            d = d.setdefault(k, {})
        d[leaf] = value
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def _error(capsys, *argv: str) -> str:
    rc, _, err = run_cli(capsys, *argv)
    assert rc == 2, err
    return one_error_line(err)


def _fails_clean(capsys, tmp_path: Path, argv: list[str], message: str) -> None:
    """The run fails with `message` and leaves no output directory behind."""
    assert _error(capsys, *argv) == message
    assert not (tmp_path / "run").exists(), sorted(p.name for p in (tmp_path / "run").iterdir())


# -- config ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "change,message",
    [
        ({"kd.temprature": 2}, "unknown config key 'kd.temprature' (did you mean 'temperature'?)"),
        ({"optimiser": {"lr": 1}}, "unknown config key 'optimiser' (did you mean 'optim'?)"),
        ({"optim.lr": 0}, "optim.lr is 0.0, expected a positive number"),
        ({"optim.lr": -0.001}, "optim.lr is -0.001, expected a positive number"),
        ({"schedule.steps": "many"}, "schedule.steps is 'many', expected an integer"),
        (
            {"kd.divergence": "kl"},
            "kd.divergence is 'kl', expected one of: forward_kl, reverse_kl, jsd, tvd, skew_kl, skew_reverse_kl",
        ),
    ],
)
def test_bad_config_file(tmp_path, capsys, change, message):
    _fails_clean(capsys, tmp_path, ["run", str(_cfg(tmp_path, **change)), "--quiet"], message)


@pytest.mark.parametrize(
    "override,message",
    [
        ("schedule.step=5", "unknown config key 'schedule.step' (did you mean 'steps'?)"),
        ("optim.lr=0", "optim.lr is 0.0, expected a positive number"),
        ("optim.lr=-3e-4", "optim.lr is -0.0003, expected a positive number"),
        ("foo", "override 'foo' is not of the form key=value (e.g. kd.temperature=2)"),
        ("kd.logits_dtype=bf16", "kd.logits_dtype is 'bf16', expected one of: float32, compute"),
    ],
)
def test_bad_override(tmp_path, capsys, override, message):
    _fails_clean(capsys, tmp_path, ["run", str(_cfg(tmp_path)), override, "--quiet"], message)


def test_malformed_yaml_names_the_line(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text("teacher:\n  path: x\nkd: {alpha: 0.5\nstudent: {path: y}\n")
    assert _error(capsys, "run", str(path)) == (
        f"{path}: line 4: not valid YAML (expected ',' or '}}', but got ':')"
    )


def test_missing_config_file(tmp_path, capsys):
    assert (
        _error(capsys, "run", str(tmp_path / "nope.yaml")) == f"{tmp_path / 'nope.yaml'}: no such config file"
    )


def test_seq_len_above_the_models_positions(tmp_path, capsys):
    _fails_clean(
        capsys,
        tmp_path,
        ["run", str(_cfg(tmp_path, **{"data.seq_len": 1000})), "--quiet"],
        "data.seq_len 1000 exceeds the models' max_position_embeddings (256)",
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA GPU")
def test_cuda_device_without_a_gpu(tmp_path, capsys):
    _fails_clean(
        capsys,
        tmp_path,
        ["run", str(_cfg(tmp_path, **{"runtime.device": "cuda"})), "--quiet"],
        "runtime.device is 'cuda', but no CUDA GPU is available (use runtime.device=cpu)",
    )


# -- models and tokenizers ------------------------------------------------------------------------
def test_tokenizer_mismatch(tmp_path, capsys):
    from kdistill.models.tokenizer import load_tokenizer

    other = make_tiny_model(tmp_path, "qwen2", tied=True, seed=2, name="other-tok", tokenizer_vocab=300)
    ids = load_tokenizer(other).identity[:12], load_tokenizer(assets().teacher).identity[:12]
    _fails_clean(
        capsys,
        tmp_path,
        ["run", str(_cfg(tmp_path, **{"student.path": str(other)})), "--quiet"],
        f"{other / 'tokenizer.json'}: tokenizer differs from the teacher's ({ids[0]} vs {ids[1]}): "
        "teacher and student must share a tokenizer",
    )


def _student_config(tmp_path: Path, **changes) -> Path:
    hf = json.loads(assets().student_config.read_text())
    hf.update(changes)
    path = tmp_path / "s" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(hf))
    return path


def test_vocab_mismatch_that_is_not_padding(tmp_path, capsys):
    v = tokenizer_vocab_size(assets().teacher)
    student = _student_config(tmp_path, vocab_size=v + 8)  # the student has rows the teacher lacks
    _fails_clean(
        capsys,
        tmp_path,
        ["run", str(_cfg(tmp_path, **{"student.path": str(student)})), "--quiet"],
        f"teacher vocab_size {v} is smaller than the student's {v + 8}: vocabularies must match "
        "(only teacher padding rows beyond the tokenizer are trimmed)",
    )


def test_student_vocab_smaller_than_the_tokenizer(tmp_path, capsys):
    v = tokenizer_vocab_size(assets().teacher)
    student = _student_config(tmp_path, vocab_size=300)
    _fails_clean(
        capsys,
        tmp_path,
        ["run", str(_cfg(tmp_path, **{"student.path": str(student)})), "--quiet"],
        f"student vocab_size 300 is smaller than the tokenizer's vocabulary ({v})",
    )


def test_teacher_layers_with_other_shapes(tmp_path, capsys):
    _fails_clean(
        capsys,
        tmp_path,
        ["run", str(_cfg(tmp_path, **{"student.init": "teacher_layers"})), "--quiet"],
        "student.init=teacher_layers needs equal hidden_size (student 32, teacher 64)",
    )


def test_pretrained_init_without_weights(tmp_path, capsys):
    p = assets().student_config
    _fails_clean(
        capsys,
        tmp_path,
        ["run", str(_cfg(tmp_path, **{"student.init": "pretrained"})), "--quiet"],
        f"student.init=pretrained but '{p}' holds no weights",
    )


# -- data -----------------------------------------------------------------------------------------
def test_empty_dataset(tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    _fails_clean(
        capsys,
        tmp_path,
        ["run", str(_cfg(tmp_path, **{"data.train": [str(empty)]})), "--quiet"],
        f"data.train: {empty}: empty file (empty dataset), expected some text",
    )


# -- output directory -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A completed 4-step run with checkpoints at steps 2 and 4."""
    from kdistill.cli import main

    root = tmp_path_factory.mktemp("finished")
    cfg = write_config(root, steps=4, checkpoint_every=2)
    assert main(["run", str(cfg), "--quiet"]) == 0
    return cfg, root / "run"


def test_output_dir_that_holds_a_run_is_refused(finished_run, capsys):
    cfg, run = finished_run
    before = _snapshot(run)
    assert _error(capsys, "run", str(cfg), "--quiet") == (
        f"output.dir '{run}' already holds a run: use --resume {run} to continue it, "
        "--overwrite to replace it, or another output.dir"
    )
    assert _snapshot(run) == before


def test_overwrite_replaces_a_run(tmp_path, capsys):
    cfg = write_config(tmp_path, steps=2)
    assert run_cli(capsys, "run", str(cfg), "--quiet")[0] == 0
    assert run_cli(capsys, "run", str(cfg), "schedule.steps=3", "--overwrite", "--quiet")[0] == 0
    rows = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["step"] for r in rows] == [1, 2, 3]


@contextlib.contextmanager
def _read_only_dir(path: Path):
    """Make `path` a directory nothing can be written in. As root, mode bits do not stop writes, so the
    directory is made immutable (chattr +i: FS_IMMUTABLE_FL, refused even for root)."""
    path.mkdir()
    if os.geteuid() != 0:
        path.chmod(0o555)
        try:
            yield "Permission denied"
        finally:
            path.chmod(0o755)
        return
    get, put, immutable = 0x80086601, 0x40086602, 0x10  # FS_IOC_GETFLAGS, FS_IOC_SETFLAGS
    fd = os.open(path, os.O_RDONLY)
    try:
        flags = array.array("i", [0])
        try:
            fcntl.ioctl(fd, get, flags, True)
            flags[0] |= immutable
            fcntl.ioctl(fd, put, flags)
        except OSError as e:  # a file system without the flag: no real way to make it read-only here
            pytest.skip(f"cannot make a directory read-only as root on this file system ({e.strerror})")
        try:
            yield "Operation not permitted"
        finally:
            flags[0] &= ~immutable
            fcntl.ioctl(fd, put, flags)
    finally:
        os.close(fd)


@pytest.mark.parametrize("where", ["inside", "itself"])
def test_read_only_output_directory(tmp_path, capsys, where):
    ro = tmp_path / "ro"
    with _read_only_dir(ro) as reason:
        out = ro / "run" if where == "inside" else ro
        cfg = _cfg(tmp_path, **{"output.dir": str(out)})
        assert _error(capsys, "run", str(cfg), "--quiet") == f"output.dir '{out}' is not writable ({reason})"
        assert list(ro.iterdir()) == []


def test_output_dir_is_a_file(tmp_path, capsys):
    f = tmp_path / "afile"
    f.write_text("x")
    cfg = _cfg(tmp_path, **{"output.dir": str(f)})
    assert _error(capsys, "run", str(cfg), "--quiet") == f"output.dir '{f}' is a file, expected a directory"
    assert f.read_text() == "x"


def test_disk_full_while_writing_a_checkpoint(tmp_path, capsys, monkeypatch):
    """ENOSPC from the safetensors writer at the step-4 checkpoint: step 2 stays intact; resume finishes."""
    from kdistill.train import checkpoint as ckpt

    real = ckpt.save_file

    def full_disk(tensors, filename, *a, **k):
        if "step-0000004" in filename:
            Path(filename).write_bytes(b"partial")  # the writer got part of the way
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(tensors, filename, *a, **k)

    monkeypatch.setattr(ckpt, "save_file", full_disk)
    cfg = write_config(tmp_path, steps=6, checkpoint_every=2)
    run = tmp_path / "run"
    snap: dict = {}
    real_save = ckpt.save_checkpoint

    def save_and_snapshot(run_dir, step, *a, **k):
        if step == 4:
            snap.update(_snapshot(run_dir / "checkpoints"))
        return real_save(run_dir, step, *a, **k)

    monkeypatch.setattr(ckpt, "save_checkpoint", save_and_snapshot)
    assert _error(capsys, "run", str(cfg), "--quiet") == (
        f"{run / 'checkpoints' / 'step-0000004'}: cannot write checkpoint (No space left on device); "
        "last good checkpoint: step 2"
    )
    assert set(snap) == {
        f"step-0000002/{n}" for n in ("student.safetensors", "optimizer.safetensors", "state.json")
    }
    assert _snapshot(run / "checkpoints") == snap  # step 2 untouched, no temp folder left
    assert not (run / "summary.json").exists() and not (run / "student").exists()
    monkeypatch.setattr(ckpt, "save_file", real)  # space again: resume from step 2 and finish
    rc, _, err = run_cli(capsys, "run", "--resume", str(run), "--quiet")
    assert rc == 0 and f"resuming from {run / 'checkpoints' / 'step-0000002'} (step 2)" in err


# -- resume ---------------------------------------------------------------------------------------
def test_resume_without_checkpoints(tmp_path, capsys):
    """A run killed before its first checkpoint: config.yaml and metrics, no checkpoint."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump(base_config(run)))
    (run / "manifest.json").write_text("{}")
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    (run / "checkpoints").mkdir()
    (run / "checkpoints" / ".tmp-step-0000002-123").mkdir()  # a write that was killed
    before = _snapshot(run)
    assert (
        _error(capsys, "run", "--resume", str(run))
        == f"--resume {run}: no complete checkpoint to resume from"
    )
    assert _snapshot(run) == before


def test_resume_of_a_directory_that_is_not_a_run(tmp_path, capsys):
    assert _error(capsys, "run", "--resume", str(tmp_path)) == (
        f"--resume {tmp_path}: no config.yaml there (not a kdistill run directory)"
    )


def test_resume_with_changed_batch_size(finished_run, capsys, tmp_path):
    import shutil

    _, run = finished_run
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    before = _snapshot(copy)
    assert _error(capsys, "run", "--resume", str(copy), "schedule.batch_size=2", "--quiet") == (
        "cannot resume: batch size is 2, the checkpoint used 4"
    )
    assert _snapshot(copy) == before


def test_resume_with_a_checkpoint_of_another_shape(finished_run, capsys, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    _, run = finished_run
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    ckpt = copy / "checkpoints" / "step-0000004"
    w = load_file(str(ckpt / "student.safetensors"))
    w["model.norm.weight"] = torch.ones(48)
    save_file(w, str(ckpt / "student.safetensors"))
    assert _error(capsys, "run", "--resume", str(copy), "schedule.steps=5", "--quiet") == (
        f"{ckpt}: checkpoint does not match this run (tensor 'model.norm.weight' has shape [48], expected [32])"
    )


def test_preset_teacher_is_refused(tmp_path, capsys):
    # A preset gives shapes for `kdistill plan`; a run needs the teacher's weights and tokenizer.
    message = (
        "teacher.path 'qwen2.5-0.5b' is not a model directory: a run needs the teacher's weights and "
        "tokenizer.json (presets only describe shapes, for `kdistill plan`)"
    )
    _fails_clean(
        capsys, tmp_path, ["run", str(_cfg(tmp_path, **{"teacher.path": "qwen2.5-0.5b"})), "--quiet"], message
    )
