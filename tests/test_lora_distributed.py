"""LoRA students under torchrun (2 processes, gloo on the CPU, FSDP2): the one-process run's losses, a
frozen base that stays bit for bit, adapters that PEFT loads with the one-process adapters' logits, the
merged export, a sharded checkpoint resumed in one process (2 -> 1) and a one-process checkpoint resumed
on two (1 -> 2), each from a copy of the finished run cut back to its checkpoint at step 3 (the reference
is also the interrupted run: two launches fewer); the same run with kd.layer_map (projections trained
beside the adapters, each its own FSDP2 unit) on two processes, killed and resumed in one, against the
uninterrupted one-process run, and with a whole student on every process (runtime.student_placement=
replicate) against it too; and, on tiny models, the sharded LoRA step's kernel keys against the
sharded plan with a fp32 and a bf16 base (the bf16 base and fp32 adapters share their FSDP units).

The run is tests/test_distributed.py's (6 steps of a global batch of 4, checkpoints at 3 and 6) with the
tiny pretrained student and adapters on four linears, dropout 0: dropout draws its masks per process
(two draws of 2 rows are not one draw of 4), the only part of a LoRA step that would differ by process
count. Gradients are clipped at every step (optim.grad_clip below the adapters' norm), so the same
losses also say that the clipping norm is the global one over both processes' shards. The tolerances are
test_distributed.py's and for the same reason (fp32 summation order).
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import yaml

from kdistill.train import distributed as dist
from tests import background
from tests.test_distributed import finish, start_torchrun
from tests.test_train_kit import (
    REPO,
    assets,
    base_config,
    child_env,
    interrupted_copy,
    read_summary,
    run_cli,
    start_proc,
)
from tests.tiny import load_hf, sample_ids

pytestmark = pytest.mark.slow

SCHED = dict(steps=6, batch_size=4, checkpoint_every=3, eval_every=3)
TARGETS = ["q_proj", "v_proj", "gate_proj", "down_proj"]


def _config(folder: Path, name: str = "run.yaml", **kd) -> Path:
    cfg = base_config(folder / "unused", **SCHED)
    cfg["student"] = {
        "path": str(assets().student),
        "init": "pretrained",
        "lora": {"rank": 4, "alpha": 8, "dropout": 0.0, "targets": TARGETS},
    }
    cfg["optim"]["grad_clip"] = 0.1  # below every step's norm (~0.2): each step clips the sharded adapters
    cfg["kd"].update(kd)
    path = folder / name
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def _helper(*argv: str) -> subprocess.Popen:
    """tests/fsdp_lora.py under torchrun (2 processes)."""
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone"]
        + [str(REPO / "tests" / "fsdp_lora.py"), *argv],
        cwd=REPO,
        env=child_env(PYTHONPATH=f"{REPO / 'src'}{os.pathsep}{REPO}"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def _ok(r: subprocess.CompletedProcess) -> None:
    assert r.returncode == 0, r.stderr[-3000:]


def prelaunch(fixturenames: set[str]) -> None:
    """tests/conftest.py: start the runs in the background if a selected test uses them."""
    if "runs" in fixturenames:
        _started()


@functools.cache
def _started() -> None:
    """Write the configs here (the tiny models are built in this process), then queue the two batches, as
    one job, for the background thread (tests/background.py)."""
    tmp = Path(tempfile.mkdtemp(prefix="kdistill-lora-dist-"))
    atexit.register(shutil.rmtree, tmp, True)
    cfg = _config(tmp)
    # kd.layer_map: widths 32 -> 64, so a projection per mapped student layer trains beside the adapters
    mapped = _config(tmp, "mapped.yaml", layer_map=[[0, 0], [1, 1]], hidden_weight=0.5)
    # the same with a whole student on every process: the adapters' and projections' gradients averaged
    rep = yaml.safe_load(mapped.read_text())
    rep["runtime"] = {"student_placement": "replicate"}
    (tmp / "mapped_rep.yaml").write_text(yaml.safe_dump(rep, sort_keys=False))
    background.start("lora_distributed", lambda: _batches(tmp, cfg, mapped))


@pytest.fixture(scope="module")
def runs():
    _started()
    return background.wait("lora_distributed")


def _batches(tmp: Path, cfg: Path, mapped: Path) -> tuple:
    dirs = {k: tmp / k for k in ("two", "one", "mapped_one", "mapped_killed", "mapped_rep")}
    procs = {
        # the 2-process run, through the helper: the gathered base compared with student.path's weights
        "two": _helper("run", str(tmp / "two.json"), "run", str(cfg), f"output.dir={dirs['two']}", "--quiet"),
        "one": start_proc(["run", str(cfg), f"output.dir={dirs['one']}", "--quiet"]),
        "step": _helper("step", str(tmp / "step.json")),
        "mapped_one": start_proc(["run", str(mapped), f"output.dir={dirs['mapped_one']}", "--quiet"]),
        "mapped_killed": start_torchrun(
            ["run", str(mapped), f"output.dir={dirs['mapped_killed']}", "--quiet"], KDISTILL_TEST_KILL_AT="4"
        ),
        "mapped_rep": start_torchrun(
            ["run", str(tmp / "mapped_rep.yaml"), f"output.dir={dirs['mapped_rep']}", "--quiet"]
        ),
    }
    with ThreadPoolExecutor(len(procs)) as pool:
        out = dict(zip(procs, pool.map(lambda p: finish(p, 900), procs.values())))
    assert out["mapped_killed"].returncode != 0
    # The finished runs cut back to their checkpoints at step 3: each is its own interrupted run.
    for name in ("two", "one"):
        dirs[f"{name}_cut"] = tmp / f"{name}_cut"
        if out[name].returncode == 0:
            interrupted_copy(dirs[name], dirs[f"{name}_cut"], 3)
    procs = {  # 2 -> 1 and 1 -> 2
        "two_to_one": start_proc(["run", "--resume", str(dirs["two_cut"]), "--quiet"]),
        "one_to_two": start_torchrun(["run", "--resume", str(dirs["one_cut"]), "--quiet"]),
        "mapped_two_to_one": start_proc(["run", "--resume", str(dirs["mapped_killed"]), "--quiet"]),
    }
    with ThreadPoolExecutor(len(procs)) as pool:
        out.update(zip(procs, pool.map(lambda p: finish(p, 900), procs.values())))
    return tmp, dirs, out


def _logits(adapter: Path, ids: torch.Tensor) -> torch.Tensor:
    from peft import PeftModel

    model = PeftModel.from_pretrained(load_hf(assets().student), str(adapter)).eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


def _same_run(run_dir: Path, ref: Path) -> None:
    """Losses of every step to 1e-5 relative (another process count), the held-out evals too."""
    assert read_summary(run_dir)["status"] == "completed"
    a, b = _rows(ref / "metrics.jsonl"), _rows(run_dir / "metrics.jsonl")
    assert [row["step"] for row in b] == [1, 2, 3, 4, 5, 6]
    for x, y in zip(a, b, strict=True):
        for key in ("loss", "ce", "kd", "grad_norm"):  # grad_norm: the adapters' global norm
            assert y[key] == pytest.approx(x[key], rel=1e-5), (x["step"], key)
    for x, y in zip(_rows(ref / "eval.jsonl"), _rows(run_dir / "eval.jsonl"), strict=True):
        assert y["student_loss"] == pytest.approx(x["student_loss"], rel=1e-5), x["step"]


def _same_adapters(run_dir: Path, ref: Path) -> None:
    from safetensors.torch import load_file

    a, b = (load_file(str(d / "adapter" / "adapter_model.safetensors")) for d in (ref, run_dir))
    assert a.keys() == b.keys() and len(a) == 2 * len(TARGETS) * 2
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-4, msg=k)


def test_two_processes_match_one_process_and_keep_the_base(runs):
    tmp, dirs, out = runs
    _ok(out["two"]), _ok(out["one"])
    two = dirs["two"]
    assert read_summary(two)["world_size"] == 2
    assert out["two"].stdout.count("status completed") == 1  # rank 0 alone reports
    _same_run(two, dirs["one"])
    # Only the adapters train; the base, gathered after the run, is student.path's weights bit for bit.
    check = json.loads((tmp / "two.json").read_text())
    assert check["optimizer_params"] == check["adapters"] == 2 * len(TARGETS) * 2
    assert check["compared"] == check["base_tensors"] and check["differ"] == []
    # Sharded checkpoints hold the adapters and their AdamW state only, one file per process.
    from kdistill.train import distributed as dist

    last = two / "checkpoints" / "step-0000006"
    assert sorted(p.name for p in (last / "shards").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    names = dist.sharded_model_names(str(last / "shards"))
    assert len(names) == check["adapters"] and all(".lora_A." in k or ".lora_B." in k for k in names)
    # The adapters, written once by rank 0 from the gathered shards: PEFT's layout, and PEFT loads them
    # with the one-process adapters' logits.
    assert sorted(p.name for p in (two / "adapter").iterdir()) == [
        ".kdistill-output",  # the marker: an output kdistill wrote (kdistill.outputs)
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    assert not (two / "student").exists() and not list(two.glob(".adapter*"))
    _same_adapters(two, dirs["one"])
    ids = sample_ids(load_hf(assets().student).config.vocab_size, batch=2, seq_len=24, seed=3)
    ours, theirs = _logits(two / "adapter", ids), _logits(dirs["one"] / "adapter", ids)
    assert (ours - _logits_base(ids)).abs().max() > 1e-3  # the adapters trained
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4)


def _logits_base(ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return load_hf(assets().student).eval()(input_ids=ids).logits


def test_merged_export_of_a_two_process_run(runs, capsys, tmp_path):
    _, dirs, out = runs
    _ok(out["two"])
    rc, _, err = run_cli(capsys, "export", "--run", str(dirs["two"]), "--merge", "--out", str(tmp_path / "m"))
    assert rc == 0, err
    ids = sample_ids(load_hf(assets().student).config.vocab_size, batch=2, seq_len=24, seed=4)
    with torch.no_grad():
        merged = load_hf(tmp_path / "m").eval()(input_ids=ids).logits
    torch.testing.assert_close(merged, _logits(dirs["two"] / "adapter", ids), rtol=0, atol=1e-4)


def test_sharded_lora_checkpoint_resumes_in_one_process(runs):
    _, dirs, out = runs
    _ok(out["two"]), _ok(out["two_to_one"])
    run = dirs["two_cut"]
    assert "resuming from" in out["two_to_one"].stderr and "step 3" in out["two_to_one"].stderr
    _same_run(run, dirs["two"])
    _same_adapters(run, dirs["two"])
    from tests.test_train_kit import final_weights

    ckpt = final_weights(run)  # written in one process: the adapters only, full tensors
    assert ckpt and all(".lora_A." in k or ".lora_B." in k for k in ckpt)


def test_layer_map_projections_train_sharded_and_resume_from_shards(runs):
    """The projections of a sharded LoRA run are in its sharded checkpoints: resumed in one process at
    step 3, the run ends as the one-process run did (losses, adapters and projections within tolerance)."""
    from tests.test_train_kit import final_weights

    _, dirs, out = runs
    _ok(out["mapped_one"]), _ok(out["mapped_two_to_one"])
    run, ref = dirs["mapped_killed"], dirs["mapped_one"]
    saved = dist.sharded_model_names(str(run / "checkpoints" / "step-0000003" / "shards"))
    assert {k for k in saved if k.startswith("kd_")} == {"kd_layer_proj.0.weight", "kd_layer_proj.1.weight"}
    _same_run(run, ref)
    _same_adapters(run, ref)
    a, b = final_weights(ref), final_weights(run)  # one-process checkpoints: adapters and projections
    assert a.keys() == b.keys() and {k for k in a if k.startswith("kd_")} == {
        "kd_layer_proj.0.weight",
        "kd_layer_proj.1.weight",
    }
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-4, msg=k)


def test_one_process_lora_checkpoint_resumes_on_two(runs):
    _, dirs, out = runs
    _ok(out["one"]), _ok(out["one_to_two"])
    assert "resuming from" in out["one_to_two"].stderr and "step 3" in out["one_to_two"].stderr
    run = dirs["one_cut"]
    _same_run(run, dirs["one"])
    _same_adapters(run, dirs["one"])
    assert json.loads((run / "checkpoints" / "step-0000006" / "state.json").read_text())["world_size"] == 2


def test_sharded_lora_step_launches_the_planned_keys_and_keeps_the_base(runs):
    """FSDP2 gathers a LoRA student's parameters as stored: the kernels see the base_dtype that the
    sharded plan says, for a fp32 base (no bf16 gather) and a bf16 one (one unit of bf16 base and fp32
    adapters); three AdamW steps with weight decay move the adapters and leave the base bit for bit."""
    tmp, _, out = runs
    _ok(out["step"])
    result = json.loads((tmp / "step.json").read_text())
    assert sorted(result) == ["bfloat16", "float32"]
    for base_dtype, r in result.items():
        assert r["problems"] == [], base_dtype
        assert r["wrong_dtype_plan_problems"] > 0, base_dtype  # the check does see the weights' dtype
        assert r["base_differ"] == [] and r["adapters_moved"], base_dtype
        assert r["optimizer_params"] == r["adapters"], base_dtype
        assert all(0 < n < float("inf") for n in r["grad_norms"]), base_dtype


def test_sharded_checkpoint_of_another_kind_is_refused(runs, capsys, tmp_path):
    """A LoRA run's sharded checkpoint does not resume a full student: one line naming both kinds."""
    from kdistill.models.hf_io import load_model
    from kdistill.train import distributed as dist
    from tests.test_train_kit import one_error_line

    _, dirs, out = runs
    _ok(out["two"])
    run = Path(shutil.copytree(dirs["two"], tmp_path / "run"))
    rc, _, err = run_cli(
        capsys, "run", "--resume", str(run), "--allow-changes", "student.lora.rank=0", "--quiet"
    )
    assert rc == 2
    assert one_error_line(err) == (
        f"{run}/checkpoints/step-0000006: checkpoint does not match this run "
        "(a sharded checkpoint of LoRA adapters, this run trains a full student)"
    )
    plain = load_model(assets().student)  # and DCP's reader is not asked for tensors the folder lacks
    with pytest.raises(ValueError, match="missing tensor 'model.embed_tokens.weight'"):
        dist.load_sharded(
            plain, torch.optim.AdamW(plain.parameters()), str(run / "checkpoints" / "step-0000006" / "shards")
        )


def test_a_replicated_lora_student_with_projections_matches_one_process(runs):
    """runtime.student_placement=replicate with LoRA adapters and kd.layer_map's projections: nothing
    sharded, their gradients averaged by one all-reduce (clipped at every step: the global norm); the
    losses, evals and adapters of the one-process run, its checkpoints holding what trains."""
    _, dirs, out = runs
    _ok(out["mapped_rep"]), _ok(out["mapped_one"])
    run = dirs["mapped_rep"]
    summary = read_summary(run)
    assert summary["world_size"] == 2 and summary["layout"]["student_replicated"] is True
    _same_run(run, dirs["mapped_one"])
    _same_adapters(run, dirs["mapped_one"])
    names = dist.sharded_model_names(str(run / "checkpoints" / "step-0000006" / "shards"))
    assert names and all(".lora_" in k or k.startswith("kd_") for k in names)
    assert any(k.startswith("kd_") for k in names)
