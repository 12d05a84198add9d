"""Data-parallel runs under torchrun (2 processes, gloo on the CPU, FSDP2 student and teacher).

One uninterrupted 2-process run and one 1-process run of the same config (same global batch of 4
sequences) go in parallel, with a 2-process run killed after step 4 (checkpoint at step 3), a 2-process
run whose rank 1 gets SIGTERM inside step 4, and the runs that need no other run: a batch that does not
divide over the processes, a mixture of two teachers, a cross-tokenizer student and the FSDP2 helper
checks (clipping, AdamW, all-gathers: tests/fsdp_checks.py, one launch). Then, in parallel: the killed
2-process run resumed on two, the 2-process checkpoint (sharded, torch.distributed.checkpoint) resumed
in one process (2 -> 1) and on four (2 -> 4: one sequence per process, every tensor resharded from two
shards to four), the 1-process run's checkpoint at step 3 resumed on 2 (1 -> 2: a copy of the finished
run cut back to that checkpoint, so the reference is also the interrupted run), the SIGTERM-stopped run
resumed, a run under `torchrun --max-restarts=1` whose rank 1 is killed by PID at step 4 (restarted from
step 3 on its own), a run with kd.layer_map, and the same run as two one-process "nodes" meeting through
a c10d rendezvous on 127.0.0.1, in the other layout (replicated teacher, checkpointed blocks, student
kept gathered: one launch for both). A resume on as many processes as the run had, and the restart, must
end with the uninterrupted run's weights bit for bit; across process counts and layouts, within the
tolerances below. Every launch of a batch starts at once, so the suite waits for two batches instead of
a launch per test; and both batches start in the background when the suite starts (tests/background.py),
this module running last, so they use the cores that the in-process tests leave idle. Each process
spends most of its few seconds importing torch, so a launch saved (a run that checks two things) is what
shortens the batches on a machine of few cores.

Why 2 processes match 1 process only closely, not exactly: the batch, the initial weights and every
per-token loss are the same, but the gradient of the 4-row batch is the average of two 2-row gradients
(FSDP's reduce-scatter) instead of one 4-row reduction, and the logged loss is a token-weighted sum of
two means. Float32 summation order differs, so each step differs by ~1e-7 relative; AdamW over 6 steps
keeps that well under 1e-5 (measured: losses equal to ~1e-7, weights to ~5e-6 absolute). The tolerances
below (1e-5 relative on losses, 1e-4 absolute on weights) leave room for other BLAS builds while
still catching a wrong loss scaling (a factor of 2 on the gradient moves the final loss by ~1e-2).
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from tests import background
from tests.test_train_kit import (
    REPO,
    assert_same_weights,
    child_env,
    interrupted_copy,
    read_summary,
    start_proc,
    student_weights,
    write_config,
)

pytestmark = pytest.mark.slow

SCHED = dict(steps=6, batch_size=4, checkpoint_every=3, eval_every=3)
# The other layout: a replicated teacher, checkpointed blocks, the student kept from forward to backward.
REPLICATED = [
    "runtime.teacher_placement=replicate",
    "runtime.activation_checkpointing=blocks",
    "runtime.student_reshard=after_backward",
]


def start_torchrun(argv: list[str], launcher: list[str] | None = None, **env: str) -> subprocess.Popen:
    launcher = launcher or ["--nproc_per_node=2", "--standalone"]
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", *launcher, "-m", "kdistill", *argv],
        cwd=REPO,
        env=child_env(**env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(p: subprocess.Popen, timeout: float = 180) -> subprocess.CompletedProcess:
    out, err = p.communicate(timeout=timeout)
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def torchrun(
    argv: list[str], nproc: int = 2, timeout: float = 180, **env: str
) -> subprocess.CompletedProcess:
    return finish(start_torchrun(argv, [f"--nproc_per_node={nproc}", "--standalone"], **env), timeout)


def _losses(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _evals(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "eval.jsonl").read_text().splitlines()]


def _close_to(run_dir: Path, ref: Path) -> None:
    """Losses to 1e-5 relative and final weights to 1e-4 absolute (another process count)."""
    assert read_summary(run_dir)["status"] == "completed"
    a, b = _losses(ref), _losses(run_dir)
    assert [row["step"] for row in b] == [1, 2, 3, 4, 5, 6]
    for x, y in zip(a, b, strict=True):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-5), x["step"]
    w1, w2 = (student_weights(d / "student" / "model.safetensors") for d in (ref, run_dir))
    assert w1.keys() == w2.keys()
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], rtol=0, atol=1e-4)


def start_helper(script: str, out: Path) -> subprocess.Popen:
    """tests/<script> under torchrun (2 gloo processes); it writes its JSON to `out`."""
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone"]
        + [str(REPO / "tests" / script), str(out)],
        cwd=REPO,
        env=child_env(PYTHONPATH=f"{REPO / 'src'}{os.pathsep}{REPO}"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _helper_result(runs, name: str) -> dict:
    """The JSON that tests/fsdp_<name>.py's check wrote (all three checks: one launch of the first batch)."""
    _, _, dirs, out, _ = runs
    assert out["checks"].returncode == 0, out["checks"].stderr[-3000:]
    return json.loads(dirs[name].read_text())


def _other_configs(tmp: Path) -> dict[str, Path]:
    """A mixture of two teachers and a student with another tokenizer (4 steps, batch 4), as YAML."""
    import yaml

    from tests.test_cross_tokenizer import other_student
    from tests.test_multi_teacher import two_teachers
    from tests.test_train_kit import base_config

    mix = two_teachers(tmp / "mix", steps=4, batch_size=4)
    cross = base_config(tmp / "cross", steps=4, batch_size=4)
    cross["student"] = {"path": str(other_student())}
    cross["kd"]["cross_tokenizer"] = True
    paths = {}
    for name, cfg in (("mix", mix), ("cross", cross)):
        paths[name] = tmp / f"{name}.yaml"
        paths[name].write_text(yaml.safe_dump(cfg, sort_keys=False))
    return paths


def _seen(read):
    """What `read` returns, or why it could not (the test that asserts on it reports it)."""
    try:
        return read()
    except (OSError, ValueError, KeyError) as e:
        return f"unreadable: {e.__class__.__name__}: {e}"


def prelaunch(fixturenames: set[str]) -> None:
    """tests/conftest.py: start both batches in the background if a selected test uses them."""
    if fixturenames & {"runs", "more"}:
        _started()


@functools.cache
def _started() -> None:
    """Write the configs here (the tiny models are built in this process), then queue the two batches
    for the background thread (tests/background.py)."""
    tmp = Path(tempfile.mkdtemp(prefix="kdistill-dist-"))
    atexit.register(shutil.rmtree, tmp, True)
    cfg = write_config(tmp, **SCHED)
    other = _other_configs(tmp)
    first = background.start("distributed.first", lambda: _first_batch(tmp, cfg, other))
    background.start("distributed.second", lambda: _second_batch(first.result()))


@pytest.fixture(scope="module")
def runs():
    """The first batch: (tmp, cfg, dirs, outputs, what the interrupted runs left before the second batch
    resumes them)."""
    _started()
    return background.wait("distributed.first")


@pytest.fixture(scope="module")
def more(runs):
    """The second batch: (dirs, outputs)."""
    return background.wait("distributed.second")


def _first_batch(tmp: Path, cfg: Path, other: dict[str, Path]) -> tuple:
    """Every launch at once."""
    dirs = {k: tmp / k for k in ("two", "one", "killed", "signalled", "odd", "teardown")}
    for name in ("clip", "adamw", "gathers", "replicate"):  # tests/fsdp_checks.py: the helpers in one launch
        dirs[name] = tmp / "checks" / f"{name}.json"
    dirs["mix"], dirs["cross"] = tmp / "mix", tmp / "cross"
    procs = {
        "two": start_torchrun(["run", str(cfg), f"output.dir={dirs['two']}", "--quiet"]),
        "one": start_proc(["run", str(cfg), f"output.dir={dirs['one']}", "--quiet"]),
        "killed": start_torchrun(
            ["run", str(cfg), f"output.dir={dirs['killed']}", "--quiet"], KDISTILL_TEST_KILL_AT="4"
        ),
        "signalled": start_torchrun(  # SIGTERM to rank 1 alone, inside step 4
            ["run", str(cfg), f"output.dir={dirs['signalled']}", "--quiet"],
            KDISTILL_TEST_KILL_AT="SIGTERM@4.1",
            KDISTILL_TEST_KILL_RANK="1",
        ),
        "odd": start_torchrun(
            ["run", str(cfg), f"output.dir={dirs['odd']}", "schedule.batch_size=3", "--quiet"]
        ),
        "teardown": start_torchrun(  # a process group's teardown that never ends, waited for 2 s
            ["run", str(cfg), f"output.dir={dirs['teardown']}", "schedule.steps=2", "--quiet"],
            KDISTILL_TEST_TEARDOWN_HANG="2",
        ),
        "mix": start_torchrun(["run", str(other["mix"]), "--quiet"]),
        "cross": start_torchrun(["run", str(other["cross"]), "--quiet"]),
        "checks": start_helper("fsdp_checks.py", tmp / "checks"),
    }
    out = {k: finish(p, 900) for k, p in procs.items()}
    # What the interrupted runs left, seen before the second batch resumes them in place.
    before = {
        "killed_ckpts": _seen(lambda: sorted(p.name for p in (dirs["killed"] / "checkpoints").iterdir())),
        "signalled_status": _seen(lambda: read_summary(dirs["signalled"])["status"]),
        "signalled_steps": _seen(lambda: [row["step"] for row in _losses(dirs["signalled"])]),
        "signalled_ckpt": (dirs["signalled"] / "checkpoints" / "step-0000004").is_dir(),
    }
    dirs["killed_copy"] = tmp / "killed_copy"  # resumed in one process (the original on two)
    dirs["killed_four"] = tmp / "killed_four"  # resumed on four processes
    for copy in ("killed_copy", "killed_four"):
        shutil.copytree(dirs["killed"], dirs[copy])
    # The one-process run, as a run stopped after its checkpoint at step 3 leaves it: resumed on two.
    dirs["one_cut"] = tmp / "one_cut"
    if out["one"].returncode == 0:
        interrupted_copy(dirs["one"], dirs["one_cut"], 3)
    return tmp, cfg, dirs, out, before


def _free_port() -> int:
    """A free port below the kernel's ephemeral range: the standalone launches running beside the
    two-node one take their stores' ports from that range (bind to port 0), so none of them can take
    this one between the choice and the first node's bind."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random(os.getpid())
    for _ in range(200):
        port = rng.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # every port tried was taken: any free one
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _second_batch(runs: tuple) -> tuple:
    """Every launch at once: the in-place resumes of the killed and the SIGTERM-stopped 2-process runs,
    resumes across process counts, a restart after a killed rank, the layer-map run and two nodes (in the
    replicated-teacher layout)."""
    tmp, cfg, dirs, _, _ = runs
    procs = {
        "resumed": start_torchrun(["run", "--resume", str(dirs["killed"]), "--quiet"]),
        "signalled": start_torchrun(["run", "--resume", str(dirs["signalled"]), "--quiet"]),
        "two_to_one": start_proc(["run", "--resume", str(dirs["killed_copy"]), "--quiet"]),
        "one_to_two": start_torchrun(["run", "--resume", str(dirs["one_cut"]), "--quiet"]),
        "two_to_four": start_torchrun(
            ["run", "--resume", str(dirs["killed_four"]), "--quiet"], ["--nproc_per_node=4", "--standalone"]
        ),
    }
    holds = tmp / "holds"
    holds.mkdir()
    dirs["restarted"], dirs["nodes"] = tmp / "restarted", tmp / "nodes"
    procs["restarted"] = start_torchrun(
        ["run", str(cfg), f"output.dir={dirs['restarted']}", "--quiet"],
        ["--nproc_per_node=2", "--standalone", "--max-restarts=1", "--monitor-interval=0.5"],
        KDISTILL_TEST_HOLD_AT=f"4@{holds}",
    )
    dirs["mapped"] = tmp / "mapped"  # kd.layer_map: projections (32 -> 64) trained beside the student
    procs["mapped"] = start_torchrun(
        ["run", str(cfg), f"output.dir={dirs['mapped']}", "--quiet"]
        + ["kd.layer_map=[[0,0],[1,1]]", "kd.hidden_weight=0.5"]
    )
    # Two nodes of one process each, with the other layout (a replicated teacher, checkpointed blocks,
    # the student kept gathered from forward to backward): neither changes the run's numbers, so one
    # launch checks both against the uninterrupted run.
    port = _free_port()
    for node in (0, 1):
        rdzv = ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=kdistill-test"]
        procs[f"node{node}"] = start_torchrun(
            ["run", str(cfg), f"output.dir={dirs['nodes']}", "--quiet", *REPLICATED],
            ["--nnodes=2", "--nproc_per_node=1", f"--node-rank={node}", *rdzv],
        )
    deadline = time.time() + 900
    while not (holds / "rank1.pid").exists() and time.time() < deadline:
        time.sleep(0.2)
    os.kill(int((holds / "rank1.pid").read_text()), signal.SIGKILL)  # one gloo rank dies mid-run
    return dirs, {k: finish(p, 900) for k, p in procs.items()}


def test_two_processes_complete_and_write_once(runs):
    _, _, dirs, out, _ = runs
    r = out["two"]
    assert r.returncode == 0, r.stderr[-3000:]
    run = dirs["two"]
    summary = read_summary(run)
    assert summary["status"] == "completed" and summary["steps"] == 6
    assert summary["world_size"] == 2
    rows = _losses(run)
    assert [row["step"] for row in rows] == [1, 2, 3, 4, 5, 6]  # rank 1 wrote nothing
    assert [json.loads(x)["step"] for x in (run / "eval.jsonl").read_text().splitlines()] == [3, 6]
    assert r.stdout.count("status completed") == 1  # the summary line comes from rank 0 only
    ckpts = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert ckpts == ["step-0000003", "step-0000006"]
    # Checkpoints are sharded: each rank wrote its own file, nothing gathered.
    last = run / "checkpoints" / "step-0000006"
    assert sorted(p.name for p in (last / "shards").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert not (last / "student.safetensors").exists()
    state = json.loads((last / "state.json").read_text())
    assert state["format"] == "sharded" and state["world_size"] == 2
    # The exported student is a whole (unsharded) Hugging Face model: the checkpoint's weights.
    from transformers import AutoModelForCausalLM

    from kdistill.models.decoder import build_decoder
    from kdistill.models.spec import load_spec
    from kdistill.train import distributed as dist

    model = AutoModelForCausalLM.from_pretrained(run / "student", dtype=torch.float32).eval()
    assert sum(p.numel() for p in model.parameters()) > 0
    exported = student_weights(run / "student" / "model.safetensors")
    plain = build_decoder(load_spec(str(run / "student")), seed=None)
    dist.load_sharded(plain, torch.optim.AdamW(plain.parameters()), str(last / "shards"))
    final = plain.state_dict()
    for k, v in exported.items():
        assert torch.equal(v, final[k]), k


def test_two_processes_match_one_process(runs):
    _, _, dirs, out, _ = runs
    assert out["one"].returncode == 0, out["one"].stderr[-3000:]
    assert out["two"].returncode == 0, out["two"].stderr[-3000:]
    a, b = _losses(dirs["one"]), _losses(dirs["two"])
    for x, y in zip(a, b, strict=True):
        for key in ("loss", "ce", "kd", "grad_norm"):  # grad_norm: the global norm over every shard
            assert y[key] == pytest.approx(x[key], rel=1e-5), (x["step"], key)
    # Held-out evals split over the ranks (each its rows of every batch, sums reduced): the same result.
    e1, e2 = (_evals(dirs[k]) for k in ("one", "two"))
    for x, y in zip(e1, e2, strict=True):
        for key in ("student_loss", "kl_to_teacher", "teacher_loss"):
            assert y[key] == pytest.approx(x[key], rel=1e-5), (x["step"], key)
        assert y["tokens"] == x["tokens"]
    s1, s2 = read_summary(dirs["one"]), read_summary(dirs["two"])
    assert s2["final_loss"] == pytest.approx(s1["final_loss"], rel=1e-5)
    assert s2["tokens_seen"] == s1["tokens_seen"]
    w1 = student_weights(dirs["one"] / "student" / "model.safetensors")
    w2 = student_weights(dirs["two"] / "student" / "model.safetensors")
    assert w1.keys() == w2.keys()
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], rtol=0, atol=1e-4)


def test_resume_under_torchrun_is_exact(runs, more):
    _, _, dirs, out, before = runs
    assert out["killed"].returncode != 0
    run = dirs["killed"]
    assert before["killed_ckpts"] == ["step-0000003"]  # before the resume
    r = more[1]["resumed"]
    assert r.returncode == 0, r.stderr[-3000:]
    assert read_summary(run)["status"] == "completed"
    assert [row["step"] for row in _losses(run)] == [1, 2, 3, 4, 5, 6]
    assert_same_weights(
        student_weights(run / "student" / "model.safetensors"),
        student_weights(dirs["two"] / "student" / "model.safetensors"),
    )


def test_batch_not_divisible_is_one_line_error(runs):
    _, _, dirs, out, _ = runs
    r = out["odd"]  # schedule.batch_size=3 on two processes
    assert r.returncode != 0
    errors = {ln for ln in r.stderr.splitlines() if ln.startswith("kdistill: error:")}
    assert len(errors) == 1, r.stderr[-3000:]
    assert "schedule.batch_size 3" in errors.pop()
    assert "src/kdistill" not in r.stderr  # no traceback from kdistill (torchrun reports the exit code)
    assert not dirs["odd"].exists()  # refused before the output folder was made


def test_sharded_checkpoint_resumes_in_one_process(runs, more):
    dirs, out = more
    assert out["two_to_one"].returncode == 0, out["two_to_one"].stderr[-3000:]
    _close_to(dirs["killed_copy"], runs[2]["two"])
    assert (dirs["killed_copy"] / "checkpoints" / "step-0000006" / "student.safetensors").exists()


def test_two_process_checkpoint_resumes_on_four(runs, more):
    dirs, out = more
    assert out["two_to_four"].returncode == 0, out["two_to_four"].stderr[-3000:]
    run = dirs["killed_four"]
    assert read_summary(run)["world_size"] == 4
    _close_to(run, runs[2]["two"])
    # The checkpoints it wrote after the resume are sharded over the four processes.
    last = run / "checkpoints" / "step-0000006"
    assert len(list((last / "shards").glob("*.distcp"))) == 4
    assert json.loads((last / "state.json").read_text())["world_size"] == 4


def test_one_process_checkpoint_resumes_on_two(runs, more):
    dirs, out = more
    assert out["one_to_two"].returncode == 0, out["one_to_two"].stderr[-3000:]
    assert "resuming from" in out["one_to_two"].stderr and "step 3" in out["one_to_two"].stderr
    _close_to(dirs["one_cut"], runs[2]["one"])


def test_killed_rank_restarts_from_the_last_checkpoint(runs, more):
    dirs, out = more
    r = out["restarted"]
    assert r.returncode == 0, r.stderr[-3000:]
    run = dirs["restarted"]
    assert "resuming from" in r.stderr and "step 3" in r.stderr
    assert [row["step"] for row in _losses(run)] == [1, 2, 3, 4, 5, 6]  # none lost, none repeated
    assert read_summary(run)["tokens_seen"] == read_summary(runs[2]["two"])["tokens_seen"]
    assert_same_weights(
        student_weights(run / "student" / "model.safetensors"),
        student_weights(runs[2]["two"] / "student" / "model.safetensors"),
    )


def test_two_nodes_through_a_c10d_rendezvous(runs, more):
    dirs, out = more
    for node in ("node0", "node1"):
        assert out[node].returncode == 0, out[node].stderr[-3000:]
    assert read_summary(dirs["nodes"])["world_size"] == 2
    _close_to(dirs["nodes"], runs[2]["two"])


def test_root_gathered_once_per_step_and_blocks_once_each_way(runs):
    # forward, 8 chunks of the KD head and the backward (checkpointed blocks recomputed): the root's
    # embeddings and lm_head once, each block once for forward and once for backward; kept gathered
    # from forward to backward, each block once.
    result = _helper_result(runs, "gathers")
    assert {k: result[k] for k in ("regathered", "kept")} == {
        "regathered": {"root": 1, "blocks": [2, 2, 2]},
        "kept": {"root": 1, "blocks": [1, 1, 1]},
    }


def test_a_kept_student_is_sharded_a_few_blocks_to_a_unit_with_the_same_gradients(runs):
    # 8 blocks kept gathered: 4 units of 2 blocks and the root, each gathered once a step (one block a
    # unit: 9 units); the loss and every process's gradient shards equal to one block a unit
    u = _helper_result(runs, "gathers")["units"]
    assert (u["policy"]["units"], u["policy"]["gathers"]) == (5, 5)
    assert (u["blocks"]["units"], u["blocks"]["gathers"]) == (9, 9)
    assert u["policy"]["loss"] == u["blocks"]["loss"] and u["same_grads"]


def test_replicated_teacher_checkpointed_blocks_and_kept_student_match(runs, more):
    """The two-node run's layout (REPLICATED): the run says so in its summary and matches the
    uninterrupted run of the default layout."""
    dirs, out = more
    for node in ("node0", "node1"):
        assert out[node].returncode == 0, out[node].stderr[-3000:]
    layout = read_summary(dirs["nodes"])["layout"]
    assert layout == {
        "world": 2,
        "teacher_sharded": False,
        "checkpointing": True,
        "student_kept": True,
        "swiglu_kept": False,
        "student_replicated": False,
    }
    assert read_summary(runs[2]["two"])["layout"]["teacher_sharded"]  # auto on the CPU: sharded
    assert not read_summary(runs[2]["two"])["layout"]["checkpointing"]
    _close_to(dirs["nodes"], runs[2]["two"])


def test_layer_map_projections_are_sharded_and_left_out_of_the_export(runs, more):
    """kd.layer_map under torchrun: each projection is its own FSDP2 unit, in the sharded checkpoints,
    and the gathered export is the plain student."""
    dirs, out = more
    assert out["mapped"].returncode == 0, out["mapped"].stderr[-3000:]
    run = dirs["mapped"]
    s = read_summary(run)
    assert s["status"] == "completed" and s["final_loss"] < s["initial_loss"]
    from kdistill.train import distributed as dist

    names = dist.sharded_model_names(str(run / "checkpoints" / "step-0000006" / "shards"))
    assert {k for k in names if k.startswith("kd_")} == {"kd_layer_proj.0.weight", "kd_layer_proj.1.weight"}
    exported = student_weights(run / "student" / "model.safetensors")
    assert exported.keys() == student_weights(runs[2]["two"] / "student" / "model.safetensors").keys()


def test_sharded_gradients_are_clipped_like_clip_grad_norm(runs):
    """The step clips FSDP2 gradients through their local shards: the same norm and the same clipped
    gradients as torch's clip_grad_norm_ on an unsharded copy (a clip far below the norm)."""
    result = _helper_result(runs, "clip")
    sharded, plain = result["norm"]
    assert plain > 1e-2 and sharded == pytest.approx(plain, rel=1e-5)
    assert result["max_abs_diff"] < 1e-8


def test_replicated_gradients_are_averaged_as_fsdp_reduces_them(runs):
    """A whole student on every process (runtime.student_placement=replicate): each process's gradients
    of its rows, averaged by one all-reduce of a flat buffer, equal FSDP2's reduce-scattered gradients
    and one process's over every row; in an fp32 buffer to float rounding, in bf16 to bf16's."""
    r = _helper_result(runs, "replicate")
    assert r["fp32_buffer_dtype"] == "torch.float32" and r["bf16_buffer_dtype"] == "torch.bfloat16"
    assert r["fp32_moved"] > 1e-3 and r["bf16_moved"] > 1e-3  # the average changed each process's own
    assert r["fp32_vs_fsdp"] < 1e-7 and r["fp32_vs_one"] < 1e-6 * r["scale"]
    assert r["bf16_vs_fsdp"] < 2**-7 * r["scale"] and r["bf16_vs_one"] < 2**-7 * r["scale"]


def test_two_teachers_and_cross_tokenizer_runs_under_torchrun(runs):
    """The other loss paths under torchrun (a mixture of two teachers; a student with another
    tokenizer): each process weighs its loss by its share of the global batch's tokens and the run
    trains."""
    _, _, dirs, out, _ = runs
    for name in ("mix", "cross"):
        r = out[name]
        assert r.returncode == 0, (name, r.stderr[-3000:])
        s = read_summary(dirs[name])
        assert s["status"] == "completed" and s["world_size"] == 2, name
        assert s["final_loss"] < s["initial_loss"], name


def test_fused_adamw_on_local_shards_matches_torch_on_dtensors(runs):
    """The sharded student's AdamW runs torch's fused kernel on the local shards: the same parameters,
    moments and step counts as torch's fused AdamW on the DTensors, a step skipped by found_inf
    included (its step count not advanced), and a step whose gradients grad_scale divides (the clip)."""
    result = _helper_result(runs, "adamw")
    assert result == {"same": [True, True, True, True], "steps": [3.0], "moved": True}


def test_sigterm_to_one_rank_stops_every_rank_at_one_step_and_resumes_exactly(runs, more):
    """SIGTERM to rank 1 alone, inside step 4: both processes finish that step, save it and write an
    interrupted summary (exit 0); resumed under torchrun, the run ends with the uninterrupted run's
    weights, bit for bit."""
    _, _, dirs, out, before = runs
    run = dirs["signalled"]
    r = out["signalled"]
    assert r.returncode == 0, r.stderr[-3000:]
    # what the stopped run left, before the second batch resumed it
    assert before["signalled_status"] == "interrupted"
    assert before["signalled_steps"] == [1, 2, 3, 4]
    assert before["signalled_ckpt"] is True
    r = more[1]["signalled"]
    assert r.returncode == 0, r.stderr[-3000:]
    assert read_summary(run)["status"] == "completed"
    assert_same_weights(
        student_weights(run / "student" / "model.safetensors"),
        student_weights(dirs["two"] / "student" / "model.safetensors"),
    )


def test_a_process_that_joined_a_group_exits_without_finalisation_and_keeps_its_output():
    """After a process group, the program ends through os._exit (no interpreter finalisation, where the
    backend's threads could abort a completed run) with its printed output flushed and its exit code."""
    code = (
        "import sys\n"
        "from kdistill.train import distributed as dist\n"
        "print('partial line without newline', end='')\n"
        "sys.stderr.write('to stderr')\n"
        "import atexit; atexit.register(lambda: print('FINALISED'))\n"
        "dist.leave(3)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], env=child_env(), capture_output=True, text=True)
    assert (r.returncode, r.stdout, r.stderr) == (3, "partial line without newline", "to stderr")


def test_the_program_leaves_through_dist_leave_only_after_joining(monkeypatch):
    from kdistill import cli
    from kdistill.train import distributed as dist

    left: list[int] = []
    monkeypatch.setattr(dist, "leave", left.append)
    monkeypatch.setattr(sys, "argv", ["kdistill", "report", "/nonexistent-run"])
    assert cli.main() == 2 and left == []  # never joined: an ordinary return
    monkeypatch.setattr(dist, "_JOINED", True)
    assert cli.main() == 2 and left == [2]  # the program, after a group: leave with the code
    assert cli.main(["report", "/nonexistent-run"]) == 2 and left == [2]  # in-process call: returns


def test_destroy_collects_garbage_before_the_process_group_goes(monkeypatch):
    """distributed.destroy: what only a reference cycle still holds (a CUDA graph that captured
    collectives keeps NCCL's communicator until destroyed) is collected before destroy_process_group."""
    import gc

    import torch.distributed as tdist

    from kdistill.train import distributed as kdist

    freed: list[str] = []

    class Held:
        def __del__(self) -> None:
            freed.append("graph")

    cycle: dict = {"graph": Held()}
    cycle["self"] = cycle
    del cycle
    gc.disable()  # so that only destroy's own collection can free the cycle
    try:
        monkeypatch.setattr(tdist, "is_initialized", lambda: True)
        monkeypatch.setattr(tdist, "destroy_process_group", lambda: freed.append("destroy"))
        kdist.destroy()
    finally:
        gc.enable()
    assert freed == ["graph", "destroy"]


def test_a_teardown_that_never_ends_is_left_behind_and_the_run_exits_with_its_code(runs):
    """A 2-process run whose process-group teardown never ends (as a run whose CUDA graphs still held
    NCCL's communicator did): each process waits its limit, says so in one line, and exits 0 with the
    run complete."""
    _, _, dirs, out, _ = runs
    r = out["teardown"]
    assert r.returncode == 0, r.stderr[-3000:]
    assert read_summary(dirs["teardown"])["status"] == "completed"
    lines = [x for x in r.stderr.splitlines() if "teardown did not end within 2 s" in x]
    assert len(lines) == 2 and "Traceback" not in r.stderr  # one line from each process


def test_destroy_waits_a_limited_time_and_raises_the_teardowns_error(monkeypatch, caplog):
    """distributed.destroy: a teardown still running after the limit is left (False, one warning); one
    that fails raises its error in the caller."""
    import threading

    import torch.distributed as tdist

    from kdistill.train import distributed as kdist

    release = threading.Event()
    monkeypatch.setattr(tdist, "is_initialized", lambda: True)
    monkeypatch.setattr(tdist, "destroy_process_group", lambda: release.wait(30))
    t0 = time.monotonic()
    with caplog.at_level("WARNING", logger="kdistill"):
        assert kdist.destroy(timeout=0.2) is False
    assert time.monotonic() - t0 < 10
    assert [r.message for r in caplog.records if "teardown did not end within 0.2 s" in r.message]
    release.set()

    def fails() -> None:
        raise RuntimeError("the backend failed")

    monkeypatch.setattr(tdist, "destroy_process_group", fails)
    with pytest.raises(RuntimeError, match="the backend failed"):
        kdist.destroy(timeout=5)
    monkeypatch.setattr(tdist, "destroy_process_group", lambda: None)
    assert kdist.destroy(timeout=5) is True
