"""Hostile and malformed input on the HTTP surface: never a 500, never a hang, never a leaked
in-flight count, always an OpenAI-style error where the proxy rejects."""

from __future__ import annotations

import json
import socket
import time
from typing import Any

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ..conftest import StartStack
from ..helpers import routing, scrape, wait_for

PATHS = ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/generate", "/v1/embeddings", "/v1/",
         "/generate?x=1"]  # fmt: skip
FIELDS = ["model", "messages", "prompt", "max_tokens", "max_completion_tokens", "stream", "stream_options", "n",
          "temperature", "text", "sampling_params", "rid", "ignore_eos",
          "input", "instructions", "max_output_tokens", "previous_response_id", "store"]  # fmt: skip

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)


def _short(body: dict[str, Any]) -> dict[str, Any]:
    """Keep generations short: a valid length becomes 4 (invalid ones stay, to be rejected)."""
    for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            body[key] = 4
    return body


# Known fields with values of any type, sometimes the right one.
known_bodies = st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=6).map(_short)


def _dump(value: Any) -> bytes:
    # The stdlib writes what orjson cannot (integers past 64 bits): hostile input worth sending.
    return json.dumps(value).encode()


bodies = st.one_of(
    known_bodies.map(_dump),
    json_values.map(_dump),
    st.binary(max_size=300),
    st.just(b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": true}'),
)
content_types = st.sampled_from(["application/json", "application/json; charset=utf-8", "text/plain", "",
                                 "application/x-www-form-urlencoded", "APPLICATION/JSON", ";;"])  # fmt: skip
# Printable header values a client can send (no surrounding blanks).
header_text = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=40).filter(lambda t: t == t.strip())


def is_openai_error(body: Any) -> bool:
    err = body.get("error") if isinstance(body, dict) else None
    return (
        isinstance(err, dict) and set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str)
    )


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_requests_never_500_hang_or_leak(stack: StartStack, data: st.DataObject) -> None:
    if not hasattr(test_random_requests_never_500_hang_or_leak, "stack"):
        test_random_requests_never_500_hang_or_leak.stack = stack(  # type: ignore[attr-defined]
            sim_args=("--time-scale", "50", "--default-max-tokens", "8"), SPECGATE_API_KEYS="k",
            SPECGATE_MAX_BODY_BYTES="2048",
        )  # fmt: skip
    s = test_random_requests_never_500_hang_or_leak.stack  # type: ignore[attr-defined]
    path = data.draw(st.sampled_from(PATHS))
    body = data.draw(bodies)
    headers = {"Authorization": data.draw(st.sampled_from(["Bearer k", "Bearer k", "Bearer nope", "k", ""]))}
    ctype = data.draw(content_types)
    if ctype:
        headers["Content-Type"] = ctype
    if data.draw(st.booleans()):
        headers["X-Request-Id"] = data.draw(header_text)
    if data.draw(st.booleans()):
        body = body + b" " * data.draw(st.integers(0, 4000))  # past the body limit sometimes
    r = httpx.post(s.url + path, content=body, headers=headers, timeout=10)
    assert r.status_code < 500, (r.status_code, r.text[:300])
    routed = "x-specgate-backend" in r.headers
    if r.status_code >= 400 and not routed:
        assert is_openai_error(r.json()), r.text[:300]  # the proxy's own rejections
    assert r.headers["x-request-id"]
    wait_for(lambda: routing(s.url)["inflight"] == 0, interval_s=0.01)


def test_requests_that_fail_or_succeed_leave_nothing_in_flight(stack: StartStack) -> None:
    s = stack(sim_args=("--time-scale", "50"))
    for body in (b"{", b'{"prompt": "p", "max_tokens": 2, "stream": true}', b"[]"):
        httpx.post(s.url + "/v1/completions", content=body, headers={"Content-Type": "application/json"})
    assert httpx.get(s.url + "/routing").json()["inflight"] == 0
    assert scrape(s.url)["specgate_inflight_requests"] == 0


def test_body_sent_a_byte_at_a_time_times_out(stack: StartStack) -> None:
    s = stack(SPECGATE_READ_TIMEOUT_S="1")
    port = int(s.url.rsplit(":", 1)[1])
    body = b'{"prompt": "p", "max_tokens": 2}'
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body))  # fmt: skip
        t0 = time.monotonic()
        sock.sendall(body[:1])  # then nothing more
        reply = b""
        while b"request_timeout" not in reply and time.monotonic() - t0 < 8:  # headers and body may split
            part = sock.recv(4096)
            if not part:
                break
            reply += part
    assert reply.startswith(b"HTTP/1.1 408")
    assert b"request_timeout" in reply
    assert 0.8 < time.monotonic() - t0 < 5
    assert httpx.get(s.url + "/routing").json()["inflight"] == 0


def test_malformed_protocol_lines_are_rejected_cleanly(stack: StartStack) -> None:
    s = stack()
    port = int(s.url.rsplit(":", 1)[1])
    for raw in (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Request-Id: a\rb\r\nContent-Length: 2\r\n\r\n{}",
                b"GARBAGE\r\n\r\n", b"POST /v1/completions HTTP/1.1\r\nContent-Length: -5\r\n\r\n"):  # fmt: skip
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(raw)
            assert sock.recv(4096).startswith(b"HTTP/1.1 400")
    r = httpx.post(s.url + "/v1/completions", json={"prompt": "p", "max_tokens": 2})
    assert r.status_code == 200  # still serving


def test_repeated_and_missing_headers(stack: StartStack) -> None:
    s = stack(SPECGATE_API_KEYS="k")
    url = s.url + "/v1/completions"
    body = b'{"prompt": "p", "max_tokens": 2}'
    # Repeated headers: the first one counts (a second key cannot sneak in behind a wrong first).
    twice = [("Authorization", "Bearer wrong"), ("Authorization", "Bearer k"), ("Content-Type", "application/json")]
    assert httpx.post(url, content=body, headers=twice).status_code == 401
    ok = [
        ("Authorization", "Bearer k"),
        ("Authorization", "Bearer wrong"),
        ("Content-Type", "application/json"),
        ("Content-Type", "text/plain"),
        ("X-Request-Id", "a"),
        ("X-Request-Id", "b"),
    ]
    r = httpx.post(url, content=body, headers=ok)
    assert r.status_code == 200 and r.headers["x-request-id"] == "a"
    # No Content-Type at all: a JSON body is still accepted.
    assert httpx.post(url, content=body, headers={"Authorization": "Bearer k"}).status_code == 200
    assert httpx.get(s.url + "/routing").json()["inflight"] == 0
