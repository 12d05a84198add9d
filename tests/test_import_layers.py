"""The package's import graph points one way: cli -> commands -> train / evaluate -> models -> dispatch
-> kernels -> ops, over a floor of foundation modules that everything may use.

The test parses every module under src/kdistill with `ast` (nothing is imported) and fails on
- a module-level import of a kdistill module in a higher layer than the importer's;
- a cycle among module-level imports;
- an import inside a function of anything but an optional dependency (OPTIONAL below): kdistill's
  own modules are imported at module level, so the graph above is the whole graph.
A planted upward import must make it fail (the last tests check the checker).
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "kdistill"

# Lowest first. A module may import its own layer and any lower one; the longest matching prefix
# names a module's layer. Same-layer imports are allowed when they form no cycle.
LAYERS: list[tuple[str, ...]] = [
    # foundation: leaves that every layer uses (errors, files, dtypes, console output, the run
    # config and the architecture spec read from config.json)
    (
        "errors",
        "fileio",
        "signals",
        "dtypes",
        "console",
        "jsonio",
        "rundir",
        "outputs",
        "config",
        "models.spec",
        "models.presets",
    ),
    ("ops",),
    ("kernels",),
    ("dispatch",),
    ("models",),
    ("data", "memory", "decode"),
    (
        "train",
        "scoring",
        "generate",
        "samples",
        "teacher_cache",
        "answer_file",
        "speculative",
        "acceptance",
    ),
    ("api", "demo", "commands"),
    ("cli", "__main__", "__init__"),
]

# Optional third-party dependencies: the only imports allowed inside functions, so that kdistill
# imports and runs (on its reference path) without them.
OPTIONAL = {
    "triton",
    "matplotlib",
    "transformers",
    "huggingface_hub",
    "tensorboard",
    "torch.utils.tensorboard",
    "wandb",
    "mlflow",
    "pyarrow",
    "jinja2",
    "peft",
    "gguf",
}


def module_name(path: Path) -> str:
    rel = path.relative_to(SRC).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


def layer_of(mod: str) -> int:
    best, best_len = None, -1
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (mod == p or mod.startswith(p + ".")) and len(p) > best_len:
                best, best_len = i, len(p)
    if best is None:
        raise AssertionError(f"kdistill.{mod} has no layer in tests/test_import_layers.py LAYERS")
    return best


def _resolve(mod: str, node: ast.ImportFrom, is_pkg: bool) -> str | None:
    """The absolute dotted name (without 'kdistill.') an ImportFrom points at, or None if external."""
    if node.level:
        base = mod.split(".") if is_pkg else mod.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
        target = ".".join([*base, node.module] if node.module else base)
        return target
    if node.module and (node.module == "kdistill" or node.module.startswith("kdistill.")):
        return node.module[len("kdistill.") :] if node.module != "kdistill" else ""
    return None


def imports_of(path: Path, source: str | None = None) -> tuple[set[str], list[str]]:
    """(kdistill modules imported at module level, problems with imports inside functions)."""
    mod = module_name(path)
    is_pkg = path.name == "__init__.py"
    tree = ast.parse(source if source is not None else path.read_text(), filename=str(path))
    top: set[str] = set()
    problems: list[str] = []
    known = all_modules()

    def targets(node: ast.AST) -> list[tuple[str, bool]]:
        """(name, is_kdistill) for each module an import statement names."""
        out: list[tuple[str, bool]] = []
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "kdistill" or a.name.startswith("kdistill."):
                    out.append((a.name[len("kdistill.") :] if a.name != "kdistill" else "", True))
                else:
                    out.append((a.name, False))
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(mod, node, is_pkg)
            if target is None:
                out.append((node.module or "", False))
            else:
                # `from kdistill.x import y` may name a submodule y
                for a in node.names:
                    sub = f"{target}.{a.name}" if target else a.name
                    out.append((sub if sub in known else target, True))
        return out

    def in_type_checking(node: ast.If) -> bool:
        t = node.test
        return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
            isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"
        )

    def visit(node: ast.AST, in_func: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and in_type_checking(child):
                continue
            if isinstance(child, ast.Import | ast.ImportFrom):
                for name, ours in targets(child):
                    if not in_func:
                        if ours and name:
                            top.add(name)
                    elif ours:
                        problems.append(
                            f"kdistill.{mod}:{child.lineno} imports kdistill.{name} inside a function"
                        )
                    elif name.split(".")[0] not in {o.split(".")[0] for o in OPTIONAL}:
                        problems.append(
                            f"kdistill.{mod}:{child.lineno} imports {name} inside a function "
                            "(only optional dependencies may be imported there)"
                        )
                continue
            visit(
                child,
                in_func or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda),
            )

    visit(tree, False)
    top.discard(mod)
    return top, problems


_ALL: set[str] | None = None


def all_modules() -> set[str]:
    global _ALL
    if _ALL is None:
        _ALL = {module_name(p) for p in SRC.rglob("*.py")}
    return _ALL


def check(sources: dict[Path, str] | None = None) -> list[str]:
    """Every violation in the tree (sources: replacement texts for some files, for the self-tests)."""
    sources = sources or {}
    graph: dict[str, set[str]] = {}
    problems: list[str] = []
    for path in sorted(SRC.rglob("*.py")):
        mod = module_name(path)
        deps, bad = imports_of(path, sources.get(path))
        problems += bad
        graph[mod] = deps
        mine = layer_of(mod)
        for dep in sorted(deps):
            if dep not in all_modules():
                # `from kdistill.pkg import name` of a package: the package's __init__
                if dep.rsplit(".", 1)[0] in all_modules():
                    dep = dep.rsplit(".", 1)[0]
                else:
                    continue
            if layer_of(dep) > mine:
                problems.append(
                    f"kdistill.{mod} (layer {mine}) imports kdistill.{dep} (layer {layer_of(dep)}): "
                    "imports must point down"
                )
    problems += _cycles(graph)
    return problems


def _cycles(graph: dict[str, set[str]]) -> list[str]:
    state: dict[str, int] = {}
    stack: list[str] = []
    found: list[str] = []

    def dfs(n: str) -> None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if m not in graph:
                continue
            if state.get(m) == 1:
                cyc = stack[stack.index(m) :] + [m]
                found.append("import cycle: " + " -> ".join(f"kdistill.{c}" for c in cyc))
            elif m not in state:
                dfs(m)
        stack.pop()
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            dfs(n)
    return found


def test_every_module_has_a_layer() -> None:
    for mod in sorted(all_modules()):
        layer_of(mod)


def test_imports_point_down_without_cycles() -> None:
    problems = check()
    assert not problems, "\n".join(problems)


def test_a_planted_upward_import_is_caught() -> None:
    ops = sorted((SRC / "ops").glob("*.py"))
    target = next(p for p in ops if p.name != "__init__.py")
    planted = target.read_text() + "\nfrom kdistill.cli import main  # noqa\n"
    problems = check({target: planted})
    assert any("imports kdistill.cli" in p and "point down" in p for p in problems), problems


def test_a_planted_cycle_and_a_function_import_are_caught() -> None:
    errors = SRC / "errors.py"
    fileio = SRC / "fileio.py"
    planted = {
        errors: errors.read_text() + "\nfrom kdistill import fileio  # noqa\n",
        fileio: fileio.read_text()
        + "\nfrom kdistill import errors  # noqa\n\ndef f():\n    import kdistill.config  # noqa\n",
    }
    problems = check(planted)
    assert any(p.startswith("import cycle") for p in problems), problems
    assert any("inside a function" in p for p in problems), problems
