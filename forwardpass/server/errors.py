"""Every error leaves the server in OpenAI's envelope: ``{"error": {"message", "type", "param", "code"}}``.

Schema and JSON errors are 400 (not FastAPI's 422); ``ForwardpassError`` subclasses carry their own
status (400 validation, 404 unknown model, 503 queue full / engine dead, ...).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from forwardpass.errors import ContextLengthError, EngineRestartingError, ForwardpassError, QueueFullError

logger = logging.getLogger(__name__)

_HTTP_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error",
               413: "invalid_request_error", 429: "rate_limit_error", 503: "server_overloaded"}


def envelope(
    message: str, type_: str, param: str | None = None, code: str | int | None = None
) -> dict[str, dict[str, str | int | None]]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(status: int, message: str, type_: str | None = None, param: str | None = None,
                   code: str | int | None = None, headers: Mapping[str, str] | None = None) -> JSONResponse:
    return JSONResponse(envelope(message, type_ or _HTTP_TYPES.get(status, "api_error"), param, code),
                        status_code=status, headers=headers)


def error_bytes(status: int, message: str, code: str | None = None) -> bytes:
    return json.dumps(envelope(message, _HTTP_TYPES.get(status, "api_error"), None, code)).encode()


def from_exception(exc: BaseException, retry_after_s: int = 1) -> JSONResponse:
    """The response for an exception raised while handling a request."""
    if isinstance(exc, ForwardpassError):
        headers = {"Retry-After": str(retry_after_s)} if isinstance(exc, QueueFullError) else None
        if isinstance(exc, EngineRestartingError):  # back once the engine has reloaded: it knows when
            headers = {"Retry-After": str(exc.retry_after_s)}  # not logged: the supervisor logs the restart
        elif exc.status_code >= 500:
            logger.warning("request failed: %s", exc)
        code = exc.code or ("context_length_exceeded" if isinstance(exc, ContextLengthError) else None)
        return error_response(exc.status_code, exc.message, exc.error_type, exc.param, code, headers)
    logger.error("unhandled error", exc_info=exc)
    return error_response(500, f"internal server error: {type(exc).__name__}", "internal_error")


def sse_error(exc: BaseException) -> str:
    """A failure in the middle of a stream: an error event (then the caller sends ``[DONE]``)."""
    if isinstance(exc, ForwardpassError):
        body = envelope(exc.message, exc.error_type, exc.param, exc.code)
    else:
        logger.error("stream failed", exc_info=exc)
        body = envelope(f"internal server error: {type(exc).__name__}", "internal_error")
    return f"data: {json.dumps(body)}\n\n"


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    err = errors[0]
    loc = [str(x) for x in err.get("loc", ()) if x not in ("body",)]
    if err.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {err.get('msg')}", None
    param = ".".join(loc) or None
    msg = str(err.get("msg", "invalid value"))
    msg = msg.removeprefix("Value error, ")
    more = f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else ""
    return (f"{param}: {msg}" if param else msg) + more, param


def install(app: FastAPI, retry_after_s: int) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(400, message, "invalid_request_error", param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))

    @app.exception_handler(ForwardpassError)
    async def _fp(request: Request, exc: ForwardpassError) -> JSONResponse:
        return from_exception(exc, retry_after_s)

    @app.exception_handler(Exception)
    async def _any(request: Request, exc: Exception) -> JSONResponse:
        return from_exception(exc, retry_after_s)
