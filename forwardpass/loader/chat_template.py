"""Render a model's chat template exactly as transformers does, inside a jinja2 sandbox.

Chat templates come with downloaded models, so they are untrusted code: they run in
``ImmutableSandboxedEnvironment`` (no attribute access to Python internals, no mutation of inputs),
and every value they see is rebuilt from plain JSON types first. The environment (trim_blocks,
lstrip_blocks, loopcontrols, ``tojson``, ``raise_exception``, ``strftime_now``, ``namespace``, the
``{% generation %}`` tag) mirrors ``transformers.utils.chat_template_utils`` so renders match HF.

Limits (a template is code from whoever published the model): a render stops with a
``ChatTemplateError`` naming the limit when it runs longer than ``time_limit_s`` (checked on every
line of the compiled template and every ``range`` step), when its output passes ``max_output_chars``,
or when one operation would build a string or list larger than that (``*``, ``+``, ``~``, ``%``,
``format`` widths, ``tojson(indent=...)``, ``center`` / ``indent`` / ``ljust`` ..., ``replace``, ``join``),
or an integer power with a huge result. Callers on an event loop run it in a worker thread.
"""

from __future__ import annotations

import json
import re
import sys
import threading
import time
from collections.abc import Iterator
from datetime import datetime
from functools import lru_cache, update_wrapper
from types import FrameType
from typing import Any, ClassVar

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.sandbox import ImmutableSandboxedEnvironment, SandboxedFormatter, SecurityError

from forwardpass.errors import ChatTemplateError

#: Default limits of one render (see the module docstring).
RENDER_TIME_LIMIT_S = 2.0
MAX_OUTPUT_CHARS = 8 << 20
MAX_FORMAT_WIDTH = 4096  # widths / precisions in format specs, center / ljust / indent widths
MAX_JSON_INDENT = 64
MAX_POW_BITS = 4096  # a ** b may not produce an integer of more bits than this


class ChatTemplateLimitError(ChatTemplateError):
    """A chat template exceeded a render limit (time, output size, or one operation's size)."""


class _Limits(threading.local):
    """The limits of the render running on this thread (renders run in worker threads)."""

    deadline = float("inf")
    time_limit_s = RENDER_TIME_LIMIT_S
    max_chars = MAX_OUTPUT_CHARS


_limits = _Limits()


def _over_time() -> None:
    if time.monotonic() > _limits.deadline:
        raise ChatTemplateLimitError(
            f"the chat template exceeded the render time limit of {_limits.time_limit_s:g} s"
        )


def _check_size(n: int, what: str) -> None:
    if n > _limits.max_chars:
        raise ChatTemplateLimitError(
            f"the chat template exceeded the output-size limit of {_limits.max_chars} characters ({what})"
        )


def _size(x: Any) -> int:
    return len(x) if isinstance(x, (str, list, tuple, bytes)) else len(str(x)) if isinstance(x, int) else 0


def _check_width(n: Any, what: str) -> None:
    if isinstance(n, int) and n > MAX_FORMAT_WIDTH:
        raise ChatTemplateLimitError(
            f"the chat template asked for a {what} of {n}; the limit is {MAX_FORMAT_WIDTH}"
        )


_SPEC_NUMBER = re.compile(r"\d+")


def _check_spec(spec: str) -> None:
    for number in _SPEC_NUMBER.findall(spec):
        _check_width(int(number) if len(number) < 12 else MAX_FORMAT_WIDTH + 1, "format width or precision")

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
    _check_width(indent if isinstance(indent, int) else len(indent) if isinstance(indent, str) else 0,
                 "tojson indent")
    if isinstance(indent, int) and indent > MAX_JSON_INDENT:
        raise ChatTemplateLimitError(f"the chat template asked for tojson indent={indent}; the limit is "
                                     f"{MAX_JSON_INDENT}")
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


class _LimitedFormatter(SandboxedFormatter):
    def format_field(self, value: Any, format_spec: str) -> Any:
        _check_spec(format_spec)
        return super().format_field(value, format_spec)


class _LimitedCodeGenerator(CodeGenerator):
    """``a ~ b`` goes through the environment, so a doubling loop cannot build a huge string."""

    def visit_Concat(self, node: jinja2.nodes.Concat, frame: Frame) -> None:
        self.write("environment.limited_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


_GROWING_METHODS = frozenset({"ljust", "rjust", "center", "zfill", "expandtabs"})


class _LimitedSandbox(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "**", "%", "+"})
    code_generator_class = _LimitedCodeGenerator

    def limited_concat(self, parts: tuple[Any, ...]) -> str:
        strs = [str(p) for p in parts]
        _check_size(sum(len(p) for p in strs), "a ~ concatenation")
        return "".join(strs)

    def call_binop(self, context: jinja2.runtime.Context, operator_: str, left: Any, right: Any) -> Any:
        if operator_ == "*":
            for a, b in ((left, right), (right, left)):
                if isinstance(a, (str, list, tuple)) and isinstance(b, int):
                    _check_size(len(a) * b, "a * repetition")
        elif operator_ == "+":
            if isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
                _check_size(len(left) + len(right), "a + concatenation")
        elif operator_ == "**":
            if (
                isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1
                and right * abs(left).bit_length() > MAX_POW_BITS
            ):
                raise ChatTemplateLimitError(
                    f"the chat template computed an integer power with more than {MAX_POW_BITS} bits"
                )
        elif operator_ == "%" and isinstance(left, str):
            _check_spec(left)
        return super().call_binop(context, operator_, left, right)

    def call(self, context: jinja2.runtime.Context, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        name = getattr(obj, "__name__", "")
        owner = getattr(obj, "__self__", None)
        if isinstance(owner, str):
            if name in _GROWING_METHODS:
                for a in [*args, *kwargs.values()]:
                    _check_width(a, f"str.{name} width")
                if name == "expandtabs":
                    _check_size(len(owner) * max([8, *[a for a in args if isinstance(a, int)]]), "expandtabs")
            elif (name == "replace" and len(args) >= 2 and isinstance(args[0], str)
                  and isinstance(args[1], str)):
                count = owner.count(args[0]) if args[0] else len(owner) + 1
                _check_size(len(owner) + count * max(0, len(args[1]) - len(args[0])), "str.replace")
            elif name == "join" and args and isinstance(args[0], (list, tuple)):
                items = args[0]
                _check_size(len(owner) * len(items) + sum(_size(i) for i in items), "str.join")
        return super().call(context, obj, *args, **kwargs)

    def wrap_str_format(self, value: Any) -> Any:
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None
        f_self = value.__self__
        formatter = _LimitedFormatter(self)

        def limited(*args: Any, **kwargs: Any) -> str:
            if value.__name__ == "format_map":
                kwargs, args = (args[0] if args else {}), ()
            return type(f_self)(formatter.vformat(f_self, args, kwargs))

        return update_wrapper(limited, value)


def _limited_range(*args: int) -> Iterator[int]:
    """The sandbox's ``range`` (at most 100,000 items) that also checks the render's deadline."""
    from jinja2.sandbox import safe_range

    for i, x in enumerate(safe_range(*args)):
        if not i & 255:
            _over_time()
        yield x


def _center(value: Any, width: int = 80) -> str:
    _check_width(width, "center width")
    return str(value).center(width)


def _indent(s: Any, width: int | str = 4, first: bool = False, blank: bool = False) -> str:
    _check_width(width if isinstance(width, int) else len(width), "indent width")
    text = str(s)
    _check_size(len(text) + (text.count("\n") + 1) * (width if isinstance(width, int) else len(width)),
                "indent")
    return jinja2.filters.do_indent(text, width, first, blank)


def _format(value: Any, *args: Any, **kwargs: Any) -> str:
    _check_spec(str(value))
    return jinja2.filters.do_format(value, *args, **kwargs)


@jinja2.pass_eval_context
def _join(eval_ctx: Any, value: Any, d: str = "", attribute: Any = None) -> str:
    items = list(value)
    _check_size(len(d) * len(items) + sum(_size(i) for i in items), "join")
    return jinja2.filters.do_join(eval_ctx, items, d, attribute)


@jinja2.pass_eval_context
def _replace(eval_ctx: Any, s: Any, old: str, new: str, count: int | None = None) -> str:
    text = str(s)
    n = (text.count(old) if old else len(text) + 1) if count is None else min(count, len(text) + 1)
    _check_size(len(text) + n * max(0, len(str(new)) - len(str(old))), "replace")
    return jinja2.filters.do_replace(eval_ctx, s, old, new, count)


@lru_cache(maxsize=32)
def _compile(template: str) -> jinja2.Template:
    env = _LimitedSandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.filters["center"] = _center
    env.filters["indent"] = _indent
    env.filters["format"] = _format
    env.filters["join"] = _join
    env.filters["replace"] = _replace
    env.globals["range"] = _limited_range
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
    time_limit_s: float = RENDER_TIME_LIMIT_S,
    max_output_chars: int = MAX_OUTPUT_CHARS,
    **variables: Any,
) -> str:
    """Render ``template`` for ``messages``; any failure becomes a ChatTemplateError with jinja's message
    (``ChatTemplateLimitError`` naming the limit when one of the render limits is exceeded)."""
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
    previous_trace = sys.gettrace()
    _limits.time_limit_s, _limits.max_chars = time_limit_s, max_output_chars
    _limits.deadline = time.monotonic() + time_limit_s
    sys.settrace(_trace_calls)  # this thread only: every line of the template checks the deadline
    try:
        out: list[str] = []
        size = 0
        for piece in compiled.generate(
            messages=_normalize_messages(messages),
            tools=_plain(tools),
            documents=_plain(documents),
            add_generation_prompt=add_generation_prompt,
            **_plain(variables),
        ):
            size += len(piece)
            _check_size(size, "the rendered prompt")
            out.append(piece)
        return "".join(out)
    except ChatTemplateError:
        raise
    except SecurityError as exc:
        raise ChatTemplateError(
            "the chat template tried an unsafe operation and was stopped by the sandbox (SecurityError: "
            f"{exc})"
        ) from exc
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"chat template error: {exc}") from exc
    except MemoryError as exc:
        raise ChatTemplateLimitError("the chat template ran out of memory while rendering") from exc
    except Exception as exc:  # a template bug (e.g. '+' on None) is a bad request, not an engine crash
        raise ChatTemplateError(f"chat template failed to render ({type(exc).__name__}: {exc})") from exc
    finally:
        sys.settrace(previous_trace)
        _limits.deadline = float("inf")


#: the conversation each template is tried on when its model loads (``probe_chat_template``)
_PROBE = [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "Hi"},
          {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}]
PROBE_TIME_LIMIT_S = 1.0


def probe_chat_template(template: str, **variables: Any) -> None:
    """Refuse, when the model loads, a template that tries to escape the sandbox or runs past a render limit
    (a loop or a recursion that never ends, an output that never stops growing): one render of a short
    conversation, bounded by ``PROBE_TIME_LIMIT_S``. Errors that depend on the conversation (the template's
    own ``raise_exception``, a syntax error a request would also meet) are left to the requests, as before."""
    try:
        render_chat_template(template, _PROBE, time_limit_s=PROBE_TIME_LIMIT_S, **variables)
    except ChatTemplateLimitError:
        raise
    except ChatTemplateError as exc:
        # an escape; a call that never ends; a range past the sandbox's cap (a loop meant not to end)
        if isinstance(exc.__cause__, (SecurityError, RecursionError, OverflowError)):
            raise


def _trace_calls(frame: FrameType, event: str, arg: Any) -> Any:
    """Trace only the compiled template's own frames, checking the deadline on each line."""
    if frame.f_code.co_filename == "<template>":
        return _trace_lines
    return None


def _trace_lines(frame: FrameType, event: str, arg: Any) -> Any:
    if event == "line":
        _over_time()
    return _trace_lines
