"""The one place that builds and sends requests to the servers, and maps transport errors.

The client is a small HTTP/1.1 connection pool on httptools (the C parser uvicorn uses). The
proxy's cost is mostly its upstream client, and `python -m loadtest.bench_upstream` measured the
candidates on this exact leg, CPU per request against this pool: aiohttp 2.7-4.3x for small
requests and 1.4x for 64-token streams, httpx 11-113x (its pool slows with concurrency), httpx on
httpx-aiohttp's transport 1.6-15x, httpx2 2.8-32x. aiohttp spent most of a request in machinery
a proxy with two fixed servers does not use (URL objects, header multidicts, tracing, a timer per
read). Everything about the client stays behind this module: the gateway sees `UpstreamResponse`
and `UpstreamError`.

What it does and no more: keep-alive connections per server (LIFO, dropped after `_KEEPALIVE_S`
idle, before SGLang's uvicorn closes them at 5 s), at most `max_connections_per_backend` at once,
connect and read timeouts, flow control (a client that reads slowly pauses the server's socket
instead of growing a buffer), and one resend when a reused connection turns out to be closed
before any answer. No redirects, cookies, compression or proxies: SGLang needs none, and the
relay passes bytes through as they came.
"""

from __future__ import annotations

import asyncio
import base64
import ipaddress
import ssl
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import cast
from urllib.parse import urlsplit

import httptools

from .config import Settings
from .kinds import ErrorKind
from .policy import Backend

# Connection-scoped headers (RFC 9110 7.6.1) and those the proxy sets itself.
HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    }
)
_NOT_FORWARDED_UP = HOP_BY_HOP | {
    b"host",
    b"content-length",
    b"authorization",
    b"accept-encoding",
    b"x-request-id",
    b"expect",
    b"content-type",
}
_NOT_RETURNED = HOP_BY_HOP | {b"server", b"date"}
# Who the client is and how it came: set by specgate from the peer, kept only from trusted proxies.
_FORWARDING = frozenset(
    {b"x-forwarded-for", b"x-forwarded-proto", b"x-forwarded-host", b"x-forwarded-port", b"x-real-ip", b"forwarded"}
)
# The largest response head (status line and headers) read from a server; larger: a protocol error.
MAX_HEAD_BYTES = 64 * 1024
# `Connection` options that name no header.
_CONNECTION_OPTIONS = frozenset({b"close", b"keep-alive"})

# Idle connections older than this are closed rather than reused: SGLang's uvicorn closes its
# side after 5 s, and a request written into a connection it is closing is lost.
_KEEPALIVE_S = 4.0
# Body bytes held for a reader before the server's socket is paused.
_BUFFER_HIGH = 256 * 1024
# Largest body `get` reads (health, metrics, models).
_GET_BODY_LIMIT = 8 * 1024 * 1024


class UpstreamError(Exception):
    """A failure before or during the response. `retryable`: nothing of it can have reached the client."""

    def __init__(self, kind: ErrorKind, message: str, *, retryable: bool) -> None:
        super().__init__(message)
        self.kind = kind
        self.retryable = retryable


class _Broken(Exception):
    """What went wrong on a connection, before it is named after its server."""

    def __init__(self, kind: ErrorKind, what: str) -> None:
        super().__init__(what)
        self.kind = kind


@dataclass(frozen=True)
class HealthProbe:
    status: int | None  # None: no HTTP answer
    body: bytes
    error: UpstreamError | None


def _tokens(value: bytes) -> set[bytes]:
    """The names in a `Connection` header, lower-cased."""
    return {t.strip().lower() for t in value.split(b",") if t.strip()}


def _too_large() -> _Broken:
    return _Broken("protocol", f"response head larger than {MAX_HEAD_BYTES // 1024} KiB")


class _Conn(asyncio.Protocol):
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
        self.error: _Broken | None = None
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
            self._fail(_Broken("protocol", "the server switched protocols"))
        except httptools.HttpParserError as exc:
            self._fail(_Broken("protocol", f"malformed HTTP ({exc})"))
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
                self.error = _Broken("disconnect", "connection lost" + (f" ({exc})" if exc else ""))
        self._wake()

    # httptools callbacks
    def on_message_begin(self) -> None:
        if self.headers_done:
            # A second response to one request: stop parsing (feed_data raises, the exchange fails).
            raise _Broken("protocol", "more than one response to a request")

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

    def _fail(self, err: _Broken) -> None:
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
            w.set_exception(_Broken("timeout", "no data within the read timeout"))
        else:
            self.timer = loop.call_at(due, self._check_timeout)

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


class _Server:
    """One server: where it is, and its pool of keep-alive connections."""

    def __init__(self, backend: str, url: str, settings: Settings, auth: bytes | None) -> None:
        parts = urlsplit(url)
        self.backend = backend
        self.url = url
        self.host = parts.hostname or "127.0.0.1"
        self.tls = ssl.create_default_context() if parts.scheme == "https" else None
        self.port = parts.port or (443 if self.tls is not None else 80)
        self.prefix = parts.path.rstrip("/").encode("latin-1")
        self.netloc = parts.netloc.rsplit("@", 1)[-1].encode("latin-1")
        if auth is None and parts.username is not None:
            basic = f"{parts.username}:{parts.password or ''}".encode("latin-1")
            auth = b"Basic " + base64.b64encode(basic)
        self.auth = b"authorization: " + auth + b"\r\n" if auth else b""
        self.connect_timeout_s = settings.connect_timeout_s
        self.read_timeout_s = settings.read_timeout_s
        # Newest last: requests take from the right, stale ones are closed from the left.
        self.idle: deque[_Conn] = deque()
        self.slots = asyncio.Semaphore(settings.max_connections_per_backend)

    def head(self, method: bytes, target: bytes, headers: bytes) -> bytes:
        return b"%s %s%s HTTP/1.1\r\nhost: %s\r\n%s%s" % (method, self.prefix, target, self.netloc, self.auth, headers)

    async def acquire(self) -> _Conn:
        """A connection, reused when one is idle and fresh; the caller holds a slot."""
        now = time.monotonic()
        while self.idle:
            conn = self.idle.pop()
            fresh = now - conn.idle_since < _KEEPALIVE_S
            if fresh and not conn.closed and conn.transport is not None and not conn.transport.is_closing():
                conn.reused = True
                return conn
            conn.abort()
        return await self.connect()

    async def connect(self) -> _Conn:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await loop.create_connection(_Conn, self.host, self.port, ssl=self.tls)
        except TimeoutError:
            raise _Broken("connect", "connect timed out") from None
        except OSError as exc:
            raise _Broken("connect", f"cannot connect ({exc.strerror or exc})") from None
        return conn

    def put_back(self, conn: _Conn) -> None:
        if conn.reusable():
            conn.stop_timer()
            conn.active = False
            conn.idle_since = now = time.monotonic()
            self.idle.append(conn)
            # After a burst, connections below the top would otherwise wait for the next burst to close.
            idle = self.idle
            while now - idle[0].idle_since >= _KEEPALIVE_S or idle[0].closed:
                idle.popleft().abort()
        else:
            conn.abort()
        self.slots.release()

    def drop(self, conn: _Conn) -> None:
        conn.abort()
        self.slots.release()

    def close(self) -> None:
        for conn in self.idle:
            conn.abort()
        self.idle.clear()

    def error(self, err: _Broken, *, before_response: bool) -> UpstreamError:
        # Connect failures and lost connections may be retried elsewhere (the relay does so only
        # before the client got a byte); a bad response only before it began; a timeout never.
        retryable = err.kind in ("connect", "disconnect") or (err.kind == "protocol" and before_response)
        return UpstreamError(err.kind, f"{self.backend}: {err}", retryable=retryable)


class UpstreamResponse:
    """A response whose headers arrived; its body is read chunk by chunk as the server sends it."""

    __slots__ = ("_conn", "_done", "_server", "content_type", "status")

    def __init__(self, server: _Server, conn: _Conn) -> None:
        self._server = server
        self._conn = conn
        self._done = False
        self.status = conn.status
        # Read once here: the relay asks for it more than once per request.
        self.content_type = next((v.decode("latin-1") for k, v in conn.headers if k.lower() == b"content-type"), "")

    def headers(self) -> list[tuple[bytes, bytes]]:
        """The server's headers minus hop-by-hop ones, those its `Connection` names included."""
        out: list[tuple[bytes, bytes]] = []
        hop: set[bytes] | None = None
        for k, v in self._conn.headers:
            name = k.lower()
            if name not in _NOT_RETURNED:
                out.append((name, v))
            elif name == b"connection" and v.lower() not in _CONNECTION_OPTIONS:
                hop = (hop or set()) | (_tokens(v) - _CONNECTION_OPTIONS)
        return [(k, v) for k, v in out if k not in hop] if hop else out

    @property
    def ended(self) -> bool:
        """The whole body has arrived and been read."""
        return self._conn.complete and not self._conn.body

    async def wait_end(self, within_s: float) -> None:
        """Wait at most `within_s` for more of the body or its end; never raises (read_chunk will)."""
        conn = self._conn
        if conn.body or conn.complete or conn.error is not None:
            return
        loop = asyncio.get_running_loop()
        conn.waiter = waiter = loop.create_future()
        timer = loop.call_later(within_s, conn._wake)
        try:
            await waiter
        finally:
            conn.waiter = None
            timer.cancel()

    async def read_chunk(self) -> bytes:
        """The next piece of body as it arrived from the server; b"" at the end."""
        conn = self._conn
        while True:
            if conn.body:
                return conn.take_body()
            if conn.complete:
                return b""
            if conn.error is not None:
                raise self._server.error(conn.error, before_response=False)
            try:
                await conn.wait(self._server.read_timeout_s)
            except _Broken as err:
                raise self._server.error(err, before_response=False) from None

    def close(self) -> None:
        """Drop the connection (not back to the pool): the server sees its client go and aborts."""
        if not self._done:
            self._done = True
            self._server.drop(self._conn)

    def release(self) -> None:
        if not self._done:
            self._done = True
            self._server.put_back(self._conn)


def renamed(headers: bytes, request_id: str, new_id: str) -> bytes:
    """Head lines from `Upstream.request_headers` with another request id (it ends them)."""
    line = b"x-request-id: " + request_id.encode("latin-1") + b"\r\n"
    if not headers.endswith(line):
        raise ValueError("not head lines from Upstream.request_headers")
    return headers[: -len(line)] + b"x-request-id: " + new_id.encode("latin-1") + b"\r\n"


class Upstream:
    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._trusted_nets = [ipaddress.ip_network(n, strict=False) for n in settings.trusted_proxies]
        self._trusted_seen: dict[str, bool] = {}
        key = settings.upstream_api_key
        auth = b"Bearer " + key.get_secret_value().encode("latin-1") if key else None
        topology = settings.routing_topology()
        # Each server by its name (proxy/topology.py), with its role.
        self.roles: dict[str, Backend] = {s.name: s.role for s in topology.servers}
        self._servers: dict[str, _Server] = {s.name: _Server(s.name, s.url, settings, auth) for s in topology.servers}

    def url(self, backend: str) -> str:
        return self._servers[backend].url

    async def aclose(self) -> None:
        for server in self._servers.values():
            server.close()

    def trusted(self, peer: str) -> bool:
        """Whether `peer` is one of SPECGATE_TRUSTED_PROXIES (remembered per address)."""
        if not self._trusted_nets:
            return False
        found = self._trusted_seen.get(peer)
        if found is None:
            try:
                addr = ipaddress.ip_address(peer)
                found = any(addr in net for net in self._trusted_nets)
            except ValueError:
                found = False
            if len(self._trusted_seen) >= 4096:
                self._trusted_seen.clear()
            self._trusted_seen[peer] = found
        return found

    def request_headers(
        self,
        client_headers: Iterable[tuple[bytes, bytes]],
        request_id: str,
        peer: str | None = None,
        scheme: str = "http",
    ) -> bytes:
        """The head's lines for the server: the client's headers minus hop-by-hop ones (those its
        `Connection` names too, RFC 9110 7.6.1) and credentials, plus the request id and
        `X-Forwarded-For`/`-Proto` as nginx's `$proxy_add_x_forwarded_for` builds them: the
        client's own, only from a trusted proxy, then the peer's address.
        uvicorn's parser already refused any header with CR or LF in it."""
        trusted = peer is not None and self.trusted(peer)
        out: list[bytes] = []
        hop: set[bytes] | None = None
        forwarded_for = b""
        proto = b""
        for k, v in client_headers:
            name = k.lower()
            if name in _NOT_FORWARDED_UP:
                if name == b"connection" and v.lower() not in _CONNECTION_OPTIONS:
                    hop = (hop or set()) | (_tokens(v) - _CONNECTION_OPTIONS)
            elif name not in _FORWARDING:
                out.append(name + b": " + v + b"\r\n")
            elif trusted:
                if name == b"x-forwarded-for":
                    forwarded_for = forwarded_for + b", " + v if forwarded_for else v
                elif name == b"x-forwarded-proto":
                    proto = proto or v
                else:
                    out.append(name + b": " + v + b"\r\n")
        if hop:  # rare: the client named headers as hop-by-hop
            out = [line for line in out if line.split(b":", 1)[0] not in hop]
            if b"x-forwarded-for" in hop:
                forwarded_for = b""
            if b"x-forwarded-proto" in hop:
                proto = b""
        if peer is not None:
            addr = peer.encode("latin-1")
            forwarded_for = forwarded_for + b", " + addr if forwarded_for else addr
        if forwarded_for:
            out.append(b"x-forwarded-for: " + forwarded_for + b"\r\n")
        out.append(
            b"x-forwarded-proto: "
            + (proto or scheme.encode("latin-1"))
            + b"\r\ncontent-type: application/json\r\nx-request-id: "
            + request_id.encode("latin-1")
            + b"\r\n"
        )
        return b"".join(out)

    async def send(self, backend: str, target: bytes, body: bytes, headers: bytes) -> UpstreamResponse:
        """POST `body` to `target` (path and query, as the client sent them); wait for the headers."""
        server = self._servers[backend]
        head = server.head(b"POST", target, headers) + b"content-length: %d\r\n\r\n" % len(body)
        conn = await self._exchange(server, head + body, before_response=True)
        return UpstreamResponse(server, conn)

    async def _exchange(self, server: _Server, request: bytes, *, before_response: bool) -> _Conn:
        """Write `request` on a pooled connection and wait for the response's headers. The
        connection holds one of the server's slots until the response is released or closed."""
        await server.slots.acquire()
        conn: _Conn | None = None
        try:
            for attempt in (0, 1):
                conn = await server.acquire()
                conn.begin(request)
                try:
                    while not conn.headers_done and conn.error is None:
                        await conn.wait(server.read_timeout_s)
                except _Broken as timeout:
                    conn.error = timeout
                if conn.error is None:
                    return conn
                err = conn.error
                conn.abort()
                # A kept-alive connection the server closed meanwhile: nothing was read, send anew.
                if attempt == 1 or not (conn.reused and err.kind == "disconnect" and not conn.got_bytes):
                    raise err
            raise AssertionError("unreachable")
        except _Broken as err:
            server.slots.release()
            raise server.error(err, before_response=before_response) from None
        except BaseException:
            # Cancelled (the client left, a timeout): the server must see the connection go.
            if conn is not None:
                conn.abort()
            server.slots.release()
            raise

    async def get(self, backend: str, path: str, timeout_s: float) -> HealthProbe:
        """A small GET with its own timeout (health, metrics, models)."""
        server = self._servers[backend]
        request = server.head(b"GET", path.encode("latin-1"), b"") + b"\r\n"
        try:
            async with asyncio.timeout(timeout_s):
                conn = await self._exchange(server, request, before_response=True)
                resp = UpstreamResponse(server, conn)
                try:
                    parts: list[bytes] = []
                    size = 0
                    while chunk := await resp.read_chunk():
                        size += len(chunk)
                        if size > _GET_BODY_LIMIT:
                            raise UpstreamError("protocol", f"{backend}: {path} body too large", retryable=False)
                        parts.append(chunk)
                    resp.release()
                    return HealthProbe(conn.status, b"".join(parts), None)
                finally:
                    resp.close()
        except TimeoutError:
            err = UpstreamError("timeout", f"{backend}: no answer to {path} within {timeout_s:g} s", retryable=False)
            return HealthProbe(None, b"", err)
        except UpstreamError as err:
            return HealthProbe(None, b"", err)
