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
demo.grade_points=P > 1 also grades each arm at P - 1 evenly spaced steps before its end (checkpoints
kept for it): summary.json's `curves` (from the warm-up's student on) and the plot's last panel.

Across tokenizers (demo.student_vocab=N > 0; e.g. `kdistill run src/kdistill/demo/on_policy.yaml
demo.student_vocab=3072 demo.grade_points=3`): the student gets a tokenizer of its own, a byte-level BPE
of N tokens trained (deterministically, at run time) on the train prompts and completions, so other
merges than the teacher's 4096, with the student's config (vocab_size N) and TEMPLATE in
RUN_DIR/models/student/; the teacher's files are copied to RUN_DIR/models/teacher/ with TEMPLATE as its
own template (kd.cross_tokenizer renders each side with its model's template; both write the text as it
is). The warm-up and both arms run with kd.cross_tokenizer=true (docs/cross_tokenizer.md): on-policy,
the student's completions are decoded to text and re-tokenized by the teacher. Grading: each model's
greedy completions in its own tokens, decoded to text up to its stop token, re-tokenized by the teacher
after its own encoding of the prompt; the teacher's NLL per teacher token and per character of the text
(the two tokenizations compare by character), with standard errors; no reverse KL (the vocabularies
differ). The texts graded are in RUN_DIR/completions.jsonl. On-policy helps when its NLL per character
is lower by more than two standard errors of the paired difference. The GPU command (one H100, a few
minutes; the JSON holds card, versions, date, command and the table):

    PYTHONPATH=src:. python3 benchmarks/onpolicy_quality.py --cross-tokenizer --json xtok.json
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import tokenizers
import torch

from kdistill.config import DIVERGENCES, RunConfig, load_config, parse_override
from kdistill.console import print_json
from kdistill.data.chat_template import ChatTemplate, load_chat_template
from kdistill.errors import UserError
from kdistill.fileio import atomic_write_json, atomic_write_text
from kdistill.generate import encode_prompts, stop_token_ids
from kdistill.jsonio import read_json, read_yaml
from kdistill.kernels import seal
from kdistill.models.hf_io import load_model
from kdistill.models.tokenizer import Tokenizer, load_tokenizer
from kdistill.train.checkpoint import list_checkpoints, load_checkpoint
from kdistill.train.corpus import expand_data_paths
from kdistill.train.evidence import pyplot
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
MIN_STUDENT_VOCAB = 320  # demo.student_vocab: the byte alphabet, the end-of-text token and some merges
EOS = "<|endoftext|>"  # the end of a completion, in both tokenizers (TEMPLATE writes it)


@dataclasses.dataclass
class Comparison:
    """The on_policy.yaml's `demo` section: what is not one run's config."""

    warmup_steps: int = 200  # shared off-policy steps before the arms (0: both arms start from scratch)
    warmup_lr: float = 0.003  # the warm-up's peak learning rate (the arms use optim.lr)
    off_policy_divergence: str = "forward_kl"  # the warm-up's and the off-policy arm's kd.divergence
    prompts_per_file: int = 1  # windows of PROMPT_LINES + COMPLETION_LINES lines taken from each file
    heldout_prompts: int = 0  # held-out prompts graded (0: all)
    # 0: the student shares the teacher's tokenizer; N: the student gets a byte-level BPE of N tokens of
    # its own (trained on the train prompts and completions) and every phase runs kd.cross_tokenizer
    student_vocab: int = 0
    grade_points: int = 1  # each arm is graded at this many evenly spaced steps (1: at its end only)

    def validate(self) -> Comparison:
        for name in ("warmup_steps", "heldout_prompts"):
            if getattr(self, name) < 0:
                raise UserError(f"demo.{name} is {getattr(self, name)}, expected 0 or a positive integer")
        for name in ("prompts_per_file", "grade_points"):
            if getattr(self, name) < 1:
                raise UserError(f"demo.{name} is {getattr(self, name)}, expected a positive integer")
        if self.student_vocab and self.student_vocab < MIN_STUDENT_VOCAB:
            raise UserError(
                f"demo.student_vocab is {self.student_vocab}, expected 0 (the teacher's tokenizer) or at "
                f"least {MIN_STUDENT_VOCAB} (the 256 bytes, the end-of-text token and merges)"
            )
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


def make_student_tokenizer(rows: list[dict[str, str]], vocab: int, out: Path) -> int:
    """A byte-level BPE of `vocab` tokens (the end-of-text token first, id 0) trained on the text of
    `rows` (prompts and completions), written to out/tokenizer.json with its tokenizer_config.json; the
    size it reached (fewer when the text holds fewer merges). Deterministic: the same rows give the
    same file."""
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=[EOS],
        min_frequency=2,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([r["prompt"] + r["completion"] for r in rows], trainer=trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {"eos_token": EOS, "bos_token": None, "tokenizer_class": "PreTrainedTokenizerFast"}
    atomic_write_json(out / "tokenizer_config.json", config)
    return int(tok.get_vocab_size(with_added_tokens=True))


def check_cross(cfg: RunConfig, vocab: int) -> Path:
    """The student's config.json for cross_models, after checking that `vocab` is not the teacher's size."""
    source = Path(cfg.student.path)
    config_file = source / "config.json" if source.is_dir() else source
    if not config_file.is_file():
        raise UserError(
            f"student.path '{cfg.student.path}': demo.student_vocab needs a config.json or a model folder"
        )
    if vocab == load_tokenizer(cfg.teacher.path).vocab_size:
        raise UserError(
            f"demo.student_vocab is {vocab}, the teacher's own vocabulary size: expected another size "
            "(the student's tokenizer is to differ from the teacher's)"
        )
    return config_file


def cross_models(cfg: RunConfig, rows: list[dict[str, str]], vocab: int, out: Path) -> tuple[Path, Path]:
    """(teacher, student) model folders under `out` for the comparison across tokenizers: the student's
    config.json (student.path's, its vocab_size set to its tokenizer's) beside a tokenizer of its own
    (make_student_tokenizer on the train rows) and TEMPLATE, no weights (student.init random); the
    teacher's files with TEMPLATE as its chat template (across tokenizers the teacher renders with its
    own template, and the demo teacher's folder has none)."""
    config_file = check_cross(cfg, vocab)
    teacher_dir = Path(cfg.teacher.path)
    student, teacher = out / "student", out / "teacher"
    size = make_student_tokenizer(rows, vocab, student)
    config = read_json(config_file, what="a model config.json")
    atomic_write_json(student / "config.json", {**config, "vocab_size": size})
    teacher.mkdir(parents=True, exist_ok=True)
    for f in sorted(teacher_dir.iterdir()):
        if f.is_file() and (f.suffix in (".json", ".safetensors")):
            shutil.copyfile(f, teacher / f.name)
    for folder in (student, teacher):
        (folder / "chat_template.jinja").write_text(TEMPLATE, encoding="utf-8")
    return teacher, student


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


@dataclasses.dataclass
class Side:
    """A model's side of the grading: its tokenizer, chat template, stop tokens and the held-out prompts
    rendered and encoded as it sees them."""

    tok: Tokenizer
    template: ChatTemplate
    stops: set[int]
    prompts: list[list[int]]


def side(model_dir: Path, prompts: list[str], cfg: RunConfig, template_file: str | None = None) -> Side:
    """The Side of the model in `model_dir` (its own tokenizer, and template unless `template_file` is
    given); each prompt cut to its last data.seq_len - kd.max_new_tokens tokens, in that model's tokens."""
    tok, template = load_tokenizer(model_dir), load_chat_template(model_dir, template_file)
    kwargs = cfg.data.template_kwargs  # the variables the arms' data was rendered with
    ids = encode_prompts(tok, template, prompts=prompts, chat=True, template_kwargs=kwargs)
    keep = cfg.data.seq_len - cfg.kd.max_new_tokens
    return Side(tok, template, stop_token_ids(model_dir, tok, template, kwargs), [p[-keep:] for p in ids])


def _teacher_tokens(t: Side, prompt: str, text: str, stopped: bool) -> list[int]:
    """The teacher's tokens of a completion's text (and of its end of turn when it stopped): the
    teacher's rendering of the conversation with `text` as the answer, after the rendering up to the
    answer, the text encoded on its own (as the model wrote it after the prompt)."""
    head = t.template.render([{"role": "user", "content": prompt}], add_generation_prompt=True)
    full = t.template.render([{"role": "user", "content": prompt}, {"role": "assistant", "content": text}])
    if not full.startswith(head + text):
        raise UserError(f"{t.template.origin}: the template does not write an answer as its text")
    return t.tok.encode(text) + (t.tok.encode(full[len(head + text) :]) if stopped else [])


@torch.no_grad()
def grade_text(
    model: torch.nn.Module, own: Side, teacher: torch.nn.Module, t: Side, prompts: list[str], new: int
) -> dict[str, Any]:
    """grade() across tokenizers: `model`'s greedy completions of its own encoding of the prompts (at most
    `new` of its tokens), each decoded to text (up to its stop token) and re-encoded by the teacher's
    tokenizer after the teacher's own encoding of the prompt (the end of turn of its template when the
    model stopped). The teacher's NLL of those tokens per teacher token and per character of the text
    (the end of turn counted as one character), token- and character-weighted, with standard errors over
    the prompts; the mean fraction of repeated 4-grams of the model's own tokens; per prompt the values
    (for paired differences), the completion's text and whether it stopped."""
    nll = 0.0
    tokens = chars = own_tokens = 0
    per_nll, per_char, rep, texts, stops = [], [], [], [], []
    device = teacher.lm_head_weight.device
    limit = teacher.spec.max_position_embeddings
    for i in range(0, len(prompts), GRADE_BATCH):
        out = rollout(model, own.prompts[i : i + GRADE_BATCH], RolloutSampling(new, 0.0), own.stops, None)
        heads, tails, lengths = t.prompts[i : i + GRADE_BATCH], [], []
        for r, ids in enumerate(out.completions):
            stopped = out.stopped[r]
            text = own.tok.decode(ids[:-1] if stopped else ids)
            tails.append(_teacher_tokens(t, prompts[i + r], text, stopped))
            texts.append(text)
            stops.append(stopped)
            lengths.append(len(text) + int(stopped))
            own_tokens += len(ids)
            rep.append(_repeated_4grams(ids))
        heads = [h[-max(1, limit - len(c)) :] for h, c in zip(heads, tails)]  # within the teacher's positions
        width = min(limit, max(len(h) + len(c) for h, c in zip(heads, tails)))
        ids, labels = completion_rows(heads, tails, width, 0, -100)  # (B, T) each
        ids, labels = ids.to(device), labels.to(device)
        logp = teacher.logits(ids)[..., : t.tok.vocab_size].float().log_softmax(-1)  # (B, T, Vt)
        tok_nll = -logp.gather(-1, labels.clamp(min=0)[..., None])[..., 0]  # (B, T)
        mask = labels != -100
        for r in range(len(heads)):
            n = int(mask[r].sum())
            row = float(tok_nll[r][mask[r]].sum())
            nll, tokens, chars = nll + row, tokens + n, chars + lengths[r]
            per_nll.append(row / max(n, 1))
            per_char.append(row / max(lengths[r], 1))
    return {
        "teacher_nll": nll / max(tokens, 1),
        "teacher_nll_se": _mean_se(per_nll)[1],
        "teacher_nll_per_char": nll / max(chars, 1),
        "teacher_nll_per_char_se": _mean_se(per_char)[1],
        "repeated_4grams": sum(rep) / len(rep),
        "tokens": tokens,
        "chars": chars,
        "own_tokens": own_tokens,
        "per_prompt_teacher_nll": per_nll,
        "per_prompt_teacher_nll_per_char": per_char,
        "per_prompt_completion": texts,
        "per_prompt_stopped": stops,
    }


LABELS = {  # the graded columns: a header for the printed table, a title for the plot
    "teacher_nll": ("teacher NLL", "teacher NLL per teacher token"),
    "teacher_nll_per_char": ("NLL / char", "teacher NLL per character"),
    "reverse_kl": ("reverse KL", "reverse KL on own greedy tokens"),
}


def _prepare(
    cfg: RunConfig, settings: Comparison, run_dir: Path
) -> tuple[RunConfig, list[dict[str, str]], dict[str, Any] | None]:
    """The data of the module docstring in run_dir/data and the base config of every phase (the
    conversations, TEMPLATE; with demo.student_vocab, the models of cross_models and kd.cross_tokenizer);
    the held-out rows; what the two tokenizers are (None with one tokenizer)."""
    data_dir = run_dir / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    per_file = settings.prompts_per_file
    rows = write_conversations(expand_data_paths(cfg.data.train), data_dir / "train.jsonl", per_file)
    held = write_conversations(expand_data_paths(cfg.data.heldout), data_dir / "heldout.jsonl", per_file)
    (data_dir / "template.jinja").write_text(TEMPLATE, encoding="utf-8")
    data = dict(
        train=[str(data_dir / "train.jsonl")],
        heldout=[str(data_dir / "heldout.jsonl")],
        chat_template=str(data_dir / "template.jinja"),
    )
    if not settings.student_vocab:
        return _with(cfg, run_dir, data=data), held, None
    teacher, student = cross_models(cfg, rows, settings.student_vocab, run_dir / "models")
    base = _with(
        cfg,
        run_dir,
        data=data,
        teacher=dict(path=str(teacher)),
        student=dict(path=str(student), init="random"),
        kd=dict(cross_tokenizer=True),
    )
    vocabs = {
        "teacher_vocab": load_tokenizer(teacher).vocab_size,
        "student_vocab": load_tokenizer(student).vocab_size,
        "student_tokenizer": str(student / "tokenizer.json"),
    }
    return base, held, vocabs


def _arm(cfg: RunConfig, run_dir: Path, label: str, points: int, quiet: bool) -> dict[str, Any]:
    """One arm of the comparison; with points > 1, a checkpoint kept at each grading point before its
    end (every steps // points steps)."""
    if points > 1:
        every = max(1, cfg.schedule.steps // points)
        keep = max(cfg.output.keep_checkpoints, cfg.schedule.steps // every + 1)
        cfg = dataclasses.replace(
            cfg,
            schedule=dataclasses.replace(cfg.schedule, checkpoint_every=every),
            output=dataclasses.replace(cfg.output, keep_checkpoints=keep),
        )
    return _run(cfg, run_dir, label, quiet)


def _arms(
    base: RunConfig, settings: Comparison, run_dir: Path, phases: dict[str, float], quiet: bool, say: Any
) -> dict[str, dict[str, Any]]:
    """The warm-up and both arms of the module docstring; their summaries."""
    off_kd = dict(on_policy=0.0, seq_kd=0.0, divergence=settings.off_policy_divergence)
    summaries: dict[str, dict[str, Any]] = {}
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
    say(f"on-policy arm: {base.schedule.steps} steps at lambda {base.kd.on_policy:g}")
    on_cfg = _with(start, run_dir / "on_policy")
    points = settings.grade_points
    summaries["on_policy"] = _arm(on_cfg, run_dir / "on_policy", "on-policy arm", points, quiet)
    budget = _train_seconds(summaries["on_policy"])
    phases["on_policy"] = summaries["on_policy"]["wall_seconds"]
    if not settings.warmup_steps:  # no warm-up to time the off-policy step: a few probe steps do
        probe = _with(start, run_dir / "probe", kd=off_kd, schedule=dict(steps=5))
        per_step = _train_seconds(_run(probe, run_dir / "probe", "probe", True)) / 5
    steps = max(1, round(budget / max(per_step, 1e-9)))
    say(f"off-policy arm: {steps} steps (the on-policy arm's {budget:.1f} s at {per_step:.3f} s per step)")
    off_cfg = _with(start, run_dir / "off_policy", kd=off_kd, schedule=dict(steps=steps))
    summaries["off_policy"] = _arm(off_cfg, run_dir / "off_policy", "off-policy arm", points, quiet)
    phases["off_policy"] = summaries["off_policy"]["wall_seconds"]
    return summaries


class _Grader:
    """Grades a model's greedy completions of the held-out prompts by the teacher: grade() with one
    tokenizer, grade_text() across tokenizers (the student's side its own tokenizer and template)."""

    def __init__(self, base: RunConfig, held: list[dict[str, str]], device: torch.device) -> None:
        self.cross = base.kd.cross_tokenizer
        self.texts = [r["prompt"] for r in held]
        self.new = base.kd.max_new_tokens
        teacher_dir = Path(base.teacher.path)
        template = None if self.cross else base.data.chat_template  # one tokenizer: the data's template
        self.t = side(teacher_dir, self.texts, base, template)
        self.own = side(Path(base.student.path), self.texts, base) if self.cross else self.t
        self.teacher = load_model(teacher_dir, device, torch.float32).eval()

    def __call__(self, model: torch.nn.Module) -> dict[str, Any]:
        if not self.cross:
            return grade(model, self.teacher, self.t.prompts, self.t.stops, self.new)
        own = self.t if model is self.teacher else self.own
        return grade_text(model, own, self.teacher, self.t, self.texts, self.new)


def _point(step: int, graded: dict[str, Any]) -> dict[str, Any]:
    """A curve's point: the step and the grade's scalars (no per-prompt lists, no table columns)."""
    skip = ("steps", "train_seconds", "heldout_ce")
    return {"step": step, **{k: v for k, v in graded.items() if not k.startswith("per_") and k not in skip}}


def _curve(
    grader: _Grader,
    arm_dir: Path,
    summary: dict[str, Any],
    ends: tuple[dict[str, Any] | None, dict[str, Any]],
    grade_points: int,
) -> list[dict[str, Any]]:
    """The arm's grades over its steps: its start (the warm-up's student, when there is one), the kept
    checkpoints nearest to steps k * steps / grade_points for k = 1 .. grade_points - 1, its end; each
    with its training seconds (the arm's measured seconds per step times its step)."""
    steps = summary["steps"]
    kept = {}
    for path in list_checkpoints(arm_dir):
        step = int(path.name.rsplit("-", 1)[-1])
        if step < steps:
            kept[step] = path
    wanted = sorted(
        {min(kept, key=lambda s: abs(s - k * steps / grade_points)) for k in range(1, grade_points)}
        if kept
        else ()
    )
    points = [] if ends[0] is None else [_point(0, ends[0])]
    for step in wanted:
        weights, _, _ = load_checkpoint(kept[step])
        model = load_model(arm_dir / "student", grader.teacher.lm_head_weight.device, torch.float32)
        model.load_state_dict(weights)
        points.append(_point(step, grader(model.eval())))
    points.append(_point(steps, ends[1]))
    seconds = _train_seconds(summary) / max(steps, 1)
    return [{**p, "train_seconds": p["step"] * seconds} for p in points]


def _grade_all(
    base: RunConfig,
    held: list[dict[str, str]],
    summaries: dict[str, dict[str, Any]],
    device: torch.device,
    grade_points: int,
) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, list[float]]], dict[str, list], int]:
    """The table's rows, their per-prompt values, each arm's curve over its steps, the prompts graded."""
    run_dir = Path(base.output.dir)
    grader = _Grader(base, held, device)
    table: dict[str, dict[str, Any]] = {}
    per_prompt: dict[str, dict[str, list[float]]] = {}
    for name in ROWS:
        if name == "teacher":
            model, summary = grader.teacher, None
        elif name in summaries:
            model = load_model(run_dir / name / "student", device, torch.float32).eval()
            summary = summaries[name]
        else:
            continue
        graded = grader(model)
        per_prompt[name] = {
            k[len("per_prompt_") :]: graded.pop(k) for k in list(graded) if k.startswith("per_")
        }
        if summary is None:  # the teacher: its held-out CE from the on-policy arm's eval (one tokenizer)
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
    if "completion" in per_prompt["teacher"]:  # across tokenizers: the texts the teacher graded
        lines = [
            json.dumps({"model": name, "prompt": i, "completion": text, "stopped": stopped})
            for name, values in per_prompt.items()
            for i, (text, stopped) in enumerate(zip(values.pop("completion"), values.pop("stopped")))
        ]
        atomic_write_text(run_dir / "completions.jsonl", "".join(line + "\n" for line in lines))
    curves = {
        arm: _curve(grader, run_dir / arm, summaries[arm], (table.get("warm_up"), table[arm]), grade_points)
        for arm in ("on_policy", "off_policy")
    }
    return table, per_prompt, curves, len(grader.texts)


def compare(
    cfg: RunConfig, settings: Comparison, run_dir: Path, quiet: bool = False, log: Any = None
) -> dict[str, Any]:
    """The comparison of the module docstring, in run_dir; its result (summary.json's content)."""
    t0 = time.time()
    say = log or (lambda msg: None)
    if settings.student_vocab:  # refused before anything is written
        check_cross(cfg, settings.student_vocab)
    prepare_output(run_dir, overwrite=True, lock=False)
    device, _ = resolve_device(cfg)
    base, held, vocabs = _prepare(cfg, settings, run_dir)
    if settings.heldout_prompts:
        held = held[: settings.heldout_prompts]
    phases = {"data": time.time() - t0}  # each phase's wall seconds
    summaries = _arms(base, settings, run_dir, phases, quiet, say)
    t_grade = time.time()
    say("grading the greedy completions of the held-out prompts")
    seal.unseal()  # grading is a new phase with its own shapes: its compiles are not a run's misses
    table, per_prompt, curves, prompts = _grade_all(base, held, summaries, device, settings.grade_points)
    keys = ("teacher_nll_per_char", "teacher_nll") if vocabs else ("reverse_kl", "teacher_nll")
    paired, verdicts = {}, {}
    for key in keys:  # on minus off, prompt by prompt
        mean, se = _mean_se(
            [a - b for a, b in zip(per_prompt["on_policy"][key], per_prompt["off_policy"][key])]
        )
        paired[key] = {"mean": mean, "se": se}
        # outside two standard errors of the paired difference, or within the noise
        verdicts[key] = "within noise" if abs(mean) <= 2 * se else ("lower" if mean < 0 else "higher")
    if vocabs:  # across tokenizers: a lower teacher NLL per character of its own completions
        helps = verdicts["teacher_nll_per_char"] == "lower"
    else:  # a lower reverse KL on its own completions without a higher teacher NLL of them
        helps = verdicts["reverse_kl"] == "lower" and verdicts["teacher_nll"] != "higher"
    result = {
        "comparison": table,
        **{f"on_policy_minus_off_policy_{k}": paired[k] for k in keys},
        **{f"on_policy_{k}_is": verdicts[k] for k in keys},
        "on_policy_helps": helps,
        "curves": curves,
        "cross_tokenizer": vocabs,
        "equal_time_ratio": table["off_policy"]["train_seconds"]
        / max(table["on_policy"]["train_seconds"], 1e-9),
        "heldout_prompts": prompts,
        "settings": dataclasses.asdict(settings),
        "lambda": cfg.kd.on_policy,
        "on_policy": summaries["on_policy"].get("on_policy"),
        "device": str(device),
        "phase_seconds": {**phases, "grading": time.time() - t_grade},
        "wall_seconds": time.time() - t0,
    }
    atomic_write_json(run_dir / "summary.json", result)
    plot_table(table, run_dir / "comparison.png", prompts, curves)
    return result


def _graded_keys(table: dict[str, dict[str, Any]]) -> list[str]:
    row = next(iter(table.values()))
    return [k for k in LABELS if k in row]


def plot_table(
    table: dict[str, dict[str, Any]], out: Path, prompts: int, curves: dict[str, list] | None = None
) -> Path:
    """Bars of each row's grades (with two standard errors) and held-out CE; with `curves`, the main
    grade of each arm over its training seconds."""
    plt = pyplot()

    names = list(table)
    keys = _graded_keys(table)
    panels = [(k, LABELS[k][1]) for k in keys]
    panels.append(("heldout_ce", "held-out CE on the data"))
    fig, axes = plt.subplots(
        1, len(panels) + bool(curves), figsize=(3.7 * (len(panels) + bool(curves)), 3.6), dpi=110
    )
    for ax, (key, title) in zip(axes, panels):
        values = [table[n][key] if table[n][key] is not None else float("nan") for n in names]
        err = [2 * table[n].get(f"{key}_se", 0.0) for n in names]
        ax.bar(names, values, yerr=err, color=["gray", "tab:olive", "tab:blue", "tab:orange"][: len(names)])
        ax.set_title(title, fontsize=9)
        ax.tick_params(axis="x", labelrotation=20)
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("nats (lower is better)")
    if curves:
        key = keys[1] if keys[:2] == ["teacher_nll", "teacher_nll_per_char"] else keys[0]
        ax = axes[-1]
        for arm, color in (("off_policy", "tab:blue"), ("on_policy", "tab:orange")):
            points = curves.get(arm) or []
            x = [p["train_seconds"] for p in points]
            y = [p[key] for p in points]
            err = [2 * p.get(f"{key}_se", 0.0) for p in points]
            ax.errorbar(x, y, yerr=err, marker="o", capsize=3, color=color, label=arm)
        ax.set_title(f"{LABELS[key][1]} over each arm", fontsize=9)
        ax.set_xlabel("training seconds from the warm-up's student")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle(
        f"the teacher's grades of each model's own greedy completions of {prompts} held-out prompts, "
        "error bars two standard errors",
        fontsize=10,
    )
    fig.tight_layout()
    tmp = out.with_name(f".{out.name}.tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    os.replace(tmp, out)
    return out


def print_table(result: dict[str, Any]) -> None:
    """The comparison as a table on stdout."""
    table = result["comparison"]
    keys = _graded_keys(table)
    vocabs = result.get("cross_tokenizer")
    if vocabs:
        print(
            f"across tokenizers: the teacher's {vocabs['teacher_vocab']} tokens, the student's "
            f"{vocabs['student_vocab']}; completions re-tokenized by the teacher"
        )
    print(f"greedy completions of {result['heldout_prompts']} held-out prompts, graded by the teacher:")
    head = "".join(f"{LABELS[k][0]:>16s}" for k in keys)
    print(f"  {'':11s}{'steps':>6s}{'train s':>9s}{head}{'rep 4-gr':>9s}{'held-out CE':>12s}")
    for name, row in table.items():
        steps = "" if row["steps"] is None else str(row["steps"])
        secs = "" if row["train_seconds"] is None else f"{row['train_seconds']:.1f}"
        ce = "" if row["heldout_ce"] is None else f"{row['heldout_ce']:.4f}"
        graded = "".join(f"{row[k]:9.4f} ±{row[f'{k}_se']:.3f}" for k in keys)
        print(f"  {name:11s}{steps:>6s}{secs:>9s}{graded}{row['repeated_4grams']:9.2f}{ce:>12s}")
    key = keys[1] if vocabs else "teacher_nll"
    for arm, points in (result.get("curves") or {}).items():
        line = ", ".join(f"step {p['step']} {p[key]:.4f} ±{p[f'{key}_se']:.3f}" for p in points)
        print(f"{LABELS[key][1]} over the {arm.replace('_', '-')} arm: {line}")
    for k in keys:
        if f"on_policy_minus_off_policy_{k}" not in result:
            continue
        d = result[f"on_policy_minus_off_policy_{k}"]
        print(
            f"on-policy minus off-policy {LABELS[k][0]}, per prompt: {d['mean']:+.4f} ± {d['se']:.4f} "
            f"(one standard error): on-policy's is {VERDICTS[result[f'on_policy_{k}_is']]}"
        )
    rule = "lower teacher NLL per character" if vocabs else "lower reverse KL, teacher NLL not higher"
    print(f"on-policy helps ({rule}): {'yes' if result['on_policy_helps'] else 'no'}")
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
