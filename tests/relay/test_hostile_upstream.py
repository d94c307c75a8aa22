"""A server that misbehaves, in-process: the app relays what it can, reports an error where it must,
stays healthy and leaves nothing in flight. The misbehaving server (tests/hostile_server.py) and the
baseline simulator run in the test's loop (tests/inprocess.py). What needs the process (its memory,
its socket writes, raw request lines) stays in test_hostile_server.py."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
from openai._streaming import SSEDecoder

from loadtest.procs import free_port
from proxy.fleet import promtext

from ..helpers import wait_until
from ..hostile_server import RESPONSES_CRLF, serving
from ..inprocess import Gateway, StartGateway
from .test_hostile_server import ALLOWED

pytestmark = pytest.mark.anyio


@pytest.fixture
async def bad_server() -> AsyncIterator[str]:
    async with serving(free_port()) as url:
        yield url


async def hostile_gateway(gateway: StartGateway, bad_server: str, **settings: Any) -> Gateway:
    """The app whose speculative server misbehaves (the baseline is a simulator)."""
    return await gateway(
        speculative_url=bad_server, read_timeout_s=1, health_interval_s=0.5, allowed_paths=ALLOWED, **settings
    )


async def ask(gw: Gateway, mode: str, stream: bool = True) -> Any:
    body = {"mode": mode, "messages": [{"role": "user", "content": "x"}], "stream": stream}
    return await gw.client.post("/v1/chat/completions", json=body)


async def still_healthy(gw: Gateway) -> None:
    assert (await gw.routing())["inflight"] == 0
    assert (await gw.client.get("/ready")).status_code == 200


async def test_malformed_sse_is_relayed_as_sent(gateway: StartGateway, bad_server: str) -> None:
    gw = await hostile_gateway(gateway, bad_server)
    r = await ask(gw, "malformed_sse")
    assert r.status_code == 200
    assert r.content == b"data: {not json\n\ndata: \xff\xfe\n\nevent: weird\nretry: x\n\ndata: [DONE]\n\n"
    await still_healthy(gw)


async def test_garbage_with_200_is_relayed_and_usage_skipped(gateway: StartGateway, bad_server: str) -> None:
    gw = await hostile_gateway(gateway, bad_server)
    r = await ask(gw, "garbage_200", stream=False)
    assert r.status_code == 200 and r.content == b"\x00\xffnot json at all"
    assert (await gw.metrics())["specgate_output_tokens_total"] == 0
    await still_healthy(gw)


async def test_stream_without_event_boundaries_still_flows(gateway: StartGateway, bad_server: str) -> None:
    gw = await hostile_gateway(gateway, bad_server)
    r = await ask(gw, "no_blank_lines")  # the client did not ask for usage: specgate strips, so it scans
    assert r.status_code == 200 and len(r.content) == 64 * (6 + 8192 + 1)
    await still_healthy(gw)


async def test_reset_mid_stream_ends_with_error_event(gateway: StartGateway, bad_server: str) -> None:
    gw = await hostile_gateway(gateway, bad_server)
    r = await ask(gw, "reset_mid_stream")
    assert r.status_code == 200
    events = [e for e in r.content.split(b"\n\n") if e]
    assert events[0].startswith(b'data: {"choices"')
    assert b'"error"' in events[-2] and events[-1] == b"data: [DONE]"
    await still_healthy(gw)


async def test_never_ending_stream_is_cut_when_the_client_leaves(gateway: StartGateway, bad_server: str) -> None:
    gw = await hostile_gateway(gateway, bad_server)
    body = {"mode": "never_ends", "messages": [{"role": "user", "content": "x"}], "stream": True}
    async with gw.client.stream("POST", "/v1/chat/completions", json=body) as r:
        lines = r.aiter_lines()
        for _ in range(20):
            await anext(lines)

    async def released() -> bool:
        return bool((await gw.routing())["inflight"] == 0)

    await wait_until(released)
    await still_healthy(gw)
    assert (await gw.metrics())["specgate_client_disconnects_total"] == 1


async def test_the_server_gets_the_request_as_the_client_sent_it(gateway: StartGateway, bad_server: str) -> None:
    gw = await hostile_gateway(gateway, bad_server)
    body = b'{"stream": false, "x": "\\u00e9"}'
    headers = {"Content-Type": "application/json", "X-Custom": "v", "Cookie": "c=1", "Authorization": "Bearer k",
               "Connection": "keep-alive", "X-Request-Id": "rid-1"}  # fmt: skip
    r = await gw.client.post("/v1/echo/a%20b?x=1&y=%3D%2F", content=body, headers=headers)
    assert r.status_code == 200 and r.headers["x-specgate-backend"] == "speculative"
    seen = r.json()
    # Still percent-encoded: the decoded target ("a b", "y==/") would be a different request.
    assert seen["target"] == "/v1/echo/a%20b?x=1&y=%3D%2F"
    assert seen["body"] == body.decode()
    got = {k.lower(): v for k, v in seen["headers"]}
    assert got["x-custom"] == "v" and got["cookie"] == "c=1" and got["x-request-id"] == "rid-1"
    assert got["content-type"] == "application/json" and got["content-length"] == str(len(body))
    assert got["host"] == bad_server.removeprefix("http://")  # the server's own
    # The client's credentials and hop-by-hop headers stay with the proxy.
    assert "authorization" not in got and "connection" not in got


async def test_done_is_not_held_for_a_body_that_stays_open(gateway: StartGateway, bad_server: str) -> None:
    gw = await hostile_gateway(gateway, bad_server)
    body = {"mode": "done_then_hold", "messages": [], "stream": True}
    async with gw.client.stream("POST", "/v1/chat/completions", json=body) as r:
        pieces = r.aiter_raw()
        got = b""
        while b"data: [DONE]\n\n" not in got:
            got += await anext(pieces)  # arrives while the server still holds its body open
        assert got.endswith(b"data: [DONE]\n\n")
        await gw.http.post(bad_server + "/release")
        assert b"".join([p async for p in pieces]) == b""
    await still_healthy(gw)


async def test_hop_by_hop_and_forwarding_headers(gateway: StartGateway, bad_server: str) -> None:
    headers = [("connection", "keep-alive, X-Secret-Hop"), ("x-secret-hop", "s"), ("x-forwarded-for", "6.6.6.6"),
               ("x-forwarded-proto", "https"), ("x-real-ip", "6.6.6.6"), ("forwarded", "for=6.6.6.6"),
               ("x-kept", "k")]  # fmt: skip

    async def upstream_saw(gw: Gateway) -> dict[str, str]:
        r = await gw.client.post("/v1/echo/h", content=b"{}", headers=headers)
        assert r.status_code == 200, r.text
        return {k.lower(): v for k, v in r.json()["headers"]}

    got = await upstream_saw(await hostile_gateway(gateway, bad_server))
    # Named in the client's Connection: hop-by-hop (RFC 9110 7.6.1), not forwarded.
    assert "x-secret-hop" not in got and got["x-kept"] == "k"
    # From an untrusted peer (127.0.0.1 here), its own forwarding headers are dropped and the peer
    # is what counts.
    assert got["x-forwarded-for"] == "127.0.0.1" and got["x-forwarded-proto"] == "http"
    assert "x-real-ip" not in got and "forwarded" not in got
    # Behind a trusted proxy: its values are kept and the peer appended, as nginx's
    # $proxy_add_x_forwarded_for does.
    trusting = await hostile_gateway(gateway, bad_server, trusted_proxies="10.0.0.0/8, 127.0.0.1")
    got = await upstream_saw(trusting)
    assert got["x-forwarded-for"] == "6.6.6.6, 127.0.0.1" and got["x-forwarded-proto"] == "https"
    assert got["x-real-ip"] == "6.6.6.6" and "x-secret-hop" not in got


async def test_huge_response_head_is_not_relayed(gateway: StartGateway, bad_server: str) -> None:
    # One good server: the request fails over to it, and the 200 KB head never reaches the client.
    gw = await hostile_gateway(gateway, bad_server)
    r = await ask(gw, "huge_head", stream=False)
    assert r.status_code == 200 and r.headers["x-specgate-backend"] == "baseline"
    assert r.headers["x-specgate-reason"] == "failover" and "x-pad" not in r.headers
    await still_healthy(gw)
    # Both servers send it: 502 upstream_unavailable, counted as the servers' protocol faults.
    both = await hostile_gateway(gateway, bad_server, baseline_url=bad_server)
    r = await ask(both, "huge_head", stream=False)
    assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_unavailable"
    assert "x-pad" not in r.headers and len(r.content) < 1024
    errors = await both.metrics_text()
    assert 'specgate_upstream_errors_total{backend="speculative",kind="protocol"} 1.0' in errors
    assert 'specgate_upstream_errors_total{backend="baseline",kind="protocol"} 1.0' in errors
    # ...and by the server that failed.
    assert 'specgate_server_upstream_errors_total{kind="protocol",server="speculative"} 1.0' in errors
    assert 'specgate_server_upstream_errors_total{kind="protocol",server="baseline"} 1.0' in errors
    assert (await both.client.get("/ready")).status_code == 200  # a bad answer is not a dead server


def sdk(gw: Gateway) -> openai.AsyncOpenAI:
    """The real openai client, over the in-process transport."""
    # The SDK types its client as httpx2's; the in-process httpx client speaks the same interface.
    client: Any = gw.client
    return openai.AsyncOpenAI(base_url="http://specgate/v1", api_key="k", http_client=client, max_retries=0)


@pytest.mark.parametrize("own_usage", [False, True], ids=["usage-asked-by-specgate", "usage-asked-by-client"])
async def test_a_chat_stream_cut_mid_event_gives_the_client_whole_events_then_the_error(
    gateway: StartGateway, bad_server: str, own_usage: bool
) -> None:
    gw = await hostile_gateway(gateway, bad_server)
    body: dict[str, Any] = {
        "mode": "chat_cut_mid_event",
        "messages": [{"role": "user", "content": "x"}],
        "stream": True,
    }
    if own_usage:  # then specgate drops nothing, and passed the stream on as it came
        body["stream_options"] = {"include_usage": True}
    r = await gw.client.post("/v1/chat/completions", json=body)
    # The openai SDK's own decoder: every event it reads is whole JSON, the half event is gone.
    events = [e for e in SSEDecoder().iter_bytes(iter([r.content]))]
    assert events[-1].data == "[DONE]"
    datas = [e.json() for e in events[:-1]]
    assert datas[0]["choices"][0]["delta"]["content"] == " a"
    assert len(datas) == 2 and datas[1]["error"]["code"] == "upstream_disconnect"
    with pytest.raises(openai.APIError, match="Upstream stream broke"):
        stream = await sdk(gw).chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "x"}],
            stream=True,
            extra_body={"mode": "chat_cut_mid_event"},
        )
        async for _ in stream:
            pass
    await still_healthy(gw)


async def test_a_responses_stream_cut_mid_event_ends_with_its_error_event(
    gateway: StartGateway, bad_server: str
) -> None:
    gw = await hostile_gateway(gateway, bad_server)
    stream = await sdk(gw).responses.create(
        model="m", input="x", stream=True, extra_body={"mode": "responses_cut_mid_event"}
    )
    events = [e async for e in stream]
    assert [e.type for e in events] == ["response.created", "response.output_text.delta", "error"]
    # Numbered after the server's last event: the `: ping` comments between them are no events.
    assert events[-1].sequence_number == 2
    await still_healthy(gw)


async def test_a_crlf_framed_responses_stream_is_read_and_its_response_remembered(
    gateway: StartGateway, bad_server: str
) -> None:
    gw = await hostile_gateway(gateway, bad_server)
    body = {"mode": "responses_crlf", "model": "m", "input": "x", "stream": True}
    r = await gw.client.post("/v1/responses", json=body)
    assert r.status_code == 200 and r.content == RESPONSES_CRLF
    assert (await gw.metrics())["specgate_output_tokens_total"] == 4
    again = await gw.client.post("/v1/responses", json={**body, "previous_response_id": "resp_crlf"})
    assert again.headers["x-specgate-reason"] == "stored_response"
    await still_healthy(gw)


async def test_a_json_body_cut_short_cuts_the_clients_connection(gateway: StartGateway, bad_server: str) -> None:
    gw = await hostile_gateway(gateway, bad_server)
    with pytest.raises(httpx.RemoteProtocolError):
        await ask(gw, "json_cut", stream=False)
    found = promtext.samples(await gw.metrics_text(), {"specgate_requests_total", "specgate_upstream_errors_total"})
    codes = {s.labels["code"] for s in found if s.name == "specgate_requests_total" and s.value}
    assert codes == {"5xx"}  # the server's failure, not a 2xx
    assert sum(s.value for s in found if s.name == "specgate_upstream_errors_total") == 1
    await still_healthy(gw)


@pytest.mark.parametrize("name", ["x-specgate-priority", "x-specgate-class", "x-session-id"])
async def test_a_repeated_specgate_header_is_refused(gateway: StartGateway, bad_server: str, name: str) -> None:
    gw = await hostile_gateway(gateway, bad_server)
    value = "interactive" if name == "x-specgate-priority" else "a"
    r = await gw.client.post("/v1/echo/x", json={}, headers=[(name, value), (name.upper(), value)])
    assert r.status_code == 400 and r.json()["error"]["code"] == "repeated_header"
    assert name in r.json()["error"]["message"]
    assert (await gw.client.post("/v1/echo/x", json={}, headers=[(name, value)])).status_code == 200
    await still_healthy(gw)


async def test_two_trace_contexts_are_none_and_neither_is_forwarded(gateway: StartGateway, bad_server: str) -> None:
    gw = await hostile_gateway(gateway, bad_server)
    one = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    two = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    state = ("tracestate", "k=v")
    r = await gw.client.post("/v1/echo/x", json={}, headers=[("traceparent", one), ("traceparent", two), state])
    got = {k.lower() for k, _ in r.json()["headers"]}
    assert r.status_code == 200 and not got & {"traceparent", "tracestate"}
    r = await gw.client.post("/v1/echo/x", json={}, headers=[("traceparent", one), state])
    assert [v for k, v in r.json()["headers"] if k.lower() == "traceparent"] == [one]  # tracing off: as sent
