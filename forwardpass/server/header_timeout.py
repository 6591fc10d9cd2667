"""A deadline on a request's headers (slowloris): uvicorn's h11 protocol waits for the end of the
headers for ever, so a client that opens connections and sends a header byte now and then would hold
them all. Here a connection whose request line and headers are not complete within ``timeout_s`` of
the connection opening, or of the first byte of the next request on a kept-alive connection, gets
``408 Request Timeout`` and is closed. (The body has its own deadline: ``BodyLimitMiddleware``.)"""

from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

_REPLY = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"


class HeaderTimeoutProtocol(H11Protocol):
    timeout_s = 30.0
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE:  # a request begun, its headers not complete yet
            self._arm()
        else:
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self._header_timer is None:  # not re-armed by each byte: the deadline is for all the headers
            self._header_timer = self.loop.call_later(self.timeout_s, self._expired)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _expired(self) -> None:
        self._header_timer = None
        idle = self.cycle is None or self.cycle.response_complete  # never cut a response being sent
        if idle and self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.write(_REPLY)
            self.transport.close()


def header_timeout_protocol(timeout_s: float) -> type[HeaderTimeoutProtocol]:
    """The protocol class uvicorn instantiates per connection, with this deadline."""
    return type("HeaderTimeoutProtocol", (HeaderTimeoutProtocol,), {"timeout_s": timeout_s})
