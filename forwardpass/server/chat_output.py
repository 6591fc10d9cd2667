"""A chat choice's text as the response shows it: reasoning split off (``reasoning_content``), tool calls
parsed out (``tool_calls``), the rest ``content`` — for whole responses and for streaming deltas.

Order as in vLLM: the reasoning parser first, then the tool parser on what is left.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from forwardpass.server.reasoning import ReasoningSplitter, split_reasoning
from forwardpass.server.tool_choice import incomplete_call_error, is_complete_json
from forwardpass.server.tools import ToolCallStreamer, forced_calls, new_call_id, parse_tool_calls


@dataclass
class ChatOutputParser:
    """``tool_mode``: None, "auto" (parse ``<tool_call>`` blocks) or "forced" (the output is constrained to
    the calls: ``tool_choice="required"`` or a named tool, given in ``tool_choice``)."""

    reasoning_parser: str | None = None
    tool_mode: str | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool = True  # False: only the first call is returned
    include_reasoning: bool = True  # False: reasoning is parsed out and not returned (vLLM)
    # the Responses API: a forced call cut short is an incomplete response (its text as content), not a 400
    incomplete_ok: bool = False
    _reasoning: ReasoningSplitter | None = field(default=None, init=False)
    _tools: ToolCallStreamer | None = field(default=None, init=False)
    _forced_text: str = field(default="", init=False)
    num_calls: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if self.reasoning_parser is not None:
            self._reasoning = ReasoningSplitter(self.reasoning_parser)
        if self.tool_mode == "auto":
            self._tools = ToolCallStreamer()

    @property
    def plain(self) -> bool:
        return self.reasoning_parser is None and self.tool_mode is None

    def message(self, text: str) -> dict[str, Any]:
        """The whole response's message."""
        msg: dict[str, Any] = {"role": "assistant"}
        content: str | None = text
        if self.reasoning_parser is not None:
            msg["reasoning_content"], content = split_reasoning(self.reasoning_parser, text)
        calls: list[dict[str, Any]] = []
        if self.tool_mode == "auto":
            content, calls = parse_tool_calls(content or "")
        elif self.tool_mode == "forced":
            self._forced_text = content or ""
            calls, content = forced_calls(self.tool_choice, self._forced_text), None
            if self.incomplete_ok and not is_complete_json(self._forced_text):
                calls, content = [], self._forced_text or None
        msg["content"] = content
        if not self.include_reasoning:
            msg.pop("reasoning_content", None)
        elif "reasoning_content" in msg:  # vLLM's newer name of the same field; clients read either
            msg["reasoning"] = msg["reasoning_content"]
        calls = calls if self.parallel_tool_calls else calls[:1]
        if calls:
            msg["tool_calls"] = calls
        self.num_calls = len(calls)
        return msg

    def delta(self, text: str, final: bool) -> dict[str, Any] | None:
        """A streaming delta (None when this text completes nothing yet)."""
        if self.plain:
            return {"content": text}
        d: dict[str, Any] = {}
        content = text
        if self._reasoning is not None:
            reasoning, content = self._reasoning.feed(text, final)
            if reasoning and self.include_reasoning:
                d["reasoning_content"] = d["reasoning"] = reasoning
        if self._tools is not None:
            content, calls = self._tools.feed(content, final)
            calls = calls if self.parallel_tool_calls else [c for c in calls if c["index"] == 0]
            if calls:
                d["tool_calls"] = calls
            self.num_calls = (len(self._tools.calls) if self.parallel_tool_calls
                              else min(len(self._tools.calls), 1))
        # named: the text is the arguments
        elif self.tool_mode == "forced" and self.incomplete_ok:  # calls only once complete (finish_reason)
            self._forced_text += content
            content = ""
            if final and is_complete_json(self._forced_text):
                calls = forced_calls(self.tool_choice, self._forced_text)
                d["tool_calls"] = [{"index": i, **c, "id": c.get("id") or new_call_id(), "type": "function"}
                                   for i, c in enumerate(calls)]
                self.num_calls = len(calls)
            elif final:
                content = self._forced_text
        elif self.tool_mode == "forced" and isinstance(self.tool_choice, dict):
            self._forced_text += content
            if content or (final and not self.num_calls):
                calls = [{"index": 0, "function": {"arguments": content}}]
                if not self.num_calls:  # the first delta names the call, as vLLM streams it
                    calls = [{"index": 0, "id": new_call_id(), "type": "function",
                              "function": {"name": self.tool_choice["function"]["name"],
                                           "arguments": content}}]
                d["tool_calls"], self.num_calls = calls, 1
            content = ""
        elif self.tool_mode == "forced":  # required: a JSON array of calls, parsed when complete
            self._forced_text += content
            content = ""
            if final:
                calls = forced_calls(self.tool_choice, self._forced_text)
                if calls:
                    d["tool_calls"] = [{"index": i, **c, "id": c.get("id") or new_call_id()}
                                       for i, c in enumerate(calls)]
                    self.num_calls = len(calls)
        if content:
            d["content"] = content
        return d or None

    def finish_reason(self, reason: str | None) -> str | None:
        """Raises (a 400, or an error event in a stream) when a forced call did not complete: the grammar
        makes the call, so only ``max_tokens`` can cut it short (``tool_choice.py``)."""
        cut_short_ok = self.incomplete_ok and reason == "length"  # Responses: status incomplete
        if self.tool_mode == "forced" and reason in ("length", "stop") and not cut_short_ok and not (
                self.num_calls and is_complete_json(self._forced_text)):
            raise incomplete_call_error(reason == "length")
        return "tool_calls" if reason == "stop" and self.num_calls else reason
