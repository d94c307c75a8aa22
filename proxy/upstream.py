"""The one place that builds and sends requests to the SGLang servers, and maps transport errors.

The client is aiohttp: measured on these machines (shared/design.md) it costs about a quarter of
httpx's CPU per request, and the proxy's cost is mostly its upstream client. Everything about
it stays behind this module: the rest of the gateway sees `UpstreamResponse` and `UpstreamError`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass
from http.cookies import BaseCookie, SimpleCookie

import aiohttp
from yarl import URL

from .config import Settings
from .metrics import ErrorKind
from .policy import BACKENDS, Backend

# Connection-scoped headers (RFC 9110 7.6.1) and those the proxy sets itself.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)
_NOT_FORWARDED_UP = HOP_BY_HOP | {
    "host",
    "content-length",
    "authorization",
    "accept-encoding",
    "x-request-id",
    "expect",
    "content-type",
}
_NOT_RETURNED = HOP_BY_HOP | {"server", "date"}


class _NoCookieJar(aiohttp.DummyCookieJar):
    """Cookies travel as the client's own headers; the jar keeps none. aiohttp's dummy jar builds
    a new empty cookie set on every request (measured: ~25 us); this one returns one shared set,
    which aiohttp only reads."""

    _EMPTY: BaseCookie[str] = SimpleCookie()

    def filter_cookies(self, request_url: URL) -> BaseCookie[str]:
        return self._EMPTY


class UpstreamError(Exception):
    """A failure before or during the response. `retryable`: nothing of it can have reached the client."""

    def __init__(self, kind: ErrorKind, message: str, *, retryable: bool) -> None:
        super().__init__(message)
        self.kind = kind
        self.retryable = retryable


def _map_error(exc: BaseException, backend: Backend, before_response: bool) -> UpstreamError:
    # Order matters: several aiohttp errors subclass both ClientError and OSError/TimeoutError.
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return UpstreamError("connect", f"{backend}: connect timed out", retryable=True)
    if isinstance(exc, aiohttp.ClientConnectorError):
        return UpstreamError("connect", f"{backend}: cannot connect ({exc.os_error.strerror or exc})", retryable=True)
    if isinstance(exc, (aiohttp.SocketTimeoutError, asyncio.TimeoutError)):
        return UpstreamError("timeout", f"{backend}: no data within the read timeout", retryable=False)
    if isinstance(exc, (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError, aiohttp.ClientOSError)):
        return UpstreamError("disconnect", f"{backend}: connection lost ({type(exc).__name__})", retryable=True)
    return UpstreamError("protocol", f"{backend}: bad response ({type(exc).__name__})", retryable=before_response)


@dataclass(frozen=True)
class HealthProbe:
    status: int | None  # None: no HTTP answer
    body: bytes
    error: UpstreamError | None


class UpstreamResponse:
    """A response whose headers arrived; its body is read chunk by chunk as the server sends it."""

    __slots__ = ("_backend", "_resp", "status")

    def __init__(self, backend: Backend, resp: aiohttp.ClientResponse) -> None:
        self._backend = backend
        self._resp = resp
        self.status = resp.status

    @property
    def content_type(self) -> str:
        return self._resp.headers.get("Content-Type", "")

    def headers(self) -> list[tuple[bytes, bytes]]:
        return [
            (k.lower().encode("latin-1"), v.encode("latin-1"))
            for k, v in self._resp.headers.items()
            if k.lower() not in _NOT_RETURNED
        ]

    async def read_chunk(self) -> bytes:
        """The next piece of body as it arrived from the server; b"" at the end."""
        try:
            return await self._resp.content.readany()
        except Exception as exc:
            raise _map_error(exc, self._backend, before_response=False) from exc

    def close(self) -> None:
        """Drop the connection (not back to the pool): the server sees its client go and aborts."""
        self._resp.close()

    def release(self) -> None:
        self._resp.release()


class Upstream:
    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._urls: dict[Backend, str] = {"speculative": settings.speculative_url, "baseline": settings.baseline_url}
        key = settings.upstream_api_key
        self._auth: list[tuple[str, str]] = [("Authorization", f"Bearer {key.get_secret_value()}")] if key else []
        self._sessions: dict[Backend, aiohttp.ClientSession] = {}

    def url(self, backend: Backend) -> str:
        return self._urls[backend]

    async def start(self) -> None:
        s = self._settings
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=s.connect_timeout_s, sock_read=s.read_timeout_s)
        for backend in BACKENDS:
            connector = aiohttp.TCPConnector(
                limit=s.max_connections_per_backend, limit_per_host=0, keepalive_timeout=30, enable_cleanup_closed=True
            )
            self._sessions[backend] = aiohttp.ClientSession(
                connector=connector,
                timeout=timeout,
                auto_decompress=False,  # relay bytes as the server sent them
                skip_auto_headers=("User-Agent", "Accept-Encoding"),
                cookie_jar=_NoCookieJar(),
            )

    async def aclose(self) -> None:
        for session in self._sessions.values():
            await session.close()
        self._sessions.clear()

    def request_headers(self, client_headers: Iterable[tuple[bytes, bytes]], request_id: str) -> list[tuple[str, str]]:
        """Client headers minus hop-by-hop and credentials, plus the upstream key and request id."""
        out = [
            (k.decode("latin-1"), v.decode("latin-1"))
            for k, v in client_headers
            if k.decode("latin-1").lower() not in _NOT_FORWARDED_UP
        ]
        out.append(("Content-Type", "application/json"))
        out.append(("X-Request-Id", request_id))
        out.extend(self._auth)
        return out

    async def send(self, backend: Backend, path: str, body: bytes, headers: list[tuple[str, str]]) -> UpstreamResponse:
        session = self._sessions[backend]
        try:
            resp = await session.post(self._urls[backend] + path, data=body, headers=headers, allow_redirects=False)
        except Exception as exc:
            raise _map_error(exc, backend, before_response=True) from exc
        return UpstreamResponse(backend, resp)

    async def get(self, backend: Backend, path: str, timeout_s: float) -> HealthProbe:
        """A small GET with its own timeout (health, metrics, models)."""
        session = self._sessions[backend]
        try:
            async with session.get(
                self._urls[backend] + path, headers=self._auth, timeout=aiohttp.ClientTimeout(total=timeout_s)
            ) as resp:
                return HealthProbe(resp.status, await resp.read(), None)
        except Exception as exc:
            return HealthProbe(None, b"", _map_error(exc, backend, before_response=True))
