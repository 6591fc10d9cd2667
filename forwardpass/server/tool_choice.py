"""The constraint behind ``tool_choice: "required"`` and a named tool: a grammar that forces a call and is
bounded so that the call completes within what the output may use.

The schema alone forces the shape, not an end: a weak model (the embedded one) given ``{"city": {"type":
"string"}}`` writes prose into the string until ``max_tokens`` and the response has no call at all. So the
schema is bounded before it is compiled: compact JSON (no free whitespace), every string without a bound of
its own gets ``maxLength``, every array ``maxItems`` (``required`` without ``parallel_tool_calls`` makes one
call). The string bound shares what the output budget leaves after the longest structure (names, keys,
enum values, numbers counted at 24 characters) among the strings the schema can hold, counting one token
per character (a weak model may spell the structure out one character at a time). Values the
client bounded (``maxLength``, ``enum``, ``const``, ``pattern``, ``format``) are kept as given.

What the bound cannot cover (a model that spends many tokens per character, unbounded numbers) ends as an
incomplete call at ``max_tokens``: the route then answers with a 400 naming ``max_tokens``
(``incomplete_call_error``), never an empty message with ``finish_reason: "length"``.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from forwardpass.errors import ValidationError
from forwardpass.server.tools import leading_json, required_schema

#: a string value is never bounded below this many characters, nor above the second
MIN_STRING_CHARS, MAX_STRING_CHARS = 8, 4096
#: below this many characters per string, several calls and long arrays give way to one call, short arrays
ROOMY_STRING_CHARS = 64
#: arrays without ``maxItems`` (tool calls of ``required`` with parallel calls included)
MAX_ITEMS = 4
_BOUNDED_STRING = ("maxLength", "enum", "const", "pattern", "format")


def forced_tool_constraint(tools: list[dict[str, Any]], named: str | None, parallel: bool,
                           token_budget: int | None) -> dict[str, Any]:
    """``StructuredOutputsParams`` keyword arguments: the named tool's parameters object, or (``required``)
    a JSON array of ``{"name", "parameters"}`` calls, bounded to fit ``token_budget`` output tokens (when
    several calls and full arrays leave strings less than ``ROOMY_STRING_CHARS``, one call with arrays of one
    item, or their ``minItems``)."""
    try:
        for items, enough in ((MAX_ITEMS, ROOMY_STRING_CHARS), (1, 0)):
            schema = _unbounded_form(tools, named, parallel and items > 1)
            _bound_arrays(schema, items)
            chars = _string_chars(schema, token_budget)
            if chars >= enough:
                break
        _bound_strings(schema, min(MAX_STRING_CHARS, max(MIN_STRING_CHARS, chars)))
    except RecursionError:  # copying a schema nested hundreds deep
        raise ValidationError("a tool's parameters schema is nested too deeply", param="tools") from None
    return {"json": schema, "disable_any_whitespace": True}


def _unbounded_form(tools: list[dict[str, Any]], named: str | None, parallel: bool) -> dict[str, Any]:
    if named is not None:
        tool = next(t for t in tools if t["function"]["name"] == named)
        return copy.deepcopy(tool["function"].get("parameters") or {"type": "object"})
    schema = required_schema(copy.deepcopy(tools))
    schema["maxItems"] = MAX_ITEMS if parallel else 1
    return schema


def _string_chars(schema: dict[str, Any], token_budget: int | None) -> int:
    """Characters each unbounded string may take so that the whole value fits the budget, counting one
    token per character (a weak model may spell the structure out one character at a time)."""
    if token_budget is None:
        return MAX_STRING_CHARS
    slots = _string_slots(schema)
    room = token_budget - _max_chars(schema)
    if slots == 0:  # nothing to share: only whether the structure fits
        return MAX_STRING_CHARS if room >= 0 else -1
    return room // slots


def incomplete_call_error(max_tokens_hit: bool) -> ValidationError:
    why = "max_tokens" if max_tokens_hit else "the output's end"
    return ValidationError(f"tool_choice forces a tool call, and {why} came before the call was complete; "
                           "raise max_tokens (max_completion_tokens)", param="max_tokens")


def is_complete_json(text: str) -> bool:
    return leading_json(text)[1] is not None


def _dict(node: dict[str, Any], key: str) -> dict[str, Any]:
    value = node.get(key)
    return value if isinstance(value, dict) else {}


def _list(node: dict[str, Any], key: str) -> list[Any]:
    value = node.get(key)
    return value if isinstance(value, list) else []


def _int(node: dict[str, Any], key: str, default: int) -> int:
    """A count the schema gives (a malformed one is xgrammar's to refuse, with a 400, not ours)."""
    value = node.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else default


def _children(node: dict[str, Any]) -> list[tuple[Any, bool]]:
    """(sub-schema, is an alternative) pairs of a schema node."""
    out: list[tuple[Any, bool]] = [(v, False) for v in _dict(node, "properties").values()]
    for key in ("items", "additionalProperties", "contains"):
        if isinstance(node.get(key), dict):
            out.append((node[key], False))
    out += [(v, False) for v in _list(node, "prefixItems")]
    out += [(v, True) for key in ("anyOf", "oneOf") for v in _list(node, key)]
    out += [(v, False) for v in _list(node, "allOf")]
    for key in ("$defs", "definitions"):
        out += [(v, True) for v in _dict(node, key).values()]
    return out


def _types(node: dict[str, Any]) -> set[str]:
    t = node.get("type")
    if isinstance(t, str):
        return {t}
    return {x for x in t if isinstance(x, str)} if isinstance(t, list) else set()


#: schema nesting the bounds reach into (deeper parts are left as given)
_MAX_DEPTH = 32


def _bound_arrays(node: Any, items: int, depth: int = 0) -> None:
    if not isinstance(node, dict) or depth > _MAX_DEPTH:
        return
    if "array" in _types(node):
        node["maxItems"] = max(min(_int(node, "maxItems", items), items), _int(node, "minItems", 0))
    for child, _ in _children(node):
        _bound_arrays(child, items, depth + 1)


def _bound_strings(node: Any, chars: int, depth: int = 0) -> None:
    if not isinstance(node, dict) or depth > _MAX_DEPTH:
        return
    if "string" in _types(node) and not any(k in node for k in _BOUNDED_STRING):
        node["maxLength"] = max(chars, _int(node, "minLength", 0))
    for child, _ in _children(node):
        _bound_strings(child, chars, depth + 1)


def _string_slots(node: Any, depth: int = 0) -> int:
    """How many unbounded strings one value of this schema can hold (arrays count ``maxItems`` times,
    alternatives their largest)."""
    if not isinstance(node, dict) or depth > _MAX_DEPTH:
        return 0
    own = int("string" in _types(node) and not any(k in node for k in _BOUNDED_STRING))
    together = alternatives = 0
    for child, alternative in _children(node):
        n = _string_slots(child, depth + 1)
        if alternative:
            alternatives = max(alternatives, n)
        else:
            together += n
    if "array" in _types(node):
        together *= _int(node, "maxItems", MAX_ITEMS)
    return own + together + alternatives


#: characters assumed for a value whose length the schema does not bound (a number, a pattern, any JSON)
_OTHER_CHARS = 24


def _max_chars(node: Any, depth: int = 0) -> int:
    """The longest compact JSON text of a value of this schema, unbounded strings counted as ``""``."""
    if not isinstance(node, dict) or depth > _MAX_DEPTH:
        return _OTHER_CHARS
    if "enum" in node or "const" in node:
        values = _list(node, "enum") or [node.get("const")]
        return max(len(json.dumps(v, ensure_ascii=False)) for v in values)
    options = [_max_chars(v, depth + 1) for key in ("anyOf", "oneOf", "allOf") for v in _list(node, key)]
    types = _types(node) or ({"object"} if "properties" in node else set())
    for t in types:
        if t == "string":
            options.append(_int(node, "maxLength", 0) + 2 if "pattern" not in node and "format" not in node
                           else _OTHER_CHARS)
        elif t == "object":
            props = _dict(node, "properties")
            options.append(2 + sum(len(json.dumps(k)) + 2 + _max_chars(v, depth + 1)
                                   for k, v in props.items()))
        elif t == "array":
            item = node.get("items") if isinstance(node.get("items"), dict) else {}
            options.append(2 + _int(node, "maxItems", MAX_ITEMS) * (_max_chars(item, depth + 1) + 1))
        else:  # number, integer, boolean, null
            options.append({"boolean": 5, "null": 4}.get(t, _OTHER_CHARS))
    return max(options, default=_OTHER_CHARS)
