"""The event-loop side state of the async engine: one writer, fed by the engine loop's events.

``FrontEnd.dispatch`` runs on the event loop for every list of events the transport delivers: it
applies token deltas through the ``OutputProcessor``, wakes the streams of the requests that advanced,
settles admissions and debug calls, keeps the gauges, and fails requests when the engine dies (then
tells ``on_death``: the restart policy's cue, ``supervisor.py``).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable

from forwardpass.engine.frontend.output_processor import OutputProcessor
from forwardpass.engine.frontend.outputs import RequestOutput
from forwardpass.engine.frontend.protocol import (
    Admitted,
    DebugReply,
    EngineCommand,
    EngineDead,
    EngineEvent,
    EngineInfo,
    Ready,
    RequestsFailed,
    Snapshot,
    StartupFailed,
    StepOutput,
    Stopped,
    StopSamples,
)
from forwardpass.engine.frontend.request_stream import FrontRequest, RequestTiming
from forwardpass.engine.scheduling.batch import TokenDelta
from forwardpass.engine.scheduling.stats import StepRecord
from forwardpass.errors import EngineCrashedError
from forwardpass.sampling.params import SamplingParams

logger = logging.getLogger(__name__)


class FrontEnd:
    def __init__(self, send: Callable[[EngineCommand], None],
                 on_death: Callable[[str], None] | None = None):
        """``on_death(reason)``: the engine died, its requests are failed (the restart policy's cue)."""
        self.send, self.on_death = send, on_death
        self.info: EngineInfo | None = None
        self.snapshot = Snapshot(0, 0, 0.0, 0)
        self.stat_listeners: list[Callable[[StepRecord], None]] = []
        self.finish_listeners: list[Callable[[RequestOutput, RequestTiming], None]] = []
        self.requests: dict[str, FrontRequest] = {}
        self.processor = OutputProcessor(None)
        self.calls: dict[int, asyncio.Future] = {}
        self.dead: str | None = None
        self.ready: asyncio.Future | None = None
        self.last_event = time.monotonic()  # liveness: any event shows the engine loop turning
        self._call_ids = itertools.count(-1, -1)

    def stalled_for(self) -> float:
        """Seconds without any event from the engine while a request waits on it (0 when none does)."""
        if not any(r.running for r in self.requests.values()):
            return 0.0
        return time.monotonic() - self.last_event

    def fail_all(self, exc: BaseException) -> list[str]:
        """Fail every unfinished request with ``exc`` (their streams end with it); the ids failed."""
        failed = [rid for rid, r in self.requests.items() if r.running]
        for rid in failed:
            self.requests[rid].fail(exc)
        return failed

    def call(self, make: Callable[[int], EngineCommand]) -> asyncio.Future:
        """Send ``make(call_id)``, a command the engine answers with a ``DebugReply``; its future.

        Ids count down from -1 so they never meet ``AsyncLLMEngine.debug_info``'s (0 up).
        """
        call_id = next(self._call_ids)
        fut = self.calls[call_id] = asyncio.get_running_loop().create_future()
        self.send(make(call_id))
        return fut

    def finish(self, req: FrontRequest) -> None:
        if not req.ack.done() or req.ack.exception() is not None:
            return  # never admitted: nothing to account for
        timing = req.timing
        timing.finished = time.monotonic()
        timing.status = (
            "finished" if req.state.finished else ("failed" if req.error is not None else "aborted")
        )
        out = req.state.make_output()
        for listener in self.finish_listeners:
            try:
                listener(out, timing)
            except Exception:
                logger.exception("finish listener failed")

    def dispatch(self, events: list[EngineEvent]) -> None:
        self.last_event = time.monotonic()
        for event in events:
            match event:
                case StepOutput(deltas=deltas, record=record):
                    self._on_step(deltas, record)
                case Admitted(request_id=rid, error=error):
                    req = self.requests.get(rid)
                    if req is not None and not req.ack.done():
                        if error is None:
                            req.ack.set_result(None)
                        else:
                            req.fail(error)
                case RequestsFailed(request_ids=rids, error=error):
                    for rid in rids:
                        if (req := self.requests.get(rid)) is not None:
                            req.fail(error)
                case Snapshot():
                    self.snapshot = event
                case DebugReply(call_id=call_id, result=result):
                    fut = self.calls.pop(call_id, None)
                    if fut is not None and not fut.done():
                        if isinstance(result, BaseException):
                            fut.set_exception(result)
                        else:
                            fut.set_result(result)
                case Ready(info=info):
                    self.info = info
                    self.snapshot = Snapshot(0, 0, 0.0, info.num_blocks)
                    if self.ready is not None and not self.ready.done():
                        self.ready.set_result(None)
                case StartupFailed(error=error):
                    self.dead = f"startup failed: {error}"
                    if self.ready is not None and not self.ready.done():
                        self.ready.set_exception(error)
                case EngineDead(reason=reason):
                    self.mark_dead(reason)
                case Stopped():
                    self.mark_dead("the engine has stopped")

    def _on_step(self, deltas: tuple[TokenDelta, ...], record: StepRecord) -> None:
        touched, stopped = self.processor.process(deltas)
        if stopped:
            self.send(StopSamples(tuple(stopped)))
        for state in touched:
            req = self.requests.get(state.request_id)
            if req is None or req.error is not None:
                continue
            req.timing.on_output()
            req.started = True
            req.version += 1
            req.event.set()
        self.snapshot = Snapshot(
            record.num_running, record.num_waiting, record.kv_usage, record.num_free_blocks
        )
        for listener in self.stat_listeners:
            listener(record)

    def mark_dead(self, reason: str) -> None:
        newly = self.dead is None
        if newly:
            self.dead = reason
        # requests still running here were in the engine when it died (a shutdown fails them first)
        err = EngineCrashedError(f"the engine has stopped: {self.dead}")
        self.fail_all(err)  # only unfinished requests: a real cause already delivered is kept
        for fut in self.calls.values():
            if not fut.done():
                fut.set_exception(err)
        self.calls.clear()
        if self.ready is not None and not self.ready.done():
            self.ready.set_exception(err)
        if newly and self.on_death is not None:
            self.on_death(reason)
        elif newly and "shut down" not in reason and "stopped" not in reason:
            logger.error("engine dead: %s", reason)


class FrontEndView:
    """Read-only views of the front end's state (``AsyncLLMEngine`` is one)."""

    front: FrontEnd

    @property
    def info(self) -> EngineInfo | None:
        return self.front.info

    @property
    def snapshot(self) -> Snapshot:
        return self.front.snapshot

    @property
    def is_dead(self) -> bool:
        return self.front.dead is not None

    @property
    def dead_reason(self) -> str | None:
        return self.front.dead

    @property
    def max_model_len(self) -> int:
        assert self.info is not None, "start() the engine first"
        return self.info.max_model_len

    @property
    def vocab_size(self) -> int:
        assert self.info is not None, "start() the engine first"
        return self.info.vocab_size

    @property
    def num_unfinished(self) -> int:
        return len(self.front.requests)

    @property
    def num_queued(self) -> int:
        """Sequences (``n`` per request) that have not produced a token yet."""
        return sum(r.num_seqs for r in self.front.requests.values() if not r.started)

    def stalled_for(self) -> float:
        return self.front.stalled_for()

    def default_sampling_params(self) -> SamplingParams:
        assert self.info is not None, "start() the engine first"
        return self.info.default_params.clone()
