"""``POST /v1/images/generations``: OpenAI's images API on the diffusion pipeline.

OpenAI fields: ``prompt``, ``n``, ``size`` ("WIDTHxHEIGHT"), ``response_format`` (only ``b64_json``: this
server keeps no files to link to), ``model``, ``user``. Extensions (diffusers' names): ``negative_prompt``,
``num_inference_steps``, ``guidance_scale``, ``seed``. Every field is bounded; a bad value is a 400 in the
OpenAI envelope naming the field. Generation and PNG encoding run on the diffusion worker thread.
"""

from __future__ import annotations

import base64
import io
import re
import time
from collections.abc import Callable
from typing import Any, Literal, TypeVar

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from forwardpass.errors import ValidationError
from forwardpass.server.diffusion_service import DiffusionService

MAX_IMAGES = 8  # n
MAX_PROMPT_CHARS = 1000
MAX_STEPS = 100
MAX_GUIDANCE = 30.0
MAX_SIDE = 1024
SIZE_RE = r"^\d{1,4}x\d{1,4}$"


class ImageGenerationRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompt: str = Field(min_length=1, max_length=MAX_PROMPT_CHARS)
    model: str | None = Field(default=None, max_length=256)
    n: int = Field(default=1, ge=1, le=MAX_IMAGES)
    size: str | None = Field(default=None, pattern=SIZE_RE, description="WIDTHxHEIGHT, e.g. 32x32")
    response_format: Literal["b64_json"] = "b64_json"
    user: str | None = Field(default=None, max_length=256)
    negative_prompt: str | None = Field(default=None, max_length=MAX_PROMPT_CHARS)
    num_inference_steps: int | None = Field(default=None, ge=1, le=MAX_STEPS)
    guidance_scale: float | None = Field(default=None, ge=0.0, le=MAX_GUIDANCE)
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)


def parse_size(size: str | None) -> tuple[int | None, int | None]:
    """``"32x48"`` → (width 32, height 48); each side in [1, MAX_SIDE] (the pipeline
    checks what it supports)."""
    if size is None:
        return None, None
    m = re.fullmatch(r"(\d+)x(\d+)", size)
    if m is None:
        raise ValidationError(f"size {size!r} must look like WIDTHxHEIGHT, e.g. 32x32", param="size")
    width, height = int(m[1]), int(m[2])
    if not (1 <= width <= MAX_SIDE and 1 <= height <= MAX_SIDE):
        raise ValidationError(f"size {size!r}: each side must be in [1, {MAX_SIDE}]", param="size")
    return width, height


_T = TypeVar("_T")


def _size_errors(fn: Callable[[], _T]) -> _T:
    """The pipeline names ``height`` / ``width``; the API's field is ``size``."""
    try:
        return fn()
    except ValidationError as exc:
        if exc.param in ("height", "width"):
            raise ValidationError(exc.message, param="size") from None
        raise


def _png_b64(image: Any) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def images_router(service: DiffusionService) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/images/generations", response_model=None)
    async def generate_images(req: ImageGenerationRequest) -> dict[str, Any]:
        width, height = parse_size(req.size)

        def work() -> list[str]:
            pipe = service.pipeline("image")
            out = _size_errors(lambda: pipe(req.prompt, negative_prompt=req.negative_prompt, width=width,
                                            height=height, num_inference_steps=req.num_inference_steps,
                                            guidance_scale=req.guidance_scale, num_images_per_prompt=req.n,
                                            seed=req.seed, show_progress=False))  # fmt: skip
            return [_png_b64(img) for img in out.images]

        images = await service.run("image", work)
        return {
            "created": int(time.time()),
            "data": [{"b64_json": b64, "revised_prompt": None} for b64 in images],
        }

    return router
