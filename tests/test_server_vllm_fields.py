"""vLLM's request fields and serve flags that vLLM's own server tests use (issue 43, second round), against
the embedded model: ``--root-path``, ``--max-logprobs -1`` (whole-vocabulary logprobs), ``logprob_token_ids``,
``truncation_side``, echo of token-id prompts with their special tokens, ``--enable-force-include-usage``,
``--return-tokens-as-token-ids``, ``thinking_token_budget``; in the Responses API ``top_logprobs``, sampling
extras, ``background`` (and cancel), namespaced tools, ``enable_response_messages`` and a forced call cut
short by ``max_output_tokens`` (status incomplete).

Oracles: a whole-vocabulary logprobs list sums to probability 1 and gives the pinned tokens' values; the
server's own ``/tokenize`` and ``/detokenize``; usage arithmetic; the chat route for the same sampling.
"""

from __future__ import annotations

import json
import math
import time

import httpx
import pytest

from forwardpass.assets import default_llm_path
from forwardpass.errors import ValidationError
from forwardpass.server.request_fields import logprobs_ask, truncated
from tests.helpers.server import ServerProcess

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.timeout(300)
MODEL, KEY, ROOT = "test-model", "sk-test", "/llm"
VOCAB = json.loads((default_llm_path() / "config.json").read_text())["vocab_size"]
MSG = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def server():
    flags = ("--num-kv-blocks", "256", "--root-path", ROOT, "--max-logprobs", "-1",
             "--enable-force-include-usage", "--return-tokens-as-token-ids", "--reasoning-parser", "qwen3")
    with ServerProcess(default_llm_path(), *flags, api_key=KEY, startup_timeout=240) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120, headers={"Authorization": f"Bearer {KEY}"}) as c:
        yield c


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=240)


def test_logprobs_ask_and_truncation_rules():
    assert logprobs_ask(None, "logprobs", 20, VOCAB).engine is None
    assert logprobs_ask(5, "logprobs", 20, VOCAB) == logprobs_ask(5, "logprobs", -1, VOCAB)
    whole = logprobs_ask(-1, "logprobs", -1, VOCAB)
    assert (whole.engine, whole.shown) == (-1, VOCAB)  # the engine's -1: every token
    assert logprobs_ask(50, "top_logprobs", 100, VOCAB).engine == -1  # past the engine's list: all, 50 shown
    assert logprobs_ask(3, "logprobs", 20, VOCAB, pinned=[7]).engine == 0  # pinned replace the top k
    for k, limit in ((-1, 20), (21, 20), (VOCAB + 1, -1)):
        with pytest.raises(ValidationError) as e:
            logprobs_ask(k, "top_logprobs", limit, VOCAB)
        assert e.value.param == "top_logprobs"
    ids = list(range(8))
    assert truncated(ids, 3, "right", 99) == [0, 1, 2] and truncated(ids, 3, None, 99) == [5, 6, 7]
    assert truncated(ids, -1, "left", 4) == [4, 5, 6, 7] and truncated(ids, None, "right", 4) == ids


def test_root_path_and_key(server):
    for path in ("/v1/models", ROOT + "/v1/models"):
        assert httpx.get(server.url + path, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
        assert httpx.get(server.url + path, headers={"Authorization": "Bearer wrong"}).status_code == 401
    other = httpx.get(server.url + "/llmx/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    assert other.status_code == 404


def test_whole_vocabulary_logprobs_and_pinned_tokens(http):
    body = {"model": MODEL, "messages": MSG, "max_tokens": 1, "temperature": 0.0, "logprobs": "true",
            "top_logprobs": -1}
    whole = http.post("/v1/chat/completions", json=body).json()["choices"][0]["logprobs"]["content"][0]
    tops = whole["top_logprobs"]
    assert len(tops) == VOCAB and len({t["token"] for t in tops}) == VOCAB
    assert math.isclose(sum(math.exp(t["logprob"]) for t in tops), 1.0, abs_tol=1e-3)  # a distribution
    by_id = {int(t["token"].removeprefix("token_id:")): t["logprob"] for t in tops}  # ids: the server's flag
    pinned = [5, 3000, VOCAB - 1]
    r = http.post("/v1/chat/completions", json={**body, "top_logprobs": 2, "logprob_token_ids": pinned})
    r = r.json()
    entry = r["choices"][0]["logprobs"]["content"][0]
    chosen = int(entry["token"].removeprefix("token_id:"))
    got = {int(t["token"].removeprefix("token_id:")): t["logprob"] for t in entry["top_logprobs"]}
    assert set(got) == {*pinned, chosen}  # the pinned tokens and the sampled one, not the top 2
    for t, lp in got.items():
        assert math.isclose(lp, by_id[t], abs_tol=1e-4)
    # completions: the chosen token is the first key of each top_logprobs entry
    c = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 1, "logprobs": 5,
                                           "logprob_token_ids": [3000], "allowed_token_ids": [42]}).json()
    lp = c["choices"][0]["logprobs"]
    assert lp["tokens"] == ["token_id:42"] and list(lp["top_logprobs"][0]) == ["token_id:42", "token_id:3000"]
    for extra, param in (({"logprob_token_ids": [VOCAB]}, "logprob_token_ids"),
                         ({"logprob_token_ids": [1], "logprobs": None}, "logprob_token_ids")):
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 1, "logprobs": 1,
                                               **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    # prompt logprobs over the whole vocabulary: every position after the first lists all tokens
    p = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi there", "max_tokens": 1,
                                           "prompt_logprobs": -1}).json()["choices"][0]["prompt_logprobs"]
    assert p[0] is None and all(len(d) == VOCAB for d in p[1:])


def test_truncation_side_and_echo_of_token_ids(http):
    base = {"model": MODEL, "prompt": list(range(8)), "max_tokens": 1, "temperature": 0.0,
            "return_token_ids": True, "truncate_prompt_tokens": 4}
    for side, kept in (("right", [0, 1, 2, 3]), ("left", [4, 5, 6, 7]), (None, [4, 5, 6, 7])):
        r = http.post("/v1/completions", json={**base, **({"truncation_side": side} if side else {})}).json()
        assert r["choices"][0]["prompt_token_ids"] == kept, (side, r)
    bad = http.post("/v1/completions", json={**base, "truncation_side": "middle"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "truncation_side"
    ids = [0, 1, 2, 5, 6]  # special tokens first: echoed as the tokenizer spells them, as vLLM does
    text = http.post("/detokenize", json={"tokens": ids}).json()["prompt"]
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": 2, "echo": True,
                                           "logprobs": 0}).json()["choices"][0]
    assert text.startswith("<|") and r["text"].startswith(text)


def test_forced_usage_and_thinking_token_budget(http):
    body = {"model": MODEL, "messages": MSG, "max_tokens": 5, "min_tokens": 5, "stream": True}
    lines = [ln[6:] for ln in http.post("/v1/chat/completions", json=body).text.splitlines()
             if ln.startswith("data: ") and ln != "data: [DONE]"]
    chunks = [json.loads(ln) for ln in lines]
    assert chunks and all(c["usage"] is not None for c in chunks)  # no stream_options asked
    done = [c["usage"]["completion_tokens"] for c in chunks]
    assert done == sorted(done) and done[-1] == 5
    assert all(c["usage"]["total_tokens"] == c["usage"]["prompt_tokens"] + c["usage"]["completion_tokens"]
               for c in chunks)
    greedy = {"model": MODEL, "messages": MSG, "max_tokens": 12, "temperature": 0.0}
    a = http.post("/v1/chat/completions", json={**greedy, "thinking_token_budget": 0}).json()
    b = http.post("/v1/chat/completions", json={**greedy, "max_reasoning_tokens": 0}).json()
    assert a["choices"][0]["message"] == b["choices"][0]["message"]  # the same budget under vLLM's name
    both = http.post("/v1/chat/completions", json={**greedy, "thinking_token_budget": 1,
                                                   "max_reasoning_tokens": 1})
    assert both.status_code == 400 and "thinking_token_budget" in both.json()["error"]["message"]


def test_responses_logprobs_extras_and_raw_messages(client, http):
    r = client.responses.create(model=MODEL, input="Say hello.", top_logprobs=3, max_output_tokens=8,
                                include=["message.output_text.logprobs"], reasoning={"effort": "none"},
                                extra_body={"enable_response_messages": True, "top_k": 40,
                                            "repetition_penalty": 1.2, "seed": 7, "temperature": 0.8})
    part = r.output[-1].content[0]
    assert len(part.logprobs) == r.usage.output_tokens  # one entry per generated token
    assert all(lp.logprob <= 0 and len(lp.top_logprobs) == 3 for lp in part.logprobs)
    prompt = http.post("/tokenize", json={"messages": [{"role": "user", "content": "Say hello."}]}).json()
    raw_in, raw_out = r.model_extra["input_messages"][0], r.model_extra["output_messages"][0]
    assert raw_in["tokens"] == prompt["tokens"] and raw_in["type"] == "raw_message_tokens"
    assert len(raw_out["tokens"]) == r.usage.output_tokens and part.text in raw_out["message"]
    # the same sampling through the chat route: the same text (the extras reach the sampler)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hello."}],
                                          max_tokens=8, temperature=0.8, seed=7, reasoning_effort="none",
                                          extra_body={"top_k": 40, "repetition_penalty": 1.2})
    assert chat.choices[0].message.content == part.text
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=MODEL, input="x", reasoning={"effort": "bogus"})


def test_responses_background_and_cancel(client):
    r = client.responses.create(model=MODEL, input="Hello!", background=True, max_output_tokens=4)
    assert r.status == "queued"
    for _ in range(200):
        r = client.responses.retrieve(r.id)
        if r.status != "queued":
            break
        time.sleep(0.2)
    assert r.status in ("completed", "incomplete") and r.output
    with pytest.raises(openai.BadRequestError, match="Cannot cancel a synchronous response"):
        client.responses.cancel(r.id)
    with pytest.raises(openai.BadRequestError, match="background can only be used when `store` is true"):
        client.responses.create(model=MODEL, input="x", background=True, store=False)
    long = client.responses.create(model=MODEL, input="Tell a story.", background=True,
                                   extra_body={"min_p": 0.0}, max_output_tokens=900)
    assert client.responses.cancel(long.id).status == "cancelled"
    time.sleep(1.0)
    assert client.responses.retrieve(long.id).status == "cancelled"  # the finished work does not overwrite it
    with pytest.raises(openai.NotFoundError, match="Response with id .* not found"):
        client.responses.retrieve("resp_unknown")


def test_responses_namespaced_tools_and_a_short_forced_call(client):
    tools = [{"type": "namespace", "name": "desk", "description": "desktop tools", "tools": [
        {"type": "function", "name": "app_state", "parameters": {
            "type": "object", "properties": {"app": {"type": "string"}}, "required": ["app"]}}]}]
    r = client.responses.create(model=MODEL, input="Inspect Chrome.", tools=tools, tool_choice="required",
                                max_output_tokens=200,
                                extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    calls = [o for o in r.output if o.type == "function_call"]
    assert r.status == "completed" and calls
    assert all(c.name == "app_state" and c.namespace == "desk" and "app" in json.loads(c.arguments)
               for c in calls)
    # no call fits 3 tokens: an incomplete response with no call (OpenAI's and vLLM's answer), not a 400
    short = client.responses.create(model=MODEL, input="Inspect Chrome.", tools=tools, tool_choice="required",
                                    max_output_tokens=3)
    assert short.status == "incomplete" and short.incomplete_details.reason == "max_output_tokens"
    assert short.output and all(o.type != "function_call" for o in short.output)
