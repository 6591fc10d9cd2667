"""OpenAI-compatible HTTP server: ``build_app(async_engine, ServerConfig)``; ``forwardpass serve`` runs it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from forwardpass.server.config import ServerConfig

if TYPE_CHECKING:
    from fastapi import FastAPI

    from forwardpass.engine.frontend.async_engine import AsyncLLMEngine

__all__ = ["ServerConfig", "build_app"]


def build_app(engine: AsyncLLMEngine, config: ServerConfig | None = None) -> FastAPI:
    from forwardpass.server.app import build_app as _build

    return _build(engine, config)
