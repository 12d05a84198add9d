"""Two runs started together on one output directory: exactly one trains, the other stops with one
line and exit 2, and the run that trained is complete and untouched by the other."""

from __future__ import annotations

from tests.test_train_kit import one_error_line, read_summary, start_proc, write_config


def test_two_runs_on_one_directory_one_trains_the_other_is_refused(tmp_path):
    run = tmp_path / "run"
    cfg = write_config(tmp_path, run_dir=run, steps=6)
    procs = [start_proc(["run", str(cfg), "--quiet"]) for _ in range(2)]  # started back to back
    results = [p.communicate(timeout=300) for p in procs]
    codes = sorted(p.returncode for p in procs)
    assert codes == [0, 2], [(p.returncode, err[-500:]) for p, (_, err) in zip(procs, results)]
    loser = next(err for p, (_, err) in zip(procs, results) if p.returncode == 2)
    message = one_error_line(loser)
    # the second either found the first's live lock or, if it came late, the first's finished run
    assert "is in use by another kdistill run" in message or "already holds a run" in message, message
    summary = read_summary(run)
    assert summary["status"] == "completed" and summary["steps"] == 6
    assert not (run / ".kdistill-lock").exists()  # released by the run that held it
