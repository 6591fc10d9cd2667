"""From an OpenAI request to engine requests, and from engine outputs to OpenAI responses / SSE chunks.

A request is admitted in full (every prompt validated and accepted by the engine) before a response
starts, so bad input is a 400 and never a half-sent stream. After that, a failure is an SSE error
event followed by ``data: [DONE]``. Whatever ends the handler (done, error, client gone), every
engine request it made is closed, which aborts those still running.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import Request
from pydantic import BaseModel

from forwardpass.engine.frontend.async_engine import AsyncLLMEngine, RequestStream
from forwardpass.engine.frontend.outputs import RequestOutput
from forwardpass.errors import (
    ContextLengthError,
    ModelNotFoundError,
    QueueFullError,
    SamplingParamsError,
    ValidationError,
)
from forwardpass.loader.chat_template import ChatTemplateLimitError
from forwardpass.sampling.params import SamplingParams
from forwardpass.sampling.reasoning_budget import ReasoningBudget
from forwardpass.server.beam_search import BeamParams, asks_beams, search_all
from forwardpass.server.chat_output import ChatOutputParser
from forwardpass.server.config import MAX_SEQS_PER_REQUEST, ServerConfig
from forwardpass.server.errors import sse_error
from forwardpass.server.openai_format import (
    ResponseContext,
    chat_chunks,
    chat_logprobs,
    completion_chunks,
    completion_logprobs,
    joined,
    merged,
    usage_of,
)
from forwardpass.server.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest
from forwardpass.server.protocol_base import engine_seed
from forwardpass.server.reasoning import END, START, reasoning_token_count
from forwardpass.server.request_fields import asks, response_context, truncated, usage_flags, widest
from forwardpass.server.sse import SSEResponse
from forwardpass.structured.params import StructuredOutputsParams

if TYPE_CHECKING:
    from forwardpass.lora.request import LoRARequest

_T = TypeVar("_T")
#: Turns one engine output (of the request at the given position) into the response's SSE choices.
ChunkMaker = Callable[["ResponseContext", int, RequestOutput], Iterator[dict[str, Any]]]


class ClientDisconnected(Exception):
    pass


class Serving:
    """Tokenization, detokenization and chat-template rendering run in worker threads (``_text``), never
    on the event loop: a 4 MB prompt or a slow template must not stall ``/health`` or other streams."""

    def __init__(self, engine: AsyncLLMEngine, config: ServerConfig) -> None:
        self.engine, self.config = engine, config
        self._text = ThreadPoolExecutor(max_workers=config.text_workers, thread_name_prefix="fp-text")
        # templates get their own workers: slow (hostile) templates cannot hold up plain tokenization
        self._templates = ThreadPoolExecutor(max_workers=config.text_workers,
                                             thread_name_prefix="fp-template")

    async def off_loop(self, fn: Callable[..., _T], *args: Any, timeout: float | None = None,
                       pool: ThreadPoolExecutor | None = None) -> _T:
        fut = asyncio.get_running_loop().run_in_executor(pool or self._text, fn, *args)
        return await asyncio.wait_for(fut, timeout)

    def check_capacity(self, num_seqs: int) -> None:
        """A request's ``n x prompts`` sequences count fully: one over the per-request cap is a 400, one
        that would overfill the waiting queue a 503 (before anything is tokenized or admitted)."""
        if num_seqs > MAX_SEQS_PER_REQUEST:
            raise ValidationError(f"n x the number of prompts must be at most {MAX_SEQS_PER_REQUEST} "
                                  f"sequences per request, got {num_seqs}", param="n")
        engine = self.engine
        if engine.num_queued + num_seqs > engine.max_queued_requests:
            raise QueueFullError(f"the waiting queue is full ({engine.num_queued} of "
                                 f"{engine.max_queued_requests} sequences waiting, this request adds "
                                 f"{num_seqs}); retry later")

    def check_token_budget(self, tokens: int) -> None:
        """The request-size budget in tokens (bytes are the middleware's): prompts and every token the
        request may generate, over all its sequences."""
        limit = self.config.max_request_tokens
        if tokens > limit:
            raise ValidationError(f"this request may use {tokens} tokens (prompt + max_tokens, times n, over "
                                  "its prompts), more than this "
                                  f"server's limit of {limit}; lower max_tokens or n, or send fewer prompts",
                                  param="max_tokens")

    # ----- admission -----------------------------------------------------------------------------
    def resolve_model(self, name: str | None) -> tuple[str, LoRARequest | None]:
        """(served name, lora request or None); 404 for a name this server does not serve."""
        name = name or self.config.default_model
        if name not in self.config.models:
            raise ModelNotFoundError(f"the model {name!r} does not exist; this server serves: "
                                     f"{', '.join(self.config.models)}", param="model",
                                     code="model_not_found")
        return name, self.config.models[name]

    def sampling_params(self, req: CompletionRequest | ChatCompletionRequest, prompt_len: int,
                        max_tokens: int | None, logprobs: int | None, what: str,
                        structured: StructuredOutputsParams | None = None,
                        reasoning_budget: ReasoningBudget | None = None, prompt_logprobs: int | None = None,
                        ) -> SamplingParams:
        limit = self.engine.max_model_len
        if prompt_len >= limit:
            raise ContextLengthError(
                f"this model's maximum context length is {limit} tokens, but the {what} has {prompt_len} "
                f"tokens and at least one token must be generated; shorten the {what}", param=what)
        if max_tokens is None:
            max_tokens = limit - prompt_len
        elif prompt_len + max_tokens > limit:
            raise ContextLengthError(
                f"this model's maximum context length is {limit} tokens, but you requested "
                f"{prompt_len + max_tokens} tokens ({prompt_len} in the {what}, {max_tokens} for the "
                f"completion); reduce the length of the {what} or max_tokens", param="max_tokens")
        d = self.engine.default_sampling_params()
        vocab = self.engine.vocab_size
        for name, ids in (("logit_bias", list(req.logit_bias_ids() or ())),
                          ("allowed_token_ids", req.allowed_token_ids or []),
                          ("logprob_token_ids", req.logprob_token_ids or []),
                          ("stop_token_ids", req.stop_token_ids or [])):
            if bad := [t for t in ids if t >= vocab]:
                raise SamplingParamsError(f"{name}: token id {bad[0]} is not in the vocabulary [0, {vocab})",
                                          param=name)
        if req.logprob_token_ids and logprobs is None:
            raise SamplingParamsError("logprob_token_ids needs logprobs", param="logprob_token_ids")
        if req.top_k is not None and req.top_k > vocab:
            raise SamplingParamsError(f"top_k must be -1 or 0 (disabled), or in [1, {vocab}] (the vocabulary "
                                      f"size), got {req.top_k}", param="top_k")

        def pick(v: _T | None, default: _T) -> _T:
            return default if v is None else v

        return SamplingParams(
            n=req.n, temperature=pick(req.temperature, d.temperature), top_p=pick(req.top_p, d.top_p),
            top_k=pick(req.top_k, d.top_k), min_p=pick(req.min_p, d.min_p),
            presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
            repetition_penalty=pick(req.repetition_penalty, d.repetition_penalty),
            seed=None if req.seed is None else engine_seed(req.seed),
            stop=req.stop, max_tokens=max_tokens, min_tokens=min(req.min_tokens, max_tokens),
            ignore_eos=req.ignore_eos, logprobs=logprobs, logit_bias=req.logit_bias_ids(),
            stop_token_ids=req.stop_token_ids, skip_special_tokens=req.skip_special_tokens,
            include_stop_str_in_output=req.include_stop_str_in_output,
            allowed_token_ids=req.allowed_token_ids, structured_outputs=structured,
            reasoning_budget=reasoning_budget, prompt_logprobs=prompt_logprobs,
            logprob_token_ids=req.logprob_token_ids if logprobs is not None else None)

    def _tags(self) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        tok = self.engine.tokenizer
        if self.config.reasoning_parser is None or tok is None:
            return None
        return (tuple(tok.encode(START, add_special_tokens=False)),
                tuple(tok.encode(END, add_special_tokens=False)))

    def _reasoning_budget(self, max_reasoning_tokens: int | None) -> ReasoningBudget | None:
        if max_reasoning_tokens is None:
            return None
        tags = self._tags()
        if tags is None:
            raise SamplingParamsError("max_reasoning_tokens needs a server started with --reasoning-parser",
                                      param="max_reasoning_tokens")
        return ReasoningBudget(max_reasoning_tokens, *tags)

    def _reasoning_counter(self) -> Callable[[list[int]], int] | None:
        tags, parser = self._tags(), self.config.reasoning_parser
        if tags is None or parser is None:
            return None
        return lambda ids: reasoning_token_count(parser, ids, *tags)

    def _check_text_length(self, text: str, what: str) -> None:
        """Before tokenizing: a text too long to fit the context window whatever its tokens (each token
        covers at most ``max_token_chars`` characters; x4 for normalizers that merge characters)."""
        tok = self.engine.tokenizer
        limit = self.engine.max_model_len * (tok.max_token_chars if tok is not None else 1) * 4
        if len(text) > limit:
            raise ContextLengthError(
                f"the {what} has {len(text)} characters, more than this model's maximum context length of "
                f"{self.engine.max_model_len} tokens can hold; shorten the {what}", param=what)

    def encode(self, prompt: str | list[int], add_special_tokens: bool = True,
               for_generation: bool = True) -> list[int]:
        """Blocking: call through ``off_loop`` for text. ``for_generation``: refuse text too long for the
        context window before tokenizing it (``/tokenize`` counts the tokens of any text the body limit
        lets through)."""
        if isinstance(prompt, list):
            vocab = self.engine.vocab_size
            if (bad := next((t for t in prompt if t >= vocab), None)) is not None:
                raise ValidationError(f"prompt token id {bad} is out of vocabulary (this model's token ids "
                                      f"are 0 to {vocab - 1})", param="prompt")
            return prompt
        tok = self.engine.tokenizer
        if tok is None:
            raise ValidationError("this model has no tokenizer: send prompts as token ids", param="prompt")
        if for_generation:
            self._check_text_length(prompt, "prompt")
        ids = tok.encode(prompt, add_special_tokens=add_special_tokens)
        if not ids:
            raise ValidationError("the prompt is empty after tokenization", param="prompt")
        return ids

    def chat_prompt_blocking(self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True,
                             template_kwargs: dict[str, Any] | None = None,
                             continue_final: bool = False, add_special_tokens: bool = False) -> list[int]:
        tok = self.engine.tokenizer
        if tok is None:
            raise ValidationError("this model has no tokenizer, so it has no chat template", param="messages")
        conv = [m.template_dict() for m in messages]
        text = tok.apply_chat_template(conv, add_generation_prompt=add_generation_prompt,
                                       time_limit_s=self.config.template_time_limit_s,
                                       max_output_chars=self.config.template_max_chars,
                                       **(template_kwargs or {}))
        if continue_final:  # as transformers does: cut what the template wrote after the last message's text
            last = messages[-1].text()
            at = text.rfind(last) if last else -1
            if at < 0:
                raise ValidationError("continue_final_message: the template did not render the last "
                                      "message's text as given", param="messages")
            text = text[:at + len(last)]
        self._check_text_length(text, "messages")
        ids = tok.encode(text, add_special_tokens=add_special_tokens)  # the template writes any BOS it wants
        if not ids:
            raise ValidationError("the chat template rendered an empty prompt", param="messages")
        return ids

    def truncated(self, ids: list[int], req: CompletionRequest | ChatCompletionRequest) -> list[int]:
        return truncated(ids, req.truncate_prompt_tokens, req.truncation_side, self.engine.max_model_len)

    async def encode_async(self, prompt: str | list[int], add_special_tokens: bool = True,
                           for_generation: bool = True) -> list[int]:
        if isinstance(prompt, list):
            return self.encode(prompt)
        return await self.off_loop(self.encode, prompt, add_special_tokens, for_generation)

    async def chat_prompt(self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True,
                          template_kwargs: dict[str, Any] | None = None,
                          continue_final: bool = False, add_special_tokens: bool = False) -> list[int]:
        try:  # the template checks its own deadline; this one also covers time spent waiting for a worker
            return await self.off_loop(self.chat_prompt_blocking, messages, add_generation_prompt,
                                       template_kwargs, continue_final, add_special_tokens,
                                       timeout=self.config.template_time_limit_s + 10, pool=self._templates)
        except TimeoutError:
            raise ChatTemplateLimitError("rendering the chat template took longer than "
                                         f"{self.config.template_time_limit_s:g} s",
                                         param="messages") from None

    async def admit(self, prompts: list[list[int]], params_list: list[SamplingParams], rid: str,
                    lora: LoRARequest | None) -> list[RequestStream]:
        streams: list[RequestStream] = []
        try:
            for i, (ids, params) in enumerate(zip(prompts, params_list)):
                streams.append(await self.engine.add_request(ids, params, f"{rid}-{i}", lora,
                                                             output_kind="delta"))
        except BaseException:
            for s in streams:
                s.close()
            raise
        return streams

    # ----- /v1/completions -----------------------------------------------------------------------
    async def completions(self, req: CompletionRequest, request: Request) -> SSEResponse | dict[str, Any]:
        model, lora = self.resolve_model(req.model)
        self.check_capacity(len(req.prompts()) * req.n)
        structured = await self.off_loop(req.structured)  # a large schema is parsed off the event loop
        prompts = [self.truncated(await self.encode_async(p, req.add_special_tokens), req)
                   for p in req.prompts()]
        ask, prompt_ask = asks(req, req.logprobs, "logprobs", self.config.max_logprobs,
                               self.engine.vocab_size)
        # echo with logprobs: the prompt's tokens are listed first, with their own logprobs
        echo_lps = prompt_ask.engine
        if req.echo and ask.engine is not None:
            echo_lps = widest(ask.engine, prompt_ask.engine or 0)
        params = [self.sampling_params(req, len(p), req.max_tokens, ask.engine, "prompt", structured,
                                       prompt_logprobs=echo_lps) for p in prompts]
        self.check_token_budget(sum(len(p) + (s.max_tokens or 0) for p, s in zip(prompts, params)) * req.n)
        rid = f"cmpl-{uuid.uuid4().hex}"
        streams = [] if asks_beams(req) else await self.admit(prompts, params, rid, lora)
        ctx = response_context(req, rid, model, self.engine.tokenizer, ask, prompt_ask,
                               self.config.return_tokens_as_token_ids)
        ctx.echo_logprobs = req.echo and ask.engine is not None
        if req.echo:  # each choice's text starts with its prompt's text (as truncated; special tokens kept)
            ctx.echo_prompts = [p if isinstance(p, str) and req.truncate_prompt_tokens is None
                                else await self.off_loop(self._decode, ids)
                                for p, ids in zip(req.prompts(), prompts)]
        if req.stream:
            usage, ctx.continuous_usage = usage_flags(req, self.config.force_include_usage)
            ctx.prompt_tokens = sum(len(p) for p in prompts)
            return SSEResponse(self._stream(streams, ctx, usage, completion_chunks))
        finals = await (self._beams(req, prompts, params, rid, lora, request) if req.use_beam_search
                        else self._collect(streams, request))
        choices: list[dict[str, Any]] = []
        for i, out in enumerate(finals):
            for c in out.outputs:
                echo = ctx.echo_prompts[i] if ctx.echo_prompts else ""
                lps = (completion_logprobs(c.logprobs, len(echo), ctx.top_k, ctx.as_ids, ctx.skipped,
                                           ctx.pinned) if req.logprobs is not None and c.logprobs is not None
                       else None)
                if lps is not None and ctx.echo_logprobs:
                    lps = joined(ctx.prompt_part(out), lps)
                choices.append({"index": i * req.n + c.index, "text": echo + c.text, "logprobs": lps,
                                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                                **ctx.prompt_fields(out), **ctx.token_ids(c)})
        return {"id": rid, "object": "text_completion", "created": ctx.created, "model": model,
                "choices": choices, "usage": usage_of(finals), "system_fingerprint": None}

    def _decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        tok = self.engine.tokenizer
        return tok.decode(ids, skip_special_tokens=skip_special_tokens) if tok is not None else ""

    # ----- /v1/chat/completions ------------------------------------------------------------------
    async def chat(self, req: ChatCompletionRequest, request: Request) -> SSEResponse | dict[str, Any]:
        model, lora = self.resolve_model(req.model)
        self.check_capacity(req.n)
        kwargs = {**(req.chat_template_kwargs or {}), **req.template_extras(),
                  **({"tools": req.tool_dicts()} if req.tools else {})}
        thinking = kwargs.get("enable_thinking") is not False
        ids = self.truncated(await self.chat_prompt(req.messages, req.add_generation_prompt, kwargs,
                                                    req.continue_final_message, req.add_special_tokens), req)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        # a forced tool call is bounded to fit what the output may use (tool_choice.py)
        budget = max_tokens if max_tokens is not None else self.engine.max_model_len - len(ids)
        structured = await self.off_loop(req.structured, budget)
        tok = self.engine.tokenizer
        if (structured is not None and self.config.reasoning_parser is not None and thinking
                and tok is not None):
            # the constraint applies to the answer: after the reasoning's closing tag
            structured.reasoning_end = tuple(tok.encode("</think>", add_special_tokens=False))
        ask, prompt_ask = asks(req, (req.top_logprobs or 0) if req.logprobs else None, "top_logprobs",
                               self.config.max_logprobs, self.engine.vocab_size)
        budget_tokens = (req.max_reasoning_tokens if req.max_reasoning_tokens is not None
                         else req.thinking_token_budget)
        reasoning = self._reasoning_budget(budget_tokens) if thinking else None
        params = self.sampling_params(req, len(ids), max_tokens, ask.engine, "messages", structured,
                                      reasoning, prompt_logprobs=prompt_ask.engine)
        self.check_token_budget((len(ids) + (params.max_tokens or 0)) * req.n)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        streams = await self.admit([ids], [params], rid, lora)

        def parser() -> ChatOutputParser:
            choice = (req.tool_choice.model_dump() if isinstance(req.tool_choice, BaseModel)
                      else req.tool_choice)
            return ChatOutputParser(self.config.reasoning_parser, req.tool_mode(), choice,
                                    req.parallel_tool_calls is not False, req.include_reasoning,
                                    req._incomplete_call_ok)

        echo = req.messages[-1].text() if req.echo and req.messages[-1].role == "assistant" else ""
        ctx = response_context(req, rid, model, self.engine.tokenizer, ask, prompt_ask,
                               self.config.return_tokens_as_token_ids, parser=parser, echo=echo)
        ctx.count_reasoning = self._reasoning_counter()
        if req.stream:
            usage, ctx.continuous_usage = usage_flags(req, self.config.force_include_usage)
            ctx.prompt_tokens = len(ids)
            return SSEResponse(self._stream(streams, ctx, usage, chat_chunks))
        out = (await self._collect(streams, request))[0]
        choices = []
        for c in out.outputs:
            p = parser()
            choices.append({"index": c.index, "message": p.message(echo + c.text),
                            "logprobs": (chat_logprobs(c.logprobs, ctx.top_k, ctx.as_ids, ctx.pinned)
                                         if req.logprobs else None),
                            "finish_reason": p.finish_reason(c.finish_reason), "stop_reason": c.stop_reason,
                            **ctx.token_ids(c)})
        return {"id": rid, "object": "chat.completion", "created": ctx.created, "model": model,
                "choices": choices, "usage": usage_of([out], ctx.count_reasoning), "system_fingerprint": None,
                **ctx.prompt_fields(out)}

    # ----- running them --------------------------------------------------------------------------
    async def _collect(self, streams: list[RequestStream], request: Request) -> list[RequestOutput]:
        """Final outputs of every stream; a client that disconnects meanwhile aborts them all."""
        async def last(stream: RequestStream) -> RequestOutput:
            out: RequestOutput | None = None
            async for delta in stream:
                out = delta if out is None else merged(out, delta)
            assert out is not None  # a stream yields at least one output, or raises
            return out

        try:
            return await self._or_disconnect(asyncio.gather(*(last(s) for s in streams)), request)
        finally:
            for s in streams:
                s.close()

    async def _or_disconnect(self, work: Awaitable[_T], request: Request) -> _T:
        """``work``'s result; a client that disconnects first cancels it (``ClientDisconnected``)."""
        task = asyncio.ensure_future(work)
        watcher = asyncio.ensure_future(_wait_disconnect(request))
        try:
            await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not task.done():
                task.cancel()
                raise ClientDisconnected()
            return task.result()
        finally:
            watcher.cancel()

    async def _beams(self, req: CompletionRequest, prompts: list[list[int]], params: list[SamplingParams],
                     rid: str, lora: LoRARequest | None, request: Request) -> list[RequestOutput]:
        """``use_beam_search``: each prompt's ``n`` best beams (beam_search.py), one output per prompt."""
        beams = [BeamParams.of(req, s.max_tokens or 1) for s in params]
        search = search_all(self.engine, prompts, beams, rid, lora,
                            lambda ids, skip: self.off_loop(self._decode, ids, skip))
        return await self._or_disconnect(search, request)

    async def _stream(self, streams: list[RequestStream], ctx: ResponseContext, include_usage: bool,
                      make_chunks: ChunkMaker) -> AsyncIterator[str]:
        totals: dict[int, RequestOutput] = {}  # each stream's deltas folded together, for usage
        continuous = include_usage and ctx.continuous_usage

        def running_usage() -> dict[str, Any]:
            """vLLM's continuous usage: the whole prompt (known from the start, however long its prefill
            takes) and the tokens generated so far."""
            usage = usage_of(list(totals.values()), ctx.count_reasoning)
            return {**usage, "prompt_tokens": ctx.prompt_tokens,
                    "total_tokens": ctx.prompt_tokens + usage["completion_tokens"]}

        try:
            if make_chunks is chat_chunks:  # the role comes first, once per choice
                for j in range(ctx.n):
                    d = ctx.chunk("chat.completion.chunk", [{
                        "index": j, "delta": {"role": "assistant", "content": ctx.echo}, "logprobs": None,
                        "finish_reason": None}], include_usage)
                    yield ctx.sse({**d, "usage": running_usage()} if continuous else d)
            async for i, out in _merge(streams):
                chunks = list(make_chunks(ctx, i, out))  # before the fold below: it extends out's lists
                totals[i] = out if i not in totals else merged(totals[i], out)
                # chat: top level
                extra: dict[str, Any] = {}
                if make_chunks is chat_chunks:
                    extra = ctx.prompt_logprobs_field(out)
                    if ctx.return_token_ids and not ctx.prompt_ids_sent:
                        extra["prompt_token_ids"], ctx.prompt_ids_sent = list(out.prompt_token_ids), True
                for choice in chunks:
                    d = ctx.chunk("chat.completion.chunk" if make_chunks is chat_chunks
                                  else "text_completion", [choice], include_usage)
                    d, extra = {**d, **extra}, {}
                    if continuous:  # vLLM: running totals on every chunk
                        d["usage"] = running_usage()
                    yield ctx.sse(d)
            if include_usage:
                obj = "chat.completion.chunk" if make_chunks is chat_chunks else "text_completion"
                yield ctx.sse({**ctx.chunk(obj, [], False),
                               "usage": usage_of(list(totals.values()), ctx.count_reasoning)})
        except Exception as exc:  # noqa: BLE001 - reported in-band: the status line is already sent
            yield sse_error(exc)
        finally:
            for s in streams:
                s.close()
        yield "data: [DONE]\n\n"


async def _merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several streams as they come, tagged with the stream's position."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | None, Exception | None]] = asyncio.Queue()

    async def pump(i: int, s: RequestStream) -> None:
        try:
            async for out in s:
                await queue.put((i, out, None))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer
            await queue.put((i, None, exc))
        await queue.put((i, None, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, got, exc = await queue.get()
            if exc is not None:
                raise exc
            if got is None:
                remaining -= 1
                continue
            yield i, got
    finally:
        for t in tasks:
            t.cancel()


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
