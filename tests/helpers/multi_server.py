"""Start ``forwardpass serve MODEL MODEL ...`` (several models behind one server) for tests, and several
servers at once (their start-ups overlap, so a test that compares against single-model servers waits for the
slowest, not the sum)."""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tests.helpers.server import ServerProcess


def multi_server(models: list[str], *flags: str, startup_timeout: float = 180.0) -> ServerProcess:
    """A server of ``models`` (each served under the name ``forwardpass models`` prints, or its path's last
    part); enter it with ``with``."""
    srv = ServerProcess(Path(models[0]), startup_timeout=startup_timeout)
    srv.cmd = [sys.executable, "-m", "forwardpass.cli", "--log-level", "INFO", "serve", *models, "--port",
               str(srv.port), *flags]
    return srv


def start_all(servers: list[ServerProcess]) -> list[ServerProcess]:
    """Enter every server concurrently; if one fails to start, the others are stopped and its error raised."""
    with ThreadPoolExecutor(len(servers)) as pool:
        futures = [pool.submit(s.__enter__) for s in servers]
    errors = [f.exception() for f in futures]
    if any(errors):
        for s, err in zip(servers, errors, strict=True):
            if err is None:
                s.__exit__(None, None, None)
        raise next(e for e in errors if e is not None)
    return servers


def stop_all(servers: list[ServerProcess]) -> None:
    for s in servers:
        s.__exit__(None, None, None)
