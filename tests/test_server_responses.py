"""``/v1/responses`` (OpenAI's Responses API, on top of the chat path) through the official ``openai`` client,
and ``tool_choice: "required"`` / named on the embedded default model (issue 43): the grammar forces a call
that fits the output budget, or the answer is a 400 naming ``max_tokens`` — never an empty message.

Oracles: the chat route itself (a response is the chat completion of the same messages), ``/tokenize``
counts for the conversation ``previous_response_id`` rebuilds, and each tool's JSON schema.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import pytest

from forwardpass.assets import default_llm_path
from forwardpass.errors import ValidationError
from forwardpass.server.responses import ResponseNotFoundError, ResponsesService, ResponseStore
from forwardpass.server.responses_protocol import ResponsesRequest
from forwardpass.server.tool_choice import MAX_ITEMS, MAX_STRING_CHARS, forced_tool_constraint
from tests.helpers.server import ServerProcess

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.timeout(300)
MODEL = "test-model"
CITY = {"type": "object", "required": ["city", "unit"],
        "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}}}
SEARCH = {"type": "object", "properties": {"query": {"type": "string"}, "tags": {
    "type": "array", "items": {"type": "string"}}}, "required": ["query", "tags"]}
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": CITY}},
              {"type": "function", "function": {"name": "search", "parameters": SEARCH}}]
RESP_TOOL = {"type": "function", "name": "get_weather", "description": "current weather", "parameters": CITY}
ASK = [{"role": "user", "content": "What is the weather in Bath?"}]


@pytest.fixture(scope="module")
def server():
    with ServerProcess(default_llm_path(), "--num-kv-blocks", "256") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=240)


def tokens_of(server, messages) -> int:
    return httpx.post(server.url + "/tokenize", json={"messages": messages}).json()["count"]


# ----- the bounded tool-call grammar alone ------------------------------------------------------------------
def test_forced_tool_constraint_bounds_strings_and_arrays():
    c = forced_tool_constraint(CHAT_TOOLS, None, True, 2000)
    schema = c["json"]
    assert c["disable_any_whitespace"] and schema["maxItems"] == MAX_ITEMS and schema["minItems"] == 1
    weather, search = (b["properties"]["parameters"] for b in schema["items"]["anyOf"])
    assert weather["properties"]["unit"] == CITY["properties"]["unit"]  # bounded values kept as given
    cap = weather["properties"]["city"]["maxLength"]
    assert search["properties"]["query"]["maxLength"] == cap and search["properties"]["tags"]["maxItems"] == 4
    # the longest output fits the budget at one character per token: 4 calls x (1 + 4) strings of cap
    assert 64 <= cap and 4 * 5 * cap < 2000
    # a tight budget: one call, short arrays, shorter strings; no budget: the largest bound
    tight = forced_tool_constraint(CHAT_TOOLS, None, True, 300)["json"]
    assert tight["maxItems"] == 1 and tight["items"]["anyOf"][1]["properties"]["parameters"]["properties"][
        "tags"]["maxItems"] == 1
    assert forced_tool_constraint(CHAT_TOOLS, None, False, None)["json"]["maxItems"] == 1
    named = forced_tool_constraint(CHAT_TOOLS, "get_weather", True, None)["json"]
    assert named["properties"]["city"]["maxLength"] == MAX_STRING_CHARS and "maxItems" not in named
    assert CHAT_TOOLS[0]["function"]["parameters"]["properties"]["city"] == {"type": "string"}  # not mutated


def test_forced_tool_constraint_survives_malformed_schemas():
    """Malformed parts are left for xgrammar to refuse (a 400 naming the field); a schema nested hundreds deep
    is a 400 naming tools, never a server error."""
    deep: dict = {"type": "object"}
    node = deep
    for _ in range(400):
        node["properties"] = {"a": {"type": "object"}}
        node = node["properties"]["a"]
    odd = [{"properties": 5, "type": [{"a": 1}, "string"], "enum": 3, "maxItems": "x"},
           {"type": "array", "items": {"type": "array"}, "minItems": True}, {"anyOf": "x", "$defs": [1]}]
    for params in odd:
        tools = [{"type": "function", "function": {"name": "f", "parameters": params}}]
        for named in (None, "f"):
            assert forced_tool_constraint(tools, named, True, 100)["disable_any_whitespace"]
    with pytest.raises(ValidationError) as e:
        forced_tool_constraint([{"type": "function", "function": {"name": "f", "parameters": deep}}], None,
                               True, 100)
    assert e.value.param == "tools"


def test_response_store_is_a_bounded_lru():
    store = ResponseStore(2)
    store.put("a", [], {"id": "a"})
    store.put("b", [], {"id": "b"})
    store.get("a")  # a is now the most recently used: b goes first
    store.put("c", [], {"id": "c"})
    assert len(store) == 2 and store.get("a")[1]["id"] == "a"
    with pytest.raises(ResponseNotFoundError) as e:
        store.get("b", "previous_response_id")
    assert e.value.status_code == 404 and e.value.param == "previous_response_id" and "'b'" in e.value.message
    ResponseStore(0).put("x", [], {})  # capacity 0 keeps nothing


def test_stream_events_from_chat_chunks():
    """The chat stream -> Responses events rewrite, on hand-made chunks: reasoning, text, a streamed call."""
    def chunk(delta=None, finish=None, usage=None):
        choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
        return "data: " + json.dumps({"choices": choices, "usage": usage}) + "\n\n"

    chunks = [chunk({"role": "assistant", "content": ""}), chunk({"reasoning_content": "hmm"}),
              chunk({"content": "Sure"}), chunk({"content": "."}),
              chunk({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                     "function": {"name": "f", "arguments": ""}}]}),
              chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"a": '}}]}),
              chunk({"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]}, finish="tool_calls"),
              chunk(usage={"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}),
              "data: [DONE]\n\n"]

    async def run():
        async def source():
            for c in chunks:
                yield c

        service = ResponsesService(serving=None, capacity=4)  # type: ignore[arg-type]  # store only
        req = ResponsesRequest.model_validate({"input": "hi"})
        return [e async for e in service._events(req, "resp_1", 0, "m", [{"role": "user", "content": "hi"}],
                                                 source())], service

    raw, service = asyncio.run(run())
    events = [json.loads(e.split("data: ", 1)[1]) for e in raw]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert all(e.startswith(f"event: {ev['type']}\n") for e, ev in zip(raw, events))
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    final = events[-1]["response"]
    assert [o["type"] for o in final["output"]] == ["reasoning", "message", "function_call"]
    assert final["output"][1]["content"][0]["text"] == "Sure." and final["usage"]["output_tokens"] == 7
    call = {k: v for k, v in final["output"][2].items() if k != "id"}
    assert call == {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": '{"a": 1}',
                    "status": "completed"}
    done = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert done[0]["arguments"] == '{"a": 1}'
    messages, stored = service.store.get("resp_1")
    assert stored == final and messages[-1]["tool_calls"][0]["function"]["arguments"] == '{"a": 1}'


# ----- tool_choice required / named on the embedded model ---------------------------------------------------
@pytest.mark.parametrize("parallel", [True, False])
def test_required_tool_choice_always_calls_a_tool(client, parallel):
    """Unbounded, the embedded model writes prose into "city" until max_tokens and answers nothing (issue
    43)."""
    for seed in range(3):
        r = client.chat.completions.create(model=MODEL, messages=ASK, tools=CHAT_TOOLS, seed=seed,
                                           tool_choice="required", temperature=1.0,
                                           parallel_tool_calls=parallel)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.tool_calls, c
        assert len(c.message.tool_calls) <= (MAX_ITEMS if parallel else 1)
        for call in c.message.tool_calls:
            schema = {"get_weather": CITY, "search": SEARCH}[call.function.name]
            jsonschema.validate(json.loads(call.function.arguments), schema)


def test_named_tool_choice_and_a_budget_too_small(client, server):
    named = {"type": "function", "function": {"name": "search"}}
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=CHAT_TOOLS, tool_choice=named, seed=1,
                                       temperature=1.0, max_tokens=200)
    call = r.choices[0].message.tool_calls[0]
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "search"
    jsonschema.validate(json.loads(call.function.arguments), SEARCH)
    # a budget that no call fits: a clear 400, streamed as an error event
    body = {"model": MODEL, "messages": ASK, "tools": CHAT_TOOLS, "tool_choice": "required", "max_tokens": 5}
    bad = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens", bad.text
    assert "tool call" in bad.json()["error"]["message"]
    streamed = httpx.post(server.url + "/v1/chat/completions", json={**body, "stream": True},
                          timeout=120).text
    assert '"param": "max_tokens"' in streamed and streamed.rstrip().endswith("data: [DONE]")


# ----- /v1/responses ----------------------------------------------------------------------------------------
def test_response_text_is_the_chat_completion_of_the_same_messages(client, server):
    kw = {"temperature": 0.0}
    r = client.responses.create(model=MODEL, input="Tell me about Emma.", instructions="Be brief.",
                                max_output_tokens=12, **kw)
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Tell me about Emma."}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, **kw)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert r.output_text == chat.choices[0].message.content and r.output[0].type == "message"
    assert r.usage.input_tokens == tokens_of(server, messages) == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert r.instructions == "Be brief." and r.max_output_tokens == 12
    assert client.responses.retrieve(r.id).output_text == r.output_text
    # input as a list of messages, with "" as the model
    r2 = client.responses.create(model="", input=messages, max_output_tokens=12, **kw)
    assert r2.output_text == r.output_text and r2.model == MODEL


def test_previous_response_id_continues_the_conversation(client, server):
    first = client.responses.create(model=MODEL, input="Who is Emma?", max_output_tokens=6, temperature=0.0)
    second = client.responses.create(model=MODEL, input="And Mr. Knightley?", previous_response_id=first.id,
                                     max_output_tokens=6, temperature=0.0)
    conversation = [{"role": "user", "content": "Who is Emma?"},
                    {"role": "assistant", "content": first.output_text},
                    {"role": "user", "content": "And Mr. Knightley?"}]
    assert second.usage.input_tokens == tokens_of(server, conversation)
    assert second.previous_response_id == first.id
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=MODEL, input="x", previous_response_id="resp_unknown")
    assert e.value.body["param"] == "previous_response_id" and "resp_unknown" in e.value.body["message"]
    unstored = client.responses.create(model=MODEL, input="x", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)


def test_response_streaming_events(client):
    kw = {"model": MODEL, "input": "Tell me about Emma.", "max_output_tokens": 10, "temperature": 0.0}
    whole = client.responses.create(**kw)
    events = list(client.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", f"response.{whole.status}"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = next(e for e in events if e.type == "response.output_text.done")
    assert deltas == done.text == events[-1].response.output_text == whole.output_text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens


def test_response_function_tools(client):
    r = client.responses.create(model=MODEL, input="Weather in Bath?", tools=[RESP_TOOL],
                                tool_choice="required", parallel_tool_calls=False, temperature=1.0,
                                extra_body={"seed": 2})
    assert r.status == "completed" and [o.type for o in r.output] == ["function_call"]
    call = r.output[0]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), CITY)
    # streamed: the same call as function_call events
    events = list(client.responses.create(model=MODEL, input="Weather in Bath?", tools=[RESP_TOOL],
                                          tool_choice="required", parallel_tool_calls=False, temperature=1.0,
                                          extra_body={"seed": 2}, stream=True))
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert done.arguments == call.arguments and events[-1].response.output[0].name == "get_weather"
    # the tool's result goes back as a function_call_output item of the next turn
    follow = client.responses.create(model=MODEL, previous_response_id=r.id, max_output_tokens=4,
                                     input=[{"type": "function_call_output", "call_id": call.call_id,
                                             "output": "rain"}])
    assert follow.status in ("completed", "incomplete") and follow.usage.input_tokens > r.usage.input_tokens
