"""Fuzzing the config reader: load_config + validate on random YAML text, on random
structured configs built from the real keys, and on random command-line overrides; only kdistill's
UserError escapes (with a one-line message).

Deterministic (derandomize=True), so CI sees the same inputs every run: 2,000 per property, enough to
reach the YAML constructor errors these properties were written for: with the reader's handling of them
removed, the random text and the random overrides fail by their 736th input (a bad date alone,
ValueError: 735th and 736th). Those inputs are also explicit examples, run whatever the count.
`KDISTILL_FUZZ_EXAMPLES=10000` runs the long version (tests/fuzz_util.py).
"""

from __future__ import annotations

import dataclasses
import typing

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kdistill.config import RunConfig, load_config
from kdistill.errors import UserError
from tests.fuzz_util import fuzz_examples

N = fuzz_examples(2_000)
FUZZ = settings(
    max_examples=N, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck)
)

_HINTS = typing.get_type_hints(RunConfig)
SECTIONS = {  # the mapping sections (not `teachers`, a list of sections: fuzzed through _FRAGMENTS)
    f.name: [g.name for g in dataclasses.fields(_HINTS[f.name])]
    for f in dataclasses.fields(RunConfig)
    if dataclasses.is_dataclass(_HINTS[f.name])
}
KEYS = [f"{s}.{k}" for s, ks in SECTIONS.items() for k in ks]

# YAML-ish fragments that reach the corners of the parser: anchors, tags, flow collections, timestamps,
# merge keys, huge numbers, NaN/inf, tabs, non-ASCII, unbalanced brackets.
_FRAGMENTS = [
    "teacher:",
    "teachers:",
    "student:",
    "kd:",
    "optim:",
    "schedule:",
    "data:",
    "output:",
    "runtime:",
    "  ",
    "\t",
    "\n",
    ": ",
    "- ",
    "{",
    "}",
    "[",
    "]",
    ",",
    "&a ",
    "*a",
    "!!python/object:os.system",
    "!!binary ",
    "!!float",
    "<<: *a",
    "2024-13-45",
    "2001-12-14t21:59:43.10-05:00",
    "1e400",
    "-.inf",
    ".nan",
    "0x1F",
    "0o17",
    "~",
    "null",
    "yes",
    "no",
    "'",
    '"',
    "\\u00e9",
    "é",
    "東京",
    "%YAML 1.1",
    "---",
    "...",
    "#",
    "|",
    ">",
    "?",
    "@",
    "`",
    "alpha: ",
    "lr: ",
    "steps: ",
    "path: x",
    "train: [a, b]",
    "seq_len: 99999999999999999999",
    "divergence: jsd",
    "temperature: -1",
    "beta: 1",
    "device: cuda:x",
    "keep_checkpoints: 0",
]


def _check(fn) -> None:
    try:
        fn()
    except UserError as e:
        assert "\n" not in str(e) and str(e)


# What the YAML constructors raise besides YAMLError: a bad date (ValueError), a bare '!!float' tag
# (IndexError), a huge '!!int' (ValueError: too many digits), nesting past the recursion limit.
_CONSTRUCTOR_ERRORS = ["2024-13-45", "!!float", "!!int " + "9" * 5000, "[" * 3000]


@FUZZ
@given(st.lists(st.one_of(st.sampled_from(_FRAGMENTS), st.text(max_size=12)), max_size=24))
@example(parts=["schedule:", "\n", "  ", "seed: ", "2024-13-45"])
@example(parts=["kd:", "\n", "  ", "temperature: ", "!!float"])
@example(parts=["schedule:", "\n", "  ", "seed: ", "!!int " + "9" * 5000])
@example(parts=["data: ", "[" * 3000])
def test_random_yaml_text(tmp_path_factory, parts):
    path = tmp_path_factory.getbasetemp() / "fuzz.yaml"
    path.write_bytes("".join(parts).encode("utf-8", "surrogatepass"))  # lone surrogates: invalid UTF-8
    _check(lambda: load_config(path).validate())


_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=10),
    st.sampled_from(["auto", "cpu", "cuda", "forward_kl", "skip", "stop", "teacher_layers", "1e-3", "true"]),
)
_values = st.one_of(
    _scalars,
    st.lists(_scalars, max_size=2),
    st.dictionaries(st.sampled_from(["a", "lr"]), _scalars, max_size=1),
)


@st.composite
def _structured(draw):
    """A config dict whose keys are mostly real (so values reach the type checks), some mistyped."""
    out: dict = {}
    for _ in range(draw(st.integers(0, 6))):
        section = draw(st.sampled_from([*SECTIONS, "optimizer", "", "kd "]))
        fields = SECTIONS.get(section, ["x"])
        key = draw(st.sampled_from([*fields, "temprature", "lr_", "STEPS"]))
        value = draw(_values)
        if draw(st.booleans()):
            out.setdefault(section, {})
            if isinstance(out[section], dict):
                out[section][key] = value
        else:
            out[section] = value
    return out


@FUZZ
@given(_structured())
def test_random_structured_config(data):
    # Straight into the reader (the YAML text path is fuzzed above): every section, key and type check.
    _check(lambda: load_config(None, base=data).validate(need_paths=False))


@FUZZ
@given(
    st.lists(
        st.one_of(
            st.builds(
                lambda k, v: f"{k}={v}",
                st.sampled_from(KEYS),
                st.one_of(st.sampled_from(_FRAGMENTS), st.text(max_size=12)),
            ),
            st.text(max_size=20),
        ),
        max_size=4,
    )
)
@example(overrides=[f"schedule.seed={v}" for v in _CONSTRUCTOR_ERRORS])
@example(overrides=["kd.temperature=!!float"])
def test_random_overrides(overrides):
    _check(lambda: load_config(None, overrides).validate(need_paths=False))
