"""One request as the async front end sees it, the stream a caller iterates for its outputs, and
``generate`` over ``add_request`` (``Generates``: the single and the data-parallel engine share it)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from forwardpass.engine.frontend.output_processor import RequestState
from forwardpass.engine.frontend.outputs import RequestOutput

if TYPE_CHECKING:
    from forwardpass.engine.frontend.async_engine import AsyncLLMEngine
    from forwardpass.lora.request import LoRARequest
    from forwardpass.sampling.params import SamplingParams


@dataclass
class RequestTiming:
    """Front-end timestamps (``time.monotonic``) of one request, for latency metrics."""

    arrival: float
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None
    itl: list[float] = field(default_factory=list)  # gaps between outputs that brought new tokens
    status: str = "running"

    def on_output(self) -> None:
        now = time.monotonic()
        if self.first_token is None:
            self.first_token = now
        elif self.last_token is not None:
            self.itl.append(now - self.last_token)
        self.last_token = now


@dataclass(eq=False)
class FrontRequest:
    """The output processor's state of a request plus what its consumer waits on."""

    state: RequestState
    ack: asyncio.Future  # admitted by the engine, or its validation error
    timing: RequestTiming
    event: asyncio.Event = field(default_factory=asyncio.Event)
    version: int = 0  # steps merged so far; a stream yields when this moves past what it has seen
    started: bool = False  # produced its first token
    error: BaseException | None = None
    timer: asyncio.TimerHandle | None = None  # the per-request timeout, if any

    @property
    def num_seqs(self) -> int:
        return len(self.state.samples)

    @property
    def running(self) -> bool:
        return not self.state.finished and self.error is None

    def fail(self, exc: BaseException) -> None:
        self.error = exc
        if not self.ack.done():
            self.ack.set_exception(exc)
            self.ack.exception()  # retrieved: no "never retrieved" warning if nobody awaits it
        self.event.set()


class RequestStream:
    """Async iterator over one request's outputs (see ``AsyncLLMEngine.add_request``): cumulative, or
    with ``delta=True`` only the tokens, text and logprobs added since the previous output."""

    def __init__(self, engine: AsyncLLMEngine, req: FrontRequest, delta: bool = False):
        self.engine, self.req, self._done = engine, req, False
        self._seen = 0  # req.version at the last output yielded
        self._cursor = [(0, 0)] * len(req.state.samples) if delta else None

    @property
    def request_id(self) -> str:
        return self.req.state.request_id

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        req = self.req
        while req.version == self._seen and req.error is None:
            await req.event.wait()
            req.event.clear()
        if req.version > self._seen:
            # Tokens produced before a failure are delivered first; the error comes on the next call.
            # (Engine steps can outpace the consumer, so output and failure may arrive together.)
            self._seen = req.version
            out = req.state.make_output(self._cursor)
            self._done = out.finished
            return out
        self._done = True
        assert req.error is not None
        raise req.error

    def close(self) -> None:
        """Idempotent; aborts the request in the engine if it has not finished."""
        self._done = True
        self.engine.release(self.req)

    def __del__(self) -> None:  # a stream dropped without close() must not leak its KV blocks
        loop = self.engine._loop
        if not self._done and loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(self.engine.release, self.req)


class Generates:
    """``generate`` in terms of ``add_request``: ``AsyncLLMEngine`` and ``DataParallelEngine`` both."""

    async def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str,
        lora_request: LoRARequest | None = None,
        output_kind: Literal["cumulative", "delta"] = "cumulative",
        encoder_input: Any = None,
    ) -> RequestStream:
        raise NotImplementedError

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str,
        lora_request: LoRARequest | None = None,
        encoder_input: Any = None,  # encoder–decoder models: log-mel features (engine/frontend/multimodal.py)
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's cumulative output each time it advances; the last one has ``finished``.

        Raises the engine's ``ValidationError`` (bad prompt), ``QueueFullError``, ``EngineDeadError``, or
        the error that failed the request. Closing / cancelling the generator aborts the request.
        """
        stream = await self.add_request(prompt, params, request_id, lora_request, encoder_input=encoder_input)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()
