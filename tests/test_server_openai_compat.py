"""The OpenAI surface vLLM's own server tests exercise (issue 43), one test per gap, against a real server on
a tiny random Qwen3 checkpoint with the test tokenizer (its chat template renders tools): usage in streamed
chunks (also for a prompt prefilled in many chunks), ``logprobs: 0`` with ``echo``, ``/tokenize`` for chat
requests with tools and its ``token_strs``, ``/detokenize``, ``model: ""``, vLLM's extra fields (honoured,
accepted or refused by name), out-of-vocabulary prompt ids, ``/invocations`` and 64-bit seeds.

Oracles are the server's own other routes (``/tokenize`` counts, greedy decoding) and the request's own
arithmetic (usage totals, token counts), never constants copied from a run.
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.helpers.server import ServerProcess, make_served_model

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.timeout(240)
MODEL = "test-model"
MSG = [{"role": "user", "content": "Hi there"}]
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "current weather",
                                         "parameters": {"type": "object", "properties": {
                                             "city": {"type": "string"}}}}}
GREEDY = {"temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(checkpoint_factory, tmp_path_factory):
    model = make_served_model(tmp_path_factory.mktemp("compat"), checkpoint_factory("qwen3"))
    # a small step budget: a long prompt is prefilled over many steps (the "long prompt" usage case)
    with ServerProcess(model, "--num-kv-blocks", "256", "--max-num-batched-tokens", "64",
                       "--enable-tokenizer-info-endpoint") as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def events(r: httpx.Response) -> list[dict]:
    assert r.status_code == 200, r.text
    data = [line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def error_of(r: httpx.Response, status: int, param: str | None) -> str:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    return err["message"]


def count_tokens(http: httpx.Client, **body) -> int:
    return http.post("/tokenize", json=body).json()["count"]


# ----- usage in streamed chunks -----------------------------------------------------------------------------
@pytest.mark.parametrize("route", ["completions", "chat"])
def test_stream_usage_on_every_chunk_with_a_long_prompt(http, route):
    """``continuous_usage_stats``: every chunk carries the running usage, the whole prompt's tokens from the
    first chunk on (a ~300-token prompt takes several 64-token prefill steps here)."""
    text = "the quick brown fox jumps over the lazy dog " * 12
    if route == "chat":
        body = {"messages": [{"role": "user", "content": text}]}
        prompt_tokens = count_tokens(http, messages=body["messages"])
    else:
        body = {"prompt": text}
        prompt_tokens = count_tokens(http, prompt=text)
    assert prompt_tokens > 4 * 64
    body = {**body, "model": MODEL, "max_tokens": 6, **GREEDY, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    chunks = events(http.post(f"/v1/{'chat/' if route == 'chat' else ''}completions", json=body))
    usages = [c["usage"] for c in chunks]
    assert all(u is not None and u["prompt_tokens"] == prompt_tokens for u in usages), usages
    assert all(u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] for u in usages)
    done = [u["completion_tokens"] for u in usages]
    assert done == sorted(done) and done[-1] == 6 and chunks[-1]["choices"] == []
    if route == "chat":  # the role chunk comes before any token
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant" and done[0] == 0
    # include_usage alone: null on every chunk but the last, which has no choices
    body["stream_options"] = {"include_usage": True}
    chunks = events(http.post(f"/v1/{'chat/' if route == 'chat' else ''}completions", json=body))
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 6,
                                   "total_tokens": prompt_tokens + 6}


# ----- logprobs ---------------------------------------------------------------------------------------------
def test_logprobs_zero_with_echo(client, http):
    """``logprobs: 0`` + ``echo``: the prompt's tokens first (the first without a logprob), and each entry's
    ``top_logprobs`` holds just the chosen token, with its logprob (as vLLM and OpenAI: k + 1 at most)."""
    prompt = "Hello there, my friend"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, echo=True, logprobs=0,
                                  temperature=0.0)
    c = r.choices[0]
    lp = c.logprobs
    n_prompt = count_tokens(http, prompt=prompt)
    assert c.text.startswith(prompt) and len(lp.tokens) == n_prompt + r.usage.completion_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for tok, logprob, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert top == {tok: pytest.approx(logprob)} and logprob <= 0
    # logprobs 2: at most 3 entries (fewer where two tokens read the same), the chosen token's among them
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, echo=True, logprobs=2,
                                  temperature=1.0, seed=5)
    lp = r.choices[0].logprobs
    for tok, logprob, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert 1 <= len(top) <= 3 and top[tok] == pytest.approx(logprob)
    assert max(len(top) for top in lp.top_logprobs[1:]) == 3  # a prompt token outside the top 2


# ----- /tokenize and /detokenize ----------------------------------------------------------------------------
def test_tokenize_chat_with_tools_and_token_strs(http, client):
    plain = http.post("/tokenize", json={"messages": MSG}).json()
    tooled = http.post("/tokenize", json={"model": MODEL, "messages": MSG, "tools": [TOOL],
                                          "return_token_strs": True}).json()
    assert tooled["count"] > plain["count"] and tooled["max_model_len"] == 512
    rendered = http.post("/detokenize", json={"tokens": tooled["tokens"]}).json()["prompt"]
    assert "get_weather" in rendered and rendered.endswith("assistant\n")
    # the prompt the chat route builds for the same request
    r = client.chat.completions.create(model=MODEL, messages=MSG, tools=[TOOL], max_tokens=1)
    assert r.usage.prompt_tokens == tooled["count"]
    strs = tooled["token_strs"]
    assert len(strs) == len(tooled["tokens"]) and "get" in "".join(strs) and "<|im_start|>" in strs
    # continue_final_message: the prompt ends inside the last (assistant) message, as in the chat route
    cont = http.post("/tokenize", json={"messages": [*MSG, {"role": "assistant", "content": "Well"}],
                                        "add_generation_prompt": False, "continue_final_message": True})
    text = http.post("/detokenize", json={"tokens": cont.json()["tokens"]}).json()["prompt"]
    assert text.endswith("assistant\nWell")
    assert error_of(http.post("/tokenize", json={"prompt": "x", "tools": [TOOL]}), 400, None)


def test_detokenize_round_trip_and_out_of_vocabulary(http):
    text = "Round trip, with punctuation!"
    ids = http.post("/tokenize", json={"prompt": text}).json()["tokens"]
    assert http.post("/detokenize", json={"model": "", "tokens": ids}).json() == {"prompt": text}
    assert error_of(http.post("/detokenize", json={"tokens": [1, 512]}), 400, "tokens")


def test_out_of_vocabulary_prompt_ids_are_named(http):
    r = http.post("/v1/completions", json={"prompt": [1, 2, 9999], "max_tokens": 2})
    msg = error_of(r, 400, "prompt")
    assert "9999" in msg and "out of vocabulary" in msg
    assert http.post("/v1/completions", json={"prompt": [1, 2, 511], "max_tokens": 2}).status_code == 200


# ----- model "" ---------------------------------------------------------------------------------------------
def test_empty_model_means_the_served_model(http):
    for path, body in (("/v1/completions", {"prompt": "Hi", "max_tokens": 2}),
                       ("/v1/chat/completions", {"messages": MSG, "max_tokens": 2})):
        r = http.post(path, json={**body, "model": ""})
        assert r.status_code == 200 and r.json()["model"] == MODEL, r.text
        assert error_of(http.post(path, json={**body, "model": "other"}), 404, "model")
    assert http.post("/tokenize", json={"model": "", "prompt": "Hi"}).status_code == 200


# ----- vLLM's extra fields ----------------------------------------------------------------------------------
def test_vllm_extra_fields_refused_by_name(http):
    base = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
    for field, value in (("priority", 1), ("bad_words", ["x"]),
                         ("logits_processors", ["x"]), ("watermarking", True), ("prompt_embeds", "AAAA")):
        msg = error_of(http.post("/v1/completions", json={**base, field: value}), 400, field)
        assert "not supported" in msg, msg
    chat = {"model": MODEL, "messages": MSG, "max_tokens": 2}
    assert "tools" in error_of(http.post("/v1/chat/completions", json={**chat, "functions": [{}]}), 400,
                               "functions")
    assert error_of(http.post("/v1/completions", json={**base, "truncate_prompt_tokens": 0}), 400,
                    "truncate_prompt_tokens")


def test_vllm_extra_fields_accepted(http):
    accepted = {"use_beam_search": False, "length_penalty": 1.0, "priority": 0, "request_id": "abc",
                "cache_salt": "salt", "vllm_xargs": {"k": 1}, "kv_transfer_params": None,
                "spaces_between_special_tokens": False, "skip_special_tokens": True, "bad_words": [],
                "min_tokens": 1, "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1}
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 3, **accepted})
    assert r.status_code == 200, r.text
    chat_only = {"chat_template_kwargs": {"enable_thinking": False}, "add_generation_prompt": True,
                 "include_reasoning": False, "reasoning_effort": "low", "store": False,
                 "metadata": {"a": "b"}, "documents": [{"title": "t", "text": "x"}], "service_tier": "auto"}
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": MSG, "max_tokens": 3, **accepted,
                                                 **chat_only})
    assert r.status_code == 200, r.text


def test_vllm_extra_fields_honoured(http):
    def complete(**kw):
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "Once upon a time", **kw})
        assert r.status_code == 200, r.text
        return r.json()

    greedy = complete(max_tokens=8, **GREEDY, return_token_ids=True)
    choice = greedy["choices"][0]
    ids = choice["token_ids"]
    assert len(ids) == 8 and choice["prompt_token_ids"] == http.post(
        "/tokenize", json={"prompt": "Once upon a time"}).json()["tokens"]
    # top_k 1 and min_p 1 are greedy whatever the temperature
    for kw in ({"top_k": 1}, {"min_p": 1.0}):
        assert complete(max_tokens=8, temperature=1.0, seed=3, ignore_eos=True, **kw)["choices"][0][
            "text"] == choice["text"]
    # stop_token_ids: stop at the third greedy token (its id is the stop_reason)
    stop_id = ids[2]
    first = ids.index(stop_id)
    r = complete(max_tokens=8, **GREEDY, stop_token_ids=[stop_id], return_token_ids=True)["choices"][0]
    assert r["finish_reason"] == "stop" and r["stop_reason"] == stop_id and len(r["token_ids"]) == first + 1
    # include_stop_str_in_output: the stop string is kept
    text = choice["text"]
    stop = text[len(text) // 2:len(text) // 2 + 2]
    if stop.strip():
        cut = complete(max_tokens=8, **GREEDY, stop=[stop])["choices"][0]["text"]
        kept = complete(max_tokens=8, **GREEDY, stop=[stop], include_stop_str_in_output=True)["choices"][0]
        assert kept["text"] == cut + stop and stop not in cut
    # truncate_prompt_tokens: the prompt's last N tokens
    r = complete(max_tokens=2, **GREEDY, truncate_prompt_tokens=3, return_token_ids=True)
    assert r["usage"]["prompt_tokens"] == 3 and r["choices"][0]["prompt_token_ids"] == choice[
        "prompt_token_ids"][-3:]
    # return_token_ids streamed: the deltas' token ids add up to the whole
    chunks = events(http.post("/v1/completions", json={"model": MODEL, "prompt": "Once upon a time",
                                                       "max_tokens": 8, **GREEDY, "stream": True,
                                                       "return_token_ids": True}))
    assert sum((c["choices"][0]["token_ids"] for c in chunks), []) == ids
    assert chunks[0]["choices"][0]["prompt_token_ids"] == choice["prompt_token_ids"]
    chat = events(http.post("/v1/chat/completions", json={
        "model": MODEL, "messages": MSG, "max_tokens": 4, **GREEDY, "stream": True,
        "return_token_ids": True}))
    assert len(sum((c["choices"][0].get("token_ids", []) for c in chat), [])) == 4
    assert [c for c in chat if "prompt_token_ids" in c][0]["prompt_token_ids"] == http.post(
        "/tokenize", json={"messages": MSG}).json()["tokens"]


# ----- /invocations -----------------------------------------------------------------------------------------
def test_invocations_routes_by_body_shape(http):
    chat = http.post("/invocations", json={"messages": MSG, "max_tokens": 2})
    assert chat.status_code == 200 and chat.json()["object"] == "chat.completion"
    cmpl = http.post("/invocations", json={"prompt": "Hi", "max_tokens": 2})
    assert cmpl.status_code == 200 and cmpl.json()["object"] == "text_completion"
    streamed = events(http.post("/invocations", json={"prompt": "Hi", "max_tokens": 2, "stream": True}))
    assert streamed[-1]["choices"][0]["finish_reason"] is not None
    # input: the embeddings route, which on a generative model says so
    emb = http.post("/invocations", json={"input": "Hi"})
    assert emb.status_code == 400 and emb.json()["error"]["code"] == "model_not_embedding"
    assert error_of(http.post("/invocations", json={"prompt": "Hi", "bogus": 1}), 400, "bogus")
    assert "messages" in error_of(http.post("/invocations", json={"nothing": 1}), 400, None)


# ----- seeds ------------------------------------------------------------------------------------------------
def test_64_bit_seeds(http):
    def sample(seed):
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 12, "seed": seed,
                                               "temperature": 1.0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    # the engine's seed is the request's modulo 2**64: -1 and 2**64 - 1 are one seed
    assert sample(2**64 - 1) == sample(-1)
    assert sample(2**63) == sample(-(2**63))
    assert len({sample(s) for s in (1, 2**40 + 1, 2**63 + 1)}) == 3
    for bad in (2**64, -(2**63) - 1):
        assert error_of(http.post("/v1/completions", json={"prompt": "Hi", "seed": bad}), 400, "seed")


# ----- found by running vLLM's own tests (benchmarks/vllm_openai_compat) -----------------------------------
def test_required_tool_choice_with_refs_to_the_tools_defs(client):
    """A tool's parameters that refer to their own ``$defs`` (pydantic writes them so): with ``required`` the
    parameters sit inside the array of calls, so the definitions must move to its root (was a 400 from the
    grammar compiler: "Cannot find field '$defs'")."""
    tool = {"type": "function", "function": {"name": "w", "parameters": {
        "type": "object", "properties": {"o": {"$ref": "#/$defs/O"}}, "required": ["o"],
        "$defs": {"O": {"type": "object", "properties": {"u": {"enum": ["c", "f"]}}, "required": ["u"]}}}}}
    # (the test model's context is 512 byte-level tokens: one small tool leaves room for the call)
    r = client.chat.completions.create(model=MODEL, messages=MSG, tools=[tool], tool_choice="required",
                                       max_tokens=64, seed=1)
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and calls, r.choices[0].message
    assert all(json.loads(c.function.arguments)["o"]["u"] in ("c", "f") for c in calls), calls


def test_required_tool_choice_refuses_conflicting_defs(http):
    def tool(name, unit_enum):
        return {"type": "function", "function": {"name": name, "parameters": {
            "type": "object", "properties": {"o": {"$ref": "#/$defs/O"}},
            "$defs": {"O": {"enum": unit_enum}}}}}

    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": MSG, "tool_choice": "required",
                                                "tools": [tool("a", ["x"]), tool("b", ["y"])]})
    assert "$defs/O" in error_of(r, 400, "tools")


def test_reasoning_also_under_vllms_newer_name():
    """vLLM's responses carry the reasoning as ``reasoning`` (``reasoning_content`` is its older name): both,
    in a whole message and in stream deltas; neither with ``include_reasoning: false``."""
    from forwardpass.server.chat_output import ChatOutputParser

    msg = ChatOutputParser(reasoning_parser="deepseek_r1").message("weigh it</think>yes")
    assert msg["reasoning"] == msg["reasoning_content"] == "weigh it" and msg["content"] == "yes"
    stream = ChatOutputParser(reasoning_parser="deepseek_r1")
    deltas = [stream.delta(t, final=False) or {} for t in ("weigh ", "it</think>", "yes")]
    deltas.append(stream.delta("", final=True) or {})
    assert "".join(d.get("reasoning", "") for d in deltas) == "weigh it"
    assert all(d.get("reasoning") == d.get("reasoning_content") for d in deltas)
    hidden = ChatOutputParser(reasoning_parser="deepseek_r1", include_reasoning=False).message("a</think>b")
    assert "reasoning" not in hidden and "reasoning_content" not in hidden


def test_tokenize_answers_token_strs_null_unless_asked(http):
    """vLLM's /tokenize always has ``token_strs`` (its tests read ``result["token_strs"] is None``)."""
    for body in ({"prompt": "Hi there"}, {"messages": MSG}, {"prompt": ""}):
        r = http.post("/tokenize", json=body)
        assert r.status_code == 200 and r.json()["token_strs"] is None, r.text
    asked = http.post("/tokenize", json={"prompt": "Hi there", "return_token_strs": True}).json()
    assert len(asked["token_strs"]) == asked["count"] > 0


def test_logit_bias_error_names_every_bad_key(http):
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": MSG, "max_tokens": 1,
                                                "logit_bias": {"bad1": 1, "5": 1, "bad2": 2}})
    message = error_of(r, 400, "logit_bias")
    assert "'bad1'" in message and "'bad2'" in message and "'5'" not in message


def test_tokenizer_info(http, server):
    """vLLM's ``/tokenizer_info`` (``--enable-tokenizer-info-endpoint``; off by default): the tokenizer's
    configuration, the chat template the server renders, the context window; no filesystem paths."""
    from forwardpass.loader.tokenizer import Tokenizer
    from forwardpass.server.config import ServerConfig

    assert ServerConfig().enable_tokenizer_info is False
    info = http.get("/tokenizer_info").json()
    assert isinstance(info["tokenizer_class"], str) and info["tokenizer_class"]
    model_dir = server.cmd[server.cmd.index("--model") + 1]
    assert info["chat_template"] == Tokenizer.from_dir(model_dir).chat_template
    assert info["model_max_length"] == http.post("/tokenize", json={"prompt": "x"}).json()["max_model_len"]
    assert not any(str(model_dir) in json.dumps(v) for v in info.values())
