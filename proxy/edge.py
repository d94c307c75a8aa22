"""The client side of a connection: how long a client may hold a socket before it has asked for
anything, how large a request head may grow, and how many connections may be open at once.

uvicorn (0.54, pinned) arms its keep-alive timer only after a response and cancels it on any
byte; a connection that never sends a byte, or sends half a request head, stays open forever,
and httptools accumulates a head without limit. `edge_protocol()` returns uvicorn's httptools
protocol with three limits added:

- the whole request head within `header_timeout_s`, counted from the accept (as nginx's
  `client_header_timeout`) or, on a kept-alive connection, from the first byte of the next request
  (as Envoy's `request_headers_timeout`); the idle time between requests is uvicorn's keep-alive
  timeout. A timed-out connection that sent part of a head gets 408; one that sent nothing is
  closed without a word, as nginx does;
- a head larger than `MAX_HEAD_BYTES` gets 431;
- past `max_connections` open connections, a new one is answered 503 and closed; the ones
  already open, running streams among them, are untouched.

Per request this costs a clock read: one timer per connection is moved on only when it fires.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from .errors import error_body
from .metrics import Rejection

# The largest request head (request line and headers) read; nginx's default allows 4 x 8 KiB lines.
MAX_HEAD_BYTES = 64 * 1024
# How long a connection answered 408 or 431 may take to read it before it is closed; one refused
# past the cap is closed once its request has come (read and dropped), or after _REFUSED_LINGER_S,
# so that refused connections hold few descriptors however fast they come back.
_LINGER_S = 1.0
_REFUSED_LINGER_S = 0.25
# Where the app's lifespan leaves its metrics for the protocol (uvicorn's shared lifespan state).
METRICS_KEY = "specgate.metrics"

_REASONS = {408: b"Request Timeout", 431: b"Request Header Fields Too Large", 503: b"Service Unavailable"}


def _answer(status: int, message: str, code: str) -> bytes:
    body = error_body(message, "server_error" if status >= 500 else "invalid_request_error", code)
    head = b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n" % (
        status,
        _REASONS[status],
        len(body),
    )
    return head + body


def edge_protocol(header_timeout_s: float, max_connections: int) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol with the limits above (uvicorn takes a class for `http=`)."""
    busy = _answer(503, f"Too many connections (limit {max_connections}); try again.", "too_many_connections")
    late = _answer(408, f"The request head did not arrive within {header_timeout_s:g} s.", "request_timeout")
    large = _answer(431, f"The request head is larger than {MAX_HEAD_BYTES} bytes.", "request_header_too_large")

    class EdgeProtocol(HttpToolsProtocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            # When the head being waited for began (None: no head is being waited for).
            self._head_since: float | None = None
            self._head_bytes = 0
            self._timer: asyncio.TimerHandle | None = None
            self._refused = False  # past the cap: never one of uvicorn's connections
            self._answered = False  # refused or closed with an answer: what comes is dropped

        # asyncio.Protocol
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            if len(self.connections) >= max_connections:
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
                    self._close("head_too_large", large)

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
            self._await_head()  # a pipelined head, begun while a response was still running

        def on_headers_complete(self) -> None:
            self._head_since = None
            self._head_bytes = 0
            super().on_headers_complete()

        # the limits
        def _await_head(self) -> None:
            if self._head_since is not None:
                return
            self._head_since = now = self.loop.time()
            if self._timer is None:
                self._timer = self.loop.call_at(now + header_timeout_s, self._check_head)

        def _check_head(self) -> None:
            # One timer per connection, moved on only when it fires: a request just notes the time.
            self._timer = None
            since = self._head_since
            if since is None or self.transport.is_closing():
                return
            due = since + header_timeout_s
            if self.loop.time() < due:
                self._timer = self.loop.call_at(due, self._check_head)
                return
            running = self.cycle is not None and not self.cycle.response_complete
            # Nothing is written into a response still running, nor to a client that sent nothing.
            self._close("header_timeout", late if self._head_bytes and not running else b"")

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
            self._answer(transport, busy, _REFUSED_LINGER_S)

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

    return EdgeProtocol
