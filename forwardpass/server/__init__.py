"""OpenAI-compatible HTTP server: ``build_app(async_engine, ServerConfig)``; ``forwardpass serve`` runs it."""

from forwardpass.server.config import ServerConfig

__all__ = ["ServerConfig", "build_app"]


def build_app(engine, config: ServerConfig | None = None):
    from forwardpass.server.app import build_app as _build

    return _build(engine, config)
