"""Issue 21 against the real server: one client must never hurt another.

One test (or more) per numbered break of the issue, named after it, then the noisy-neighbour test and
the RSS check. Two servers: ``server`` (API key from FORWARDPASS_API_KEY, a chat template with
hostile branches chosen by the message text, a short read timeout) and ``faulty`` (an engine that can
be made slow or stuck, short watchdog / request / shutdown timeouts; its last test stops it).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.helpers.server import (
    SLOW_STEP_SEED,
    STUCK_ENGINE_SEED,
    STUCK_S,
    ServerProcess,
    assert_trickled_headers_time_out,
    make_served_model,
)
from tests.test_server import assert_error

pytestmark = pytest.mark.timeout(240)
KEY = "sk-hardening"
HOSTILE_TEMPLATE = (
    "{%- set c = messages[-1]['content'] -%}"
    "{%- if c == 'LOOP' -%}{%- for i in range(100000) -%}{%- for j in range(100000) -%}{%- endfor -%}{%- "
    "endfor -%}{%- elif c == 'WIDE' -%}{{ '{:>999999999}'.format('x') }}"
    "{%- elif c == 'INDENT' -%}{{ messages | tojson(indent=100000000) }}"
    "{%- elif c == 'BIG' -%}{{ 'x' * 1000000000 }}"
    "{%- else -%}{%- for m in messages -%}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{%- "
    "endfor -%}{%- if add_generation_prompt -%}<|im_start|>assistant\n{%- endif -%}{%- endif -%}"
)


@pytest.fixture(scope="module")
def model_dir(checkpoint_factory, tmp_path_factory):
    model = make_served_model(tmp_path_factory.mktemp("hardening"), checkpoint_factory("qwen3"))
    (model / "chat_template.jinja").write_text(HOSTILE_TEMPLATE)
    return model


@pytest.fixture(scope="module")
def server(model_dir):
    with ServerProcess(model_dir, "--num-kv-blocks", "256", "--max-request-bytes", str(3 << 20),
                       "--read-timeout", "2", "--chat-template-timeout", "0.5",
                       "--max-stats-records", "500",  # bounded, and full after the RSS test's warm-up
                       "--max-request-tokens", "20000",
                       env={"FORWARDPASS_API_KEY": KEY}) as srv:
        srv.api_key = KEY
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60, headers=server.headers()) as c:
        yield c


def free_blocks_all_back(http: httpx.Client, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while True:
        info = http.get("/debug/engine").json()
        if info["num_free_blocks"] == info["num_blocks"] and info["num_requests"] == 0:
            assert info["invariants_ok"], info
            return
        assert time.monotonic() < deadline, info
        time.sleep(0.05)


def sse_lines(r: httpx.Response) -> list[str]:
    return [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]


# ----- the hostile inputs of the issue, each must be a 4xx ------------------------------------------
def _raw(body: bytes, **headers: str) -> dict:
    return {"content": body, "headers": {"content-type": "application/json", **headers}}


HOSTILE: list[tuple[str, str, dict]] = [
    ("break1_top_k_2^63", "/v1/completions", {"json": {"prompt": "hi", "temperature": 1, "top_k": 2**63}}),
    ("break1_top_k_10^30", "/v1/completions", {"json": {"prompt": "hi", "temperature": 1, "top_k": 10**30}}),
    ("break1_top_k_over_vocab", "/v1/completions",
     {"json": {"prompt": "hi", "temperature": 1, "top_k": 100000}}),
    ("break1_seed_2^64", "/v1/completions", {"json": {"prompt": "hi", "seed": 2**64}}),
    ("break2_loop", "/v1/chat/completions", {"json": {"messages": [{"role": "user", "content": "LOOP"}]}}),
    ("break2_wide", "/v1/chat/completions", {"json": {"messages": [{"role": "user", "content": "WIDE"}]}}),
    ("break2_indent", "/v1/chat/completions",
     {"json": {"messages": [{"role": "user", "content": "INDENT"}]}}),
    ("break2_big", "/v1/chat/completions", {"json": {"messages": [{"role": "user", "content": "BIG"}]}}),
    ("break5_n_x_prompts", "/v1/completions", {"json": {"prompt": ["a"] * 32, "n": 16}}),
    ("break6_surrogate_chat", "/v1/chat/completions",
     _raw(b'{"messages": [{"role": "user", "content": "\\udc80"}]}')),
    ("break6_surrogate_tokenize", "/tokenize", _raw(b'{"prompt": "a\\udc80b"}')),
    ("break10_string_max_tokens", "/v1/completions", {"json": {"prompt": "hi", "max_tokens": "16"}}),
    ("break10_logprobs_true", "/v1/completions", {"json": {"prompt": "hi", "logprobs": True}}),
    ("break10_prompt_bool", "/v1/completions", {"json": {"prompt": [True]}}),
    # model "" means the served model (as vLLM, issue 43); a model that is not a string is loose input
    ("break10_model_not_a_string", "/v1/completions", {"json": {"prompt": "hi", "model": 0}}),
    ("break10_utf16_body", "/v1/completions", _raw(json.dumps({"prompt": "hi"}).encode("utf-16"))),
    ("break10_utf16le_body", "/v1/completions", _raw(json.dumps({"prompt": "hi"}).encode("utf-16-le"))),
    ("break10_float_n", "/v1/completions", {"json": {"prompt": "hi", "n": 2.0}}),
]


def _send(http: httpx.Client, path: str, kwargs: dict) -> httpx.Response:
    return http.post(path, **kwargs)


# ----- break 1 ---------------------------------------------------------------------------------------
def test_break1_huge_top_k_is_400_and_other_streams_go_on(http):
    with http.stream("POST", "/v1/completions", json={"prompt": "Once", "max_tokens": 30, "temperature": 0,
                                                      "ignore_eos": True, "stream": True}) as stream:
        for name in ("break1_top_k_2^63", "break1_top_k_10^30", "break1_top_k_over_vocab"):
            _, path, kwargs = next(h for h in HOSTILE if h[0] == name)
            assert_error(_send(http, path, kwargs), 400, param="top_k")
        events = sse_lines(stream)
    assert events[-1] == "[DONE]" and all("error" not in e for e in events)
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
    free_blocks_all_back(http)


# ----- break 2 ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("which", ["break2_loop", "break2_wide", "break2_indent", "break2_big"])
def test_break2_chat_template_limits_are_400_and_health_stays_up(http, server, which):
    _, path, kwargs = next(h for h in HOSTILE if h[0] == which)
    stop = threading.Event()
    worst = [0.0]

    def poll():
        while not stop.is_set():
            t = time.monotonic()
            assert httpx.get(server.url + "/health", timeout=10).status_code == 200
            worst[0] = max(worst[0], time.monotonic() - t)
            time.sleep(0.02)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    t0 = time.monotonic()
    e = assert_error(_send(http, path, kwargs), 400)
    stop.set()
    poller.join(10)
    assert "limit" in e["message"], e
    assert time.monotonic() - t0 < 5
    assert worst[0] < 1.0, worst


# ----- break 3 ---------------------------------------------------------------------------------------
def test_break3_models_list_shows_no_paths(http, model_dir):
    data = http.get("/v1/models").json()["data"]
    assert data and all(str(model_dir) not in json.dumps(m) and "/" not in m["root"] for m in data), data
    # the execution plan lists the FORWARDPASS_* variables in force, a secret's value hidden
    assert KEY not in json.dumps(data)
    assert data[0]["forwardpass"]["execution_plan"]["env"]["FORWARDPASS_API_KEY"] == "***"


def test_break3_symlink_out_of_the_model_dir_is_refused(model_dir, tmp_path):
    from forwardpass.errors import UnsafeModelFileError
    from forwardpass.loader.tokenizer import Tokenizer

    secret = tmp_path / "secret.txt"
    secret.write_text("TOP SECRET {{ 1 }}")
    evil = tmp_path / "evil"
    evil.mkdir()
    for f in model_dir.iterdir():
        (evil / f.name).write_bytes(f.read_bytes())
    (evil / "chat_template.jinja").unlink()
    (evil / "chat_template.jinja").symlink_to(secret)
    with pytest.raises(UnsafeModelFileError, match="outside the model directory"):
        Tokenizer.from_dir(evil)
    (evil / "chat_template.jinja").unlink()
    (evil / "config.json").unlink()
    (evil / "config.json").symlink_to(model_dir / "config.json")  # a real config, but outside
    from forwardpass.models.model_spec import load_model_spec

    with pytest.raises(UnsafeModelFileError):
        load_model_spec(evil)


# ----- break 4 ---------------------------------------------------------------------------------------
def test_break4_tokenizing_a_big_prompt_does_not_block_health(http, server):
    text = "hello world, this is a long prompt " * 60000  # ~2 MB: seconds of tokenization
    worst, done = [0.0], threading.Event()
    result: dict = {}

    def tokenize():
        result["r"] = httpx.post(server.url + "/tokenize", json={"prompt": text}, headers=server.headers(),
                                 timeout=120)
        done.set()

    t = threading.Thread(target=tokenize, daemon=True)
    started = time.monotonic()
    t.start()
    time.sleep(0.3)
    probes = 0
    while not done.is_set():
        t0 = time.monotonic()
        assert httpx.get(server.url + "/health", timeout=30).status_code == 200
        worst[0] = max(worst[0], time.monotonic() - t0)
        probes += 1
        time.sleep(0.05)
    t.join()
    tokenize_s = time.monotonic() - started
    assert result["r"].status_code == 200 and result["r"].json()["count"] > 100000
    # a blocked event loop holds /health for the whole tokenization; a free one answers in a small share of
    # it (a ratio, not a wall-clock bound: on a loaded 2-core host both stretch together)
    assert probes >= 3, f"tokenizing took {tokenize_s:.2f}s: too short to probe"
    assert worst[0] < max(1.0, 0.3 * tokenize_s), f"/health took {worst[0]:.2f}s of {tokenize_s:.2f}s"
    # the same prompt for generation is refused before tokenization (far beyond the context window)
    t0 = time.monotonic()
    assert_error(http.post("/v1/completions", json={"prompt": text}), 400, param="prompt")
    assert time.monotonic() - t0 < max(2.0, 0.3 * tokenize_s)


# ----- break 5 ---------------------------------------------------------------------------------------
def test_break5_n_times_prompts_counts_fully(http):
    _, path, kwargs = next(h for h in HOSTILE if h[0] == "break5_n_x_prompts")
    e = assert_error(_send(http, path, kwargs), 400, param="n")
    assert "512" in e["message"]
    r = http.post("/v1/completions", json={"prompt": ["a"] * 8, "n": 8, "max_tokens": 1})
    assert r.status_code == 200 and len(r.json()["choices"]) == 64


# ----- break 6 ---------------------------------------------------------------------------------------
def test_break6_lone_surrogate_is_400_and_keep_alive_survives(server):
    with httpx.Client(base_url=server.url, timeout=30, headers=server.headers()) as c:
        for name in ("break6_surrogate_chat", "break6_surrogate_tokenize"):
            _, path, kwargs = next(h for h in HOSTILE if h[0] == name)
            e = assert_error(_send(c, path, kwargs), 400)
            assert "surrogate" in e["message"]
            # the same connection serves the next request
            assert c.post("/tokenize", json={"prompt": "fine"}).status_code == 200
    assert "Traceback" not in server.log()


# ----- break 7 ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("change,param", [
    ({"vocab_size": 2000000}, "vocab_size"),
    ({"vocab_size": 1024}, "vocab_size"),  # within limits, but not the checkpoint's (WeightShapeError)
    ({"hidden_size": 65536}, "hidden_size"),
    ({"hidden_size": "64"}, "hidden_size"),
    ({"hidden_size": 64.0}, "hidden_size"),
    ({"num_attention_heads": 0}, "num_attention_heads"),
    ({"max_position_embeddings": -5}, "max_position_embeddings"),
    ({"num_hidden_layers": 5}, "num_hidden_layers"),  # MissingTensorError, before allocation
    ({"rms_norm_eps": "x"}, "rms_norm_eps"),
])
def test_break7_config_sizes_are_validated_before_allocation(model_dir, tmp_path, change, param):
    from forwardpass.errors import ConfigError, MissingTensorError, WeightShapeError
    from forwardpass.models.loading import load_model

    bad = tmp_path / "bad"
    bad.mkdir()
    for f in model_dir.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((model_dir / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, **change}))
    with pytest.raises((ConfigError, WeightShapeError, MissingTensorError)) as e:
        load_model(bad)
    assert e.value.param == param, e.value


def test_break7_deeply_nested_config_is_a_clear_error(model_dir, tmp_path):
    from forwardpass.errors import ModelLoadError
    from forwardpass.models.model_spec import load_model_spec

    bad = tmp_path / "deep"
    bad.mkdir()
    (bad / "config.json").write_text('{"a": ' + "[" * 100000 + "]" * 100000 + "}")
    with pytest.raises(ModelLoadError, match="nested too deeply"):
        load_model_spec(bad)


# ----- break 10 --------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", [h[0] for h in HOSTILE if h[0].startswith("break10_")])
def test_break10_loose_input_is_refused(http, name):
    _, path, kwargs = next(h for h in HOSTILE if h[0] == name)
    assert_error(_send(http, path, kwargs), 400)


def test_break10_api_key_from_env_and_bearer_case_insensitive(server):
    assert "sk-hardening" not in " ".join(server.cmd)  # not on the command line (ps)
    for scheme in ("Bearer", "bearer", "BEARER"):
        r = httpx.get(server.url + "/v1/models", headers={"Authorization": f"{scheme} {KEY}"})
        assert r.status_code == 200, scheme
    assert_error(httpx.get(server.url + "/v1/models", headers={"Authorization": "Basic " + KEY}), 401)
    assert_error(httpx.get(server.url + "/v1/models"), 401)


def test_chat_page_loads_without_the_key_and_its_api_calls_need_it(server):
    """The page's HTML, CSS and JS hold no data: they load without a key, then the page asks for it."""
    for path in ("/", "/chat/static/chat.js", "/chat/static/chat.css"):
        assert httpx.get(server.url + path).status_code == 200, path
    assert_error(httpx.get(server.url + "/chat/static/../../v1/models"), 401)  # no way around the key
    assert_error(httpx.post(server.url + "/v1/chat/completions", json={"messages": []}), 401)


def test_break10_half_sent_body_times_out(server):
    body = json.dumps({"prompt": "hi", "max_tokens": 1}).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body[:5])
        t0 = time.monotonic()
        reply = s.recv(4096)
        assert b" 408 " in reply.split(b"\r\n", 1)[0], reply
        assert 1.5 < time.monotonic() - t0 < 8


def test_break10_half_sent_headers_time_out(server):
    """Slowloris: headers trickled in (or never sent) do not hold a connection past --read-timeout."""
    assert_trickled_headers_time_out(server.url, server.port, "/v1/completions")


def test_break5_request_size_budget_in_tokens(http):
    """Bytes are not the only bound: a small body asking for much work is refused by its token count."""
    body = {"prompt": ["hi"] * 8, "n": 8, "max_tokens": 400}  # ~26k tokens of work in ~100 bytes
    r = http.post("/v1/completions", json=body)
    assert_error(r, 400)
    assert r.json()["error"]["param"] == "max_tokens" and "limit" in r.json()["error"]["message"]


# ----- noisy neighbour -------------------------------------------------------------------------------
def test_noisy_neighbour(http, server):
    """8 streams in flight while 50 hostile requests arrive: the 8 finish exactly as alone, every hostile
    request gets a 4xx, /health stays 200 throughout, no block leaked."""
    prompts = [f"Story {i}: once upon a time" for i in range(8)]
    body = {"max_tokens": 24, "temperature": 0, "ignore_eos": True}
    alone = [http.post("/v1/completions", json={**body, "prompt": p}).json()["choices"][0]["text"]
             for p in prompts]

    def stream(p: str) -> str:
        with httpx.stream("POST", server.url + "/v1/completions", headers=server.headers(), timeout=120,
                          json={**body, "prompt": p, "stream": True}) as r:
            events = sse_lines(r)
        assert events[-1] == "[DONE]"
        return "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1] if json.loads(e)["choices"])

    stop, health = threading.Event(), []

    def poll():
        while not stop.is_set():
            health.append(httpx.get(server.url + "/health", timeout=30).status_code)
            time.sleep(0.05)

    hostile = [HOSTILE[i % len(HOSTILE)] for i in range(50)]
    with ThreadPoolExecutor(16) as pool:
        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        streams = [pool.submit(stream, p) for p in prompts]
        time.sleep(0.2)
        codes = list(pool.map(lambda h: _send(http, h[1], h[2]).status_code, hostile))
        texts = [f.result() for f in streams]
        stop.set()
        poller.join(10)
    assert all(400 <= c < 500 for c in codes), dict(zip((h[0] for h in hostile), codes))
    assert texts == alone
    assert health and set(health) == {200}
    free_blocks_all_back(http)


# ----- memory ----------------------------------------------------------------------------------------
def _rss_mb(pid: int) -> float:
    import psutil

    proc = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)]) / 2**20


def _rss_flat(http, server, warmup: int, n: int, bound_mb: float) -> tuple[float, float]:
    async def run(count: int) -> None:
        import asyncio

        async with httpx.AsyncClient(base_url=server.url, headers=server.headers(), timeout=60) as c:
            sem = asyncio.Semaphore(16)

            async def one(i: int) -> None:
                async with sem:
                    r = await c.post("/v1/completions", json={"prompt": f"req {i}", "max_tokens": 1 + i % 2,
                                                              "stream": bool(i % 3 == 0)})
                    assert r.status_code == 200

            await asyncio.gather(*(one(i) for i in range(count)))

    import asyncio

    # A leak grows with every request, so it shows in both halves of the run; the allocator's one-off
    # growth (arenas of new threads, caches filling to their bounds) shows only in the first. So the
    # bound applies to the whole run, and the second half alone must stay within half of it.
    asyncio.run(run(warmup))
    before = _rss_mb(server.proc.pid)
    asyncio.run(run(n // 2))
    middle = _rss_mb(server.proc.pid)
    asyncio.run(run(n - n // 2))
    after = _rss_mb(server.proc.pid)
    print(f"RSS server+engine: {before:.1f} -> {middle:.1f} -> {after:.1f} MB over {n} requests")
    assert after - middle < bound_mb / 2, (before, middle, after)
    assert after - before < 2 * bound_mb, (before, middle, after)
    free_blocks_all_back(http)
    return before, after


def test_rss_flat_over_5000_requests(http, server):
    """Over 5,000 requests after 500 warm-up ones: < 15 MB in the second 2,500 (a leak of 6 kB per request
    would exceed it), < 60 MB in all. (A 1,000-request version flaked: the server was still settling.)"""
    _rss_flat(http, server, warmup=500, n=5000, bound_mb=30)


# ----- breaks 8 and 9: a slow / stuck engine ---------------------------------------------------------
@pytest.fixture(scope="module")
def faulty(checkpoint_factory, tmp_path_factory):
    model = make_served_model(tmp_path_factory.mktemp("faulty"), checkpoint_factory("qwen3"))
    with ServerProcess(model, "--num-kv-blocks", "128", "--engine-factory",
                       "tests.helpers.server:FaultInjectingEngine", "--watchdog-timeout", "2",
                       "--request-timeout", "4", "--shutdown-timeout", "1") as srv:
        yield srv


def test_break8_request_timeout_fails_a_hung_request(faulty):
    with httpx.Client(base_url=faulty.url, timeout=60) as c:
        t0 = time.monotonic()
        with c.stream("POST", "/v1/completions",
                      json={"prompt": "slow", "max_tokens": 200, "seed": SLOW_STEP_SEED,
                                                       "stream": True, "ignore_eos": True}) as r:
            events = sse_lines(r)
        assert 3.5 < time.monotonic() - t0 < 10
        assert events[-1] == "[DONE]"
        err = json.loads(events[-2])["error"]
        assert err["type"] == "timeout_error" and "request timeout" in err["message"], err
        assert c.get("/health").status_code == 200  # a slow engine makes progress: not stalled
        free_blocks_all_back(c)


def test_break8_stuck_engine_makes_health_503_then_recovers(faulty):
    with httpx.Client(base_url=faulty.url, timeout=60) as c:
        results = {}
        t = threading.Thread(target=lambda: results.setdefault("r", c.post(
            "/v1/completions", json={"prompt": "stuck", "max_tokens": 3, "seed": STUCK_ENGINE_SEED})),
                             daemon=True)
        t0 = time.monotonic()
        t.start()
        seen_503 = None
        while time.monotonic() - t0 < STUCK_S - 1:
            r = httpx.get(faulty.url + "/health", timeout=10)
            if r.status_code == 503:
                seen_503 = r.json()["error"]
                break
            time.sleep(0.1)
        assert seen_503 is not None and "no progress" in seen_503["message"], seen_503
        t.join(30)
        assert_error(results["r"], 504, "timeout_error")  # --request-timeout 4 < the 7 s hang
        deadline = time.monotonic() + 20
        while httpx.get(faulty.url + "/health", timeout=10).status_code != 200:  # the engine came back
            assert time.monotonic() < deadline
            time.sleep(0.1)
        free_blocks_all_back(c)


def test_break9_shutdown_ends_streams_with_error_and_done(faulty):  # last: stops the server
    got: dict = {}

    def consume():
        with httpx.stream("POST", faulty.url + "/v1/completions", timeout=60, json={
                "prompt": "slow", "max_tokens": 200, "seed": SLOW_STEP_SEED, "stream": True,
                "ignore_eos": True,
        }) as r:
            got["events"] = sse_lines(r)

    t = threading.Thread(target=consume, daemon=True)
    t.start()
    time.sleep(1.0)  # streaming, one token per 0.3 s; the request timeout (4 s) is not reached
    assert faulty.stop(timeout=30) == 0
    t.join(10)
    events = got["events"]
    assert events[-1] == "[DONE]", events
    err = json.loads(events[-2])["error"]
    assert "shutting down" in err["message"], err
    assert len(events) >= 3  # some tokens first
    assert os.environ.get("FORWARDPASS_API_KEY") is None  # the env var was the server's only
