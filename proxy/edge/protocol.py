"""The client side of a connection: how long a client may hold a socket before it has asked for
anything, how large a request head may grow, and how many connections may be open at once.

uvicorn (0.54, pinned) arms its keep-alive timer only after a response and cancels it on any
byte; a connection that never sends a byte, or sends half a request head, stays open forever,
and httptools accumulates a head without limit. `EdgeProtocol` is uvicorn's httptools
protocol with these limits added (`edge_protocol()` binds the settings to it):

- the whole request head within `header_timeout_s`, counted from the accept (as nginx's
  `client_header_timeout`) or, on a kept-alive connection, from the first byte of the next request
  (as Envoy's `request_headers_timeout`); the idle time between requests is uvicorn's keep-alive
  timeout. A timed-out connection that sent part of a head gets 408; one that sent nothing is
  closed without a word, as nginx does;
- a head larger than `MAX_HEAD_BYTES` gets 431, counted exactly (request line and headers as
  parsed) however many writes it came in;
- past `max_connections` open connections, a new one is answered 503 and closed; the ones
  already open, running streams among them, are untouched;
- no connection is upgraded. specgate serves no WebSocket, and uvicorn's upgrade hands the socket to
  another protocol, out of every timeout and of the connection count. A request that asks for an
  upgrade (`Connection: Upgrade`, as curl's `--http2` sends for h2c) is served as the HTTP/1.1
  request it also is when it has no body, and the connection is closed after the answer (the parser
  reads nothing after an upgrade); one with a body gets 400 and is closed, because the parser hands
  an upgrade's body to the new protocol and specgate would relay an empty one;
- trailers of a chunked request body are dropped: they would otherwise join the request's
  headers after the fact and be forwarded upstream;
- a response that cannot be completed honestly (a server's JSON body that broke off after its first
  bytes went on) is cut: the app calls the scope's `ABORT` extension, which closes the connection,
  so the client's HTTP parser sees a body cut short rather than a complete one. ASGI has no message
  for it, and an app that raises or returns early is logged by uvicorn as its own failure.

Per request this costs a clock read: one timer per connection is moved on only when it fires.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from ..errors import error_body
from ..kinds import Rejection

# The largest request head (request line and headers) read; nginx's default allows 4 x 8 KiB lines.
MAX_HEAD_BYTES = 64 * 1024
# How long a connection answered 408 or 431 may take to read it before it is closed; one refused
# past the cap is closed once its request has come (read and dropped), or after _REFUSED_LINGER_S,
# so that refused connections hold few descriptors however fast they come back.
_LINGER_S = 1.0
_REFUSED_LINGER_S = 0.25
# Where the app's lifespan leaves its metrics for the protocol (uvicorn's shared lifespan state).
METRICS_KEY = "specgate.metrics"

_REASONS = {
    400: b"Bad Request",
    408: b"Request Timeout",
    431: b"Request Header Fields Too Large",
    503: b"Service Unavailable",
}
# The scope extension that cuts the connection of a response the app cannot complete.
ABORT = "specgate.abort"
# What a header line adds to the head besides its name and value (": " and CRLF).
_HEADER_OVERHEAD = 4


def _answer(status: int, message: str, code: str) -> bytes:
    body = error_body(message, "server_error" if status >= 500 else "invalid_request_error", code)
    head = b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n" % (
        status,
        _REASONS[status],
        len(body),
    )
    return head + body


@dataclass(frozen=True)
class Limits:
    """The settings' limits, and the answers that enforce them, built once per server."""

    header_timeout_s: float
    max_connections: int
    busy: bytes
    late: bytes
    large: bytes
    upgrade: bytes

    @classmethod
    def of(cls, header_timeout_s: float, max_connections: int) -> Limits:
        return cls(
            header_timeout_s,
            max_connections,
            busy=_answer(503, f"Too many connections (limit {max_connections}); try again.", "too_many_connections"),
            late=_answer(408, f"The request head did not arrive within {header_timeout_s:g} s.", "request_timeout"),
            large=_answer(431, f"The request head is larger than {MAX_HEAD_BYTES} bytes.", "request_header_too_large"),
            upgrade=_answer(
                400,
                "specgate does not upgrade connections (Upgrade: websocket, h2c); send the request without "
                "'Connection: Upgrade'.",
                "upgrade_not_supported",
            ),
        )


def _aborter(ref: weakref.ReferenceType[RequestResponseCycle]) -> Callable[[], None]:
    def abort() -> None:
        """Cut the connection under a response that cannot be completed. The cycle counts as
        disconnected: later writes go nowhere, and uvicorn logs nothing of it (the app has)."""
        cycle = ref()
        if cycle is not None:
            cycle.disconnected = True
            cycle.transport.close()

    return abort


def edge_protocol(header_timeout_s: float, max_connections: int) -> type[HttpToolsProtocol]:
    """EdgeProtocol with these limits (uvicorn takes a class for `http=`)."""
    limits = Limits.of(header_timeout_s, max_connections)
    return type("EdgeProtocol", (EdgeProtocol,), {"limits": limits})


class EdgeProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the limits above; `edge_protocol` binds the settings."""

    limits: ClassVar[Limits]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # When the head being waited for began (None: no head is being waited for).
        self._head_since: float | None = None
        self._head_bytes = 0
        self._timer: asyncio.TimerHandle | None = None
        self._refused = False  # past the cap: never one of uvicorn's connections
        self._answered = False  # refused or closed with an answer: what comes is dropped
        # The current head's size as parsed (request line and header lines), and whether its
        # headers are complete (what comes as headers then is a chunked body's trailers).
        self._head_parsed = 0
        self._in_body = False
        # An upgrade was asked for: the parser reads nothing more on this connection.
        self._close_after_response = False

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self.limits.max_connections:
            self._refuse(transport)
            return
        super().connection_made(transport)
        self._gauge(1)
        self._await_head()

    def data_received(self, data: bytes) -> None:
        if self._answered:
            # Read and dropped, so that closing sends no reset ahead of the answer.
            if self._refused:
                self.transport.close()
            return
        if self._head_since is None and (self.cycle is None or self.cycle.response_complete):
            self._await_head()  # the next request's first byte (a bare CRLF counts too)
        super().data_received(data)
        if self._head_since is not None:
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES and not self.transport.is_closing():
                self._close("head_too_large", self.limits.large)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._refused:
            self.parser = None  # type: ignore[assignment]  # as uvicorn does: no cycle left to collect
        else:
            self._gauge(-1)
            super().connection_lost(exc)

    # httptools callbacks
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_parsed, self._in_body = 0, False
        self._await_head()  # a pipelined head, begun while a response was still running

    def on_url(self, url: bytes) -> None:
        self._head_parsed += len(url)
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._in_body:
            return  # a trailer: dropped
        self._head_parsed += len(name) + len(value) + _HEADER_OVERHEAD
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._head_since = None
        self._head_bytes = 0
        self._in_body = True
        if self._answered:
            return
        if self._head_parsed > MAX_HEAD_BYTES:
            # The whole head came in one write: the per-write count never saw it pending.
            self._close("head_too_large", self.limits.large)
            return
        if self.parser.should_upgrade() and self._has_body():
            self._close("upgrade", self.limits.upgrade)
            return
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not None:
            # Bound to this request's cycle (a pipelined request may have the protocol's next), by a
            # weak reference: held in the cycle's own scope, a strong one would be a reference loop
            # that only the garbage collector frees, for every request.
            abort: Any = _aborter(weakref.ref(cycle))
            cycle.scope["extensions"] = {ABORT: abort}

    def on_body(self, body: bytes) -> None:
        if not self._answered:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if not self._answered:
            super().on_message_complete()

    # uvicorn's upgrade handling, turned off (see the module's docstring)
    def _should_upgrade(self) -> bool:
        return False

    def _unsupported_upgrade_warning(self) -> None:
        # Called once the parser stopped at an upgrade: nothing more is read on this
        # connection, so it ends with the current answer. Not logged: any client can ask.
        if self._answered:
            return  # refused: the answer lingers as _answer arranged
        self._close_after_response = True
        if self.cycle is None or self.cycle.response_complete:
            self.transport.close()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._close_after_response and not self.transport.is_closing():
            self.transport.close()

    def send_400_response(self, msg: str) -> None:
        if not self._answered:  # already answered (431, 400 upgrade): one answer only
            super().send_400_response(msg)

    def _has_body(self) -> bool:
        for name, value in self.headers:
            if name == b"transfer-encoding" or (name == b"content-length" and value.strip() not in (b"0", b"")):
                return True
        return False

    # the limits
    def _await_head(self) -> None:
        if self._head_since is not None:
            return
        self._head_since = now = self.loop.time()
        if self._timer is None:
            self._timer = self.loop.call_at(now + self.limits.header_timeout_s, self._check_head)

    def _check_head(self) -> None:
        # One timer per connection, moved on only when it fires: a request just notes the time.
        self._timer = None
        since = self._head_since
        if since is None or self.transport.is_closing():
            return
        due = since + self.limits.header_timeout_s
        if self.loop.time() < due:
            self._timer = self.loop.call_at(due, self._check_head)
            return
        running = self.cycle is not None and not self.cycle.response_complete
        # Nothing is written into a response still running, nor to a client that sent nothing.
        self._close("header_timeout", self.limits.late if self._head_bytes and not running else b"")

    def _close(self, event: Rejection, answer: bytes) -> None:
        self._count(event)
        self._head_since = None
        if answer:
            self._answer(self.transport, answer)
        else:
            self.transport.close()

    def _refuse(self, transport: asyncio.Transport) -> None:
        self._refused = True
        self.transport = transport
        self._count("limit")
        self._answer(transport, self.limits.busy, _REFUSED_LINGER_S)

    def _answer(self, transport: asyncio.Transport, answer: bytes, linger_s: float = _LINGER_S) -> None:
        # Write, half-close, and read until the client closes (or _LINGER_S): closing a socket
        # with unread bytes would reset the connection, and the client could lose the answer.
        self._answered = True
        transport.write(answer)
        if not transport.can_write_eof():
            transport.close()
            return
        transport.write_eof()
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self.loop.call_later(linger_s, transport.abort)

    def eof_received(self) -> None:
        if self._answered:
            self.transport.close()

    def _count(self, event: Rejection) -> None:
        metrics = self.app_state.get(METRICS_KEY)
        if metrics is not None:
            metrics.child(metrics.client_rejections, event).inc()

    def _gauge(self, delta: int) -> None:
        metrics = self.app_state.get(METRICS_KEY)
        if metrics is not None:
            metrics.client_connections.inc(delta)
