"""Server-sent events that stop when the client goes away, whatever ASGI spec version the server speaks."""

from __future__ import annotations

from collections.abc import AsyncIterable

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send


class SSEResponse(StreamingResponse):
    """Streams ``data: ...`` lines. A task listens for ``http.disconnect`` meanwhile and cancels the
    stream, so the generator's ``finally`` (which aborts the engine requests) runs at once instead of
    at the next failed write."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterable[str]) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with anyio.create_task_group() as tg:

            async def stream() -> None:
                try:
                    await self.stream_response(send)
                except OSError:
                    pass  # the client went away mid-write
                tg.cancel_scope.cancel()

            async def listen() -> None:
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()

            tg.start_soon(stream)
            tg.start_soon(listen)
        aclose = getattr(self.body_iterator, "aclose", None)
        if aclose is not None:
            await aclose()  # runs the generator's cleanup now, not at garbage collection
