"""A server with an API key, a small body limit and a one-request waiting queue: 401, 413, 503 +
Retry-After, open /health and /metrics; then SIGTERM with a stream in flight."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

from tests.helpers.server import ServerProcess, make_served_model
from tests.test_server import assert_error

pytestmark = pytest.mark.timeout(180)
KEY = "sk-test-123"
LONG = {"prompt": "hello", "max_tokens": 400, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def server(checkpoint_factory, tmp_path_factory):
    model = make_served_model(tmp_path_factory.mktemp("served"), checkpoint_factory("qwen3"))
    with ServerProcess(model, "--max-num-seqs", "1", "--max-queued-requests", "1", "--max-request-bytes",
                       "4096", "--num-kv-blocks", "64",
                       "--fair-share-tokens", "0", api_key=KEY) as srv:  # the running stream keeps its slot
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60, headers=server.headers()) as c:
        yield c


def test_missing_or_wrong_key_is_401(server):
    with httpx.Client(base_url=server.url, timeout=30) as anon:
        e = assert_error(anon.post("/v1/completions", json={"prompt": "x"}), 401, "authentication_error")
        assert e["code"] == "invalid_api_key"
        assert_error(anon.get("/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
        assert_error(anon.get("/v1/models", headers={"Authorization": KEY}), 401)  # no "Bearer "
        assert anon.get("/health").status_code == 200
        assert anon.get("/metrics").status_code == 200


def test_right_key_works_with_the_openai_client(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    ok = client.completions.create(model="test-model", prompt="hi", max_tokens=2)
    assert ok.usage.completion_tokens >= 1
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_body_over_the_limit_is_413(http):
    assert_error(http.post("/v1/completions", json={"prompt": "x" * 5000}), 413)
    # no content-length (chunked): counted while reading
    r = http.post("/v1/completions", content=iter([json.dumps({"prompt": "y" * 5000}).encode()]),
                  headers={"content-type": "application/json"})
    assert_error(r, 413)


def _fill_the_queue(http, server, errors: list) -> list[threading.Thread] | None:
    """A stream that takes the only running slot, then a request that waits for it; returns their threads
    once the waiting one is in the engine's queue, or None (after both ended) if the stream finished first:
    the tiny model decodes 400 tokens in well under a second, and on a busy machine the second request can
    reach the engine too late."""
    first_chunk = threading.Event()

    def running():  # takes the only running slot
        try:
            with httpx.stream("POST", server.url + "/v1/completions", json={**LONG, "stream": True},
                              headers=server.headers(), timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        first_chunk.set()
                        time.sleep(0.01)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    def queued():  # waits for the slot: the one queued request allowed
        try:
            httpx.post(server.url + "/v1/completions", json=LONG, headers=server.headers(), timeout=60)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=running, daemon=True), threading.Thread(target=queued, daemon=True)]
    threads[0].start()
    assert first_chunk.wait(30)
    threads[1].start()
    deadline = time.monotonic() + 20
    while http.get("/debug/engine").json()["num_waiting"] < 1:  # the queued one is in the engine
        if not threads[0].is_alive():
            for t in threads:
                t.join(60)
            return None  # the stream ended before the second request was queued
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return threads


def test_full_queue_is_503_with_retry_after(http, server):
    errors: list = []
    for _ in range(3):
        if (threads := _fill_the_queue(http, server, errors)) is not None:
            break
    assert threads is not None, "the running stream ended before a second request was queued, 3 times"
    r = http.post("/v1/completions", json={"prompt": "over", "max_tokens": 2})
    e = assert_error(r, 503, "server_overloaded")
    assert "queue is full" in e["message"]
    assert int(r.headers["retry-after"]) >= 1
    for t in threads:
        t.join(60)
    assert not errors
    assert http.post("/v1/completions", json={"prompt": "again", "max_tokens": 2}).status_code == 200


def test_sigterm_lets_the_stream_finish_then_exits_cleanly(http, server):  # last: stops the server
    body = {"prompt": "hello", "max_tokens": 300, "ignore_eos": True, "stream": True}
    events = []
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=server.headers(),
                      timeout=60) as r:
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: {"):
                events.append(line)
                break
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        with pytest.raises(httpx.ConnectError):  # not accepting any more
            httpx.get(server.url + "/health", timeout=5)
        events += [line for line in lines if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert server.proc.wait(60) == 0
    assert "Traceback" not in server.log()
