"""The uvicorn server both HTTP servers run on: the generative one (``run.py``) and the embedding one
(``embedding_app.py``), so they share the signal handling, the header deadline and the Config settings.

* SIGTERM / SIGINT stop the server gracefully and the process exits 0 (uvicorn would re-raise the
  signal, so the process would die "killed by signal").
* A request's headers get ``read_timeout_s`` (slowloris: ``header_timeout.py``): 408 and close.
* In-flight requests get ``shutdown_timeout_s`` to finish; with ``fail_all``, what is still running is
  then failed (a stream ends with an error event and [DONE]) within ``SHUTDOWN_GRACE_S`` more, before
  uvicorn would cancel it.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable, Iterator
from typing import Any

import uvicorn

from forwardpass.errors import EngineDeadError
from forwardpass.server.config import ServerConfig
from forwardpass.server.header_timeout import header_timeout_protocol

#: after ``shutdown_timeout_s``, how long failed streams get to write their error event and [DONE]
SHUTDOWN_GRACE_S = 3.0


class Server(uvicorn.Server):
    def __init__(
        self,
        config: uvicorn.Config,
        *,
        shutdown_timeout_s: float,
        on_started: Callable[[], None] | None = None,
        fail_all: Callable[[BaseException], None] | None = None,
    ) -> None:
        super().__init__(config)
        self.shutdown_timeout_s, self.on_started, self.fail_all = shutdown_timeout_s, on_started, fail_all

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        with super().capture_signals():
            yield
            # uvicorn re-raises the SIGTERM it handled, so the process would die "killed by signal";
            # a graceful stop is a clean exit here.
            self._captured_signals.clear()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started and self.on_started is not None:
            self.on_started()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        fail_all = self.fail_all
        if fail_all is None:
            return await super().shutdown(sockets)

        async def end_streams() -> None:
            await asyncio.sleep(self.shutdown_timeout_s)
            fail_all(
                EngineDeadError(
                    f"the server is shutting down: the request did not finish within the shutdown timeout "
                    f"({self.shutdown_timeout_s:g} s)"
                )
            )

        cut = asyncio.ensure_future(end_streams())
        try:
            await super().shutdown(sockets)
        finally:
            cut.cancel()


def build_server(
    app: Any,
    config: ServerConfig,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    log_level: str = "info",
    access_log: bool | None = None,
    on_started: Callable[[], None] | None = None,
    fail_all: Callable[[BaseException], None] | None = None,
) -> Server:
    """The server for ``app``; ``server.run(sockets=...)`` serves it. ``on_started()`` runs once the app
    has started and the server listens; ``fail_all(exc)`` ends every request still running after
    ``config.shutdown_timeout_s`` on shutdown (without it, uvicorn cancels them then); ``access_log``:
    one line per request (default: only at debug level)."""
    grace = SHUTDOWN_GRACE_S if fail_all is not None else 0.0
    return Server(
        uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level=log_level,
            timeout_keep_alive=5,
            http=header_timeout_protocol(config.read_timeout_s),  # headers too get --read-timeout (slowloris)
            # uvicorn annotates this ``int | None`` but only hands it to
            # asyncio.wait_for, which takes a float.
            timeout_graceful_shutdown=config.shutdown_timeout_s + grace,  # type: ignore[arg-type]
            access_log=log_level == "debug" if access_log is None else access_log,
        ),
        shutdown_timeout_s=config.shutdown_timeout_s,
        on_started=on_started,
        fail_all=fail_all,
    )
