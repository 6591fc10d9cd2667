"""Run the server with uvicorn.

Signals: uvicorn handles SIGTERM / SIGINT. It stops accepting connections at once and lets in-flight
requests (streams included) finish for up to ``shutdown_timeout_s``. Then every request still running
is failed: a stream gets an error event and ``data: [DONE]``, a plain request a 503, within a short
grace period before uvicorn would cancel what is left. The app's lifespan shutdown then stops the
engine (aborting anything still in it) and the process exits 0. The uvicorn server itself (signals,
header deadline, Config) is ``uvicorn_server.build_server``, shared with the embedding server.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable
from typing import cast

from forwardpass.engine.frontend.async_engine import AsyncLLMEngine, EngineSpec, RestartPolicy
from forwardpass.server.config import ServerConfig

logger = logging.getLogger(__name__)


def run_server(spec: EngineSpec, config: ServerConfig, *, host: str = "127.0.0.1", port: int = 8000,
               backend: str = "process", max_queued_requests: int = 1024, log_level: str = "info",
               sockets: list[socket.socket] | None = None,
               on_started: Callable[[AsyncLLMEngine], None] | None = None, access_log: bool | None = None,
               data_parallel_size: int = 1) -> None:
    """``sockets``: already-bound listening sockets to serve on (``serve`` binds before loading, so a busy
    port fails fast); ``on_started(engine)`` runs once the engine is up and the server listens (the
    banner); ``access_log`` one line per request (default: only at debug level).

    An engine that dies is restarted up to ``config.engine_restarts`` times (``supervisor.py``); once they
    are spent the server stops and this raises, so ``forwardpass serve`` exits 1 and a process supervisor
    (systemd, Kubernetes) restarts it: a server that answers nothing must not look alive."""
    from forwardpass.server.app import build_app
    from forwardpass.server.uvicorn_server import build_server

    lost: list[str] = []

    def engine_lost(reason: str) -> None:
        logger.error("the server stops: the engine is down and will not be restarted; exiting with status 1 "
                     "so that a process supervisor restarts the server")
        lost.append(reason)
        server.should_exit = True  # uvicorn's graceful stop: the dead engine's requests have already failed

    policy = RestartPolicy(max_restarts=config.engine_restarts)
    if data_parallel_size > 1:  # N replicas behind the same routes, requests to the least loaded
        from forwardpass.distributed.data_parallel import DataParallelEngine

        engine = cast("AsyncLLMEngine", DataParallelEngine(  # the same interface, duck-typed
            spec, replicas=data_parallel_size, backend=backend, max_queued_requests=max_queued_requests,
            request_timeout_s=config.request_timeout_s, restart_policy=policy, on_engine_lost=engine_lost))
    else:
        engine = AsyncLLMEngine(spec, backend=backend, max_queued_requests=max_queued_requests,
                                request_timeout_s=config.request_timeout_s, restart_policy=policy,
                                on_engine_lost=engine_lost)
    app = build_app(engine, config)
    server = build_server(
        app,
        config,
        host=host,
        port=port,
        log_level=log_level,
        access_log=access_log,
        on_started=None if on_started is None else lambda: on_started(engine),
        fail_all=engine.fail_all,
    )
    server.run(sockets=sockets)
    from forwardpass.errors import ForwardpassError

    if not server.started:
        raise ForwardpassError(engine.dead_reason or "the server failed to start (see the log above)")
    if lost:
        raise ForwardpassError(f"the engine died and was not restarted ({lost[0]}); "
                               f"--engine-restarts {config.engine_restarts}")
