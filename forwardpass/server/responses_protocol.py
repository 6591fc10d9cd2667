"""Request body of ``POST /v1/responses`` (OpenAI's Responses API) and its translation into the chat
request that runs it: the Responses route is a front end of the chat path, not a second engine path.

``input`` is a string (one user message) or a list of items: messages (text parts), ``function_call``
items (a previous turn's calls, passed back) and ``function_call_output`` items (their results); a
previous response's ``reasoning`` items are accepted and left out (chat templates drop old reasoning).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Self

from pydantic import Field, model_validator

from forwardpass.errors import ValidationError
from forwardpass.sampling.params import MAX_TOKENS
from forwardpass.server.config import MAX_MESSAGES
from forwardpass.server.protocol import ChatCompletionRequest
from forwardpass.server.protocol_base import ModelName, _Strict

ShortText = Annotated[str, Field(max_length=256)]


class TextPart(_Strict):
    type: Literal["input_text", "output_text", "text"]
    text: str
    annotations: list[Any] | None = None  # on output_text passed back: accepted, not used
    logprobs: list[Any] | None = None


class MessageItem(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | Annotated[list[TextPart], Field(max_length=1024)]
    id: ShortText | None = None
    status: ShortText | None = None
    phase: ShortText | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: ShortText
    name: Annotated[str, Field(min_length=1, max_length=64)]
    arguments: str
    id: ShortText | None = None
    status: ShortText | None = None


class FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: ShortText
    output: str
    id: ShortText | None = None
    status: ShortText | None = None


class ReasoningItem(_Strict):
    type: Literal["reasoning"]
    id: ShortText | None = None
    summary: list[Any] = Field(default_factory=list)
    content: list[Any] | None = None
    encrypted_content: str | None = None
    status: ShortText | None = None


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem


class FunctionTool(_Strict):
    """A Responses function tool: flat (``name`` and ``parameters`` at the top, no ``function`` object)."""

    type: Literal["function"]
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionToolChoice(_Strict):
    type: Literal["function"]
    name: Annotated[str, Field(min_length=1, max_length=64)]


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: ShortText | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    model_config = {"extra": "forbid", "strict": True, "populate_by_name": True}


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # accepted, not used


class ReasoningConfig(_Strict):
    effort: Literal["minimal", "low", "medium", "high"] | None = None  # passed to the chat template
    summary: Literal["auto", "concise", "detailed"] | None = None  # accepted, not used


class ResponsesRequest(_Strict):
    model: ModelName | None = None
    input: str | Annotated[list[InputItem], Field(min_length=1, max_length=MAX_MESSAGES)]
    instructions: str | None = Field(None, description="a system message for this turn (not carried to the "
                                                       "next one through previous_response_id)")
    max_output_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool = False
    tools: Annotated[list[FunctionTool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool | None = None
    previous_response_id: ShortText | None = None
    store: bool = True
    metadata: Annotated[dict[str, str], Field(max_length=16)] | None = None
    user: ShortText | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    truncation: Literal["disabled"] | None = Field(None, description="\"auto\" is refused: no truncation")
    include: list[str] | None = None  # accepted, not used
    service_tier: ShortText | None = None  # accepted, not used
    background: Literal[False] | None = Field(None, description="true is refused: no background responses")
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)  # vLLM's extension

    @model_validator(mode="after")
    def _check(self) -> Self:
        if isinstance(self.input, str) and not self.input:
            raise ValueError("input must not be empty")
        return self

    def chat_request(self, history: list[dict[str, Any]]) -> ChatCompletionRequest:
        """The chat request that runs this response: ``history`` (the previous responses' messages), then
        the instructions as a system message, then this input."""
        messages = [*history]
        if self.instructions:
            messages.insert(0, {"role": "system", "content": self.instructions})
        messages += self.input_messages()
        body: dict[str, Any] = {
            "messages": messages, "stream": self.stream, "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature, "top_p": self.top_p,
            "parallel_tool_calls": self.parallel_tool_calls, "user": self.user, "seed": self.seed}
        if self.model is not None:
            body["model"] = self.model
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        if self.tools:
            body["tools"] = [
                {"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})}
                for t in self.tools]
        if isinstance(self.tool_choice, FunctionToolChoice):
            body["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type == "json_schema":
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": fmt.name or "schema", "schema": fmt.schema_, "strict": fmt.strict}}
        elif fmt is not None and fmt.type == "json_object":
            body["response_format"] = {"type": "json_object"}
        if self.reasoning is not None and self.reasoning.effort is not None:
            body["reasoning_effort"] = self.reasoning.effort
        return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})

    def input_messages(self) -> list[dict[str, Any]]:
        """This turn's input as chat messages (consecutive function calls become one assistant message)."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        out: list[dict[str, Any]] = []
        for item in self.input:
            if isinstance(item, MessageItem):
                out.append({"role": item.role, "content": item.text()})
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                if out and out[-1]["role"] == "assistant" and "tool_calls" in out[-1]:
                    out[-1]["tool_calls"].append(call)
                elif out and out[-1]["role"] == "assistant":
                    out[-1]["tool_calls"] = [call]
                else:
                    out.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif isinstance(item, FunctionCallOutputItem):
                out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
        if not out:
            raise ValidationError("input has no message, function call or function call output",
                                  param="input")
        return out

    def echo_fields(self) -> dict[str, Any]:
        """The request's settings, as a response object repeats them."""
        return {
            "instructions": self.instructions, "max_output_tokens": self.max_output_tokens,
            "temperature": self.temperature if self.temperature is not None else 1.0,
            "top_p": self.top_p if self.top_p is not None else 1.0,
            "tools": [t.model_dump(exclude_none=True) for t in self.tools or []],
            "tool_choice": (self.tool_choice.model_dump() if isinstance(self.tool_choice, FunctionToolChoice)
                            else self.tool_choice or "auto"),
            "parallel_tool_calls": self.parallel_tool_calls is not False,
            "previous_response_id": self.previous_response_id, "store": self.store,
            "metadata": self.metadata or {}, "user": self.user, "truncation": "disabled",
            "text": {"format": (self.text.format.model_dump(by_alias=True, exclude_none=True)
                                if self.text is not None and self.text.format is not None
                                else {"type": "text"})},
            "reasoning": self.reasoning.model_dump() if self.reasoning is not None else None,
        }
