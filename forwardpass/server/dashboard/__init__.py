"""The live dashboard at ``/dashboard``: static HTML + JS shipped in the package, fed over SSE.

Routes (``dashboard_router``): ``GET /dashboard`` the page; ``GET /dashboard/static/{file}`` its script
and style sheet; ``GET /dashboard/state`` one JSON snapshot (``DashboardState.snapshot`` plus the KV block
map the engine loop answers a ``BlockMapRequest`` with); ``GET /dashboard/events`` the same snapshot as
server-sent events every ``interval_s``. No CDN, no build step: the page works offline.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from importlib import resources
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, HTTPException
from fastapi.responses import HTMLResponse, Response

from forwardpass.engine.frontend.protocol import BlockMapRequest
from forwardpass.server.dashboard.state import DashboardState, engine_peaks
from forwardpass.server.sse import SSEResponse

if TYPE_CHECKING:
    from forwardpass.engine.frontend.async_engine import AsyncLLMEngine

__all__ = ["DashboardState", "dashboard_router"]

_STATIC = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}


def _static(name: str) -> str:
    static = resources.files("forwardpass.server.dashboard").joinpath("static")
    return static.joinpath(name).read_text(encoding="utf-8")


def dashboard_router(engine: AsyncLLMEngine, *, interval_s: float = 0.5, stream_s: float = 5.0) -> APIRouter:
    """``stream_s`` bounds one SSE connection (the page's ``EventSource`` reconnects at once): an open
    dashboard must not hold up a graceful shutdown, which waits for open responses to end."""
    state = DashboardState(engine, engine_peaks(engine))  # the model's layers: from the engine once started
    router = APIRouter(include_in_schema=False)
    last_map: dict[str, Any] = {}

    async def blocks() -> dict[str, Any] | None:
        if engine.is_dead or engine.info is None:
            return None
        try:
            result = await asyncio.wait_for(engine.front.call(BlockMapRequest), timeout=2.0)
        except Exception:  # noqa: BLE001 - a timeout (busy engine) or a dying one: keep the last map
            return last_map.get("map")
        last_map["map"] = result
        return result

    async def full_state() -> dict[str, Any]:
        snap = state.snapshot()
        snap["blocks"] = await blocks()
        snap["model"] = engine.model_dir.name
        snap["engine_dead"] = engine.is_dead
        return snap

    @router.get("/dashboard", response_class=HTMLResponse)
    async def page() -> HTMLResponse:
        return HTMLResponse(_static("index.html"))

    @router.get("/dashboard/static/{name}")
    async def static(name: str) -> Response:
        if name not in _STATIC:
            raise HTTPException(status_code=404, detail="not found")
        return Response(_static(name), media_type=_STATIC[name])

    @router.get("/dashboard/state", response_model=None)
    async def get_state() -> dict[str, Any]:
        return await full_state()

    @router.get("/dashboard/events", response_class=SSEResponse)
    async def events() -> SSEResponse:
        async def stream() -> AsyncIterator[str]:
            yield "retry: 500\n\n"
            end = asyncio.get_running_loop().time() + stream_s
            while asyncio.get_running_loop().time() < end and not engine.is_dead:
                yield f"data: {json.dumps(await full_state())}\n\n"
                await asyncio.sleep(interval_s)

        return SSEResponse(stream())

    return router
