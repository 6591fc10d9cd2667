"""Pure-ASGI middleware: API-key check (401) and request-body limit (413), both before any parsing."""

from __future__ import annotations

import hmac
from collections.abc import Iterable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from forwardpass.server.errors import error_bytes

OPEN_PATHS = frozenset({"/health", "/metrics"})


async def _send_error(send: Send, status: int, message: str, code: str | None = None,
                      headers: Iterable[tuple[bytes, bytes]] = ()) -> None:
    body = error_bytes(status, message, code)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})


class APIKeyMiddleware:
    """``Authorization: Bearer KEY`` on every path but /health and /metrics; constant-time compare."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        given = b""
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                given = value
                break
        if not hmac.compare_digest(given, self.expected):
            msg = "missing API key: send 'Authorization: Bearer <key>'" if not given else "incorrect API key"
            return await _send_error(send, 401, msg, "invalid_api_key", [(b"www-authenticate", b"Bearer")])
        return await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """Reads the body up front (at most ``limit`` bytes, else 413) and replays it to the app."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        too_big = f"the request body is larger than this server's limit of {self.limit} bytes"
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and value.isdigit() and int(value) > self.limit:
                return await _send_error(send, 413, too_big)
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                return await _send_error(send, 413, too_big)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # after the body: waits for http.disconnect

        return await self.app(scope, replay, send)
