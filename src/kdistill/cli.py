"""The kdistill command line.

    kdistill run [CONFIG.yaml] [key=value ...]      distil (no arguments: the embedded demo)
    kdistill plan CONFIG [key=value ...]            parameters, FLOPs, memory estimate
    kdistill prewarm CONFIG [--pack DIR]            compile (or load from a kernel pack) every kernel the run needs
    kdistill kernels build --arch sm_80,... CONFIG [--out DIR]  cross-compile the kernel plan without a GPU
    kdistill eval --model DIR --data FILE           held-out cross-entropy and perplexity
    kdistill generate --model DIR --prompt TEXT     sample from a model (KV cache, batched, --chat)
    kdistill data preview --model DIR --data FILE   packed conversation rows, learned tokens marked
    kdistill inspect DIR                            architecture, sizes, tokenizer identity
    kdistill report RUN_DIR                         summary of a finished or interrupted run
    kdistill export --run RUN_DIR [--merge] --out DIR   a LoRA run's adapters (PEFT layout) or merged model
    kdistill teacher-cache CONFIG --out DIR [--mode exact|topk|sampled] [--k K]   the teacher's targets once

Errors a user can cause print one line and exit 2; `--debug` shows the traceback. This module is the
argument parser and the command table; each command lives in kdistill.commands.
"""

from __future__ import annotations

import argparse
import os
import sys
import typing
from collections.abc import Callable, Sequence

import torch

from kdistill import __version__, signals
from kdistill.commands.data import preview_command
from kdistill.commands.eval import eval_command
from kdistill.commands.export import export_command
from kdistill.commands.generate import generate_command
from kdistill.commands.inspect import inspect_command
from kdistill.commands.kernels import build_command, prewarm_command
from kdistill.commands.plan import plan_command
from kdistill.commands.report import report_command
from kdistill.commands.run import run_command
from kdistill.commands.teacher_cache import teacher_cache_command
from kdistill.errors import UserError
from kdistill.kernels.keys import ARCHS
from kdistill.train import distributed as dist


def _add_config_args(p: argparse.ArgumentParser, optional: bool = False) -> None:
    p.add_argument(
        "config",
        nargs="?" if optional else None,
        metavar="CONFIG",
        help="YAML run config (or a preset pair like 'qwen2.5-1.5b:qwen2.5-0.5b' for plan)",
    )
    p.add_argument(
        "overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. kd.temperature=2"
    )


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are the one-line form (a UserError), not a usage block and exit 2."""

    def error(self, message: str) -> typing.NoReturn:
        cmd = self.prog.removeprefix("kdistill").strip()
        raise UserError(
            f"{cmd + ': ' if cmd else ''}{message} (see kdistill {cmd + ' ' if cmd else ''}--help)"
        )


def version_text() -> str:
    """`kdistill --version`: kdistill, torch, Triton (or "not installed") and CUDA (torch's build, or "none")."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    cuda = torch.version.cuda or "none (CPU build of torch)"
    return f"kdistill {__version__}\ntorch {torch.__version__}\ntriton {triton_version}\ncuda {cuda}"


class VersionAction(argparse.Action):
    """--version: the versions are read only when asked (Triton may take a while to import)."""

    def __call__(self, parser: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
        print(version_text())
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kdistill", description="Logit knowledge distillation of causal LMs.")
    parser.add_argument(
        "--version", action=VersionAction, nargs=0, help="show kdistill, torch, Triton and CUDA versions"
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    parser.add_argument(
        "--log-kernels",
        action="store_true",
        help="log every kernel compile and cache hit with its key (or KDISTILL_LOG_KERNELS=1)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("run", help="distil a teacher into a student (no CONFIG: the embedded demo)")
    _add_config_args(p, optional=True)
    p.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR exactly where it stopped")
    p.add_argument(
        "--allow-changes",
        action="store_true",
        help="with --resume: continue although the teacher, student, tokenizer or data changed (recorded)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace a run already in output.dir")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print the summary as JSON at the end")

    p = sub.add_parser("plan", help="parameter counts, FLOPs per token and peak memory estimate")
    _add_config_args(p)
    p.add_argument("--nproc", type=int, default=1, help="plan one of N torchrun processes (default 1)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")

    p = sub.add_parser("prewarm", help="compile every kernel of the run's plan, then stop")
    p.add_argument(
        "--pack", metavar="DIR", help="load the kernels from this kernel pack (default: runtime.kernel_pack)"
    )
    _add_config_args(p)

    p = sub.add_parser("kernels", help="kernel tools")
    ksub = p.add_subparsers(dest="kernels_command", metavar="SUBCOMMAND")
    b = ksub.add_parser("build", help="compile the kernel plan for GPU archs without a GPU")
    b.add_argument(
        "--arch",
        default=None,
        help=f"comma-separated archs (default: {','.join(ARCHS)}, and sm_103,sm_121 where this Triton targets them)",
    )
    b.add_argument("--json", action="store_true", help="print JSON")
    b.add_argument("--out", metavar="DIR", help="write the binaries to this kernel pack (or add to it)")
    b.add_argument(
        "--nproc",
        type=int,
        default=1,
        help="the plan of one of N torchrun processes (default 1: one process)",
    )
    _add_config_args(b)

    p = sub.add_parser("eval", help="mean next-token cross-entropy and perplexity of a model on data")
    p.add_argument("--model", required=True, help="Hugging Face model directory")
    p.add_argument("--data", required=True, nargs="+", help="text files/directories or JSONL")
    p.add_argument(
        "--seq-len",
        type=int,
        default=None,
        help="tokens per sequence (default: min(512, the model's max_position_embeddings))",
    )
    p.add_argument("--batch-size", type=int, default=8, help="sequences per batch (default: %(default)s)")
    p.add_argument("--no-pack", action="store_true", help="score each JSONL line / document on its own")
    p.add_argument("--device", default="auto", help="cpu, cuda or auto (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=None, help="stop after this many scored tokens")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--draft-for",
        metavar="TEACHER",
        default=None,
        help="measure --model as a draft of TEACHER: acceptance rate and predicted speed-up",
    )
    p.add_argument(
        "--draft-tokens", type=int, default=None, help="with --draft-for: tokens per verify (default: 4)"
    )
    p.add_argument("--prompts", type=int, default=32, help="with --draft-for: held-out prompts (default: 32)")
    p.add_argument(
        "--max-new-tokens", type=int, default=64, help="with --draft-for: tokens per prompt (default: 64)"
    )

    _add_generate_parser(sub)

    p = sub.add_parser("data", help="data tools")
    dsub = p.add_subparsers(dest="data_command", metavar="SUBCOMMAND")
    d = dsub.add_parser("preview", help="the first packed rows of conversations, learned tokens marked")
    d.add_argument("--model", required=True, help="model directory (tokenizer.json and its chat template)")
    d.add_argument("--data", required=True, nargs="+", help="conversation JSONL or Parquet files")
    d.add_argument("-n", type=int, default=3, help="rows to show (default: %(default)s)")
    d.add_argument("--seq-len", type=int, default=512, help="tokens per packed row (default: %(default)s)")
    d.add_argument("--chat-template", default=None, help="a .jinja file to render with instead")
    d.add_argument(
        "--train-on", default="assistant", help="assistant, last_assistant or all (default: %(default)s)"
    )
    d.add_argument(
        "--template-kwargs",
        metavar="JSON",
        default=None,
        help="template variables, e.g. '{\"enable_thinking\": false}'",
    )
    d.add_argument("--json", action="store_true", help="per row input_ids, labels and boundaries as JSON")

    p = sub.add_parser("inspect", help="architecture, parameter counts, dtype, vocab and tokenizer identity")
    p.add_argument("model", metavar="DIR", help="Hugging Face model directory (or a preset name)")
    p.add_argument("--json", action="store_true", help="print JSON")

    p = sub.add_parser("report", help="readable summary of a finished or interrupted run")
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("--json", action="store_true", help="print JSON")

    p = sub.add_parser(
        "export", help="a LoRA run's adapters (PEFT layout), or merged into the base with --merge"
    )
    p.add_argument("--run", required=True, metavar="RUN_DIR", help="a completed LoRA run")
    p.add_argument("--out", required=True, metavar="DIR", help="output folder")
    p.add_argument(
        "--merge", action="store_true", help="fold the adapters into the base: a Hugging Face model"
    )

    p = sub.add_parser(
        "teacher-cache",
        help="run the teacher once over the run's training and held-out rows, write its targets",
    )
    _add_config_args(p)
    p.add_argument("--out", required=True, metavar="DIR", help="the cache folder (resumable)")
    p.add_argument("--mode", default="exact", help="exact, topk or sampled (default: %(default)s)")
    p.add_argument(
        "--k", type=int, default=64, help="ids per token for topk and sampled (default: %(default)s)"
    )
    p.add_argument("--shard-rows", type=int, default=256, help="packed rows per shard (default: %(default)s)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    return parser


def _add_generate_parser(sub: argparse._SubParsersAction) -> None:
    """`kdistill generate`: its prompts, sampling, batching and output options."""
    p = sub.add_parser(
        "generate", help="answer prompts with a model (greedy by default, CUDA graphs on a GPU)"
    )
    p.add_argument("--model", required=True, help="Hugging Face model directory")
    p.add_argument("--prompt", action="append", metavar="TEXT", help="a prompt (repeat for a batch)")
    p.add_argument(
        "--messages", metavar="FILE", help="JSONL of conversations to answer (last turn: user or tool)"
    )
    p.add_argument("--chat", action="store_true", help="render prompts with the model's chat template")
    p.add_argument(
        "--chat-template", metavar="PATH", default=None, help="a .jinja file to render with instead"
    )
    p.add_argument("--max-new-tokens", type=int, default=128, help="per prompt (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default: %(default)s)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k likeliest tokens (0: off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1: off)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default: %(default)s)")
    p.add_argument("--device", default="auto", help="cpu, cuda or auto (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="one JSON line per answer, as each finishes")
    p.add_argument("--out", metavar="FILE", help="write answers to this JSONL (resumable, with a manifest)")
    p.add_argument(
        "--samples-per-prompt", type=int, default=1, help="answers per prompt, 1 to 1024 (default: 1)"
    )
    p.add_argument("--batch-size", type=int, default=32, help="rows decoded at once (default: %(default)s)")
    p.add_argument(
        "--max-length", type=int, default=None, help="cache slots per row: prompt + new tokens (default: fit)"
    )
    p.add_argument(
        "--kernel-pack",
        metavar="DIR",
        default=None,
        help="load the decode kernels from this kernel pack (kdistill kernels build --out) on a GPU",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument(
        "--draft",
        metavar="DIR",
        default=None,
        help="speculative decoding: this model drafts, --model verifies",
    )
    p.add_argument(
        "--draft-tokens", type=int, default=None, help="with --draft: tokens per verify (default: 4)"
    )


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "run": run_command,
    "plan": plan_command,
    "prewarm": prewarm_command,
    "kernels": build_command,  # its one subcommand, checked in _dispatch
    "data": preview_command,  # its one subcommand, checked in _dispatch
    "eval": eval_command,
    "generate": generate_command,
    "inspect": inspect_command,
    "report": report_command,
    "export": export_command,
    "teacher-cache": teacher_cache_command,
}


def _dispatch(args: argparse.Namespace) -> int:
    if args.log_kernels:
        os.environ["KDISTILL_LOG_KERNELS"] = "1"
    cmd = args.command
    if cmd == "kernels" and args.kernels_command != "build":
        raise UserError("kernels: expected a subcommand: build")
    if cmd == "data" and args.data_command != "preview":
        raise UserError("data: expected a subcommand: preview")
    if cmd not in COMMANDS:
        raise UserError(
            "expected a command: run, plan, prewarm, kernels, eval, generate, inspect, report, export, data, teacher-cache (see --help)"
        )
    return COMMANDS[cmd](args)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `kdistill` script. Returns the process exit code.

    SIGTERM/SIGINT handlers are active from here to the return: outside the training loop a signal
    raises `signals.Interrupted` at a safe point, cleanup runs, and the user gets one line."""
    code = _main(argv)
    if argv is None and dist.joined():
        # a process of a torchrun job (the program, not main called in-process): see dist.leave
        dist.leave(code)
    return code


def _main(argv: Sequence[str] | None) -> int:
    debug = "--debug" in (sys.argv[1:] if argv is None else list(argv))
    try:
        with signals.installed():  # restored on return (main called in-process, e.g. by tests)
            return _parse_and_dispatch(argv) or 0
    except UserError as e:
        if debug:
            raise
        print(f"kdistill: error: {e}", file=sys.stderr)
        return e.exit_code
    except signals.Interrupted as e:
        # a signal during set-up or export: what it interrupted was removed (nothing half-written),
        # so it ends like any other run that could not complete: one line, exit 2
        if debug:
            raise
        print(f"kdistill: error: {e}", file=sys.stderr)
        return UserError.exit_code
    except KeyboardInterrupt:
        if debug:
            raise
        print("kdistill: interrupted", file=sys.stderr)
        return 130


def _parse_and_dispatch(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    # `kdistill run cfg.yaml --quiet a=b`: overrides after an option are still overrides.
    args, extra = parser.parse_known_args(argv)
    stray = [a for a in extra if a.startswith("-") or "=" not in a or not hasattr(args, "overrides")]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    return _dispatch(args)


if __name__ == "__main__":
    sys.exit(main())
