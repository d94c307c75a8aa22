"""What a hostile client can send at the edge and the request path (issue 25): upgrade requests,
heads just over the cap, trailers, encodings, deep and big JSON, and slash redirects. Raw sockets
on loopback, against specgate in front of a scripted server that shows what reached it."""

from __future__ import annotations

import select
import socket
import time
from collections.abc import Iterator

import httpx
import orjson
import pytest

from loadtest.procs import Proc

from ..conftest import StartSim
from ..helpers import scrape, wait_for
from ..relay.test_hostile_server import bad_server, start_proxy

__all__ = ["bad_server"]  # a fixture, used by name


@pytest.fixture
def edge(simulator: StartSim, bad_server: str) -> Iterator[tuple[str, Proc]]:
    """specgate (at most 8 client connections, a 1 s header timeout) whose speculative server is
    the scripted one; every request goes there (high watermark 1000)."""
    base = simulator("baseline", "--time-scale", "20")
    url, proxy = start_proxy(bad_server, base.url, SPECGATE_MAX_CLIENT_CONNECTIONS="8", SPECGATE_HEADER_TIMEOUT_S="1",
                             SPECGATE_KEEPALIVE_TIMEOUT_S="1", SPECGATE_HIGH_WATERMARK="1000",
                             SPECGATE_LOW_WATERMARK="999")  # fmt: skip
    try:
        yield url, proxy
    finally:
        proxy.stop()


def _addr(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def _read_until_closed(sock: socket.socket, limit_s: float) -> bytes:
    """Everything the server wrote until it closed the socket; fails if it stays open."""
    got = b""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([sock], [], [], 0.1)
        if ready:
            try:
                part = sock.recv(65536)
            except ConnectionResetError:
                return got
            if not part:
                return got
            got += part
    raise AssertionError(f"still open after {limit_s} s: {got[:200]!r}")


def _connections(url: str) -> float:
    return scrape(url).get("specgate_client_connections", 0.0)


def test_upgrade_requests_are_answered_as_http_and_leave_no_connection_behind(edge: tuple[str, Proc]) -> None:
    url, _ = edge
    before = _connections(url)
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
        b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
        b"Content-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
    )
    socks = [socket.create_connection(_addr(url)) for _ in range(8)]  # the whole cap
    try:
        for s in socks:
            s.sendall(head)
        # Each is answered and closed: no upgrade is done, none holds a connection past its answer.
        for s in socks:
            said = _read_until_closed(s, 5.0)
            # It has a body, which the parser would hand to the new protocol: refused and closed.
            assert said.startswith(b"HTTP/1.1 400") and b"upgrade_not_supported" in said, said[:100]
    finally:
        for s in socks:
            s.close()
    assert httpx.get(url + "/health", timeout=5).status_code == 200
    # The gauge is exact once they closed (this scrape's own connection aside).
    wait_for(lambda: _connections(url) <= before, timeout_s=10)


def test_an_h2c_upgrade_is_served_as_http_without_a_body_and_refused_with_one(edge: tuple[str, Proc]) -> None:
    url, _ = edge
    h2c = b"Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQCAAAAAAIAAAAA\r\n"
    # As curl --http2 asks on http://: no body, so the request is whole and answered as HTTP/1.1
    # (a server may ignore an upgrade), then the connection closes (the parser reads no more).
    with socket.create_connection(_addr(url)) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n" + h2c + b"\r\n")
        said = _read_until_closed(s, 5.0)
    assert said.startswith(b"HTTP/1.1 200"), said[:200]
    assert b"101 Switching" not in said
    # With a body, which the parser would hand to the new protocol: refused, not relayed empty.
    body = orjson.dumps({"mode": "echo_raw", "messages": [], "stream": True})
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n" + h2c
    with socket.create_connection(_addr(url)) as s:
        s.sendall(head + b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        said = _read_until_closed(s, 5.0)
    assert said.startswith(b"HTTP/1.1 400") and b"upgrade_not_supported" in said, said[:200]
    assert scrape(url)["specgate_client_rejections_total"] >= 1


def test_the_head_cap_is_exact_when_the_head_comes_in_one_write(edge: tuple[str, Proc]) -> None:
    url, _ = edge
    body = b"{}"
    for pad, status in ((60 * 1024, b"HTTP/1.1 4"), (70 * 1024, b"HTTP/1.1 431")):
        head = b"POST /v1/echo/x HTTP/1.1\r\nHost: x\r\nX-Pad: %s\r\nContent-Type: application/json\r\n" % (b"p" * pad)
        with socket.create_connection(_addr(url)) as s:
            s.sendall(head + b"Content-Length: 2\r\nConnection: close\r\n\r\n" + body)
            said = _read_until_closed(s, 5.0)
        assert said.startswith(status), (pad, said[:200])
        if pad > 64 * 1024:
            assert b"request_header_too_large" in said


def test_trailers_are_not_forwarded(edge: tuple[str, Proc]) -> None:
    url, _ = edge
    chunk = b'{"a": 1}'
    request = (
        b"POST /v1/echo/x HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n"
        b"Trailer: X-Trailer\r\nConnection: close\r\n\r\n"
        b"%x\r\n%s\r\n0\r\nX-Trailer: evil\r\n\r\n" % (len(chunk), chunk)
    )
    with socket.create_connection(_addr(url)) as s:
        s.sendall(request)
        said = _read_until_closed(s, 5.0)
    assert said.startswith(b"HTTP/1.1 200"), said[:200]
    seen = orjson.loads(said.split(b"\r\n\r\n", 1)[1])
    names = [k.lower() for k, _ in seen["headers"]]
    assert "x-trailer" not in names and seen["body"] == '{"a": 1}'


def test_a_body_with_a_content_encoding_is_refused(edge: tuple[str, Proc]) -> None:
    url, _ = edge
    for encoding in ("gzip", "br", "deflate, gzip"):
        r = httpx.post(url + "/v1/chat/completions", content=b'{"messages": []}',
                       headers={"content-type": "application/json", "content-encoding": encoding})  # fmt: skip
        assert r.status_code == 415, (encoding, r.text)
        assert r.json()["error"]["code"] == "unsupported_media_type"
    # identity is no encoding at all.
    r = httpx.post(url + "/v1/echo/x", content=b"{}",
                   headers={"content-type": "application/json", "content-encoding": "identity"})  # fmt: skip
    assert r.status_code == 200


def test_big_integers_and_deep_fields_reach_the_server_as_sent(edge: tuple[str, Proc]) -> None:
    url, _ = edge
    # A 30-digit seed, a float's exact spelling and a field nested 300 deep: specgate adds
    # stream_options to a streamed chat body, and changes nothing else.
    deep = "[" * 300 + "]" * 300
    raw = ('{"mode": "echo_raw", "stream": true, "seed": 123456789012345678901234567890, "t": 1.10, '
           f'"x": {deep}, "messages": [{{"role": "user", "content": "hi"}}]}}')  # fmt: skip
    r = httpx.post(url + "/v1/chat/completions", content=raw.encode(), headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text
    event = orjson.loads(r.text.split("data: ", 1)[1].split("\n\n", 1)[0])
    seen = event["raw"]
    assert "123456789012345678901234567890" in seen and '"t": 1.10' in seen and deep in seen
    assert orjson.loads(seen)["stream_options"] == {"include_usage": True}


def test_a_trailing_slash_is_no_redirect(edge: tuple[str, Proc]) -> None:
    url, _ = edge
    for path in ("/routing/", "/health/", "/metrics/"):
        r = httpx.get(url + path, headers={"host": "evil.example"})
        assert r.status_code == 404, (path, r.status_code)
        assert "location" not in r.headers
