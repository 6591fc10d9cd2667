"""Response shapes of the OpenAI-compatible routes, for the OpenAPI schema (the routes build plain dicts: no
validation cost per token)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int  # part of completion_tokens: the reasoning block, its closing tag included


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    completion_tokens_details: CompletionTokensDetails | None = None  # with a reasoning parser


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: dict[str, Any] | None = None
    finish_reason: Literal["stop", "length"] | None
    stop_reason: int | str | None = None
    # vLLM: with prompt_logprobs, None for the first prompt token, then {token id:
    # {logprob, rank, decoded_token}}
    prompt_logprobs: list[dict[str, Any] | None] | None = None
    prompt_token_ids: list[int] | None = None  # vLLM, with return_token_ids
    token_ids: list[int] | None = None  # vLLM, with return_token_ids


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    system_fingerprint: str | None = None


class ToolCallFunction(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"]
    function: ToolCallFunction


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    reasoning_content: str | None = Field(None, description="with --reasoning-parser: the <think> part")
    reasoning: str | None = Field(None, description="the same as reasoning_content (vLLM's newer name)")
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: dict[str, Any] | None = None
    finish_reason: Literal["stop", "length", "tool_calls"] | None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # vLLM, with return_token_ids


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None
    prompt_logprobs: list[dict[str, Any] | None] | None = None  # vLLM, with prompt_logprobs
    prompt_token_ids: list[int] | None = None  # vLLM, with return_token_ids


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | int | None


class ErrorResponse(BaseModel):
    error: ErrorBody
