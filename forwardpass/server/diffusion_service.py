"""The diffusion models behind ``/v1/images/generations`` and ``/v1/videos``, and the one thread that runs
them.

Generation is compute-bound and a pipeline keeps scheduler state, so image requests run one at a time on
one worker thread and video jobs one at a time on another: the event loop only enqueues work and awaits a
future. (One clip at a time is also the regime video runs in: one clip fills the machine, so batch 1.)
A full queue is a 429 (``BusyError``): the client should slow down; the server is not failing.

Pipelines load on first use from the folders the server was started with (``"default"``: the embedded
models), so a server that never gets a diffusion request never pays for loading one.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

from forwardpass.errors import ForwardpassError, ModelNotFoundError

T = TypeVar("T")
DEFAULT = "default"


def resolve_folder(value: str | None, kind: str) -> Path | None:
    """``"default"`` → the embedded model's folder; ``None`` / ``"none"`` → route disabled; else a folder that
    must hold ``model_index.json`` (checked at start-up, not at the first request)."""
    if value is None or value.lower() == "none":
        return None
    if value == DEFAULT:
        if kind == "image":
            from forwardpass.diffusion import DEFAULT_MODEL_DIR

            return DEFAULT_MODEL_DIR
        from forwardpass.diffusion.video import DEFAULT_VIDEO_MODEL_DIR

        return DEFAULT_VIDEO_MODEL_DIR
    path = Path(value).expanduser()
    if not (path / "model_index.json").is_file():
        raise ModelNotFoundError(f"--{kind}-model {value}: not a diffusion pipeline folder (no "
                                 "model_index.json)", param=f"{kind}_model")  # fmt: skip
    return path


class BusyError(ForwardpassError):
    """Too much diffusion work is already waiting: 429, as OpenAI answers a rate limit; retry later."""

    error_type = "rate_limit_error"
    status_code = 429


class _Lane:
    """A bounded FIFO of work and the one daemon thread that runs it."""

    def __init__(self, name: str, max_pending: int):
        self.name = name
        self.queue: queue.Queue[tuple[Callable[[], Any], Future]] = queue.Queue(maxsize=max_pending)
        self.thread: threading.Thread | None = None
        self.lock = threading.Lock()

    def submit(self, fn: Callable[[], Any]) -> Future:
        fut: Future = Future()
        try:
            self.queue.put_nowait((fn, fut))
        except queue.Full:
            raise BusyError(
                f"{self.queue.maxsize} {self.name} requests are already waiting; retry later"
            ) from None
        with self.lock:
            if self.thread is None or not self.thread.is_alive():
                # Daemon: a generation in progress never holds up the process's exit.
                self.thread = threading.Thread(
                    target=self._work, name=f"forwardpass-{self.name}", daemon=True
                )
                self.thread.start()
        return fut

    def _work(self) -> None:
        while True:
            fn, fut = self.queue.get()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - delivered to the awaiting request; the worker lives on
                fut.set_exception(exc)


class DiffusionService:
    """Lazily loaded pipelines; images and videos each have their own lane (one thread, one request at a
    time), so a short image request never waits behind a long video job."""

    def __init__(self, image_dir: Path | None, video_dir: Path | None, *, max_pending: int = 16):
        self.image_dir, self.video_dir = image_dir, video_dir
        self._pipes: dict[str, Any] = {}
        self._load_lock = threading.Lock()
        self._lanes = {kind: _Lane(kind, max_pending) for kind in ("image", "video")}

    def pipeline(self, kind: str) -> Any:
        """The image or video pipeline, loaded once (on its lane's thread, never on the event loop)."""
        with self._load_lock:
            if kind not in self._pipes:
                if kind == "image":
                    from forwardpass.diffusion.pipeline import ImagePipeline

                    assert self.image_dir is not None  # the route exists only with a folder
                    self._pipes[kind] = ImagePipeline.from_pretrained(self.image_dir)
                else:
                    from forwardpass.diffusion.video.pipeline import VideoPipeline

                    assert self.video_dir is not None
                    self._pipes[kind] = VideoPipeline.from_pretrained(self.video_dir)
                self._pipes[kind].set_progress_bar_config(disable=True)
            return self._pipes[kind]

    def submit(self, kind: str, fn: Callable[[], T]) -> Future:
        """Queue ``fn`` on the ``kind`` lane; a full lane is a 429 the client may retry."""
        return self._lanes[kind].submit(fn)

    async def run(self, kind: str, fn: Callable[[], T]) -> T:
        return await asyncio.wrap_future(self.submit(kind, fn))


def diffusion_routers(image_model: str | None, video_model: str | None) -> list:
    """The routers ``build_app`` includes: images and videos, each only when its model is configured."""
    image_dir, video_dir = resolve_folder(image_model, "image"), resolve_folder(video_model, "video")
    if image_dir is None and video_dir is None:
        return []
    service = DiffusionService(image_dir, video_dir)
    routers = []
    if image_dir is not None:
        from forwardpass.server.images import images_router

        routers.append(images_router(service))
    if video_dir is not None:
        from forwardpass.server.videos import videos_router

        routers.append(videos_router(service))
    return routers
