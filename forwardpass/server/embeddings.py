"""``POST /v1/embeddings`` (OpenAI's embeddings API) and its answer on a server that runs a generative model.

Request: ``input`` is a string, a list of strings, a list of token ids or a list of token-id lists;
``encoding_format`` ``float`` (JSON numbers) or ``base64`` (little-endian float32 bytes, what the
``openai`` client asks for by default); ``dimensions`` only where the model has that many (no model here
is trained for shortened, Matryoshka-style vectors, so any other value is a 400); vLLM's
``truncate_prompt_tokens`` extension (``-1`` = the model's maximum). Every bound is a 400 naming the field
(``input[3]``), an input over the model's length without truncation included.

Tokenization and JSON encoding run in worker threads, the encoder on the embedder's compute thread: the
event loop never waits for either.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import Callable
from typing import Any, Literal

import numpy as np
from fastapi import APIRouter, Request, Response
from pydantic import Field

from forwardpass.embed.async_runner import AsyncEmbedder
from forwardpass.embed.inputs import check_ids, encode_text, resolve_truncation
from forwardpass.errors import ModelNotFoundError, ValidationError
from forwardpass.server.protocol import _Strict

#: OpenAI's own cap on inputs per request
MAX_EMBEDDING_INPUTS = 2048
#: characters of one text input; longer documents should be split (or truncated by the client)
MAX_INPUT_CHARS = 1 << 18

EmbeddingInput = str | list[str] | list[int] | list[list[int]]


class EmbeddingRequest(_Strict):  # as every route: unknown fields and coercion ("16" for 16) are 400s
    input: EmbeddingInput
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1, le=1 << 16)
    user: str | None = Field(default=None, max_length=256)
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1, le=1 << 20)


def _inputs(req: EmbeddingRequest) -> list[str | list[int]]:
    raw = req.input
    items: list[str | list[int]]
    if isinstance(raw, str):
        items = [raw]
    elif raw and all(isinstance(t, int) for t in raw):
        items = [list(raw)]  # type: ignore[arg-type]  # one list of token ids
    else:
        items = list(raw)  # type: ignore[arg-type]
    if not items:
        raise ValidationError("input is empty; give a string, a list of strings or token ids", param="input")
    if len(items) > MAX_EMBEDDING_INPUTS:
        raise ValidationError(
            f"input has {len(items)} entries; at most {MAX_EMBEDDING_INPUTS} per request", param="input"
        )
    for i, item in enumerate(items):
        if isinstance(item, str) and len(item) > MAX_INPUT_CHARS:
            raise ValidationError(
                f"input[{i}] has {len(item)} characters; at most {MAX_INPUT_CHARS}", param=f"input[{i}]"
            )
    return items


def embeddings_router(
    embedder: AsyncEmbedder, served_names: list[str], on_done: Callable[[int, float], None] | None = None
) -> APIRouter:
    """The route on an embedding server; ``on_done(prompt_tokens, seconds)`` feeds the metrics."""
    router = APIRouter()
    runner = embedder.runner

    def tokenize(items: list[str | list[int]], limit: int | None) -> list[list[int]]:
        out = []
        for i, item in enumerate(items):
            param = "input" if len(items) == 1 else f"input[{i}]"
            out.append(
                encode_text(runner.tokenizer, item, runner.limits, limit, param)
                if isinstance(item, str)
                else check_ids(item, runner.limits, limit, param)
            )
        return out

    @router.post("/v1/embeddings", response_model=None)
    @router.post("/embeddings", response_model=None, include_in_schema=False)
    async def create_embeddings(req: EmbeddingRequest, request: Request) -> Response:
        start = time.monotonic()
        name = req.model or served_names[0]
        if name not in served_names:
            raise ModelNotFoundError(
                f"the model {name!r} does not exist; this server serves: {', '.join(served_names)}",
                param="model",
                code="model_not_found",
            )
        if req.dimensions is not None and req.dimensions != runner.dimensions:
            raise ValidationError(
                f"dimensions={req.dimensions} is not supported: this model gives "
                f"{runner.dimensions}-dimensional embeddings and was not trained for shortened "
                f"(Matryoshka) vectors; omit dimensions",
                param="dimensions",
            )
        limit = resolve_truncation(req.truncate_prompt_tokens, runner.limits)
        items = _inputs(req)
        token_ids = await asyncio.to_thread(tokenize, items, limit)
        vectors = await embedder.embed(token_ids)
        prompt_tokens = sum(len(t) for t in token_ids)
        body = await asyncio.to_thread(_response_json, vectors, req.encoding_format, name, prompt_tokens)
        if on_done is not None:
            on_done(prompt_tokens, time.monotonic() - start)
        return Response(body, media_type="application/json")

    return router


def _response_json(vectors: list[list[float]], encoding: str, model: str, prompt_tokens: int) -> bytes:
    def encode(vec: list[float]) -> Any:
        if encoding == "base64":
            return base64.b64encode(np.asarray(vec, dtype="<f4").tobytes()).decode("ascii")
        return vec

    data = [{"object": "embedding", "index": i, "embedding": encode(v)} for i, v in enumerate(vectors)]
    return json.dumps(
        {
            "object": "list",
            "data": data,
            "model": model,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
        }
    ).encode()


def generative_embeddings_router() -> APIRouter:
    """``/v1/embeddings`` on a server that runs a generative model: a clear 400 instead of a 404."""
    router = APIRouter()

    @router.post("/v1/embeddings", response_model=None, include_in_schema=False)
    @router.post("/embeddings", response_model=None, include_in_schema=False)
    async def no_embeddings() -> dict[str, Any]:
        raise ValidationError(
            "this server runs a generative model, which does not embed; serve an embedding model "
            "(e.g. a sentence-transformers BertModel) with forwardpass serve --task embed",
            param="model",
            code="model_not_embedding",
        )

    return router
