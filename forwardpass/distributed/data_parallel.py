"""Data parallelism for the server: N engine replicas behind one API, each request to the least loaded.

Each replica is a whole ``AsyncLLMEngine`` — its own engine process (and, with tensor parallelism, its
own group of ranks), its own KV cache and scheduler. A new request goes to the live replica with the
fewest requests in flight (ties: the next one in turn, so an idle server spreads a burst evenly).
Nothing is shared between replicas but the listeners: ``/metrics`` and the dashboard see every
replica's steps and finished requests.

A replica that dies takes only its own requests with it; new requests go to the others while it restarts
(each replica restarts on its own, under ``restart_policy``). The server reports itself dead (``/health``
503) only when no replica is up, and ``on_engine_lost`` is called once no replica is up or coming back.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from forwardpass.engine.frontend.async_engine import AsyncLLMEngine, EngineSpec
from forwardpass.engine.frontend.outputs import RequestOutput
from forwardpass.engine.frontend.protocol import EngineInfo, Snapshot
from forwardpass.engine.frontend.request_stream import Generates, RequestStream, RequestTiming
from forwardpass.engine.frontend.supervisor import NO_RESTARTS, RestartPolicy
from forwardpass.engine.scheduling.stats import StepRecord
from forwardpass.errors import EngineDeadError, ValidationError
from forwardpass.loader.tokenizer import Tokenizer
from forwardpass.lora.request import LoRARequest
from forwardpass.sampling.params import SamplingParams


class DataParallelEngine(Generates):
    """The ``AsyncLLMEngine`` interface the server uses, over ``replicas`` engines (``generate`` is
    ``Generates``'s, over this ``add_request``)."""

    def __init__(
        self,
        spec: EngineSpec,
        *,
        replicas: int,
        backend: str = "process",
        max_queued_requests: int = 1024,
        request_timeout_s: float | None = None,
        restart_policy: RestartPolicy = NO_RESTARTS,
        on_engine_lost: Callable[[str], None] | None = None,
    ):
        if replicas < 1:
            raise ValidationError(
                f"data_parallel_size must be >= 1, got {replicas}", param="data_parallel_size"
            )
        self.spec, self.max_queued_requests = spec, max_queued_requests
        self._adding: set[str] = set()  # request ids on their way to a replica (add_request)
        self.model_dir = Path(spec.model)
        self.replicas = [
            AsyncLLMEngine(
                spec,
                backend=backend,
                max_queued_requests=max_queued_requests,
                request_timeout_s=request_timeout_s,
                restart_policy=restart_policy,
                on_engine_lost=self._replica_lost,
            )
            for _ in range(replicas)
        ]
        self.on_engine_lost = on_engine_lost
        self.stat_listeners: list[Callable[[StepRecord], None]] = []
        self.finish_listeners: list[Callable[[RequestOutput, RequestTiming], None]] = []
        for r in self.replicas:  # one list for all: a listener registered later hears every replica
            r.stat_listeners = r.front.stat_listeners = self.stat_listeners
            r.finish_listeners = r.front.finish_listeners = self.finish_listeners
        self._turn = itertools.count()

    # ----- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        await asyncio.gather(*(r.start() for r in self.replicas))

    async def shutdown(self, timeout: float = 30.0) -> None:
        await asyncio.gather(*(r.shutdown(timeout) for r in self.replicas))

    def fail_all(self, exc: BaseException) -> None:
        for r in self.replicas:
            r.fail_all(exc)

    # ----- routing ---------------------------------------------------------------------------------
    def _replica_lost(self, reason: str) -> None:
        if self.on_engine_lost is not None and all(r.is_dead and not r.supervisor.restarting
                                                   for r in self.replicas):
            self.on_engine_lost(reason)

    def check_alive(self) -> None:
        """Raises what a request gets when no replica is up (restarting: the soonest one's error)."""
        if self.is_dead:
            for r in sorted(self.replicas, key=lambda r: not r.supervisor.restarting):
                r.check_alive()

    @property
    def num_restarts(self) -> int:
        return sum(r.num_restarts for r in self.replicas)

    def pick(self) -> AsyncLLMEngine:
        """The live replica with the fewest requests in flight (round robin among equals)."""
        live = [r for r in self.replicas if not r.is_dead]
        if not live:
            self.check_alive()
            raise EngineDeadError(f"the engine is not running: {self.dead_reason}")
        start = next(self._turn) % len(live)
        turn = live[start:] + live[:start]
        return min(turn, key=lambda r: r.num_unfinished)

    async def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str,
        lora_request: LoRARequest | None = None,
        output_kind: Literal["cumulative", "delta"] = "cumulative",
        encoder_input: Any = None,  # encoder–decoder models (Whisper): log-mel features, as one engine takes
    ) -> RequestStream:
        if request_id in self._adding or any(request_id in r.front.requests for r in self.replicas):
            raise ValidationError(f"request id {request_id!r} is already in use", param="request_id")
        # reserved until a replica holds it: two requests with one id arriving together (the replica's
        # add_request awaits before it registers the id) must not both pass the check above
        self._adding.add(request_id)
        try:
            return await self.pick().add_request(
                prompt, params, request_id, lora_request, output_kind, encoder_input=encoder_input
            )
        finally:
            self._adding.discard(request_id)

    async def abort(self, request_id: str) -> None:
        for r in self.replicas:
            if request_id in r.front.requests:
                await r.abort(request_id)

    async def debug_info(self) -> dict[str, Any]:
        infos = [await r.debug_info() for r in self.replicas if not r.is_dead]
        if not infos:
            raise EngineDeadError(f"the engine is not running: {self.dead_reason}")
        return {**infos[0], "replicas": infos}

    # ----- views (what the routes, metrics and dashboard read) ------------------------------------
    @property
    def front(self):  # the dashboard's block map: the first live replica's
        return next((r for r in self.replicas if not r.is_dead), self.replicas[0]).front

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.replicas[0].tokenizer

    @property
    def info(self) -> EngineInfo | None:
        """Replica 0's, with the KV blocks of all replicas (the snapshot's free blocks are summed too)."""
        first = self.replicas[0].info
        if first is None or any(r.info is None for r in self.replicas):
            return first
        return dataclasses.replace(first, num_blocks=sum(r.info.num_blocks for r in self.replicas if r.info))

    @property
    def snapshot(self) -> Snapshot:
        snaps = [r.snapshot for r in self.replicas]
        return Snapshot(
            sum(s.num_running for s in snaps),
            sum(s.num_waiting for s in snaps),
            sum(s.kv_usage for s in snaps) / len(snaps),
            sum(s.num_free_blocks for s in snaps),
        )

    @property
    def is_dead(self) -> bool:
        return all(r.is_dead for r in self.replicas)

    @property
    def dead_reason(self) -> str | None:
        reasons = [f"replica {i}: {r.dead_reason}" for i, r in enumerate(self.replicas) if r.is_dead]
        return "; ".join(reasons) if self.is_dead else None

    @property
    def max_model_len(self) -> int:
        return self.replicas[0].max_model_len

    @property
    def vocab_size(self) -> int:
        return self.replicas[0].vocab_size

    @property
    def num_unfinished(self) -> int:
        return sum(r.num_unfinished for r in self.replicas)

    @property
    def num_queued(self) -> int:
        return sum(r.num_queued for r in self.replicas)

    def stalled_for(self) -> float:
        return max(r.stalled_for() for r in self.replicas if not r.is_dead) if not self.is_dead else 0.0

    def default_sampling_params(self) -> SamplingParams:
        return self.replicas[0].default_sampling_params()
