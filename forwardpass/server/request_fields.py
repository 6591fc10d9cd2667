"""vLLM request fields resolved against this server's settings: how many top logprobs a request gets
(``--max-logprobs``, ``-1`` = the whole vocabulary) and which side of a prompt ``truncate_prompt_tokens``
keeps (``truncation_side``)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from forwardpass.errors import ValidationError
from forwardpass.sampling.params import MAX_LOGPROBS as ENGINE_TOP
from forwardpass.server.openai_format import ResponseContext

if TYPE_CHECKING:
    from forwardpass.loader.tokenizer import Tokenizer
    from forwardpass.server.protocol import ChatCompletionRequest, CompletionRequest


@dataclass(frozen=True)
class LogprobsAsk:
    """What a request's logprobs field asks of the engine (``SamplingParams.logprobs``: None, a count, or
    -1 for the whole vocabulary) and how many top entries the response shows per position."""

    engine: int | None
    shown: int


def logprobs_ask(k: int | None, field: str, max_logprobs: int, vocab: int,
                 pinned: list[int] | None = None) -> LogprobsAsk:
    """``k`` as the request gives it (-1: the whole vocabulary, allowed when ``--max-logprobs`` is -1 or
    covers the vocabulary, as vLLM does). With ``pinned`` (``logprob_token_ids``) the engine adds those
    tokens and the response shows them instead of the top ``k``."""
    if k is None:
        return LogprobsAsk(None, 0)
    limit = vocab if max_logprobs == -1 else min(max_logprobs, vocab)
    if k == -1:
        if limit < vocab:
            raise ValidationError(f"{field}: -1 (the whole vocabulary) needs a server started with "
                                  f"--max-logprobs -1 (this one allows {max_logprobs})", param=field)
        k = vocab
    if k > limit:
        raise ValidationError(f"{field} must be at most {limit} (this server's --max-logprobs is "
                              f"{max_logprobs}, the vocabulary {vocab} tokens), got {k}", param=field)
    if pinned:
        return LogprobsAsk(0, 0)
    # more than the engine's own top-k list: it returns the whole vocabulary; the response shows k
    return LogprobsAsk(k if k <= ENGINE_TOP else -1, k)


def truncated(ids: list[int], keep: int | None, side: str | None, context: int) -> list[int]:
    """vLLM's ``truncate_prompt_tokens``: at most ``keep`` tokens (-1: the context window's), the last ones
    (``truncation_side`` left, the default) or the first (right)."""
    if keep is None:
        return ids
    if keep == 0:
        raise ValidationError("truncate_prompt_tokens must be -1 (the context window) or at least 1",
                              param="truncate_prompt_tokens")
    n = context if keep < 0 else keep
    return ids[:n] if side == "right" else ids[-n:]


def widest(a: int, b: int) -> int:
    """The larger of two engine logprobs counts (-1, the whole vocabulary, is the largest)."""
    return -1 if -1 in (a, b) else max(a, b)


def asks(req: CompletionRequest | ChatCompletionRequest, k: int | None, field: str, max_logprobs: int,
         vocab: int) -> tuple[LogprobsAsk, LogprobsAsk]:
    """A request's (output, prompt) logprobs as the engine runs them and the response shows them."""
    return (logprobs_ask(k, field, max_logprobs, vocab, req.logprob_token_ids),
            logprobs_ask(req.prompt_logprobs, "prompt_logprobs", max_logprobs, vocab))


def response_context(req: CompletionRequest | ChatCompletionRequest, rid: str, model: str,
                     tokenizer: Tokenizer | None, ask: LogprobsAsk, prompt_ask: LogprobsAsk,
                     tokens_as_ids: bool, **kwargs: Any) -> ResponseContext:
    """The response's constants: logprobs shown, tokens as ids (the request's or ``--return-tokens-as-
    token-ids``), pinned tokens, prompt logprobs, token ids."""
    ctx = ResponseContext(rid, model, int(time.time()), req.n, tokenizer, top_k=ask.shown,
                          as_ids=req.return_tokens_as_token_ids or tokens_as_ids, **kwargs)
    ctx.pinned = frozenset(req.logprob_token_ids) if req.logprob_token_ids else None
    ctx.show_prompt_logprobs, ctx.prompt_top_k = req.prompt_logprobs is not None, prompt_ask.shown
    ctx.return_token_ids = bool(req.return_token_ids)
    return ctx


def usage_flags(req: CompletionRequest | ChatCompletionRequest, force: bool) -> tuple[bool, bool]:
    """(usage at the end, usage on every chunk) of a stream; ``--enable-force-include-usage``: both."""
    if force:
        return True, True
    usage = bool(req.stream_options and req.stream_options.include_usage)
    return usage, usage and bool(req.stream_options and req.stream_options.continuous_usage_stats)
