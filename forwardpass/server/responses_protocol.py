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
from forwardpass.sampling.params import MAX_TOKENS, MAX_TOP_K
from forwardpass.server.config import MAX_MESSAGES
from forwardpass.server.protocol import ChatCompletionRequest
from forwardpass.server.protocol_base import MAX_LOGPROBS_FIELD, ModelName, ReasoningEffort, _Strict

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


class NamespaceTool(_Strict):
    """A group of function tools under a name (vLLM's and Codex's ``namespace`` tool): the model sees each as
    ``NAMESPACE__NAME``; the call comes back as ``name`` with ``namespace``."""

    type: Literal["namespace"]
    name: Annotated[str, Field(min_length=1, max_length=30, pattern=r"^[A-Za-z0-9_.:-]+$")]
    description: str | None = None
    tools: Annotated[list[FunctionTool], Field(min_length=1, max_length=128)]

    @model_validator(mode="after")
    def _fits(self) -> Self:
        for t in self.tools:
            if len(flat_name(self.name, t.name)) > 64:
                raise ValueError(f"namespace {self.name!r} + tool {t.name!r}: the flat name "
                                 f"{flat_name(self.name, t.name)!r} is longer than 64 characters")
        return self


#: how a namespaced tool is named to the model (vLLM's separator)
NAMESPACE_SEPARATOR = "__"


def flat_name(namespace: str, name: str) -> str:
    return f"{namespace}{NAMESPACE_SEPARATOR}{name}"


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
    effort: ReasoningEffort | None = None  # passed to the chat template ("none": no thinking)
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
    tools: Annotated[list[FunctionTool | NamespaceTool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool | None = None
    previous_response_id: ShortText | None = None
    store: bool = True
    metadata: Annotated[dict[str, str], Field(max_length=16)] | None = None
    user: ShortText | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    truncation: Literal["disabled"] | None = Field(None, description="\"auto\" is refused: no truncation")
    include: Annotated[list[ShortText], Field(max_length=16)] | None = Field(
        None, description="\"message.output_text.logprobs\": each output_text part's logprobs")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS_FIELD,
                                     description="the k most likely tokens at each output position")
    service_tier: ShortText | None = None  # accepted, not used
    background: bool | None = Field(None, description="answer at once (status queued); GET the response "
                                                      "later; needs store")
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)  # vLLM's extension
    # vLLM's extensions: sampling, template variables, the raw prompt and output
    top_k: int | None = Field(None, ge=-1, le=MAX_TOP_K)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    chat_template_kwargs: dict[str, Any] | None = Field(None, max_length=64)
    enable_response_messages: bool = Field(False, description="input_messages / output_messages: the "
                                                              "prompt and the output as text and token ids")
    request_id: ShortText | None = None  # accepted, not used

    @model_validator(mode="after")
    def _check(self) -> Self:
        if isinstance(self.input, str) and not self.input:
            raise ValueError("input must not be empty")
        if self.background and not self.store:
            raise ValueError("background can only be used when `store` is true")
        if self.background and self.stream:
            raise ValueError("background responses are not streamed here: send stream false and GET the "
                             "response")
        return self

    def wants_logprobs(self) -> bool:
        return self.top_logprobs is not None or "message.output_text.logprobs" in (self.include or ())

    def namespaces(self) -> dict[str, tuple[str, str]]:
        """flat tool name -> (namespace, name), for the namespaced tools."""
        return {flat_name(t.name, f.name): (t.name, f.name)
                for t in self.tools or [] if isinstance(t, NamespaceTool) for f in t.tools}

    def function_tools(self) -> list[dict[str, Any]]:
        """The tools as chat tools (namespaced ones under their flat names)."""
        out = []
        for t in self.tools or []:
            group = t.tools if isinstance(t, NamespaceTool) else [t]
            for f in group:
                fn = f.model_dump(exclude_none=True, exclude={"type"})
                if isinstance(t, NamespaceTool):
                    fn["name"] = flat_name(t.name, f.name)
                out.append({"type": "function", "function": fn})
        return out

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
            "parallel_tool_calls": self.parallel_tool_calls, "user": self.user, "seed": self.seed,
            "top_k": self.top_k, "min_p": self.min_p, "repetition_penalty": self.repetition_penalty,
            "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
            "chat_template_kwargs": self.chat_template_kwargs,
            "return_token_ids": True if self.enable_response_messages else None}
        if self.wants_logprobs():
            body.update(logprobs=True, top_logprobs=self.top_logprobs or 0)
        if self.model is not None:
            body["model"] = self.model
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        if self.tools:
            body["tools"] = self.function_tools()
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
        chat = ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
        chat._incomplete_call_ok = True  # a forced call cut short: status incomplete, as OpenAI answers
        return chat

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
