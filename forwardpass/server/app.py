"""``build_app(async_engine, ServerConfig)``: the FastAPI app. Its lifespan starts and stops the engine."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

import forwardpass
from forwardpass.engine.frontend.async_engine import AsyncLLMEngine
from forwardpass.errors import EngineDeadError, ValidationError
from forwardpass.server import errors
from forwardpass.server.chat_page import chat_page_router
from forwardpass.server.config import ServerConfig
from forwardpass.server.dashboard import dashboard_router
from forwardpass.server.invocations import add_invocations_route
from forwardpass.server.metrics import ServerMetrics
from forwardpass.server.middleware import install_middleware
from forwardpass.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from forwardpass.server.response_models import ChatCompletionResponse, CompletionResponse, ErrorResponse
from forwardpass.server.serving import ClientDisconnected, Serving

_T = TypeVar("_T")
_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 503)}
_SSE = {"text/event-stream": {"schema": {"type": "string"}}}


def build_app(engine: AsyncLLMEngine, config: ServerConfig | None = None) -> FastAPI:
    config = config or ServerConfig()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if engine.info is None:
            await engine.start()
        yield
        await engine.shutdown(timeout=config.shutdown_timeout_s)

    app = FastAPI(title="forwardpass", version=forwardpass.__version__, lifespan=lifespan,
                  description="OpenAI-compatible inference server")
    serving = Serving(engine, config)
    metrics = ServerMetrics(engine, config.default_model)
    app.state.engine, app.state.metrics, app.state.serving = engine, metrics, serving
    errors.install(app, config.retry_after_s)

    async def run(coro: Awaitable[_T]) -> _T | Response:
        try:
            return await coro
        except ClientDisconnected:
            return Response(status_code=499)

    # llama.cpp's server answers the OpenAI routes without the /v1 prefix too; so do we (out of the schema).
    @app.post("/v1/completions", response_model=CompletionResponse,
              responses={**_ERRORS, 200: {"content": _SSE}})
    @app.post("/completions", response_model=CompletionResponse, include_in_schema=False)
    async def completions(req: CompletionRequest, request: Request) -> Response | dict[str, Any]:
        return await run(serving.completions(req, request))

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse,
              responses={**_ERRORS, 200: {"content": _SSE}})
    @app.post("/chat/completions", response_model=ChatCompletionResponse, include_in_schema=False)
    async def chat_completions(req: ChatCompletionRequest, request: Request) -> Response | dict[str, Any]:
        return await run(serving.chat(req, request))

    created = int(time.time())

    # Routes that return plain dicts say ``response_model=None``: their return annotation is for the type
    # checker only, not a response model for FastAPI to validate against and publish.
    add_invocations_route(app, _ERRORS)  # /invocations: chat, completions or embeddings by the body's shape

    @app.get("/props", response_model=None)
    async def props() -> dict[str, Any]:
        """llama.cpp's server properties (what its web UI and clients read)."""
        tok = engine.tokenizer
        return {"default_generation_settings": {"n_ctx": engine.max_model_len, "model": config.default_model},
                "total_slots": engine.info.max_num_seqs if engine.info is not None else 0,
                "model_alias": config.default_model,
                "model_path": config.default_model,  # never a filesystem path
                "chat_template": (tok.chat_template or "") if tok is not None else "",
                "build_info": f"forwardpass {forwardpass.__version__}", "modalities": {"vision": False}}

    from forwardpass.registry import served_diffusion_models  # the image / video models served too

    @app.get("/v1/models", response_model=None)
    @app.get("/models", response_model=None, include_in_schema=False)
    async def models() -> dict[str, Any]:
        # vLLM-style extra fields, which OpenAI clients ignore; "forwardpass" carries how the engine computes
        # (``layers/weight_report.py::described_plan``: weight methods, kernels, ISA, FORWARDPASS_* variables
        # in force)
        plan = engine.info.execution_plan if engine.info is not None else {}
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": created, "owned_by": "forwardpass",
             "root": name,  # the served name: filesystem paths are not the clients' business
             "parent": None if lora is None else config.default_model, "max_model_len": engine.max_model_len,
             "forwardpass": {"execution_plan": plan}}
            for name, lora in config.models.items()] + served_diffusion_models(config, created)}

    @app.get("/health", responses={503: {"model": ErrorResponse}})
    async def health() -> JSONResponse:
        if engine.is_dead:
            try:
                engine.check_alive()  # the error a request would get now (restarting: with Retry-After)
            except EngineDeadError as exc:
                return errors.from_exception(exc, config.retry_after_s)
        stalled = engine.stalled_for()
        if stalled > config.watchdog_timeout_s:  # has work, made no progress: stuck or stopped
            return errors.error_response(
                503, f"the engine has made no progress for {stalled:.0f} s while it has work "
                f"(watchdog timeout {config.watchdog_timeout_s:g} s)", "engine_stalled")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics", response_class=Response)
    async def get_metrics() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/version", response_model=None)
    async def version() -> dict[str, str]:
        return {"version": forwardpass.__version__}

    if config.enable_tokenizer_info:
        @app.get("/tokenizer_info", response_model=None)
        async def tokenizer_info() -> dict[str, Any]:
            from forwardpass.server.tokenizer_info import tokenizer_info as info

            template = engine.tokenizer.chat_template if engine.tokenizer is not None else None
            return await serving.off_loop(info, engine.model_dir, template, engine.max_model_len)

    @app.post("/tokenize", responses=_ERRORS, response_model=None)
    async def tokenize(req: TokenizeRequest) -> dict[str, Any] | Response:
        serving.resolve_model(req.model)
        if req.messages is not None:  # the prompt the chat route would build (tools, template variables)
            ids = await serving.chat_prompt(req.messages, req.add_generation_prompt, req.template_kwargs(),
                                            req.continue_final_message, req.add_special_tokens is True)
        else:
            if not req.prompt:
                return {"tokens": [], "count": 0, "max_model_len": engine.max_model_len, "token_strs": None}
            ids = await serving.encode_async(req.prompt, req.add_special_tokens is not False,
                                             for_generation=False)
        # token_strs is always there, null unless asked for (vLLM's shape)
        body: dict[str, Any] = {"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len,
                                "token_strs": None}
        if req.return_token_strs and engine.tokenizer is not None:
            tok = engine.tokenizer
            body["token_strs"] = [tok.id_to_token(t) for t in ids]
        # a million ids: encoded in a worker too, not by FastAPI's per-item encoder on the event loop
        return Response(await serving.off_loop(json.dumps, body), media_type="application/json")

    @app.post("/detokenize", responses=_ERRORS, response_model=None)
    async def detokenize(req: DetokenizeRequest) -> dict[str, str]:
        serving.resolve_model(req.model)
        tok = engine.tokenizer
        if tok is None:
            raise ValidationError("this model has no tokenizer", param="tokens")
        if any(t >= tok.vocab_size for t in req.tokens):
            raise ValidationError(f"token ids must be in [0, {tok.vocab_size})", param="tokens")
        return {"prompt": await serving.off_loop(tok.decode, req.tokens, False)}

    if config.enable_debug_endpoints:
        @app.get("/debug/engine", response_model=None)
        async def debug_engine() -> dict[str, Any]:
            """KV blocks, queue lengths and a ``check_invariants()`` run (enabled by a flag, for tests)."""
            if engine.is_dead:
                raise EngineDeadError(f"the engine is not running: {engine.dead_reason}")
            info = await engine.debug_info()
            return {**info, "num_unfinished_front_end": engine.num_unfinished}

    app.include_router(dashboard_router(engine))  # /dashboard, /dashboard/state, /dashboard/events
    app.include_router(chat_page_router())  # / : the web chat page (talks to /v1/chat/completions)
    from forwardpass.server.embeddings import generative_embeddings_router

    app.include_router(generative_embeddings_router())  # /v1/embeddings: a 400 naming --task embed
    from forwardpass.server.diffusion_service import diffusion_routers

    for router in diffusion_routers(config.image_model, config.video_model):  # images, videos
        app.include_router(router)
    from forwardpass.server.transcriptions import transcriptions_router

    app.include_router(transcriptions_router(engine, serving))  # /v1/audio/transcriptions (Whisper models)
    from forwardpass.server.responses import ResponsesService, responses_router

    app.state.responses = ResponsesService(serving, config.responses_max_stored)
    app.include_router(responses_router(app.state.responses))  # /v1/responses: on top of the chat path

    install_middleware(app, config)  # CORS, the key check, the body limit (as the embedding server)
    return app
