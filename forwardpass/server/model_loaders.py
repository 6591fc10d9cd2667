"""How each kind of served model is loaded for the model pool (``model_pool.py``), and what it is once loaded.

Each loaded model is served by the very app a single-model server runs (``build_app`` on its own
``AsyncLLMEngine``, ``build_embedding_app`` on its own encoder, the diffusion routers), so a request routed to
it is answered exactly as that server answers it. Loading never blocks the event loop nor the other models:
an engine loads in its own process (``AsyncLLMEngine.start`` awaits it), an encoder's weights load in a worker
thread, a diffusion pipeline loads at its first request on its own lane thread (``diffusion_service.py``).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, replace
from typing import Any

from fastapi import FastAPI
from prometheus_client import CollectorRegistry
from starlette.types import ASGIApp

from forwardpass.engine.frontend.async_engine import AsyncLLMEngine, EngineSpec
from forwardpass.server.config import ServerConfig
from forwardpass.server.model_pool import LoadedModel


def model_server_config(config: ServerConfig, name: str) -> ServerConfig:
    """The settings of one model's own app behind the pool: it serves ``name`` only; the API key, CORS and
    the root path are the pool's app's job (checked once, outside), the diffusion routes are pool models."""
    return replace(config, models={name: None}, api_key=None, allowed_origins=[], root_path="",
                   image_model=None, video_model=None)


@dataclass
class EngineSettings:
    """How ``serve`` runs a generation engine (the same for every model of the pool)."""

    backend: str = "process"
    max_queued_requests: int = 1024


class EngineModel:
    """A language model or a Whisper model: its engine (its own process) behind ``build_app``."""

    def __init__(self, engine: AsyncLLMEngine, app: FastAPI) -> None:
        self.engine, self.app = engine, app

    async def close(self, timeout_s: float) -> None:
        # its app's text worker threads end when the app is dropped (an executor's workers exit once it is
        # garbage collected)
        await self.engine.shutdown(timeout=timeout_s)

    def fail_all(self, exc: BaseException) -> None:
        self.engine.fail_all(exc)

    def problem(self, watchdog_timeout_s: float) -> str | None:
        if self.engine.is_dead:
            return f"its engine is not running: {self.engine.dead_reason}"
        stalled = self.engine.stalled_for()
        if stalled > watchdog_timeout_s:
            return f"its engine has made no progress for {stalled:.0f} s while it has work"
        return None

    def dead_reason(self) -> str | None:
        return self.engine.dead_reason if self.engine.is_dead else None

    def metrics(self) -> CollectorRegistry | None:
        self.app.state.metrics.render()  # refreshes the gauges read off the engine's last snapshot
        return self.app.state.metrics.registry


async def load_engine_model(spec: EngineSpec, config: ServerConfig, settings: EngineSettings) -> LoadedModel:
    from forwardpass.server.app import build_app

    engine = AsyncLLMEngine(spec, backend=settings.backend, max_queued_requests=settings.max_queued_requests,
                            request_timeout_s=config.request_timeout_s)
    try:
        await engine.start()  # the engine process loads the model; the event loop only awaits it
    except BaseException:
        await engine.shutdown(timeout=1.0)  # reap the process if it is still there
        raise
    return EngineModel(engine, build_app(engine, config))


class EncoderModel:
    """An embedding model: an encoder in this process (its forward passes on one worker thread)."""

    def __init__(self, embedder: Any, app: FastAPI) -> None:
        self.embedder, self.app = embedder, app

    async def close(self, timeout_s: float) -> None:
        await self.embedder.shutdown()

    def fail_all(self, exc: BaseException) -> None:
        self.embedder.fail_all(exc)

    def problem(self, watchdog_timeout_s: float) -> str | None:
        if self.embedder.dead_reason is not None:
            return f"its embedding worker is not running: {self.embedder.dead_reason}"
        busy = self.embedder.busy_since
        if busy is not None and time.monotonic() - busy > watchdog_timeout_s:
            return f"one encoder pass has run for over {watchdog_timeout_s:g} s"
        return None

    def dead_reason(self) -> str | None:
        return self.embedder.dead_reason

    def metrics(self) -> CollectorRegistry | None:
        return self.app.state.metrics.registry


async def load_encoder_model(model_dir: str, config: ServerConfig, *, dtype: str, device: str,
                             max_model_len: int | None, max_num_batched_tokens: int | None) -> LoadedModel:
    from forwardpass.embed.async_runner import AsyncEmbedder
    from forwardpass.embed.runner import EmbeddingRunner
    from forwardpass.server.embedding_app import build_embedding_app

    # the weights load in a worker thread: the event loop keeps serving the other models meanwhile
    runner = await asyncio.to_thread(EmbeddingRunner, model_dir, dtype=dtype, device=device,
                                     max_model_len=max_model_len,
                                     max_num_batched_tokens=max_num_batched_tokens)
    embedder = AsyncEmbedder(runner)
    await embedder.start()
    return EncoderModel(embedder, build_embedding_app(embedder, config))


class DiffusionModel:
    """An image or a video pipeline behind its routes; the pipeline itself loads at its first request, on
    its lane's thread (``diffusion_service.py``)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def close(self, timeout_s: float) -> None:
        return None  # the app and its lazily loaded pipeline are dropped with this object

    def fail_all(self, exc: BaseException) -> None:
        return None  # a job in progress finishes on its thread; nothing to end early

    def problem(self, watchdog_timeout_s: float) -> str | None:
        return None

    def dead_reason(self) -> str | None:
        return None

    def metrics(self) -> CollectorRegistry | None:
        return None


async def load_diffusion_model(folder: str, kind: str, config: ServerConfig) -> LoadedModel:
    from forwardpass.server import errors
    from forwardpass.server.diffusion_service import diffusion_routers

    app = FastAPI()
    errors.install(app, config.retry_after_s)
    routers = diffusion_routers(folder if kind == "image" else None, folder if kind == "video" else None)
    for router in routers:
        app.include_router(router)
    return DiffusionModel(app)
