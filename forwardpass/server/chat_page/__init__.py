"""The web chat page at ``/``: static HTML, CSS and JS shipped in the package (no CDN, no build step).

The page talks to the server only through the public OpenAI API: ``GET /v1/models`` fills the model
picker, ``POST /v1/chat/completions`` with ``"stream": true`` streams each reply (server-sent events,
read with ``fetch`` and a stream reader). A "Stop" button aborts the fetch, which the server sees as a
disconnect and frees the request's KV blocks. With an API key set, the page asks for it once and keeps
it in the browser's local storage.
"""

from __future__ import annotations

from importlib import resources

from fastapi import APIRouter, HTTPException
from fastapi.responses import HTMLResponse, Response

_STATIC = {"chat.js": "text/javascript", "chat.css": "text/css"}


def _static(name: str) -> str:
    static = resources.files("forwardpass.server.chat_page").joinpath("static")
    return static.joinpath(name).read_text(encoding="utf-8")


def chat_page_router() -> APIRouter:
    router = APIRouter(include_in_schema=False)

    @router.get("/", response_class=HTMLResponse)
    async def page() -> HTMLResponse:
        return HTMLResponse(_static("index.html"))

    @router.get("/chat/static/{name}")
    async def static(name: str) -> Response:
        if name not in _STATIC:
            raise HTTPException(status_code=404, detail="not found")
        return Response(_static(name), media_type=_STATIC[name])

    return router
