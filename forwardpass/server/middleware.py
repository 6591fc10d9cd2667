"""Pure-ASGI middleware: API-key check (401), request-body limit (413), body read timeout (408) and
UTF-8 bodies only (400), all before any parsing; ``install_middleware`` adds them (and CORS) to an app."""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Iterable

from starlette.applications import Starlette
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from forwardpass.server.config import ServerConfig
from forwardpass.server.errors import error_bytes

# "/": the chat page's HTML (no data; it asks for the key)
OPEN_PATHS = frozenset({"/health", "/metrics", "/"})
OPEN_PREFIXES = ("/chat/static/",)  # the chat page's CSS and JS


async def _send_error(send: Send, status: int, message: str, code: str | None = None,
                      headers: Iterable[tuple[bytes, bytes]] = ()) -> None:
    body = error_bytes(status, message, code)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()), *headers]})
    await send({"type": "http.response.body", "body": body})


class APIKeyMiddleware:
    """``Authorization: Bearer KEY`` on every path but /health, /metrics and the chat page's static
    files (the scheme is case-insensitive, as RFC 9110 says); constant-time compare of the key."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or path in OPEN_PATHS or path.startswith(OPEN_PREFIXES):
            return await self.app(scope, receive, send)
        given = b""
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                given = value
                break
        scheme, _, key = given.strip().partition(b" ")
        if scheme.lower() != b"bearer" or not hmac.compare_digest(key.strip(), self.expected):
            msg = "missing API key: send 'Authorization: Bearer <key>'" if not given else "incorrect API key"
            return await _send_error(send, 401, msg, "invalid_api_key", [(b"www-authenticate", b"Bearer")])
        return await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """Reads the body up front (at most ``limit`` bytes, else 413; all of it within ``read_timeout_s``,
    else 408; UTF-8, else 400) and replays it to the app."""

    def __init__(self, app: ASGIApp, limit: int, read_timeout_s: float = 30.0) -> None:
        self.app, self.limit, self.read_timeout_s = app, limit, read_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        too_big = f"the request body is larger than this server's limit of {self.limit} bytes"
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and value.isdigit() and int(value) > self.limit:
                return await _send_error(send, 413, too_big)
        chunks: list[bytes] = []
        size = 0
        deadline = asyncio.get_running_loop().time() + self.read_timeout_s
        while True:
            try:
                message = await asyncio.wait_for(receive(), deadline - asyncio.get_running_loop().time())
            except TimeoutError:
                return await _send_error(send, 408, f"the request body was not received within "
                                         f"{self.read_timeout_s:g} s", headers=[(b"connection", b"close")])
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                return await _send_error(send, 413, too_big)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        if _is_binary_upload(scope):  # multipart forms (audio files) are checked by their route, not as JSON
            return await self.app(scope, replay_body(body, receive), send)
        try:  # JSON is UTF-8 (RFC 8259); raw NUL bytes only occur in UTF-16/32, which json.loads would guess
            body.decode("utf-8")
            if b"\x00" in body:
                raise UnicodeDecodeError("utf-8", body, body.index(b"\x00"), body.index(b"\x00") + 1,
                                         "NUL byte")
        except UnicodeDecodeError as exc:
            return await _send_error(send, 400,
                                     f"the request body must be UTF-8 encoded JSON (byte {exc.start} "
                                     "is not valid UTF-8 JSON text)")
        return await self.app(scope, replay_body(body, receive), send)


class RootPathMiddleware:
    """``--root-path /llm``: a request for ``/llm/v1/...`` is routed as ``/v1/...`` (a proxy that forwards
    the prefix unchanged); requests without the prefix are routed as they are, as vLLM's server does."""

    def __init__(self, app: ASGIApp, root_path: str) -> None:
        self.app, self.root = app, root_path

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] in ("http", "websocket") and (path == self.root or path.startswith(self.root + "/")):
            scope = {**scope, "path": path[len(self.root):] or "/", "root_path": self.root}
            scope["raw_path"] = scope["path"].encode()
        await self.app(scope, receive, send)


def install_middleware(app: Starlette, config: ServerConfig) -> None:
    """The middleware both servers (generation and embeddings) run, from the outermost: CORS (a preflight
    is answered before the key check; only with ``allowed_origins``), the API key, then the body limit,
    all before anything is parsed."""
    app.add_middleware(
        BodyLimitMiddleware, limit=config.max_request_bytes, read_timeout_s=config.read_timeout_s
    )
    if config.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=config.api_key)
    if config.allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(config.allowed_origins),
            allow_methods=["*"],
            allow_headers=["*"],
            allow_credentials=False,
        )
    if config.root_path:  # outermost: every check below sees the route's own path
        app.add_middleware(RootPathMiddleware, root_path=config.root_path)


def _is_binary_upload(scope: Scope) -> bool:
    for name, value in scope.get("headers", ()):
        if name == b"content-type":
            return value.split(b";")[0].strip().lower() in (b"multipart/form-data",
                                                            b"application/octet-stream")
    return False


def replay_body(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that yields the body already read, then the client's next message (its disconnect)."""
    replayed = False

    async def replay() -> Message:
        nonlocal replayed
        if not replayed:
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
