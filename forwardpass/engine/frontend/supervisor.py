"""Engine restarts: an engine loop that dies (its process killed by the OS's out-of-memory killer, a crash
in a kernel, a fault that broke the KV pool) is replaced by a fresh one, a bounded number of times.

``AsyncLLMEngine`` owns one ``EngineSupervisor``; so does every engine a multi-model server holds, so each
model restarts on its own. The front end has already failed the dead engine's requests with the cause
(``FrontEnd.mark_dead``) when ``on_death`` is called. Then either a restart is scheduled (after a backoff
that doubles up to ``max_backoff_s``) and requests arriving meanwhile get ``EngineRestartingError`` (503 +
Retry-After), or, with no restarts left, ``on_exhausted(reason)`` is called: the server decides what that
means (``server/run.py`` exits non-zero, vLLM's convention, so that a process supervisor restarts it).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from forwardpass.errors import ConfigError, EngineRestartingError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RestartPolicy:
    """``max_restarts`` over the engine's lifetime (0: a dead engine stays dead); the n-th restart waits
    ``min(max_backoff_s, backoff_s * 2**n)`` seconds first, so a model that dies at once is not reloaded
    in a tight loop."""

    max_restarts: int = 0
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ConfigError(f"engine restarts must be >= 0, got {self.max_restarts}",
                              param="engine_restarts")
        if not 0 <= self.backoff_s <= self.max_backoff_s:
            raise ConfigError(f"restart backoff must satisfy 0 <= backoff_s ({self.backoff_s}) <= "
                              f"max_backoff_s ({self.max_backoff_s})", param="backoff_s")

    def delay(self, attempt: int) -> float:
        return min(self.max_backoff_s, self.backoff_s * 2.0 ** min(attempt, 30))


NO_RESTARTS = RestartPolicy()  # the library's default: a dead engine stays dead (as before restarts)


class EngineSupervisor:
    """Restarts the engine through ``launch()`` (start a loop, wait until it is ready; raises if it dies
    while starting) after each unexpected death, within ``policy``."""

    def __init__(self, policy: RestartPolicy, launch: Callable[[], Awaitable[None]],
                 on_exhausted: Callable[[str], None] | None = None):
        self.policy, self.launch, self.on_exhausted = policy, launch, on_exhausted
        self.num_restarts = 0  # successful restarts (the /metrics counter)
        self.attempts = 0  # restarts tried, counted against the policy
        self.running = False  # an engine started once: deaths before that are start-up failures
        self.closing = False  # shutting down: the engine stopping is expected
        self.restarting = False
        self._retry_at = 0.0  # monotonic time the engine is expected back (Retry-After)
        self._startup_s = 0.0  # how long the last start took (the reload part of Retry-After)
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        """The first start; its failure is the caller's (nothing is retried)."""
        began = time.monotonic()
        await self.launch()
        self._startup_s, self.running = time.monotonic() - began, True

    def on_death(self, reason: str) -> None:
        """The engine died (called on the event loop, its requests already failed)."""
        if self.closing or not self.running or self.restarting:
            return
        if self.attempts >= self.policy.max_restarts:
            self._give_up(reason)
            return
        self.restarting = True
        self._task = asyncio.ensure_future(self._restart(reason))

    def unavailable(self, reason: str) -> EngineRestartingError:
        """The error for a request that arrives while the engine restarts."""
        wait = max(1, math.ceil(self._retry_at - time.monotonic()))
        return EngineRestartingError(f"the engine is restarting after it died ({reason}); retry in about "
                                     f"{wait} s", retry_after_s=wait)

    def close(self) -> None:
        self.closing = True
        if self._task is not None:
            self._task.cancel()

    async def _restart(self, reason: str) -> None:
        try:
            while True:
                delay = self.policy.delay(self.attempts)
                self.attempts += 1
                self._retry_at = time.monotonic() + delay + self._startup_s
                logger.error("engine died: %s; its requests failed; restarting it in %.0f s "
                             "(restart %d of %d)", reason, delay, self.attempts, self.policy.max_restarts)
                await asyncio.sleep(delay)
                try:
                    await self.start()
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # noqa: BLE001 - any failure to come back is one more death
                    reason = f"the restarted engine failed to start: {exc}"
                    if self.attempts >= self.policy.max_restarts:
                        self.restarting = False
                        self._give_up(reason)
                        return
                    continue
                self.num_restarts += 1
                self.restarting = False
                logger.warning("engine restarted (restart %d of %d); serving again", self.attempts,
                               self.policy.max_restarts)
                return
        except asyncio.CancelledError:
            self.restarting = False

    def _give_up(self, reason: str) -> None:
        n = self.policy.max_restarts
        logger.error("engine died: %s; %s", reason, f"no restarts left ({n} used)" if n else
                     "restarts are off (--engine-restarts 0)")
        if self.on_exhausted is not None:
            self.on_exhausted(reason)
