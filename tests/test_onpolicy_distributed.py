"""On-policy distillation under torchrun (2 processes, gloo on the CPU, FSDP2 student and teacher).

One 2-process run with kd.on_policy = 0.5 and kd.seq_kd = 0.5 (seed 0 makes its 4 steps data,
teacher-written, data, on-policy), sampled at temperature 1 with a generator per process: the student
(and for the teacher-written step the sharded teacher) writes through a gathered copy on every process,
each process its own rows; the student's blocks are kept gathered from forward to backward, so its one
gather of the on-policy step (before it writes) serves its update too. Then the checkpoint it wrote at step 2 is resumed on 2 processes, as a run
interrupted after it would be, and must end with the uninterrupted run's metrics, weights and
generator states, bit for bit. Every generated step's metrics line has each process's phase times.

That the loss of a step over 2 processes equals one process's over the same rows, with unequal completion
tokens per process, is tested in tests/test_onpolicy.py (the two processes emulated, exactly).
"""

from __future__ import annotations

import atexit
import functools
import json
import shutil
import tempfile
from pathlib import Path

import pytest

from tests import background
from tests.test_distributed import torchrun
from tests.test_onpolicy import _metrics, _run_config, _write
from tests.test_train_kit import assert_same_weights, interrupted_copy, read_summary, student_weights

pytestmark = pytest.mark.slow


def prelaunch(fixturenames: set[str]) -> None:
    """tests/conftest.py: start the two launches in the background if a selected test uses them."""
    if "runs" in fixturenames:
        _started()


@functools.cache
def _started() -> None:
    """Write the config and data here, then queue the launches for the background thread
    (tests/background.py)."""
    tmp = Path(tempfile.mkdtemp(prefix="kdistill-onpolicy-dist-"))
    atexit.register(shutil.rmtree, tmp, True)
    cfg = _run_config(tmp, on_policy=0.5, seq_kd=0.5, max_new_tokens=6)
    cfg["schedule"].update(steps=4, checkpoint_every=2, grad_accum=2)
    # the student kept gathered from forward to backward: gathered once per on-policy step, before it writes
    cfg.setdefault("runtime", {})["student_reshard"] = "after_backward"
    path = _write(tmp, cfg)
    # the same run with a whole student on every process (its own folder: _write names run.yaml)
    cfg["runtime"] = {"student_placement": "replicate"}
    rep = _write(tmp, cfg, "rep.yaml")
    background.start("onpolicy_distributed", lambda: _launches(tmp, path, rep))


@pytest.fixture(scope="module")
def launched():
    _started()
    return background.wait("onpolicy_distributed")


@pytest.fixture(scope="module")
def runs(launched):
    """The run sharded with FSDP2 (student kept gathered), its cut copy and that copy resumed."""
    return launched[0]


@pytest.fixture(scope="module")
def replicated(launched):
    """The same with a whole student on every process (runtime.student_placement=replicate)."""
    return launched[1]


def _launches(tmp: Path, path: Path, rep: Path) -> tuple:
    out = []
    for name, config in (("two", path), ("rep", rep)):
        two = tmp / name
        first = torchrun(["run", str(config), f"output.dir={two}", "--quiet"], timeout=900)
        assert first.returncode == 0, first.stderr[-3000:]
        # What a run interrupted after step 3 leaves: its checkpoint at step 2, no export, no summary
        # (the metrics lines after step 2 are dropped by the resume).
        cut = interrupted_copy(two, tmp / f"{name}_cut", 2)
        resumed = torchrun(["run", "--resume", str(cut), "--quiet"], timeout=900)
        out.append((two, cut, resumed))
    return out


def _state(run_dir: Path, step: int) -> dict:
    return json.loads((run_dir / "checkpoints" / f"step-{step:07d}" / "state.json").read_text())


def test_two_processes_write_their_own_samples_and_report_every_phase(runs):
    two, _, _ = runs
    summary = read_summary(two)
    assert summary["status"] == "completed" and summary["world_size"] == 2
    assert summary["jit_after_prewarm"] == 0
    # the student's one gather of an on-policy step serves its writing and its update; the resume below is
    # exact through it
    assert summary["layout"]["student_kept"] is True
    rows = _metrics(two, ())
    assert [r["step"] for r in rows] == [1, 2, 3, 4]  # rank 0 alone writes the metrics
    assert [r.get("policy", "data") for r in rows] == ["data", "seq_kd", "data", "on_policy"]
    generated = [r for r in rows if "policy" in r]
    for r in generated:
        assert r["completions"] == 8  # 2 micro-batches of 4 rows: both processes' samples
        assert 1 <= r["completion_len"] <= 6 and 0 <= r["eos_fraction"] <= 1
        assert r["completion_tokens"] == round(r["completion_len"] * 8)
        assert r["gen_s"] > 0 and r["score_s"] > 0 and r["update_s"] >= 0
        # every process's phases, gathered to rank 0: one entry per rank, rank 0's as its own columns
        phases = r["phase_s"]
        assert list(phases) == ["generate", "wait", "score", "update"]
        assert all(len(v) == 2 and min(v) >= 0 for v in phases.values())
        assert all(g > 0 for g in phases["generate"]) and all(s > 0 for s in phases["score"])
        assert phases["generate"][0] == r["gen_s"] and phases["score"][0] == r["score_s"]
        assert phases["wait"][0] + phases["update"][0] == pytest.approx(r["update_s"])
    on = next(r for r in generated if r["policy"] == "on_policy")
    assert on["sample_kl"] == on["kd"] == on["loss"]  # alpha = 1: the divergence alone
    op = summary["on_policy"]
    assert op["on_policy_steps"] == 1 and op["seq_kd_steps"] == 1
    assert op["mean_completion_len"] == pytest.approx(sum(r["completion_len"] for r in generated) / 2)
    # Every process samples with its own generator, whose state the checkpoint keeps (in rank order).
    gens = _state(two, 4)["onpolicy"]["generators"]
    assert len(gens) == 2 and gens[0] != gens[1]
    assert _state(two, 4)["world_size"] == 2


def test_resumed_on_policy_run_matches_the_uninterrupted_one(runs):
    two, cut, resumed = runs
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "step-0000002 (step 2)" in resumed.stderr
    assert read_summary(cut)["status"] == "completed"
    assert_same_weights(
        student_weights(cut / "student" / "model.safetensors"),
        student_weights(two / "student" / "model.safetensors"),
    )
    assert _metrics(cut) == _metrics(two)  # losses, samples' lengths and EOS, without the timings
    assert _state(cut, 4)["onpolicy"]["generators"] == _state(two, 4)["onpolicy"]["generators"]
    a, b = read_summary(two)["on_policy"], read_summary(cut)["on_policy"]
    for key in ("on_policy_steps", "seq_kd_steps", "mean_completion_len", "eos_fraction", "sample_kl"):
        assert a[key] == b[key], key


def test_a_replicated_student_trains_resumes_exactly_and_stays_close_to_the_sharded_one(runs, replicated):
    """runtime.student_placement=replicate: a whole student on every process, its gradients averaged by
    one all-reduce; the same steps, samples and phase rows as the sharded run; its checkpoint (one
    process's tensors on every process, written once) resumes on two processes bit for bit; and its
    losses stay within float rounding of FSDP2's (the same rows, the same sampled completions)."""
    rep, cut, resumed = replicated
    summary = read_summary(rep)
    assert summary["status"] == "completed" and summary["world_size"] == 2
    assert summary["jit_after_prewarm"] == 0
    assert summary["layout"]["student_replicated"] is True and summary["layout"]["teacher_sharded"] is False
    rows = _metrics(rep, ())
    assert [r.get("policy", "data") for r in rows] == ["data", "seq_kd", "data", "on_policy"]
    assert all(len(r["phase_s"]["generate"]) == 2 for r in rows if "policy" in r)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "step-0000002 (step 2)" in resumed.stderr
    assert_same_weights(
        student_weights(cut / "student" / "model.safetensors"),
        student_weights(rep / "student" / "model.safetensors"),
    )
    assert _metrics(cut) == _metrics(rep)
    sharded = _metrics(runs[0])
    for a, b in zip(_metrics(rep), sharded, strict=True):
        assert a["step"] == b["step"] and a.get("completion_tokens") == b.get("completion_tokens")
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4), a["step"]
