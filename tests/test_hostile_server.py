"""A server that misbehaves: the proxy relays what it can, reports an error where it must, stays
healthy, keeps memory bounded and leaves nothing in flight."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from loadtest.procs import Proc, free_port, start

from .conftest import StartSim
from .helpers import scrape


@pytest.fixture
def hostile(simulator: StartSim) -> Iterator[tuple[str, Proc]]:
    """specgate whose speculative server misbehaves (the baseline is a simulator)."""
    port = free_port()
    bad = start("hostile", ["-m", "tests.hostile_server", str(port)], ready_url=f"http://127.0.0.1:{port}/health")
    base = simulator("baseline", "--time-scale", "20")
    proxy_port = free_port()
    env = {"SPECGATE_HOST": "127.0.0.1", "SPECGATE_PORT": str(proxy_port), "SPECGATE_LOG_LEVEL": "warning",
           "SPECGATE_SPECULATIVE_URL": f"http://127.0.0.1:{port}", "SPECGATE_BASELINE_URL": base.url,
           "SPECGATE_READ_TIMEOUT_S": "1", "SPECGATE_HEALTH_INTERVAL_S": "0.5"}  # fmt: skip
    url = f"http://127.0.0.1:{proxy_port}"
    proxy = start("proxy", ["-m", "proxy"], ready_url=url + "/ready", env=env)
    try:
        yield url, proxy
    finally:
        proxy.stop()
        bad.stop()


def ask(url: str, mode: str, stream: bool = True, **kw: object) -> httpx.Response:
    body = {"mode": mode, "messages": [{"role": "user", "content": "x"}], "stream": stream}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=30, **kw)  # type: ignore[arg-type]


def still_healthy(url: str) -> None:
    assert httpx.get(url + "/routing").json()["inflight"] == 0
    assert httpx.get(url + "/ready").status_code == 200


def test_malformed_sse_is_relayed_as_sent(hostile: tuple[str, Proc]) -> None:
    url, _ = hostile
    r = ask(url, "malformed_sse")
    assert r.status_code == 200
    assert r.content == b"data: {not json\n\ndata: \xff\xfe\n\nevent: weird\nretry: x\n\ndata: [DONE]\n\n"
    still_healthy(url)


def test_garbage_with_200_is_relayed_and_usage_skipped(hostile: tuple[str, Proc]) -> None:
    url, _ = hostile
    r = ask(url, "garbage_200", stream=False)
    assert r.status_code == 200 and r.content == b"\x00\xffnot json at all"
    assert scrape(url)["specgate_output_tokens_total"] == 0
    still_healthy(url)


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


def test_stream_without_event_boundaries_still_flows(hostile: tuple[str, Proc]) -> None:
    url, _ = hostile
    r = ask(url, "no_blank_lines")  # the client did not ask for usage: specgate strips, so it scans
    assert r.status_code == 200 and len(r.content) == 64 * (6 + 8192 + 1)
    still_healthy(url)


def test_reset_mid_stream_ends_with_error_event(hostile: tuple[str, Proc]) -> None:
    url, _ = hostile
    r = ask(url, "reset_mid_stream")
    assert r.status_code == 200
    events = [e for e in r.content.split(b"\n\n") if e]
    assert events[0].startswith(b'data: {"choices"')
    assert b'"error"' in events[-2] and events[-1] == b"data: [DONE]"
    still_healthy(url)


def test_never_ending_stream_is_cut_when_the_client_leaves(hostile: tuple[str, Proc]) -> None:
    url, _ = hostile
    got = 0
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=10,
                      json={"mode": "never_ends", "messages": [{"role": "user", "content": "x"}],
                            "stream": True}) as r:  # fmt: skip
        lines = r.iter_lines()
        while got < 20:
            next(lines)
            got += 1
    deadline = time.monotonic() + 5
    while httpx.get(url + "/routing").json()["inflight"] and time.monotonic() < deadline:
        time.sleep(0.05)
    still_healthy(url)
    assert scrape(url)["specgate_client_disconnects_total"] == 1


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
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if httpx.get(url + "/routing").json()["inflight"] == 0:
                break
            time.sleep(0.2)
        assert httpx.get(url + "/routing").json()["inflight"] == 0
        assert scrape(url)["specgate_client_disconnects_total"] == 1
    finally:
        sock.close()
    assert proxy.alive()
    still_healthy(url)


def test_the_server_gets_the_request_as_the_client_sent_it(hostile: tuple[str, Proc]) -> None:
    url, _ = hostile
    body = b'{"stream": false, "x": "\\u00e9"}'
    headers = {"Content-Type": "application/json", "X-Custom": "v", "Cookie": "c=1", "Authorization": "Bearer k",
               "Connection": "keep-alive", "X-Request-Id": "rid-1"}  # fmt: skip
    r = httpx.post(url + "/v1/echo/a%20b%2Fc?x=1&y=%3D", content=body, headers=headers, timeout=10)
    assert r.status_code == 200 and r.headers["x-specgate-backend"] == "speculative"
    seen = r.json()
    # Still percent-encoded: the decoded path ("a b/c") would be a different request, or a broken one.
    assert seen["target"] == "/v1/echo/a%20b%2Fc?x=1&y=%3D"
    assert seen["body"] == body.decode()
    got = {k.lower(): v for k, v in seen["headers"]}
    assert got["x-custom"] == "v" and got["cookie"] == "c=1" and got["x-request-id"] == "rid-1"
    assert got["content-type"] == "application/json" and got["content-length"] == str(len(body))
    assert got["host"].startswith("127.0.0.1:") and got["host"] != url.removeprefix("http://")  # the server's own
    # The client's credentials and hop-by-hop headers stay with the proxy.
    assert "authorization" not in got and "connection" not in got


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


def test_done_is_not_held_for_a_body_that_stays_open(hostile: tuple[str, Proc]) -> None:
    url, _ = hostile
    body = {"mode": "done_then_hold", "messages": [], "stream": True}
    server = httpx.get(url + "/routing").json()["backends"]["speculative"]["url"]
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=10) as r:
        pieces = r.iter_raw()
        got = b""
        while b"data: [DONE]\n\n" not in got:
            got += next(pieces)  # arrives while the server still holds its body open
        assert got.endswith(b"data: [DONE]\n\n")
        httpx.post(server + "/release", timeout=10)
        assert b"".join(pieces) == b""
    still_healthy(url)
