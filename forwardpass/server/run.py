"""Run the server with uvicorn.

Signals: uvicorn handles SIGTERM / SIGINT. It stops accepting connections at once and lets in-flight
requests (streams included) finish for up to ``shutdown_timeout_s``. Then every request still running
is failed: a stream gets an error event and ``data: [DONE]``, a plain request a 503, within a short
grace period before uvicorn would cancel what is left. The app's lifespan shutdown then stops the
engine (aborting anything still in it) and the process exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Callable, Iterator
from typing import cast

from forwardpass.engine.async_engine import AsyncLLMEngine, EngineSpec
from forwardpass.errors import EngineDeadError
from forwardpass.server.config import ServerConfig

#: after ``shutdown_timeout_s``, how long failed streams get to write their error event and [DONE]
SHUTDOWN_GRACE_S = 3.0

logger = logging.getLogger(__name__)


def run_server(spec: EngineSpec, config: ServerConfig, *, host: str = "127.0.0.1", port: int = 8000,
               backend: str = "process", max_queued_requests: int = 1024, log_level: str = "info",
               sockets: list[socket.socket] | None = None,
               on_started: Callable[[AsyncLLMEngine], None] | None = None, access_log: bool | None = None,
               data_parallel_size: int = 1) -> None:
    """``sockets``: already-bound listening sockets to serve on (``serve`` binds before loading, so a busy
    port fails fast); ``on_started(engine)`` runs once the engine is up and the server listens (the
    banner); ``access_log`` one line per request (default: only at debug level)."""
    import uvicorn

    from forwardpass.server.app import build_app
    from forwardpass.server.header_timeout import header_timeout_protocol

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            with super().capture_signals():
                yield
                # uvicorn re-raises the SIGTERM it handled, so the process would die "killed by signal";
                # a graceful stop is a clean exit here.
                self._captured_signals.clear()

        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets)
            if self.started and on_started is not None:
                on_started(engine)

        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            async def end_streams() -> None:
                await asyncio.sleep(config.shutdown_timeout_s)
                engine.fail_all(EngineDeadError(
                    f"the server is shutting down: the request did not finish within the shutdown timeout "
                    f"({config.shutdown_timeout_s:g} s)"))

            cut = asyncio.ensure_future(end_streams())
            try:
                await super().shutdown(sockets)
            finally:
                cut.cancel()

    if data_parallel_size > 1:  # N replicas behind the same routes, requests to the least loaded
        from forwardpass.distributed.data_parallel import DataParallelEngine

        engine = cast("AsyncLLMEngine", DataParallelEngine(  # the same interface, duck-typed
            spec, replicas=data_parallel_size, backend=backend, max_queued_requests=max_queued_requests,
            request_timeout_s=config.request_timeout_s))
    else:
        engine = AsyncLLMEngine(spec, backend=backend, max_queued_requests=max_queued_requests,
                                request_timeout_s=config.request_timeout_s)
    app = build_app(engine, config)
    server = Server(uvicorn.Config(
        app, host=host, port=port, log_level=log_level, timeout_keep_alive=5,
        http=header_timeout_protocol(config.read_timeout_s),  # headers too get --read-timeout (slowloris)
        # uvicorn annotates this ``int | None`` but only hands it to asyncio.wait_for, which takes a float.
        timeout_graceful_shutdown=config.shutdown_timeout_s + SHUTDOWN_GRACE_S,  # type: ignore[arg-type]
        access_log=log_level == "debug" if access_log is None else access_log))
    server.run(sockets=sockets)
    if not server.started:
        from forwardpass.errors import ForwardpassError

        raise ForwardpassError(engine.dead_reason or "the server failed to start (see the log above)")
