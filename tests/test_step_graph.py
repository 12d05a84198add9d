"""runtime.cuda_graphs on a machine without a GPU: the setting's checks, which runs may capture their
step, the bookkeeping that decides when to capture, and the memory plan's term for the graph's pool.
The captured step itself is tested on a GPU (tests/gpu/test_graph_gpu.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import yaml

from kdistill.config import RunConfig, TeacherConfig
from kdistill.errors import UserError
from kdistill.memory import estimate_memory
from kdistill.models.spec import load_spec
from kdistill.train.graph import WARM_STEPS, StepGraph, signature, wanted
from tests.test_train_kit import base_config, run_cli

CUDA, CPU = torch.device("cuda"), torch.device("cpu")


def _cfg(**runtime) -> RunConfig:
    cfg = RunConfig()
    return dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, **runtime))


def test_bad_value_is_one_line(tmp_path, capsys):
    cfg = base_config(tmp_path / "run")
    cfg["runtime"]["cuda_graphs"] = "sometimes"
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    rc, _, err = run_cli(capsys, "run", str(path), "--quiet")
    assert rc == 2 and "runtime.cuda_graphs" in err and "expected one of: auto, on, off" in err
    assert "Traceback" not in err and not (tmp_path / "run").exists()


def test_on_is_refused_in_one_line_where_capture_cannot_be_done(tmp_path, capsys):
    cfg = base_config(tmp_path / "run")
    cfg["runtime"]["cuda_graphs"] = "on"  # on the CPU
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    rc, _, err = run_cli(capsys, "run", str(path), "--quiet")
    assert rc == 2 and "Traceback" not in err
    line = [x for x in err.splitlines() if "cuda_graphs" in x]
    assert len(line) == 1 and "not on a CUDA device" in line[0]


def test_which_runs_capture():
    assert wanted(_cfg(), CUDA, 1)
    assert not wanted(_cfg(), CPU, 1)  # auto: not on a CPU
    assert not wanted(_cfg(), CUDA, 2)  # auto: not under torchrun
    assert not wanted(_cfg(cuda_graphs="off"), CUDA, 1)
    lora = _cfg()
    lora.student.lora.rank = 4
    assert lora.student.lora.enabled and wanted(lora, CUDA, 1)  # adapters are captured too
    cached = dataclasses.replace(_cfg(), teacher=TeacherConfig(cache="some/cache"))
    assert not wanted(cached, CUDA, 1)
    for cfg, why in [(cached, "teacher.cache"), (_cfg(), "torchrun")]:
        on = dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, cuda_graphs="on"))
        with pytest.raises(UserError, match=why):
            wanted(on, CUDA, 2 if why == "torchrun" else 1)


def test_capture_after_warm_steps_at_one_signature():
    ids = torch.zeros(2, 8, dtype=torch.long)
    a = [((ids, ids), 14)]
    b = [((ids, ids), 13)]  # another count of scored tokens: another graph
    g = StepGraph(CPU)
    assert signature(a) != signature(b)
    for _ in range(WARM_STEPS):
        assert not g.capture_now(signature(a))
        g.note_eager(signature(a))
    assert g.capture_now(signature(a)) and not g.capture_now(signature(b))
    g.note_eager(signature(b))  # a step of another shape restarts the count
    assert not g.capture_now(signature(a))
    assert not g.ready(signature(a)) and not g.restore_grads()  # nothing captured yet


def test_memory_plan_counts_the_eval_beside_the_graph_pool():
    t, s = load_spec("qwen2.5-1.5b"), load_spec("qwen2.5-0.5b")
    on = estimate_memory(t, s, _cfg())
    off = estimate_memory(t, s, _cfg(cuda_graphs="off"))
    assert "eval_beside_graph_pool" in on and "eval_beside_graph_pool" not in off
    assert on["total"] - off["total"] == on["eval_beside_graph_pool"] > 0
    assert "eval_beside_graph_pool" not in estimate_memory(t, s, _cfg(), device="cpu")


def test_generated_steps_are_captured_when_every_step_is_one_with_one_teacher():
    def gen(**kd) -> RunConfig:
        cfg = _cfg()
        return dataclasses.replace(cfg, kd=dataclasses.replace(cfg.kd, **kd))

    assert wanted(gen(on_policy=1.0), CUDA, 1) and wanted(gen(seq_kd=1.0), CUDA, 1)
    assert not wanted(gen(on_policy=1.0), CUDA, 2)
    for cfg, why in [
        (gen(on_policy=0.5), "alternate between generated and data rows"),
        (gen(on_policy=1.0, on_policy_loss="sampled_reverse_kl"), "sampled_reverse_kl"),
    ]:
        assert not wanted(cfg, CUDA, 1)  # auto: eager
        on = dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, cuda_graphs="on"))
        with pytest.raises(UserError, match=why):
            wanted(on, CUDA, 1)
    t, s = load_spec("qwen2.5-7b"), load_spec("qwen2.5-1.5b")
    on = estimate_memory(t, s, gen(on_policy=1.0))
    off = estimate_memory(
        t,
        s,
        dataclasses.replace(
            gen(on_policy=1.0), runtime=dataclasses.replace(_cfg().runtime, cuda_graphs="off")
        ),
    )
    # writing and scoring run beside the captured update's pool: the plan adds them to the step's peak
    assert on["generation_beside_graph_pool"] > 0 and "generation_beside_graph_pool" not in off
    assert on["total"] > off["total"]


class _Graph:
    """Stands in for torch.cuda.CUDAGraph: records reset() (which destroys a real graph)."""

    def __init__(self) -> None:
        self.resets = 0

    def reset(self) -> None:
        self.resets += 1


def test_release_destroys_every_graph_and_keeps_the_counts():
    """StepGraph.release, at a run's end before the process group is destroyed: the step's graph and
    every scoring graph are reset (a graph that captured collectives holds NCCL's communicator until
    it is destroyed) and dropped; the counts the summary reports stay."""
    g = StepGraph(CPU)
    step, scoring = _Graph(), [_Graph(), _Graph()]
    t = torch.zeros(2)
    g.graph, g.sig, g.parts, g.inputs = step, ("data",), t, [(t,)]
    g.counts.update(captures=1, replays=5)
    g.scoring.graphs = {(1, (2, 3)): (scoring[0], t, t), (1, (2, 4)): (scoring[1], t, t)}
    g.scoring.counts.update(scoring_captures=2, scoring_replays=7)
    g.release()
    assert step.resets == 1 and [s.resets for s in scoring] == [1, 1]
    assert g.graph is None and g.parts is None and g.inputs == [] and g.scoring.graphs == {}
    assert not g.ready(("data",)) and not g.restore_grads()
    summary = g.summary()
    assert summary["captures"] == 1 and summary["replays"] == 5 and summary["scoring_replays"] == 7
    g.release()  # twice: nothing left to reset
    assert step.resets == 1


def test_a_run_releases_its_graphs_when_it_ends_or_fails(monkeypatch, tmp_path):
    """recipe.train releases the run's graphs on every way out of the loop (an error included), after
    the summary has read their counts; a release that fails after an error does not hide that error."""
    from types import SimpleNamespace

    from kdistill.train import recipe

    released: list[str] = []

    class Held:
        def release(self) -> None:
            released.append("release")

    trackers = SimpleNamespace(close=lambda failed=False: released.append(f"close failed={failed}"))
    run = SimpleNamespace(ctx=SimpleNamespace(graph=Held()), trackers=trackers)
    monkeypatch.setattr(recipe, "setup", lambda *a, **k: run)
    monkeypatch.setattr(recipe, "train_loop", lambda r: ("done", 3, {}))
    monkeypatch.setattr(recipe, "finish", lambda r, *a: released.append("summary") or {"steps": 3})
    assert recipe.train(RunConfig(), tmp_path) == {"steps": 3}
    assert released == ["summary", "release", "close failed=False"]

    def fails(r):
        raise RuntimeError("a step failed")

    released.clear()
    monkeypatch.setattr(recipe, "train_loop", fails)
    with pytest.raises(RuntimeError, match="a step failed"):
        recipe.train(RunConfig(), tmp_path)
    assert released == ["close failed=True", "release"]

    class Broken:  # a device in an error state: the release fails too
        def release(self) -> None:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    run.ctx.graph = Broken()
    with pytest.raises(RuntimeError, match="a step failed"):  # the run's own error is the one raised
        recipe.train(RunConfig(), tmp_path)
