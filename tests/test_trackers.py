"""Experiment trackers, read back with each tool's own formats: TensorBoard event files through
tensorboard's EventAccumulator, the W&B offline run file (`run-<id>.wandb`, wandb's record log of
protobuf records) and the MLflow file store."""

from __future__ import annotations

import json
import math
import struct
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest

from kdistill.errors import UserError
from kdistill.train.trackers import (
    Trackers,
    TrackerWarning,
    finite_scalars,
    flatten_config,
    markdown_table,
    open_trackers,
)

CONFIG = {
    "teacher": {"path": "org/teacher"},
    "kd": {"alpha": 0.5, "temperature": 2.0, "divergence": "fkl"},
    "data": {"paths": ["a.txt", "b.txt"], "seq_len": 64},
    "output": {"report_to": ["tensorboard"], "dir": Path("runs/x")},
    "seed": 7,
}
SAMPLES = [
    {"prompt": "Hi", "completion": "Hello | there\nsecond line"},
    {"prompt": "2+2?", "completion": "4", "score": 1.0},
]


def run_steps(t: Trackers) -> None:
    t.log(1, {"train/loss": 2.5, "train/lr": 1e-3, "train/grad_norm": float("nan"), "note": "text"})
    t.log(2, {"train/loss": 2.0, "train/lr": 9e-4, "train/grad_norm": 1.25, "perf/mem": float("inf")})
    t.log_text(2, "samples", SAMPLES)
    t.log(3, {"train/loss": 1.5, "heldout/ce": 1.75})


def test_flatten_finite_and_markdown() -> None:
    flat = flatten_config(CONFIG)
    assert flat["kd.alpha"] == 0.5 and flat["teacher.path"] == "org/teacher" and flat["seed"] == 7
    assert flat["data.paths"] == '["a.txt", "b.txt"]' and flat["output.dir"] == '"runs/x"'
    assert finite_scalars(
        {"a": 1, "b": float("nan"), "c": "x", "d": None, "e": -float("inf"), "f": True}
    ) == {
        "a": 1.0,
        "f": 1.0,
    }
    md = markdown_table(SAMPLES).splitlines()
    assert md[0] == "| prompt | completion | score |" and md[1] == "|---|---|---|"
    assert md[2] == "| Hi | Hello \\| there<br>second line |  |"


def test_tensorboard_event_files_read_back(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    with open_trackers(["tensorboard"], tmp_path, CONFIG, "run-tb") as t:
        assert t.where == {"tensorboard": str(tmp_path / "tensorboard")}
        run_steps(t)
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    scalars = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    assert scalars["train/loss"] == [(1, 2.5), (2, 2.0), (3, 1.5)]
    assert scalars["train/grad_norm"] == [(2, 1.25)]  # the NaN at step 1 was skipped
    assert scalars["heldout/ce"] == [(3, 1.75)]
    assert [s for s, _ in scalars["train/lr"]] == [1, 2] and math.isclose(
        scalars["train/lr"][0][1], 1e-3, rel_tol=1e-6
    )
    assert "perf/mem" not in scalars and "note" not in scalars
    content = acc.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    hp = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info.hparams
    assert hp["kd.alpha"].number_value == 0.5 and hp["kd.divergence"].string_value == "fkl"
    assert hp["teacher.path"].string_value == "org/teacher" and hp["seed"].number_value == 7
    (text,) = acc.Tensors("samples/text_summary")
    assert (
        text.step == 2
        and "| Hi | Hello \\| there<br>second line |" in text.tensor_proto.string_val[0].decode()
    )


def read_wandb_records(path: Path) -> list[Any]:
    """The protobuf records of a .wandb file: a ':W&B' header (7 bytes), then a LevelDB-style log of
    32 KiB blocks whose chunks carry crc32 (4), length (2) and type (1: full, 2: first, 3: middle, 4: last)."""
    from wandb.proto import wandb_internal_pb2

    raw = path.read_bytes()
    assert raw[:4] == b":W&B"
    block, pos, buf, records = 32768, 7, b"", []
    while pos + 7 <= len(raw):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _crc, n, kind = struct.unpack("<IHB", raw[pos : pos + 7])
        buf, pos = buf + raw[pos + 7 : pos + 7 + n], pos + 7 + n
        if kind == 0:
            break
        if kind in (1, 4):
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(buf)
            records.append(rec)
            buf = b""
    return records


def test_wandb_offline_run_reads_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    monkeypatch.setenv("WANDB_PROJECT", "kd-test")
    with open_trackers(["wandb"], tmp_path, CONFIG, "run-wb") as t:
        run_steps(t)
        run_dir = Path(t.where["wandb"]).parent  # .../wandb/offline-run-<time>-<id>/files -> the run
    assert run_dir.parent == tmp_path / "wandb" and run_dir.name.startswith("offline-run-")
    (wandb_file,) = run_dir.glob("run-*.wandb")
    records = read_wandb_records(wandb_file)
    assert records[-1].WhichOneof("record_type") == "exit"  # complete once close() returns

    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run.display_name == "run-wb" and run.project == "kd-test"
    config = {i.key: json.loads(i.value_json) for i in run.config.update}
    assert config["kd"] == {"alpha": 0.5, "temperature": 2.0, "divergence": "fkl"}
    assert config["output"]["dir"] == "runs/x" and config["seed"] == 7

    history = []
    for r in records:
        if r.WhichOneof("record_type") == "history":
            history.append(
                {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            )
    by_step = {h["_step"]: h for h in history}
    assert [by_step[s]["train/loss"] for s in (1, 2, 3)] == [2.5, 2.0, 1.5]
    assert "train/grad_norm" not in by_step[1] and by_step[2]["train/grad_norm"] == 1.25
    assert "perf/mem" not in by_step[2] and by_step[3]["heldout/ce"] == 1.75
    assert by_step[2]["samples/_type"] == "table-file"
    table = json.loads((run_dir / "files" / by_step[2]["samples/path"]).read_text())
    assert table["columns"] == ["prompt", "completion", "score"]
    assert table["data"][0] == ["Hi", "Hello | there\nsecond line", ""] and table["data"][1][2] == "1.0"


def test_mlflow_file_store_reads_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_ALLOW_FILE_STORE"):
        monkeypatch.delenv(var, raising=False)  # restored (unset) after the test
    with open_trackers(["mlflow"], tmp_path, CONFIG, "run-ml") as t:
        run_steps(t)
        assert t.where["mlflow"].startswith((tmp_path / "mlruns").as_uri())
    (meta,) = [p for p in (tmp_path / "mlruns").glob("*/*/meta.yaml")]
    run = meta.parent
    loss = [line.split() for line in (run / "metrics" / "train" / "loss").read_text().splitlines()]
    assert [(float(v), int(s)) for _, v, s in loss] == [(2.5, 1), (2.0, 2), (1.5, 3)]
    grad = (run / "metrics" / "train" / "grad_norm").read_text().split()
    assert (float(grad[1]), int(grad[2])) == (1.25, 2)
    assert not (run / "metrics" / "perf").exists()
    assert (run / "params" / "kd.alpha").read_text() == "0.5"
    assert (run / "params" / "data.paths").read_text() == '["a.txt", "b.txt"]'
    assert (run / "tags" / "mlflow.runName").read_text() == "run-ml"
    assert "FINISHED" in meta.read_text() or "status: 3" in meta.read_text()
    sample = json.loads((run / "artifacts" / "samples" / "step_00000002.json").read_text())
    assert sample["columns"] == ["prompt", "completion", "score"] and sample["data"][0][0] == "Hi"


def test_several_trackers_and_none(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("MLFLOW_TRACKING_URI", "MLFLOW_ALLOW_FILE_STORE"):
        monkeypatch.delenv(var, raising=False)
    t = open_trackers(["tensorboard", "mlflow", "tensorboard"], tmp_path / "a", CONFIG, "r")
    assert t.names == ["tensorboard", "mlflow"]
    run_steps(t)
    t.close()
    t.close()  # idempotent
    none = open_trackers([], tmp_path / "b", CONFIG, "r")
    run_steps(none)
    none.close()
    assert none.names == [] and not any((tmp_path / "b").iterdir())


def one_line(names: list[str], tmp_path: Path) -> str:
    with pytest.raises(UserError) as e:
        open_trackers(names, tmp_path, CONFIG, "r")
    msg = str(e.value)
    assert "\n" not in msg and "output.report_to" in msg
    return msg


def test_an_unknown_tracker_is_one_line(tmp_path: Path) -> None:
    msg = one_line(["tensorboard", "comet"], tmp_path)
    assert "'comet'" in msg and "tensorboard, wandb, mlflow" in msg
    assert not (tmp_path / "tensorboard").exists()


@pytest.mark.parametrize(
    "name, modules",
    [
        ("tensorboard", ["tensorboard", "torch.utils.tensorboard"]),
        ("wandb", ["wandb"]),
        ("mlflow", ["mlflow"]),
    ],
)
def test_a_tracker_not_installed_names_its_extra(
    name: str, modules: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for m in modules:
        monkeypatch.setitem(sys.modules, m, None)  # import raises ImportError
    others = [n for n in ("tensorboard", "wandb") if n != name][:1]
    msg = one_line([*others, name], tmp_path)
    assert f"pip install 'kdistill[{name}]'" in msg and f"'{name}'" in msg
    assert not any(tmp_path.iterdir())  # nothing half open


class Fake:
    def __init__(self, name: str, fail_in: str = "") -> None:
        self.name, self.where, self.fail_in = name, f"fake://{name}", fail_in
        self.logged: list[tuple[int, dict]] = []
        self.texts: list[tuple[int, str, list]] = []
        self.closed: list[bool] = []

    def log(self, step: int, scalars: dict[str, float]) -> None:
        if self.fail_in == "log":
            raise ConnectionError("server went away\nsecond line of detail")
        self.logged.append((step, scalars))

    def log_text(self, step: int, key: str, rows: list) -> None:
        if self.fail_in == "log_text":
            raise RuntimeError("bad table")
        self.texts.append((step, key, rows))

    def close(self, failed: bool) -> None:
        self.closed.append(failed)
        if self.fail_in == "close":
            raise OSError("disk full")


def test_a_tracker_failing_mid_run_warns_once_and_is_disabled() -> None:
    good, bad = Fake("good"), Fake("bad", fail_in="log")
    t = Trackers([bad, good])
    with pytest.warns(TrackerWarning) as record:
        run_steps(t)
    (w,) = record
    msg = str(w.message)
    assert "tracker bad failed in log (ConnectionError: server went away)" in msg and "\n" not in msg
    assert "disabled" in msg
    assert t.names == ["good"] and bad.closed == [True]
    assert [s for s, _ in good.logged] == [1, 2, 3] and good.logged[0][1] == {
        "train/loss": 2.5,
        "train/lr": 1e-3,
    }
    assert good.texts == [(2, "samples", SAMPLES)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        t.log(4, {"train/loss": 1.0})  # no second warning
        t.close()
    assert good.closed == [False]


def test_a_tracker_failing_in_text_or_close_never_raises() -> None:
    a, b = Fake("a", fail_in="log_text"), Fake("b", fail_in="close")
    t = Trackers([a, b])
    with pytest.warns(TrackerWarning) as record:
        run_steps(t)
        t.close(failed=True)
    assert [str(w.message).split(" (")[0] for w in record] == [
        "tracker a failed in log_text",
        "tracker b failed in close",
    ]
    assert b.closed == [True] and [s for s, _ in b.logged] == [1, 2, 3]


def test_a_tracker_that_cannot_start_is_one_line_and_closes_the_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kdistill.train import trackers

    def broken(self: Any, run_dir: Path, config: dict, run_name: str) -> None:
        raise PermissionError("wandb: api_key not configured (no-tty)\ncall wandb login")

    monkeypatch.setattr(trackers._WandB, "__init__", broken)
    msg = one_line(["tensorboard", "wandb"], tmp_path)
    assert "tracker 'wandb' could not start: PermissionError: wandb: api_key not configured" in msg
    assert list((tmp_path / "tensorboard").iterdir())  # tensorboard was opened, then closed
