"""The engine side of the async engine: owns an ``EngineCore`` and runs its step loop.

Commands arrive through ``inbox`` and are applied between steps; the loop sleeps on the inbox when no
request is unfinished. Each turn's events go out as one list through ``emit``. The same loop runs in
a thread or in a process of its own (``transport.py``).

Failure handling: an exception from ``core.step()`` fails every request then in the engine (the batch
state is unknown), which are aborted; if the KV invariants still hold the loop carries on, otherwise
it stops and reports the engine dead. A crash of the loop itself also reports it dead.
"""

from __future__ import annotations

import logging
import os
import queue
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from forwardpass.config import EngineConfig
from forwardpass.engine.core import EngineCore
from forwardpass.engine.frontend.launch import build_engine_core
from forwardpass.engine.frontend.protocol import (
    Abort,
    AddRequest,
    Admitted,
    BlockMapRequest,
    DebugReply,
    DebugRequest,
    EngineCommand,
    EngineDead,
    EngineEvent,
    EngineInfo,
    Ready,
    RequestsFailed,
    Shutdown,
    Snapshot,
    StartupFailed,
    StepOutput,
    Stopped,
    StopSamples,
    portable,
)
from forwardpass.engine.introspect import block_map
from forwardpass.errors import EngineDeadError, ForwardpassError
from forwardpass.layers.weight_report import described_plan

logger = logging.getLogger(__name__)

IDLE_POLL_S = 1.0  # how often an idle engine checks that its front end is alive


@dataclass
class EngineSpec:
    """A picklable recipe for the engine core, built inside its loop (thread or process).

    ``factory`` is None (the standard core), an ``EngineCore`` subclass (built the standard way), or a
    module-level callable ``factory(model, EngineConfig) -> EngineCore``.
    """

    model: str
    config_kwargs: dict[str, Any] = field(default_factory=dict)
    factory: Callable[[str, EngineConfig], EngineCore] | type[EngineCore] | None = None
    log_level: int = logging.WARNING
    num_threads: int | None = None  # torch compute threads of the engine (None: torch's default)


def build_engine(spec: EngineSpec) -> EngineCore:
    if spec.num_threads:
        import torch

        torch.set_num_threads(spec.num_threads)
    config = EngineConfig(**spec.config_kwargs)
    factory = spec.factory
    if factory is None:
        return build_engine_core(spec.model, config)
    if isinstance(factory, type):  # an EngineCore subclass
        return build_engine_core(spec.model, config, core_cls=factory)
    return factory(spec.model, config)


class _EngineBroken(Exception):
    """A failed step left the engine inconsistent; the loop ends (the front end has been told)."""


class Inbox(Protocol):
    def get(self, block: bool = True, timeout: float | None = None) -> EngineCommand: ...

    def get_nowait(self) -> EngineCommand: ...


class EngineLoop:
    def __init__(
        self,
        spec: EngineSpec,
        inbox: Inbox,
        emit: Callable[[list[EngineEvent]], None],
        alive: Callable[[], bool],
    ):
        self.spec, self.inbox, self.emit, self.alive = spec, inbox, emit, alive

    def run(self) -> None:
        try:
            core = build_engine(self.spec)
        except BaseException as exc:
            if isinstance(exc, ForwardpassError):  # a bad model or option: the message says it all
                logger.error("engine failed to start: %s", exc)
            else:
                logger.exception("engine failed to start")
            self.emit([StartupFailed(portable(exc))])
            return
        self.core = core
        self.emit(
            [
                Ready(
                    EngineInfo(
                        max_model_len=core.max_model_len,
                        vocab_size=core.spec.vocab,
                        num_blocks=core.kv.num_blocks,
                        block_size=core.config.block_size,
                        default_params=core.default_sampling_params(),
                        eos_token_ids=tuple(core.eos_token_ids),
                        max_num_seqs=core.config.max_num_seqs,
                        # the plan, and what the loaded weights really are (a GGUF file's own types)
                        execution_plan=described_plan(core.plan, core.model),
                        model_spec=core.spec,
                    )
                )
            ]
        )
        try:
            self._loop()
        except _EngineBroken:
            return  # already reported, together with the requests it failed
        except BaseException as exc:
            logger.exception("engine loop crashed")
            self.emit([EngineDead(f"engine loop crashed: {type(exc).__name__}: {exc}")])
            return
        self.emit([Stopped()])

    def _loop(self) -> None:
        core = self.core
        while True:
            events: list[EngineEvent] = []
            for cmd in self._drain(block=not core.has_unfinished_requests()):
                match cmd:
                    case Shutdown():
                        core.abort(list(core.scheduler.requests))
                        return
                    case AddRequest(request_id=rid):
                        try:
                            core.add_request(
                                rid,
                                cmd.prompt_token_ids,
                                cmd.params,
                                lora_request=cmd.lora_request,
                                arrival_time=cmd.arrival_time,
                                encoder_input=cmd.encoder_input,
                            )
                        except Exception as exc:  # noqa: BLE001 - validation errors go back to the caller
                            events.append(Admitted(rid, portable(exc)))
                        else:
                            events.append(Admitted(rid))
                    case Abort(request_ids=ids):
                        core.abort(list(ids))
                    case StopSamples(samples=samples):
                        core.stop_samples(list(samples))
                    case DebugRequest(call_id=call_id):
                        events.append(DebugReply(call_id, self._debug()))
                    case BlockMapRequest(call_id=call_id):
                        events.append(DebugReply(call_id, block_map(core)))
            if core.has_unfinished_requests():
                try:
                    out = core.step()
                except Exception as exc:  # noqa: BLE001 - fail the affected requests, not the process
                    self._fail_all(exc, events)
                else:
                    events.append(StepOutput(tuple(out.deltas), out.record))
                    events.extend(RequestsFailed((rid,), err) for rid, err in out.failed.items())
            if not core.has_unfinished_requests():  # idle from here: report the gauges once more
                events.append(self._snapshot())
            if events:
                self.emit(events)

    def _drain(self, block: bool) -> list[EngineCommand]:
        out: list[EngineCommand] = []
        while block:
            try:
                out.append(self.inbox.get(timeout=IDLE_POLL_S))
                break
            except queue.Empty:
                if not self.alive():
                    return [Shutdown()]
        while True:
            try:
                out.append(self.inbox.get_nowait())
            except queue.Empty:
                return out

    def _fail_all(self, exc: Exception, events: list[EngineEvent]) -> None:
        rids = tuple(self.core.scheduler.requests)
        logger.exception("engine step failed; failing the %d requests in the engine", len(rids))
        self.core.abort(list(rids))
        events.append(RequestsFailed(rids, portable(exc)))  # the requests learn the real cause
        if isinstance(exc, EngineDeadError):  # e.g. a tensor-parallel worker died: no later step can run
            events.append(EngineDead(str(exc)))
            self.emit(events)
            raise _EngineBroken from exc
        try:
            self.core.check_invariants()
        except AssertionError as broken:  # the fault broke the KV pool: the engine cannot go on
            # in the same message, so no request can see the engine alive after this failure
            events.append(EngineDead(f"the KV cache is inconsistent after a failed step: {broken}"))
            self.emit(events)
            raise _EngineBroken from broken

    def _snapshot(self) -> Snapshot:
        s, kv = self.core.scheduler, self.core.kv
        return Snapshot(len(s.running), len(s.waiting), kv.usage, kv.num_free_blocks)

    def _debug(self) -> dict[str, Any]:
        core = self.core
        snap = self._snapshot()
        info: dict[str, Any] = {
            "num_running": snap.num_running,
            "num_waiting": snap.num_waiting,
            "kv_usage": snap.kv_usage,
            "num_free_blocks": snap.num_free_blocks,
            "num_blocks": core.kv.num_blocks,
            "num_requests": len(core.scheduler.requests),
            "total_preemptions": core.scheduler.num_preemptions,
            "invariants_ok": True,
            "pid": os.getpid(),  # the engine's process (tests kill it)
            "invariant_error": None,
        }
        try:
            core.check_invariants()
        except AssertionError as exc:
            info["invariants_ok"], info["invariant_error"] = False, str(exc) or "AssertionError"
        return info
