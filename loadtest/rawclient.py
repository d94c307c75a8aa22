"""A minimal HTTP/1.1 keep-alive client for the overhead benchmark's load generator.

The overhead benchmark must drive targets faster than they can serve, from one process on a
machine it shares with them. aiohttp's client spends most of a small request's time in its own
machinery (measured: the generator at 98-100% of a core while the zero-delay backend still had
room), so this client does the least a client can: one connection per closed-loop worker, a
request prebuilt as bytes, and httptools (uvicorn's C parser) to find the status, the body chunks
and the end of each response. It times what arrives; it does not interpret it.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import cast

import httptools


@dataclass
class Exchange:
    """One response as it arrived: status, and the arrival time of each SSE event with data."""

    status: int = 0
    events: list[float] = field(default_factory=list)


class _Conn(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.current: Exchange | None = None
        self.done: asyncio.Future[Exchange] | None = None
        self.lost: BaseException | None = None

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports do not subclass asyncio.Transport, but they are ones.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(exc)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = exc or ConnectionResetError("connection closed by the server")
        self._fail(self.lost)

    # httptools callbacks
    def on_status(self, status: bytes) -> None:
        assert self.current is not None
        self.current.status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        ex = self.current
        assert ex is not None
        n = body.count(b"data: {")
        if n:
            now = time.perf_counter()
            ex.events.extend([now] * n)

    def on_message_complete(self) -> None:
        if self.done is not None and not self.done.done() and self.current is not None:
            self.done.set_result(self.current)

    def _fail(self, exc: BaseException) -> None:
        if self.done is not None and not self.done.done():
            self.done.set_exception(exc)


class RawClient:
    """One keep-alive connection; `send` waits for the whole response."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self._conn: _Conn | None = None

    async def _connect(self) -> _Conn:
        loop = asyncio.get_running_loop()
        _, conn = await loop.create_connection(_Conn, self.host, self.port)
        return conn

    async def send(self, request: bytes) -> Exchange:
        conn = self._conn
        if conn is None or conn.lost is not None:
            conn = self._conn = await self._connect()
        assert conn.transport is not None
        conn.current = Exchange()
        conn.done = asyncio.get_running_loop().create_future()
        conn.transport.write(request)
        return await conn.done

    def close(self) -> None:
        if self._conn is not None and self._conn.transport is not None:
            self._conn.transport.close()
        self._conn = None


def post(host: str, port: int, path: str, body: bytes, headers: dict[str, str] | None = None) -> bytes:
    """A POST request as bytes, ready to write on a keep-alive connection."""
    lines = [
        f"POST {path} HTTP/1.1",
        f"Host: {host}:{port}",
        "Content-Type: application/json",
        f"Content-Length: {len(body)}",
        *(f"{k}: {v}" for k, v in (headers or {}).items()),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body
