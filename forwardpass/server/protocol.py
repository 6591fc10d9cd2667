"""Request bodies of the OpenAI-compatible routes (pydantic). Unknown fields are refused, as OpenAI does.

Responses are built as plain dicts in ``serving.py`` (one per SSE chunk; no validation cost per token)
and documented by the models in ``response_models.py``. The strict base and vLLM's extra fields are in
``protocol_base.py``.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Self, TypeGuard, cast

from pydantic import ConfigDict, Field, PrivateAttr, field_validator, model_validator

from forwardpass.errors import ValidationError
from forwardpass.sampling.params import MAX_LOGIT_BIAS, MAX_TOKENS, MAX_TOP_K
from forwardpass.server.config import (
    MAX_MESSAGES,
    MAX_N,
    MAX_PROMPTS,
    MAX_STOP_LENGTH,
    MAX_STOP_STRINGS,
)
from forwardpass.server.protocol_base import (
    MAX_LOGPROBS_FIELD,
    SEED_MAX,
    SEED_MIN,
    ModelName,
    OpenAIChatExtras,
    TokenId,
    VllmExtras,
    _has_lone_surrogate,
    _Strict,
)
from forwardpass.structured.params import MAX_CHOICES, StructuredOutputsParams

StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_LENGTH)]


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage on every chunk too


class JsonSchemaFormat(_Strict):
    name: Annotated[str, Field(max_length=256)] = "schema"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


class ResponseFormat(_Strict):
    """OpenAI's ``response_format``: text, any JSON object, or JSON that follows a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> Self:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs a json_schema object")
        return self


class StructuredOutputsRequest(_Strict):
    """vLLM's ``structured_outputs``: exactly one constraint."""

    json_: str | dict[str, Any] | None = Field(None, alias="json")
    regex: str | None = None
    choice: Annotated[list[str], Field(min_length=1, max_length=MAX_CHOICES)] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    disable_fallback: bool = False  # accepted for vLLM clients; there is one backend (xgrammar)
    disable_additional_properties: bool = False  # accepted for vLLM clients; schemas are used as given

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


class _SamplingRequest(VllmExtras):
    model: ModelName | None = Field(None,
                                    description="a served model name (GET /v1/models); none or \"\": the "
                                                "first")
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=MAX_TOP_K,
                              description="-1 or 0 disable top-k; at most the vocabulary")
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: StopString | list[StopString] | None = Field(None, max_length=MAX_STOP_STRINGS)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=MAX_TOKENS)
    user: str | None = Field(None, max_length=256)
    logit_bias: dict[str, float] | None = Field(
        None, max_length=1 << 16, description="token id (as a string) -> bias in [-100, 100] added to its "
                                              "logit")
    allowed_token_ids: Annotated[list[TokenId], Field(min_length=1, max_length=1 << 20)] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: str | dict[str, Any] | None = Field(None,
                                                     description="older vLLM form of structured_outputs.json")
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(min_length=1, max_length=MAX_CHOICES)] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = Field(None, description="ignored: xgrammar is the only backend")

    return_tokens_as_token_ids: bool = False  # vLLM: logprob tokens as "token_id:N" (no decoding)
    prompt_logprobs: int | None = Field(None, ge=-1, le=MAX_LOGPROBS_FIELD, description="vLLM: each prompt "
                                        "token's logprob and the k most likely tokens at its position (-1: "
                                        "all; at most the server's --max-logprobs)")

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> Self:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream: true")
        return self

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        bad = [k for k in (v or {}) if not (k.isascii() and k.isdigit() and len(k) <= 10)]
        if bad:  # every bad key named (the first eight), as vLLM does, so a client can fix them at once
            raise ValueError("logit_bias keys must be token ids (digit strings); got "
                             + ", ".join(f"{k!r:.40}" for k in bad[:8]) + (" ..." if len(bad) > 8 else ""))
        for k, bias in (v or {}).items():
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias values must be in [-100, 100]; token {k} has {bias}")
        return v

    def _extra_constraint(self, token_budget: int | None) -> dict[str, Any] | None:
        return None

    def logit_bias_ids(self) -> dict[int, float] | None:
        return {int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None

    def structured(self, token_budget: int | None = None) -> StructuredOutputsParams | None:
        """The request's one output constraint (validated by xgrammar: a 400 says what is wrong), or None.
        ``token_budget``: the output tokens a forced tool call must fit in."""
        forms: dict[str, dict[str, Any]] = {}
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            forms["response_format"] = {"json_object": True}
        elif rf is not None and rf.type == "json_schema" and rf.json_schema is not None:
            schema = rf.json_schema.schema_
            forms["response_format"] = {"json": schema} if schema is not None else {"json_object": True}
        if self.structured_outputs is not None:
            so = self.structured_outputs
            forms["structured_outputs"] = {
                "json": so.json_, "regex": so.regex, "choice": so.choice, "grammar": so.grammar,
                "json_object": bool(so.json_object), "structural_tag": so.structural_tag,
                "disable_any_whitespace": so.disable_any_whitespace}
        for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                          ("guided_grammar", "grammar")):
            if getattr(self, name) is not None:
                forms[name] = {key: getattr(self, name)}
        if (extra := self._extra_constraint(token_budget)) is not None:
            forms["tool_choice"] = extra
        if not forms:
            return None
        if len(forms) > 1:
            raise ValidationError(f"give one output constraint, not several: {', '.join(forms)}",
                                  param=next(iter(forms)))
        name, kwargs = next(iter(forms.items()))
        try:
            return StructuredOutputsParams(**kwargs)
        except ValidationError as exc:  # name the request's own field
            raise type(exc)(exc.message.replace("structured_outputs", name, 1) if name != "structured_outputs"
                            else exc.message,
                            param=name if name != "structured_outputs" else exc.param) from None


class CompletionRequest(_SamplingRequest):
    prompt: (
        Annotated[str, Field(min_length=1)]
        | Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=MAX_PROMPTS)]
        | Annotated[list[TokenId], Field(min_length=1)]
        | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]],
                    Field(min_length=1, max_length=MAX_PROMPTS)]
    )
    max_tokens: int | None = Field(16, ge=1, le=MAX_TOKENS, description="null: up to the context window")
    logprobs: int | None = Field(None, ge=-1, le=MAX_LOGPROBS_FIELD,
                                 description="at most the server's --max-logprobs (-1: all, when it is -1)")
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    add_special_tokens: bool = True  # vLLM: the tokenizer's BOS etc. around a text prompt
    prompt_embeds: Any = Field(None, description="refused: prompts are text or token ids")

    @field_validator("prompt_embeds")
    @classmethod
    def _no_embeds(cls, v: Any) -> Any:
        if v is not None:
            raise ValueError("prompt_embeds are not supported by this server; send text or token ids")
        return v

    @model_validator(mode="after")
    def _unsupported(self) -> Self:
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


#: At most this many extra fields per message (vLLM passes a message's unknown keys to the template).
MAX_EXTRA_MESSAGE_FIELDS = 16


class ChatMessage(_Strict):
    """A chat message. As vLLM: any role (the usual five, or a custom one the model's template knows, e.g.
    ``ipython``), and extra fields passed through to the chat template (bounded in number and name)."""

    model_config = ConfigDict(extra="allow", strict=True)

    role: Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_.-]{0,63}$")]
    content: str | list[TextPart] | None = Field(None, description="text, or a list of text parts")
    name: Annotated[str, Field(max_length=256)] | None = None
    tool_call_id: Annotated[str, Field(max_length=256)] | None = None
    tool_calls: Annotated[list[dict[str, Any]], Field(max_length=128)] | None = None
    reasoning_content: str | None = None

    @model_validator(mode="after")
    def _bounded_extras(self) -> Self:
        extra = self.model_extra or {}
        if len(extra) > MAX_EXTRA_MESSAGE_FIELDS:
            raise ValueError(f"a message may carry at most {MAX_EXTRA_MESSAGE_FIELDS} extra fields, got "
                             f"{len(extra)}")
        for key, value in extra.items():
            if not (key.isidentifier() and len(key) <= 64):
                raise ValueError("extra message field names must be identifiers of at most 64 characters: "
                                 f"{key!r}")
            if _has_lone_surrogate(value):
                raise ValueError(f"{key} must be valid Unicode text")
        return self

    def template_dict(self) -> dict[str, Any]:
        """The message as chat templates read it (tool-call arguments as objects, as vLLM passes them)."""
        d: dict[str, Any] = {**(self.model_extra or {}),
                             "role": "system" if self.role == "developer" else self.role,
                             "content": self.text()}
        for key in ("name", "tool_call_id", "reasoning_content"):
            if getattr(self, key) is not None:
                d[key] = getattr(self, key)
        if self.tool_calls is not None:
            d["tool_calls"] = [_with_parsed_arguments(c) for c in self.tool_calls]
        return d

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


#: template variables the server sets itself
RESERVED_TEMPLATE_NAMES = {"messages", "add_generation_prompt", "time_limit_s", "max_output_chars", "tools",
                           "bos_token", "eos_token", "unk_token", "pad_token"}


def _with_parsed_arguments(call: dict[str, Any]) -> dict[str, Any]:
    fn = call.get("function")
    if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
        try:
            return {**call, "function": {**fn, "arguments": json.loads(fn["arguments"])}}
        except ValueError:
            pass
    return call


class ToolFunction(_Strict):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: ToolFunction


class NamedFunction(_Strict):
    name: Annotated[str, Field(min_length=1, max_length=64)]


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingRequest, OpenAIChatExtras):
    # set by the Responses route: a forced tool call cut short answers "incomplete" there, not a 400
    _incomplete_call_ok: bool = PrivateAttr(False)
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS,
                                   description="deprecated alias of max_completion_tokens")
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    logprobs: Annotated[bool, Field(strict=False)] = False  # vLLM's clients send "true" too
    top_logprobs: int | None = Field(None, ge=-1, le=MAX_LOGPROBS_FIELD,
                                     description="at most the server's --max-logprobs (-1: all)")
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM: the last (assistant) message is continued, not closed
    add_special_tokens: bool = False  # vLLM: the template writes any BOS; true adds the tokenizer's too
    # vLLM: the response starts with the last message's content (when its role is assistant)
    echo: bool = False
    chat_template: str | None = Field(None, description="refused: the model's own template is always used")
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, max_length=64, description="extra template variables, e.g. {\"enable_thinking\": false}")
    max_reasoning_tokens: int | None = Field(
        None, ge=0, le=MAX_TOKENS, description="thinking budget: the "
        "reasoning's closing tag is forced after this many reasoning tokens (needs --reasoning-parser); "
        "max_completion_tokens still covers reasoning + answer")
    thinking_token_budget: int | None = Field(None, ge=0, le=MAX_TOKENS,
                                              description="vLLM's name of max_reasoning_tokens")

    @field_validator("use_beam_search")
    @classmethod
    def _no_beams(cls, v: bool) -> bool:
        if v:  # vLLM has it on both routes; here the completions route only (server/beam_search.py)
            raise ValueError("beam search is supported on /v1/completions only, not on this route")
        return v

    @model_validator(mode="after")
    def _unsupported(self) -> Self:
        if self.chat_template is not None:
            raise ValueError("request-supplied chat templates (chat_template) are refused; "
                             "the model's own chat template is used")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message needs add_generation_prompt: false")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ValueError("continue_final_message needs the last message to be the assistant's")
        reserved = set(self.chat_template_kwargs or ()) & RESERVED_TEMPLATE_NAMES
        if reserved:
            raise ValueError(f"chat_template_kwargs may not set {', '.join(sorted(reserved))}")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        if self.thinking_token_budget is not None and self.max_reasoning_tokens is not None:
            raise ValueError("give max_reasoning_tokens or thinking_token_budget (its vLLM name), not both")
        names = [t.function.name for t in self.tools or []]
        if self.tool_choice is not None and self.tool_choice != "none" and not names:
            raise ValueError("tool_choice needs tools")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise ValueError(f"tool_choice names {self.tool_choice.function.name!r}, which is not in tools")
        return self

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    def tool_mode(self) -> str | None:
        """None (no tool parsing), "auto" (parse <tool_call> blocks) or "forced" (required / a named tool)."""
        if not self.tools or self.tool_choice == "none":
            return None
        return "auto" if self.tool_choice in (None, "auto") else "forced"

    def _extra_constraint(self, token_budget: int | None) -> dict[str, Any] | None:
        from forwardpass.server.tool_choice import forced_tool_constraint

        if self.tool_mode() != "forced" or not self.tools:
            return None
        named = self.tool_choice.function.name if isinstance(self.tool_choice, NamedToolChoice) else None
        return forced_tool_constraint(self.tool_dicts() or [], named, self.parallel_tool_calls is not False,
                                      token_budget)


class TokenizeRequest(_Strict):
    """vLLM's ``/tokenize``: a prompt, or a chat request's messages (with its tools, template variables and
    documents: the prompt the chat route would build)."""

    model: ModelName | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1, max_length=MAX_MESSAGES)
    add_special_tokens: bool | None = Field(None, description="default: true for a prompt, false for "
                                                                "messages")
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    chat_template_kwargs: dict[str, Any] | None = Field(None, max_length=64)
    documents: Annotated[list[dict[str, Any]], Field(max_length=64)] | None = None
    return_token_strs: bool = False  # vLLM: the token strings too

    @model_validator(mode="after")
    def _one_of(self) -> Self:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        if self.messages is None and (self.tools or self.chat_template_kwargs or self.documents
                                      or self.continue_final_message):
            raise ValueError("tools, chat_template_kwargs, documents and continue_final_message need "
                             "messages")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message needs add_generation_prompt: false")
        if reserved := set(self.chat_template_kwargs or ()) & RESERVED_TEMPLATE_NAMES:
            raise ValueError(f"chat_template_kwargs may not set {', '.join(sorted(reserved))}")
        return self

    def template_kwargs(self) -> dict[str, Any]:
        tools = [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None
        return {**(self.chat_template_kwargs or {}), **({"tools": tools} if tools else {}),
                **({"documents": self.documents} if self.documents is not None else {})}


class DetokenizeRequest(_Strict):
    model: ModelName | None = None
    tokens: list[TokenId] = Field(max_length=1 << 20)
