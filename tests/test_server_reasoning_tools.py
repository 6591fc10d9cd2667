"""Reasoning (``--reasoning-parser qwen3``), tool calls (Hermes ``<tool_call>``: auto, required, named,
streamed) and llama.cpp's habits (routes without ``/v1``, CORS preflight without auth, ``/props``) and vLLM's
``/invocations``, through the official ``openai`` client against a real server on the embedded model.

The embedded model never learned ``<think>`` or ``<tool_call>``: a grammar (``structured_outputs``) makes it
write them, so what is tested is the parsing, deterministically, at temperature 1.
"""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest

from forwardpass.assets import default_llm_path
from forwardpass.server.chat_output import ChatOutputParser
from forwardpass.server.reasoning import ReasoningSplitter, split_reasoning
from forwardpass.server.tools import ToolCallStreamer, parse_tool_calls
from tests.helpers.server import ServerProcess

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.timeout(240)
MODEL = "test-model"
KEY = "sk-test"
ORIGIN = "http://chat.example"
MSG = [{"role": "user", "content": "What is the weather in Bath?"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "current weather",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 12},
                                                "unit": {"enum": ["celsius", "fahrenheit"]}},
                                                "required": ["city", "unit"], "additionalProperties": False}}}
THINK = r"<think>[a-z]{2,8}( [a-z]{2,8}){1,4}</think>\n\n[A-Z][a-z]{2,8}"
# This server parses reasoning, so constraints start after </think>, which the embedded model never writes;
# without thinking they apply from the first token.
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
CALL = ('root ::= '
        '"Sure. <tool_call>{\\"name\\": \\"get_weather\\", \\"arguments\\": {\\"city\\": \\"" [a-z]{2,8} '
        '"\\", \\"unit\\": \\"celsius\\"}}</tool_call>"')


@pytest.fixture(scope="module")
def server():
    with ServerProcess(default_llm_path(), "--num-kv-blocks", "256", "--reasoning-parser", "qwen3",
                       "--allowed-origins", ORIGIN, api_key=KEY) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


# ----- the parsers alone -----------------------------------------------------------------------------
def test_reasoning_splitter_units():
    assert split_reasoning("qwen3", "<think>a b</think>\n\nanswer") == ("a b", "answer")
    assert split_reasoning("qwen3", "just an answer") == (None, "just an answer")
    assert split_reasoning("deepseek_r1", "thinking</think>answer") == ("thinking", "answer")
    assert split_reasoning("deepseek_r1", "never closed") == ("never closed", "")
    s = ReasoningSplitter("qwen3")
    parts = [s.feed(d) for d in ["<th", "ink>re", "ason</th", "ink>\n\nans", "wer"]] + [s.feed("", True)]
    assert "".join(r for r, _ in parts) == "reason" and "".join(c for _, c in parts) == "answer"


def test_tool_parsers_units():
    text = 'ok <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call> <tool_call>not json</tool_call>'
    content, calls = parse_tool_calls(text)
    assert [c["function"]["name"] for c in calls] == ["f"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"x": 1}
    assert content == "ok  <tool_call>not json</tool_call>"
    st = ToolCallStreamer()
    parts = ["hi <tool", '_call>{"name": "g", ', '"arguments": {"a": ', '[1, {"b": 2}]}', "}</tool_",
             "call> bye"]
    out = [st.feed(d) for d in parts] + [st.feed("", True)]
    assert "".join(c for c, _ in out) == "hi  bye"
    deltas = [c for _, cs in out for c in cs]
    assert [c["function"].get("name") for c in deltas if "id" in c] == ["g"]  # one header, then fragments
    assert json.loads("".join(c["function"]["arguments"] for c in deltas)) == {"a": [1, {"b": 2}]}
    assert len(deltas) >= 3 and st.calls[0]["function"]["arguments"] == '{"a": [1, {"b": 2}]}'
    p = ChatOutputParser(None, "forced", "required")
    assert p.message('[{"name": "g", "parameters": {"a": 1}}]')["tool_calls"][0]["function"]["name"] == "g"
    assert p.finish_reason("stop") == "tool_calls"


# ----- reasoning through the server --------------------------------------------------------------------
def test_reasoning_content_split_and_streamed(client):
    # enable_thinking false: the grammar covers the whole output, so it can make the model write <think>
    kw = {"model": MODEL, "messages": MSG, "temperature": 1.0, "max_tokens": 60, "seed": 3,
          "extra_body": {"structured_outputs": {"regex": THINK},
                         "chat_template_kwargs": {"enable_thinking": False}}}
    r = client.chat.completions.create(**kw)
    m = r.choices[0].message
    assert re.fullmatch(r"[a-z]{2,8}( [a-z]{2,8}){1,4}", m.reasoning_content), m
    assert re.fullmatch(r"[A-Z][a-z]{2,8}", m.content), m
    reasoning = content = ""
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            reasoning += getattr(c.delta, "reasoning_content", None) or ""
            content += c.delta.content or ""
    assert (reasoning, content) == (m.reasoning_content, m.content)


def test_plain_answer_has_no_reasoning_and_template_kwargs_pass(client):
    r = client.chat.completions.create(model=MODEL, messages=MSG, temperature=1.0, max_tokens=8, seed=4,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.choices[0].message.reasoning_content is None and r.choices[0].message.content


# ----- tools ------------------------------------------------------------------------------------------------
def test_auto_tool_call_parsed_and_streamed(client):
    kw = {"model": MODEL, "messages": MSG, "tools": [WEATHER], "temperature": 1.0, "max_tokens": 80,
          "seed": 5, "extra_body": {"structured_outputs": {"grammar": CALL}, **NO_THINK}}
    r = client.chat.completions.create(**kw)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content == "Sure.", c
    call = c.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, WEATHER["function"]["parameters"])
    content, calls, finish = "", [], None
    for chunk in client.chat.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            calls += ch.delta.tool_calls or []
            finish = ch.finish_reason or finish
    assert content.strip() == "Sure." and finish == "tool_calls"
    # as vLLM streams them: the id and name first, then the arguments' JSON text in several fragments
    assert calls[0].id.startswith("call_") and calls[0].function.name == "get_weather" and len(calls) > 2
    assert all(tc.index == 0 and tc.id is None and tc.function.name is None for tc in calls[1:])
    assert json.loads("".join(tc.function.arguments or "" for tc in calls)) == args


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_required_and_named_tool_choice_are_enforced(client, choice):
    r = client.chat.completions.create(model=MODEL, messages=MSG, tools=[WEATHER], tool_choice=choice,
                                       temperature=0.8, max_tokens=120, seed=6, n=2, extra_body=NO_THINK)
    for c in r.choices:
        if c.finish_reason == "length":
            continue
        assert c.finish_reason == "tool_calls" and c.message.tool_calls
        for call in c.message.tool_calls:
            assert call.function.name == "get_weather"
            jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    if isinstance(choice, dict):  # a named call streams its arguments as they are generated
        calls, finish = [], None
        for chunk in client.chat.completions.create(model=MODEL, messages=MSG, tools=[WEATHER],
                                                    tool_choice=choice, temperature=0.8, max_tokens=120,
                                                    seed=6, stream=True, extra_body=NO_THINK):
            for ch in chunk.choices:
                calls += ch.delta.tool_calls or []
                finish = ch.finish_reason or finish
        assert calls[0].function.name == "get_weather" and len(calls) > 2
        if finish == "tool_calls":
            args = json.loads("".join(tc.function.arguments or "" for tc in calls))
            jsonschema.validate(args, WEATHER["function"]["parameters"])


def test_tool_choice_errors(server):
    h = {"Authorization": f"Bearer {KEY}"}
    for body in ({"tool_choice": "required"}, {"tools": [WEATHER], "tool_choice": {
            "type": "function", "function": {"name": "nope"}}}):
        r = httpx.post(server.url + "/v1/chat/completions", headers=h, json={"messages": MSG, **body})
        assert r.status_code == 400 and "tool" in r.json()["error"]["message"]


def test_tool_messages_reach_the_template(client):
    msgs = [*MSG, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "bath"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "rain"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER], tool_choice="none",
                                       max_tokens=4, temperature=0.0)
    assert r.choices[0].message.tool_calls is None


# ----- llama.cpp habits, /invocations -----------------------------------------------------------------------
def test_routes_without_v1_props_cors_and_invocations(server):
    h = {"Authorization": f"Bearer {KEY}"}
    body = {"messages": MSG, "max_tokens": 3, "temperature": 0.0}
    a = httpx.post(server.url + "/chat/completions", headers=h, json=body, timeout=60).json()
    b = httpx.post(server.url + "/v1/chat/completions", headers=h, json=body, timeout=60).json()
    assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]
    assert httpx.post(server.url + "/completions", headers=h,
                      json={"prompt": "a", "max_tokens": 2}).status_code == 200
    assert httpx.get(server.url + "/models", headers=h).json()["data"][0]["id"] == MODEL
    inv = httpx.post(server.url + "/invocations", headers=h, json=body, timeout=60).json()
    assert inv["object"] == "chat.completion"
    assert httpx.post(server.url + "/invocations", headers=h, json={"prompt": "a", "max_tokens": 2}).json()[
        "object"] == "text_completion"
    assert httpx.post(server.url + "/invocations", headers=h,
                      json={"prompt": "a", "bogus": 1}).status_code == 400
    props = httpx.get(server.url + "/props", headers=h).json()
    assert props["default_generation_settings"]["n_ctx"] == 1024 and "/" not in props["model_path"]
    pre = httpx.options(server.url + "/v1/chat/completions", headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == ORIGIN
    r = httpx.get(server.url + "/v1/models", headers={**h, "Origin": ORIGIN})
    assert r.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.options(server.url + "/v1/models", headers={"Origin": "http://evil.example",
                                                              "Access-Control-Request-Method": "GET"})
    assert "access-control-allow-origin" not in other.headers


def test_thinking_budget_closes_reasoning_and_usage_counts_it(client, server):
    """The assistant turn is continued from an open <think>: after 4 reasoning tokens the server forces
    </think>, the answer follows, and usage reports the reasoning tokens (closing tag included)."""
    messages = [{"role": "user", "content": "Tell me a story."}, {"role": "assistant", "content": "<think>"}]
    extra = {"continue_final_message": True, "add_generation_prompt": False, "ignore_eos": True}
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0,
                                       extra_body={**extra, "max_reasoning_tokens": 4})
    m = r.choices[0].message
    assert m.reasoning_content and m.content
    closing = httpx.post(server.url + "/tokenize", headers={"Authorization": f"Bearer {KEY}"},
                         json={"prompt": "</think>", "add_special_tokens": False}).json()["count"]
    assert r.usage.completion_tokens_details.reasoning_tokens == 4 + closing
    assert r.usage.completion_tokens == 20
    # without a budget the embedded model (which never learned the tag) does not close it: no reasoning
    # is split off (qwen3's parser), and none is counted
    free = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0,
                                          extra_body=extra)
    assert free.choices[0].message.reasoning_content is None
    assert free.usage.completion_tokens_details.reasoning_tokens == 0


def test_thinking_budget_needs_a_reasoning_parser_and_a_sane_value(client):
    with pytest.raises(openai.BadRequestError, match="max_reasoning_tokens"):
        client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=4,
                                       extra_body={"max_reasoning_tokens": -1})
