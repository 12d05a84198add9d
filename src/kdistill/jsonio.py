"""The one way in for every JSON, JSONL and YAML file kdistill reads, and typed access to their fields.

    cfg = read_json(path, what="a Hugging Face config.json")            # size and depth limits
    f = Fields(cfg, where=str(path))
    heads = f.int("num_attention_heads", min=1)
    theta = f.float("rope_theta", min_exclusive=0)                    # finite unless finite=False
    rope = f.optional("rope_scaling", "obj")                           # a Fields or None
    data = read_yaml(run_yaml)                                         # duplicate keys refused,
                                                                       # alias expansion bounded
    for lineno, row in iter_jsonl(path): ...                           # one JSON value per line

Every failure is a one-line `UserError` that names the file, the field (dotted path) or the line, and
what was expected; a value echoed in a message is cut by `short_repr` (a huge or self-referencing value
never becomes a huge message). No RecursionError, MemoryError-by-design or decoder exception escapes.
"""

from __future__ import annotations

import datetime
import json
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from kdistill.errors import UserError

MiB = 1 << 20
MAX_JSON_BYTES = 64 * MiB  # config.json, tokenizer.json (large vocabularies), shard indexes, state
MAX_YAML_BYTES = 1 * MiB  # run configs are a few hundred bytes
MAX_LINE_BYTES = 16 * MiB  # one JSONL line
MAX_DEPTH = 64  # nesting of objects and arrays; HF configs nest 3 deep, tokenizer.json about 6
MAX_YAML_NODES = 100_000  # nodes after alias expansion

# The largest seed every consumer accepts: numpy's legacy RandomState takes 0 <= seed < 2**32.
SEED_LIMIT = 2**32


# ----------------------------------------------------------------------------------------------
# Short reprs for messages


class _Full(Exception):
    pass


def short_repr(value: Any, limit: int = 60) -> str:
    """`repr(value)` cut to at most `limit` characters, computed without building the whole repr.

    A multi-gigabyte string, a 10**6-digit int or a structure shared a billion times through YAML aliases
    costs a few microseconds here.
    """
    out: list[str] = []
    budget = [limit + 1]

    def emit(s: str) -> None:
        out.append(s)
        budget[0] -= len(s)
        if budget[0] <= 0:
            raise _Full

    def walk(v: Any, depth: int) -> None:
        if depth > 8:
            emit("...")
        elif isinstance(v, str):
            emit(repr(v[: limit + 1]))
        elif isinstance(v, bytes | bytearray):
            emit(repr(bytes(v[: limit + 1])))
        elif isinstance(v, bool) or v is None:
            emit(repr(v))
        elif isinstance(v, int):
            emit(repr(v) if v.bit_length() <= 256 else f"<int of {v.bit_length()} bits>")
        elif isinstance(v, float):
            emit(repr(v))
        elif isinstance(v, dict):
            emit("{")
            for i, (k, x) in enumerate(v.items()):
                if i:
                    emit(", ")
                walk(k, depth + 1)
                emit(": ")
                walk(x, depth + 1)
            emit("}")
        elif isinstance(v, list | tuple | set | frozenset):
            emit("[" if isinstance(v, list) else "(" if isinstance(v, tuple) else "{")
            for i, x in enumerate(v):
                if i:
                    emit(", ")
                walk(x, depth + 1)
            emit("]" if isinstance(v, list) else ")" if isinstance(v, tuple) else "}")
        else:
            try:
                emit(repr(v)[: limit + 1])
            except Exception:
                emit(f"<{type(v).__name__}>")

    try:
        walk(value, 0)
    except _Full:
        pass
    text = "".join(out)
    return text if len(text) <= limit else text[: max(limit - 3, 0)] + "..."


def cut(text: str, limit: int = 100) -> str:
    """Plain text (an exception's message) on one line, at most `limit` characters."""
    text = " ".join(str(text)[: limit * 4].split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def type_name(value: Any) -> str:
    """The JSON/YAML word for a Python value's type: 'a string', 'an object', 'null', ..."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list | tuple):
        return "a list"
    return f"a {type(value).__name__}"


# ----------------------------------------------------------------------------------------------
# Reading bytes with a size limit


def _size_text(n: int) -> str:
    return f"{n // MiB} MiB" if n % MiB == 0 else f"{n} bytes"


def read_bytes_limited(path: Path | str, *, max_bytes: int, what: str = "a file") -> bytes:
    """The bytes of `path`, at most `max_bytes` (never more read into memory), as one-line errors."""
    p = Path(path)
    try:
        with open(p, "rb") as f:
            data = f.read(max_bytes + 1)
    except FileNotFoundError:
        raise UserError(f"{p}: no such file (expected {what})") from None
    except IsADirectoryError:
        raise UserError(f"{p}: is a directory (expected {what})") from None
    except OSError as e:
        raise UserError(f"{p}: cannot read ({e.strerror or e.__class__.__name__})") from None
    if len(data) > max_bytes:
        raise UserError(f"{p}: larger than {_size_text(max_bytes)} (expected {what})")
    return data


def _decode_utf8(data: bytes, where: str) -> str:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{where}: not UTF-8 (invalid byte at offset {e.start})") from None
    return text[1:] if text.startswith("\ufeff") else text


# ----------------------------------------------------------------------------------------------
# JSON


def _check_depth(obj: Any, max_depth: int) -> int | None:
    """The nesting depth of a parsed value if it exceeds `max_depth`, else None (iterative)."""
    stack: list[tuple[Any, int]] = [(obj, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict):
            if d > max_depth:
                return d
            stack.extend((x, d + 1) for x in v.values())
        elif isinstance(v, list):
            if d > max_depth:
                return d
            stack.extend((x, d + 1) for x in v)
    return None


def parse_json(text: str | bytes, *, where: str, max_depth: int = MAX_DEPTH, line: int | None = None) -> Any:
    """Parse JSON text; errors name `where` (and `line` for JSONL). NaN/Infinity literals parse to floats
    (Python's own json writes them); `Fields.float` refuses them where a finite number is asked."""
    at = f"{where} line {line}" if line is not None else where
    if isinstance(text, bytes):
        text = _decode_utf8(text, at)
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        pos = f"line {e.lineno}, column {e.colno}" if line is None else f"column {e.colno}"
        raise UserError(f"{at}: not valid JSON ({e.msg} at {pos})") from None
    except RecursionError:
        raise UserError(f"{at}: not valid JSON (nested too deeply)") from None
    except (ValueError, OverflowError) as e:  # e.g. an integer of more than 4300 digits
        raise UserError(f"{at}: not valid JSON ({cut(str(e))})") from None
    deep = _check_depth(obj, max_depth)
    if deep is not None:
        raise UserError(f"{at}: nested too deeply (more than {max_depth} levels of objects and lists)")
    return obj


def read_json(
    path: Path | str,
    *,
    max_bytes: int = MAX_JSON_BYTES,
    max_depth: int = MAX_DEPTH,
    what: str = "a JSON file",
    expect_object: bool = True,
) -> Any:
    """Read and parse a JSON file with size and depth limits; by default the top level must be an object."""
    p = Path(path)
    obj = parse_json(read_bytes_limited(p, max_bytes=max_bytes, what=what), where=str(p), max_depth=max_depth)
    if expect_object and not isinstance(obj, dict):
        raise UserError(f"{p}: expected a JSON object at the top level, got {type_name(obj)} ({what})")
    return obj


def iter_jsonl(
    path: Path | str,
    *,
    max_line_bytes: int = MAX_LINE_BYTES,
    max_depth: int = MAX_DEPTH,
    skip_torn_tail: bool = False,
) -> Iterator[tuple[int, Any]]:
    """(line number, value) for each non-blank line of a JSONL file, never more than one line in memory.

    skip_torn_tail: a last line without its newline that does not parse is skipped instead of refused
    (a metrics file whose writer was killed mid-line).
    """
    p = Path(path)
    try:
        f = open(p, "rb")
    except FileNotFoundError:
        raise UserError(f"{p}: no such file (expected a JSONL file)") from None
    except OSError as e:
        raise UserError(f"{p}: cannot read ({e.strerror or e.__class__.__name__})") from None
    with f:
        lineno = 0
        while True:
            try:
                raw = f.readline(max_line_bytes + 1)
            except OSError as e:
                raise UserError(f"{p}: cannot read ({e.strerror or e.__class__.__name__})") from None
            if not raw:
                return
            lineno += 1
            if len(raw) > max_line_bytes and not raw.endswith(b"\n"):
                raise UserError(
                    f"{p} line {lineno}: longer than {_size_text(max_line_bytes)}, "
                    "expected one JSON value per line"
                )
            if not raw.strip():
                continue
            try:
                yield lineno, parse_json(raw, where=str(p), max_depth=max_depth, line=lineno)
            except UserError:
                if skip_torn_tail and not raw.endswith(b"\n") and not f.read(1):
                    return
                raise


# ----------------------------------------------------------------------------------------------
# YAML


class YamlWord(str):
    """A plain (unquoted) YAML 1.1 boolean word other than true/false: yes, no, on, off (in any of their
    YAML spellings). It is a string, so a field whose values are words keeps what was written
    (`runtime.cuda_graphs: off` is 'off', never 'False'); `plain_value` gives it its YAML 1.1 truth where
    no field type says otherwise (free-form values such as template variables)."""

    @property
    def truth(self) -> bool:
        return self.lower() in ("yes", "on")


_BOOL_TAG = "tag:yaml.org,2002:bool"
_WORD_TAG = "tag:kdistill,2024:word"


def plain_value(value: Any) -> Any:
    """A parsed YAML value in plain types: a `YamlWord` becomes its boolean (as a mapping key, its text),
    a date or datetime its ISO text (what a template would print for it); lists and mappings are walked.
    Other values are returned as they are (the writable-type check refuses what JSON or YAML cannot
    hold)."""
    if isinstance(value, YamlWord):
        return value.truth
    if isinstance(value, datetime.date):  # datetime.datetime is a date too
        return value.isoformat()
    if isinstance(value, list):
        return [plain_value(v) for v in value]
    if isinstance(value, dict):
        return {
            (str(k) if isinstance(k, YamlWord) else plain_value(k)): plain_value(v) for k, v in value.items()
        }
    return value


class _Loader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys and bounds the size of the value after alias expansion.

    Booleans are true and false only (in their YAML spellings); yes, no, on and off are `YamlWord`s, so a
    documented word value is never read as a boolean."""

    max_nodes = MAX_YAML_NODES
    max_depth = MAX_DEPTH
    where = "<yaml>"

    composed = 0  # nodes composed so far (aliases not counted): a lower bound of the expanded size

    def compose_node(self, parent: Any, index: Any) -> Any:  # type: ignore[override]
        """Count each new node and stop at the limit: a huge document is refused as soon as it has more
        than max_nodes values, not after all of it has been scanned and composed."""
        if not self.check_event(yaml.AliasEvent):
            self.composed += 1
            if self.composed > self.max_nodes:
                line = self.peek_event().start_mark.line + 1
                raise UserError(
                    f"{self.where}: line {line}: more than {self.max_nodes} values (a run config or record "
                    "holds far fewer)"
                )
        return super().compose_node(parent, index)

    def compose_document(self) -> Any:  # type: ignore[override]
        node = super().compose_document()
        _check_graph(node, self.where, self.max_nodes, self.max_depth)
        return node

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:  # type: ignore[override]
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    hash(key)
                except TypeError:
                    raise UserError(
                        f"{self.where}: line {key_node.start_mark.line + 1}: a mapping key is "
                        f"{type_name(key)}, expected a string"
                    ) from None
                line = key_node.start_mark.line + 1
                if key in seen:
                    raise UserError(
                        f"{self.where}: line {line}: duplicate key {short_repr(key)} "
                        f"(first given on line {seen[key]}); give each key once"
                    )
                seen[key] = line
        return super().construct_mapping(node, deep=deep)


_Loader.add_constructor("tag:yaml.org,2002:map", _Loader.construct_yaml_map)
# The resolver lists are copied: add_implicit_resolver would append to SafeLoader's own.
_Loader.yaml_implicit_resolvers = {
    ch: [(tag, rx) for tag, rx in resolvers if tag != _BOOL_TAG]
    for ch, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(_BOOL_TAG, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
_Loader.add_implicit_resolver(
    _WORD_TAG, re.compile(r"^(?:yes|Yes|YES|no|No|NO|on|On|ON|off|Off|OFF)$"), list("yYnNoO")
)
_Loader.add_constructor(_WORD_TAG, lambda loader, node: YamlWord(loader.construct_scalar(node)))


def _check_graph(root: Any, where: str, max_nodes: int, max_depth: int) -> None:
    """Refuse a composed YAML node graph whose expanded size or depth is over the limits, or that
    refers to itself; iterative, and linear in the number of distinct nodes (aliases share nodes)."""
    if root is None:
        return
    size: dict[int, int] = {}
    depth: dict[int, int] = {}
    on_stack: set[int] = set()
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        key = id(node)
        if isinstance(node, yaml.MappingNode):
            children = [c for kv in node.value for c in kv]
        elif isinstance(node, yaml.SequenceNode):
            children = list(node.value)
        else:
            children = []
        if done:
            on_stack.discard(key)
            size[key] = min(1 + sum(size[id(c)] for c in children), max_nodes + 1)
            depth[key] = 1 + max((depth[id(c)] for c in children), default=0)
            if size[key] > max_nodes:
                raise UserError(
                    f"{where}: line {node.start_mark.line + 1}: more than {max_nodes} values after "
                    "expanding aliases (anchors '&' and aliases '*' that multiply a value); "
                    "write the config out plainly"
                )
            if depth[key] > max_depth:
                raise UserError(f"{where}: nested too deeply (more than {max_depth} levels)")
            continue
        if key in size:
            continue
        if key in on_stack:
            raise UserError(
                f"{where}: line {node.start_mark.line + 1}: a value contains itself through an alias"
            )
        on_stack.add(key)
        stack.append((node, True))
        if len(on_stack) > max_depth + 1:
            raise UserError(f"{where}: nested too deeply (more than {max_depth} levels)")
        stack.extend((c, False) for c in children if id(c) not in size)


def _flow_depth(text: str, limit: int) -> int:
    """An upper bound on the flow-collection nesting ('[' and '{') of YAML text, outside quotes and
    comments, stopping once past `limit`: PyYAML's scanner is quadratic in that depth, so a few KB of
    '[' would take seconds before any error."""
    if text.count("[") + text.count("{") <= limit:
        return 0  # the common case: too few brackets to matter
    depth = top = 0
    quote = ""
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if quote:
            if c == "\\" and quote == '"':
                i += 1
            elif c == quote:
                if quote == "'" and i + 1 < n and text[i + 1] == "'":
                    i += 1
                else:
                    quote = ""
        elif c in "\"'" and (i == 0 or text[i - 1] in " \t\n[{,:-?"):
            quote = c
        elif c == "#" and (i == 0 or text[i - 1] in " \t\n"):
            j = text.find("\n", i)
            i = n if j < 0 else j
            continue
        elif c in "[{":
            depth += 1
            if depth > top:
                top = depth
                if top > limit:
                    return top
        elif c in "]}":
            depth = max(depth - 1, 0)
        i += 1
    return top


# What the YAML constructors raise besides YAMLError: bad dates (ValueError), a bare '!!float' tag
# (IndexError), a huge '!!int' (ValueError), and RecursionError from the composer on deep nesting.
_YAML_FAILURES = (ValueError, IndexError, TypeError, OverflowError, KeyError, AttributeError)


def parse_yaml(
    text: str | bytes,
    *,
    where: str = "<yaml>",
    max_nodes: int = MAX_YAML_NODES,
    max_depth: int = MAX_DEPTH,
) -> Any:
    """Parse one YAML document safely: duplicate keys refused, aliases bounded, one-line errors."""
    if isinstance(text, bytes):
        text = _decode_utf8(text, where)
    loader_cls = type("Loader", (_Loader,), {"where": where, "max_nodes": max_nodes, "max_depth": max_depth})
    if _flow_depth(text, max_depth) > max_depth:
        raise UserError(f"{where}: nested too deeply (more than {max_depth} levels)")
    loader = None
    try:
        loader = loader_cls(text)  # the reader checks characters here (a NUL is a ReaderError)
        return loader.get_single_data()
    except UserError:
        raise
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        line = f"line {mark.line + 1}: " if mark is not None else ""
        problem = e.problem or e.context or "syntax error"
        raise UserError(f"{where}: {line}not valid YAML ({cut(problem)})") from None
    except yaml.YAMLError as e:
        raise UserError(f"{where}: not valid YAML ({cut(str(e))})") from None
    except RecursionError:
        raise UserError(f"{where}: nested too deeply (more than {max_depth} levels)") from None
    except _YAML_FAILURES as e:
        msg = cut(str(e))
        raise UserError(f"{where}: not valid YAML ({e.__class__.__name__}: {msg})") from None
    finally:
        if loader is not None:
            loader.dispose()


def read_yaml(
    path: Path | str,
    *,
    max_bytes: int = MAX_YAML_BYTES,
    max_nodes: int = MAX_YAML_NODES,
    max_depth: int = MAX_DEPTH,
    what: str = "a YAML file",
) -> Any:
    """Read and parse a YAML file (see `parse_yaml`) with a size limit."""
    p = Path(path)
    data = read_bytes_limited(p, max_bytes=max_bytes, what=what)
    return parse_yaml(data, where=str(p), max_nodes=max_nodes, max_depth=max_depth)


# ----------------------------------------------------------------------------------------------
# Typed field access

_MISSING: Any = object()


def _range_text(
    min: float | None, max: float | None, min_exclusive: float | None, max_exclusive: float | None
) -> str:
    parts = []
    if min is not None:
        parts.append(f">= {min}")
    if min_exclusive is not None:
        parts.append(f"> {min_exclusive}")
    if max is not None:
        parts.append(f"<= {max}")
    if max_exclusive is not None:
        parts.append(f"< {max_exclusive}")
    return " and ".join(parts)


def _in_range(
    v: float,
    min: float | None,
    max: float | None,
    min_exclusive: float | None,
    max_exclusive: float | None,
) -> bool:
    return not (
        (min is not None and v < min)
        or (max is not None and v > max)
        or (min_exclusive is not None and v <= min_exclusive)
        or (max_exclusive is not None and v >= max_exclusive)
    )


def check_int(
    name: str,
    value: Any,
    *,
    min: int | None = None,
    max: int | None = None,
    max_exclusive: int | None = None,
    prefix: str = "",
) -> int:
    """`value` as an int in range, else a UserError '<prefix><name> is <v>, expected an integer ...'.
    Booleans are not integers here; an integral float (2.0) is accepted."""
    rng = _range_text(min, max, None, max_exclusive)
    expected = "an integer" + (f" {rng}" if rng else "")
    v = value
    if isinstance(v, float) and math.isfinite(v) and v.is_integer() and abs(v) < 2**63:
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise UserError(f"{prefix}{name} is {short_repr(value)} ({type_name(value)}), expected {expected}")
    if not _in_range(v, min, max, None, max_exclusive):
        raise UserError(f"{prefix}{name} is {short_repr(value)}, expected {expected}")
    return v


def finite_float(
    name: str,
    value: Any,
    *,
    min: float | None = None,
    max: float | None = None,
    min_exclusive: float | None = None,
    max_exclusive: float | None = None,
    finite: bool = True,
    prefix: str = "",
) -> float:
    """`value` as a float (ints accepted, booleans not), finite unless finite=False, in range.

    finite_float("optim.lr", cfg.optim.lr, min_exclusive=0)   # 'optim.lr is inf, expected a finite
                                                               #  number > 0'
    """
    rng = _range_text(min, max, min_exclusive, max_exclusive)
    expected = ("a finite number" if finite else "a number") + (f" {rng}" if rng else "")
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise UserError(f"{prefix}{name} is {short_repr(value)} ({type_name(value)}), expected {expected}")
    try:
        v = float(value)
    except OverflowError:
        raise UserError(f"{prefix}{name} is {short_repr(value)}, expected {expected}") from None
    if (
        (finite and not math.isfinite(v))
        or math.isnan(v)
        or not _in_range(v, min, max, min_exclusive, max_exclusive)
    ):
        raise UserError(f"{prefix}{name} is {short_repr(value)}, expected {expected}")
    return v


def check_seed(name: str, value: Any, *, prefix: str = "") -> int:
    """A seed every RNG we feed accepts: an integer with 0 <= seed < 2**32."""
    return check_int(name, value, min=0, max_exclusive=SEED_LIMIT, prefix=prefix)


def check_str(
    name: str,
    value: Any,
    *,
    choices: tuple[str, ...] | list[str] | None = None,
    nonempty: bool = False,
    max_len: int | None = 4096,
    prefix: str = "",
) -> str:
    """`value` as a string (optionally one of `choices`, non-blank, at most max_len characters)."""
    if not isinstance(value, str):
        what = f"one of: {', '.join(choices)}" if choices else "a string"
        raise UserError(f"{prefix}{name} is {short_repr(value)} ({type_name(value)}), expected {what}")
    if choices is not None and value not in choices:
        raise UserError(f"{prefix}{name} is {short_repr(value)}, expected one of: {', '.join(choices)}")
    if nonempty and not value.strip():
        raise UserError(f"{prefix}{name} is {short_repr(value)}, expected a non-empty string")
    if max_len is not None and len(value) > max_len:
        raise UserError(f"{prefix}{name} is a string of {len(value)} characters, expected at most {max_len}")
    return value


def check_bool(name: str, value: Any, *, prefix: str = "") -> bool:
    if not isinstance(value, bool):
        raise UserError(f"{prefix}{name} is {short_repr(value)} ({type_name(value)}), expected true or false")
    return value


class Fields:
    """Typed, range-checked access to a parsed JSON/YAML object; errors name `where` and the dotted path.

    f = Fields(cfg, where="<dir>/config.json")
    f.int("num_attention_heads", min=1)           # '<dir>/config.json: num_attention_heads is '8'
                                                  #  (a string), expected an integer >= 1'
    f.obj("rope_scaling").float("factor", min_exclusive=0)   # path 'rope_scaling.factor'
    f.optional("head_dim", "int", min=1)          # None when absent or null
    """

    def __init__(self, obj: Any, where: str, path: str = "") -> None:
        self.where = where
        self.path = path
        if not isinstance(obj, dict):
            what = f"{path} is {type_name(obj)}" if path else f"the top level is {type_name(obj)}"
            raise UserError(f"{where}: {what}, expected an object")
        self.data: dict[Any, Any] = obj

    # -- plumbing
    def _name(self, key: str | int) -> str:
        if isinstance(key, int):
            return f"{self.path}[{key}]"
        return f"{self.path}.{key}" if self.path else str(key)

    @property
    def _prefix(self) -> str:
        return f"{self.where}: "

    def has(self, key: str) -> bool:
        return key in self.data

    def keys(self) -> list[str]:
        return [k for k in self.data if isinstance(k, str)]

    def unknown(self, allowed: tuple[str, ...] | list[str] | set[str]) -> list[str]:
        """Keys present but not in `allowed` (dotted), for an 'unknown key' error of the caller's choice."""
        return [self._name(k) if isinstance(k, str) else short_repr(k) for k in self.data if k not in allowed]

    def raw(self, key: str, default: Any = _MISSING) -> Any:
        if key not in self.data:
            if default is _MISSING:
                raise UserError(f"{self.where}: missing field {self._name(key)}")
            return default
        return self.data[key]

    def _get(self, key: str, default: Any, expected: str) -> Any:
        if key not in self.data:
            if default is _MISSING:
                raise UserError(f"{self.where}: missing field {self._name(key)} (expected {expected})")
            return default
        return self.data[key]

    # -- typed getters
    def int(
        self,
        key: str,
        *,
        default: Any = _MISSING,
        min: int | None = None,
        max: int | None = None,
        max_exclusive: int | None = None,
    ) -> Any:
        v = self._get(key, default, "an integer")
        if key not in self.data:
            return v
        return check_int(
            self._name(key), v, min=min, max=max, max_exclusive=max_exclusive, prefix=self._prefix
        )

    def float(
        self,
        key: str,
        *,
        default: Any = _MISSING,
        finite: bool = True,
        min: float | None = None,
        max: float | None = None,
        min_exclusive: float | None = None,
        max_exclusive: float | None = None,
    ) -> Any:
        v = self._get(key, default, "a number")
        if key not in self.data:
            return v
        return finite_float(
            self._name(key),
            v,
            min=min,
            max=max,
            min_exclusive=min_exclusive,
            max_exclusive=max_exclusive,
            finite=finite,
            prefix=self._prefix,
        )

    def str(
        self,
        key: str,
        *,
        default: Any = _MISSING,
        choices: tuple[str, ...] | list[str] | None = None,
        nonempty: bool = False,
        max_len: int | None = 4096,
    ) -> Any:
        v = self._get(key, default, "a string")
        if key not in self.data:
            return v
        return check_str(
            self._name(key), v, choices=choices, nonempty=nonempty, max_len=max_len, prefix=self._prefix
        )

    def bool(self, key: str, *, default: Any = _MISSING) -> Any:
        v = self._get(key, default, "true or false")
        if key not in self.data:
            return v
        return check_bool(self._name(key), v, prefix=self._prefix)

    def obj(self, key: str, *, default: Any = _MISSING) -> Any:
        v = self._get(key, default, "an object")
        if key not in self.data:
            return v
        return Fields(v, self.where, self._name(key))

    def list(
        self,
        key: str,
        *,
        default: Any = _MISSING,
        item: str | None = None,
        min_len: int = 0,
        max_len: int | None = None,
        **item_kw: Any,
    ) -> Any:
        """A list; with `item` ('int', 'float', 'str', 'bool', 'obj') every element is checked as that
        kind with `item_kw` (e.g. item='int', min=0), and errors name 'key[i]'."""
        v = self._get(key, default, "a list")
        if key not in self.data:
            return v
        name = self._name(key)
        if not isinstance(v, list):
            raise UserError(f"{self.where}: {name} is {short_repr(v)} ({type_name(v)}), expected a list")
        if len(v) < min_len or (max_len is not None and len(v) > max_len):
            bound = f"{min_len} to {max_len}" if max_len is not None else f"at least {min_len}"
            raise UserError(f"{self.where}: {name} has {len(v)} items, expected {bound}")
        if item is None:
            return v
        inner = Fields({i: x for i, x in enumerate(v)}, self.where, name)
        return [inner._kind(item, i, **item_kw) for i in range(len(v))]

    def optional(self, key: str, kind: str, **kw: Any) -> Any:
        """`kind` ('int', 'float', 'str', 'bool', 'list', 'obj') of `key`, or None when absent or null."""
        if self.data.get(key) is None:
            return None
        return self._kind(kind, key, **kw)

    def _kind(self, kind: str, key: Any, **kw: Any) -> Any:
        getter = {
            "int": self.int,
            "float": self.float,
            "str": self.str,
            "bool": self.bool,
            "list": self.list,
            "obj": self.obj,
        }.get(kind)
        if getter is None:
            raise ValueError(f"unknown field kind {kind!r}")
        return getter(key, **kw)
