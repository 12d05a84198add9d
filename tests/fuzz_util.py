"""Deterministic mutations of a valid JSON or YAML document, for tests that assert only kdistill's
UserError escapes a reader.

    for label, text in json_mutants(doc, seed=0): ...    # (what was mutated, the mutant's text)
    for label, text in yaml_mutants(doc, seed=0): ...

Mutations: every field's value swapped for each other JSON type and for edge values (NaN, +-inf, 0,
negative, huge ints and floats, huge strings, deep nesting), fields removed, truncation of the text at
many points, deep nesting of the whole document, duplicate keys, byte flips; YAML adds alias bombs,
self-referencing anchors, tags and tabs. The same seed gives the same mutants.

The config and data hypothesis properties (tests/test_fuzz_config.py, tests/test_fuzz_data.py) take their
example count from `fuzz_examples`: a CI default that still finds the bugs they were written for, and the
long run on demand, e.g.
`KDISTILL_FUZZ_EXAMPLES=10000 pytest tests/test_fuzz_config.py tests/test_fuzz_data.py`.
"""

from __future__ import annotations

import copy
import json
import os
import random
from collections.abc import Iterator
from typing import Any

import yaml

_Dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)  # the writer's speed only; parsing is ours


def fuzz_examples(default: int) -> int:
    """Examples per hypothesis property: KDISTILL_FUZZ_EXAMPLES when set (a positive integer), else
    `default`. The properties are derandomized, so a count gives the same inputs on every run."""
    raw = os.environ.get("KDISTILL_FUZZ_EXAMPLES", "").strip()
    if not raw:
        return default
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"KDISTILL_FUZZ_EXAMPLES is {raw!r}, expected a positive integer")
    return int(raw)


HUGE_STR = "x" * 200_000
DEEP = 2_000

EDGE_VALUES: list[tuple[str, Any]] = [
    ("null", None),
    ("true", True),
    ("false", False),
    ("zero", 0),
    ("neg", -1),
    ("big_int", 2**64),
    ("huge_int", 10**200),
    ("float", 0.5),
    ("neg_float", -1e-9),
    ("nan", float("nan")),
    ("inf", float("inf")),
    ("-inf", float("-inf")),
    ("huge_float", 1e308),
    ("empty_str", ""),
    ("str", "abc"),
    ("num_str", "8"),
    ("huge_str", HUGE_STR),
    ("empty_list", []),
    ("list", [1, "a", None]),
    ("empty_obj", {}),
    ("obj", {"a": 1}),
    ("nested", [[[[[[[[[[1]]]]]]]]]]),
]


def _paths(doc: Any, prefix: tuple = ()) -> Iterator[tuple]:
    """Every path (tuple of keys and indexes) to a value in doc, parents before children."""
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield (*prefix, k)
            yield from _paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield (*prefix, i)
            yield from _paths(v, (*prefix, i))


def _set(doc: Any, path: tuple, value: Any) -> Any:
    out = copy.deepcopy(doc)
    cur = out
    for k in path[:-1]:
        cur = cur[k]
    cur[path[-1]] = value
    return out


def _delete(doc: Any, path: tuple) -> Any:
    out = copy.deepcopy(doc)
    cur = out
    for k in path[:-1]:
        cur = cur[k]
    del cur[path[-1]]
    return out


def _label(path: tuple) -> str:
    return ".".join(str(p) for p in path)


def structural_mutants(doc: Any, seed: int = 0) -> Iterator[tuple[str, Any]]:
    """(label, mutated document): each field set to each edge value, each field removed."""
    rng = random.Random(seed)
    for path in _paths(doc):
        yield f"del {_label(path)}", _delete(doc, path)
        for name, value in EDGE_VALUES:
            yield f"{_label(path)}={name}", _set(doc, path, value)
        # a random pair of edge values nested one inside the other
        a, b = rng.sample(EDGE_VALUES, 2)
        yield f"{_label(path)}=[{a[0]},{{{b[0]}}}]", _set(doc, path, [a[1], {"k": b[1]}])
    yield "top=list", [doc]
    yield "top=str", "config"
    yield "top=null", None


def text_mutants(text: str, seed: int = 0, n_random: int = 60) -> Iterator[tuple[str, str]]:
    """(label, text) for truncations, byte flips and insertions in a document's text."""
    rng = random.Random(seed)
    cuts = sorted({0, 1, len(text) // 2, len(text) - 1, *(rng.randrange(len(text)) for _ in range(20))})
    for c in cuts:
        yield f"truncate@{c}", text[:c]
    junk = [
        "\x00",
        "{",
        "}",
        "[",
        "]",
        ":",
        ",",
        '"',
        "\\",
        "\n",
        "\t",
        "-",
        "&a ",
        "*a",
        "!!",
        "#",
        "'",
        "\ud800",
    ]
    for i in range(n_random):
        pos = rng.randrange(len(text) + 1)
        if i % 3 == 0:
            yield f"delete@{pos}", text[:pos] + text[pos + 1 :]
        else:
            j = rng.choice(junk)
            yield f"insert{j!r}@{pos}", text[:pos] + j + text[pos:]


def json_mutants(doc: dict[str, Any], seed: int = 0) -> Iterator[tuple[str, str]]:
    """(label, JSON text) mutants of a JSON object (NaN/Infinity written as Python's json writes them)."""
    for label, m in structural_mutants(doc, seed):
        yield label, json.dumps(m)
    text = json.dumps(doc, indent=2)
    yield from text_mutants(text, seed)
    yield "deep_array", "[" * DEEP + "]" * DEEP
    yield "deep_unclosed", "[" * 100_000
    yield "deep_object", '{"a": ' * DEEP + "1" + "}" * DEEP
    yield "deep_in_field", json.dumps({**doc, "x": 0}).replace("0}", "[" * DEEP + "]" * DEEP + "}")
    first = next(iter(doc))
    yield "duplicate_key", text[:-1].rstrip() + f', "{first}": "dup"}}'
    yield "huge_number_literal", text.replace(": ", ": " + "9" * 5000, 1)
    yield "exp_literal", text.replace(": ", ': 1e99999, "_": ', 1)
    yield "bom", "\ufeff" + text
    yield "empty", ""
    yield "whitespace", " \n\t"


def yaml_mutants(doc: dict[str, Any], seed: int = 0) -> Iterator[tuple[str, str]]:
    """(label, YAML text) mutants of a YAML mapping."""
    for label, m in structural_mutants(doc, seed):
        if label.endswith("huge_str"):
            continue  # same as JSON; keeps the YAML share fast
        yield label, yaml.dump(m, Dumper=_Dumper, sort_keys=False, width=1 << 30)
    text = yaml.safe_dump(doc, sort_keys=False)
    yield from text_mutants(text, seed)
    first = next(iter(doc))
    yield "duplicate_section", text + yaml.safe_dump({first: doc[first]}, sort_keys=False)
    yield "duplicate_nested_key", text.replace("\n  ", "\n  dup: 1\n  dup: 2\n  ", 1)
    bomb = 'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n'
    prev = "a"
    for name in "bcdefghi":
        bomb += f"{name}: &{name} [{','.join(['*' + prev] * 9)}]\n"
        prev = name
    yield "billion_laughs", bomb
    yield "bomb_in_section", text + bomb.replace("a: &a", "zz: &a")
    yield "self_alias", f"{first}: &s\n  x: *s\n"
    yield "deep_flow", "[" * DEEP + "]" * DEEP
    yield "deep_block", "".join("  " * i + f"k{i}:\n" for i in range(300)) + "  " * 300 + "v\n"
    yield "python_tag", f"{first}: !!python/object/apply:os.system [ls]\n"
    yield "binary_tag", f"{first}: !!binary aGVsbG8=\n"
    yield "set_tag", f"{first}: !!set {{a, b}}\n"
    yield "bad_date", f"{first}: 2024-13-45\n"
    yield "bare_float_tag", f"{first}: !!float\n"
    yield "nan_inf", f"{first}: {{a: .nan, b: -.inf}}\n"
    yield "tabs", text.replace("  ", "\t")
    yield "complex_key", "? [a, b]\n: 1\n"
    yield "merge_scalar", "<<: 1\n"
    yield "huge_int", f"{first}: {'9' * 5000}\n"
    yield "multi_doc", text + "---\n" + text
    yield "empty", ""
