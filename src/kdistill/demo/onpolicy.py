"""The embedded on-policy comparison: `kdistill run src/kdistill/demo/on_policy.yaml` (CPU, < 5 minutes).

    run_onpolicy_demo(["schedule.steps=30", "demo.warmup_steps=50"])   # overrides apply to on_policy.yaml
    cfg, settings = load_demo_config(overrides)
    result = compare(cfg, settings, run_dir)                           # any device (benchmarks/onpolicy_quality.py)

Data: the demo teacher's corpus as prompts and completions. Each stdlib file's first PROMPT_LINES lines
are a prompt, the next COMPLETION_LINES lines its completion (train files for training, held-out files
for grading; demo.prompts_per_file > 1 adds the same windows further down each file), rendered as the
text itself, the completion ended by the end-of-text token.

The experiment is on-policy distillation where the literature runs it (GKD, MiniLLM): on a student that
is already a reasonable model, whose own samples then drift from the data's prefixes. From a random
student the samples are noise and the teacher's grades of them teach little.

1. warm-up (shared): the student from its initialisation, off-policy (kd.on_policy = 0, the divergence
   demo.off_policy_divergence, learning rate demo.warmup_lr) for demo.warmup_steps steps;
2. on-policy arm: from the warm-up's student, the yaml's run (kd.on_policy = lambda of schedule.steps
   on the student's own sampled completions, graded by kd.divergence);
3. off-policy arm: from the same student, the yaml's run with kd.on_policy = 0 and
   demo.off_policy_divergence, for as many steps as the on-policy arm's training seconds hold at the
   warm-up's measured seconds per step (the same kind of step): the same wall-clock training time.
   Both arms' measured seconds are in the table (setup, loading and the final eval are left out of both).

Grading: the teacher (a reference), the warm-up's student and both arms complete the held-out prompts
greedily (kd.max_new_tokens tokens) and the teacher grades each completion: its per-token NLL of the
tokens and the reverse KL(student || teacher) per token over the full vocabulary at T = 1 (lower is
better for both), with standard errors over the prompts, the fraction of repeated 4-grams (a degenerate
loop lowers the teacher's NLL: this shows it), and each model's held-out CE on the data's completions.
The arms are compared prompt by prompt (on minus off, mean and standard error); on-policy helps when
its reverse KL is lower by more than two standard errors and its teacher NLL is not higher by as much.
RUN_DIR/summary.json holds the table (and the phases' wall seconds), RUN_DIR/comparison.png draws it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from kdistill.config import DIVERGENCES, RunConfig, load_config, parse_override
from kdistill.console import print_json
from kdistill.data.chat_template import load_chat_template
from kdistill.errors import UserError
from kdistill.fileio import atomic_write_json
from kdistill.generate import encode_prompts, stop_token_ids
from kdistill.jsonio import read_yaml
from kdistill.kernels import seal
from kdistill.models.hf_io import load_model
from kdistill.models.tokenizer import load_tokenizer
from kdistill.train.corpus import expand_data_paths
from kdistill.train.onpolicy import completion_rows
from kdistill.train.preflight import resolve_device
from kdistill.train.recipe import train
from kdistill.train.rollouts import RolloutSampling, rollout
from kdistill.train.rundir import prepare_output, print_config, start_run_dir

ON_POLICY_YAML = Path(__file__).resolve().parent / "on_policy.yaml"
PROMPT_LINES, COMPLETION_LINES = 6, 10
MAX_CHARS = 600  # a completion's text is cut here, so most conversations fit data.seq_len
GRADE_BATCH = 8  # prompts per greedy rollout while grading
# The text as it is: a user turn is the prompt, an assistant turn the completion and its end of text.
TEMPLATE = (
    "{% for m in messages %}{{ m['content'] }}{% if m['role'] == 'assistant' %}<|endoftext|>{% endif %}"
    "{% endfor %}"
)
VERDICTS = {
    "lower": "lower, by more than two standard errors",
    "higher": "higher, by more than two standard errors",
    "within noise": "within two standard errors of off-policy's",
}
ROWS = ("teacher", "warm_up", "off_policy", "on_policy")  # the table's rows, in print order


@dataclasses.dataclass
class Comparison:
    """The on_policy.yaml's `demo` section: what is not one run's config."""

    warmup_steps: int = 200  # shared off-policy steps before the arms (0: both arms start from scratch)
    warmup_lr: float = 0.003  # the warm-up's peak learning rate (the arms use optim.lr)
    off_policy_divergence: str = "forward_kl"  # the warm-up's and the off-policy arm's kd.divergence
    prompts_per_file: int = 1  # windows of PROMPT_LINES + COMPLETION_LINES lines taken from each file
    heldout_prompts: int = 0  # held-out prompts graded (0: all)

    def validate(self) -> Comparison:
        for name in ("warmup_steps", "heldout_prompts"):
            if getattr(self, name) < 0:
                raise UserError(f"demo.{name} is {getattr(self, name)}, expected 0 or a positive integer")
        if self.prompts_per_file < 1:
            raise UserError(f"demo.prompts_per_file is {self.prompts_per_file}, expected a positive integer")
        if not self.warmup_lr > 0:
            raise UserError(f"demo.warmup_lr is {self.warmup_lr}, expected a number > 0")
        if self.off_policy_divergence not in DIVERGENCES:
            raise UserError(
                f"demo.off_policy_divergence is '{self.off_policy_divergence}', expected one of: "
                + ", ".join(DIVERGENCES)
            )
        return self


def is_onpolicy_demo(config_path: str | None) -> bool:
    """The config is the embedded on_policy.yaml (the comparison runs instead of one run)."""
    return config_path is not None and Path(config_path).resolve() == ON_POLICY_YAML


def load_demo_config(overrides: list[str], path: Path = ON_POLICY_YAML) -> tuple[RunConfig, Comparison]:
    """The yaml's run config (its `demo` section left out) and its Comparison; `demo.KEY=VALUE`
    overrides go to the Comparison, the others to the run config. Relative model paths are relative
    to the yaml's folder."""
    raw = read_yaml(path, what="a YAML run config")
    section = dict(raw.pop("demo", None) or {})
    run_overrides = []
    for item in overrides:
        keys, value = parse_override(item)
        if keys[0] != "demo":
            run_overrides.append(item)
        elif len(keys) != 2:
            raise UserError(f"override '{item}': expected demo.KEY=VALUE")
        else:
            section[keys[1]] = value
    names = {f.name: f.type for f in dataclasses.fields(Comparison)}
    for key, value in section.items():
        if key not in names:
            raise UserError(f"{path}: demo.{key} is not a setting (expected one of: {', '.join(names)})")
        want, what = {
            "int": (int, "an integer"),
            "float": ((int, float), "a number"),
            "str": (str, "a name"),
        }[str(names[key])]
        if not isinstance(value, want) or isinstance(value, bool):
            raise UserError(f"{path}: demo.{key} is {value!r}, expected {what}")
    settings = Comparison(**section).validate()
    cfg = load_config(None, run_overrides, base=raw)
    for part in (cfg.teacher, cfg.student):  # relative to the yaml's folder, as a config file's are
        if part.path and not Path(part.path).is_absolute() and (path.parent / part.path).exists():
            part.path = str(path.parent / part.path)
    return cfg.validate(), settings


def write_conversations(files: list[str], out: Path, per_file: int = 1) -> list[dict[str, str]]:
    """{"prompt", "completion"} per window of each file with enough lines (the first PROMPT_LINES lines
    and the next COMPLETION_LINES, then up to per_file - 1 more windows below them), written to `out`
    as JSONL, and returned."""
    rows = []
    span = PROMPT_LINES + COMPLETION_LINES
    for f in files:
        try:
            lines = Path(f).read_text(encoding="utf-8").splitlines(keepends=True)
        except (OSError, UnicodeDecodeError):
            continue  # an unreadable file is a prompt fewer
        for start in range(0, per_file * span, span):
            part = lines[start : start + span]
            completion = "".join(part[PROMPT_LINES:])[:MAX_CHARS]
            prompt = "".join(part[:PROMPT_LINES])
            if len(part) > PROMPT_LINES + 2 and prompt.strip() and completion.strip():
                rows.append({"prompt": prompt, "completion": completion})
    out.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return rows


def _train_seconds(summary: dict[str, Any]) -> float:
    """The run's training steps' seconds (no setup, loading or eval)."""
    return summary["tokens_seen"] / summary["tokens_per_s"] if summary.get("tokens_per_s") else 0.0


def _run(cfg: RunConfig, run_dir: Path, label: str, quiet: bool) -> dict[str, Any]:
    prepare_output(run_dir, overwrite=True, lock=False)
    start_run_dir(cfg, run_dir, str(resolve_device(cfg)[0]))
    return train(cfg, run_dir, quiet=quiet, label=label)


def _with(cfg: RunConfig, run_dir: Path, **sections: dict[str, Any]) -> RunConfig:
    """cfg with output.dir = run_dir and the given fields of each section replaced."""
    parts = {k: dataclasses.replace(getattr(cfg, k), **v) for k, v in sections.items()}
    return dataclasses.replace(cfg, output=dataclasses.replace(cfg.output, dir=str(run_dir)), **parts)


def _repeated_4grams(ids: list[int]) -> float:
    grams = [tuple(ids[i : i + 4]) for i in range(len(ids) - 3)]
    return (len(grams) - len(set(grams))) / len(grams) if grams else 0.0


def _mean_se(values: list[float]) -> tuple[float, float]:
    n = len(values)
    mean = sum(values) / n
    var = sum((x - mean) ** 2 for x in values) / (n - 1) if n > 1 else 0.0
    return mean, math.sqrt(var / n)


@torch.no_grad()
def grade(
    model: torch.nn.Module,
    teacher: torch.nn.Module,
    prompts: list[list[int]],
    stops: set[int],
    new: int,
) -> dict[str, Any]:
    """`model`'s greedy completions of `prompts` (at most `new` tokens), graded by the teacher: the
    per-token NLL and reverse KL(model || teacher) at T = 1 over the completion tokens (token-weighted
    means), their standard errors over the prompts, the mean fraction of repeated 4-grams of a completion,
    and per prompt the reverse KL (for paired differences)."""
    nll = rkl = 0.0
    tokens = 0
    per_nll, per_rkl, rep = [], [], []
    device = teacher.lm_head_weight.device
    for i in range(0, len(prompts), GRADE_BATCH):
        part = prompts[i : i + GRADE_BATCH]
        out = rollout(model, part, RolloutSampling(new, 0.0), stops, None)
        width = max(len(p) for p in part) + new
        ids, labels = completion_rows(part, out.completions, width, 0, -100)  # (B, T) each
        ids, labels = ids.to(device), labels.to(device)
        logq = model.logits(ids).float().log_softmax(-1)  # (B, T, V)
        logp = teacher.logits(ids)[..., : logq.shape[-1]].float().log_softmax(-1)
        tok_nll = -logp.gather(-1, labels.clamp(min=0)[..., None])[..., 0]  # (B, T)
        tok_rkl = (logq.exp() * (logq - logp)).sum(-1)  # (B, T)
        mask = labels != -100
        for r in range(len(part)):
            n = int(mask[r].sum())
            row_nll, row_rkl = float(tok_nll[r][mask[r]].sum()), float(tok_rkl[r][mask[r]].sum())
            nll, rkl, tokens = nll + row_nll, rkl + row_rkl, tokens + n
            per_nll.append(row_nll / max(n, 1))
            per_rkl.append(row_rkl / max(n, 1))
            rep.append(_repeated_4grams(out.completions[r]))
    return {
        "teacher_nll": nll / max(tokens, 1),
        "teacher_nll_se": _mean_se(per_nll)[1],
        "reverse_kl": rkl / max(tokens, 1),
        "reverse_kl_se": _mean_se(per_rkl)[1],
        "repeated_4grams": sum(rep) / len(rep),
        "tokens": tokens,
        "per_prompt_reverse_kl": per_rkl,
        "per_prompt_teacher_nll": per_nll,
    }


def compare(
    cfg: RunConfig, settings: Comparison, run_dir: Path, quiet: bool = False, log: Any = None
) -> dict[str, Any]:
    """The comparison of the module docstring, in run_dir; its result (summary.json's content)."""
    t0 = time.time()
    say = log or (lambda msg: None)
    prepare_output(run_dir, overwrite=True, lock=False)
    device, _ = resolve_device(cfg)
    data_dir = run_dir / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    per_file = settings.prompts_per_file
    write_conversations(expand_data_paths(cfg.data.train), data_dir / "train.jsonl", per_file)
    held = write_conversations(expand_data_paths(cfg.data.heldout), data_dir / "heldout.jsonl", per_file)
    (data_dir / "template.jinja").write_text(TEMPLATE, encoding="utf-8")
    base = _with(
        cfg,
        run_dir,
        data=dict(
            train=[str(data_dir / "train.jsonl")],
            heldout=[str(data_dir / "heldout.jsonl")],
            chat_template=str(data_dir / "template.jinja"),
        ),
    )
    off_kd = dict(on_policy=0.0, seq_kd=0.0, divergence=settings.off_policy_divergence)
    summaries: dict[str, dict[str, Any]] = {}
    phases = {"data": time.time() - t0}  # each phase's wall seconds
    start = base
    if settings.warmup_steps:
        say(f"warm-up: {settings.warmup_steps} off-policy steps")
        warm_cfg = _with(
            base,
            run_dir / "warm_up",
            kd=off_kd,
            optim=dict(lr=settings.warmup_lr),
            schedule=dict(steps=settings.warmup_steps),
        )
        summaries["warm_up"] = _run(warm_cfg, run_dir / "warm_up", "warm-up (off-policy)", quiet)
        start = _with(
            base, run_dir, student=dict(path=str(run_dir / "warm_up" / "student"), init="pretrained")
        )
        per_step = _train_seconds(summaries["warm_up"]) / settings.warmup_steps
        phases["warm_up"] = summaries["warm_up"]["wall_seconds"]
    say(f"on-policy arm: {cfg.schedule.steps} steps at lambda {cfg.kd.on_policy:g}")
    on_cfg = _with(start, run_dir / "on_policy")
    summaries["on_policy"] = _run(on_cfg, run_dir / "on_policy", "on-policy arm", quiet)
    budget = _train_seconds(summaries["on_policy"])
    phases["on_policy"] = summaries["on_policy"]["wall_seconds"]
    if not settings.warmup_steps:  # no warm-up to time the off-policy step: a few probe steps do
        probe = _with(start, run_dir / "probe", kd=off_kd, schedule=dict(steps=5))
        per_step = _train_seconds(_run(probe, run_dir / "probe", "probe", True)) / 5
    steps = max(1, round(budget / max(per_step, 1e-9)))
    say(f"off-policy arm: {steps} steps (the on-policy arm's {budget:.1f} s at {per_step:.3f} s per step)")
    off_cfg = _with(start, run_dir / "off_policy", kd=off_kd, schedule=dict(steps=steps))
    summaries["off_policy"] = _run(off_cfg, run_dir / "off_policy", "off-policy arm", quiet)
    phases["off_policy"] = summaries["off_policy"]["wall_seconds"]
    t_grade = time.time()

    say("grading the greedy completions of the held-out prompts")
    seal.unseal()  # grading is a new phase with its own shapes: its compiles are not a run's misses
    teacher_dir = Path(cfg.teacher.path)
    tok = load_tokenizer(teacher_dir)
    template = load_chat_template(teacher_dir, str(data_dir / "template.jinja"))
    if settings.heldout_prompts:
        held = held[: settings.heldout_prompts]
    prompts = encode_prompts(tok, template, prompts=[r["prompt"] for r in held], chat=True)
    prompts = [p[-(cfg.data.seq_len - cfg.kd.max_new_tokens) :] for p in prompts]
    stops = stop_token_ids(teacher_dir, tok, template)
    teacher = load_model(teacher_dir, device, torch.float32).eval()
    new = cfg.kd.max_new_tokens
    table: dict[str, dict[str, Any]] = {}
    per_prompt: dict[str, dict[str, list[float]]] = {}
    for name in ROWS:
        if name == "teacher":
            model, summary = teacher, None
        elif name in summaries:
            model = load_model(run_dir / name / "student", device, torch.float32).eval()
            summary = summaries[name]
        else:
            continue
        graded = grade(model, teacher, prompts, stops, new)
        per_prompt[name] = {k: graded.pop(f"per_prompt_{k}") for k in ("reverse_kl", "teacher_nll")}
        if summary is None:  # the teacher: its held-out CE from the on-policy arm's eval
            ce = summaries["on_policy"]["heldout"].get("teacher_loss")
        else:
            ce = summary["heldout"].get("student_loss")
        table[name] = {
            "steps": summary["steps"] if summary else None,
            "train_seconds": _train_seconds(summary) if summary else None,
            "heldout_ce": ce,
            # the student as the teacher's draft: greedy acceptance at the end of its run (summary's `draft`)
            "draft_alpha": (summary.get("draft") or {}).get("alpha") if summary else None,
            **graded,
        }
    paired, verdicts = {}, {}
    for key in ("reverse_kl", "teacher_nll"):  # on minus off, prompt by prompt
        mean, se = _mean_se(
            [a - b for a, b in zip(per_prompt["on_policy"][key], per_prompt["off_policy"][key])]
        )
        paired[key] = {"mean": mean, "se": se}
        # outside two standard errors of the paired difference, or within the noise
        verdicts[key] = "within noise" if abs(mean) <= 2 * se else ("lower" if mean < 0 else "higher")
    result = {
        "comparison": table,
        "on_policy_minus_off_policy_reverse_kl": paired["reverse_kl"],
        "on_policy_minus_off_policy_teacher_nll": paired["teacher_nll"],
        "on_policy_reverse_kl_is": verdicts["reverse_kl"],
        "on_policy_teacher_nll_is": verdicts["teacher_nll"],
        # helps: a lower reverse KL on its own completions without a higher teacher NLL of them
        "on_policy_helps": verdicts["reverse_kl"] == "lower" and verdicts["teacher_nll"] != "higher",
        "equal_time_ratio": table["off_policy"]["train_seconds"]
        / max(table["on_policy"]["train_seconds"], 1e-9),
        "heldout_prompts": len(prompts),
        "settings": dataclasses.asdict(settings),
        "lambda": cfg.kd.on_policy,
        "on_policy": summaries["on_policy"].get("on_policy"),
        "device": str(device),
        "phase_seconds": {**phases, "grading": time.time() - t_grade},
        "wall_seconds": time.time() - t0,
    }
    atomic_write_json(run_dir / "summary.json", result)
    plot_table(table, run_dir / "comparison.png", len(prompts))
    return result


def plot_table(table: dict[str, dict[str, Any]], out: Path, prompts: int) -> Path:
    """Bars of each row's teacher NLL and reverse KL (with two standard errors) and held-out CE."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(table)
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.6), dpi=110)
    panels = (
        ("teacher_nll", "teacher NLL of own greedy tokens"),
        ("reverse_kl", "reverse KL on own greedy tokens"),
        ("heldout_ce", "held-out CE on the data"),
    )
    for ax, (key, title) in zip(axes, panels):
        values = [table[n][key] if table[n][key] is not None else float("nan") for n in names]
        err = [2 * table[n].get(f"{key}_se", 0.0) for n in names]
        ax.bar(names, values, yerr=err, color=["gray", "tab:olive", "tab:blue", "tab:orange"][: len(names)])
        ax.set_title(title, fontsize=10)
        ax.tick_params(axis="x", labelrotation=20)
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("nats/token (lower is better)")
    fig.suptitle(f"{prompts} held-out prompts, error bars two standard errors", fontsize=10)
    fig.tight_layout()
    tmp = out.with_name(f".{out.name}.tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    os.replace(tmp, out)
    return out


def print_table(result: dict[str, Any]) -> None:
    """The comparison as a table on stdout."""
    print(f"greedy completions of {result['heldout_prompts']} held-out prompts, graded by the teacher:")
    print(
        f"  {'':11s}{'steps':>6s}{'train s':>9s}{'teacher NLL':>16s}{'reverse KL':>16s}{'rep 4-gr':>9s}"
        f"{'held-out CE':>12s}"
    )
    for name, row in result["comparison"].items():
        steps = "" if row["steps"] is None else str(row["steps"])
        secs = "" if row["train_seconds"] is None else f"{row['train_seconds']:.1f}"
        ce = "" if row["heldout_ce"] is None else f"{row['heldout_ce']:.4f}"
        print(
            f"  {name:11s}{steps:>6s}{secs:>9s}"
            f"{row['teacher_nll']:9.4f} ±{row['teacher_nll_se']:.3f}{row['reverse_kl']:9.4f} ±{row['reverse_kl_se']:.3f}"
            f"{row['repeated_4grams']:9.2f}{ce:>12s}"
        )
    for key, label in (("reverse_kl", "reverse KL"), ("teacher_nll", "teacher NLL")):
        d = result[f"on_policy_minus_off_policy_{key}"]
        print(
            f"on-policy minus off-policy {label}, per prompt: {d['mean']:+.4f} ± {d['se']:.4f} "
            f"(one standard error): on-policy's is {VERDICTS[result[f'on_policy_{key}_is']]}"
        )
    print(
        f"on-policy helps (lower reverse KL, teacher NLL not higher): {'yes' if result['on_policy_helps'] else 'no'}"
    )
    alphas = {
        n: r.get("draft_alpha") for n, r in result["comparison"].items() if r.get("draft_alpha") is not None
    }
    if alphas:
        shown = ", ".join(f"{n} {a:.3f}" for n, a in alphas.items())
        print(f"as the teacher's draft model, greedy acceptance rate: {shown}")


def run_onpolicy_demo(overrides: list[str], quiet: bool = False, as_json: bool = False) -> int:
    """The comparison of the module docstring; RUN_DIR/summary.json holds its table."""
    cfg, settings = load_demo_config(overrides)
    run_dir = Path(cfg.output.dir)
    print_config(cfg, quiet)

    def say(msg: str) -> None:  # stderr: with --json, stdout is the result alone
        if not quiet:
            print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    result = compare(cfg, settings, run_dir, quiet=quiet, log=say)
    if as_json:
        print_json(result)
        return 0
    print()
    print_table(result)
    print(f"run in {run_dir}/ (summary.json, comparison.png, warm_up/, on_policy/, off_policy/)")
    return 0
