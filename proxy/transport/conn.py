"""One HTTP/1.1 connection to a server, on httptools (the C parser uvicorn uses): one exchange at a
time, parsed as it arrives, with flow control (a client that reads slowly pauses the server's socket
instead of growing a buffer) and a read timeout that costs one timer per connection, not one per
read. What went wrong is a `Broken` with its kind; the facade (upstream.py) names it after its server.
"""

from __future__ import annotations

import asyncio
from typing import cast

import httptools

from ..kinds import ErrorKind

# The largest response head (status line and headers) read from a server; larger: a protocol error.
MAX_HEAD_BYTES = 64 * 1024
# Body bytes held for a reader before the server's socket is paused.
_BUFFER_HIGH = 256 * 1024


class Broken(Exception):
    """What went wrong on a connection, before it is named after its server."""

    def __init__(self, kind: ErrorKind, what: str) -> None:
        super().__init__(what)
        self.kind = kind


def _too_large() -> Broken:
    return Broken("protocol", f"response head larger than {MAX_HEAD_BYTES // 1024} KiB")


class Conn(asyncio.Protocol):
    """One connection; one exchange at a time. httptools calls the on_* methods while parsing."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.idle_since = 0.0
        self.reused = False
        self.last_data = 0.0
        self.timeout_s = 0.0
        self.timer: asyncio.TimerHandle | None = None
        self._reset()

    def _reset(self) -> None:
        self.active = False
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.headers_done = False
        self.head_bytes = 0
        self.keep_alive = False
        self.complete = False
        self.got_bytes = False
        self.body: list[bytes] = []
        self.buffered = 0
        self.paused = False
        self.error: Broken | None = None
        self.waiter: asyncio.Future[None] | None = None

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports do not subclass asyncio.Transport, but they are ones.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if not self.active:
            # Bytes nobody asked for (after a complete response): this connection is not reusable.
            self.abort()
            return
        self.got_bytes = True
        self.last_data = asyncio.get_running_loop().time()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(Broken("protocol", "the server switched protocols"))
        except httptools.HttpParserError as exc:
            self._fail(Broken("protocol", f"malformed HTTP ({exc})"))
        if not self.headers_done:
            # Everything so far is head: httptools would hold a head of any size in memory.
            self.head_bytes += len(data)
            if self.head_bytes > MAX_HEAD_BYTES:
                self._fail(_too_large())

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.active and not self.complete and self.error is None:
            # Only a clean close ends a body that has no length: a reset cuts it short.
            if exc is None and self.headers_done and self._ends_at_eof():
                self.complete = True
            else:
                self.error = Broken("disconnect", "connection lost" + (f" ({exc})" if exc else ""))
        self._wake()

    # httptools callbacks
    def on_message_begin(self) -> None:
        if self.headers_done:
            # A second response to one request: stop parsing (feed_data raises, the exchange fails).
            raise Broken("protocol", "more than one response to a request")

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))
        self.head_bytes += len(name) + len(value) + 4

    def on_headers_complete(self) -> None:
        if self.head_bytes > MAX_HEAD_BYTES:  # a large head that came in one read
            self._fail(_too_large())
            return
        self.status = self.parser.get_status_code()
        # Asked now: once the message is complete the parser has already reset.
        self.keep_alive = self.parser.should_keep_alive()
        self.headers_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        self.body.append(body)
        self.buffered += len(body)
        if self.buffered > _BUFFER_HIGH and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        self.complete = True
        self._wake()

    # the exchange
    def _ends_at_eof(self) -> bool:
        names = {k.lower() for k, _ in self.headers}
        return b"content-length" not in names and b"transfer-encoding" not in names

    def _fail(self, err: Broken) -> None:
        if self.error is None:
            self.error = err
        self.abort()
        self._wake()

    def _wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def wait(self, timeout_s: float) -> None:
        """Until the parser has news (headers, body, end, error), or no byte came for `timeout_s`."""
        loop = asyncio.get_running_loop()
        self.waiter = waiter = loop.create_future()
        self.timeout_s = timeout_s
        if self.timer is None:
            self.timer = loop.call_at(self.last_data + timeout_s, self._check_timeout)
        try:
            await waiter
        finally:
            self.waiter = None

    def _check_timeout(self) -> None:
        # One timer per connection, moved on only when it fires: arrivals just note the time,
        # so a stream of chunks does not schedule and cancel a timer for each.
        self.timer = None
        w = self.waiter
        if w is None or w.done():
            return
        loop = asyncio.get_running_loop()
        due = self.last_data + self.timeout_s
        if loop.time() >= due:
            w.set_exception(Broken("timeout", "no data within the read timeout"))
        else:
            self.timer = loop.call_at(due, self._check_timeout)

    async def wait_briefly(self, within_s: float) -> None:
        """Wait at most `within_s` for more of the body, its end or an error; never raises."""
        if self.body or self.complete or self.error is not None:
            return
        loop = asyncio.get_running_loop()
        self.waiter = waiter = loop.create_future()
        timer = loop.call_later(within_s, self._wake)
        try:
            await waiter
        finally:
            self.waiter = None
            timer.cancel()

    def begin(self, request: bytes) -> None:
        self._reset()
        self.active = True
        self.last_data = asyncio.get_running_loop().time()
        assert self.transport is not None
        self.transport.write(request)

    def take_body(self) -> bytes:
        body = self.body
        chunk = body[0] if len(body) == 1 else b"".join(body)
        self.body = []
        self.buffered = 0
        if self.paused and self.transport is not None and not self.closed:
            self.paused = False
            self.transport.resume_reading()
        return chunk

    def reusable(self) -> bool:
        return self.complete and self.keep_alive and not self.closed and self.error is None

    def stop_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def abort(self) -> None:
        self.closed = True
        self.stop_timer()
        if self.transport is not None:
            self.transport.close()
