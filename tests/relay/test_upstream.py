"""The upstream connection pool against a scripted server on loopback: reuse, limits, stale
keep-alive connections, timeouts, bodies that end at EOF, URL prefixes and credentials."""

from __future__ import annotations

import asyncio
import base64
import shutil
import socket
import ssl
import struct
import subprocess
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from proxy.config import Settings
from proxy.fleet.engines import POOL_KEEPALIVE_S
from proxy.transport.forwarding import Forwarding
from proxy.transport.upstream import Upstream, UpstreamError

from ..helpers import wait_until

OK = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, "Script"], Awaitable[None]]


@dataclass
class Script:
    """A server whose every connection runs `handler`; it counts connections and requests."""

    handler: Handler
    connections: int = 0
    open_now: int = 0
    most_open: int = 0
    heads: list[bytes] = field(default_factory=list)

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.open_now += 1
        self.most_open = max(self.most_open, self.open_now)
        try:
            await self.handler(reader, writer, self)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self.open_now -= 1
            writer.close()

    async def read_request(self, reader: asyncio.StreamReader) -> bytes:
        head = await reader.readuntil(b"\r\n\r\n")
        self.heads.append(head)
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                await reader.readexactly(int(line.split(b":")[1]))
        return head


async def keep_alive(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, s: Script) -> None:
    while True:
        await s.read_request(reader)
        writer.write(OK)
        await writer.drain()


async def run_with(handler: Handler, test: Callable[[Upstream, Script], Awaitable[None]], **settings: object) -> Script:
    script = Script(handler)
    server = await asyncio.start_server(script.serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    url = settings.pop("url", f"http://127.0.0.1:{port}")
    keepalive_s = settings.pop("keepalive_s", POOL_KEEPALIVE_S)
    assert isinstance(keepalive_s, float)
    assert isinstance(url, str)
    s = Settings(_env_file=None, speculative_url=url.format(port=port), baseline_url=url.format(port=port), **settings)  # type: ignore[arg-type]
    up = Upstream.of(s.routing_topology(), s, keepalive_s=keepalive_s)
    try:
        await asyncio.wait_for(test(up, script), 20)
    finally:
        await up.aclose()
        server.close()
    return script


async def post(up: Upstream, target: bytes = b"/v1/completions") -> tuple[int, bytes]:
    resp = await up.send("baseline", target, b"{}", up.request_headers([], "rid"))
    parts = []
    while chunk := await resp.read_chunk():
        parts.append(chunk)
    resp.release()
    return resp.status, b"".join(parts)


def test_connections_are_kept_alive_and_reused() -> None:
    async def test(up: Upstream, s: Script) -> None:
        for _ in range(20):
            assert await post(up) == (200, b"{}")
        await asyncio.gather(*(post(up) for _ in range(5)))

    script = asyncio.run(run_with(keep_alive, test))
    assert len(script.heads) == 25
    assert script.connections <= 5


def test_at_most_max_connections_per_backend_at_once() -> None:
    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, s: Script) -> None:
        while True:
            await s.read_request(reader)
            await asyncio.sleep(0.05)
            writer.write(OK)
            await writer.drain()

    async def test(up: Upstream, s: Script) -> None:
        results = await asyncio.gather(*(post(up) for _ in range(8)))
        assert all(r == (200, b"{}") for r in results)

    script = asyncio.run(run_with(slow, test, max_connections_per_backend=2))
    assert script.most_open == 2 and len(script.heads) == 8


def test_a_connection_the_server_closed_while_idle_is_not_an_error() -> None:
    async def one_per_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, s: Script) -> None:
        # Answers as if keeping the connection, then closes it (as a server's keep-alive timeout does).
        await s.read_request(reader)
        writer.write(OK)
        await writer.drain()

    async def test(up: Upstream, s: Script) -> None:
        for _ in range(5):
            assert await post(up) == (200, b"{}")
            await wait_until(lambda: s.open_now == 0)  # the server closed it before the next request

    script = asyncio.run(run_with(one_per_connection, test))
    assert script.connections == 5


def test_a_request_written_into_a_closing_connection_is_sent_again() -> None:
    # The server reads the request on a reused connection and closes without answering, the race
    # with a server's keep-alive timeout. The pool sends it again once, on a new connection.
    async def drop_second(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, s: Script) -> None:
        await s.read_request(reader)
        writer.write(OK)
        await writer.drain()
        if s.connections == 1:
            await s.read_request(reader)  # and close without a word

    async def test(up: Upstream, s: Script) -> None:
        assert await post(up) == (200, b"{}")
        assert await post(up) == (200, b"{}")

    script = asyncio.run(run_with(drop_second, test))
    assert script.connections == 2 and len(script.heads) == 3


def test_a_fresh_connection_closed_before_the_answer_is_a_retryable_disconnect() -> None:
    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, s: Script) -> None:
        await s.read_request(reader)

    async def test(up: Upstream, s: Script) -> None:
        with pytest.raises(UpstreamError) as err:
            await post(up)
        assert err.value.kind == "disconnect" and err.value.retryable

    script = asyncio.run(run_with(hang_up, test))
    assert script.connections == 1  # not sent twice: that connection was new


def test_silence_after_the_headers_is_a_read_timeout() -> None:
    async def stall(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, s: Script) -> None:
        await s.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n")
        await writer.drain()
        await asyncio.sleep(5)

    async def test(up: Upstream, s: Script) -> None:
        resp = await up.send("baseline", b"/v1/completions", b"{}", up.request_headers([], "rid"))
        assert await resp.read_chunk() == b"hello"
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(UpstreamError) as err:
            await resp.read_chunk()
        assert err.value.kind == "timeout" and not err.value.retryable
        assert 0.2 <= loop.time() - t0 < 2
        resp.close()

    asyncio.run(run_with(stall, test, read_timeout_s=0.3))


def test_a_body_that_ends_at_eof_is_complete() -> None:
    async def http10(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, s: Script) -> None:
        await s.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-type: text/plain\r\n\r\nall of it")
        await writer.drain()

    async def test(up: Upstream, s: Script) -> None:
        assert await post(up) == (200, b"all of it")
        assert await post(up) == (200, b"all of it")

    script = asyncio.run(run_with(http10, test))
    assert script.connections == 2  # connection: close is honoured


def cut_after(first: bytes) -> Callable[[Upstream, Script], Awaitable[None]]:
    """A test: the body starts with `first`, then the connection is lost."""

    async def test(up: Upstream, s: Script) -> None:
        resp = await up.send("baseline", b"/v1/completions", b"{}", up.request_headers([], "rid"))
        assert await resp.read_chunk() == first
        with pytest.raises(UpstreamError) as err:
            await resp.read_chunk()
        assert err.value.kind == "disconnect"
        resp.close()

    return test


def test_a_body_cut_short_is_a_disconnect() -> None:
    async def short(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, s: Script) -> None:
        await s.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly this")
        await writer.drain()

    asyncio.run(run_with(short, cut_after(b"only this")))


def test_a_malformed_answer_is_a_protocol_error() -> None:
    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, s: Script) -> None:
        await s.read_request(reader)
        writer.write(b"SMTP ready\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(1)

    async def test(up: Upstream, s: Script) -> None:
        with pytest.raises(UpstreamError) as err:
            await post(up)
        assert err.value.kind == "protocol" and err.value.retryable

    asyncio.run(run_with(garbage, test))


def test_nothing_listening_is_a_connect_error() -> None:
    async def test(up: Upstream, s: Script) -> None:
        with pytest.raises(UpstreamError) as err:
            await post(up)
        assert err.value.kind == "connect" and err.value.retryable
        probe = await up.get("baseline", "/health", 1)
        assert probe.status is None and probe.error is not None and probe.error.kind == "connect"

    # Port 1 on loopback: nobody listens there.
    asyncio.run(run_with(keep_alive, test, url="http://127.0.0.1:1"))


def test_url_prefix_userinfo_and_upstream_key_shape_the_request() -> None:
    async def test(up: Upstream, s: Script) -> None:
        await post(up, b"/v1/completions?x=%20")
        probe = await up.get("baseline", "/health", 2)
        assert probe.status == 200 and probe.body == b"{}"

    script = asyncio.run(run_with(keep_alive, test, url="http://u:p@127.0.0.1:{port}/prefix/"))
    post_head, get_head = script.heads
    assert post_head.startswith(b"POST /prefix/v1/completions?x=%20 HTTP/1.1\r\n")
    assert get_head.startswith(b"GET /prefix/health HTTP/1.1\r\n")
    assert b"authorization: Basic " + base64.b64encode(b"u:p") + b"\r\n" in post_head
    assert b"host: 127.0.0.1:" in post_head and b"u:p@" not in post_head
    assert b"x-request-id: rid\r\n" in post_head and b"content-length: 2\r\n" in post_head

    # SPECGATE_UPSTREAM_API_KEY wins over credentials in the URL.
    script = asyncio.run(run_with(keep_alive, test, url="http://u:p@127.0.0.1:{port}", upstream_api_key="sk-up"))
    assert b"authorization: Bearer sk-up\r\n" in script.heads[0] and b"Basic" not in script.heads[0]


def test_an_https_server_is_reached_over_tls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl is needed to make a certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    # The client trusts what the system trusts; here, this certificate.
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_tls.load_cert_chain(cert, key)

    async def main() -> Script:
        script = Script(keep_alive)
        server = await asyncio.start_server(script.serve, "127.0.0.1", 0, ssl=server_tls)
        url = f"https://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        s = Settings(_env_file=None, speculative_url=url, baseline_url=url)
        up = Upstream.of(s.routing_topology(), s, keepalive_s=POOL_KEEPALIVE_S)
        try:
            assert await post(up) == (200, b"{}")
            assert await post(up) == (200, b"{}")
        finally:
            await up.aclose()
            server.close()
        return script

    script = asyncio.run(main())
    assert len(script.heads) == 2 and script.connections == 1


def test_a_reset_cuts_short_a_body_that_ends_at_eof() -> None:
    async def reset(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, s: Script) -> None:
        await s.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\npart")
        await writer.drain()
        await asyncio.sleep(0.05)
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close sends RST
        writer.transport.abort()

    asyncio.run(run_with(reset, cut_after(b"part")))


def test_idle_connections_are_closed_once_stale() -> None:
    async def test(up: Upstream, s: Script) -> None:
        await asyncio.gather(*(post(up) for _ in range(5)))
        assert s.open_now == 5  # all kept alive
        for _ in range(3):
            # One stream keeps reusing the newest connection; the four below it go stale.
            await asyncio.sleep(0.1)
            assert await post(up) == (200, b"{}")
        await wait_until(lambda: s.open_now == 1)  # closed when they went stale, not left for the next burst

    script = asyncio.run(run_with(keep_alive, test, keepalive_s=0.2))
    assert script.connections == 5


@pytest.mark.parametrize(
    ("trusted", "peer", "forwarded_for", "proto"),
    [
        ((), "192.0.2.7", b"192.0.2.7", b"http"),  # nobody trusted: the client's values are dropped
        (("10.0.0.0/8",), "192.0.2.7", b"192.0.2.7", b"http"),  # a peer outside the trusted network
        (("10.0.0.0/8",), "10.1.2.3", b"6.6.6.6, 7.7.7.7, 10.1.2.3", b"https"),  # kept in order, peer last
        (("::1",), "::1", b"6.6.6.6, 7.7.7.7, ::1", b"https"),
    ],
)
def test_forwarding_headers(trusted: tuple[str, ...], peer: str, forwarded_for: bytes, proto: bytes) -> None:
    up = Forwarding(trusted)
    client = [(b"X-Forwarded-For", b"6.6.6.6"), (b"x-forwarded-proto", b"https"), (b"x-forwarded-for", b"7.7.7.7"),
              (b"x-real-ip", b"6.6.6.6"), (b"connection", b"Keep-Alive, X-Hop"), (b"x-hop", b"h"),
              (b"x-ok", b"o")]  # fmt: skip
    lines = up.request_headers(client, "rid", peer, "http").split(b"\r\n")
    assert lines.count(b"x-forwarded-for: " + forwarded_for) == 1
    assert lines.count(b"x-forwarded-proto: " + proto) == 1
    assert sum(line.startswith(b"x-forwarded-for") for line in lines) == 1
    assert (b"x-real-ip: 6.6.6.6" in lines) == (forwarded_for != peer.encode())
    assert b"x-ok: o" in lines and not any(line.startswith(b"x-hop") for line in lines)
