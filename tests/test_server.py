"""The OpenAI-compatible server, started for real on 127.0.0.1: the official ``openai`` client, the
other endpoints, and one test per error case (status code + OpenAI envelope)."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.helpers.server import FATAL_FAULT_SEED, MID_STREAM_FAULT_SEED, ServerProcess, make_served_model

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.timeout(180)
MODEL = "test-model"
NO_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def server(checkpoint_factory, tmp_path_factory):
    model = make_served_model(tmp_path_factory.mktemp("served"), checkpoint_factory("qwen3"))
    with ServerProcess(model, "--num-kv-blocks", "256", "--engine-factory",
                       "tests.helpers.server:FaultInjectingEngine") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def assert_error(r: httpx.Response, status: int, type_: str | None = None, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["message"]
    if type_:
        assert body["error"]["type"] == type_
    if param:
        assert body["error"]["param"] == param, body
    return body["error"]


def sse_events(r: httpx.Response) -> list:
    events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


# ----- the openai client ----------------------------------------------------------------------------
def test_models_list(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_models_list_reports_the_execution_plan(http, server):
    """Each model entry carries the engine's execution plan (a field OpenAI clients ignore), the one the
    engine logged once at start-up: this plain engine's fp32 weights, on the small-batch kernel
    where it was compiled."""
    import ast

    (entry,) = http.get("/v1/models").json()["data"]
    plan = entry["forwardpass"]["execution_plan"]
    assert (plan["device"], plan["dtype"], plan["lora_slots"]) == ("cpu", "float32", False)
    assert plan["weights"]["dense"] == ("fp32+small-matmul" if plan["small_matmul"] else "fp32")
    fp32 = ("fp32-packed", "fp32+small-matmul") if plan["small_matmul"] else ("fp32",)
    assert plan["weights"]["projection"] in fp32
    assert ("small_matmul" in plan["isa"]) == plan["small_matmul"]  # the kernel's build, where there is one
    logged = [line.split("execution plan: ", 1)[1] for line in server.log_path.read_text().splitlines()
              if "execution plan: " in line]
    assert len(logged) == 1 and ast.literal_eval(logged[0]) == plan, logged


def test_completion(client):
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=7, temperature=0,
                                  extra_body=NO_EOS)
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert len(r.choices) == 1 and r.choices[0].finish_reason == "length" and r.choices[0].index == 0
    assert r.usage.completion_tokens == 7 and r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + 7


def test_completion_batch_of_prompts_and_token_ids(client):
    r = client.completions.create(model=MODEL, prompt=[[5, 6, 7], [8, 9]], max_tokens=3, n=2, temperature=0,
                                  extra_body=NO_EOS)
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == 12
    chunks = list(client.completions.create(model=MODEL, prompt=[[5, 6, 7], [8, 9]], max_tokens=3, n=2,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body=NO_EOS))
    streamed = {i: "" for i in range(4)}
    for c in chunks:
        for ch in c.choices:
            streamed[ch.index] += ch.text
    assert streamed == {c.index: c.text for c in r.choices}
    assert chunks[-1].usage.completion_tokens == 12


def test_chat(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": "Be brief."},
                                                              {"role": "user", "content": "Hello!"}],
                                       max_completion_tokens=6, temperature=0, extra_body=NO_EOS)
    assert r.object == "chat.completion"
    msg = r.choices[0].message
    assert msg.role == "assistant" and isinstance(msg.content, str)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 6


def test_streaming_chat_with_usage_equals_non_streaming(client):
    kw = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 12,
              "temperature": 0, "extra_body": NO_EOS}
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_streaming_completion(client):
    kw = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 10, "temperature": 0,
          "extra_body": NO_EOS}
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_n_2(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], n=2,
                                       max_tokens=8, temperature=1.0, seed=3, extra_body=NO_EOS)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.usage.completion_tokens == 16
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                 n=2, max_tokens=8, temperature=1.0, seed=3, stream=True,
                                                 extra_body=NO_EOS))
    streamed = {0: "", 1: ""}
    for c in chunks:
        for ch in c.choices:
            streamed[ch.index] += ch.delta.content or ""
    assert streamed == {c.index: c.message.content for c in r.choices}


def test_stop_strings(client):
    kw = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 24, "temperature": 0,
          "extra_body": NO_EOS}
    text = client.completions.create(**kw).choices[0].text
    candidates = [text[i:i + 2] for i in range(2, len(text) - 2) if "\ufffd" not in text[i:i + 2]]
    assert candidates, text
    stop = candidates[0]
    r = client.completions.create(**kw, stop=[stop, "never-appears"])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == text[: text.find(stop)]
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kw, stop=stop, stream=True))
    assert streamed == r.choices[0].text


def test_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=5, temperature=0, logprobs=True, top_logprobs=3,
                                       extra_body=NO_EOS)
    content = r.choices[0].logprobs.content
    assert len(content) == 5
    for item in content:
        assert item.logprob <= 0 and len(item.top_logprobs) == 3
        assert item.top_logprobs[0].logprob == pytest.approx(item.logprob)  # greedy picks the best
        assert item.bytes == list(item.token.encode())
    c = client.completions.create(model=MODEL, prompt="Hi", max_tokens=4, temperature=0, logprobs=2,
                                  extra_body=NO_EOS)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    assert all(len(t) <= 2 for t in lp.top_logprobs)


def test_seed_reproducibility(client):
    kw = {"model": MODEL, "prompt": "A seed", "max_tokens": 12, "temperature": 1.0, "top_p": 0.95,
          "extra_body": NO_EOS}
    a = client.completions.create(**kw, seed=1234).choices[0].text
    b = client.completions.create(**kw, seed=1234).choices[0].text
    c = client.completions.create(**kw, seed=99).choices[0].text
    assert a == b
    assert a != c or len(a) == 0


# ----- other endpoints ------------------------------------------------------------------------------
def test_tokenize_detokenize_version_health_metrics(http):
    r = http.post("/tokenize", json={"prompt": "Hello world"}).json()
    assert r["count"] == len(r["tokens"]) > 0 and r["max_model_len"] > 0
    assert http.post("/detokenize", json={"tokens": r["tokens"]}).json()["prompt"] == "Hello world"
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat["count"] > r["count"] - 2
    assert http.get("/version").json()["version"]
    assert http.get("/health").status_code == 200
    text = http.get("/metrics").text
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prompt_tokens_total",
                 "generation_tokens_total", "num_preemptions_total", "time_to_first_token_seconds_bucket",
                 "inter_token_latency_seconds_bucket", "e2e_request_latency_seconds_bucket",
                 "request_queue_time_seconds_bucket"):
        assert f"forwardpass:{name}" in text, name


# ----- errors ---------------------------------------------------------------------------------------
def test_malformed_json_is_400(http):
    r = http.post("/v1/completions", content=b'{"prompt": "x",', headers={"content-type": "application/json"})
    assert "not valid JSON" in assert_error(r, 400, "invalid_request_error")["message"]


def test_schema_error_is_400_not_422(http):
    assert_error(http.post("/v1/completions", json={"prompt": "x", "temperature": "hot"}), 400,
                 "invalid_request_error", "temperature")
    assert_error(http.post("/v1/completions", json={"max_tokens": 3}), 400, param="prompt")
    assert_error(http.post("/v1/chat/completions", json={"messages": "hi"}), 400, param="messages")
    assert_error(http.post("/v1/completions", json={"prompt": "x", "unknown_field": 1}), 400)
    assert_error(http.post("/v1/completions", json=[1, 2]), 400)


def test_out_of_range_value_is_400(http):
    assert_error(http.post("/v1/completions", json={"prompt": "x", "top_p": 0}), 400, param="top_p")
    assert_error(http.post("/v1/completions", json={"prompt": [600]}), 400, param="prompt")  # vocab is 512


def test_unknown_model_is_404(http):
    e = assert_error(http.post("/v1/chat/completions",
                               json={"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}),
                     404, "not_found_error", "model")
    assert e["code"] == "model_not_found"


def test_context_window_is_400_naming_the_length(http):
    e = assert_error(http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 600}), 400)
    assert "maximum context length is 512" in e["message"] and e["code"] == "context_length_exceeded"
    for long in ({"prompt": [5] * 600, "max_tokens": 1}, {"prompt": [5] * 512, "max_tokens": None}):
        e = assert_error(http.post("/v1/completions", json=long), 400)
        assert "maximum context length is 512" in e["message"] and e["code"] == "context_length_exceeded"


def test_caps_on_n_logprobs_and_stop(http):
    assert_error(http.post("/v1/completions", json={"prompt": "x", "n": 17}), 400, param="n")
    assert_error(http.post("/v1/completions", json={"prompt": "x", "logprobs": 21}), 400, param="logprobs")
    msgs = [{"role": "user", "content": "x"}]
    assert_error(http.post("/v1/chat/completions",
                           json={"messages": msgs, "logprobs": True, "top_logprobs": 50}),
                 400, param="top_logprobs")
    assert_error(http.post("/v1/completions", json={"prompt": "x", "stop": [str(i) for i in range(9)]}),
                 400, param="stop")
    assert_error(http.post("/v1/completions", json={"prompt": "x", "stop": "s" * 300}), 400)


def test_request_supplied_chat_template_is_refused(http):
    body = {"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ messages }}"}
    assert "chat template" in assert_error(http.post("/v1/chat/completions", json=body), 400)["message"]


def test_unknown_route_and_method_use_the_envelope(http):
    assert_error(http.get("/v1/nothing"), 404)
    assert_error(http.get("/v1/completions"), 405)


def test_failure_mid_stream_is_an_sse_error_then_done(http, server):
    body = {"prompt": "hello", "max_tokens": 50, "stream": True, "seed": MID_STREAM_FAULT_SEED, **NO_EOS}
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        events = sse_events(r)
    assert "error" in events[-1] and "injected step fault" in events[-1]["error"]["message"]
    assert any("choices" in e for e in events[:-1])  # it failed in the middle, after some tokens
    info = http.get("/debug/engine").json()
    assert info["invariants_ok"] and info["num_free_blocks"] == info["num_blocks"]
    assert http.post("/v1/completions", json={"prompt": "ok", "max_tokens": 2}).status_code == 200


def test_dead_engine_makes_health_503(http):  # last: it kills this module's engine
    r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 5, "seed": FATAL_FAULT_SEED})
    assert r.status_code >= 500
    assert_error(http.get("/health"), 503)
    assert_error(http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}), 503)
