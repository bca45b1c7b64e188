"""uvicorn's HTTP/1.1 protocol with a deadline for a request's headers.

uvicorn closes idle keep-alive connections but waits forever for a request whose
headers never finish, so a few thousand half-sent requests would hold as many sockets
(and their buffers) for good. Here a request's headers must be complete
`header_timeout` seconds after the connection opened, or after the request's first
byte on a kept-alive connection; else it is answered 408 and the connection closed
(a connection that sent nothing is just closed). The body's own deadline is the application's
(limits.read_body), since uvicorn hands the request over once its headers are in.
"""

from __future__ import annotations

import asyncio
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

_TIMEOUT_RESPONSE = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
                     b"content-length: %d\r\n\r\n%s")
_TIMEOUT_BODY = (b'{"error":{"message":"the request headers did not arrive in time","type":'
                 b'"invalid_request_error","param":null,"code":"request_timeout"}}')


def protocol_with_header_timeout(header_timeout: float) -> type[H11Protocol]:
    """An H11Protocol class (uvicorn's `http=` setting) enforcing `header_timeout` seconds."""

    class HeaderTimeoutProtocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            cycle = self.cycle
            super().data_received(data)
            if self.cycle is not cycle:  # a request's headers are in: the application takes over
                self._disarm()
            elif self._header_timer is None and (cycle is None or cycle.response_complete):
                self._arm()  # the first bytes of the next request on a kept-alive connection

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(header_timeout, self._timed_out)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _timed_out(self) -> None:
            self._header_timer = None
            if self.transport.is_closing() or (self.cycle is not None and not self.cycle.response_complete):
                return
            if self.conn.trailing_data[0]:  # part of a request came: tell the client why it is cut off
                self.transport.write(_TIMEOUT_RESPONSE % (len(_TIMEOUT_BODY), _TIMEOUT_BODY))
            self.transport.close()

    return HeaderTimeoutProtocol
