"""The embedded on-policy comparison: `kdistill run src/kdistill/demo/on_policy.yaml` (CPU, < 5 minutes).

    run_onpolicy_demo(["schedule.steps=30"])        # overrides apply to on_policy.yaml

The demo teacher's corpus as prompts and completions: each stdlib file's first PROMPT_LINES lines are a
prompt, the next COMPLETION_LINES lines its completion (train files for training, held-out files for
the evaluation), rendered with a plain template (the text as it is, the completion ended by the
end-of-text token). Two students from the same initialisation:

- on-policy: the yaml's run (kd.on_policy of its steps on its own sampled completions);
- off-policy: the same config with kd.on_policy = 0, for as many steps as fit in the on-policy run's
  training time (timed by the on-policy run's own data steps, or by a few probe steps at lambda 1).

Then each student completes the held-out prompts greedily (kd.max_new_tokens tokens) and the teacher
grades them: its per-token NLL of the student's tokens and the reverse KL(student || teacher) per
token over the full vocabulary (both lower is better), beside each student's held-out CE on the data's
completions. RUN_DIR/summary.json holds the table.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import torch

from kdistill.config import RunConfig, load_config
from kdistill.console import print_json
from kdistill.data.chat_template import load_chat_template
from kdistill.fileio import atomic_write_json
from kdistill.generate import encode_prompts, stop_token_ids
from kdistill.models.hf_io import load_model
from kdistill.models.tokenizer import load_tokenizer
from kdistill.train.corpus import expand_data_paths
from kdistill.train.onpolicy import completion_rows
from kdistill.train.recipe import train
from kdistill.train.rollouts import RolloutSampling, rollout
from kdistill.train.rundir import prepare_output, print_config, start_run_dir

ON_POLICY_YAML = Path(__file__).resolve().parent / "on_policy.yaml"
PROMPT_LINES, COMPLETION_LINES = 6, 10
MAX_CHARS = 600  # a completion's text is cut here, so most conversations fit data.seq_len
HELDOUT_PROMPTS = 32
# The text as it is: a user turn is the prompt, an assistant turn the completion and its end of text.
TEMPLATE = (
    "{% for m in messages %}{{ m['content'] }}{% if m['role'] == 'assistant' %}<|endoftext|>{% endif %}"
    "{% endfor %}"
)


def is_onpolicy_demo(config_path: str | None) -> bool:
    """The config is the embedded on_policy.yaml (the comparison runs instead of one run)."""
    return config_path is not None and Path(config_path).resolve() == ON_POLICY_YAML


def write_conversations(files: list[str], out: Path) -> list[dict[str, str]]:
    """{"prompt", "completion"} per file with enough lines, written to `out` as JSONL, and returned."""
    rows = []
    for f in files:
        try:
            lines = Path(f).read_text(encoding="utf-8").splitlines(keepends=True)
        except (OSError, UnicodeDecodeError):
            continue  # an unreadable file is one prompt fewer
        completion = "".join(lines[PROMPT_LINES : PROMPT_LINES + COMPLETION_LINES])[:MAX_CHARS]
        prompt = "".join(lines[:PROMPT_LINES])
        if len(lines) > PROMPT_LINES + 2 and prompt.strip() and completion.strip():
            rows.append({"prompt": prompt, "completion": completion})
    out.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return rows


def _data_step_seconds(run_dir: Path, summary: dict[str, Any]) -> float | None:
    """Mean seconds of the run's steps on the data (its training time less its generated steps'), or None."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    generated = sum(r["gen_s"] + r["score_s"] + r["update_s"] for r in rows if "policy" in r)
    data_steps = sum(1 for r in rows if "policy" not in r)
    return (_train_seconds(summary) - generated) / data_steps if data_steps else None


def _train_seconds(summary: dict[str, Any]) -> float:
    return summary["tokens_seen"] / summary["tokens_per_s"] if summary.get("tokens_per_s") else 0.0


def _run(cfg: RunConfig, run_dir: Path, label: str, quiet: bool) -> dict[str, Any]:
    prepare_output(run_dir, overwrite=True, lock=False)
    start_run_dir(cfg, run_dir, "cpu")
    return train(cfg, run_dir, quiet=quiet, label=label)


@torch.no_grad()
def grade(
    student_dir: Path, teacher: torch.nn.Module, prompts: list[list[int]], stops: set[int], new: int
) -> dict[str, float]:
    """The student's greedy completions of `prompts`, graded by the teacher: per-token NLL and
    reverse KL(student || teacher) at T = 1 over the completion tokens."""
    student = load_model(student_dir, torch.device("cpu"), torch.float32).eval()
    nll = rkl = 0.0
    tokens = 0
    for i in range(0, len(prompts), 8):
        part = prompts[i : i + 8]
        out = rollout(student, part, RolloutSampling(new, 0.0), stops, None)
        width = max(len(p) for p in part) + new
        ids, labels = completion_rows(part, out.completions, width, 0, -100)
        mask = labels != -100  # (B, T) the completion's tokens
        logq = student.logits(ids).log_softmax(-1)[mask]  # (n, V)
        logp = teacher.logits(ids)[..., : logq.shape[-1]].log_softmax(-1)[mask]
        nll -= float(logp.gather(1, labels[mask][:, None]).sum())
        rkl += float((logq.exp() * (logq - logp)).sum())
        tokens += int(mask.sum())
    return {"teacher_nll": nll / max(tokens, 1), "reverse_kl": rkl / max(tokens, 1), "tokens": tokens}


def run_onpolicy_demo(overrides: list[str], quiet: bool = False, as_json: bool = False) -> int:
    """The comparison of the module docstring; RUN_DIR/summary.json holds its table."""
    t0 = time.time()
    cfg = load_config(ON_POLICY_YAML, overrides).validate()
    run_dir = Path(cfg.output.dir)
    prepare_output(run_dir, overwrite=True, lock=False)
    print_config(cfg, quiet)
    data_dir = run_dir / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    write_conversations(expand_data_paths(cfg.data.train), data_dir / "train.jsonl")
    held = write_conversations(expand_data_paths(cfg.data.heldout), data_dir / "heldout.jsonl")
    (data_dir / "template.jinja").write_text(TEMPLATE, encoding="utf-8")
    data = dataclasses.replace(
        cfg.data,
        train=[str(data_dir / "train.jsonl")],
        heldout=[str(data_dir / "heldout.jsonl")],
        chat_template=str(data_dir / "template.jinja"),
    )
    on_cfg = dataclasses.replace(
        cfg, data=data, output=dataclasses.replace(cfg.output, dir=str(run_dir / "on_policy"))
    )
    on = _run(on_cfg, run_dir / "on_policy", "on-policy student", quiet)
    budget = _train_seconds(on)
    per_step = _data_step_seconds(run_dir / "on_policy", on)
    off_kd = dataclasses.replace(cfg.kd, on_policy=0.0, seq_kd=0.0)
    if per_step is None:  # no data step at lambda 1: a few probe steps time them
        probe = dataclasses.replace(
            on_cfg,
            kd=off_kd,
            schedule=dataclasses.replace(cfg.schedule, steps=5),
            output=dataclasses.replace(cfg.output, dir=str(run_dir / "probe")),
        )
        per_step = _train_seconds(_run(probe, run_dir / "probe", "probe", True)) / 5
    steps = max(1, round(budget / max(per_step, 1e-9)))
    off_cfg = dataclasses.replace(
        on_cfg,
        kd=off_kd,
        schedule=dataclasses.replace(cfg.schedule, steps=steps),
        output=dataclasses.replace(cfg.output, dir=str(run_dir / "off_policy")),
    )
    off = _run(off_cfg, run_dir / "off_policy", "off-policy student", quiet)

    teacher_dir = Path(cfg.teacher.path)
    tok = load_tokenizer(teacher_dir)
    template = load_chat_template(teacher_dir, str(data_dir / "template.jinja"))
    prompts = encode_prompts(tok, template, prompts=[r["prompt"] for r in held[:HELDOUT_PROMPTS]], chat=True)
    prompts = [p[-(cfg.data.seq_len - cfg.kd.max_new_tokens) :] for p in prompts]
    stops = stop_token_ids(teacher_dir, tok, template)
    teacher = load_model(teacher_dir, torch.device("cpu"), torch.float32).eval()
    table = {}
    for name, summary in (("on_policy", on), ("off_policy", off)):
        graded = grade(run_dir / name / "student", teacher, prompts, stops, cfg.kd.max_new_tokens)
        table[name] = {
            "steps": summary["steps"],
            "train_seconds": _train_seconds(summary),
            "heldout_ce": summary["heldout"].get("student_loss"),
            **graded,
        }
    result = {
        "comparison": table,
        "on_policy_helps": table["on_policy"]["reverse_kl"] < table["off_policy"]["reverse_kl"],
        "heldout_prompts": len(prompts),
        "on_policy": on.get("on_policy"),
        "wall_seconds": time.time() - t0,
    }
    atomic_write_json(run_dir / "summary.json", result)
    if as_json:
        print_json(result)
        return 0
    print()
    print(f"student's own greedy completions of {len(prompts)} held-out prompts, graded by the teacher:")
    print(
        f"  {'':12s}{'steps':>6s}{'train s':>9s}{'teacher NLL':>13s}{'reverse KL':>12s}{'held-out CE':>13s}"
    )
    for name, row in table.items():
        ce = row["heldout_ce"]
        print(
            f"  {name:12s}{row['steps']:6d}{row['train_seconds']:9.1f}{row['teacher_nll']:13.4f}"
            f"{row['reverse_kl']:12.4f}{ce if ce is None else format(ce, '13.4f')}"
        )
    print(f"run in {run_dir}/ (summary.json, on_policy/, off_policy/)")
    return 0
