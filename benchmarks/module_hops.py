"""Module hops of `kdistill generate`: how often following its call graph crosses between kdistill's modules.

    PYTHONPATH=src:. python3 benchmarks/module_hops.py            # a tiny chat model built on the fly, CPU
    PYTHONPATH=src:. python3 benchmarks/module_hops.py --modules generate,answer_file,data.chat_template
    PYTHONPATH=OTHER/src:. python3 benchmarks/module_hops.py   # another tree's code (e.g. `git archive`)

Runs `kdistill generate` in this process under sys.setprofile, on the CPU, three times: printing answers
(`--prompt ... --chat`), writing an answer file (`--messages FILE --out FILE`) and speculative decoding
(`--draft`, the model drafting for itself). Every Python call whose
code lives under src/kdistill is attributed to its module; a call from one module into another is a
hop (an edge caller -> callee), and a call into a module that is already on the stack below the caller
(A -> B -> A: the reader following the code goes back up into a file they had left) is a bounce. The
counts are of distinct edges (a loop calling the same function a thousand times is one edge), over the
modules named by --modules (default: the command's own files, the job's preparation and the engine;
the decoder, kernels and dispatch below them are left out: they are the same for every caller).
`file switches`: the functions in the order they are first called (the order a reader following the
command meets them), and how often the next one is in another file than the one before.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

DEFAULT = (
    "cli,commands.generate,generate,answer_file,data.chat_template,data.chat,decode,speculative,"
    "models.tokenizer,models.spec,models.hf_io,kernels.seal,kernels.pack,outputs"
)


def module_of(filename: str, root: Path) -> str | None:
    try:
        rel = Path(filename).resolve().relative_to(root)
    except ValueError:
        return None
    parts = list(rel.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def trace(argv: list[str], keep: set[str], root: Path) -> tuple[set, set, list[str]]:
    """(hop edges, bounce edges, the module of each function in the order first called) of one
    `kdistill` command line run in this process."""
    from kdistill.cli import main

    stack: list[str | None] = []
    hops: set[tuple[str, str]] = set()
    bounces: set[tuple[str, str]] = set()
    seen: set[object] = set()
    order: list[str] = []

    def prof(frame, event, _arg):
        if event == "call":
            mod = module_of(frame.f_code.co_filename, root)
            mod = mod if mod in keep else None
            if mod is not None and frame.f_code not in seen:
                seen.add(frame.f_code)
                order.append(mod)
            caller = next((m for m in reversed(stack) if m is not None), None)
            if mod is not None and caller is not None and mod != caller:
                hops.add((caller, mod))
                below = [m for m in stack if m is not None]
                if mod in below[:-1]:
                    bounces.add((caller, mod))
            stack.append(mod)
        elif event == "return" and stack:
            stack.pop()

    sys.setprofile(prof)
    try:
        rc = main(argv)
    finally:
        sys.setprofile(None)
    if rc != 0:
        raise SystemExit(f"kdistill {' '.join(argv)} exited {rc}")
    return hops, bounces, order


def tiny_chat_model(folder: Path) -> Path:
    from tests.tiny import make_tiny_model

    d = make_tiny_model(folder, family="qwen2")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}<|endoftext|>\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a model directory with a chat template (default: a tiny one)")
    ap.add_argument("--modules", default=DEFAULT, help="the modules counted, relative to kdistill")
    ap.add_argument("--edges", action="store_true", help="print every edge")
    args = ap.parse_args()
    import kdistill

    root = Path(kdistill.__file__).resolve().parent
    keep = set(args.modules.split(","))
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = Path(args.model) if args.model else tiny_chat_model(tmp / "model")
        msgs = tmp / "p.jsonl"
        msgs.write_text("\n".join(json.dumps([{"role": "user", "content": w}]) for w in ("hi", "the fox")))
        common = ["generate", "--model", str(model), "--device", "cpu", "--max-new-tokens", "4", "--quiet"]
        runs = {
            "print": [*common, "--prompt", "hello", "--chat"],
            "out": [*common, "--messages", str(msgs), "--out", str(tmp / "a.jsonl")],
            "draft": [*common, "--prompt", "hello", "--chat", "--draft", str(model)],
        }
        for name, argv in runs.items():
            hops, bounces, order = trace(argv, keep, root)
            mods = {m for e in hops for m in e}
            switches = sum(a != b for a, b in zip(order, order[1:]))
            print(
                f"{name}: {len(mods)} modules, {len(hops)} hop edges, {len(bounces)} bounce edges, "
                f"{switches} file switches over {len(order)} functions"
            )
            if args.edges:
                for a, b in sorted(hops):
                    print(f"  {a} -> {b}{'   (bounce)' if (a, b) in bounces else ''}")


if __name__ == "__main__":
    main()
