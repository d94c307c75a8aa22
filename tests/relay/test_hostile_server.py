"""A server that misbehaves, in front of specgate as a process: its memory stays bounded, what it
writes on its sockets, raw request lines. What the app does with a misbehaving server is tested
in-process (test_hostile_upstream.py)."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import httpx
import orjson
import pytest

from loadtest.procs import Proc, free_port, start

from .. import helpers
from ..conftest import StartSim
from ..helpers import routing, scrape, wait_for

# The default inference routes, and the hostile server's echo route under them.
ALLOWED = "/v1/chat/completions,/v1/completions,/v1/responses,/v1/embeddings,/v1/models,/generate,/v1/echo/*"


def start_proxy(speculative: str, baseline: str, **env: str) -> tuple[str, Proc]:
    p = helpers.start_proxy(speculative, baseline, "/ready", SPECGATE_READ_TIMEOUT_S="1",
                            SPECGATE_HEALTH_INTERVAL_S="0.5", SPECGATE_ALLOWED_PATHS=ALLOWED, **env)  # fmt: skip
    return p.url, p.proc


@pytest.fixture
def bad_server() -> Iterator[str]:
    port = free_port()
    bad = start("hostile", ["-m", "tests.hostile_server", str(port)], ready_url=f"http://127.0.0.1:{port}/health")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        bad.stop()


@pytest.fixture
def hostile(simulator: StartSim, bad_server: str) -> Iterator[tuple[str, Proc]]:
    """specgate whose speculative server misbehaves (the baseline is a simulator)."""
    base = simulator("baseline", "--time-scale", "20")
    url, proxy = start_proxy(bad_server, base.url)
    try:
        yield url, proxy
    finally:
        proxy.stop()


def still_healthy(url: str) -> None:
    assert httpx.get(url + "/routing").json()["inflight"] == 0
    assert httpx.get(url + "/ready").status_code == 200


def test_huge_response_streams_through_in_bounded_memory(hostile: tuple[str, Proc]) -> None:
    url, proxy = hostile
    before = proxy.rss_mib()
    size = 0
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=60,
                      json={"mode": "huge", "messages": [{"role": "user", "content": "x"}]}) as r:  # fmt: skip
        for chunk in r.iter_raw():
            size += len(chunk)
    assert size > 48 * 1024 * 1024
    assert proxy.rss_mib() - before < 40  # relayed, not buffered (the body is 48 MiB)
    still_healthy(url)


def test_client_that_stops_reading_is_dropped(hostile: tuple[str, Proc]) -> None:
    url, proxy = hostile
    port = int(url.rsplit(":", 1)[1])
    body = b'{"mode": "firehose", "messages": [{"role": "user", "content": "x"}], "stream": true}'
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    try:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
        # Never read: buffers fill, the relay blocks, the watchdog drops the client after ~1 s.
        wait_for(lambda: routing(url)["inflight"] == 0, timeout_s=15, interval_s=0.2)
        assert scrape(url)["specgate_client_disconnects_total"] == 1
    finally:
        sock.close()
    assert proxy.alive()
    still_healthy(url)


def raw_exchange(url: str, request: bytes, until: bytes) -> list[bytes]:
    """The pieces recv() returned, up to the one that completes `until`: what the proxy wrote
    together arrives together on loopback."""
    host, port = url.removeprefix("http://").split(":")
    pieces: list[bytes] = []
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(request)
        while until not in b"".join(pieces):
            piece = sock.recv(1 << 20)
            assert piece, b"".join(pieces)
            pieces.append(piece)
    return pieces


def post(path: str, body: bytes) -> bytes:
    return b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
        path.encode(),
        len(body),
        body,
    )


def test_done_goes_with_the_end_of_the_body(hostile: tuple[str, Proc]) -> None:
    url, _ = hostile
    body = b'{"mode": "done_then_end", "stream": true, "messages": []}'
    for _ in range(3):
        pieces = raw_exchange(url, post("/v1/chat/completions", body), until=b"data: [DONE]")
        # The server wrote `[DONE]` and the end of its body apart; the client gets them together,
        # so one that stops at `[DONE]` finds the response complete (and may reuse the connection).
        assert pieces[-1].endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"), pieces
        # ...and the head came first, before any event (SGLang sends it at once).
        assert pieces[0].startswith(b"HTTP/1.1 200 OK\r\n")
    still_healthy(url)


def raw_answer(url: str, head: bytes, body: bytes = b"") -> tuple[int, dict[str, str], bytes]:
    """Send `head` (request line and headers, without the blank line) as written, with
    `Connection: close`; the answer's status, headers (last of each name) and body."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(head + b"\r\nconnection: close\r\ncontent-length: %d\r\n\r\n" % len(body) + body)
        data = b""
        while part := sock.recv(1 << 16):
            data += part
    top, _, rest = data.partition(b"\r\n\r\n")
    lines = top.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return int(lines[0].split()[1]), headers, rest


def test_only_listed_paths_reach_a_server(hostile: tuple[str, Proc]) -> None:
    url, _ = hostile
    server = httpx.get(url + "/routing").json()["backends"]["speculative"]["url"]
    body = b'{"mode": "malformed_sse", "messages": []}'
    refused = {
        "/v1/chat/completions/../../../update_weights_from_disk": 400,
        "/v1/%2e%2e/flush_cache": 400,
        "/v1/%2E%2E/flush_cache": 400,
        "/v1/chat%2Fcompletions": 400,
        "/v1/chat/completions%00": 400,
        "/v1/./chat/completions": 400,
        "/v1/echo/%252e%252e/%252e%252e/flush_cache": 400,  # encoded twice: one more decoding hop
        "/v1/echo/..%5C..%5Cflush_cache": 400,
        "/v1/load_lora_adapter": 404,
        "/v1/unload_lora_adapter": 404,
        "/update_weights_from_disk": 404,
        "/flush_cache": 404,
    }
    for path, status in refused.items():
        got, headers, answer = raw_answer(url, b"POST %s HTTP/1.1\r\nhost: x" % path.encode(), body)
        assert got == status, (path, got, answer)
        assert "x-specgate-backend" not in headers
        err = orjson.loads(answer)["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert err["code"] == ("invalid_path" if status == 400 else "not_found")
    # A listed path asked with another method: 405 and what it takes (no 404, nothing forwarded).
    for method in ("PUT", "DELETE", "PATCH", "OPTIONS", "GET", "HEAD"):
        got, headers, answer = raw_answer(url, b"%s /v1/chat/completions HTTP/1.1\r\nhost: x" % method.encode())
        assert (got, headers["allow"]) == (405, "POST"), (method, answer)
    got, headers, _ = raw_answer(url, b"POST /v1/models HTTP/1.1\r\nhost: x")
    assert (got, headers["allow"]) == (405, "GET, HEAD")
    # The server saw none of it: only specgate's own polls.
    reached = [s for s in httpx.get(server + "/seen").json() if s != "GET /metrics"]
    assert reached == [], reached
    # What is listed still goes through, query and all.
    got, headers, answer = raw_answer(url, b"POST /v1/echo/x?a=%2F HTTP/1.1\r\nhost: x", b"{}")
    assert got == 200 and orjson.loads(answer)["target"] == "/v1/echo/x?a=%2F"
    still_healthy(url)


def test_a_json_body_cut_short_cuts_the_clients_connection_with_one_line_logged(hostile: tuple[str, Proc]) -> None:
    url, proxy = hostile
    with pytest.raises(httpx.RemoteProtocolError):
        httpx.post(
            url + "/v1/chat/completions", json={"mode": "json_cut", "messages": [{"role": "user", "content": "x"}]}
        )
    still_healthy(url)
    wait_for(lambda: "client connection cut" in "".join(proxy.stderr_lines))
    logged = "".join(proxy.stderr_lines)
    assert "Exception in ASGI application" not in logged and "without completing" not in logged, logged
    assert logged.count("json_cut") == 0  # nothing of the request's body
