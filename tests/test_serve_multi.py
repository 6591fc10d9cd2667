"""Several language models behind one server (``forwardpass serve A B ...``), on tiny random-weight models:

* with ``--models-max 1``, 30 requests alternating between two models all succeed, each equal to that model's
  single-model server's greedy output; the log shows the loads and unloads;
* while one model loads, a stream from another keeps flowing: no gap in it longer than the load's duration
  / 10 (both measured here, so the check is a ratio, whatever the machine's speed);
* a model over ``--models-memory`` is a 503 naming the budget, and the others keep serving;
* ``/v1/models`` (kind, loaded, memory), ``/metrics`` (a ``model`` label), 404 / 400 routing errors, and the
  dashboard of a model picked by ``?model=``.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from forwardpass.loader.gguf_packages import packaged_gguf
from tests.helpers.multi_server import multi_server, start_all, stop_all
from tests.helpers.server import ServerProcess, make_served_model

pytest.importorskip("transformers")
GGUF = packaged_gguf("smollm2")  # the over-budget model: the packaged SmolLM2 file (installed or fetched)
if GGUF is None:
    pytest.skip("the SmolLM2 GGUF file is not here (forwardpass generate Hi --model smollm2 fetches it)",
                allow_module_level=True)
KV = ("--kv-cache-memory", str(8 << 20))  # 8 MiB per model: the tiny models' estimates stay ~0.01 GB
PROMPTS = [f"request number {i}" for i in range(30)]


@pytest.fixture(scope="module")
def models(checkpoint_factory, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("multi")
    return {"lm-a": make_served_model(root / "lm-a", checkpoint_factory("qwen3")),
            "lm-b": make_served_model(root / "lm-b", checkpoint_factory("llama"))}


def complete(http: httpx.Client, model: str, prompt: str) -> str:
    r = http.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 8,
                                           "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


@pytest.fixture(scope="module")
def servers(models):
    """The two single-model servers (the references), the pool server with room for one model, and one with
    a memory budget that lm-a and lm-b fit (~0.01 GB each) and SmolLM2 (~0.11 GB) never does: started
    together."""
    singles = {name: ServerProcess(path, *KV) for name, path in models.items()}
    pooled = multi_server([str(models["lm-a"]), str(models["lm-b"])], "--models-max", "1", *KV)
    budget = multi_server([str(models["lm-a"]), str(models["lm-b"]), str(GGUF)], "--models-memory", "0.05",
                          *KV)
    every = [*singles.values(), pooled, budget]
    start_all(every)
    yield singles, pooled, budget
    stop_all(every)


@pytest.fixture(scope="module")
def budget_server(servers):
    return servers[2]


def test_models_max_1_alternating_requests_equal_single_model_servers(servers):
    singles, pooled, _ = servers
    names = ["lm-a" if i % 2 == 0 else "lm-b" for i in range(len(PROMPTS))]
    with httpx.Client(timeout=120) as ref:
        want = [complete(ref.__class__(base_url=singles[n].url, timeout=120), "test-model", p)
                for n, p in zip(names, PROMPTS, strict=True)]
    assert want[0] != want[1]  # the two models answer differently: a mix-up would show
    with httpx.Client(base_url=pooled.url, timeout=120) as http, ThreadPoolExecutor(15) as workers:
        got = list(workers.map(lambda np: complete(http, *np), zip(names, PROMPTS, strict=True)))
        assert got == want  # all 30 served, none lost, each by its own model
        listed = {m["id"]: m for m in http.get("/v1/models").json()["data"]}
    assert sum(m["loaded"] for m in listed.values()) == 1
    assert listed["lm-b"]["loads"] >= 1 and listed["lm-a"]["unloads"] >= 1
    log = pooled.log()
    assert "loaded model lm-b" in log and "unloaded model lm-a" in log
    assert "unloading model lm-a (least recently used; lm-b needs room under --models-max 1)" in log


def test_a_model_over_the_memory_budget_is_refused_and_the_others_keep_serving(budget_server):
    with httpx.Client(base_url=budget_server.url, timeout=120) as http:
        r = http.post("/v1/chat/completions", json={"model": GGUF.stem, "max_tokens": 2,
                                                    "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert "memory budget of 0.05 GB (--models-memory)" in err["message"] and GGUF.stem in err["message"]
        assert err["param"] == "model" and err["code"] == "model_over_budget"
        assert complete(http, "lm-a", "still here") and http.get("/health").status_code == 200
        listed = {m["id"]: m for m in http.get("/v1/models").json()["data"]}
        assert listed[GGUF.stem]["state"] == "unloaded" and listed["lm-a"]["loaded"]
        assert listed["lm-a"]["max_model_len"] == 512 and listed[GGUF.stem]["max_model_len"] is None
        assert listed[GGUF.stem]["memory_bytes"] > 0.05e9 > listed["lm-a"]["memory_bytes"]


def test_a_stream_keeps_flowing_while_another_model_loads(budget_server):
    """Streams from lm-a run back to back while lm-b loads; the longest gap between two chunks of one stream
    during the load is under a tenth of the load's duration."""
    url = budget_server.url
    arrivals: list[list[float]] = []
    stop = threading.Event()

    def stream_forever() -> None:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
        while not stop.is_set():
            times: list[float] = []
            arrivals.append(times)
            for _ in client.completions.create(model="lm-a", prompt="tell me", max_tokens=400, stream=True,
                                               temperature=0, extra_body={"ignore_eos": True}):
                times.append(time.monotonic())

    streamer = threading.Thread(target=stream_forever, daemon=True)
    streamer.start()
    while not arrivals or len(arrivals[0]) < 5:  # streaming before the load starts
        time.sleep(0.02)
    with httpx.Client(base_url=url, timeout=120) as http:
        t0 = time.monotonic()
        assert complete(http, "lm-b", "load me")  # waits for lm-b's load, then is served
        t1 = time.monotonic()
        load_s = {m["id"]: m for m in http.get("/v1/models").json()["data"]}["lm-b"]["load_seconds"]
    stop.set()
    streamer.join(120)
    gaps = [b - a for times in arrivals for a, b in zip(times, times[1:], strict=False)
            if t0 <= a and b <= t1]
    assert load_s is not None and load_s <= t1 - t0
    print(f"lm-b loaded in {load_s:.2f} s; {len(gaps)} chunk gaps of lm-a's streams meanwhile, the longest "
          f"{max(gaps, default=0) * 1000:.0f} ms (ratio {max(gaps, default=0) / load_s:.3f}, limit 0.1)")
    assert len(gaps) >= 20, f"too few chunks during the load ({len(gaps)} gaps in {load_s:.1f} s)"
    assert max(gaps) < load_s / 10, f"a {max(gaps):.3f} s gap while lm-b loaded for {load_s:.2f} s"


def test_models_metrics_routing_errors_and_dashboard(budget_server):
    with httpx.Client(base_url=budget_server.url, timeout=120) as http:
        complete(http, "lm-a", "count me")
        listed = http.get("/v1/models").json()["data"]
        assert [(m["id"], m["kind"]) for m in listed] == [("lm-a", "generate"), ("lm-b", "generate"),
                                                         (GGUF.stem, "generate")]
        metrics = http.get("/metrics").text
        assert 'forwardpass:model_loaded{model="lm-a"} 1.0' in metrics
        assert 'forwardpass:model_loads_total{model="lm-a"} 1.0' in metrics
        assert f'forwardpass:model_loaded{{model="{GGUF.stem}"}} 0.0' in metrics
        assert 'forwardpass:generation_tokens_total{model="lm-a",model_name="lm-a"}' in metrics
        r = http.post("/v1/completions", json={"model": "gpt-4", "prompt": "x"})
        assert r.status_code == 404 and "serves: lm-a, lm-b, " in r.json()["error"]["message"]
        r = http.post("/v1/embeddings", json={"model": "lm-a", "input": "x"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "model_wrong_kind"
        assert "needs a model of kind embed" in r.json()["error"]["message"]
        state = http.get("/dashboard/state", params={"model": "lm-a"}).json()
        assert state["model"] == "lm-a"
        assert "model-select" in http.get("/dashboard").text
        assert http.get("/").status_code == 200  # the chat page: static, served without loading a model
        bad = http.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
        assert bad.status_code == 400 and json.loads(bad.text)["error"]


def test_a_model_whose_engine_is_killed_is_loaded_again(budget_server):
    """SIGKILL one model's engine process: /health says which model cannot serve, and its next request loads
    it again and is served; the other model is untouched."""
    import psutil

    with httpx.Client(base_url=budget_server.url, timeout=120) as http:
        complete(http, "lm-a", "before")
        complete(http, "lm-b", "before")
        engines = [p for p in psutil.Process(budget_server.proc.pid).children()
                   if "spawn_main" in " ".join(p.cmdline())]
        assert len(engines) == 2  # lm-a's and lm-b's
        loads = {m["id"]: m["loads"] for m in http.get("/v1/models").json()["data"]}
        victim = engines[0]
        victim.kill()
        victim.wait(10)
        deadline = time.monotonic() + 10
        while http.get("/health").status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.1)
        health = http.get("/health")
        assert health.status_code == 503 and "cannot serve" in health.json()["error"]["message"]
        assert complete(http, "lm-a", "after") and complete(http, "lm-b", "after")
        after = {m["id"]: m["loads"] for m in http.get("/v1/models").json()["data"]}
        assert sum(after[n] - loads[n] for n in ("lm-a", "lm-b")) == 1  # the killed one only
        assert http.get("/health").status_code == 200
    assert "its engine is gone" in budget_server.log()
