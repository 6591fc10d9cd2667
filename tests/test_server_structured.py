"""Structured output and the sampling extensions through the official ``openai`` client against a real server
serving the embedded model (forwardpass/assets/llm): ``response_format`` (json_schema, json_object), vLLM's
``structured_outputs`` {json, regex, choice, grammar} and the older ``guided_*`` fields, ``logit_bias`` and
``allowed_token_ids``; invalid constraints are a 400 that says what is wrong."""

from __future__ import annotations

import functools
import json
import operator
import re

import httpx
import jsonschema
import pytest

from forwardpass.assets import default_llm_path
from tests.helpers.server import ServerProcess
from tests.test_structured_output import SCHEMAS

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.timeout(240)
MODEL = "test-model"
MSG = [{"role": "user", "content": "Write about Mr. Darcy."}]


@pytest.fixture(scope="module")
def server():
    with ServerProcess(default_llm_path(), "--num-kv-blocks", "256") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _check_json(choices, schema) -> int:
    done = 0
    for c in choices:
        text = c.message.content if hasattr(c, "message") else c.text
        assert c.finish_reason in ("stop", "length")
        if c.finish_reason == "stop":
            jsonschema.validate(json.loads(text), schema)
            done += 1
    return done


@pytest.mark.parametrize("name", ["person", "order_with_refs", "event_tags"])
def test_response_format_json_schema(client, name):
    r = client.chat.completions.create(
        model=MODEL, messages=MSG, temperature=0.8, max_completion_tokens=300, n=3, seed=7,
        response_format={"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name],
                                                                "strict": True}})
    assert _check_json(r.choices, SCHEMAS[name]) >= 1


def test_response_format_json_object_and_completions(client):
    r = client.chat.completions.create(model=MODEL, messages=MSG, temperature=0.7, max_tokens=200, n=2,
                                       seed=3, response_format={"type": "json_object"})
    for c in r.choices:
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.message.content), dict)
    schema = SCHEMAS["weather_tool_args"]
    r = client.completions.create(model=MODEL, prompt="Weather:", temperature=0.8, max_tokens=120, n=2,
                                  seed=4, extra_body={"response_format": {
                                      "type": "json_schema", "json_schema": {"name": "w", "schema": schema}}})
    _check_json(r.choices, schema)


def test_structured_outputs_forms(client):
    regex = r"[A-Z][a-z]{2,8} (Bennet|Darcy)"
    r = client.completions.create(model=MODEL, prompt="Name:", temperature=0.9, max_tokens=40, n=3, seed=5,
                                  extra_body={"structured_outputs": {"regex": regex}})
    assert all(c.finish_reason == "stop" and re.fullmatch(regex, c.text) for c in r.choices), r.choices
    choices = ["Pride", "Prejudice", "Persuasion"]
    r = client.chat.completions.create(model=MODEL, messages=MSG, temperature=1.0, n=4, seed=6,
                                       extra_body={"structured_outputs": {"choice": choices}})
    assert all(c.message.content in choices and c.finish_reason == "stop" for c in r.choices)
    grammar = 'root ::= "yes" | "no" | "maybe " [0-9]'
    r = client.chat.completions.create(model=MODEL, messages=MSG, temperature=1.0, n=3, seed=8,
                                       extra_body={"structured_outputs": {"grammar": grammar}})
    assert all(re.fullmatch(r"yes|no|maybe [0-9]", c.message.content) for c in r.choices)
    schema = SCHEMAS["weather_tool_args"]
    r = client.chat.completions.create(model=MODEL, messages=MSG, temperature=0.8, max_tokens=150, n=2,
                                       seed=9, extra_body={"structured_outputs": {"json": schema}})
    _check_json(r.choices, schema)


def test_guided_fields_and_streaming(client):
    r = client.completions.create(model=MODEL, prompt="Answer:", temperature=1.0, n=3, seed=10,
                                  extra_body={"guided_choice": ["A", "B", "C"]})
    assert all(c.text in ("A", "B", "C") for c in r.choices)
    r = client.completions.create(model=MODEL, prompt="Num:", temperature=1.0, max_tokens=20, seed=11,
                                  extra_body={"guided_regex": "[0-9]{4}"})
    assert re.fullmatch("[0-9]{4}", r.choices[0].text)
    schema = SCHEMAS["weather_tool_args"]
    stream = client.chat.completions.create(model=MODEL, messages=MSG, temperature=0.8, max_tokens=150,
                                            seed=12, stream=True, extra_body={"guided_json": schema})
    text, finish = "", None
    for chunk in stream:
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    if finish == "stop":
        jsonschema.validate(json.loads(text), schema)
    r = client.completions.create(model=MODEL, prompt="Grammar:", temperature=1.0, max_tokens=10, seed=13,
                                  extra_body={"guided_grammar": 'root ::= "x" [a-c]'})
    assert re.fullmatch("x[a-c]", r.choices[0].text)


def test_truncation_is_length(client):
    r = client.chat.completions.create(model=MODEL, messages=MSG, temperature=0.8, max_tokens=4, seed=14,
                                       response_format={"type": "json_schema", "json_schema": {
                                           "name": "p", "schema": SCHEMAS["person"]}})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 4


def test_logit_bias_and_allowed_token_ids(client, server):
    ids = httpx.post(server.url + "/tokenize", json={"prompt": " Darcy", "add_special_tokens": False}).json()
    tok = ids["tokens"][0]
    r = client.completions.create(model=MODEL, prompt="Hello", temperature=1.0, max_tokens=5, seed=1,
                                  logit_bias={str(tok): 100})
    assert r.choices[0].text == httpx.post(server.url + "/detokenize",
                                           json={"tokens": [tok] * 5}).json()["prompt"]
    r = client.completions.create(model=MODEL, prompt="Hello", temperature=1.0, max_tokens=8, seed=2,
                                  logprobs=0, extra_body={"allowed_token_ids": [tok, tok + 1]})
    allowed = {httpx.post(server.url + "/detokenize", json={"tokens": [t]}).json()["prompt"]
               for t in (tok, tok + 1)}
    assert all(t in allowed for t in r.choices[0].logprobs.tokens), (r.choices[0].text, allowed)


@pytest.mark.parametrize("body, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "strnig"}}}}}}, "response_format", "JSON schema"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex", "regular expression"),
    ({"guided_grammar": "root ::= nothing_here"}, "guided_grammar", "EBNF"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, None, "one output constraint"),
    ({"logit_bias": {"99999": 1}}, "logit_bias", "99999"),
    ({"logit_bias": {"abc": 1}}, None, "token ids"),
    ({"logit_bias": {"5": 101}}, None, "-100, 100"),
    ({"allowed_token_ids": [4096]}, "allowed_token_ids", "4096"),
    ({"response_format": {"type": "json_schema"}}, None, "json_schema"),
])
def test_bad_constraints_are_400(server, body, param, words):
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL, "messages": MSG, **body},
                   timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert words in err["message"], err
    if param:
        assert err["param"] == param, err


# ----- standard OpenAI parameters and vLLM extensions, one test each ----------------------------------------
def test_stream_options_without_stream_is_400(server):
    r = httpx.post(server.url + "/v1/completions",
                   json={"prompt": "a", "stream_options": {"include_usage": True}})
    assert r.status_code == 400 and "stream_options" in r.json()["error"]["message"]


def test_logprobs_0_returns_the_sampled_tokens_logprob(client):
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, logprobs=0, temperature=0.0)
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == 3 and all(x <= 0 for x in lp.token_logprobs)


def test_return_tokens_as_token_ids(client):
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, logprobs=1, temperature=0.0,
                                  extra_body={"return_tokens_as_token_ids": True})
    assert all(re.fullmatch(r"token_id:\d+", t) for t in r.choices[0].logprobs.tokens)
    r = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=2, logprobs=True,
                                       temperature=0.0, extra_body={"return_tokens_as_token_ids": True})
    assert all(c.token.startswith("token_id:") for c in r.choices[0].logprobs.content)


def test_continuous_usage_stats(client):
    chunks = list(client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0.0,
                                            stream=True, stream_options={"include_usage": True,
                                                            "continuous_usage_stats": True}))
    counts = [c.usage.completion_tokens for c in chunks if c.choices]
    assert counts == sorted(counts) and counts[-1] == 4 and chunks[-1].usage.completion_tokens == 4


def test_max_completion_tokens(client):
    r = client.chat.completions.create(model=MODEL, messages=MSG, max_completion_tokens=3, temperature=0.0,
                                       extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"


def test_tokenize_token_strs_and_chat_messages(server):
    r = httpx.post(server.url + "/tokenize", json={"prompt": "Hello there", "return_token_strs": True}).json()
    assert len(r["token_strs"]) == r["count"] and "".join(r["token_strs"]).replace("Ġ", " ") == "Hello there"
    r = httpx.post(server.url + "/tokenize", json={"messages": MSG, "add_generation_prompt": False}).json()
    assert r["count"] > 0


def test_custom_roles_and_extra_message_fields_reach_the_template(server):
    """As vLLM: a role the template knows (here any: the template prints it) and extra message fields are
    passed to the template; names are bounded and checked."""
    from forwardpass.server.protocol import ChatMessage

    msg = ChatMessage.model_validate({"role": "ipython", "content": "42", "tool_name": "calc", "step": 3})
    assert msg.template_dict() == {"role": "ipython", "content": "42", "tool_name": "calc", "step": 3}
    chat = httpx.post(server.url + "/tokenize", json={"messages": [{"role": "ipython", "content": "42"}],
                                                      "add_generation_prompt": False}).json()
    text = httpx.post(server.url + "/tokenize", json={"prompt": "<|im_start|>ipython\n42<|im_end|>\n",
                                                      "add_special_tokens": False}).json()
    assert chat["tokens"] == text["tokens"]
    bad = [{"role": "no spaces allowed", "content": "x"}, {"role": "user", "content": "x", "bad-name": 1},
           {"role": "user", "content": "x", **{f"f{i}": i for i in range(17)}}]
    for m in bad:
        r = httpx.post(server.url + "/v1/chat/completions",
                       json={"model": MODEL, "messages": [m], "max_tokens": 1})
        assert r.status_code == 400 and "messages" in (r.json()["error"]["param"] or ""), (m, r.text)


def test_continue_final_message_and_chat_echo(client, server):
    msgs = [*MSG, {"role": "assistant", "content": "It is raining in"}]
    body = {"model": MODEL, "messages": msgs, "max_tokens": 3, "temperature": 0.0,
            "add_generation_prompt": False, "continue_final_message": True, "echo": True}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).json()
    assert r["choices"][0]["message"]["content"].startswith("It is raining in")
    # the prompt ends with the assistant's text, not with a closed turn
    toks = httpx.post(server.url + "/tokenize",
                      json={"messages": msgs, "add_generation_prompt": False}).json()
    assert r["usage"]["prompt_tokens"] < toks["count"]
    bad = httpx.post(server.url + "/v1/chat/completions", json={**body, "add_generation_prompt": True})
    assert bad.status_code == 400


def test_text_offset_skips_special_tokens_the_text_leaves_out(client):
    # token 2 is <|im_end|>, a special token: skipped from the text, so it must not move text_offset
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, logprobs=0, temperature=0.0,
                                  logit_bias={"2": 100}, extra_body={"ignore_eos": True})
    c = r.choices[0]
    assert c.text == "" and c.logprobs.text_offset == [0, 0, 0]


def test_vllm_metric_names(client, server):
    client.completions.create(model=MODEL, prompt="Hello there", max_tokens=4, temperature=0.0)
    text = httpx.get(server.url + "/metrics").text
    for name in ("time_per_output_token_seconds", "request_prompt_tokens", "request_generation_tokens",
                 "request_prefill_time_seconds", "request_decode_time_seconds",
                 "request_inference_time_seconds"):
        for prefix in ("vllm:", "forwardpass:"):
            assert f"{prefix}{name}_count{{" in text, name
    assert "vllm:prefix_cache_queries_total{" in text and "vllm:prefix_cache_hits_total{" in text
    assert "forwardpass:time_to_first_token_seconds_count{" in text  # ours stay


def test_completion_echo_with_logprobs_lists_the_prompt_first(client):
    """As vLLM: echo + logprobs gives the prompt's tokens (the first without a logprob) then the
    completion's, with text offsets into the echoed text; streaming gives the same entries."""
    kw = {"model": MODEL, "prompt": "Hello there, friend", "max_tokens": 3, "temperature": 0.0, "logprobs": 2}
    plain = client.completions.create(**kw).choices[0]
    r = client.completions.create(echo=True, extra_body={"prompt_logprobs": 2}, **kw).choices[0]
    n_prompt = len(r.prompt_logprobs)
    lp = r.logprobs
    assert (lp.tokens[n_prompt:] == plain.logprobs.tokens
            and lp.token_logprobs[n_prompt:] == plain.logprobs.token_logprobs)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and r.prompt_logprobs[0] is None
    assert "".join(lp.tokens[:n_prompt]) == "Hello there, friend"
    for i in range(1, n_prompt):  # the echoed entries are the prompt_logprobs of the same tokens
        entry = next(v for v in r.prompt_logprobs[i].values() if v["decoded_token"] == lp.tokens[i])
        assert entry["logprob"] == pytest.approx(lp.token_logprobs[i]) and len(lp.top_logprobs[i]) <= 3
    assert lp.text_offset[n_prompt] == len("Hello there, friend") and lp.text_offset[0] == 0
    chunks = [c.choices[0] for c in client.completions.create(echo=True, stream=True, **kw) if c.choices]
    assert functools.reduce(operator.iadd, (c.logprobs.token_logprobs for c in chunks if c.logprobs),
                            []) == lp.token_logprobs


def test_prompt_logprobs_in_chat(client):
    r = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=2, temperature=0.0,
                                       extra_body={"prompt_logprobs": 1})
    prompt_lps = r.model_extra["prompt_logprobs"]
    assert prompt_lps[0] is None and len(prompt_lps) == r.usage.prompt_tokens
    assert all(1 <= len(d) <= 2 and all(v["logprob"] <= 0 for v in d.values()) for d in prompt_lps[1:])
    stream = [c for c in client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=2,
                                                        temperature=0.0, stream=True,
                                                        extra_body={"prompt_logprobs": 1})]
    carried = [c.model_extra["prompt_logprobs"] for c in stream if c.model_extra.get("prompt_logprobs")]
    assert carried == [prompt_lps]  # once, on one chunk


def test_completion_echo(client):
    r = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=3, temperature=0.0, echo=True)
    plain = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=3, temperature=0.0)
    assert r.choices[0].text == "Hello there" + plain.choices[0].text
    text = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="Hello there", max_tokens=3, temperature=0.0, echo=True, stream=True)
        if c.choices)
    assert text == r.choices[0].text
