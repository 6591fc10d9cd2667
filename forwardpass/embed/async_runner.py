"""``AsyncEmbedder``: the server's embedding front end. Compute runs off the event loop, batched across
requests.

Requests queue their (already tokenized) inputs; one worker task takes everything waiting, runs it through
``EmbeddingRunner.embed_ids`` on a single compute thread (so the token budget batches inputs of several
requests together), and hands each request its vectors. The event loop only moves lists around.

Fault isolation: when a forward pass over several requests raises, each request is run again alone, so
only the request whose input fails gets the error. A request whose client went away (its future was
cancelled) is dropped before it is computed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from forwardpass.embed.runner import EmbeddingRunner
from forwardpass.errors import EngineDeadError, QueueFullError

logger = logging.getLogger(__name__)


@dataclass
class _Job:
    inputs: list[list[int]]
    future: asyncio.Future[list[list[float]]]
    queued_at: float = field(default_factory=time.monotonic)


class AsyncEmbedder:
    def __init__(self, runner: EmbeddingRunner, max_queued_inputs: int = 16384):
        self.runner = runner
        self.max_queued_inputs = max_queued_inputs
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="fp-embed")
        self._pending: list[_Job] = []
        self._running: list[_Job] = []  # the jobs of the forward pass in progress
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self.dead_reason: str | None = None
        self.busy_since: float | None = None  # when the running forward pass began (for /health)

    @property
    def queued_inputs(self) -> int:
        return sum(len(j.inputs) for j in self._pending)

    async def start(self) -> None:
        self._wake = asyncio.Event()
        self._task = asyncio.create_task(self._loop(), name="fp-embed-loop")

    async def shutdown(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self.fail_all(EngineDeadError("the server is shutting down"))
        self._pool.shutdown(wait=False, cancel_futures=True)

    def fail_all(self, exc: BaseException) -> None:
        """Answer every waiting and running request with ``exc`` now (the server's shutdown deadline): each
        client gets its error response instead of a dropped connection. A pass still computing finishes in
        its thread and its results are dropped."""
        for job in [*self._running, *self._pending]:
            if not job.future.done():
                job.future.set_exception(exc)
        self._pending.clear()

    async def embed(self, inputs: list[list[int]]) -> list[list[float]]:
        """The vectors of ``inputs`` (checked token ids), computed with whatever else is waiting."""
        if self._task is None or self._task.done():
            raise EngineDeadError(
                f"the embedding worker is not running{': ' + self.dead_reason if self.dead_reason else ''}"
            )
        if self.queued_inputs + len(inputs) > self.max_queued_inputs:
            raise QueueFullError(
                f"{self.queued_inputs} inputs are waiting (limit {self.max_queued_inputs}); retry later"
            )
        future: asyncio.Future[list[list[float]]] = asyncio.get_running_loop().create_future()
        self._pending.append(_Job(inputs, future))
        assert self._wake is not None
        self._wake.set()
        return await future

    async def _loop(self) -> None:
        assert self._wake is not None
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                while self._pending:
                    jobs, self._pending = self._pending, []
                    await self._run([j for j in jobs if not j.future.done()])
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # a bug in this loop: say so on /health instead of hanging requests
            self.dead_reason = f"{type(exc).__name__}: {exc}"
            logger.exception("the embedding worker died")
            raise

    async def _run(self, jobs: list[_Job]) -> None:
        if not jobs:
            return
        flat = [ids for job in jobs for ids in job.inputs]
        self.busy_since = time.monotonic()
        self._running = jobs
        try:
            vectors = await asyncio.get_running_loop().run_in_executor(
                self._pool, self.runner.embed_ids, flat
            )
        except Exception as exc:  # noqa: BLE001 - any failure of a pass is that request's error, not the server's
            if len(jobs) > 1:  # find the request that fails; the others still get their answers
                for job in jobs:
                    await self._run([job])
                return
            logger.warning("embedding request failed: %s: %s", type(exc).__name__, exc)
            if not jobs[0].future.done():
                jobs[0].future.set_exception(exc)
            return
        finally:
            self.busy_since = None
            self._running = []
        start = 0
        for job in jobs:
            part = vectors[start : start + len(job.inputs)]
            start += len(job.inputs)
            if not job.future.done():
                job.future.set_result(part)
