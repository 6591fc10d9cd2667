"""The strict base of every request model, and vLLM's extra request fields (accepted as vLLM accepts them:
honoured where the engine can, ignored where they change nothing here, a 400 naming the field where a value
asks for something this server does not do).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from forwardpass.sampling.params import MAX_TOKENS

TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]
#: "" (or no model at all) means the served model, as vLLM reads it
ModelName = Annotated[str, Field(max_length=256)]
#: any signed or unsigned 64-bit seed (vLLM's and OpenAI's clients send either); see ``engine_seed``
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
#: vLLM's reasoning_effort values (OpenAI's, and DeepSeek's "max")
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]
#: tokens one request may pin with logprob_token_ids
MAX_PINNED = 256
#: the bound of the logprobs fields before the server's --max-logprobs and the vocabulary apply
MAX_LOGPROBS_FIELD = 1 << 24


def engine_seed(seed: int) -> int:
    """A request's 64-bit seed as the engine's: taken modulo 2**64 (-1 and 2**64 - 1 are one seed), then its
    high 32 bits folded into the low 32 (multiplied by an odd constant, so high bits 0 change nothing).
    torch's CPU generator reads only the low 32 bits of a seed: unfolded, 1, 2**40 + 1 and 2**63 + 1 would
    all sample alike. Seeds below 2**32 are the engine's seeds as they are (the Python API's with them)."""
    s = seed & 0xFFFF_FFFF_FFFF_FFFF
    return (s & 0xFFFF_FFFF) ^ (((s >> 32) * 0x9E37_79B1) & 0xFFFF_FFFF)


def _has_lone_surrogate(value: Any) -> bool:
    """A str that cannot be encoded as UTF-8 (JSON allows ``"\\udc80"``; tokenizers and responses do not).
    Walked with a stack, not recursion: a deeply nested body must be a 400, not a RecursionError."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            if not v.isascii():
                try:
                    v.encode("utf-8")
                except UnicodeEncodeError:
                    return True
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
    return False


class _Strict(BaseModel):
    """Unknown fields refused; no coercion (``"16"`` is not an int, ``true`` is not a number); text that
    is not valid Unicode (a lone surrogate) refused with a 400 naming the field."""

    model_config = ConfigDict(extra="forbid", strict=True)

    @field_validator("*", mode="after")
    @classmethod
    def _valid_unicode(cls, v: Any) -> Any:
        if _has_lone_surrogate(v):
            raise ValueError("must be valid Unicode text (a lone surrogate such as \\udc80 cannot be encoded "
                             "as UTF-8)")
        return v


def _refuse(what: str) -> ValueError:
    return ValueError(f"{what} is not supported by this server")


class VllmExtras(_Strict):
    """vLLM's sampling extras, on both generation routes (``/v1/completions``, ``/v1/chat/completions``)."""

    use_beam_search: bool = Field(False, description="/v1/completions: the n best beams (beam_search.py); "
                                                      "refused on the chat route")
    length_penalty: float = Field(1.0, description="beam search: ranks beams by logprob / length ** this")
    stop_token_ids: Annotated[list[TokenId], Field(max_length=1024)] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = Field(
        True, description="accepted: special tokens are decoded as the tokenizer writes them")
    truncate_prompt_tokens: int | None = Field(
        None, ge=-1, le=MAX_TOKENS,
        description="keep only the prompt's last N tokens (-1: the context window)")
    priority: int = Field(0, description="0 only: no priority scheduling")
    request_id: Annotated[str, Field(max_length=256)] | None = Field(None, description="accepted, not used")
    cache_salt: Annotated[str, Field(min_length=1, max_length=1024)] | None = Field(
        None, description="accepted, not used: the prefix cache is not salted")
    bad_words: list[str] | None = None
    logits_processors: list[Any] | None = None
    watermarking: bool | None = None
    vllm_xargs: dict[str, Any] | None = Field(None, max_length=64, description="accepted, not used")
    kv_transfer_params: dict[str, Any] | None = Field(None, description="accepted, not used")
    return_token_ids: bool | None = Field(None, description="prompt_token_ids and each choice's token_ids")
    truncation_side: Literal["left", "right"] | None = Field(
        None, description="with truncate_prompt_tokens: keep the prompt's last tokens (left, the default) or "
                          "its first (right)")
    logprob_token_ids: Annotated[list[TokenId], Field(min_length=1, max_length=MAX_PINNED)] | None = Field(
        None, description="with logprobs: each position's top logprobs are these tokens' (and the chosen "
                          "one's) instead of the most likely")

    @field_validator("priority")
    @classmethod
    def _no_priority(cls, v: int) -> int:
        if v != 0:
            raise _refuse("priority scheduling (a priority other than 0)")
        return v

    @field_validator("bad_words", "logits_processors")
    @classmethod
    def _empty_only(cls, v: list[Any] | None) -> list[Any] | None:
        if v:
            raise _refuse("this field (a non-empty list)")
        return v

    @field_validator("watermarking")
    @classmethod
    def _no_watermark(cls, v: bool | None) -> bool | None:
        if v:
            raise _refuse("watermarking")
        return v


class OpenAIChatExtras(_Strict):
    """Chat fields OpenAI's client may send and vLLM accepts; ``documents`` reach the chat template."""

    include_reasoning: bool = Field(True, description="false: no reasoning_content in the response")
    reasoning_effort: ReasoningEffort | None = Field(
        None, description="passed to the chat template as reasoning_effort; \"none\" also sets "
                          "enable_thinking false (unless chat_template_kwargs sets it), as vLLM")
    documents: Annotated[list[dict[str, Any]], Field(max_length=64)] | None = Field(
        None, description="RAG documents, passed to the chat template as documents")
    store: bool | None = Field(None, description="accepted, not used")
    metadata: dict[str, str] | None = Field(None, max_length=16, description="accepted, not used")
    service_tier: str | None = Field(None, max_length=64, description="accepted, not used")
    mm_processor_kwargs: dict[str, Any] | None = Field(None, description="accepted, not used (no images)")
    functions: list[Any] | None = Field(None, description="refused: the deprecated form of tools")
    function_call: Any = Field(None, description="refused: the deprecated form of tool_choice")

    @field_validator("functions", "function_call")
    @classmethod
    def _deprecated(cls, v: Any) -> Any:
        if v is not None:
            raise ValueError("functions / function_call (deprecated by OpenAI) are not supported; use "
                             "tools and tool_choice")
        return v

    def template_extras(self) -> dict[str, Any]:
        """Template variables these fields set."""
        out: dict[str, Any] = {}
        if self.documents is not None:
            out["documents"] = self.documents
        if self.reasoning_effort is not None:
            out["reasoning_effort"] = self.reasoning_effort
            if "enable_thinking" not in (getattr(self, "chat_template_kwargs", None) or {}):
                out["enable_thinking"] = self.reasoning_effort != "none"
        return out
