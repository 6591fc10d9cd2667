"""Video generation as jobs, the shape of OpenAI's videos API:

    POST   /v1/videos                 → a video object, ``status: "queued"``
    GET    /v1/videos/{id}            → status (queued, in_progress, completed, failed, cancelled) and
                                        progress 0–100
    GET    /v1/videos/{id}/content    → the file (GIF by default, ``?format=mp4`` when PyAV is installed)
    POST   /v1/videos/{id}/cancel     → stop it (between denoising steps); the record stays
    DELETE /v1/videos/{id}            → cancel if running, then forget it

A clip takes seconds to minutes, longer than an HTTP request should hang, so the request only creates a
job; the diffusion worker thread runs jobs one at a time (batch 1) and reports progress from the
pipeline's per-step callback, which is also where a cancelled job stops. The store is bounded: it keeps at
most ``max_jobs`` jobs, evicting the oldest finished one, and refuses (429) when every slot is still live.
"""

from __future__ import annotations

import asyncio
import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Literal

from fastapi import APIRouter, Query, Response
from pydantic import BaseModel, ConfigDict, Field

from forwardpass.diffusion.video.export import encode_video
from forwardpass.errors import ForwardpassError, ModelNotFoundError, ValidationError
from forwardpass.server.diffusion_service import BusyError, DiffusionService
from forwardpass.server.images import (
    MAX_GUIDANCE,
    MAX_PROMPT_CHARS,
    MAX_STEPS,
    SIZE_RE,
    _size_errors,
    parse_size,
)

MAX_FRAMES = 16
MAX_JOBS = 64
FINISHED = ("completed", "failed", "cancelled")


class VideoRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompt: str = Field(min_length=1, max_length=MAX_PROMPT_CHARS)
    model: str | None = Field(default=None, max_length=256)
    size: str | None = Field(default=None, pattern=SIZE_RE, description="WIDTHxHEIGHT, e.g. 32x32")
    num_frames: int | None = Field(default=None, ge=1, le=MAX_FRAMES)
    negative_prompt: str | None = Field(default=None, max_length=MAX_PROMPT_CHARS)
    num_inference_steps: int | None = Field(default=None, ge=1, le=MAX_STEPS)
    guidance_scale: float | None = Field(default=None, ge=0.0, le=MAX_GUIDANCE)
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    framewise: bool = False
    fps: int = Field(default=8, ge=1, le=60)
    scale: int = Field(default=1, ge=1, le=16, description="nearest-neighbour upscale of the frames")
    user: str | None = Field(default=None, max_length=256)


class JobCancelled(Exception):
    pass


@dataclass
class VideoJob:
    id: str
    request: VideoRequest
    created_at: int = field(default_factory=lambda: int(time.time()))
    status: str = "queued"
    progress: int = 0
    completed_at: int | None = None
    error: dict[str, Any] | None = None
    frames: list | None = None
    cancel: threading.Event = field(default_factory=threading.Event)

    def public(self) -> dict[str, Any]:
        r = self.request
        return {"id": self.id, "object": "video", "model": r.model or "forwardpass-video",
                "status": self.status, "progress": self.progress, "created_at": self.created_at,
                "completed_at": self.completed_at, "size": r.size, "num_frames": r.num_frames,
                "prompt": r.prompt, "framewise": r.framewise,
                "error": self.error}  # fmt: skip


class VideoJobStore:
    """At most ``max_jobs`` jobs; the oldest *finished* job makes room for a new one."""

    def __init__(self, max_jobs: int = MAX_JOBS):
        self.max_jobs = max_jobs
        self._jobs: OrderedDict[str, VideoJob] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, request: VideoRequest) -> VideoJob:
        with self._lock:
            if len(self._jobs) >= self.max_jobs:
                finished = next((k for k, j in self._jobs.items() if j.status in FINISHED), None)
                if finished is None:
                    raise BusyError(f"{self.max_jobs} video jobs are queued or running; retry later")
                del self._jobs[finished]
            job = VideoJob(id=f"video_{secrets.token_hex(12)}", request=request)
            self._jobs[job.id] = job
            return job

    def get(self, job_id: str) -> VideoJob:
        job = self._jobs.get(job_id)
        if job is None:
            raise ModelNotFoundError(f"no video job {job_id!r} (finished jobs are kept until {self.max_jobs} "
                                     "newer ones need the room)", param="video_id")  # fmt: skip
        return job

    def remove(self, job_id: str) -> None:
        with self._lock:
            self._jobs.pop(job_id, None)

    def __len__(self) -> int:
        return len(self._jobs)


def run_job(service: DiffusionService, job: VideoJob) -> None:
    """On the diffusion worker: generate, reporting progress and stopping between steps when cancelled."""
    if job.cancel.is_set():
        return
    job.status = "in_progress"
    r = job.request
    try:
        pipe = service.pipeline("video")
        width, height = parse_size(r.size)
        frames = r.num_frames or pipe.defaults.get("num_frames", 8)
        steps = r.num_inference_steps or pipe.defaults["num_inference_steps"]
        total = steps * (frames if r.framewise else 1)

        def on_step(_pipe: Any, i: int, _t: Any, _state: dict) -> None:
            if job.cancel.is_set():
                raise JobCancelled
            job.progress = min(99, round(100 * (i + 1) / total))

        out = _size_errors(lambda: pipe(r.prompt, negative_prompt=r.negative_prompt, num_frames=frames,
                                        num_inference_steps=steps, guidance_scale=r.guidance_scale,
                                        width=width, height=height, seed=r.seed, framewise=r.framewise,
                                        callback_on_step_end=on_step, show_progress=False))  # fmt: skip
        job.frames = out.frames[0]
        job.status, job.progress = "completed", 100
    except JobCancelled:
        job.status = "cancelled"
    except ForwardpassError as exc:
        job.status, job.error = "failed", {"message": exc.message, "type": exc.error_type, "param": exc.param}
    except Exception as exc:  # noqa: BLE001 - a job's failure is its own, reported in its status
        job.status, job.error = (
            "failed",
            {"message": f"internal error: {type(exc).__name__}", "type": "internal_error"},
        )
    finally:
        job.completed_at = int(time.time())


def videos_router(service: DiffusionService, store: VideoJobStore | None = None) -> APIRouter:
    router = APIRouter()
    store = store or VideoJobStore()
    router.job_store = store  # type: ignore[attr-defined]  # for tests and the dashboard

    @router.post("/v1/videos", response_model=None)
    async def create_video(req: VideoRequest) -> dict[str, Any]:
        parse_size(req.size)  # the size's form is checked now; what the model supports, when it runs
        job = store.add(req)
        try:
            service.submit("video", lambda: run_job(service, job))
        except BusyError:
            store.remove(job.id)
            raise
        return job.public()

    @router.get("/v1/videos/{video_id}", response_model=None)
    async def get_video(video_id: str) -> dict[str, Any]:
        return store.get(video_id).public()

    @router.get("/v1/videos/{video_id}/content", response_model=None)
    async def get_content(video_id: str, format: Literal["gif", "mp4"] = Query("gif")) -> Response:
        job = store.get(video_id)
        if job.status != "completed" or job.frames is None:
            raise ValidationError(f"video {video_id} is {job.status}, not completed; poll GET "
                                  f"/v1/videos/{video_id}",
                                  param="video_id", code="video_not_ready")  # fmt: skip
        r = job.request
        # milliseconds for a short clip, but still not on the event loop
        data = await asyncio.to_thread(encode_video, job.frames, format, fps=r.fps, scale=r.scale)
        return Response(data, media_type="image/gif" if format == "gif" else "video/mp4")

    async def _cancel(video_id: str) -> VideoJob:
        job = store.get(video_id)
        if job.status not in FINISHED:
            job.cancel.set()
            if job.status == "queued":  # never started: the worker will skip it
                job.status, job.completed_at = "cancelled", int(time.time())
        return job

    @router.post("/v1/videos/{video_id}/cancel", response_model=None)
    async def cancel_video(video_id: str) -> dict[str, Any]:
        return (await _cancel(video_id)).public()

    @router.delete("/v1/videos/{video_id}", response_model=None)
    async def delete_video(video_id: str) -> dict[str, Any]:
        job = await _cancel(video_id)
        store.remove(video_id)
        return {"id": job.id, "object": "video.deleted", "deleted": True}

    return router
