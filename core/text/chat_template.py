"""Chat templates: jinja2 templates from a checkpoint (or a request) rendered in a sandbox.

Templates are untrusted code from the Hub, so they run in an ImmutableSandboxedEnvironment, and everything they
see is rebuilt from plain JSON types first: no object with methods reaches them. The environment mirrors the one
transformers renders with (trim_blocks, lstrip_blocks, loop controls, `{% generation %}`, a non-escaping
`tojson`, `raise_exception`, `strftime_now`), so a checkpoint's template gives the same text here as there.
Every failure, including a template calling `raise_exception`, becomes a ChatTemplateError carrying the message:
a server answers it with a 400.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from deepinfer.errors import InvalidInputError
from deepinfer.text.deepseek_v3_template import DEEPSEEK_V3_CHAT_TEMPLATE

CHAT_TEMPLATE_FILE = "chat_template.jinja"
ADDITIONAL_CHAT_TEMPLATES_DIR = "additional_chat_templates"
# Names a message's reasoning travels under; templates read the first (transformers fills all of them the same way).
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# Appended to the final message for continue_final_message; the output is cut where it reappears.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class ChatTemplateError(InvalidInputError):
    """A chat template could not be compiled or rendered for these messages; the message says why."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False
) -> str:
    # jinja's own tojson HTML-escapes <, >, & and ', which would corrupt prompts.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """`dict(...)` for templates without handing them the dict type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """jinja's namespace, refusing underscore names so a template cannot plant dunder attributes."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - same signature trick as jinja's Namespace
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"templates cannot set underscore attributes on namespaces: {name!r}")


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`, which training templates use to mark assistant text: its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return caller()


def _make_environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


_ENVIRONMENT = _make_environment()


@functools.lru_cache(maxsize=64)
def _compile(source: str) -> jinja2.Template:
    # Cached: a server renders the same few templates for every request.
    try:
        return _ENVIRONMENT.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template has a syntax error on line {e.lineno}: {e.message}") from None
    except jinja2.exceptions.TemplateError as e:
        raise ChatTemplateError(f"chat template cannot be compiled: {e}") from None


def plain_template_data(value: Any) -> Any:
    """`value` rebuilt from JSON types only (dataclasses and pydantic models become dicts, anything else a
    "<TypeName>" placeholder), so a template never holds an object whose methods the sandbox does not know."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {plain_template_data(k): plain_template_data(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain_template_data(v) for v in value]
    if isinstance(value, tuple):
        return tuple(plain_template_data(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain_template_data(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return plain_template_data(value.model_dump())
    return f"<{type(value).__name__}>"


def normalize_messages(messages: Any) -> list[dict]:
    """Messages as templates expect them, the way transformers prepares them: plain dicts, keys whose value is
    None dropped (OpenAI clients send `content: null`, which many templates would print as "None"), and reasoning
    copied under every name templates read it by."""
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise ChatTemplateError(f"messages must be a list of messages, got {type(messages).__name__}")
    if not messages:
        raise ChatTemplateError("messages is empty; a chat needs at least one message")
    out = []
    for i, message in enumerate(plain_template_data(list(messages))):
        if not isinstance(message, dict):
            raise ChatTemplateError(f"messages[{i}] must be an object with a role, got {type(message).__name__}")
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


class ChatTemplate:
    """One compiled chat template. Raises ChatTemplateError when `source` is not a valid template."""

    def __init__(self, source: str) -> None:
        if not isinstance(source, str):
            raise ChatTemplateError(f"a chat template must be a string, got {type(source).__name__}")
        self.source = source
        self._template = _compile(source)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = False,
        continue_final_message: bool = False,
        special_tokens: Mapping[str, str | None] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """The prompt text for `messages`. `special_tokens` (bos_token, eos_token, ...) and `template_kwargs`
        (e.g. enable_thinking) become template variables; `continue_final_message` leaves the last message open
        for the model to continue instead of closing it."""
        chat = normalize_messages(messages)
        if tools is not None and (
            isinstance(tools, (str, Mapping)) or not all(isinstance(t, Mapping) for t in tools)
        ):
            raise ChatTemplateError("tools must be a list of JSON-schema objects")
        if continue_final_message and add_generation_prompt:
            raise ChatTemplateError("continue_final_message and add_generation_prompt cannot both be set")
        final_text = None
        if continue_final_message:
            final_text = chat[-1].get("content")
            if not isinstance(final_text, str):
                raise ChatTemplateError("continue_final_message needs the last message to have text content")
            chat[-1]["content"] = final_text + _CONTINUE_TAG
        variables = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        variables.update(plain_template_data(template_kwargs))
        try:
            text = self._template.render(
                messages=chat,
                tools=plain_template_data(list(tools)) if tools is not None else None,
                documents=plain_template_data(list(documents)) if documents is not None else None,
                add_generation_prompt=bool(add_generation_prompt),
                **variables,
            )
        except jinja2.exceptions.SecurityError as e:
            raise ChatTemplateError(f"chat template attempted an unsafe operation: {e}") from None
        except jinja2.exceptions.TemplateError as e:
            # Covers raise_exception: its message is the template author's explanation, passed on verbatim.
            raise ChatTemplateError(str(e.message if e.message is not None else e)) from None
        except Exception as e:  # noqa: BLE001 - a template can fail in any way; it must never take the server down
            raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from None
        if final_text is not None:
            return _cut_at_continue_tag(text, final_text)
        return text


def _cut_at_continue_tag(text: str, final_text: str) -> str:
    tag = _CONTINUE_TAG.strip()
    if tag not in text or final_text.strip() not in text:
        raise ChatTemplateError("continue_final_message: the template does not render the final message's text")
    at = text.rindex(tag)
    if text[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return text[:at]
    return text[:at].rstrip()  # the template trimmed the message's trailing space, and the tag's with it


def load_chat_templates(folder: str | Path, tokenizer_config: Mapping[str, Any]) -> dict[str, str]:
    """A checkpoint's chat templates by name ("default", "tool_use", ...); empty when it ships none.

    `chat_template.jinja` and `additional_chat_templates/NAME.jinja` (the current transformers layout) take
    precedence over `chat_template` in tokenizer_config.json, which may be one string or a list of
    {"name", "template"} objects. Raises ChatTemplateError for a malformed entry.
    """
    folder = Path(folder)
    templates: dict[str, str] = {}
    configured = tokenizer_config.get("chat_template")
    if isinstance(configured, str):
        templates["default"] = configured
    elif isinstance(configured, list):
        for entry in configured:
            named = isinstance(entry, Mapping) and isinstance(entry.get("name"), str)
            if not (named and isinstance(entry.get("template"), str)):
                raise ChatTemplateError("tokenizer_config.json chat_template list entries need a name and a template")
            templates[entry["name"]] = entry["template"]
    elif configured is not None:
        kind = type(configured).__name__
        raise ChatTemplateError(f"tokenizer_config.json chat_template must be a string or a list, got {kind}")
    extra_dir = folder / ADDITIONAL_CHAT_TEMPLATES_DIR
    if extra_dir.is_dir():
        for path in sorted(extra_dir.glob("*.jinja")):
            templates[path.stem] = path.read_text(encoding="utf-8")
    if (folder / CHAT_TEMPLATE_FILE).is_file():
        templates["default"] = (folder / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
    return templates


def choose_chat_template(
    templates: Mapping[str, str], requested: str | None = None, tools: Sequence[Any] | None = None
) -> str:
    """The template source to render, following transformers: `requested` may name one of `templates` or be a
    template itself; otherwise "tool_use" when tools are given and it exists, then "default". A checkpoint
    with no template gets the built-in DeepSeek-V3 one."""
    if requested is not None:
        return templates.get(requested, requested)
    if not templates:
        return DEEPSEEK_V3_CHAT_TEMPLATE
    if tools is not None and "tool_use" in templates:
        return templates["tool_use"]
    if "default" in templates:
        return templates["default"]
    if len(templates) == 1:
        return next(iter(templates.values()))
    raise ChatTemplateError(f"this model has several chat templates and no default; pick one of {sorted(templates)}")
