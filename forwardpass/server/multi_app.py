"""The app of a server with several models (``forwardpass serve A B C``): one address, a model pool behind it.

The server's own routes are ``/v1/models`` (every served model: kind, loaded or not, memory), ``/health``,
``/metrics`` (every loaded model's series, with a ``model`` label, and the pool's) and ``/version``. Every
other request is routed by its ``model`` (the JSON body's field, the form's field of an upload, or ``?model=``
on a GET such as ``/dashboard?model=NAME``) to that model's own single-model app (``model_loaders.py``), which
answers it as a one-model server would; it holds a lease on the model until its response (a stream included)
ends. The middleware (CORS, API key, body limit, root path) runs once, here, before routing.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import parse_qs

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.samples import Sample
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import forwardpass
from forwardpass.errors import ForwardpassError
from forwardpass.server import errors
from forwardpass.server.config import ServerConfig
from forwardpass.server.middleware import install_middleware, replay_body
from forwardpass.server.model_pool import GB, ModelKind, ModelPool, ModelSlot, ModelState

logger = logging.getLogger("forwardpass.serve")

G, T, E = (ModelKind.GENERATE,), (ModelKind.TRANSCRIBE,), (ModelKind.EMBED,)
#: route -> the kinds of model that answer it (exact paths; prefixes below)
ROUTE_KINDS: dict[str, tuple[ModelKind, ...]] = {
    "/v1/chat/completions": G, "/chat/completions": G, "/v1/completions": G, "/completions": G,
    "/v1/responses": G, "/tokenize": G, "/detokenize": G,
    "/v1/audio/transcriptions": T, "/v1/embeddings": E, "/embeddings": E,
    "/v1/images/generations": (ModelKind.IMAGE,), "/v1/videos": (ModelKind.VIDEO,),
    # the pages and the engine's GETs: an engine's model (?model=NAME picks it; else the default or the first)
    "/dashboard": G + T, "/props": G + T, "/tokenizer_info": G + T, "/debug/engine": G + T,
}
PREFIX_KINDS = (("/v1/responses/", G), ("/v1/videos/", (ModelKind.VIDEO,)), ("/dashboard/", G + T))
#: /invocations: the body's first key of these picks the kind (as server/invocations.py picks the route)
INVOCATION_KINDS = (("messages", G), ("prompt", G), ("input", E))
#: answered by this app itself, never routed to a model (the chat page is static: it loads no model, so an
#: unauthenticated GET / cannot make the server load one)
OWN_PATHS = frozenset({"/v1/models", "/models", "/health", "/metrics", "/version", "/docs", "/openapi.json",
                       "/"})
OWN_PREFIXES = ("/chat/static/",)


def route_kinds(path: str, body: dict[str, Any] | None) -> tuple[ModelKind, ...] | None:
    """The kinds of model ``path`` needs; None: any kind."""
    if path == "/invocations" and body is not None:
        return next((kinds for key, kinds in INVOCATION_KINDS if key in body), G)
    if path in ROUTE_KINDS:
        return ROUTE_KINDS[path]
    return next((kinds for prefix, kinds in PREFIX_KINDS if path.startswith(prefix)), None)


async def _read_body(receive: Receive) -> tuple[bytes, Message | None]:
    """The whole body (the body-limit middleware outside has bounded it), or the client's disconnect."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return b"", message
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks), None


async def _requested_model(scope: Scope, body: bytes, receive: Receive) -> tuple[str | None, dict | None]:
    """(the ``model`` the request names or None, its JSON body when it has one)."""
    query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
    if "model" in query:
        return query["model"][0] or None, None
    content_type = next((v for k, v in scope.get("headers", ()) if k == b"content-type"), b"")
    if content_type.split(b";")[0].strip().lower() == b"multipart/form-data":
        with contextlib.suppress(Exception):  # a malformed form: the model's route answers its 400
            async with Request(scope, replay_body(body, receive)).form() as form:
                value = form.get("model")
                return (value if isinstance(value, str) and value else None), None
        return None, None
    try:
        parsed = json.loads(body) if body else None
    except ValueError:
        return None, None  # not JSON: the model's route answers the 400 a one-model server gives
    if not isinstance(parsed, dict):
        return None, None
    model = parsed.get("model")
    return (model if isinstance(model, str) and model else None), parsed


class ModelRouter:
    """ASGI middleware: a request for a model's route goes to that model's app, under a lease."""

    def __init__(self, app: ASGIApp, pool: ModelPool, retry_after_s: int = 1) -> None:
        self.app, self.pool, self.retry_after_s = app, pool, retry_after_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")  # a lifespan scope has none
        if scope["type"] != "http" or path in OWN_PATHS or path.startswith(OWN_PREFIXES):
            return await self.app(scope, receive, send)
        body, disconnect = b"", None
        if scope["method"] not in ("GET", "HEAD", "OPTIONS"):
            body, disconnect = await _read_body(receive)
            if disconnect is not None:
                return
        name, parsed = await _requested_model(scope, body, receive)
        kinds = route_kinds(scope["path"], parsed) or tuple(ModelKind)
        try:
            slot = self.pool.route(name, kinds, scope["path"])
            model = await self.pool.acquire(slot)
        except ForwardpassError as exc:
            return await errors.from_exception(exc, self.retry_after_s)(scope, receive, send)
        try:
            await model.app(scope, replay_body(body, receive), send)
        finally:
            self.pool.release(slot)


def _model_entry(slot: ModelSlot, created: int) -> dict[str, Any]:
    engine = getattr(slot.model, "engine", None)  # a loaded language / speech model's engine
    return {"id": slot.name, "object": "model", "created": created, "owned_by": "forwardpass",
            "root": slot.name, "parent": None, "kind": slot.kind.value,
            "loaded": slot.state is ModelState.LOADED, "state": slot.state.value,
            "memory_bytes": slot.memory_bytes, "loads": slot.loads, "unloads": slot.unloads,
            "load_seconds": slot.load_seconds,
            "max_model_len": engine.max_model_len if engine is not None else None}  # vLLM's field


def merged_metrics(pool: ModelPool) -> bytes:
    """Every loaded model's series with a ``model`` label added, and the pool's own, in one exposition."""
    families: dict[str, Metric] = {}

    def add(name: str, doc: str, typ: str, model: str, value: float) -> None:
        fam = families.setdefault(name, Metric(name, doc, typ))
        fam.samples.append(Sample(name + ("_total" if typ == "counter" else ""), {"model": model}, value))

    for slot in pool.slots.values():
        add("forwardpass:model_loaded", "1 while the model is loaded", "gauge", slot.name,
            float(slot.state is ModelState.LOADED))
        add("forwardpass:model_memory_bytes", "the model's memory estimate (weights + KV cache)", "gauge",
            slot.name, float(slot.memory_bytes))
        add("forwardpass:model_loads", "times the model was loaded", "counter", slot.name, float(slot.loads))
        add("forwardpass:model_unloads", "times the model was unloaded", "counter", slot.name,
            float(slot.unloads))
        registry = slot.model.metrics() if slot.model is not None else None
        for fam in registry.collect() if registry is not None else ():
            merged = families.setdefault(fam.name, Metric(fam.name, fam.documentation, fam.type, fam.unit))
            merged.samples.extend(s._replace(labels={**s.labels, "model": slot.name}) for s in fam.samples)

    class Collected:
        def collect(self) -> list[Metric]:
            return list(families.values())

    out = CollectorRegistry(auto_describe=False)
    out.register(Collected())
    return generate_latest(out)


def build_multi_app(pool: ModelPool, config: ServerConfig) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await pool.preload(pool.default)  # the default model is ready when the server says it listens
        yield
        await pool.close()

    app = FastAPI(title="forwardpass", version=forwardpass.__version__, lifespan=lifespan,
                  description="OpenAI-compatible inference server (several models)")
    app.state.pool = pool
    errors.install(app, config.retry_after_s)
    created = int(time.time())

    @app.get("/v1/models", response_model=None)
    @app.get("/models", response_model=None, include_in_schema=False)
    async def models() -> dict[str, Any]:
        budget = pool.memory_budget_bytes
        return {"object": "list", "data": [_model_entry(s, created) for s in pool.slots.values()],
                "forwardpass": {"models_max": pool.max_loaded,
                                "models_memory_gb": None if budget is None else budget / GB}}

    @app.get("/health")
    async def health() -> JSONResponse:
        for slot in pool.slots.values():
            problem = slot.model.problem(config.watchdog_timeout_s) if slot.model is not None else None
            if problem is not None:
                return errors.error_response(503, f"the model {slot.name!r} cannot serve: {problem}",
                                             "engine_dead")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics", response_class=Response)
    async def get_metrics() -> Response:
        return Response(merged_metrics(pool), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/version", response_model=None)
    async def version() -> dict[str, str]:
        return {"version": forwardpass.__version__}

    from forwardpass.server.chat_page import chat_page_router

    app.include_router(chat_page_router())  # / : the web chat page (its selector lists the chat models)
    app.add_middleware(ModelRouter, pool=pool, retry_after_s=config.retry_after_s)  # innermost
    install_middleware(app, config)  # CORS, the API key, the body limit: before any routing
    return app


def run_multi_server(pool: ModelPool, config: ServerConfig, *, host: str, sockets: list, log_level: str,
                     access_log: bool, on_started: Any = None) -> None:
    """Serve ``pool`` on the already-bound ``sockets`` until SIGTERM (``run.py``'s server, several models)."""
    from forwardpass.server.uvicorn_server import build_server

    server = build_server(build_multi_app(pool, config), config, host=host, log_level=log_level,
                          access_log=access_log, on_started=on_started, fail_all=pool.fail_all)
    server.run(sockets=sockets)
    if not server.started:
        raise ForwardpassError("the server failed to start (see the log above)")
