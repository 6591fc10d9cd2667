"""The model pool's policy (server/model_pool.py) on stand-in models that load in a set time: routing
(404 listing the served names, 400 naming the kind a route needs), loads on demand, least-recently-used
unloading under ``max_loaded`` and the memory budget, unloading that waits for in-flight requests, requests
that wait for a load (bounded), a refusal over the budget that unloads nothing, and no starvation when
requests alternate."""

from __future__ import annotations

import asyncio
import logging

import pytest

from forwardpass.errors import ModelLoadError, ModelNotFoundError, RequestTimeoutError, ValidationError
from forwardpass.server.model_pool import ModelKind, ModelMemoryError, ModelPool, ModelSlot, ModelState


class FakeModel:
    def __init__(self, name: str, events: list[str]) -> None:
        self.name, self.events, self.in_flight = name, events, 0
        self.dead: str | None = None

    async def app(self, scope, receive, send) -> None:  # never called here
        raise AssertionError

    async def close(self, timeout_s: float) -> None:
        assert self.in_flight == 0, f"{self.name} unloaded with {self.in_flight} requests in flight"
        self.events.append(f"close {self.name}")

    def fail_all(self, exc: BaseException) -> None:
        pass

    def problem(self, watchdog_timeout_s: float) -> str | None:
        return self.dead

    def dead_reason(self) -> str | None:
        return self.dead

    def metrics(self):
        return None


def make_slot(name: str, events: list[str], *, kind=ModelKind.GENERATE, memory: int = 1, load_s: float = 0.01,
              fail: bool = False) -> ModelSlot:
    async def load() -> FakeModel:
        events.append(f"load {name}")
        await asyncio.sleep(load_s)
        if fail:
            raise RuntimeError("no weights")
        return FakeModel(name, events)

    return ModelSlot(name, kind, memory, load)


async def serve_one(pool: ModelPool, name: str, seconds: float = 0.0) -> str:
    """One request: a lease for ``seconds`` on the model, checking it stays loaded meanwhile."""
    slot = pool.slots[name]
    model = await pool.acquire(slot)
    assert isinstance(model, FakeModel)
    model.in_flight += 1
    try:
        await asyncio.sleep(seconds)
        assert slot.model is model
        return model.name
    finally:
        model.in_flight -= 1
        pool.release(slot)


def test_routing_names_the_served_models_and_the_needed_kind():
    events: list[str] = []
    pool = ModelPool([make_slot("lm", events), make_slot("whisper", events, kind=ModelKind.TRANSCRIBE),
                      make_slot("minilm", events, kind=ModelKind.EMBED)])
    gen, embed = (ModelKind.GENERATE,), (ModelKind.EMBED,)
    assert pool.route(None, gen, "/v1/chat/completions").name == "lm"  # the default
    assert pool.route(None, embed, "/v1/embeddings").name == "minilm"  # the first of the kind
    with pytest.raises(ModelNotFoundError, match="serves: lm, whisper, minilm") as nf:
        pool.route("gpt-4", gen, "/v1/chat/completions")
    assert nf.value.status_code == 404
    with pytest.raises(ValidationError, match="'whisper' is a transcribe model; /v1/embeddings needs a "
                       "model of kind embed") as wrong:
        pool.route("whisper", embed, "/v1/embeddings")
    assert wrong.value.status_code == 400 and wrong.value.param == "model"
    with pytest.raises(ValidationError, match="needs a model of kind image"):
        pool.route(None, (ModelKind.IMAGE,), "/v1/images/generations")


def test_lru_unloads_under_models_max_and_waits_for_in_flight(caplog):
    events: list[str] = []

    async def run() -> None:
        slots = [make_slot("a", events), make_slot("b", events), make_slot("c", events)]
        pool = ModelPool(slots, max_loaded=2)
        assert await serve_one(pool, "a") == "a"
        assert await serve_one(pool, "b") == "b"
        # a long request on b, then c: a is the least recently used and goes; b's request is untouched
        long_b = asyncio.create_task(serve_one(pool, "b", 0.3))
        await asyncio.sleep(0.05)
        assert await serve_one(pool, "a") == "a"  # a was used last... then c must unload b, after its request
        c = asyncio.create_task(serve_one(pool, "c"))
        await asyncio.sleep(0.1)
        assert pool.slots["b"].state is ModelState.DRAINING and not c.done()  # waits for b's request
        assert await long_b == "b" and await c == "c"
        assert [s.name for s in pool.slots.values() if s.state is ModelState.LOADED] == ["a", "c"]
        await pool.close()

    with caplog.at_level(logging.INFO, logger="forwardpass.serve"):
        asyncio.run(run())
    assert events[:2] == ["load a", "load b"]
    assert "close b" in events and events.index("close b") < events.index("load c")
    assert "unloading model b (least recently used; c needs room under --models-max 2)" in caplog.text


def test_requests_wait_for_a_load_bounded_by_the_timeout():
    events: list[str] = []

    async def run() -> None:
        pool = ModelPool([make_slot("a", events), make_slot("slow", events, load_s=0.5)], load_timeout_s=0.2)
        with pytest.raises(RequestTimeoutError, match="did not become ready within the request timeout"):
            await serve_one(pool, "slow")
        # the load goes on without the request that started it; the next request finds it loaded
        await asyncio.sleep(0.4)
        assert pool.slots["slow"].state is ModelState.LOADED and pool.slots["slow"].users == 0
        # several requests waiting for one load: one load serves them all
        waiting = [serve_one(pool, "a") for _ in range(5)]
        assert await asyncio.gather(*waiting) == ["a"] * 5
        assert events.count("load a") == 1

    asyncio.run(run())


def test_memory_budget_unloads_lru_and_refuses_what_cannot_fit():
    events: list[str] = []

    async def run() -> None:
        pool = ModelPool([make_slot("a", events, memory=40), make_slot("b", events, memory=50),
                          make_slot("c", events, memory=30), make_slot("huge", events, memory=150)],
                         memory_budget_bytes=100)
        await serve_one(pool, "a")
        await serve_one(pool, "b")  # 90 of 100: both loaded
        with pytest.raises(ModelMemoryError, match=r"'huge' needs about .* memory budget of 0\.00 GB") as e:
            await serve_one(pool, "huge")
        assert e.value.status_code == 503
        # nothing was unloaded for the refused model; the others keep serving
        assert {s.name for s in pool.slots.values() if s.state is ModelState.LOADED} == {"a", "b"}
        assert await serve_one(pool, "b") == "b" and "load huge" not in events
        await serve_one(pool, "c")  # 120 > 100: the least recently used (a) makes room
        assert {s.name for s in pool.slots.values() if s.state is ModelState.LOADED} == {"b", "c"}
        assert "close a" in events and "close b" not in events
    asyncio.run(run())


def test_a_failed_load_fails_its_requests_and_the_next_one_retries():
    events: list[str] = []

    async def run() -> None:
        bad = make_slot("bad", events, fail=True)
        pool = ModelPool([make_slot("a", events), bad])
        with pytest.raises(ModelLoadError, match="'bad' failed to load: no weights"):
            await serve_one(pool, "bad")
        assert bad.state is ModelState.UNLOADED and bad.users == 0
        with pytest.raises(ModelLoadError):
            await serve_one(pool, "bad")
        assert events.count("load bad") == 2
        assert await serve_one(pool, "a") == "a"

    asyncio.run(run())


def test_alternating_requests_under_models_max_1_all_served():
    """Concurrent requests alternating between two models with room for one: each is served (none starves,
    none is lost), and no model is unloaded under a request."""
    events: list[str] = []

    async def run() -> list[str]:
        pool = ModelPool([make_slot("a", events, load_s=0.02), make_slot("b", events, load_s=0.02)],
                         max_loaded=1, load_timeout_s=30)
        names = ["a" if i % 2 == 0 else "b" for i in range(30)]
        got = await asyncio.gather(*(serve_one(pool, n, 0.01) for n in names))
        assert all(s.users == 0 for s in pool.slots.values())
        return list(got)

    names = ["a" if i % 2 == 0 else "b" for i in range(30)]
    assert asyncio.run(run()) == names
    assert events.count("close a") + events.count("close b") >= 1


def test_a_model_whose_engine_died_is_loaded_again_at_its_next_request(caplog):
    events: list[str] = []

    async def run() -> None:
        pool = ModelPool([make_slot("a", events)])
        await serve_one(pool, "a")
        first = pool.slots["a"].model
        assert isinstance(first, FakeModel)
        first.dead = "the engine process exited (exit code -9)"
        assert await serve_one(pool, "a") == "a"
        assert pool.slots["a"].model is not first and pool.slots["a"].loads == 2

    with caplog.at_level(logging.INFO, logger="forwardpass.serve"):
        asyncio.run(run())
    assert events == ["load a", "close a", "load a"]
    assert "its engine is gone: the engine process exited (exit code -9)" in caplog.text
