"""``POST /v1/responses`` (OpenAI's Responses API) on top of the chat path, and the in-memory store behind
``previous_response_id`` (``GET`` / ``DELETE /v1/responses/{id}`` too).

Each request becomes a chat request (``responses_protocol.py``) that ``Serving.chat`` runs as any other;
its answer is rewritten as a response object: reasoning (with a reasoning parser) as a ``reasoning`` item,
text as a ``message`` item with one ``output_text`` part, tool calls as ``function_call`` items. A stream
is the chat stream rewritten as Responses events (``event: <type>`` + ``data: {...}``): response.created,
response.in_progress, then per item output_item.added / content_part.added / output_text.delta ... done,
and response.completed (``response.incomplete`` when ``max_output_tokens`` cut it short).

Stored responses (``store``, the default) keep their conversation (input messages + the answer) for the
next turn's ``previous_response_id``, in memory, the ``ServerConfig.responses_max_stored`` most recent
(least recently used first out).
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterable, AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import ValidationError as PydanticValidationError

from forwardpass.errors import ForwardpassError
from forwardpass.server.responses_background import NEVER_GONE, BackgroundResponses, raw_messages
from forwardpass.server.responses_protocol import ResponsesRequest
from forwardpass.server.serving import ClientDisconnected, Serving
from forwardpass.server.sse import SSEResponse


class ResponseNotFoundError(ForwardpassError):
    error_type = "not_found_error"
    status_code = 404


class ResponseStore:
    """The most recent ``capacity`` stored responses: id -> (conversation messages, response object)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, tuple[list[dict[str, Any]], dict[str, Any]]] = OrderedDict()

    def put(self, rid: str, messages: list[dict[str, Any]], response: dict[str, Any]) -> None:
        if self.capacity <= 0:
            return
        self._items[rid] = (messages, response)
        self._items.move_to_end(rid)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, rid: str, param: str | None = None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        if rid not in self._items:
            raise ResponseNotFoundError(
                f"Response with id {rid!r} not found. This server keeps the {self.capacity} most recent "
                "responses made with store: true, in memory.", param=param, code="response_not_found")
        self._items.move_to_end(rid)
        return self._items[rid]

    def status(self, rid: str) -> str | None:
        """The stored response's status (None when not stored)."""
        item = self._items.get(rid)
        return None if item is None else item[1].get("status")

    def delete(self, rid: str) -> None:
        self.get(rid)
        del self._items[rid]

    def __len__(self) -> int:
        return len(self._items)


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _usage(chat_usage: dict[str, Any] | None) -> dict[str, Any] | None:
    if chat_usage is None:
        return None
    details = chat_usage.get("completion_tokens_details") or {}
    return {"input_tokens": chat_usage["prompt_tokens"], "output_tokens": chat_usage["completion_tokens"],
            "total_tokens": chat_usage["total_tokens"], "input_tokens_details": {"cached_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": details.get("reasoning_tokens", 0)}}


def _message_item(text: str, status: str = "completed", item_id: str | None = None,
                  logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"id": item_id or _new_id("msg"), "type": "message", "role": "assistant", "status": status,
            "content": [_text_part(text, logprobs)]}


def _text_part(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def _logprobs(choice: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat choice's logprobs as output_text logprobs (the same token / logprob / bytes / top_logprobs)."""
    return list((choice.get("logprobs") or {}).get("content") or [])


def _reasoning_item(text: str, item_id: str | None = None) -> dict[str, Any]:
    return {"id": item_id or _new_id("rs"), "type": "reasoning", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": "completed"}


def _call_item(call_id: str, name: str, arguments: str, status: str = "completed",
               item_id: str | None = None, namespaces: dict[str, tuple[str, str]] | None = None,
               ) -> dict[str, Any]:
    item = {"id": item_id or _new_id("fc"), "type": "function_call", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}
    if name in (namespaces or {}):  # a namespaced tool: its own name, and the namespace beside it
        item["namespace"], item["name"] = (namespaces or {})[name]
    return item


class ResponsesService:
    def __init__(self, serving: Serving, capacity: int) -> None:
        self.serving = serving
        self.store = ResponseStore(capacity)
        self.background = BackgroundResponses(self.store)

    def envelope(self, req: ResponsesRequest, rid: str, created: int, model: str, status: str,
                 output: list[dict[str, Any]], usage: dict[str, Any] | None) -> dict[str, Any]:
        return {"id": rid, "object": "response", "created_at": created, "model": model, "status": status,
                "output": output, "usage": usage, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                **req.echo_fields()}

    async def create(self, req: ResponsesRequest, request: Request) -> Response | dict[str, Any]:
        history = self.store.get(req.previous_response_id, "previous_response_id")[0] \
            if req.previous_response_id else []
        try:
            chat_req = req.chat_request(history)
        except PydanticValidationError as exc:
            raise RequestValidationError(exc.errors()) from None
        messages = [m.model_dump(exclude_none=True) for m in chat_req.messages]
        model = self.serving.resolve_model(chat_req.model)[0]
        rid, created = _new_id("resp"), int(time.time())
        if req.background:  # answered at once; the work goes on in a task (cancel: POST .../cancel)
            queued = self.envelope(req, rid, created, model, "queued", [], None)
            self.store.put(rid, messages, queued)
            self.background.start(rid, self._run(req, chat_req, rid, created, model, messages, NEVER_GONE))
            return queued
        try:
            return await self._run(req, chat_req, rid, created, model, messages, request)
        except ClientDisconnected:
            return Response(status_code=499)

    async def _run(self, req: ResponsesRequest, chat_req: Any, rid: str, created: int, model: str,
                   messages: list[dict[str, Any]], request: Any) -> Response | dict[str, Any]:
        result = await self.serving.chat(chat_req, request)
        if isinstance(result, SSEResponse):
            return SSEResponse(self._events(req, rid, created, model, messages, result.body_iterator))
        choice = result["choices"][0]
        msg = choice["message"]
        output: list[dict[str, Any]] = []
        if msg.get("reasoning_content"):
            output.append(_reasoning_item(msg["reasoning_content"]))
        status = "incomplete" if choice["finish_reason"] == "length" else "completed"
        if msg.get("content"):
            output.append(_message_item(msg["content"], status, logprobs=_logprobs(choice)))
        output += [_call_item(c["id"], c["function"]["name"], c["function"]["arguments"],
                              namespaces=req.namespaces()) for c in msg.get("tool_calls") or []]
        body = self.envelope(req, rid, created, model, status, output, _usage(result["usage"]))
        if req.enable_response_messages:
            body.update(raw_messages(self.serving.engine.tokenizer, result.get("prompt_token_ids") or [],
                                     choice.get("token_ids") or []))
        if req.store and self.store.status(rid) != "cancelled":
            answer = _assistant_message(msg.get("content"), msg.get("tool_calls"))
            self.store.put(rid, [*messages, answer], body)
        return body

    async def _events(self, req: ResponsesRequest, rid: str, created: int, model: str,
                      messages: list[dict[str, Any]], chunks: AsyncIterable[Any]) -> AsyncIterator[str]:
        """The chat stream's chunks rewritten as Responses events."""
        seq = 0
        output: list[dict[str, Any]] = []  # items, in the order they were opened
        open_text: dict[str, Any] | None = None  # the message or reasoning item text goes to now
        calls: dict[int, dict[str, Any]] = {}  # chat tool-call index -> function_call item
        usage: dict[str, Any] | None = None
        finish: str | None = None

        namespaces = req.namespaces()

        def event(kind: str, **fields: Any) -> str:
            nonlocal seq
            seq += 1
            data = {"type": kind, "sequence_number": seq - 1, **fields}
            return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

        def close_text() -> list[str]:
            nonlocal open_text
            if open_text is None:
                return []
            item, open_text = open_text, None
            i = output.index(item)
            if item["type"] == "reasoning":
                text = item["content"][0]["text"]
                return [event("response.reasoning_text.done", item_id=item["id"], output_index=i,
                              content_index=0, text=text),
                        event("response.output_item.done", output_index=i,
                              item={**item, "status": "completed"})]
            text = item["content"][0]["text"]
            item["status"] = "completed"
            lps = item["content"][0]["logprobs"]
            return [event("response.output_text.done", item_id=item["id"], output_index=i, content_index=0,
                          text=text, logprobs=lps),
                    event("response.content_part.done", item_id=item["id"], output_index=i, content_index=0,
                          part=_text_part(text, lps)),
                    event("response.output_item.done", output_index=i, item=item)]

        def text_delta(kind: str, delta: str, logprobs: list[dict[str, Any]] | None = None) -> list[str]:
            nonlocal open_text
            out: list[str] = []
            if open_text is None or open_text["type"] != kind:
                out += close_text()
                open_text = (_reasoning_item("") if kind == "reasoning"
                             else {**_message_item(""), "status": "in_progress"})
                output.append(open_text)
                i = len(output) - 1
                out.append(event("response.output_item.added", output_index=i,
                                 item={**open_text, "content": []}))
                if kind == "message":
                    out.append(event("response.content_part.added", item_id=open_text["id"], output_index=i,
                                     content_index=0, part=_text_part("")))
            open_text["content"][0]["text"] += delta
            i = output.index(open_text)
            extra: dict[str, Any] = {} if kind == "reasoning" else {"logprobs": logprobs or []}
            if kind == "message" and logprobs:
                open_text["content"][0]["logprobs"].extend(logprobs)
            out.append(event("response.reasoning_text.delta" if kind == "reasoning"
                             else "response.output_text.delta", item_id=open_text["id"], output_index=i,
                             content_index=0, delta=delta, **extra))
            return out

        def call_delta(tc: dict[str, Any]) -> list[str]:
            out: list[str] = []
            fn = tc.get("function") or {}
            if tc["index"] not in calls:
                out += close_text()
                item = _call_item(tc.get("id") or _new_id("call"), fn.get("name") or "", "", "in_progress",
                                  namespaces=namespaces)
                calls[tc["index"]] = item
                output.append(item)
                out.append(event("response.output_item.added", output_index=len(output) - 1, item=dict(item)))
            item = calls[tc["index"]]
            if fn.get("arguments"):
                item["arguments"] += fn["arguments"]
                out.append(event("response.function_call_arguments.delta", item_id=item["id"],
                                 output_index=output.index(item), delta=fn["arguments"]))
            return out

        start = self.envelope(req, rid, created, model, "in_progress", [], None)
        yield event("response.created", response=start)
        yield event("response.in_progress", response=start)
        try:
            async for raw in chunks:
                data = raw[len("data: "):].strip() if isinstance(raw, str) else ""
                if not data or data == "[DONE]":
                    continue
                chunk = json.loads(data)
                if "error" in chunk:  # the chat stream failed after it started
                    err = chunk["error"]
                    yield event("error", code=err.get("code") or err.get("type"), message=err["message"],
                                param=err.get("param"))
                    failed = self.envelope(req, rid, created, model, "failed", output, None)
                    failed["error"] = {"code": err.get("code") or err.get("type"), "message": err["message"]}
                    yield event("response.failed", response=failed)
                    return
                usage = _usage(chunk.get("usage")) or usage
                for choice in chunk.get("choices") or []:
                    delta = choice.get("delta") or {}
                    for text in ([delta["reasoning_content"]] if delta.get("reasoning_content") else []):
                        for e in text_delta("reasoning", text):
                            yield e
                    if delta.get("content"):
                        for e in text_delta("message", delta["content"], _logprobs(choice)):
                            yield e
                    for tc in delta.get("tool_calls") or []:
                        for e in call_delta(tc):
                            yield e
                    finish = choice.get("finish_reason") or finish
        finally:
            aclose = getattr(chunks, "aclose", None)
            if aclose is not None:
                await aclose()
        for e in close_text():
            yield e
        for item in calls.values():
            item["status"] = "completed"
            i = output.index(item)
            yield event("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                        name=item["name"], arguments=item["arguments"])
            yield event("response.output_item.done", output_index=i, item=item)
        status = "incomplete" if finish == "length" else "completed"
        final = self.envelope(req, rid, created, model, status, output, usage)
        if req.store:
            text = "".join(it["content"][0]["text"] for it in output if it["type"] == "message")
            tool_calls = [{"id": c["call_id"], "type": "function",
                           "function": {"name": c["name"], "arguments": c["arguments"]}}
                          for c in calls.values()]
            self.store.put(rid, [*messages, _assistant_message(text or None, tool_calls or None)], final)
        yield event(f"response.{status}", response=final)


def _assistant_message(content: str | None, tool_calls: list[dict[str, Any]] | None) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls:
        msg["tool_calls"] = [{"id": c["id"], "type": "function", "function": dict(c["function"])}
                             for c in tool_calls]
    return msg


def responses_router(service: ResponsesService) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/responses", response_model=None)
    async def create_response(req: ResponsesRequest, request: Request) -> Response | dict[str, Any]:
        return await service.create(req, request)

    @router.get("/v1/responses/{response_id}", response_model=None)
    async def get_response(response_id: str) -> dict[str, Any]:
        return service.store.get(response_id, "response_id")[1]

    @router.post("/v1/responses/{response_id}/cancel", response_model=None)
    async def cancel_response(response_id: str) -> dict[str, Any]:
        return await service.background.cancel(response_id)

    @router.delete("/v1/responses/{response_id}", response_model=None)
    async def delete_response(response_id: str) -> dict[str, Any]:
        service.store.delete(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    return router
