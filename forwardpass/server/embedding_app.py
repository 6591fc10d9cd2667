"""The HTTP server of an embedding model (``forwardpass serve --task embed``).

An encoder has no generation engine, so this app is its own small FastAPI app: ``/v1/embeddings``,
``/v1/models``, ``/health``, ``/metrics``, ``/version``, with the same error envelope, body limit, API
key and CORS as the generative server, on the same uvicorn server (``uvicorn_server.py``: signals, the
header deadline). The generation routes answer a 400 that says what this server is, rather
than a bare 404.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

import forwardpass
from forwardpass.embed.async_runner import AsyncEmbedder
from forwardpass.errors import ValidationError
from forwardpass.server import errors
from forwardpass.server.config import ServerConfig
from forwardpass.server.embeddings import embeddings_router
from forwardpass.server.middleware import install_middleware

P = "forwardpass:"
_GENERATION_ROUTES = (
    "/v1/completions",
    "/completions",
    "/v1/chat/completions",
    "/chat/completions",
    "/invocations",
    "/tokenize",
    "/detokenize",
)


class EmbeddingMetrics:
    def __init__(self, embedder: AsyncEmbedder, model_name: str):
        r = self.registry = CollectorRegistry()
        lbl = {"model_name": model_name}
        self.requests = Counter(
            P + "embedding_requests", "embedding requests answered", list(lbl), registry=r
        ).labels(**lbl)
        self.prompt_tokens = Counter(
            P + "prompt_tokens", "tokens embedded (the usage clients received)", list(lbl), registry=r
        ).labels(**lbl)
        self.latency = Histogram(
            P + "e2e_request_latency_seconds",
            "request latency",
            list(lbl),
            registry=r,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
        ).labels(**lbl)
        waiting = Gauge(
            P + "num_inputs_waiting", "inputs queued for the encoder", list(lbl), registry=r
        ).labels(**lbl)
        waiting.set_function(lambda: embedder.queued_inputs)
        passes = Gauge(
            P + "embedding_forward_passes", "encoder forward passes so far", list(lbl), registry=r
        ).labels(**lbl)
        passes.set_function(lambda: embedder.runner.forward_passes)

    def done(self, prompt_tokens: int, seconds: float) -> None:
        self.requests.inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.latency.observe(seconds)


def build_embedding_app(embedder: AsyncEmbedder, config: ServerConfig) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await embedder.start()
        yield
        await embedder.shutdown()

    app = FastAPI(
        title="forwardpass",
        version=forwardpass.__version__,
        lifespan=lifespan,
        description="OpenAI-compatible embedding server",
    )
    errors.install(app, config.retry_after_s)
    names = list(config.models)
    metrics = EmbeddingMetrics(embedder, config.default_model)
    app.state.embedder, app.state.metrics = embedder, metrics
    app.include_router(embeddings_router(embedder, names, metrics.done))
    created = int(time.time())
    runner = embedder.runner

    @app.get("/v1/models", response_model=None)
    @app.get("/models", response_model=None, include_in_schema=False)
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": created,
                    "owned_by": "forwardpass",
                    "root": name,
                    "parent": None,
                    "max_model_len": runner.limits.max_model_len,
                    "task": "embed",
                    "dimensions": runner.dimensions,
                }
                for name in names
            ],
        }

    @app.get("/health")
    async def health() -> JSONResponse:
        if embedder.dead_reason is not None:
            return errors.error_response(
                503, f"the embedding worker is not running: {embedder.dead_reason}", "engine_dead"
            )
        busy = embedder.busy_since
        if busy is not None and time.monotonic() - busy > config.watchdog_timeout_s:
            return errors.error_response(
                503, f"one encoder pass has run for over {config.watchdog_timeout_s:g} s", "engine_stalled"
            )
        return JSONResponse({"status": "ok"})

    @app.get("/metrics", response_class=Response)
    async def get_metrics() -> Response:
        return Response(
            generate_latest(metrics.registry), media_type="text/plain; version=0.0.4; charset=utf-8"
        )

    @app.get("/version", response_model=None)
    async def version() -> dict[str, str]:
        return {"version": forwardpass.__version__}

    async def not_generative() -> None:
        raise ValidationError(
            "this server runs an embedding model (task embed); it does not generate text. Use "
            "POST /v1/embeddings, or serve a generative model for completions",
            param="model",
            code="model_not_generative",
        )

    for path in _GENERATION_ROUTES:
        app.add_api_route(path, not_generative, methods=["POST"], include_in_schema=False)

    from forwardpass.server.invocations import add_invocations_route

    add_invocations_route(app)  # SageMaker's route: input -> embeddings (others get the 400 above)
    install_middleware(app, config)  # CORS, the API key, the body limit: as the generative server
    return app


def run_embedding_server(
    runner_factory: Any,
    config: ServerConfig,
    *,
    host: str,
    sockets: list,
    log_level: str,
    access_log: bool,
    on_started: Any = None,
) -> None:
    """Load the model (``runner_factory()``), then serve on the already-bound ``sockets`` until SIGTERM."""
    from forwardpass.server.uvicorn_server import build_server

    embedder = AsyncEmbedder(runner_factory())
    app = build_embedding_app(embedder, config)
    server = build_server(
        app,
        config,
        host=host,
        log_level=log_level,
        access_log=access_log,
        on_started=None if on_started is None else lambda: on_started(embedder),
        fail_all=embedder.fail_all,  # past the shutdown timeout, requests get a 503 rather than a reset
    )
    server.run(sockets=sockets)
