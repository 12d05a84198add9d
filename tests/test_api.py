"""The Python API: the README's example runs as written (the demo's models, 3 steps), configs given as a
dict or a RunConfig with dotted and keyword overrides, errors raised as kdistill.UserError, and
`import kdistill` stays cheap (torch is loaded on first use of the API)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import kdistill
from tests.test_train_kit import REPO, assets, base_config


def readme_example() -> str:
    """The one ```python block of the README's "Python API" section."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    section = text.split("## Python API", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 1, "the Python API section should hold one python example"
    return blocks[0]


def fresh_python(
    tmp_path: Path, script: str, *args: str, path: tuple[Path, ...] = ()
) -> subprocess.CompletedProcess:
    """`script` in a fresh interpreter in tmp_path, with the repository's src (then `path`) importable
    and the token cache under tmp_path."""
    pythonpath = os.pathsep.join(str(p) for p in (REPO / "src", *path))
    env = {**os.environ, "PYTHONPATH": pythonpath, "KDISTILL_CACHE_DIR": str(tmp_path / "cache")}
    return subprocess.run(
        [sys.executable, "-c", script, *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_readme_python_example_runs(tmp_path: Path) -> None:
    proc = fresh_python(tmp_path, readme_example())
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("completed ") and lines[1] == "Decoder 4096"
    assert lines[2].startswith("held-out loss ") and lines[3].startswith("planned peak memory ")
    assert (tmp_path / "runs" / "api-example" / "student" / "model.safetensors").is_file()


def test_distill_from_a_dict_with_overrides_then_load_and_evaluate(tmp_path: Path) -> None:
    cfg = base_config(tmp_path / "ignored", steps=50)
    run = kdistill.distill(
        cfg, "schedule.steps=2", output={"dir": str(tmp_path / "run")}, **{"kd.alpha": 0.25}
    )
    assert (
        run.run_dir == tmp_path / "run" and run.summary["status"] == "completed" and run.summary["steps"] == 2
    )
    saved = (run.run_dir / "config.yaml").read_text()
    assert "alpha: 0.25" in saved
    model, tok = kdistill.load(run.student_dir)
    assert type(model).__name__ == "Decoder" and not model.training and tok is not None
    scores = kdistill.evaluate(run.student_dir, [str(assets().heldout)], seq_len=32, device="cpu")
    assert scores["tokens"] > 0 and scores["loss"] > 0


def test_errors_raise_user_error(tmp_path: Path) -> None:
    cfg = base_config(tmp_path / "run")
    with pytest.raises(kdistill.UserError, match="unknown config key 'kd.alpah'"):
        kdistill.distill(cfg, "kd.alpah=0.3")
    with pytest.raises(kdistill.UserError, match="kd.alpha is 2.0"):
        kdistill.distill(cfg, kd={"alpha": 2})
    with pytest.raises(kdistill.UserError, match="already holds a run"):
        (tmp_path / "run").mkdir()
        (tmp_path / "run" / "manifest.json").write_text("{}")
        kdistill.distill(cfg)
    plan = kdistill.plan(
        kdistill.RunConfig(), teacher={"path": "qwen2.5-1.5b"}, student={"path": "qwen2.5-0.5b"}
    )
    assert plan["teacher"]["name"] == "qwen2.5-1.5b"


def test_import_kdistill_is_cheap() -> None:
    code = "import sys, kdistill; print('torch' in sys.modules, kdistill.__version__, kdistill.UserError.__name__)"
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", kdistill.__version__, "UserError"]


def test_resolved_config_is_printed_as_a_diff_from_the_defaults(tmp_path: Path, capsys) -> None:
    from kdistill.api import build_config
    from kdistill.train.rundir import config_diff, print_config

    cfg = build_config(kdistill.RunConfig(), **{"kd.alpha": 0.3, "data.train": ["a.txt"]})
    assert config_diff(cfg) == {"data.train": ["a.txt"], "kd.alpha": 0.3}
    print_config(cfg, quiet=False)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("resolved config (2 fields differ from the defaults")
    assert lines[1:] == ["  data.train: [a.txt]", "  kd.alpha: 0.3"]


def test_version_names_torch_triton_and_cuda(capsys) -> None:
    import torch

    from kdistill.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"kdistill {kdistill.__version__}" and lines[1] == f"torch {torch.__version__}"
    assert (
        lines[2].startswith("triton ")
        and lines[3] == f"cuda {torch.version.cuda or 'none (CPU build of torch)'}"
    )


FREED_SCRIPT = """
import gc, json, sys, weakref
from pathlib import Path
import kdistill
from kdistill.train import recipe
from tests.test_train_kit import base_config

refs = {}
setup = recipe.setup

def watched(*args, **kwargs):
    run = setup(*args, **kwargs)
    refs.update(run=weakref.ref(run), student=weakref.ref(run.ctx.student), teacher=weakref.ref(run.ctx.teacher))
    return run

recipe.setup = watched
gc.collect()
gc.disable()  # only reference counts free what the run leaves
result = kdistill.distill(base_config(Path(sys.argv[1])), "schedule.steps=2")
assert result.summary["status"] == "completed"
print(json.dumps({name: ref() is None for name, ref in refs.items()}))
"""


def test_a_finished_run_frees_its_models_when_distill_returns(tmp_path: Path) -> None:
    """When `kdistill.distill` returns, the run's models (and with them its optimizer, its GPU memory,
    its CUDA graphs) are freed at once, without waiting for a garbage collection: a notebook that runs
    twice does not keep the first run beside the second. In a fresh interpreter, as a user's first run
    is: the first plot imports matplotlib, whose import once kept the run alive through the tracebacks
    it caches."""
    proc = fresh_python(tmp_path, FREED_SCRIPT, str(tmp_path / "run"), path=(REPO,))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == '{"run": true, "student": true, "teacher": true}'
