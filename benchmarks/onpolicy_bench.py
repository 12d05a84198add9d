"""On-policy distillation speed: TRL's GKDTrainer beside kdistill (kd.on_policy=1), same pair, same card,
and kdistill's weak scaling under torchrun (the same prompts per GPU on 1, 2, 4 GPUs).

    python benchmarks/onpolicy_bench.py                           # Qwen2.5-1.5B -> 0.5B shapes, 1 GPU
    python benchmarks/onpolicy_bench.py --json out.json --steps 8
    python benchmarks/onpolicy_bench.py --row long --nproc 1,2,4     # 1.5B -> 0.5B, 16 prompts x 1,024 new
    python benchmarks/onpolicy_bench.py --row 7b --nproc 1,2,4       # 7B -> 1.5B, 4 prompts x 256 new
    python benchmarks/onpolicy_bench.py --device cpu --tiny --nproc 1,2 --only kdistill   # CPU smoke (gloo)

Both sides train the same student from the same teacher (random weights at the presets' shapes of
--pair TEACHER:STUDENT, built here with transformers and saved once; no download) on the same prompts:
--prompts prompts per GPU of --prompt-len tokens, --new new tokens sampled by the student at every step
(lambda = 1), JSD(0.5) at temperature 0.9 over the full vocabulary, AdamW on an fp32 student under bf16
autocast, a bf16 teacher. The tokenizer is a word-level one built here (one token per word), so a prompt
of 128 words is 128 tokens on both sides.

Reported per side, after --warmup untimed steps: completion tokens per second through whole optimizer
steps (generation, teacher scoring, update), seconds per step, and peak GPU memory (each side runs in
its own process, so the peaks are its own). kdistill runs once per world size of --nproc (`kdistill run`,
under torchrun above one process, schedule.batch_size = prompts x world): its completion tokens per
second over all processes, the scaling against its first world size (ideally the world size), and
each phase's mean seconds per step on every rank, from metrics.jsonl's phase_s (generate: the rank's own
generation; score: the teacher on its rows; wait: then, for the slowest rank's samples; update: the rest),
with the layout the run chose. TRL runs on one device only, as the anchor; it needs `trl` and `datasets`
(and their pure-Python dependencies); a side that cannot run says why in its entry. One invocation writes
one JSON with the card, versions, date and command (rewritten after each world size, `"partial": true`
until the last: what was measured survives an invocation stopped from outside). A kdistill run past
--run-limit seconds is stopped and its entry holds the error and the end of its stderr, where every
process of the run printed its threads' stacks (SIGABRT under PYTHONFAULTHANDLER): where a stalled run
was stuck. vLLM-based trainers are not measured (their engine is not installable on the benchmark
machine).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import kdistill
from kdistill.config import parse_override
from kdistill.models.presets import PRESETS
from kdistill.train.distributed import TEARDOWN_LATE

REPO = Path(__file__).resolve().parents[1]
KDISTILL_SRC = Path(kdistill.__file__).resolve().parents[1]  # the runs' processes import this tree's kdistill

TINY = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
)
WORDS = 2000  # the word-level tokenizer's vocabulary (the models keep their own vocab_size)
EOS = "<|endoftext|>"
# Each message's text and a newline; the answer ends with the end of text.
TEMPLATE = (
    "{% for m in messages %}{{ m['content'] }}\n{% if m['role'] == 'assistant' %}" + EOS + "{% endif %}"
    "{% endfor %}"
)


@dataclasses.dataclass
class Shape:
    batch: int = 8  # prompts per GPU (each completed once)
    prompt: int = 128
    new: int = 128
    steps: int = 6
    warmup: int = 3
    temperature: float = 0.9
    teacher: str = "qwen2.5-1.5b"
    student: str = "qwen2.5-0.5b"
    profile: int = 0  # steps profiled (runtime.profile_steps) after the warm-up, before the timed ones
    overrides: tuple[str, ...] = ()  # kdistill config overrides, SECTION.FIELD=VALUE


def build_assets(out: Path, tiny: bool, shape: Shape, rows: int) -> Path:
    """teacher/, student/ (config, safetensors, tokenizer with the template) and data.jsonl (`rows`
    prompts) under out."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {EOS: 0, "<unk>": 1, **{f"w{i}": i + 2 for i in range(WORDS)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens([EOS])
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token=EOS, pad_token=EOS, unk_token="<unk>"
    )
    tok.chat_template = TEMPLATE
    for role, preset in (("teacher", shape.teacher), ("student", shape.student)):
        raw = dict(PRESETS[preset])
        for k in ("architectures", "torch_dtype", "layer_types", "max_window_layers"):
            raw.pop(k, None)
        if tiny:
            width = TINY["hidden_size"] * (2 if role == "teacher" else 1)
            raw.update(
                TINY, hidden_size=width, head_dim=width // TINY["num_attention_heads"], vocab_size=4096
            )
        raw.update(eos_token_id=0, bos_token_id=0, pad_token_id=0)
        torch.manual_seed(0 if role == "teacher" else 1)
        # random weights drawn on the GPU where there is one: a 7B model's on the CPU take minutes
        with torch.device("cuda" if torch.cuda.is_available() and not tiny else "cpu"):
            model = transformers.AutoModelForCausalLM.from_config(
                transformers.Qwen2Config(**raw), dtype=torch.bfloat16
            )
        model.save_pretrained(out / role)
        tok.save_pretrained(out / role)
        del model
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the runs that follow are other processes
    g = torch.Generator().manual_seed(0)
    with open(out / "data.jsonl", "w", encoding="utf-8") as f:
        for _ in range(rows):
            words = torch.randint(0, WORDS, (shape.prompt + shape.new,), generator=g).tolist()
            text = [f"w{w}" for w in words]
            row = {"prompt": " ".join(text[: shape.prompt]), "completion": " ".join(text[shape.prompt :])}
            f.write(json.dumps(row) + "\n")
    (out / "template.jinja").write_text(TEMPLATE, encoding="utf-8")
    return out


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_trl(assets: Path, device: str, shape: Shape) -> dict[str, Any]:
    """TRL's GKDTrainer at lambda = 1 for warmup + steps steps, timed step by step by a callback."""
    import datasets
    import transformers

    try:
        from trl.experimental.gkd import GKDConfig, GKDTrainer
    except ImportError:  # older TRL keeps it at the top level
        from trl import GKDConfig, GKDTrainer
    import trl

    gpu = device.startswith("cuda")
    # the word-level tokenizer as built (AutoTokenizer would pick the Qwen2 class from config.json)
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(assets / "teacher")
    student = transformers.AutoModelForCausalLM.from_pretrained(assets / "student", dtype=torch.float32)
    teacher = transformers.AutoModelForCausalLM.from_pretrained(
        assets / "teacher", dtype=torch.bfloat16 if gpu else torch.float32
    )
    rows = [json.loads(x) for x in (assets / "data.jsonl").read_text().splitlines()]
    ds = datasets.Dataset.from_list(
        [
            {
                "messages": [
                    {"role": "user", "content": r["prompt"]},
                    {"role": "assistant", "content": r["completion"]},
                ]
            }
            for r in rows
        ]
    )
    times: list[float] = []

    class Timer(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            _sync(device)
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            _sync(device)
            times.append(time.perf_counter() - self.t0)

    with tempfile.TemporaryDirectory() as tmp:
        args = GKDConfig(
            output_dir=tmp,
            per_device_train_batch_size=shape.batch,
            gradient_accumulation_steps=1,
            max_steps=shape.warmup + shape.steps,
            learning_rate=1e-5,
            lmbda=1.0,
            beta=0.5,
            temperature=shape.temperature,
            max_new_tokens=shape.new,
            max_length=shape.prompt + shape.new + 8,
            bf16=gpu,
            use_cpu=not gpu,
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            dataloader_num_workers=0,
            seed=0,
        )
        trainer = GKDTrainer(
            model=student, teacher_model=teacher, args=args, train_dataset=ds, processing_class=tok,
            callbacks=[Timer()],
        )  # fmt: skip
        if gpu:
            torch.cuda.reset_peak_memory_stats()
        trainer.train()
    timed = times[shape.warmup :]
    per_step = sum(timed) / len(timed)
    return {
        "version": trl.__version__,
        "seconds_per_step": per_step,
        # every row writes max_new_tokens tokens (random weights: a sampled EOS is rare)
        "completion_tokens_per_s": shape.batch * shape.new / per_step,
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if gpu else None,
        "steps_timed": len(timed),
    }


def kdistill_config(assets: Path, work: Path, device: str, shape: Shape, world: int) -> dict[str, Any]:
    """The run config of kdistill at kd.on_policy = 1 on `world` processes (shape.batch prompts each)."""
    cfg: dict[str, Any] = {
        "teacher": {"path": str(assets / "teacher")},
        "student": {"path": str(assets / "student"), "init": "pretrained"},
        "data": {
            "train": [str(assets / "data.jsonl")],
            "heldout_fraction": 0.01,
            "seq_len": shape.prompt + shape.new + 8,
            "chat_template": str(assets / "template.jinja"),
            "cache_dir": str(work / "cache"),
        },
        "kd": {
            "alpha": 1.0, "divergence": "jsd", "beta": 0.5, "temperature": shape.temperature,
            "on_policy": 1.0, "max_new_tokens": shape.new,
        },
        "optim": {"lr": 1e-5, "warmup_steps": 0},
        "schedule": {
            "steps": shape.warmup + shape.profile + shape.steps, "batch_size": shape.batch * world,
            "eval_every": 0,
            "eval_batches": 1, "checkpoint_every": 0, "sample_prompts": 0,
        },
        "output": {"dir": str(work / f"run-{world}"), "keep_checkpoints": 1},
        "runtime": {"device": device, "profile_steps": shape.profile},
    }  # fmt: skip
    for item in shape.overrides:  # values as kdistill's command line reads them (`off` stays a word)
        path, value = parse_override(item)
        node = cfg
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
    return cfg


def run_env() -> dict[str, str]:
    """The environment of a `kdistill run` process: this one's, with the kdistill this process imported
    first on PYTHONPATH (a tree chosen by PYTHONPATH when the benchmark started, else the repository's),
    so that a run from another tree measures that tree."""
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(KDISTILL_SRC), os.environ.get("PYTHONPATH", "")]),
    }


def launch(cmd: list[str], env: dict[str, str], limit: float) -> tuple[subprocess.CompletedProcess, bool]:
    """Run `cmd` (a run, or torchrun and its processes) in a session of its own for at most `limit`
    seconds: (its result, whether it ran out of time). Past the limit every process of the run gets
    SIGABRT first (`signal_tree`: torchrun's workers too), which makes each Python process print every
    thread's stack (the faulthandler, PYTHONFAULTHANDLER=1), so the stderr of a run that stalled says
    where each of its processes was; then SIGKILL for what is left. Should the benchmark itself be
    stopped while it waits (Ctrl-C, or SIGTERM: `stop_on_sigterm`), the run is killed before it goes."""
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**env, "PYTHONFAULTHANDLER": "1"},
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=limit)
        return subprocess.CompletedProcess(cmd, proc.returncode, out, err), False
    except subprocess.TimeoutExpired:
        pass
    except BaseException:  # the benchmark itself stopped (Ctrl-C, SIGTERM): its run goes too
        signal_tree(proc.pid, signal.SIGKILL)
        raise
    out = err = ""
    for sig, wait in ((signal.SIGABRT, 30.0), (signal.SIGKILL, None)):
        signal_tree(proc.pid, sig)  # a run already gone: its output is read at once below
        try:
            out, err = proc.communicate(timeout=wait)  # without a wait after SIGKILL: until it ends
            break
        except subprocess.TimeoutExpired:
            continue
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err), True


def process_tree(pid: int) -> list[int]:
    """`pid` and every process below it, read from /proc (Linux)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rpartition(")")[2].split()[1])  # after the command's name: state, ppid
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def signal_tree(pid: int, sig: int) -> bool:
    """Send `sig` to `pid`'s session and to every process below it: torchrun starts its workers in
    sessions of their own, out of reach of its session's signal. The tree is read before any signal
    (a worker whose torchrun ended first would no longer be below it). False when `pid` is gone."""
    tree = process_tree(pid)
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        return False
    for p in tree[1:]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, sig)
    return True


def run_kdistill(
    assets: Path, work: Path, device: str, shape: Shape, world: int, limit: float = 1800.0
) -> dict[str, Any]:
    """`kdistill run` at kd.on_policy = 1 on `world` processes (torchrun above one); per-step phases
    from metrics.jsonl, rank 0's step times, completion tokens of every process. A run that takes more
    than `limit` seconds is stopped: its result is the error and the end of its stderr (every process's
    stacks: `launch`)."""
    cfg_path = work / f"run-{world}.yaml"
    cfg_path.write_text(json.dumps(kdistill_config(assets, work, device, shape, world)), encoding="utf-8")
    launcher = [sys.executable]
    if world > 1:
        launcher += ["-m", "torch.distributed.run", f"--nproc_per_node={world}", "--standalone"]
    proc, late = launch([*launcher, "-m", "kdistill", "run", str(cfg_path), "--quiet"], run_env(), limit)
    if late:
        lines = [x for x in proc.stderr.splitlines() if x.strip()]
        return {"error": f"stopped after {limit:g} s (--run-limit)", "stderr_tail": lines[-400:]}
    run_dir = work / f"run-{world}"
    if proc.returncode != 0 or not (run_dir / "summary.json").is_file():
        tail = [x for x in proc.stderr.splitlines() if x.strip()] or ["failed (no summary)"]
        return {"error": tail[-1].strip()[-500:], "stderr_tail": tail[-200:]}
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    timed = rows[shape.warmup + shape.profile :]  # the profiled steps carry the profiler's overhead
    seconds = [r["gen_s"] + r["score_s"] + r["update_s"] for r in timed]
    tokens = sum(r["completion_tokens"] for r in timed)
    phases = {
        name: [sum(r["phase_s"][name][rank] for r in timed) / len(timed) for rank in range(world)]
        for name in timed[0]["phase_s"]
    }
    return {
        "world_size": world,
        "seconds_per_step": sum(seconds) / len(seconds),
        "completion_tokens_per_s": tokens / sum(seconds),
        "gen_s": sum(r["gen_s"] for r in timed) / len(timed),
        "score_s": sum(r["score_s"] for r in timed) / len(timed),
        "update_s": sum(r["update_s"] for r in timed) / len(timed),
        "phase_s_per_rank": phases,
        "mean_completion_len": tokens / sum(r["completions"] for r in timed),
        "completions_per_step": sum(r["completions"] for r in timed) / len(timed),  # over all processes
        "layout": summary.get("layout"),
        "peak_memory_gib": summary.get("peak_memory_gib"),
        "planned_memory_gib": summary.get("planned_memory_gib"),
        "jit_after_prewarm": summary.get("jit_after_prewarm"),
        "cuda_graphs": summary.get("cuda_graphs"),  # the update's captures, replays and eager steps
        "steps_timed": len(timed),
        # processes whose process-group teardown outlasted its limit (distributed.destroy): 0 expected
        "teardown_timeouts": proc.stderr.count(TEARDOWN_LATE),
        **({"profile": profiles(run_dir, world)} if shape.profile else {}),
    }


def profiles(run_dir: Path, world: int) -> dict[str, Any]:
    """Each rank's runtime.profile_steps report (profile/rank{R}.json: wall and device time per step,
    kernel groups, exposed collective time)."""
    out = {}
    for rank in range(world):
        path = run_dir / "profile" / f"rank{rank}.json"
        out[str(rank)] = json.loads(path.read_text()) if path.is_file() else None
    return out


def provider_main(args: argparse.Namespace, shape: Shape) -> int:
    """TRL's side in this process: its result as one JSON line on stdout."""
    try:
        out = run_trl(Path(args.assets), args.device, shape)
    except ImportError as e:
        out = {"error": f"cannot import {e.name or e}: install trl and datasets to compare"}
    print("RESULT " + json.dumps(out), flush=True)
    return 0


# The realistic rows (--row): pair, prompts per GPU, new tokens; explicit --pair/--prompts/--new win
ROWS = {
    "default": ("qwen2.5-1.5b:qwen2.5-0.5b", 8, 128),
    "long": ("qwen2.5-1.5b:qwen2.5-0.5b", 16, 1024),
    "7b": ("qwen2.5-7b:qwen2.5-1.5b", 4, 256),
}


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, Shape, list[int]]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--row",
        choices=sorted(ROWS),
        default="default",
        help="a named row: default (1.5B -> 0.5B, 8 x 128 new), long (1.5B -> 0.5B, 16 x 1,024), "
        "7b (7B -> 1.5B, 4 x 256); --pair, --prompts and --new given explicitly override it",
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (a CPU smoke check)")
    p.add_argument("--pair", default=None, help="TEACHER:STUDENT preset names")
    p.add_argument("--prompts", type=int, default=None, help="prompts per GPU and step")
    p.add_argument("--prompt-len", type=int, default=128, help="tokens per prompt")
    p.add_argument("--new", type=int, default=None, help="new tokens per completion")
    p.add_argument("--nproc", default="1", help="kdistill's world sizes, comma-separated (torchrun above 1)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="untimed steps first (default 3: on a GPU kdistill captures its update at the third step; "
        "2 with --profile-steps)",
    )
    p.add_argument("--json", help="write the results here")
    p.add_argument(
        "--run-limit",
        type=float,
        default=1800.0,
        help="seconds a kdistill run may take; a run past it is stopped, every process's stacks in its "
        "result's stderr_tail (default 1800)",
    )
    p.add_argument(
        "--profile-steps",
        type=int,
        default=0,
        help="kdistill: profile this many steps after the warm-up (runtime.profile_steps), not timed",
    )
    p.add_argument("--only", choices=("trl", "kdistill"), help="run one side")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.FIELD=VALUE",
        help="kdistill: a config override (repeatable), e.g. runtime.grad_reduce=compute",
    )
    p.add_argument("--provider", choices=("trl",), help=argparse.SUPPRESS)
    p.add_argument("--assets", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    pair, prompts, new = ROWS[args.row]
    args.pair = args.pair or pair
    args.prompts = args.prompts if args.prompts is not None else prompts
    args.new = args.new if args.new is not None else new
    teacher, _, student = args.pair.partition(":")
    for name in (teacher, student):
        if name not in PRESETS:
            p.error(f"--pair {args.pair}: no preset {name!r} (one of {', '.join(sorted(PRESETS))})")
    try:
        worlds = sorted({int(x) for x in args.nproc.split(",") if x.strip()})
    except ValueError:
        p.error(f"--nproc {args.nproc}: expected world sizes such as 1,2,4")
    if not worlds or min(worlds) < 1:
        p.error(f"--nproc {args.nproc}: expected world sizes >= 1")
    for item in args.set:
        if "=" not in item or "." not in item.partition("=")[0]:
            p.error(f"--set {item}: expected SECTION.FIELD=VALUE")
    if args.warmup is None:
        args.warmup = 2 if args.profile_steps else 3
    if args.run_limit <= 0:
        p.error(f"--run-limit {args.run_limit:g}: expected seconds > 0")
    if args.profile_steps and args.warmup != 2:
        p.error("--profile-steps: a run profiles the steps after its own 2 warm-up steps; use --warmup 2")
    shape = Shape(
        batch=args.prompts, prompt=args.prompt_len, new=args.new, steps=args.steps, warmup=args.warmup,
        teacher=teacher, student=student, profile=max(0, args.profile_steps), overrides=tuple(args.set),
    )  # fmt: skip
    if args.tiny:
        shape = dataclasses.replace(shape, batch=2, prompt=16, new=8)
    return args, shape, worlds


def stop_on_sigterm() -> None:
    """SIGTERM (a `timeout` around the benchmark) ends it through SystemExit, so that `launch` stops the
    run it waits for: a run is started in a session of its own and would otherwise outlive it."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))


def main() -> int:
    stop_on_sigterm()
    args, shape, worlds = parse_args()
    if args.provider:
        return provider_main(args, shape)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        rows = max(64 * shape.batch, 2 * shape.batch * max(worlds) * (shape.steps + shape.warmup))
        assets = build_assets(Path(tmp), args.tiny, shape, rows)
        if args.only in (None, "trl"):
            cmd = [
                sys.executable,
                __file__,
                "--provider",
                "trl",
                "--assets",
                str(assets),
                "--device",
                args.device,
            ]
            cmd += ["--pair", args.pair, "--prompts", str(args.prompts), "--prompt-len", str(args.prompt_len)]
            cmd += ["--new", str(args.new), "--steps", str(args.steps), "--warmup", str(args.warmup)]
            cmd += ["--tiny"] if args.tiny else []
            proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
            line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
            errors = [x for x in proc.stderr.splitlines() if "Error" in x] or ["failed (no result line)"]
            results["trl"] = json.loads(line[7:]) if line else {"error": errors[-1].strip()}
            print(f"trl: {json.dumps(results['trl'])}", file=sys.stderr, flush=True)
        if args.only in (None, "kdistill"):
            results["kdistill"] = {}
            for world in worlds:
                out = run_kdistill(assets, Path(tmp), args.device, shape, world, args.run_limit)
                results["kdistill"][str(world)] = out
                print(f"kdistill x{world}: {json.dumps(out)}", file=sys.stderr, flush=True)
                if args.json and world != worlds[-1]:  # what is measured so far, should the rest not end
                    write_json(Path(args.json), make_report(args, shape, worlds, results, partial=True))
        # written before the assets are removed (a 7B teacher's checkpoint takes a while to delete)
        report = make_report(args, shape, worlds, results)
        print(json.dumps(report, indent=2))
        if args.json:
            write_json(Path(args.json), report)
    return 0


def write_json(path: Path, report: dict[str, Any]) -> None:
    """The report, written whole or not at all (a temporary file renamed)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def make_report(
    args: argparse.Namespace, shape: Shape, worlds: list[int], results: dict[str, Any], partial: bool = False
) -> dict[str, Any]:
    """The benchmark's JSON: the shape, the machine, the command and the results so far, with kdistill's
    scaling against its first world size and its speedup over TRL. partial: written after a world size
    while others are still to run (`"partial": true` in the JSON)."""
    rates = {w: r.get("completion_tokens_per_s") for w, r in results.get("kdistill", {}).items()}
    base_world = str(worlds[0])
    scaling = {
        w: rate / rates[base_world] if rate and rates.get(base_world) else None for w, rate in rates.items()
    }
    trl_rate = results.get("trl", {}).get("completion_tokens_per_s")
    return {
        "benchmark": "on-policy distillation, whole steps, weak scaling",
        "pair": "tiny" if args.tiny else f"{shape.teacher} -> {shape.student} shapes (random weights)",
        "shape": {**dataclasses.asdict(shape), "prompts_per_gpu": shape.batch},
        "device": torch.cuda.get_device_name()
        if args.device.startswith("cuda")
        else platform.processor() or "cpu",
        "gpus": torch.cuda.device_count() if args.device.startswith("cuda") else 0,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "results": results,
        # completion tokens per second against the first world size (weak scaling: ideally world / first)
        "kdistill_scaling": {"against_world": worlds[0], **scaling},
        "kdistill_speedup": rates.get(base_world) / trl_rate if trl_rate and rates.get(base_world) else None,
        **({"partial": True} if partial else {}),
    }


if __name__ == "__main__":
    raise SystemExit(main())
