"""/v1/images/generations and /v1/videos through httpx on the real app (``build_app``), errors included."""

from __future__ import annotations

import asyncio
import base64
import io
import time

import httpx
import pytest
from PIL import Image

from forwardpass.server.config import ServerConfig


def _app(**config):
    from forwardpass.engine.frontend.async_engine import AsyncLLMEngine, EngineSpec
    from forwardpass.server.app import build_app

    # The LLM engine is never started here: ASGITransport does not run the lifespan.
    return build_app(AsyncLLMEngine(EngineSpec(model="unused", config_kwargs={})), ServerConfig(**config))


@pytest.fixture(scope="module")
def app():
    return _app(image_model="default", video_model="default")


def call(app, method: str, url: str, **kwargs) -> httpx.Response:
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t",
                                     timeout=120) as client:  # fmt: skip
            return await client.request(method, url, **kwargs)

    return asyncio.run(go())


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def test_images_generate_b64_png(app):
    r = call(app, "POST", "/v1/images/generations",
             json={"prompt": "a handwritten 7", "n": 2, "size": "32x32", "num_inference_steps": 2,
                   "seed": 3})  # fmt: skip
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    assert len(data) == 2
    img = Image.open(io.BytesIO(base64.b64decode(data[0]["b64_json"])))
    assert img.format == "PNG" and img.size == (32, 32)
    again = call(app, "POST", "/v1/images/generations",
                 json={"prompt": "a handwritten 7", "n": 2, "num_inference_steps": 2, "seed": 3})  # fmt: skip
    assert again.json()["data"] == data  # same seed, same images


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "7", "n": 0}, "n"),
        ({"prompt": "7", "n": 9}, "n"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": "7", "size": "big"}, "size"),
        ({"prompt": "7", "size": "64x64"}, "size"),  # well-formed, but the model is trained on 32x32 only
        ({"prompt": "7", "size": "4096x4096"}, "size"),
        ({"prompt": "7", "response_format": "url"}, "response_format"),
        ({"prompt": "7", "num_inference_steps": 0}, "num_inference_steps"),
        ({"prompt": "7", "num_inference_steps": 101}, "num_inference_steps"),
        ({"prompt": "7", "guidance_scale": -1}, "guidance_scale"),
        ({"prompt": "7", "seed": -1}, "seed"),
        ({"prompt": "7", "colour": "red"}, "colour"),
    ],
)
def test_images_bounds_are_400_naming_the_field(app, body, param):
    err = error_of(call(app, "POST", "/v1/images/generations", json=body), 400)
    assert err["param"] == param and err["type"] == "invalid_request_error"


def _wait(app, vid: str, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = call(app, "GET", f"/v1/videos/{vid}").json()
        if job["status"] in ("completed", "failed", "cancelled"):
            return job
        time.sleep(0.05)
    raise AssertionError(f"video job {vid} did not finish")


def test_video_job_lifecycle(app):
    r = call(app, "POST", "/v1/videos",
             json={"prompt": "a handwritten 3 moving left", "num_frames": 8, "num_inference_steps": 2,
                   "seed": 0})  # fmt: skip
    assert r.status_code == 200, r.text
    job = r.json()
    assert (
        job["object"] == "video"
        and job["status"] in ("queued", "in_progress")
        and job["id"].startswith("video_")
    )
    done = _wait(app, job["id"])
    assert done["status"] == "completed" and done["progress"] == 100, done
    content = call(app, "GET", f"/v1/videos/{job['id']}/content")
    assert content.status_code == 200 and content.headers["content-type"] == "image/gif"
    gif = Image.open(io.BytesIO(content.content))
    assert gif.n_frames == 8 and gif.size == (32, 32)
    gone = call(app, "DELETE", f"/v1/videos/{job['id']}")
    assert gone.json() == {"id": job["id"], "object": "video.deleted", "deleted": True}
    assert error_of(call(app, "GET", f"/v1/videos/{job['id']}"), 404)["param"] == "video_id"


def test_video_cancel_stops_a_running_job(app):
    slow = call(app, "POST", "/v1/videos", json={"prompt": "seven moving up", "num_inference_steps": 100,
                                                 "framewise": True}).json()  # fmt: skip
    queued = call(
        app, "POST", "/v1/videos", json={"prompt": "two moving down", "num_inference_steps": 2}
    ).json()
    # the second job waits behind the first (one worker, batch 1): cancelling it before it starts is immediate
    cancelled = call(app, "POST", f"/v1/videos/{queued['id']}/cancel").json()
    assert cancelled["status"] == "cancelled"
    deadline = time.monotonic() + 60
    while call(app, "GET", f"/v1/videos/{slow['id']}").json()["progress"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert call(app, "POST", f"/v1/videos/{slow['id']}/cancel").status_code == 200
    done = _wait(app, slow["id"])
    assert done["status"] == "cancelled" and 0 < done["progress"] < 100
    err = error_of(call(app, "GET", f"/v1/videos/{slow['id']}/content"), 400)
    assert err["code"] == "video_not_ready"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "3", "num_frames": 0}, "num_frames"),
        ({"prompt": "3", "num_frames": 17}, "num_frames"),
        ({"prompt": "3", "num_inference_steps": 1000}, "num_inference_steps"),
        ({"prompt": "3", "size": "32"}, "size"),
        ({"prompt": "3", "fps": 0}, "fps"),
        ({"prompt": "x" * 1001}, "prompt"),
    ],
)
def test_video_bounds_are_400_naming_the_field(app, body, param):
    assert error_of(call(app, "POST", "/v1/videos", json=body), 400)["param"] == param


def test_video_failure_is_reported_in_the_job(app):
    job = call(app, "POST", "/v1/videos", json={"prompt": "3 moving left", "size": "64x64",
                                                "num_inference_steps": 1}).json()  # fmt: skip
    done = _wait(app, job["id"])
    assert done["status"] == "failed" and done["error"]["param"] == "size"


def test_video_unknown_id_and_bad_format(app):
    assert error_of(call(app, "GET", "/v1/videos/video_nope"), 404)["type"] == "not_found_error"
    assert (
        error_of(call(app, "GET", "/v1/videos/video_nope/content?format=avi"), 400)["param"] == "query.format"
    )


def test_job_store_is_bounded():
    from forwardpass.server.diffusion_service import BusyError
    from forwardpass.server.videos import VideoJobStore, VideoRequest

    store = VideoJobStore(max_jobs=2)
    a = store.add(VideoRequest(prompt="1"))
    store.add(VideoRequest(prompt="2"))
    with pytest.raises(BusyError) as err:
        store.add(VideoRequest(prompt="3"))  # both live: refuse (429)
    assert err.value.status_code == 429
    a.status = "completed"
    store.add(VideoRequest(prompt="3"))  # the finished one makes room
    assert len(store) == 2 and a.id not in [j for j in store._jobs]


def test_routes_only_when_asked():
    app = _app()  # the LLM server alone: no diffusion routes, no diffusion model loaded
    assert call(app, "POST", "/v1/images/generations", json={"prompt": "7"}).status_code == 404
    assert call(app, "POST", "/v1/videos", json={"prompt": "7"}).status_code == 404


def test_bad_model_folder_fails_at_build(tmp_path):
    from forwardpass.errors import ModelNotFoundError

    with pytest.raises(ModelNotFoundError, match="model_index.json"):
        _app(video_model=str(tmp_path))
    with pytest.raises(ModelNotFoundError, match="model_index.json"):
        _app(image_model=str(tmp_path / "missing"))
