"""The client side of specgate's sockets (proxy/edge/protocol.py) and its operator endpoints: how long a
connection may stay without a request, how large a head may grow, how many connections may be
open, and who may read /routing and /metrics. Raw sockets: these are about framing and timing."""

from __future__ import annotations

import asyncio
import gc
import select
import socket
import time
from typing import Any

import httpx
import orjson
import uvicorn
import uvloop
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from loadtest.procs import http_status
from loadtest.slowloris import format_report, run_slowloris
from proxy.edge.protocol import edge_protocol

from ..conftest import StartStack
from ..helpers import scrape, wait_for, wait_until


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def _closed_within(sock: socket.socket, limit_s: float, drip: bytes = b"") -> tuple[float, bytes]:
    """Seconds until the server closed `sock` (sending `drip` every 0.2 s meanwhile), and what
    it wrote before closing."""
    t0 = time.monotonic()
    got = b""
    while time.monotonic() - t0 < limit_s:
        if drip:
            try:
                sock.send(drip)
            except OSError:
                return time.monotonic() - t0, got
        ready, _, _ = select.select([sock], [], [], 0.2)
        if ready:
            try:
                part = sock.recv(65536)
            except ConnectionResetError:
                part = b""
            if not part:
                return time.monotonic() - t0, got
            got += part
    raise AssertionError(f"still open after {limit_s} s: {got!r}")


def _request(path: str, body: bytes) -> bytes:
    return b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
        path.encode(),
        len(body),
        body,
    )


def test_connections_without_a_request_are_closed(stack: StartStack) -> None:
    s = stack(SPECGATE_HEADER_TIMEOUT_S="1", SPECGATE_KEEPALIVE_TIMEOUT_S="1")
    addr = ("127.0.0.1", _port(s.url))
    idle = socket.create_connection(addr)  # never a byte
    half = socket.create_connection(addr)  # half a head, then one byte every 0.2 s (slowloris)
    half.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ")
    with idle, half:
        took, said = _closed_within(half, 6, drip=b"a")
        assert 0.8 < took < 2.5, took
        assert said.startswith(b"HTTP/1.1 408") and b"request_timeout" in said
        took, said = _closed_within(idle, 6)
        assert took < 2.5 and said == b""  # nothing sent, nothing said: closed as nginx does
    # A kept-alive connection: idle after its response, closed after the keep-alive timeout; one that
    # then drips bare line ends (which begin no request) is closed by the header timeout.
    body = b'{"prompt": "p", "max_tokens": 2}'
    for drip in (b"", b"\r\n"):
        with socket.create_connection(addr) as conn:
            conn.sendall(_request("/v1/completions", body))
            answer = b""
            while b'"usage"' not in answer:
                answer += conn.recv(65536)
            assert answer.startswith(b"HTTP/1.1 200")
            took, said = _closed_within(conn, 6, drip=drip)
            assert took < 2.5, (drip, took)
            assert said.startswith(b"HTTP/1.1 408") if drip else said == b"", said
    # A head past 64 KiB: 431, however fast it comes.
    with socket.create_connection(addr) as big:
        big.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Big: " + b"b" * 70_000)
        _, said = _closed_within(big, 6)
        assert said.startswith(b"HTTP/1.1 431") and b"request_header_too_large" in said
    counted = httpx.get(s.url + "/metrics").text
    assert 'specgate_client_rejections_total{reason="header_timeout"} 3.0' in counted
    assert 'specgate_client_rejections_total{reason="head_too_large"} 1.0' in counted
    assert httpx.post(s.url + "/v1/completions", json={"prompt": "p", "max_tokens": 2}).status_code == 200


def test_connections_past_the_cap_are_refused_and_streams_run_on(stack: StartStack) -> None:
    s = stack(sim_args=("--time-scale", "1"), SPECGATE_MAX_CLIENT_CONNECTIONS="3")
    addr = ("127.0.0.1", _port(s.url))
    body = orjson.dumps({"prompt": "p", "max_tokens": 150, "stream": True, "ignore_eos": True})
    stream = socket.create_connection(addr)
    stream.sendall(_request("/v1/completions", body))
    got = stream.recv(65536)
    assert got.startswith(b"HTTP/1.1 200")
    idle = [socket.create_connection(addr) for _ in range(2)]  # three open now: the cap
    for sock in idle:  # answered, so the server holds them (kept alive, idle from then on)
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
    with socket.create_connection(addr) as extra:
        extra.sendall(_request("/v1/completions", b'{"prompt": "p", "max_tokens": 2}'))
        _, said = _closed_within(extra, 5)
    assert said.startswith(b"HTTP/1.1 503") and b"too_many_connections" in said, said
    # The stream that was running goes on to its end.
    stream.settimeout(30)
    while b"data: [DONE]" not in got:
        part = stream.recv(65536)
        assert part, got[-300:]
        got += part
    assert b'"error"' not in got
    for sock in (stream, *idle):
        sock.close()
    wait_for(lambda: http_status(s.url + "/health") == 200)  # the closes reach the server: served again
    metrics = scrape(s.url)
    assert metrics["specgate_client_rejections_total"] >= 1
    assert metrics["specgate_client_connections"] == 1  # this scrape's own


def test_operator_endpoints_need_an_admin_key_when_set(stack: StartStack) -> None:
    s = stack(SPECGATE_API_KEYS="k", SPECGATE_ADMIN_KEYS="adm")
    for auth in ({}, {"Authorization": "Bearer k"}, {"Authorization": "Bearer nope"}):
        r = httpx.get(s.url + "/routing", headers=auth)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert r.json()["error"]["code"] == "invalid_api_key" and "admin key" in r.json()["error"]["message"]
    assert httpx.get(s.url + "/routing", headers={"Authorization": "Bearer adm"}).json()["mode"] == "speculative"
    # Prometheus and probes need none by default.
    for path in ("/metrics", "/health", "/ready"):
        assert httpx.get(s.url + path).status_code == 200, path
    # An admin key is not an inference key.
    r = httpx.post(s.url + "/v1/completions", json={"prompt": "p", "max_tokens": 2},
                   headers={"Authorization": "Bearer adm"})  # fmt: skip
    assert r.status_code == 401
    guarded = stack(SPECGATE_ADMIN_KEYS="adm", SPECGATE_PROTECT_METRICS="true")
    assert httpx.get(guarded.url + "/metrics").status_code == 401
    assert httpx.get(guarded.url + "/metrics", headers={"Authorization": "Bearer adm"}).status_code == 200
    assert httpx.get(guarded.url + "/ready").status_code == 200


def test_slowloris_scenario_runs() -> None:
    """`python -m loadtest slowloris`, small and short: a benchmark, so nothing timed is asserted,
    only that the attack happened and was dealt with."""
    report = uvloop.run(run_slowloris(idle=100, slow=10, concurrency=2, phase_s=1.5, time_scale=50,
                                      max_tokens=4, header_timeout_s=0.5))  # fmt: skip
    quiet, attack, recovery = report.phases
    assert quiet.requests and attack.requests and recovery.requests
    assert attack.attacker_closed_by_specgate >= 110 and attack.attacker_408 >= 10
    assert report.rejections["header_timeout"] >= 110
    assert quiet.errors == attack.errors == recovery.errors == 0
    assert "under attack" in format_report(report)


def test_a_finished_request_is_freed_without_the_garbage_collector() -> None:
    """The protocol hands each request an abort (edge.ABORT) in its scope: held there, it must not
    make the request a reference loop that only the collector frees, on every request."""

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    async def serve() -> int:
        config = uvicorn.Config(app, host="127.0.0.1", port=0, http=edge_protocol(10, 100), lifespan="off")
        server = uvicorn.Server(config)
        task = asyncio.create_task(server.serve())
        await wait_until(lambda: server.started)
        port = server.servers[0].sockets[0].getsockname()[1]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        gc.collect()
        gc.disable()
        try:
            for _ in range(50):
                writer.write(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
                await reader.readuntil(b"ok")
            live = sum(isinstance(o, RequestResponseCycle) for o in gc.get_objects())
        finally:
            gc.enable()
            writer.close()
            server.should_exit = True
            await task
        return live

    assert asyncio.run(serve()) <= 1  # the connection's current request, at most
