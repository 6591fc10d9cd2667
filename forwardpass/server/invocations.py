"""``POST /invocations``: SageMaker's one route, as vLLM serves it: the body's shape picks the API
(``messages`` a chat completion, ``prompt`` a completion, ``input`` an embedding) and the request runs through
that route unchanged (same validation, errors, streaming), on the generative and the embedding server alike.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.types import Message, Receive, Scope, Send

from forwardpass.errors import ValidationError

#: the first key of these a body has picks its route
ROUTES = (("messages", "/v1/chat/completions"), ("prompt", "/v1/completions"), ("input", "/v1/embeddings"))


class _Forwarded(Response):
    """Runs the request again through the app, at another path, with the body already read."""

    def __init__(self, app: Any, path: str, body: bytes) -> None:
        super().__init__()
        self.app, self.path, self.raw = app, path, body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": self.raw, "more_body": False}
            return await receive()  # afterwards: the client's disconnect, as the route expects

        await self.app({**scope, "path": self.path, "raw_path": self.path.encode()}, replay, send)


def add_invocations_route(app: FastAPI, responses: dict[int | str, dict[str, Any]] | None = None) -> None:
    @app.post("/invocations", responses=responses, response_model=None)
    async def invocations(request: Request) -> Response:
        """vLLM's (SageMaker's) one route: ``messages`` -> chat, ``prompt`` -> completions, ``input`` ->
        embeddings."""
        raw = await request.body()
        try:
            body = json.loads(raw)
        except ValueError as exc:
            raise ValidationError(f"the request body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise ValidationError("the request body must be a JSON object")
        path = next((p for key, p in ROUTES if key in body), None)
        if path is None:
            raise ValidationError("an /invocations body needs messages (a chat completion), prompt (a "
                                  "completion) or input (an embedding)")
        return _Forwarded(request.app, path, raw)
