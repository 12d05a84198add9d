"""benchmarks/onpolicy_bench.py's smoke check on the CPU: kdistill's side at tiny shapes on one process
and under torchrun on two (gloo), one timed step each, written as one JSON.

    python benchmarks/onpolicy_bench.py --device cpu --tiny --nproc 1,2 --only kdistill --steps 1 --warmup 1
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.test_train_kit import REPO, child_env

pytestmark = pytest.mark.slow


def test_the_scaling_table_has_a_row_per_world_size_with_every_ranks_phases(tmp_path):
    out = tmp_path / "bench.json"
    argv = [
        "--device",
        "cpu",
        "--tiny",
        "--nproc",
        "1,2",
        "--only",
        "kdistill",
        "--steps",
        "1",
        "--warmup",
        "1",
    ]
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "onpolicy_bench.py"), *argv, "--json", str(out)],
        cwd=tmp_path,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["command"].endswith(" ".join([*argv, "--json", str(out)]))
    assert report["device"] and report["torch"] and report["date"]
    assert "trl" not in report["results"]  # --only kdistill
    rows = report["results"]["kdistill"]
    assert set(rows) == {"1", "2"}
    for world, row in rows.items():
        assert "error" not in row, row
        assert row["world_size"] == int(world) and row["layout"]["world"] == int(world)
        assert row["steps_timed"] == 1 and row["jit_after_prewarm"] == 0 and row["teardown_timeouts"] == 0
        # the same prompts per process (2 at --tiny): twice as many completions on two processes
        assert row["completions_per_step"] == 2 * int(world)
        assert row["mean_completion_len"] <= 8 and row["completion_tokens_per_s"] > 0
        assert set(row["phase_s_per_rank"]) == {"generate", "wait", "score", "update"}
        assert all(len(v) == int(world) for v in row["phase_s_per_rank"].values())
    scaling = report["kdistill_scaling"]
    assert scaling["against_world"] == 1 and scaling["1"] == 1.0
    assert scaling["2"] == pytest.approx(
        rows["2"]["completion_tokens_per_s"] / rows["1"]["completion_tokens_per_s"]
    )


def test_a_named_row_sets_the_pair_prompts_and_new_tokens_and_explicit_flags_win():
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import onpolicy_bench
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    _, shape, worlds = onpolicy_bench.parse_args(["--row", "long", "--nproc", "1,2,4"])
    assert (shape.teacher, shape.student, shape.batch, shape.new) == (
        "qwen2.5-1.5b",
        "qwen2.5-0.5b",
        16,
        1024,
    )
    assert worlds == [1, 2, 4]
    _, shape, _ = onpolicy_bench.parse_args(["--row", "7b", "--new", "64"])
    assert (shape.teacher, shape.student, shape.batch, shape.new) == ("qwen2.5-7b", "qwen2.5-1.5b", 4, 64)
    _, shape, _ = onpolicy_bench.parse_args([])
    assert (shape.teacher, shape.batch, shape.new) == ("qwen2.5-1.5b", 8, 128)


def test_set_overrides_read_values_as_the_command_line_does(tmp_path):
    """--set values reach the run's config as `kdistill run`'s own overrides read them: `off` stays the
    word (not YAML 1.1's false), true a bool, 2 a number."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import onpolicy_bench
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    argv = ["--tiny", "--set", "runtime.cuda_graphs=off", "--set", "runtime.profile_shapes=true"]
    _, shape, _ = onpolicy_bench.parse_args([*argv, "--set", "kd.temperature=2"])
    cfg = onpolicy_bench.kdistill_config(tmp_path, tmp_path, "cpu", shape, 1)
    assert cfg["runtime"]["cuda_graphs"] == "off" and cfg["runtime"]["profile_shapes"] is True
    assert cfg["kd"]["temperature"] == 2


def test_the_runs_import_the_tree_the_benchmark_was_started_with(tmp_path):
    """A benchmark started with another tree first on PYTHONPATH (a before/after comparison) hands that
    tree to its `kdistill run` processes, not the repository's src."""
    import shutil

    other = tmp_path / "other"
    shutil.copytree(REPO / "src" / "kdistill", other / "kdistill")
    probe = "import onpolicy_bench, os; print(onpolicy_bench.run_env()['PYTHONPATH'].split(os.pathsep)[0])"
    env = {**child_env(), "PYTHONPATH": os.pathsep.join([str(other), str(REPO / "benchmarks")])}
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == str(other.resolve())


def test_a_run_past_its_limit_is_stopped_with_every_process_stack():
    """onpolicy_bench.launch: a run (here a process that sleeps, with a child of its own in a session of
    its own, as torchrun starts its workers) past its limit gets SIGABRT in every process, so each
    prints its threads' stacks through the faulthandler before it ends (and ends); a run within its
    limit is untouched."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        from onpolicy_bench import launch
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    child = "import time\ndef stuck_in_the_child():\n    time.sleep(120)\nstuck_in_the_child()"
    parent = (
        "import subprocess, sys, time\n"
        f"c = subprocess.Popen([sys.executable, '-c', {child!r}], start_new_session=True)\n"
        "def stuck_in_the_parent():\n    time.sleep(120)\nstuck_in_the_parent()"
    )
    proc, late = launch([sys.executable, "-c", parent], child_env(), limit=3.0)
    assert late and proc.returncode != 0
    assert "stuck_in_the_parent" in proc.stderr and "stuck_in_the_child" in proc.stderr
    assert "Fatal Python error: Aborted" in proc.stderr
    done, fast = launch([sys.executable, "-c", "print('ok')"], child_env(), limit=60.0)
    assert not fast and done.returncode == 0 and done.stdout.strip() == "ok"


def _gone(pid: int) -> bool:
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except OSError:
        return True
    return stat.rpartition(")")[2].split()[0] == "Z"  # ended, not yet reaped


def test_a_benchmark_stopped_by_sigterm_takes_its_run_along(tmp_path):
    """A `timeout` around onpolicy_bench stops it with SIGTERM while it waits for a run: the run (started
    in a session of its own) and the run's workers (each in a session of its own, as torchrun's are) are
    killed too, not left holding the GPUs."""
    pids = tmp_path / "pids"
    child = "import time\ntime.sleep(120)"
    parent = (
        "import os, subprocess, sys, time\n"
        f"c = subprocess.Popen([sys.executable, '-c', {child!r}], start_new_session=True)\n"
        f"open({str(pids)!r} + '.tmp', 'w').write(f'{{os.getpid()}} {{c.pid}}')\n"
        f"os.replace({str(pids)!r} + '.tmp', {str(pids)!r})\n"
        "time.sleep(120)"
    )
    bench = (
        f"import sys\nsys.path.insert(0, {str(REPO / 'benchmarks')!r})\n"
        "from onpolicy_bench import launch, stop_on_sigterm\n"
        "stop_on_sigterm()\n"
        f"launch([sys.executable, '-c', {parent!r}], {{}}, limit=120.0)\n"
    )
    env = child_env()
    proc = subprocess.Popen([sys.executable, "-c", bench], env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not pids.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.1)
    assert pids.exists(), proc.stderr.read() if proc.poll() is not None else "no run started"
    run_pid, worker_pid = (int(x) for x in pids.read_text().split())
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    deadline = time.monotonic() + 10
    while not (_gone(run_pid) and _gone(worker_pid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(run_pid) and _gone(worker_pid)
