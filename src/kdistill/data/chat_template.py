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

import dataclasses
import functools
import json
from collections.abc import Mapping, Sequence
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


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """A chat template with the special tokens it is rendered with.

    Attributes:
        source: the Jinja source text.
        origin: the file it was read from (named in messages).
        special_tokens: e.g. {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}.
    """

    source: str
    origin: str
    special_tokens: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def render(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = False, **kwargs: Any
    ) -> str:
        """The conversation as text, exactly as `apply_chat_template(..., tokenize=False)` renders it.

        Raises:
            UserError: the template raised (its own `raise_exception`, an undefined value, a sandbox
                violation); the message names the template file.
        """
        import jinja2

        compiled = _compile(self.source, self.origin)
        values = {**self.special_tokens, **kwargs}
        try:
            return compiled.render(
                messages=[dict(m) for m in messages],
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **values,
            )
        except jinja2.TemplateError as e:
            raise UserError(f"{self.origin}: chat template failed: {e}") from None


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
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} starts with '_'")

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
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


def load_chat_template(model_dir: str | Path, override: str | Path | None = None) -> ChatTemplate:
    """The chat template of a model directory, or of `override` (data.chat_template) when given.

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
            raise UserError(f"data.chat_template: {override} is not a file (expected a .jinja file)")
        if path.suffix == ".json":
            source = _template_from_config(_read_json_object(path), path)
            if source is None:
                raise UserError(f"data.chat_template: {path} has no 'chat_template' key")
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
        raise UserError(
            f"{folder}: no chat template (expected chat_template.jinja or 'chat_template' in "
            "tokenizer_config.json; or give one with data.chat_template=PATH)"
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
