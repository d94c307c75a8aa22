"""One server's pool of keep-alive HTTP/1.1 connections (proxy/transport/conn.py): where the server is, at most
`max_connections` exchanges at once, idle connections reused newest first and closed once older than
the engines' keep-alive window allows, and one resend when a reused connection turns out to be
closed before any answer. Failures are `conn.Broken`; the facade (upstream.py) names them.
"""

from __future__ import annotations

import asyncio
import base64
import ssl
import time
from collections import deque
from dataclasses import dataclass
from urllib.parse import urlsplit

from .conn import Broken, Conn


@dataclass(frozen=True)
class Limits:
    """How long to wait for a server and how much of it to use at once."""

    connect_timeout_s: float
    read_timeout_s: float  # without a byte from the server
    max_connections: int  # per server
    # Idle connections older than this are closed rather than reused (engines.POOL_KEEPALIVE_S).
    keepalive_s: float


def url_credentials(url: str) -> bytes | None:
    """The `Authorization` value for a URL's own user and password (Basic), or None without them."""
    parts = urlsplit(url)
    if parts.username is None:
        return None
    return b"Basic " + base64.b64encode(f"{parts.username}:{parts.password or ''}".encode("latin-1"))


class ServerPool:
    """One server: where it is, and its pool of keep-alive connections."""

    def __init__(self, name: str, url: str, limits: Limits, auth: bytes | None) -> None:
        parts = urlsplit(url)
        self.name = name
        self.url = url
        self.host = parts.hostname or "127.0.0.1"
        self.tls = ssl.create_default_context() if parts.scheme == "https" else None
        self.port = parts.port or (443 if self.tls is not None else 80)
        self.prefix = parts.path.rstrip("/").encode("latin-1")
        self.netloc = parts.netloc.rsplit("@", 1)[-1].encode("latin-1")
        if auth is None:
            auth = url_credentials(url)
        self.auth = b"authorization: " + auth + b"\r\n" if auth else b""
        self.connect_timeout_s = limits.connect_timeout_s
        self.read_timeout_s = limits.read_timeout_s
        self.keepalive_s = limits.keepalive_s
        # Newest last: requests take from the right, stale ones are closed from the left.
        self.idle: deque[Conn] = deque()
        self.slots = asyncio.Semaphore(limits.max_connections)

    def head(self, method: bytes, target: bytes, headers: bytes) -> bytes:
        return b"%s %s%s HTTP/1.1\r\nhost: %s\r\n%s%s" % (method, self.prefix, target, self.netloc, self.auth, headers)

    async def exchange(self, request: bytes) -> Conn:
        """Write `request` on a pooled connection and wait for the response's headers. The
        connection holds one of the server's slots until `put_back` or `drop`; on a failure
        (Broken, or cancellation) the slot is released and the connection closed."""
        await self.slots.acquire()
        conn: Conn | None = None
        try:
            for attempt in (0, 1):
                conn = await self._acquire()
                conn.begin(request)
                try:
                    while not conn.headers_done and conn.error is None:
                        await conn.wait(self.read_timeout_s)
                except Broken as timeout:
                    conn.error = timeout
                if conn.error is None:
                    return conn
                err = conn.error
                conn.abort()
                # A kept-alive connection the server closed meanwhile: nothing was read, send anew.
                if attempt == 1 or not (conn.reused and err.kind == "disconnect" and not conn.got_bytes):
                    raise err
            raise AssertionError("unreachable")
        except Broken:
            self.slots.release()
            raise
        except BaseException:
            # Cancelled (the client left, a timeout): the server must see the connection go.
            if conn is not None:
                conn.abort()
            self.slots.release()
            raise

    async def _acquire(self) -> Conn:
        """A connection, reused when one is idle and fresh; the caller holds a slot."""
        now = time.monotonic()
        while self.idle:
            conn = self.idle.pop()
            fresh = now - conn.idle_since < self.keepalive_s
            if fresh and not conn.closed and conn.transport is not None and not conn.transport.is_closing():
                conn.reused = True
                return conn
            conn.abort()
        return await self._connect()

    async def _connect(self) -> Conn:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await loop.create_connection(Conn, self.host, self.port, ssl=self.tls)
        except TimeoutError:
            raise Broken("connect", "connect timed out") from None
        except OSError as exc:
            raise Broken("connect", f"cannot connect ({exc.strerror or exc})") from None
        return conn

    def put_back(self, conn: Conn) -> None:
        if conn.reusable():
            conn.stop_timer()
            conn.active = False
            conn.idle_since = now = time.monotonic()
            self.idle.append(conn)
            # After a burst, connections below the top would otherwise wait for the next burst to close.
            idle = self.idle
            while now - idle[0].idle_since >= self.keepalive_s or idle[0].closed:
                idle.popleft().abort()
        else:
            conn.abort()
        self.slots.release()

    def drop(self, conn: Conn) -> None:
        conn.abort()
        self.slots.release()

    def close(self) -> None:
        for conn in self.idle:
            conn.abort()
        self.idle.clear()
