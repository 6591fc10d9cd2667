"""``background: true`` responses (the Responses API): the request is answered at once with status
``queued``; the work runs in a task and its result replaces the stored response, which ``GET
/v1/responses/{id}`` returns; ``POST /v1/responses/{id}/cancel`` stops it (status ``cancelled``). Also
``enable_response_messages`` (vLLM's): the prompt and the output as raw text and token ids."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from forwardpass.errors import ForwardpassError, ValidationError

if TYPE_CHECKING:
    from forwardpass.loader.tokenizer import Tokenizer
    from forwardpass.server.responses import ResponseStore

log = logging.getLogger(__name__)


class _NeverGone:
    """Stands in for the HTTP request of a background response: its client has been answered already, so
    its disconnect must not abort the work."""

    async def receive(self) -> dict[str, Any]:
        await asyncio.Event().wait()  # never returns; cancelled with the work
        raise AssertionError("unreachable")


NEVER_GONE = _NeverGone()


class BackgroundResponses:
    def __init__(self, store: ResponseStore) -> None:
        self.store = store
        self.tasks: dict[str, asyncio.Task[Any]] = {}

    def start(self, rid: str, work: Coroutine[Any, Any, Any]) -> None:
        async def run() -> None:
            try:
                await work
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - kept as the response's error, for the client's GET
                log.warning("background response %s failed: %s", rid, exc)
                messages, body = self.store.get(rid)
                code = (exc.code if isinstance(exc, ForwardpassError) else None) or "server_error"
                self.store.put(rid, messages, {**body, "status": "failed",
                                               "error": {"code": code, "message": str(exc)}})
            finally:
                self.tasks.pop(rid, None)

        self.tasks[rid] = asyncio.ensure_future(run())

    async def cancel(self, rid: str) -> dict[str, Any]:
        """vLLM's rules: only a background response still queued or running can be cancelled."""
        messages, body = self.store.get(rid, "response_id")
        if body.get("status") not in ("queued", "in_progress"):
            raise ValidationError("Cannot cancel a synchronous response.", param="response_id")
        body = {**body, "status": "cancelled"}
        self.store.put(rid, messages, body)
        task = self.tasks.pop(rid, None)
        if task is not None:
            task.cancel()  # the chat request's streams close, which aborts its engine requests
            await asyncio.gather(task, return_exceptions=True)
        return body


def raw_messages(tokenizer: Tokenizer | None, prompt_ids: list[int], output_ids: list[int]) -> dict[str, Any]:
    """vLLM's ``input_messages`` / ``output_messages``: the prompt and the output, each as the text its
    tokens spell (special tokens kept) and the token ids."""
    def raw(ids: list[int]) -> list[dict[str, Any]]:
        text = tokenizer.decode(ids, skip_special_tokens=False) if tokenizer is not None else ""
        return [{"type": "raw_message_tokens", "message": text, "tokens": list(ids)}]

    return {"input_messages": raw(prompt_ids), "output_messages": raw(output_ids)}
