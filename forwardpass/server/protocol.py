"""Request bodies of the OpenAI-compatible routes (pydantic). Unknown fields are refused, as OpenAI does.

Responses are built as plain dicts in ``serving.py`` (one per SSE chunk; no validation cost per token)
and documented by the response models at the end of this file.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Self, TypeGuard, cast

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from forwardpass.sampling.params import MAX_TOKENS, MAX_TOP_K
from forwardpass.server.config import (
    MAX_LOGPROBS,
    MAX_MESSAGES,
    MAX_N,
    MAX_PROMPTS,
    MAX_STOP_LENGTH,
    MAX_STOP_STRINGS,
)

StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_LENGTH)]
TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]
ModelName = Annotated[str, Field(min_length=1, max_length=256)]


def _has_lone_surrogate(value: Any) -> bool:
    """A str that cannot be encoded as UTF-8 (JSON allows ``"\\udc80"``; tokenizers and responses do not)."""
    if isinstance(value, str):
        if value.isascii():
            return False
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(value, (list, tuple)):
        return any(_has_lone_surrogate(v) for v in value)
    if isinstance(value, dict):
        return any(_has_lone_surrogate(k) or _has_lone_surrogate(v) for k, v in value.items())
    return False


class _Strict(BaseModel):
    """Unknown fields refused; no coercion (``"16"`` is not an int, ``true`` is not a number); text that
    is not valid Unicode (a lone surrogate) refused with a 400 naming the field."""

    model_config = ConfigDict(extra="forbid", strict=True)

    @field_validator("*", mode="after")
    @classmethod
    def _valid_unicode(cls, v: Any) -> Any:
        if _has_lone_surrogate(v):
            raise ValueError("must be valid Unicode text (a lone surrogate such as \\udc80 cannot be encoded as UTF-8)")
        return v


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingRequest(_Strict):
    model: ModelName | None = Field(None, description="a served model name (GET /v1/models); default: the first")
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=MAX_TOP_K, description="-1 or 0 disable top-k; at most the vocabulary")
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: StopString | list[StopString] | None = Field(None, max_length=MAX_STOP_STRINGS)
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=MAX_TOKENS)
    user: str | None = Field(None, max_length=256)
    logit_bias: dict[str, float] | None = Field(None, description="not supported: must be empty")

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v:
            raise ValueError("logit_bias is not supported by this server")
        return v


class CompletionRequest(_SamplingRequest):
    prompt: (
        Annotated[str, Field(min_length=1)]
        | Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=MAX_PROMPTS)]
        | Annotated[list[TokenId], Field(min_length=1)]
        | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1, max_length=MAX_PROMPTS)]
    )
    max_tokens: int | None = Field(16, ge=1, le=MAX_TOKENS, description="null: up to the context window")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_N)

    @model_validator(mode="after")
    def _unsupported(self) -> Self:
        if self.echo:
            raise ValueError("echo is not supported by this server")
        if self.suffix:
            raise ValueError("suffix is not supported by this server")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of must equal n (best-of sampling is not supported)")
        return self

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if _is_token_ids(p):
            return [list(p)]
        return list(cast("list[str] | list[list[int]]", p))  # the rest of the validated union


def _is_token_ids(p: list[str] | list[int] | list[list[int]]) -> TypeGuard[list[int]]:
    """One prompt of token ids (pydantic has validated the union: an int first means all ints)."""
    return bool(p) and isinstance(p[0], int)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = Field(None, description="text, or a list of text parts")
    name: Annotated[str, Field(max_length=256)] | None = None
    tool_call_id: Annotated[str, Field(max_length=256)] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS, description="deprecated alias of max_completion_tokens")
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    chat_template: str | None = Field(None, description="refused: the model's own template is always used")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="refused")

    @model_validator(mode="after")
    def _unsupported(self) -> Self:
        if self.chat_template is not None or self.chat_template_kwargs is not None:
            raise ValueError("request-supplied chat templates (chat_template, chat_template_kwargs) are refused; "
                             "the model's own chat template is used")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise ValueError("response_format other than {'type': 'text'} is not supported")
        if self.tools:
            raise ValueError("tools are not supported by this server")
        if self.tool_choice not in (None, "none", "auto"):
            raise ValueError("tool_choice is not supported by this server")
        return self


class TokenizeRequest(_Strict):
    model: ModelName | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1, max_length=MAX_MESSAGES)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_of(self) -> Self:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeRequest(_Strict):
    model: ModelName | None = None
    tokens: list[TokenId] = Field(max_length=1 << 20)


# ----- response shapes (documentation; the routes build dicts) ---------------------------------------
class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: dict[str, Any] | None = None
    finish_reason: Literal["stop", "length"] | None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    system_fingerprint: str | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: dict[str, Any] | None = None
    finish_reason: Literal["stop", "length"] | None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | int | None


class ErrorResponse(BaseModel):
    error: ErrorBody
