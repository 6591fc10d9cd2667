"""AsyncLLMEngine: the asyncio front end of the engine, used by the server.

The engine loop (``core_loop.py``) runs in a process of its own by default, or in a thread
(``transport.py`` says why). The front end, on the event loop, tokenizes prompts, sends typed commands
(``protocol.py``), and turns the loop's token deltas into outputs with its ``OutputProcessor``
(detokenization, stop strings, logprobs, ``n``). A sample that a stop string ends is stopped in the
engine with a ``StopSamples`` command.

Failure handling
----------------
* A request whose consumer goes away (the stream is closed, cancelled or dropped) is aborted; the
  engine frees its KV blocks when it applies the abort, before its next step.
* A failed step fails the requests then in the engine with the cause (``RequestsFailed``); a crash of
  the loop, or the engine process exiting, marks the engine dead: every pending request fails at once
  with :class:`EngineCrashedError` naming the cause (the exit code or signal). Then ``restart_policy``
  decides (``supervisor.py``): a fresh engine loop is started after a backoff, new requests meanwhile
  get :class:`EngineRestartingError` (503 + Retry-After); or, with no restarts left, the engine stays
  dead (:class:`EngineDeadError`) and ``on_engine_lost(reason)`` is called.
* ``max_queued_requests`` bounds the sequences (``n`` per request) that have not produced a token
  yet: one more raises :class:`QueueFullError`.
* ``request_timeout_s`` fails a request that has not finished in time (:class:`RequestTimeoutError`)
  and aborts it in the engine; ``stalled_for()`` is the watchdog's input (no event while busy).
* Tokenization runs in a worker thread (``asyncio.to_thread``), never on the event loop.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, Literal

from forwardpass.engine.frontend.core_loop import EngineSpec
from forwardpass.engine.frontend.front_end import FrontEnd, FrontEndView
from forwardpass.engine.frontend.output_processor import OutputProcessor
from forwardpass.engine.frontend.protocol import (
    Abort,
    AddRequest,
    DebugRequest,
    EngineCommand,
    EngineEvent,
    Shutdown,
)
from forwardpass.engine.frontend.request_stream import FrontRequest, Generates, RequestStream, RequestTiming
from forwardpass.engine.frontend.supervisor import NO_RESTARTS, EngineSupervisor, RestartPolicy
from forwardpass.engine.frontend.transport import TRANSPORTS, ProcessTransport, ThreadTransport
from forwardpass.errors import (
    EngineDeadError,
    QueueFullError,
    RequestAbortedError,
    RequestTimeoutError,
    ValidationError,
)
from forwardpass.loader.tokenizer import Tokenizer
from forwardpass.lora.request import LoRARequest
from forwardpass.sampling.params import SamplingParams

__all__ = ["AsyncLLMEngine", "EngineSpec", "RequestStream", "RequestTiming", "RestartPolicy"]


class AsyncLLMEngine(FrontEndView, Generates):
    """``await start()``, then ``async for out in generate(prompt, params, request_id): ...``.

    Outputs are cumulative by default (``output_kind="delta"``: only what is new since the stream's last
    output); when the consumer is slower than the engine, intermediate states are coalesced.
    ``stat_listeners`` are called on the event loop with each ``StepRecord``; ``finish_listeners`` with
    ``(RequestOutput, RequestTiming)`` when a request ends (finished, aborted or failed).
    """

    def __init__(self, spec: EngineSpec, *, backend: str = "process", max_queued_requests: int = 1024,
                 request_timeout_s: float | None = None, restart_policy: RestartPolicy = NO_RESTARTS,
                 on_engine_lost: Callable[[str], None] | None = None):
        if backend not in TRANSPORTS:
            raise ValidationError(f"backend must be 'process' or 'thread', got {backend!r}", param="backend")
        self.spec, self.backend, self.max_queued_requests = spec, backend, max_queued_requests
        self.request_timeout_s = request_timeout_s
        self.model_dir = Path(spec.model)
        self.tokenizer: Tokenizer | None = None
        self.supervisor = EngineSupervisor(restart_policy, self._launch, on_engine_lost)
        # state the engine loop's events update (on the event loop)
        self.front = FrontEnd(self._send, on_death=self.supervisor.on_death)
        self.stat_listeners, self.finish_listeners = self.front.stat_listeners, self.front.finish_listeners
        self._requests = self.front.requests
        self._call_ids = itertools.count()
        self._accepting = False
        self._transport: ThreadTransport | ProcessTransport | None = None
        self._generation = 0  # which engine loop is current: a replaced one's late events are dropped
        self._loop: asyncio.AbstractEventLoop | None = None

    # ----- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        """Start the engine loop and wait until the model is loaded; raises the engine's startup error."""
        self._loop = asyncio.get_running_loop()
        if (self.model_dir / "tokenizer.json").exists():
            self.tokenizer = Tokenizer.from_dir(self.model_dir)
        self.front.processor = OutputProcessor(self.tokenizer)
        await self.supervisor.start()
        self._accepting = True

    @property
    def num_restarts(self) -> int:
        return self.supervisor.num_restarts

    async def _launch(self) -> None:
        """Start an engine loop (replacing a dead one) and wait until its model is loaded."""
        loop, old = asyncio.get_running_loop(), self._transport
        if old is not None:  # dead: reap it before a second copy of the model loads
            await loop.run_in_executor(None, old.join, 5.0)
        self._generation += 1
        ready = self.front.ready = loop.create_future()
        self._transport = TRANSPORTS[self.backend](self.spec, partial(self._post, self._generation))
        await ready
        self.front.dead = None

    def _post(self, generation: int, events: list[EngineEvent]) -> None:
        """Called from the transport's thread: hand the events to the event loop."""
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(self._dispatch, generation, events)
        except RuntimeError:
            pass  # the event loop is closed: nobody is left to tell

    def _dispatch(self, generation: int, events: list[EngineEvent]) -> None:
        if generation == self._generation:
            self.front.dispatch(events)

    async def shutdown(self, timeout: float = 30.0) -> None:
        """Stop accepting, let running requests finish for up to ``timeout`` s, abort the rest, stop."""
        self._accepting = False
        self.supervisor.close()
        deadline = time.monotonic() + timeout
        while self._requests and time.monotonic() < deadline and self.front.dead is None:
            await asyncio.sleep(0.05)
        self.fail_all(EngineDeadError("the server is shutting down"))
        self._send(Shutdown())  # also to a loop still loading after a restart; a dead one ignores it
        if self._transport is not None:
            await asyncio.get_running_loop().run_in_executor(
                None, self._transport.join, max(1.0, deadline - time.monotonic())
            )
        self.front.dead = self.front.dead or "the engine has been shut down"

    def fail_all(self, exc: BaseException) -> None:
        """End every unfinished request with ``exc`` now (shutdown) and abort them in the engine."""
        failed = self.front.fail_all(exc)
        if failed and not self.is_dead:
            self._send(Abort(tuple(failed)))

    # ----- requests --------------------------------------------------------------------------------
    async def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str,
        lora_request: LoRARequest | None = None,
        output_kind: Literal["cumulative", "delta"] = "cumulative",
        encoder_input: Any = None,  # encoder–decoder models: log-mel features (engine/frontend/multimodal.py)
    ) -> RequestStream:
        """Submit a request and wait until the engine has admitted it (or raised its validation error).

        Iterate the returned stream for outputs; call ``close()`` when done with it, which aborts the
        request if it is unfinished. The server uses this form so that bad prompts become a 400 before
        a streaming response starts.
        """
        text = prompt if isinstance(prompt, str) else None
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValidationError(f"{self.model_dir} has no tokenizer.json: send prompt token ids",
                                      param="prompt")
            prompt = await asyncio.to_thread(self.tokenizer.encode, prompt)
        # checked after the await, with nothing awaited until the request is registered
        self._check_accepting()
        if request_id in self._requests:
            raise ValidationError(f"request id {request_id!r} is already in use", param="request_id")
        if self.num_queued + params.n > self.max_queued_requests:
            raise QueueFullError(f"the waiting queue is full ({self.max_queued_requests} sequences); retry "
                                 "later")
        assert self._loop is not None
        if not any(r.running for r in self._requests.values()):
            self.front.last_event = time.monotonic()  # the watchdog counts from when the engine has work
        timing = RequestTiming(arrival=time.monotonic())
        state = self.front.processor.add_request(request_id, text, prompt, params, timing.arrival)
        req = self._requests[request_id] = FrontRequest(state, self._loop.create_future(), timing)
        if self.request_timeout_s is not None:
            req.timer = self._loop.call_later(self.request_timeout_s, self._expire, req)
        self._send(AddRequest(request_id, prompt, params, lora_request, timing.arrival, encoder_input))
        stream = RequestStream(self, req, delta=output_kind == "delta")
        try:
            await req.ack
        except BaseException:
            stream.close()
            raise
        return stream

    def release(self, req: FrontRequest) -> None:
        """The consumer is done with a request: abort it if it is still running, account for it."""
        rid = req.state.request_id
        if req.timer is not None:
            req.timer.cancel()
        if self._requests.get(rid) is not req:
            return
        if not req.state.finished and req.error is None and not self.is_dead:
            self._send(Abort((rid,)))
        del self._requests[rid]
        self.front.processor.abort([rid])
        self.front.finish(req)

    async def abort(self, request_id: str) -> None:
        """Abort a request: its stream raises ``RequestAbortedError``; the engine frees its blocks."""
        req = self._requests.get(request_id)
        if req is not None and not req.state.finished:
            req.fail(RequestAbortedError(f"request {request_id} was aborted"))
        if not self.is_dead:
            self._send(Abort((request_id,)))

    async def debug_info(self) -> dict[str, Any]:
        """Engine counters plus a ``check_invariants()`` run, taken between two steps."""
        self.check_alive()
        assert self._loop is not None
        call_id = next(self._call_ids)
        fut = self.front.calls[call_id] = self._loop.create_future()
        self._send(DebugRequest(call_id))
        return await fut

    # ----- internals -------------------------------------------------------------------------------
    def _expire(self, req: FrontRequest) -> None:
        if req.running and self._requests.get(req.state.request_id) is req:
            req.fail(RequestTimeoutError(f"the request did not finish within the server's request timeout "
                                         f"of {self.request_timeout_s:g} s", code="request_timeout"))
            if not self.is_dead:
                self._send(Abort((req.state.request_id,)))

    def check_alive(self) -> None:
        if self.front.dead is not None and self.supervisor.restarting:
            raise self.supervisor.unavailable(self.front.dead)
        if self.front.dead is not None:
            raise EngineDeadError(f"the engine is not running: {self.front.dead}")

    def _check_accepting(self) -> None:
        self.check_alive()
        if not self._accepting:
            raise EngineDeadError("the server is not accepting requests (starting or shutting down)")

    def _send(self, command: EngineCommand) -> None:
        if self._transport is not None:
            self._transport.send(command)
