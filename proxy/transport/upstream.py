"""The one place that sends requests to the servers and maps transport errors: a small facade over
the header policy (forwarding.py), the HTTP/1.1 connection (conn.py) and each server's pool
(pool.py). The gateway sees `Upstream`, `UpstreamResponse` and `UpstreamError`, nothing below them.

The client is specgate's own HTTP/1.1 pool on httptools. The proxy's cost is mostly its upstream
client, and `python -m loadtest.bench_upstream` measured the candidates on this exact leg, CPU per
request against this pool: aiohttp 2.7-4.3x for small requests and 1.4x for 64-token streams, httpx
11-113x (its pool slows with concurrency), httpx on httpx-aiohttp's transport 1.6-15x, httpx2
2.8-32x. aiohttp spent most of a request in machinery a proxy with a few fixed servers does not use
(URL objects, header multidicts, tracing, a timer per read).

What it does and no more: keep-alive connections per server (LIFO, dropped before the engine's
server closes them: engines.POOL_KEEPALIVE_S), at most `max_connections_per_backend` at once,
connect and read timeouts, flow control, and one resend when a reused connection turns out to be
closed before any answer. No redirects, cookies, compression or proxies: the engines need none,
and the relay passes bytes through as they came.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..fleet.topology import Topology
from ..kinds import ErrorKind
from .conn import Broken, Conn
from .forwarding import Forwarding, response_headers
from .pool import Limits, ServerPool

if TYPE_CHECKING:
    from ..config import Settings

# Largest body `get` reads (health, metrics, models).
_GET_BODY_LIMIT = 8 * 1024 * 1024


class UpstreamError(Exception):
    """A failure before or during the response. `retryable`: nothing of it can have reached the client."""

    def __init__(self, kind: ErrorKind, message: str, *, retryable: bool) -> None:
        super().__init__(message)
        self.kind = kind
        self.retryable = retryable


def _named(pool: ServerPool, err: Broken, *, before_response: bool) -> UpstreamError:
    # Connect failures and lost connections may be retried elsewhere (the relay does so only
    # before the client got a byte); a bad response only before it began; a timeout never.
    retryable = err.kind in ("connect", "disconnect") or (err.kind == "protocol" and before_response)
    return UpstreamError(err.kind, f"{pool.name}: {err}", retryable=retryable)


@dataclass(frozen=True)
class HealthProbe:
    status: int | None  # None: no HTTP answer
    body: bytes
    error: UpstreamError | None


class UpstreamResponse:
    """A response whose headers arrived; its body is read chunk by chunk as the server sends it."""

    __slots__ = ("_conn", "_done", "_pool", "content_type", "status")

    def __init__(self, pool: ServerPool, conn: Conn) -> None:
        self._pool = pool
        self._conn = conn
        self._done = False
        self.status = conn.status
        # Read once here: the relay asks for it more than once per request.
        self.content_type = next((v.decode("latin-1") for k, v in conn.headers if k.lower() == b"content-type"), "")

    def headers(self) -> list[tuple[bytes, bytes]]:
        """The server's headers minus hop-by-hop ones, those its `Connection` names included."""
        return response_headers(self._conn.headers)

    @property
    def ended(self) -> bool:
        """The whole body has arrived and been read."""
        return self._conn.complete and not self._conn.body

    async def wait_end(self, within_s: float) -> None:
        """Wait at most `within_s` for more of the body or its end; never raises (read_chunk will)."""
        await self._conn.wait_briefly(within_s)

    async def read_chunk(self) -> bytes:
        """The next piece of body as it arrived from the server; b"" at the end."""
        conn = self._conn
        while True:
            if conn.body:
                return conn.take_body()
            if conn.complete:
                return b""
            if conn.error is not None:
                raise _named(self._pool, conn.error, before_response=False)
            try:
                await conn.wait(self._pool.read_timeout_s)
            except Broken as err:
                raise _named(self._pool, err, before_response=False) from None

    def close(self) -> None:
        """Drop the connection (not back to the pool): the server sees its client go and aborts."""
        if not self._done:
            self._done = True
            self._pool.drop(self._conn)

    def release(self) -> None:
        if not self._done:
            self._done = True
            self._pool.put_back(self._conn)


class Upstream:
    """Every server of the topology, by name; built once, from a topology built once (app.py)."""

    def __init__(
        self,
        topology: Topology,
        limits: Limits,
        *,
        api_key: str | None = None,
        trusted_proxies: Iterable[str] = (),
        own_trace_context: bool = False,
    ) -> None:
        self.forwarding = Forwarding(trusted_proxies, own_trace_context=own_trace_context)
        # The head's lines for the server (Forwarding.request_headers), as the hot path asks for them.
        self.request_headers = self.forwarding.request_headers
        auth = b"Bearer " + api_key.encode("latin-1") if api_key else None
        # Each server's pool by its name (servers.Server.name): routing hands the transport names only.
        self._pools = {s.name: ServerPool(s.name, s.url, limits, auth) for s in topology.servers}

    @classmethod
    def of(
        cls, topology: Topology, settings: Settings, *, keepalive_s: float, own_trace_context: bool = False
    ) -> Upstream:
        """The upstream the settings ask for, to the servers of `topology` (built by the caller),
        keeping idle connections `keepalive_s` (engines.POOL_KEEPALIVE_S: an engine fact, handed in
        so that the transport imports none of the engine adapters' parsing); `own_trace_context`:
        tracing is on, and the client's trace context stays out (forwarding.traced adds specgate's)."""
        key = settings.upstream_api_key
        limits = Limits(
            settings.connect_timeout_s, settings.read_timeout_s, settings.max_connections_per_backend, keepalive_s
        )
        api_key = key.get_secret_value() if key else None
        return cls(
            topology,
            limits,
            api_key=api_key,
            trusted_proxies=settings.trusted_proxies,
            own_trace_context=own_trace_context,
        )

    def url(self, server: str) -> str:
        return self._pools[server].url

    async def aclose(self) -> None:
        for pool in self._pools.values():
            pool.close()

    async def send(self, server: str, target: bytes, body: bytes, headers: bytes) -> UpstreamResponse:
        """POST `body` to `target` (path and query, as the client sent them); wait for the headers."""
        pool = self._pools[server]
        head = pool.head(b"POST", target, headers) + b"content-length: %d\r\n\r\n" % len(body)
        try:
            return UpstreamResponse(pool, await pool.exchange(head + body))
        except Broken as err:
            raise _named(pool, err, before_response=True) from None

    async def get(self, server: str, path: str, timeout_s: float) -> HealthProbe:
        """A small GET with its own timeout (health, metrics, models)."""
        pool = self._pools[server]
        request = pool.head(b"GET", path.encode("latin-1"), b"") + b"\r\n"
        try:
            async with asyncio.timeout(timeout_s):
                try:
                    conn = await pool.exchange(request)
                except Broken as broken:
                    raise _named(pool, broken, before_response=True) from None
                resp = UpstreamResponse(pool, conn)
                try:
                    parts: list[bytes] = []
                    size = 0
                    while chunk := await resp.read_chunk():
                        size += len(chunk)
                        if size > _GET_BODY_LIMIT:
                            raise UpstreamError("protocol", f"{server}: {path} body too large", retryable=False)
                        parts.append(chunk)
                    resp.release()
                    return HealthProbe(conn.status, b"".join(parts), None)
                finally:
                    resp.close()
        except TimeoutError:
            err = UpstreamError("timeout", f"{server}: no answer to {path} within {timeout_s:g} s", retryable=False)
            return HealthProbe(None, b"", err)
        except UpstreamError as err:
            return HealthProbe(None, b"", err)
