"""AsyncLLMEngine: the asyncio front end of :class:`LLMEngine`, used by the server.

Where the step loop runs
------------------------
By default (``backend="process"``) the ``LLMEngine`` lives in a **process of its own**; the event loop
(HTTP, JSON, SSE, tokenization, chat templates, metrics) stays in the server process. Measured on the
machines we serve from (docs ``PERFORMANCE-NOTES.md``), a CPU-busy Python thread next to the model
step slows its matmuls 3–6×: every torch op releases the GIL and must win it back from the thread
that is busy encoding JSON. Under load the HTTP side *is* busy, so a thread would tax every forward
pass exactly when throughput matters. The process boundary costs one pickle of each step's outputs,
which are sent as *deltas* (new token ids, logprobs and text only) and batched into one message
per step, so the transfer stays linear in the output length.

``backend="thread"`` runs the same loop in a daemon thread of this process. It starts faster (no
second ``import torch``), so the unit tests and embedded uses take it; the trade-off above applies.

Either way the ``LLMEngine`` object is only ever touched by its loop: ``add`` / ``abort`` / debug
calls go through a queue and are applied between steps; the loop sleeps on that queue when no
request is unfinished. Results come back as one list of events per loop turn, dispatched on the
event loop (``call_soon_threadsafe``), where each request's state is merged and its consumer woken.

Failure handling
----------------
* A request whose consumer goes away (the async generator is closed or cancelled) is aborted; the
  engine frees its KV blocks when it applies the abort, before its next step.
* An exception from ``engine.step()`` fails every request then in the engine (the batch state is
  unknown), which are aborted; if the KV invariants still hold the loop carries on, otherwise it
  stops. An exception of the loop itself, or the engine process exiting, marks the engine dead:
  every pending request fails with :class:`EngineDeadError` and so does every new one.
* ``max_queued_requests`` bounds the requests that have not produced a token yet (waiting in the
  scheduler, in the hand-over queue, or in their first prefill): one more raises
  :class:`QueueFullError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from forwardpass.engine.outputs import CompletionOutput, RequestOutput
from forwardpass.errors import EngineDeadError, ForwardpassError, QueueFullError, ValidationError

logger = logging.getLogger(__name__)

_IDLE_POLL_S = 1.0  # how often an idle engine process checks that its parent is alive


@dataclass
class EngineSpec:
    """A picklable recipe for the engine, built inside its loop (thread or process).

    ``factory(model, EngineConfig) -> LLMEngine`` must be a module-level callable when the engine runs
    in a process; by default it is ``LLMEngine`` (or ``LoRALLMEngine`` when ``lora_kwargs`` is given).
    """

    model: str
    config_kwargs: dict = field(default_factory=dict)
    factory: Callable[..., Any] | None = None
    lora_kwargs: dict | None = None
    log_level: int = logging.WARNING
    num_threads: int | None = None  # torch compute threads of the engine (None: torch's default)


def build_engine(spec: EngineSpec):
    from forwardpass.config import EngineConfig

    if spec.num_threads:
        import torch

        torch.set_num_threads(spec.num_threads)

    config = EngineConfig(**spec.config_kwargs)
    if spec.factory is not None:
        return spec.factory(spec.model, config)
    if spec.lora_kwargs:
        from forwardpass.lora.engine import LoRALLMEngine

        return LoRALLMEngine(spec.model, config, **spec.lora_kwargs)
    from forwardpass.engine.llm_engine import LLMEngine

    return LLMEngine(spec.model, config)


def _portable(exc: BaseException) -> ForwardpassError:
    """An exception that pickles and that the server maps to an error envelope."""
    if isinstance(exc, ForwardpassError):
        return exc
    return ForwardpassError(f"engine fault: {type(exc).__name__}: {exc}")


# ================================ the loop (engine side) ===========================================
class _EngineLoop:
    """Owns the LLMEngine. ``inbox`` has ``get(timeout=)`` / ``get_nowait()``; ``emit(events)`` sends a
    list of events to the front end. Runs until a ``shutdown`` command or a crash."""

    def __init__(self, spec: EngineSpec, inbox, emit: Callable[[list], None], alive: Callable[[], bool]):
        self.spec, self.inbox, self.emit, self.alive = spec, inbox, emit, alive
        # request id -> completion index -> (tokens, text characters) sent
        self.sent: dict[str, dict[int, tuple[int, int]]] = {}

    def run(self) -> None:
        try:
            self.engine = build_engine(self.spec)
        except BaseException as exc:
            logger.exception("engine failed to start")
            self.emit([("startup_error", _portable(exc))])
            return
        e = self.engine
        self.emit([("ready", {
            "max_model_len": e.max_model_len, "vocab_size": int(e.model_config["vocab_size"]),
            "num_blocks": e.kv.num_blocks, "block_size": e.config.block_size,
            "default_params": e.default_sampling_params(), "eos_token_ids": list(e.eos_token_ids),
            "max_num_seqs": e.config.max_num_seqs,
        })])
        try:
            self._loop()
        except BaseException as exc:
            logger.exception("engine loop crashed")
            self.emit([("dead", f"engine loop crashed: {type(exc).__name__}: {exc}")])
            return
        self.emit([("stopped", None)])

    def _loop(self) -> None:
        engine = self.engine
        while True:
            commands = self._drain(block=not engine.has_unfinished_requests())
            events: list = []
            for cmd in commands:
                if cmd[0] == "shutdown":
                    engine.abort(list(engine.requests))
                    return
                self._apply(cmd, events)
            if engine.has_unfinished_requests():
                try:
                    outputs = engine.step()
                except Exception as exc:  # noqa: BLE001 - fail the affected requests, not the process
                    self._fail_all(exc, events)
                else:
                    events.extend(("out", self._delta(o)) for o in outputs)
                    if engine.stats:
                        events.append(("step", engine.stats[-1]))
            if not engine.has_unfinished_requests():  # idle from here: report the gauges once more
                events.append(("snapshot", self._snapshot()))
            if events:
                self.emit(events)

    def _drain(self, block: bool) -> list:
        out = []
        while block:
            try:
                out.append(self.inbox.get(timeout=_IDLE_POLL_S))
                break
            except queue.Empty:
                if not self.alive():
                    return [("shutdown",)]
        while True:
            try:
                out.append(self.inbox.get_nowait())
            except queue.Empty:
                return out

    def _apply(self, cmd: tuple, events: list) -> None:
        kind = cmd[0]
        if kind == "add":
            _, rid, prompt, params, lora, arrival = cmd
            try:
                self.engine.add_request(rid, prompt, params, lora_request=lora, arrival_time=arrival)
            except Exception as exc:  # noqa: BLE001 - validation errors go back to the caller
                events.append(("ack", (rid, _portable(exc))))
            else:
                self.sent[rid] = {}
                events.append(("ack", (rid, None)))
        elif kind == "abort":
            self.engine.abort(cmd[1])
            for rid in cmd[1]:
                self.sent.pop(rid, None)
        elif kind == "call":
            _, call_id, name = cmd
            try:
                result = getattr(self, f"_call_{name}")()
            except Exception as exc:  # noqa: BLE001
                result = _portable(exc)
            events.append(("reply", (call_id, result)))

    def _delta(self, o: RequestOutput) -> RequestOutput:
        """The output with only the token ids, logprobs and text not sent before.

        Visible text only grows (a stop string is cut where it starts, which is past the text already
        shown); if it ever shrank, the whole text is sent and its index listed in ``extra["text_reset"]``.
        """
        sent = self.sent.setdefault(o.request_id, {})
        first, reset = not sent, []
        comps = []
        for c in o.outputs:
            k, t = sent.get(c.index, (0, 0))
            if len(c.text) < t:
                reset.append(c.index)
                t = 0
            comps.append(CompletionOutput(
                index=c.index, text=c.text[t:], token_ids=c.token_ids[k:], cumulative_logprob=c.cumulative_logprob,
                logprobs=None if c.logprobs is None else c.logprobs[k:], finish_reason=c.finish_reason,
                stop_reason=c.stop_reason))
            sent[c.index] = (len(c.token_ids), len(c.text))
        if o.finished:
            self.sent.pop(o.request_id, None)
        out = RequestOutput(o.request_id, None, o.prompt_token_ids if first else [], comps, o.finished,
                            o.metrics, o.num_cached_tokens)
        if reset:
            out.extra["text_reset"] = True
        return out

    def _fail_all(self, exc: Exception, events: list) -> None:
        logger.exception("engine step failed; failing the %d requests in the engine", len(self.engine.requests))
        rids = list(self.engine.requests)
        self.engine.abort(rids)
        err = _portable(exc)
        events.extend(("failed", (rid, err)) for rid in rids)
        for rid in rids:
            self.sent.pop(rid, None)
        self.emit(events[:])  # the requests learn the real cause even if the check below ends the loop
        events.clear()
        self.engine.check_invariants()  # if the fault broke the KV pool, this ends the loop: engine dead

    def _snapshot(self) -> dict:
        e = self.engine
        return {"num_running": len(e.scheduler.running), "num_waiting": len(e.scheduler.waiting),
                "kv_usage": e.kv.usage, "num_free_blocks": e.kv.num_free_blocks}

    def _call_debug(self) -> dict:
        e = self.engine
        info = {**self._snapshot(), "num_blocks": e.kv.num_blocks, "num_requests": len(e.requests),
                "total_preemptions": e.scheduler.num_preemptions, "invariants_ok": True, "invariant_error": None}
        try:
            e.check_invariants()
        except AssertionError as exc:
            info["invariants_ok"], info["invariant_error"] = False, str(exc) or "AssertionError"
        return info


def _process_main(spec: EngineSpec, inbox, conn) -> None:
    """Entry point of the engine process."""
    import multiprocessing
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the server decides
    logging.basicConfig(level=spec.log_level, format="%(levelname)s %(name)s [engine]: %(message)s")
    parent = multiprocessing.parent_process()

    def emit(events: list) -> None:
        conn.send(events)

    try:
        _EngineLoop(spec, inbox, emit, lambda: parent is None or parent.is_alive()).run()
    except (BrokenPipeError, EOFError, OSError):
        pass  # the server went away
    finally:
        conn.close()


# ================================ the front end (event loop side) ==================================
@dataclass
class _RequestState:
    request_id: str
    prompt: str | list[int]
    ack: asyncio.Future
    event: asyncio.Event = field(default_factory=asyncio.Event)
    prompt_token_ids: list[int] = field(default_factory=list)
    completions: dict[int, CompletionOutput] = field(default_factory=dict)
    metrics: Any = None
    num_cached_tokens: int = 0
    started: bool = False  # produced its first output
    finished: bool = False
    error: BaseException | None = None
    version: int = 0  # outputs merged so far; a stream yields when this moves past what it has seen

    def merge(self, d: RequestOutput) -> None:
        self.version += 1
        if d.prompt_token_ids:
            self.prompt_token_ids = d.prompt_token_ids
        reset = d.extra.get("text_reset", ())
        for c in d.outputs:
            cur = self.completions.get(c.index)
            if cur is None:
                self.completions[c.index] = cur = CompletionOutput(
                    c.index, "", [], logprobs=None if c.logprobs is None else [])
            cur.text = c.text if c.index in reset else cur.text + c.text
            cur.token_ids.extend(c.token_ids)
            if c.logprobs is not None:
                cur.logprobs.extend(c.logprobs)
            cur.cumulative_logprob, cur.finish_reason, cur.stop_reason = (
                c.cumulative_logprob, c.finish_reason, c.stop_reason)
        self.metrics, self.num_cached_tokens = d.metrics, d.num_cached_tokens
        self.finished = d.finished

    def snapshot(self) -> RequestOutput:
        comps = [CompletionOutput(c.index, c.text, list(c.token_ids), c.cumulative_logprob,
                                  None if c.logprobs is None else list(c.logprobs), c.finish_reason, c.stop_reason)
                 for _, c in sorted(self.completions.items())]
        return RequestOutput(self.request_id, self.prompt if isinstance(self.prompt, str) else None,
                             list(self.prompt_token_ids), comps, self.finished, self.metrics, self.num_cached_tokens)


class RequestStream:
    """Async iterator over one request's cumulative outputs (see ``AsyncLLMEngine.add_request``)."""

    def __init__(self, engine: AsyncLLMEngine, state: _RequestState):
        self.engine, self.state, self._done = engine, state, False
        self._seen = 0  # state.version at the last output yielded

    @property
    def request_id(self) -> str:
        return self.state.request_id

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        state = self.state
        while state.version == self._seen and state.error is None:
            await state.event.wait()
            state.event.clear()
        if state.version > self._seen:
            # Tokens produced before a failure are delivered first; the error comes on the next call.
            # (Engine steps can outpace the consumer, so output and failure may arrive together.)
            self._seen = state.version
            out = state.snapshot()
            self._done = out.finished
            return out
        self._done = True
        raise state.error

    def close(self) -> None:
        """Idempotent; aborts the request in the engine if it has not finished."""
        self._done = True
        self.engine._release(self.state)

    def __del__(self) -> None:  # a stream dropped without close() must not leak its KV blocks
        loop = self.engine._loop
        if not self._done and loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(self.engine._release, self.state)


class AsyncLLMEngine:
    """``await start()``, then ``async for out in generate(prompt, params, request_id): ...``.

    Outputs are cumulative like ``LLMEngine.step()``'s; when the consumer is slower than the engine,
    intermediate states are coalesced (it always sees the latest). ``stat_listeners`` are called on the
    event loop with each ``StepRecord``; ``finish_listeners`` with ``(RequestOutput, RequestTiming)``
    when a request ends (finished, aborted or failed).
    """

    def __init__(self, spec: EngineSpec, *, backend: str = "process", max_queued_requests: int = 1024):
        if backend not in ("process", "thread"):
            raise ValidationError(f"backend must be 'process' or 'thread', got {backend!r}", param="backend")
        self.spec, self.backend, self.max_queued_requests = spec, backend, max_queued_requests
        self.model_dir = Path(spec.model)
        self.tokenizer = None
        self.info: dict = {}
        self.snapshot: dict = {"num_running": 0, "num_waiting": 0, "kv_usage": 0.0, "num_free_blocks": 0}
        self.stat_listeners: list[Callable] = []
        self.finish_listeners: list[Callable] = []
        self._requests: dict[str, _RequestState] = {}
        self._timings: dict[str, RequestTiming] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._dead: str | None = None
        self._accepting = False
        self._stopped = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready: asyncio.Future | None = None

    # ----- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        """Start the loop and wait until the model is loaded; raises the engine's startup error."""
        self._loop = loop = asyncio.get_running_loop()
        self._ready = loop.create_future()
        if (self.model_dir / "tokenizer.json").exists():
            from forwardpass.loader.tokenizer import Tokenizer

            self.tokenizer = Tokenizer.from_dir(self.model_dir)
        if self.backend == "thread":
            self._inbox = queue.Queue()
            self._thread = threading.Thread(target=self._thread_main, name="forwardpass-engine", daemon=True)
            self._thread.start()
        else:
            import multiprocessing

            ctx = multiprocessing.get_context("spawn")  # fork would copy the server's threads and torch state
            self._inbox = ctx.Queue()
            recv_conn, send_conn = ctx.Pipe(duplex=False)
            self._proc = ctx.Process(target=_process_main, args=(self.spec, self._inbox, send_conn),
                                     name="forwardpass-engine", daemon=True)
            self._proc.start()
            send_conn.close()
            self._reader = threading.Thread(target=self._reader_main, args=(recv_conn,), name="forwardpass-reader",
                                            daemon=True)
            self._reader.start()
        await self._ready
        self._accepting = True

    def _thread_main(self) -> None:
        try:
            _EngineLoop(self.spec, self._inbox, self._post, lambda: True).run()
        finally:
            self._stopped.set()

    def _reader_main(self, conn) -> None:
        try:
            while True:
                self._post(conn.recv())
        except (EOFError, OSError):
            pass
        except RuntimeError:  # the event loop is closed
            return
        self._stopped.set()
        self._proc.join(5)
        code = self._proc.exitcode
        self._post([("dead", f"the engine process exited (exit code {code})")])

    def _post(self, events: list) -> None:
        try:
            self._loop.call_soon_threadsafe(self._dispatch, events)
        except RuntimeError:
            pass  # the event loop is closed: nobody is left to tell

    async def shutdown(self, timeout: float = 30.0) -> None:
        """Stop accepting, let running requests finish for up to ``timeout`` s, abort the rest, stop."""
        self._accepting = False
        deadline = time.monotonic() + timeout
        while self._requests and time.monotonic() < deadline and self._dead is None:
            await asyncio.sleep(0.05)
        for state in list(self._requests.values()):
            self._fail(state, EngineDeadError("the server is shutting down"))
        if self._dead is None:
            self._send(("shutdown",))
        await asyncio.get_running_loop().run_in_executor(None, self._join, max(1.0, deadline - time.monotonic()))
        self._dead = self._dead or "the engine has been shut down"

    def _join(self, timeout: float) -> None:
        self._stopped.wait(timeout)
        if self.backend == "process":
            self._proc.join(timeout=5)
            if self._proc.is_alive():
                logger.warning("engine process did not stop; killing it")
                self._proc.kill()
                self._proc.join(5)
            self._inbox.close()
            self._inbox.join_thread()

    @property
    def is_dead(self) -> bool:
        return self._dead is not None

    @property
    def dead_reason(self) -> str | None:
        return self._dead

    @property
    def max_model_len(self) -> int:
        return self.info["max_model_len"]

    @property
    def num_unfinished(self) -> int:
        return len(self._requests)

    @property
    def num_queued(self) -> int:
        return sum(1 for s in self._requests.values() if not s.started)

    def default_sampling_params(self):
        return self.info["default_params"].clone()

    # ----- requests --------------------------------------------------------------------------------
    async def generate(self, prompt: str | list[int], params, request_id: str,
                       lora_request: Any = None) -> AsyncIterator[RequestOutput]:
        """Yield the request's cumulative output each time it advances; the last one has ``finished``.

        Raises the engine's ``ValidationError`` (bad prompt), ``QueueFullError``, ``EngineDeadError``, or
        the error that failed the request. Closing / cancelling the generator aborts the request.
        """
        stream = await self.add_request(prompt, params, request_id, lora_request)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    async def add_request(self, prompt: str | list[int], params, request_id: str,
                          lora_request: Any = None) -> RequestStream:
        """Submit a request and wait until the engine has admitted it (or raised its validation error).

        Iterate the returned stream for outputs; call ``close()`` when done with it, which aborts the
        request if it is unfinished. The server uses this form so that bad prompts become a 400 before
        a streaming response starts.
        """
        self._check_accepting()
        if request_id in self._requests:
            raise ValidationError(f"request id {request_id!r} is already in use", param="request_id")
        if self.num_queued >= self.max_queued_requests:
            raise QueueFullError(f"the waiting queue is full ({self.max_queued_requests} requests); retry later")
        if isinstance(prompt, str) and self.tokenizer is not None:
            prompt = self.tokenizer.encode(prompt)  # tokenize here, away from the engine's loop
        state = _RequestState(request_id, prompt, self._loop.create_future())
        self._requests[request_id] = state
        timing = self._timings[request_id] = RequestTiming(arrival=time.monotonic())
        self._send(("add", request_id, prompt, params, lora_request, timing.arrival))
        stream = RequestStream(self, state)
        try:
            await state.ack
        except BaseException:
            stream.close()
            raise
        return stream

    def _release(self, state: _RequestState) -> None:
        """The consumer is done with a request: abort it if it is still running, account for it."""
        if self._requests.get(state.request_id) is not state:
            return
        if not state.finished and state.error is None and not self.is_dead:
            self._send(("abort", [state.request_id]))
        del self._requests[state.request_id]
        self._finish(state)

    async def abort(self, request_id: str) -> None:
        """Abort a request: its generator raises ``RequestAbortedError``; the engine frees its blocks."""
        from forwardpass.errors import RequestAbortedError

        state = self._requests.get(request_id)
        if state is not None and not state.finished:
            self._fail(state, RequestAbortedError(f"request {request_id} was aborted"))
        if not self.is_dead:
            self._send(("abort", [request_id]))

    async def debug_info(self) -> dict:
        """Engine counters plus a ``check_invariants()`` run, taken between two steps."""
        self._check_alive()
        call_id = next(self._call_ids)
        fut = self._calls[call_id] = self._loop.create_future()
        self._send(("call", call_id, "debug"))
        return await fut

    # ----- internals -------------------------------------------------------------------------------
    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine is not running: {self._dead}")

    def _check_accepting(self) -> None:
        self._check_alive()
        if not self._accepting:
            raise EngineDeadError("the server is not accepting requests (starting or shutting down)")

    def _send(self, cmd: tuple) -> None:
        self._inbox.put(cmd)

    def _fail(self, state: _RequestState, exc: BaseException) -> None:
        state.error = exc
        if not state.ack.done():
            state.ack.set_exception(exc)
            state.ack.exception()  # retrieved: no "never retrieved" warning if nobody awaits it
        state.event.set()

    def _finish(self, state: _RequestState) -> None:
        timing = self._timings.pop(state.request_id, None)
        if timing is None or not state.ack.done() or state.ack.exception() is not None:
            return  # never admitted: nothing to account for
        timing.finished = time.monotonic()
        timing.status = "finished" if state.finished else ("failed" if state.error is not None else "aborted")
        out = state.snapshot()
        for listener in self.finish_listeners:
            try:
                listener(out, timing)
            except Exception:
                logger.exception("finish listener failed")

    def _dispatch(self, events: list) -> None:
        for kind, payload in events:
            if kind == "out":
                state = self._requests.get(payload.request_id)
                if state is None or state.error is not None:
                    continue
                timing = self._timings.get(payload.request_id)
                if timing is not None and any(c.token_ids for c in payload.outputs):
                    timing.on_output()
                state.started = True
                state.merge(payload)
                state.event.set()
            elif kind == "step":
                self.snapshot = {"num_running": payload.num_running, "num_waiting": payload.num_waiting,
                                 "kv_usage": payload.kv_usage, "num_free_blocks": payload.num_free_blocks}
                for listener in self.stat_listeners:
                    listener(payload)
            elif kind == "ack":
                rid, exc = payload
                state = self._requests.get(rid)
                if state is not None and not state.ack.done():
                    if exc is None:
                        state.ack.set_result(None)
                    else:
                        self._fail(state, exc)
            elif kind == "failed":
                rid, exc = payload
                state = self._requests.get(rid)
                if state is not None:
                    self._fail(state, exc)
            elif kind == "snapshot":
                self.snapshot = payload
            elif kind == "reply":
                call_id, result = payload
                fut = self._calls.pop(call_id, None)
                if fut is not None and not fut.done():
                    (fut.set_exception if isinstance(result, BaseException) else fut.set_result)(result)
            elif kind == "ready":
                self.info = payload
                self.snapshot["num_free_blocks"] = payload["num_blocks"]
                if not self._ready.done():
                    self._ready.set_result(None)
            elif kind == "startup_error":
                self._dead = f"startup failed: {payload}"
                if not self._ready.done():
                    self._ready.set_exception(payload)
            elif kind in ("dead", "stopped"):
                self._mark_dead(payload or "the engine has stopped")

    def _mark_dead(self, reason: str) -> None:
        if self._dead is None:
            self._dead = reason
            if "shut down" not in reason and "stopped" not in reason:
                logger.error("engine dead: %s", reason)
        err = EngineDeadError(f"the engine has stopped: {self._dead}")
        for state in list(self._requests.values()):
            if not state.finished and state.error is None:  # keep a real cause already delivered
                self._fail(state, err)
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(err)
        self._calls.clear()
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(err)


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
        else:
            self.itl.append(now - self.last_token)
        self.last_token = now
