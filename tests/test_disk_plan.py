"""The disk plan: a run whose checkpoints and export cannot fit on output.dir's filesystem is refused
before any weight is loaded, in one line, leaving nothing behind; the plan counts the checkpoints that
exist at once (rotation writes the newest before it removes the oldest) and the export, and bounds a
real run's files."""

from __future__ import annotations

from pathlib import Path

import yaml

from kdistill.config import load_config
from kdistill.models.hf_io import EXTRA_FILES, TOKENIZER_FILES
from kdistill.models.spec import load_spec
from kdistill.train.preflight import CHECKPOINT_EXTRA, EXPORT_EXTRA, check_disk, disk_plan
from tests.test_train_kit import assets, base_config, one_error_line, run_cli


def _config(tmp_path: Path, **schedule):
    cfg = base_config(tmp_path / "run", **schedule)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path, cfg


def _size(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def test_the_disk_plan_counts_the_checkpoints_at_once_and_the_export():
    spec = load_spec(assets().student_config)
    total = spec.param_counts()["total"]
    ckpt, export = total * 12 + CHECKPOINT_EXTRA, total * 4 + EXPORT_EXTRA

    def plan(**over):
        base = {"schedule": {k: v for k, v in over.items() if k != "keep"}, "output": {}}
        if "keep" in over:
            base["output"]["keep_checkpoints"] = over["keep"]
        return disk_plan(load_config(None, base=base).validate(need_paths=False), spec)

    # one checkpoint at the end, then the export beside it
    assert plan(steps=10, checkpoint_every=0) == {
        "checkpoint": ckpt,
        "at_once": 1,
        "export": export,
        "total": ckpt + export,
    }
    # steps 3, 6, 9 and the end: 4 written; with 2 kept the third is written beside two
    p = plan(steps=10, checkpoint_every=3, keep=2)
    assert (p["at_once"], p["total"]) == (3, max(3 * ckpt, 2 * ckpt + export))
    p = plan(steps=10, checkpoint_every=3, keep=5)  # never more than were written
    assert (p["at_once"], p["total"]) == (4, max(4 * ckpt, 4 * ckpt + export))
    # kd.layer_map's projections (student width x teacher width each) are trained and checkpointed
    teacher = load_spec(assets().teacher)
    assert teacher.hidden_size != spec.hidden_size
    mapped = load_config(None, base={"kd": {"layer_map": [[0, 0], [1, 1]], "hidden_weight": 0.5}})
    p = disk_plan(mapped.validate(need_paths=False), spec, teacher=teacher)
    assert p["checkpoint"] == ckpt + 2 * spec.hidden_size * teacher.hidden_size * 12
    assert p["export"] == export  # the export leaves them out
    lora = load_config(None, base={"student": {"lora": {"rank": 2, "targets": ["q_proj"]}}})
    adapters = spec.lora_params(2, ["q_proj"])
    p = disk_plan(lora.validate(need_paths=False), spec, export_files=1000)
    assert p["checkpoint"] == adapters * 12 + CHECKPOINT_EXTRA
    assert p["export"] == adapters * 4 + 1000 + EXPORT_EXTRA


def test_the_disk_plan_bounds_a_real_runs_checkpoints_and_export(tmp_path, capsys):
    path, cfg = _config(tmp_path, steps=4, checkpoint_every=2)
    rc, _, err = run_cli(capsys, "run", str(path), "--quiet")
    assert rc == 0, err
    run = tmp_path / "run"
    teacher = Path(cfg["teacher"]["path"])
    files = sum(
        (teacher / n).stat().st_size for n in (*TOKENIZER_FILES, *EXTRA_FILES) if (teacher / n).is_file()
    )
    p = disk_plan(load_config(path).validate(), load_spec(assets().student_config), files)
    ckpts = sorted((run / "checkpoints").iterdir())
    assert [c.name for c in ckpts] == ["step-0000002", "step-0000004"]
    for c in ckpts:  # an upper bound, by no more than the fixed allowance
        assert p["checkpoint"] - CHECKPOINT_EXTRA <= _size(c) <= p["checkpoint"], (_size(c), p)
    student = _size(run / "student")
    assert p["export"] - EXPORT_EXTRA <= student <= p["export"], (student, p)


def test_a_run_whose_checkpoints_cannot_fit_is_refused_before_loading(tmp_path, capsys, monkeypatch):
    # a million checkpoints of the tiny student, all kept: more than any disk holds
    path, _ = _config(tmp_path, steps=1_000_000, checkpoint_every=1)
    monkeypatch.setenv("KDISTILL_TEST_KILL_AT", "SIGTERM@1")  # a run that did start stops after step 1
    run = tmp_path / "run"
    rc, _, err = run_cli(capsys, "run", str(path), "output.keep_checkpoints=1000000", "--quiet")
    line = one_error_line(err)
    assert rc == 2
    assert line.startswith(f"output.dir '{run}': the run writes up to ")
    assert "(1000000 checkpoint(s) of " in line and "at once with output.keep_checkpoints=1000000" in line
    assert line.endswith(
        "free; free space, lower output.keep_checkpoints, choose another output.dir or set "
        "output.check_disk=false"
    )
    assert not run.exists()  # nothing half-written: the run directory it created is gone
    off = load_config(path, ["output.keep_checkpoints=1000000", "output.check_disk=false"]).validate()
    check_disk(
        off, load_spec(assets().teacher), load_spec(assets().student_config), run
    )  # switched off: no refusal


def test_kdistill_plan_shows_the_disk_plan(capsys):
    import json

    argv = ("plan", "qwen2.5-7b:qwen2.5-1.5b", "schedule.steps=1000", "schedule.checkpoint_every=100")
    rc, out, err = run_cli(capsys, *argv, "--json")
    assert rc == 0, err
    disk = json.loads(out)["disk_bytes"]
    spec = load_spec("qwen2.5-1.5b")
    cfg = load_config(None, base={"schedule": {"steps": 1000, "checkpoint_every": 100}}).validate(
        need_paths=False
    )
    assert disk == disk_plan(cfg, spec) and disk["at_once"] == 3  # 10 written, 2 kept, the third beside them
    assert disk["checkpoint"] == spec.param_counts()["total"] * 12 + CHECKPOINT_EXTRA
    rc, out, err = run_cli(capsys, *argv)
    assert (
        rc == 0 and f"disk in output.dir: up to {disk['total'] / 2**30:.2f} GiB (3 checkpoint(s) of " in out
    )
