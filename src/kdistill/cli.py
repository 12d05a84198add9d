"""The kdistill command line.

    kdistill run [CONFIG.yaml] [key=value ...]      distil (no arguments: the embedded demo)
    kdistill plan CONFIG [key=value ...]            parameters, FLOPs, memory estimate
    kdistill prewarm CONFIG [key=value ...]         compile every kernel the run needs, then stop
    kdistill kernels build --arch sm_80,... CONFIG  cross-compile the kernel plan without a GPU
    kdistill eval --model DIR --data FILE           held-out cross-entropy and perplexity
    kdistill inspect DIR                            architecture, sizes, tokenizer identity
    kdistill report RUN_DIR                         summary of a finished or interrupted run

Errors a user can cause print one line and exit 2; `--debug` shows the traceback. This module is the
argument parser and the command table; each command lives in kdistill.commands.
"""

from __future__ import annotations

import argparse
import os
import sys
import typing
from collections.abc import Callable, Sequence

from kdistill import __version__, signals
from kdistill.commands.eval import eval_command
from kdistill.commands.inspect import inspect_command
from kdistill.commands.kernels import build_command, prewarm_command
from kdistill.commands.plan import plan_command
from kdistill.commands.report import report_command
from kdistill.commands.run import run_command
from kdistill.errors import UserError
from kdistill.kernels.keys import ARCHS


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


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kdistill", description="Logit knowledge distillation of causal LMs.")
    parser.add_argument("--version", action="version", version=f"kdistill {__version__}")
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
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")

    p = sub.add_parser("prewarm", help="compile every kernel of the run's plan, then stop")
    _add_config_args(p)

    p = sub.add_parser("kernels", help="kernel tools")
    ksub = p.add_subparsers(dest="kernels_command", metavar="SUBCOMMAND")
    b = ksub.add_parser("build", help="compile the kernel plan for GPU archs without a GPU")
    b.add_argument(
        "--arch",
        default=",".join(ARCHS),
        help="comma-separated archs (default: %(default)s)",
    )
    b.add_argument("--json", action="store_true", help="print JSON")
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

    p = sub.add_parser("inspect", help="architecture, parameter counts, dtype, vocab and tokenizer identity")
    p.add_argument("model", metavar="DIR", help="Hugging Face model directory (or a preset name)")
    p.add_argument("--json", action="store_true", help="print JSON")

    p = sub.add_parser("report", help="readable summary of a finished or interrupted run")
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("--json", action="store_true", help="print JSON")
    return parser


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "run": run_command,
    "plan": plan_command,
    "prewarm": prewarm_command,
    "kernels": build_command,  # its one subcommand, checked in _dispatch
    "eval": eval_command,
    "inspect": inspect_command,
    "report": report_command,
}


def _dispatch(args: argparse.Namespace) -> int:
    if args.log_kernels:
        os.environ["KDISTILL_LOG_KERNELS"] = "1"
    cmd = args.command
    if cmd == "kernels" and args.kernels_command != "build":
        raise UserError("kernels: expected a subcommand: build")
    if cmd not in COMMANDS:
        raise UserError("expected a command: run, plan, prewarm, kernels, eval, inspect, report (see --help)")
    return COMMANDS[cmd](args)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `kdistill` script. Returns the process exit code.

    SIGTERM/SIGINT handlers are active from here to the return: outside the training loop a signal
    raises `signals.Interrupted` at a safe point, cleanup runs, and the user gets one line."""
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
        if debug:
            raise
        print(f"kdistill: {e}", file=sys.stderr)
        return e.exit_code
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
