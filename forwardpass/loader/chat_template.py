"""Render a model's chat template exactly as transformers does, inside a jinja2 sandbox.

Chat templates come with downloaded models, so they are untrusted code: they run in
``ImmutableSandboxedEnvironment`` (no attribute access to Python internals, no mutation of inputs),
and every value they see is rebuilt from plain JSON types first. The environment (trim_blocks,
lstrip_blocks, loopcontrols, ``tojson``, ``raise_exception``, ``strftime_now``, ``namespace``, the
``{% generation %}`` tag) mirrors ``transformers.utils.chat_template_utils`` so renders match HF.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any, ClassVar

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from forwardpass.errors import ChatTemplateError

# transformers copies a message's reasoning under these names; the first is the one templates read.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class _GenerationTag(jinja2.ext.Extension):
    """Accept ``{% generation %}...{% endgeneration %}`` (used by training templates); render the body."""

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # Unlike jinja's built-in tojson this does not HTML-escape, which is what templates expect.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Dict:
    """``dict(...)`` for templates, without exposing the dict type object itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """A namespace that refuses underscore names, so templates cannot plant dunder attributes."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # self is args[0]: jinja's Namespace trick
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"chat templates cannot set underscore attributes on a namespace ({name!r})")


@lru_cache(maxsize=32)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _Dict()
    env.globals["namespace"] = _Namespace
    return env.from_string(template)


def _plain(value: Any) -> Any:
    """Rebuild ``value`` from JSON types so the template never sees an object with dangerous methods."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):  # subclasses (enums, ...) are stripped back to the base type
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if callable(getattr(value, "model_dump", None)):  # pydantic models (OpenAI request objects)
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _normalize_messages(messages: list[dict]) -> list[dict]:
    """As transformers does: drop None-valued keys (``content=None`` from OpenAI clients) and copy
    reasoning under every name templates read it by."""
    out = []
    for message in _plain(list(messages)):
        if not isinstance(message, dict):
            raise ChatTemplateError(f"chat messages must be dicts with 'role' and 'content', got {message!r}")
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def render_chat_template(
    template: str,
    messages: list[dict],
    *,
    add_generation_prompt: bool = True,
    tools: list[dict] | None = None,
    documents: list[dict] | None = None,
    **variables: Any,
) -> str:
    """Render ``template`` for ``messages``; any failure becomes a ChatTemplateError with jinja's message."""
    if not messages:
        raise ChatTemplateError(
            "cannot apply a chat template to an empty conversation; pass at least one message"
        )
    try:
        compiled = _compile(template)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(
            f"the model's chat template does not parse (line {exc.lineno}): {exc.message}"
        ) from exc
    try:
        return compiled.render(
            messages=_normalize_messages(messages),
            tools=_plain(tools),
            documents=_plain(documents),
            add_generation_prompt=add_generation_prompt,
            **_plain(variables),
        )
    except SecurityError as exc:
        raise ChatTemplateError(
            f"the chat template tried an unsafe operation and was stopped by the sandbox (SecurityError: {exc})"
        ) from exc
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"chat template error: {exc}") from exc
    except Exception as exc:  # a template bug (e.g. '+' on None) is a bad request, not an engine crash
        raise ChatTemplateError(f"chat template failed to render ({type(exc).__name__}: {exc})") from exc
