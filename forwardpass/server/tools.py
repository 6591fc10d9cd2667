"""Tool calls in the Hermes format (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, what Qwen's
chat templates ask for): parsed out of whole responses and out of streams, and the structured-output
constraints that enforce ``tool_choice="required"`` and a named tool.

* ``auto``: the model decides; ``<tool_call>`` blocks that hold valid JSON become ``tool_calls``, the
  rest stays ``content`` (a block that is not valid JSON stays content too, as vLLM does).
* ``required``: the output is constrained to a JSON array of one or more ``{"name", "parameters"}``
  objects, one of the given tools each; ``named``: to the named tool's parameters object.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from forwardpass.errors import ValidationError

START, END = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call(name: str, arguments: Any, call_id: str | None = None) -> dict[str, Any]:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": call_id or new_call_id(), "type": "function", "function": {"name": name, "arguments": args}}


def _parse_block(body: str) -> dict[str, Any] | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    return _call(obj["name"], obj.get("arguments", obj.get("parameters", {})))


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content or None, tool calls) of a whole response."""
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    pos = 0
    for m in _BLOCK.finditer(text):
        call = _parse_block(m.group(1))
        if call is None:
            continue
        kept.append(text[pos:m.start()])
        calls.append(call)
        pos = m.end()
    kept.append(text[pos:])
    content = "".join(kept).strip() if calls else text
    return (content or None) if calls else content, calls


def forced_calls(tool_choice: Any, text: str) -> list[dict[str, Any]]:
    """The tool calls of an output constrained by ``required`` (a JSON array) or a named
    tool (its arguments)."""
    value, end = leading_json(text)
    if isinstance(tool_choice, dict):  # the arguments as generated, up to where their JSON ends
        return [_call(tool_choice["function"]["name"], text if end is None else text.lstrip()[:end])]
    items = value if isinstance(value, list) else []
    return [_call(i["name"], i.get("parameters", {})) for i in items if isinstance(i, dict) and "name" in i]


def leading_json(text: str) -> tuple[Any, int | None]:
    """The JSON value the text starts with and where it ends in ``text.lstrip()`` ((None, None) if it starts
    with none): what the grammar forced, without a tail the detokenizer may add (a tokenizer whose
    end-of-sequence token is not marked special spells it)."""
    try:
        return json.JSONDecoder().raw_decode(text.lstrip())
    except ValueError:
        return None, None


def required_schema(tools: list[dict[str, Any]]) -> dict[str, Any]:
    """JSON array of one or more calls, each naming a given tool and matching its parameters (vLLM's form).

    A tool's ``$defs`` (or ``definitions``) move to the array's root, where its ``#/$defs/...`` references
    point once the parameters are nested in the array (as vLLM does); two tools defining one name differently
    are a 400 naming ``tools``."""
    params = [dict(t["function"].get("parameters") or {"type": "object"}) for t in tools]
    root: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": [
        {"type": "object", "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                                          "parameters": p},
         "required": ["name", "parameters"]} for t, p in zip(tools, params, strict=True)]}}
    for key in ("$defs", "definitions"):
        for p in params:
            defs = p.pop(key, None)
            for name, schema in (defs.items() if isinstance(defs, dict) else ()):
                if root.setdefault(key, {}).setdefault(name, schema) != schema:
                    raise ValidationError(f"two tools define {key}/{name} differently; the forced call's "
                                          "schema needs one definition per name", param="tools")
    return root


# the start of a call object up to its arguments: name first (the order Hermes templates and Qwen use)
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')


class ToolCallStreamer:
    """Streaming: text outside ``<tool_call>`` blocks passes through as content (a tail that may start a
    tag is held back). Inside a block, as in vLLM: once the name is known, a delta with the call's index,
    id and name (``arguments: ""``), then the arguments' JSON text in fragments as it arrives (the call
    object's closing brace held back until the block closes). A block whose name does not come first is
    sent whole when it closes; one that never opens a call object stays content."""

    def __init__(self) -> None:
        self.buf = ""
        self.inside = False
        self.calls: list[dict[str, Any]] = []
        self._args_at: int | None = None  # where the current block's arguments start in buf (header sent)
        self._args_sent = 0  # characters of them already sent

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        self.buf += delta
        content = ""
        new: list[dict[str, Any]] = []
        while True:
            if not self.inside:
                i = self.buf.find(START)
                if i >= 0:
                    content += self.buf[:i]
                    self.buf, self.inside = self.buf[i + len(START):], True
                    continue
                keep = 0 if final else _partial_tail(self.buf, START)
                content += self.buf[:len(self.buf) - keep]
                self.buf = self.buf[len(self.buf) - keep:]
                break
            j = self.buf.find(END)
            if j < 0:
                if self._args_at is None and (m := _HEAD.match(self.buf)):
                    call = _call(json.loads(f'"{m.group(1)}"'), "")
                    # a copy:
                    new.append({"index": len(self.calls), **call, "function": dict(call["function"])})
                    self.calls.append(call)  # the arguments accumulate in the kept call only
                    self._args_at, self._args_sent = m.end(), 0
                if self._args_at is not None:
                    new.extend(self._fragment(self._streamable()))
                elif final:  # an unclosed block: give the text back as content
                    content += START + self.buf
                    self.buf = ""
                break
            if self._args_at is not None:  # the rest of the arguments, up to the object's closing brace
                body = self.buf[self._args_at:j].strip()
                new.extend(self._fragment(body[:-1].rstrip() if body.endswith("}") else body))
                self._args_at = None
            else:
                whole = _parse_block(self.buf[:j].strip())
                if whole is None:
                    content += START + self.buf[:j + len(END)]
                else:
                    new.append({"index": len(self.calls), **whole})
                    self.calls.append(whole)
            self.buf, self.inside = self.buf[j + len(END):], False
        return content, new

    def _streamable(self) -> str:
        """The arguments text so far, less what may still be the object's closing brace or the end tag."""
        assert self._args_at is not None
        text = self.buf[self._args_at:].lstrip()
        text = text[:len(text) - _partial_tail(text, END)].rstrip()
        return text.removesuffix("}")

    def _fragment(self, args_text: str) -> list[dict[str, Any]]:
        piece = args_text[self._args_sent:]
        if not piece:
            return []
        self._args_sent = len(args_text)
        self.calls[-1]["function"]["arguments"] += piece
        return [{"index": len(self.calls) - 1, "function": {"arguments": piece}}]


def _partial_tail(text: str, tag: str) -> int:
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0
