"""Request bodies of the OpenAI-compatible routes (pydantic). Unknown fields are refused, as OpenAI does.

Responses are built as plain dicts in ``serving.py`` (one per SSE chunk; no validation cost per token)
and documented by the response models at the end of this file.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Self, TypeGuard, cast

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from forwardpass.server.config import MAX_LOGPROBS, MAX_N, MAX_PROMPTS, MAX_STOP_LENGTH, MAX_STOP_STRINGS

StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_LENGTH)]
TokenId = Annotated[int, Field(ge=0)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingRequest(_Strict):
    model: str | None = Field(None, description="a served model name (GET /v1/models); default: the first")
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, description="-1 or 0 disable top-k")
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
    min_tokens: int = Field(0, ge=0)
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
    max_tokens: int | None = Field(16, ge=1, description="null: up to the context window")
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
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, description="deprecated alias of max_completion_tokens")
    max_completion_tokens: int | None = Field(None, ge=1)
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
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_of(self) -> Self:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeRequest(_Strict):
    model: str | None = None
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
