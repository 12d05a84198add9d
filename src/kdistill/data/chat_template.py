"""Chat templates: a model's own Jinja template, rendered the way `transformers` renders it.

    tpl = load_chat_template("models/teacher")            # chat_template.jinja or tokenizer_config.json
    text = tpl.render(messages, add_generation_prompt=True)
    note = template_mismatch(teacher_tpl, student_tpl)     # None when both render with the same template

The environment is the one `transformers.apply_chat_template` builds: Jinja2's immutable *sandboxed*
environment with `trim_blocks` and `lstrip_blocks`, the `loopcontrols` extension, a `tojson` filter that
keeps non-ASCII text as it is, and the globals `raise_exception`, `strftime_now`, `dict` and
`namespace`. The template sees `messages`, `tools=None`, `documents=None`, `add_generation_prompt` and
the model's special tokens (`bos_token`, `eos_token`, ...) as strings. A `{% generation %}` block
renders its body unchanged. So our text, encoded without added special tokens, gives the same token
ids as `apply_chat_template(messages, tokenize=True)`.

Where a template comes from, first found wins: an explicit override (a `.jinja` file, or a JSON file
with a `chat_template` key, or a model directory), else `chat_template.jinja` in the model directory,
else `chat_template` in its `tokenizer_config.json` (a string, or a list of named templates of which
`default` is used). Special tokens are always read from the model directory's
`tokenizer_config.json`.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import json
import operator
import re
import signal
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from kdistill.errors import UserError
from kdistill.jsonio import read_json

# The special tokens transformers passes to a template (its `special_tokens_map`), by config key.
SPECIAL_TOKEN_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
MAX_TEMPLATE_FILE_BYTES = 64 << 20  # tokenizer_config.json files are well below this
TIME_LIMIT_S = 10.0  # per rendering; real templates take milliseconds
ALARM_SLACK_S = 0.5  # the hooks stop a template first (with a cleaner message); the alarm is the backstop
MAX_RENDER_CHARS = 64 << 20  # per rendering; a conversation line is at most 16 MiB


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """A chat template with the special tokens it is rendered with.

    Attributes:
        source: the Jinja source text.
        origin: the file it was read from (named in messages).
        special_tokens: e.g. {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}.
        time_limit_s, max_chars: the budget of one rendering (seconds, characters written).
    """

    source: str
    origin: str
    special_tokens: Mapping[str, str] = dataclasses.field(default_factory=dict)
    time_limit_s: float = TIME_LIMIT_S
    max_chars: int = MAX_RENDER_CHARS

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = False,
        tools: Sequence[Any] | None = None,
        documents: Sequence[Any] | None = None,
        **kwargs: Any,
    ) -> str:
        """The conversation as text, exactly as `apply_chat_template(..., tokenize=False)` renders it:
        `messages` passed as given (every key of every message), `tools` and `documents` as given,
        `kwargs` (e.g. enable_thinking=False) as template variables over the special tokens.

        Raises:
            UserError: one line naming the template file (and its line, where Jinja knows it): the
                template raised (its own `raise_exception`, an undefined value, a sandbox violation,
                any Python error), recursed too deeply, ran past `time_limit_s` or wrote more than
                `max_chars` characters.
        """
        compiled = _compile(self.source, self.origin)
        values = {**self.special_tokens, **kwargs}
        budget = _Budget(time.monotonic() + self.time_limit_s, self.max_chars)
        token = _BUDGET.set(budget)
        try:
            pieces, size = [], 0
            with _alarm(self.time_limit_s + ALARM_SLACK_S):
                for piece in compiled.generate(
                    messages=[dict(m) for m in messages],
                    tools=None if tools is None else list(tools),
                    documents=None if documents is None else list(documents),
                    add_generation_prompt=add_generation_prompt,
                    **values,
                ):
                    size += len(piece)
                    budget.check(size)
                    pieces.append(piece)
            return "".join(pieces)
        except _BudgetExceeded as e:
            raise UserError(f"{self.origin}: chat template {e}{_template_line(e)}") from None
        except RecursionError as e:
            raise UserError(
                f"{self.origin}: chat template recursion too deep{_template_line(e)} (expected a template "
                "that ends)"
            ) from None
        except MemoryError as e:
            raise UserError(f"{self.origin}: chat template ran out of memory{_template_line(e)}") from None
        except Exception as e:  # a template is an untrusted program: any error it raises is one line
            raise UserError(
                f"{self.origin}: chat template failed{_template_line(e)}: {_one_line(e)}"
            ) from None
        finally:
            _BUDGET.reset(token)


# -- budgets: a rendering may take at most time_limit_s seconds and write at most max_chars characters.
# Checked where a template can spend time or memory: every output piece, every call (macros, methods,
# filters), every attribute or item lookup, every 1024 steps of range(), and before `*`, `**` and `%`
# build a value larger than the output limit; a SIGALRM timer (main thread) stops what no hook sees.


class _BudgetExceeded(Exception):
    pass


@dataclasses.dataclass
class _Budget:
    deadline: float
    max_chars: int

    def check(self, size: int = 0) -> None:
        if size > self.max_chars:
            raise _BudgetExceeded(f"wrote more than {self.max_chars} characters (the limit per rendering)")
        if time.monotonic() > self.deadline:
            raise _BudgetExceeded("ran longer than its time limit per rendering")


_BUDGET: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar(
    "kdistill_template_budget", default=None
)


@contextlib.contextmanager
def _alarm(seconds: float) -> Iterator[None]:
    """A hard stop for template code that no hook sees (a long loop over a string with an empty
    body): SIGALRM raises _BudgetExceeded, in the main thread when no other timer is armed."""
    usable = (
        hasattr(signal, "setitimer")
        and threading.current_thread() is threading.main_thread()
        and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    )
    if not usable:
        yield
        return

    def on_alarm(signum: int, frame: Any) -> None:
        raise _BudgetExceeded("ran longer than its time limit per rendering")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _check(size: int = 0) -> None:
    budget = _BUDGET.get()
    if budget is not None:
        budget.check(size)


def _size(value: Any) -> int:
    return len(value) if isinstance(value, str | bytes | list | tuple | dict) else 0


def _check_args(args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
    # A width or count argument larger than the output limit (" ".ljust(10**10), center(10**9)) would
    # allocate before any output is counted.
    budget = _BUDGET.get()
    if budget is None:
        return
    for v in (*args, *kwargs.values()):
        if isinstance(v, int) and not isinstance(v, bool) and abs(v) > budget.max_chars:
            raise _BudgetExceeded(
                f"asked for a size of {v} (more than the limit of {budget.max_chars} characters)"
            )
    budget.check()


def _template_line(e: BaseException) -> str:
    """' line N' where the traceback passes through the template (Jinja maps its frames to template
    lines), else ''."""
    lineno = getattr(e, "lineno", None)
    tb = e.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            lineno = tb.tb_lineno
        tb = tb.tb_next
    return f" at line {lineno}" if isinstance(lineno, int) else ""


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or e.__class__.__name__
    if not isinstance(e, Exception) or e.__class__.__module__.startswith("jinja2"):
        return text[:300]
    return f"{e.__class__.__name__}: {text}"[:300]


@functools.lru_cache(maxsize=16)
def _compile(source: str, origin: str) -> Any:
    """The template compiled in transformers' sandboxed environment (cached by source)."""
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    import jinja2.sandbox
    import jinja2.utils

    class GenerationBlock(jinja2.ext.Extension):
        # `{% generation %}...{% endgeneration %}` marks assistant text for transformers' own masks;
        # here it renders its body unchanged.
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            call = self.call_method("_body")
            return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        x: Any,
        ensure_ascii: bool = False,
        indent: Any = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        # Jinja's own tojson escapes HTML characters; transformers' does not.
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    class TemplateDict:
        # dict() for templates, without attribute access to the dict type itself
        def __call__(self, *args: Any, **kwargs: Any) -> dict:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        # namespace() that refuses underscore names (no way to CPython internals)
        def __init__(*args: Any, **kwargs: Any) -> None:
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            TemplateNamespace._check(name)
            _check(_size(value))  # a namespace value grown in a loop is memory no output counts
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} starts with '_'")

    class BudgetedEnvironment(jinja2.sandbox.ImmutableSandboxedEnvironment):
        # transformers' environment, with the budget checked at every call, lookup and sized operator
        intercepted_binops = frozenset(["*", "**", "%"])

        def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
            _check_args(args, kwargs)
            out = super().call(__context, __obj, *args, **kwargs)
            _check(_size(out))
            return out

        def wrap_str_format(self, value: Any) -> Any:
            owner = getattr(value, "__self__", None)
            if isinstance(owner, str) and getattr(value, "__name__", "") in ("format", "format_map"):
                # '{:>999999999}'.format(x): a width in the format string allocates before any check
                budget = _BUDGET.get()
                limit = budget.max_chars if budget is not None else MAX_RENDER_CHARS
                fields = re.findall(r"\{[^{}]*\}", owner)
                if any(int(n) > limit for f in fields for n in re.findall(r"\d+", f)):
                    raise _BudgetExceeded(f"formats a field wider than {limit} characters")
            return super().wrap_str_format(value)

        def getattr(self, obj: Any, attribute: str) -> Any:
            _check()
            return super().getattr(obj, attribute)

        def getitem(self, obj: Any, argument: Any) -> Any:
            _check()
            return super().getitem(obj, argument)

        def call_binop(self, context: Any, operator_: str, left: Any, right: Any) -> Any:
            budget = _BUDGET.get()
            limit = budget.max_chars if budget is not None else MAX_RENDER_CHARS
            if operator_ == "*":
                for seq, n in ((left, right), (right, left)):
                    if _size(seq) and isinstance(n, int) and _size(seq) * n > limit:
                        raise _BudgetExceeded(f"builds a value of more than {limit} items with '*'")
                return operator.mul(left, right)
            if operator_ == "**":
                if isinstance(left, int) and isinstance(right, int) and abs(left) > 1:
                    if right * max(abs(left).bit_length(), 1) > 8 * limit:
                        raise _BudgetExceeded(f"builds a number of more than {limit} bytes with '**'")
                return operator.pow(left, right)
            if isinstance(left, str):
                _check_format(left, right, limit)
            return operator.mod(left, right)

    # optimized=False: Jinja's optimizer evaluates constant expressions while compiling, where no
    # budget applies ('%999999999d' | format(1) would allocate gigabytes before the first rendering).
    env = BudgetedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[GenerationBlock, jinja2.ext.loopcontrols],
        optimized=False,
    )
    for name, fn in list(env.filters.items()):
        env.filters[name] = _budgeted_filter(fn)
    env.globals["range"] = _BudgetedRange
    env.filters["tojson"] = _budgeted_filter(tojson)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise UserError(f"{origin}: chat template line {e.lineno}: {e.message}") from None
    except jinja2.TemplateError as e:
        raise UserError(f"{origin}: chat template does not compile: {e}") from None


class _BudgetedRange:
    """range() of the sandbox (at most MAX_RANGE items) whose iteration checks the budget."""

    def __init__(self, *args: int) -> None:
        import jinja2.sandbox

        self._r = jinja2.sandbox.safe_range(*args)

    def __iter__(self) -> Iterator[int]:
        for i, v in enumerate(self._r):
            if i % 1024 == 1023:
                _check()
            yield v

    def __len__(self) -> int:
        return len(self._r)

    def __getitem__(self, i: Any) -> Any:
        return self._r[i]

    def __reversed__(self) -> Iterator[int]:
        return reversed(self._r)

    def __contains__(self, v: Any) -> bool:
        return v in self._r


def _check_format(fmt: str, values: Any, limit: int) -> None:
    """Refuse a printf-style format whose widths or precisions (or `*` values) exceed `limit`."""
    numbers = [int(n) for n in re.findall(r"%[-+ #0]*(\d*)(?:\.(\d*))?", fmt) for n in [*n] if n]
    stars = [v for v in (values if isinstance(values, tuple) else (values,)) if isinstance(v, int)]
    if any(n > limit for n in numbers) or ("*" in fmt and any(abs(v) > limit for v in stars)):
        raise _BudgetExceeded(f"formats a field wider than {limit} characters with '%'")


def _budgeted_filter(fn: Any) -> Any:
    """A Jinja filter whose size arguments and result are checked against the budget.

    The wrapper takes the context (pass_context), which also keeps Jinja from running the filter on
    constants while it compiles, where no budget applies; the filter gets what it asked for."""
    import jinja2.utils

    wants = jinja2.utils._PassArg.from_obj(fn)

    @jinja2.utils.pass_context
    @functools.wraps(fn)
    def wrapper(context: Any, *args: Any, **kwargs: Any) -> Any:
        budget = _BUDGET.get()
        limit = budget.max_chars if budget is not None else MAX_RENDER_CHARS
        if getattr(fn, "__name__", "") == "do_format" and args and isinstance(args[0], str):
            _check_format(args[0], tuple(args[1:]), limit)
        _check_args(args[1:], kwargs)
        if wants is jinja2.utils._PassArg.context:
            out = fn(context, *args, **kwargs)
        elif wants is jinja2.utils._PassArg.eval_context:
            out = fn(context.eval_ctx, *args, **kwargs)
        elif wants is jinja2.utils._PassArg.environment:
            out = fn(context.environment, *args, **kwargs)
        else:
            out = fn(*args, **kwargs)
        _check(_size(out))
        return out

    return wrapper


def _read_json_object(path: Path) -> dict[str, Any]:
    return read_json(path, max_bytes=MAX_TEMPLATE_FILE_BYTES, what="a tokenizer_config.json")


def _template_from_config(config: Mapping[str, Any], where: Path) -> str | None:
    value = config.get("chat_template")
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
        raise UserError(
            f"{where}: 'chat_template' lists templates {sorted(map(str, named))} but none named 'default'"
        )
    raise UserError(f"{where}: 'chat_template' is {type(value).__name__}, expected a string")


def _special_tokens(config: Mapping[str, Any]) -> dict[str, str]:
    out: dict[str, str] = {}
    for key in SPECIAL_TOKEN_KEYS:
        value = config.get(key)
        if isinstance(value, dict):  # a serialised AddedToken
            value = value.get("content")
        if isinstance(value, str):
            out[key] = value
    return out


def load_chat_template(
    model_dir: str | Path, override: str | Path | None = None, *, field: str = "data.chat_template"
) -> ChatTemplate:
    """The chat template of a model directory, or of `override` when given.

    Args:
        field: the option the override comes from, named in messages (`--chat-template` for the CLI).

    Raises:
        UserError: no template found, or a file that cannot be read or does not compile.
    """
    folder = Path(model_dir)
    config_path = folder / "tokenizer_config.json"
    config = _read_json_object(config_path) if config_path.is_file() else {}
    specials = _special_tokens(config)

    source: str | None = None
    origin: Path | None = None
    if override is not None and str(override) != "":
        path = Path(override)
        if path.is_dir():
            path = path / "chat_template.jinja" if (path / "chat_template.jinja").is_file() else path
            if path.is_dir():
                path = path / "tokenizer_config.json"
        if not path.is_file():
            raise UserError(f"{field}: {override} is not a file (expected a .jinja file)")
        if path.suffix == ".json":
            source = _template_from_config(_read_json_object(path), path)
            if source is None:
                raise UserError(f"{field}: {path} has no 'chat_template' key")
        else:
            source = _read_text(path)
        origin = path
    elif (folder / "chat_template.jinja").is_file():
        origin = folder / "chat_template.jinja"
        source = _read_text(origin)
    elif config:
        source = _template_from_config(config, config_path)
        origin = config_path
    if source is None or origin is None:
        option = f"{field}=PATH" if field.startswith("data.") else f"{field} PATH"
        raise UserError(
            f"{folder}: no chat template (expected chat_template.jinja or 'chat_template' in "
            f"tokenizer_config.json; or give one with {option})"
        )
    template = ChatTemplate(source=source, origin=str(origin), special_tokens=specials)
    _compile(template.source, template.origin)  # syntax errors surface here, naming the file
    return template


def _read_text(path: Path) -> str:
    try:
        if path.stat().st_size > MAX_TEMPLATE_FILE_BYTES:
            raise UserError(f"{path}: larger than 64 MiB, expected a Jinja chat template")
        return path.read_text(encoding="utf-8")
    except OSError as e:
        raise UserError(f"{path}: cannot read ({e.strerror or e.__class__.__name__})") from None
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not UTF-8 at byte {e.start}, expected a Jinja chat template") from None


def template_mismatch(teacher: ChatTemplate, student: ChatTemplate) -> str | None:
    """A one-line warning when teacher and student templates differ (None when they are the same).

    The run renders conversations with the teacher's template unless told otherwise."""
    if teacher.source == student.source and dict(teacher.special_tokens) == dict(student.special_tokens):
        return None
    what = "chat templates" if teacher.source != student.source else "special tokens of the chat templates"
    return (
        f"teacher and student {what} differ (teacher: {teacher.origin}, student: {student.origin}); "
        "conversations are rendered with the teacher's (set data.chat_template=PATH to choose)"
    )
