"""A lean client for one streaming POST: HTTP/1.1 over asyncio streams, server-sent events out.

The load generator shares its machine with the server it measures, so its own cost per
event counts against the server: httpx's streaming path spends about 90 us of CPU per
event, this one a small fraction of that (one connection per request, `Connection: close`,
chunked or plain bodies, no TLS, no redirects, no proxies: only what a load test needs).
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator
from urllib.parse import urlsplit


class StreamClosed(Exception):
    """The connection ended before the response did."""


class SSEResponse:
    """The status and headers of a response; `events()` yields each event's data (bytes)."""

    def __init__(self, status: int, headers: dict[str, str], reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter) -> None:
        self.status = status
        self.headers = headers
        self._reader = reader
        self._writer = writer

    async def body(self) -> bytes:
        """The whole body (for a response that is not a stream, such as an error)."""
        return b"".join([piece async for piece in self._pieces()])

    async def events(self) -> AsyncIterator[bytes]:
        buffer = b""
        async for piece in self._pieces():
            buffer += piece
            *complete, buffer = buffer.split(b"\n\n")
            for event in complete:
                for line in event.split(b"\n"):
                    if line.startswith(b"data: "):
                        yield line[6:]

    async def _pieces(self) -> AsyncIterator[bytes]:
        reader = self._reader
        if self.headers.get("transfer-encoding", "").lower() == "chunked":
            while True:
                size_line = await reader.readline()
                if not size_line.endswith(b"\n"):
                    raise StreamClosed("the connection closed inside a chunked body")
                size = int(size_line.split(b";", 1)[0], 16)
                if size == 0:
                    return
                try:
                    data = await reader.readexactly(size + 2)
                except asyncio.IncompleteReadError:
                    raise StreamClosed("the connection closed inside a chunk") from None
                yield data[:-2]
        elif "content-length" in self.headers:
            try:
                yield await reader.readexactly(int(self.headers["content-length"]))
            except asyncio.IncompleteReadError:
                raise StreamClosed("the connection closed inside the body") from None
        else:
            while piece := await reader.read(65536):
                yield piece

    def close(self) -> None:
        self._writer.close()


async def post_stream(url: str, path: str, body: bytes, headers: dict[str, str] | None = None) -> SSEResponse:
    """Send `POST path` with a JSON body and read the status and headers. ConnectionRefusedError
    (nobody listens), OSError and StreamClosed (the connection broke) propagate."""
    parts = urlsplit(url)
    host, port = parts.hostname, parts.port or 80
    reader, writer = await asyncio.open_connection(host, port)
    try:
        lines = [f"POST {path} HTTP/1.1", f"Host: {parts.netloc}", "Content-Type: application/json",
                 f"Content-Length: {len(body)}", "Accept: text/event-stream", "Connection: close",
                 *(f"{name}: {value}" for name, value in (headers or {}).items())]
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)
        status_line = await reader.readline()
        if not status_line:
            raise StreamClosed("the connection closed before a response")
        status = int(status_line.split(None, 2)[1])
        response_headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            response_headers[name.strip().lower()] = value.strip()
    except BaseException:
        writer.close()
        raise
    return SSEResponse(status, response_headers, reader, writer)
