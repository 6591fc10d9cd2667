"""ModelPool: the models one server serves (``forwardpass serve A B C``), each loaded when a request names it.

Every served name has a :class:`ModelSlot`: its kind (what routes it answers), its memory estimate, how to
load it, and its state::

    unloaded -> loading -> loaded -> draining -> unloaded

A request holds a *lease* on its model (:meth:`ModelPool.acquire` / :meth:`ModelPool.release`) for as long as
it runs, a stream included. Loading runs in a task of its own (never in a request, so a request that times
out does not cancel a load others wait for), one load at a time, and before it the pool makes room: while
``max_loaded`` models are loaded, or the memory budget would be exceeded, the least recently used model is
drained (no new leases; the requests it already admitted finish) and unloaded. A request that arrives while
its model drains waits for it to unload, then loads it again. A request counted while its model loads is
served by that load even if another load then drains the model: so alternating requests cannot starve each
other. A model whose estimate alone exceeds the budget is refused (503 naming the budget) without
unloading anything.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

from prometheus_client import CollectorRegistry
from starlette.types import ASGIApp

from forwardpass.errors import (
    ForwardpassError,
    ModelLoadError,
    ModelNotFoundError,
    RequestTimeoutError,
    ValidationError,
)

logger = logging.getLogger("forwardpass.serve")

GB = 1e9


class ModelKind(enum.StrEnum):
    """What a served model does, hence which routes it answers."""

    GENERATE = "generate"  # chat, completions, responses, tokenize
    TRANSCRIBE = "transcribe"  # /v1/audio/transcriptions (Whisper)
    EMBED = "embed"  # /v1/embeddings (an encoder)
    IMAGE = "image"  # /v1/images/generations (a diffusion pipeline)
    VIDEO = "video"  # /v1/videos


class LoadedModel(Protocol):
    """A model once loaded: the single-model app that serves it, and what the pool needs of it."""

    @property
    def app(self) -> ASGIApp:
        """The single-model app that answers its requests."""

    async def close(self, timeout_s: float) -> None:
        """Stop it (its engine process, its worker) and free its memory; in-flight requests are done."""

    def fail_all(self, exc: BaseException) -> None:
        """End every request it still runs with ``exc`` (the server's shutdown deadline passed)."""

    def problem(self, watchdog_timeout_s: float) -> str | None:
        """Why it cannot serve now (a dead engine, a stalled step), or None."""

    def dead_reason(self) -> str | None:
        """Why its engine (or worker) is gone for good, or None: the pool then loads it again."""

    def metrics(self) -> CollectorRegistry | None:
        """Its Prometheus registry, refreshed (the ``model`` label is added by the server)."""


class ModelMemoryError(ForwardpassError):
    """A model that cannot fit the memory budget even alone: 503, and nothing else is unloaded for it."""

    error_type = "server_overloaded"
    status_code = 503


class ModelState(enum.StrEnum):
    UNLOADED = "unloaded"
    LOADING = "loading"
    LOADED = "loaded"
    DRAINING = "draining"  # chosen to unload: admits no new request, waits for the ones it has


@dataclass(eq=False)
class ModelSlot:
    name: str
    kind: ModelKind
    memory_bytes: int  # the estimate the budget counts (memory_need.py)
    load: Callable[[], Awaitable[LoadedModel]]  # starts it; raises the load's error
    state: ModelState = ModelState.UNLOADED
    model: LoadedModel | None = None
    users: int = 0  # leases held or promised (requests counted while it loads)
    last_used: float = 0.0
    loads: int = 0
    unloads: int = 0
    load_seconds: float | None = None  # how long the last load took
    load_task: asyncio.Task[None] | None = field(default=None, repr=False)


class ModelPool:
    """The slots, by served name (the first is the default), with the loading policy above."""

    def __init__(self, slots: Iterable[ModelSlot], *, max_loaded: int | None = None,
                 memory_budget_bytes: int | None = None, load_timeout_s: float | None = None,
                 unload_timeout_s: float = 30.0) -> None:
        self.slots = {s.name: s for s in slots}
        if not self.slots:
            raise ValueError("a model pool needs at least one model")
        if max_loaded is not None and max_loaded < 1:
            raise ValueError(f"max_loaded must be >= 1, got {max_loaded}")
        self.max_loaded, self.memory_budget_bytes = max_loaded, memory_budget_bytes
        self.load_timeout_s, self.unload_timeout_s = load_timeout_s, unload_timeout_s
        self._changed = asyncio.Condition()  # notified on every state or lease change
        self._load_lock = asyncio.Lock()  # one load (and the unloads that make room for it) at a time
        self._closing = False

    @property
    def default(self) -> ModelSlot:
        return next(iter(self.slots.values()))

    # ----- routing ---------------------------------------------------------------------------------
    def route(self, name: str | None, kinds: tuple[ModelKind, ...], what: str) -> ModelSlot:
        """The slot a request for ``what`` (a route) naming ``name`` goes to: 404 for a name not served, 400
        for a model of another kind. No name: the default model if it fits the route, else the first model
        of a kind that does."""
        if name is None:
            if self.default.kind in kinds:
                return self.default
            slot = next((s for s in self.slots.values() if s.kind in kinds), None)
            if slot is None:
                raise ValidationError(f"{what} needs a model of kind {' or '.join(kinds)}, and this server "
                                      f"serves none: {self.described()}", param="model",
                                      code="model_wrong_kind")
            return slot
        slot = self.slots.get(name)
        if slot is None:
            raise ModelNotFoundError(f"the model {name!r} does not exist; this server serves: "
                                     f"{', '.join(self.slots)}", param="model", code="model_not_found")
        if slot.kind not in kinds:
            raise ValidationError(f"the model {name!r} is a {slot.kind} model; {what} needs a model of "
                                  f"kind {' or '.join(kinds)} (served: {self.described()})",
                                  param="model", code="model_wrong_kind")
        return slot

    def described(self) -> str:
        return ", ".join(f"{s.name} ({s.kind})" for s in self.slots.values())

    # ----- leases ----------------------------------------------------------------------------------
    async def acquire(self, slot: ModelSlot) -> LoadedModel:
        """The loaded model, loading it first if needed (waiting at most ``load_timeout_s``: a 504); the
        caller must :meth:`release` it when its request ends."""
        try:
            return await asyncio.wait_for(self._acquire(slot), self.load_timeout_s)
        except TimeoutError:
            raise RequestTimeoutError(
                f"the model {slot.name!r} did not become ready within the request timeout "
                f"({self.load_timeout_s:g} s; it is {slot.state})") from None

    async def _acquire(self, slot: ModelSlot) -> LoadedModel:
        while True:
            if self._closing:
                raise ModelLoadError("the server is shutting down")
            if slot.state is ModelState.LOADED:
                assert slot.model is not None
                dead = slot.model.dead_reason()
                if dead is not None:  # its engine died (killed, crashed): replace it, then serve
                    await self._unload(slot, f"its engine is gone: {dead}; it is loaded again")
                    continue
                slot.users += 1
                slot.last_used = time.monotonic()
                return slot.model
            if slot.state is ModelState.DRAINING:  # wait until it is unloaded, then load it again
                async with self._changed:
                    await self._changed.wait_for(lambda: slot.state is not ModelState.DRAINING)
                continue
            if slot.state is ModelState.UNLOADED:
                self._check_fits(slot)
                slot.state = ModelState.LOADING
                slot.load_task = asyncio.create_task(self._load(slot), name=f"load {slot.name}")
            assert slot.load_task is not None
            slot.users += 1  # counted now: a drain that starts after this load waits for us
            try:
                await asyncio.shield(slot.load_task)
            except BaseException:
                await self._release(slot)
                raise
            slot.last_used = time.monotonic()
            assert slot.model is not None  # loaded, or draining but waiting for our lease
            return slot.model

    def release(self, slot: ModelSlot) -> None:
        """The end of a request's lease (``acquire``'s other half)."""
        slot.users -= 1
        slot.last_used = time.monotonic()
        asyncio.ensure_future(self._notify())

    async def _release(self, slot: ModelSlot) -> None:
        slot.users -= 1
        await self._notify()

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    # ----- loading and unloading -------------------------------------------------------------------
    def _check_fits(self, slot: ModelSlot) -> None:
        budget = self.memory_budget_bytes
        if budget is not None and slot.memory_bytes > budget:
            raise ModelMemoryError(
                f"the model {slot.name!r} needs about {slot.memory_bytes / GB:.2f} GB (weights + KV cache), "
                f"more than this server's memory budget of {budget / GB:.2f} GB (--models-memory); it is "
                "not loaded, and the other models keep serving", param="model", code="model_over_budget")

    async def _load(self, slot: ModelSlot) -> None:
        try:
            async with self._load_lock:
                await self._make_room(slot)
                logger.info("loading model %s (%s, about %.2f GB) ...", slot.name, slot.kind,
                            slot.memory_bytes / GB)
                t0 = time.monotonic()
                slot.model = await slot.load()
                slot.load_seconds = time.monotonic() - t0
                slot.loads += 1
                slot.state, slot.last_used = ModelState.LOADED, time.monotonic()
                logger.info("loaded model %s in %.1f s (%s)", slot.name, slot.load_seconds,
                            self._loaded_line())
        except BaseException as exc:
            slot.state, slot.model = ModelState.UNLOADED, None
            logger.error("loading model %s failed: %s", slot.name, exc)
            await self._notify()
            if isinstance(exc, ForwardpassError) or not isinstance(exc, Exception):
                raise
            raise ModelLoadError(f"the model {slot.name!r} failed to load: {exc}") from exc
        await self._notify()

    async def _make_room(self, target: ModelSlot) -> None:
        """Unload least recently used models until ``target`` fits the count and the memory budget."""
        while True:
            held = [s for s in self.slots.values()
                    if s is not target and s.state in (ModelState.LOADED, ModelState.DRAINING)]
            over_count = self.max_loaded is not None and len(held) + 1 > self.max_loaded
            budget = self.memory_budget_bytes
            need = sum(s.memory_bytes for s in held) + target.memory_bytes
            over_memory = budget is not None and need > budget
            if not (over_count or over_memory):
                return
            loaded = [s for s in held if s.state is ModelState.LOADED]
            if not loaded:  # only models already on their way out (a dead engine's): wait for them
                async with self._changed:
                    await self._changed.wait()
                continue
            victim = min(loaded, key=lambda s: s.last_used)
            why = (f"--models-max {self.max_loaded}" if over_count
                   else f"the memory budget of {(budget or 0) / GB:.2f} GB")
            await self._unload(victim, f"least recently used; {target.name} needs room under {why}")

    async def _unload(self, slot: ModelSlot, why: str) -> None:
        slot.state = ModelState.DRAINING
        await self._notify()
        logger.info("unloading model %s (%s); waiting for its %d request(s) in flight", slot.name, why,
                    slot.users)
        async with self._changed:
            await self._changed.wait_for(lambda: slot.users <= 0)
        model, slot.model = slot.model, None
        try:
            if model is not None:
                await model.close(self.unload_timeout_s)
        finally:
            slot.state = ModelState.UNLOADED
            slot.unloads += 1
            await self._notify()
        logger.info("unloaded model %s (%s)", slot.name, self._loaded_line())

    def _loaded_line(self) -> str:
        loaded = [s for s in self.slots.values() if s.state is ModelState.LOADED]
        used = sum(s.memory_bytes for s in loaded)
        budget = "" if self.memory_budget_bytes is None else f" of {self.memory_budget_bytes / GB:.2f} GB"
        return f"loaded now: {', '.join(s.name for s in loaded) or 'none'}; about {used / GB:.2f} GB{budget}"

    async def preload(self, slot: ModelSlot) -> None:
        """Load ``slot`` now (the default model, at start-up); its errors are the server's start-up errors."""
        await self.acquire(slot)
        await self._release(slot)

    async def close(self) -> None:
        """At shutdown: stop every loaded model (each waits ``unload_timeout_s`` for its requests)."""
        self._closing = True
        loaded = [s for s in self.slots.values() if s.model is not None]
        await asyncio.gather(*(self._close(s) for s in loaded), return_exceptions=True)

    async def _close(self, slot: ModelSlot) -> None:
        model, slot.model = slot.model, None
        if model is not None:
            await model.close(self.unload_timeout_s)
        slot.state = ModelState.UNLOADED

    def fail_all(self, exc: BaseException) -> None:
        for slot in self.slots.values():
            if slot.model is not None:
                slot.model.fail_all(exc)
