"""The gateway's behaviour through its HTTP surface, in-process: the app from `create_app` driven in
the test's event loop, in front of two simulated SGLang servers in the same loop (tests/inprocess.py).
test_proxy.py keeps what needs the proxy as a process under uvicorn, or the openai SDK on a socket."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import AsyncIterator

import orjson
import pytest

from loadtest.simulator.wire import token_text

from ..helpers import sse_events, sse_json, wait_until
from ..inprocess import Gateway, StartGateway

pytestmark = pytest.mark.anyio

CHAT = [{"role": "user", "content": "What is speculative decoding?"}]
# A generation that outlasts any test, within the simulator's context (131072 tokens: SGLang, and so
# the simulator, refuses prompt + max_tokens past it with 400).
LONG = {"prompt": "p", "max_tokens": 120_000, "stream": True}
SHORT = {"prompt": "p", "max_tokens": 2}


async def test_routing_headers_and_request_id(gateway: StartGateway) -> None:
    gw = await gateway()
    r = await gw.client.post("/v1/completions", json=SHORT, headers={"x-request-id": "abc-1"})
    assert r.status_code == 200
    assert r.headers["x-specgate-backend"] == "speculative"
    assert r.headers["x-specgate-reason"] == "light_load"
    assert r.headers["x-request-id"] == "abc-1"
    generated = (await gw.client.post("/v1/completions", json=SHORT)).headers["x-request-id"]
    assert len(generated) == 32


@pytest.mark.parametrize("include_usage", [True, False])
async def test_streams_are_byte_identical_through_the_proxy(gateway: StartGateway, include_usage: bool) -> None:
    gw = await gateway(sim={"created": 1700000000})
    body: dict[str, object] = {"messages": CHAT, "max_tokens": 40, "stream": True, "rid": "fixed-rid"}
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    direct = (await gw.http.post(gw.spec.url + "/v1/chat/completions", json=body)).content
    proxied = await gw.client.post("/v1/chat/completions", json=body)
    assert proxied.headers["x-specgate-backend"] == "speculative"
    assert proxied.content == direct
    has_usage = any("usage" in e for e in sse_json(proxied.content))
    assert has_usage == include_usage


async def test_non_streamed_answers_are_relayed_as_sent(gateway: StartGateway) -> None:
    gw = await gateway(sim={"created": 1700000000})
    body = {"messages": CHAT, "max_tokens": 8, "rid": "fixed-rid"}
    direct = await gw.http.post(gw.spec.url + "/v1/chat/completions", json=body)
    proxied = await gw.client.post("/v1/chat/completions", json=body)
    assert proxied.status_code == 200
    assert proxied.json()["choices"][0]["message"]["content"] == token_text(0, 8)
    # The same answer but for the latency the simulator reports in it.
    assert proxied.json()["choices"] == direct.json()["choices"]
    assert proxied.json()["usage"] == direct.json()["usage"]
    assert proxied.headers["content-type"] == direct.headers["content-type"]


async def test_usage_counted_whether_or_not_the_client_asked(gateway: StartGateway) -> None:
    gw = await gateway()
    plain = await gw.client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 6, "stream": True})
    chunks = sse_json(plain.content)
    assert all(c.get("usage") is None for c in chunks)  # the usage chunk specgate asked for is dropped
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == token_text(0, 6)
    body = {"messages": CHAT, "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}}
    asked = sse_json((await gw.client.post("/v1/chat/completions", json=body)).content)
    assert asked[-1]["usage"]["completion_tokens"] == 4
    # `null` options are no options: counted, and the chunk the client did not ask for is dropped.
    body = {"messages": CHAT, "max_tokens": 5, "stream": True, "stream_options": None}
    nulled = await gw.client.post("/v1/chat/completions", json=body)
    assert nulled.status_code == 200, nulled.text
    assert all(c.get("usage") is None for c in sse_json(nulled.content))
    await gw.client.post("/v1/completions", json={"prompt": "x" * 40, "max_tokens": 3})
    m = await gw.metrics()
    assert m["specgate_output_tokens_total"] == 6 + 4 + 5 + 3
    assert m["specgate_prompt_tokens_total"] > 0


async def test_switches_to_baseline_under_load_and_back_with_hysteresis(gateway: StartGateway) -> None:
    gw = await gateway(high_watermark=4, low_watermark=2)
    async with contextlib.AsyncExitStack() as held:
        streams = [await held.enter_async_context(contextlib.AsyncExitStack()) for _ in range(4)]
        backends = [(await st.enter_async_context(gw.stream(LONG))).headers["x-specgate-backend"] for st in streams]
        assert backends == ["speculative"] * 4
        assert (await gw.routing())["mode"] == "baseline"  # the load reached the high watermark
        async with gw.stream(LONG) as fifth:
            assert (fifth.headers["x-specgate-backend"], fifth.headers["x-specgate-reason"]) == (
                "baseline",
                "heavy_load",
            )
        # Load 4 -> 3: inside the band, the mode holds.
        await streams[0].aclose()
        await wait_until(lambda: _load_is(gw, 3))
        async with gw.stream(LONG) as held_back:
            assert held_back.headers["x-specgate-reason"] == "hysteresis_hold"
            assert held_back.headers["x-specgate-backend"] == "baseline"
        assert (await gw.routing())["mode"] == "baseline"
        # Load falls to the low watermark: back to speculative.
        await streams[1].aclose()
        await wait_until(lambda: _mode_is(gw, "speculative"))
        async with gw.stream(LONG) as after:
            assert after.headers["x-specgate-backend"] == "speculative"
    await wait_until(lambda: _inflight_is(gw, 0))
    m = await gw.metrics()
    assert m["specgate_mode_switches_total"] == 2
    assert m["specgate_routing_mode"] == 1


async def _load_is(gw: Gateway, n: int) -> bool:
    return bool((await gw.routing())["load"] == n)


async def _mode_is(gw: Gateway, mode: str) -> bool:
    return bool((await gw.routing())["mode"] == mode)


async def _inflight_is(gw: Gateway, n: int) -> bool:
    return bool((await gw.routing())["inflight"] == n)


async def test_spillover(gateway: StartGateway) -> None:
    gw = await gateway(policy="spillover", spillover_limit=2)
    async with gw.stream(LONG) as a, gw.stream(LONG) as b, gw.stream(LONG) as c:
        assert [r.headers["x-specgate-backend"] for r in (a, b, c)] == ["speculative", "speculative", "baseline"]
        assert c.headers["x-specgate-reason"] == "spillover"
        assert (await gw.routing())["backends"]["baseline"]["inflight"] == 1


async def test_retry_on_refused_connection_and_immediate_mark_down(gateway: StartGateway) -> None:
    gw = await gateway(health_interval_s=60)  # no poll will notice the stop: the request must
    await gw.spec.stop()
    r = await gw.client.post("/v1/completions", json={"prompt": "p", "max_tokens": 3})
    assert r.status_code == 200
    assert (r.headers["x-specgate-backend"], r.headers["x-specgate-reason"]) == ("baseline", "failover")
    assert r.json()["choices"][0]["text"] == token_text(0, 3)
    m = await gw.metrics()
    assert m["specgate_failovers_total"] == 1
    assert m["specgate_upstream_errors_total"] == 1
    assert (await gw.routing())["backends"]["speculative"]["healthy"] is False
    nxt = await gw.client.post("/v1/completions", json={"prompt": "p", "max_tokens": 3})
    assert nxt.headers["x-specgate-reason"] == "only_healthy"


@contextlib.asynccontextmanager
async def resetting_server() -> AsyncIterator[str]:
    """A server whose /health answers 200 and that resets every other request's connection once it
    has read the request head: a failure before the first byte of an answer."""
    posts = 0

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal posts
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while head := await reader.readuntil(b"\r\n\r\n"):
                if head.startswith(b"GET /health "):
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
                    await writer.drain()
                    continue
                if not head.startswith(b"GET "):
                    posts += 1
                sock = writer.get_extra_info("socket")
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                break
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.close()
        await server.wait_closed()


async def test_a_reset_before_the_answer_fails_over_to_the_other_server(gateway: StartGateway) -> None:
    async with resetting_server() as url:
        gw = await gateway(speculative_url=url, health_interval_s=60)
        assert (await gw.routing())["backends"]["speculative"]["healthy"] is True
        r = await gw.client.post("/v1/completions", json={"prompt": "p", "max_tokens": 3, "stream": True})
        assert r.status_code == 200
        assert (r.headers["x-specgate-backend"], r.headers["x-specgate-reason"]) == ("baseline", "failover")
        events = sse_json(r.content)
        assert "".join(e["choices"][0]["text"] for e in events) == token_text(0, 3)
        m = await gw.metrics()
        assert m["specgate_failovers_total"] == 1
        assert m["specgate_inflight_requests"] == 0


async def test_failover_when_stopped_and_recovery_when_back(gateway: StartGateway) -> None:
    gw = await gateway()
    await gw.spec.stop()

    async def spec_healthy() -> bool:
        return bool((await gw.routing())["backends"]["speculative"]["healthy"])

    async def spec_down() -> bool:
        return not await spec_healthy()

    await wait_until(spec_down)
    r = await gw.client.post("/v1/completions", json={"prompt": "p", "max_tokens": 3})
    assert (r.headers["x-specgate-backend"], r.headers["x-specgate-reason"]) == ("baseline", "only_healthy")
    assert (await gw.metrics())["specgate_backend_up"] == 1
    await gw.spec.restart()
    await wait_until(spec_healthy)
    r = await gw.client.post("/v1/completions", json={"prompt": "p", "max_tokens": 3})
    assert r.headers["x-specgate-backend"] == "speculative"


async def test_both_down_gives_503_at_once(gateway: StartGateway) -> None:
    gw = await gateway()
    await gw.spec.stop()
    await gw.base.stop()

    async def not_ready() -> bool:
        return (await gw.client.get("/ready")).status_code == 503

    await wait_until(not_ready)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    r = await gw.client.post("/v1/chat/completions", json={"messages": CHAT, "stream": True})
    assert loop.time() - t0 < 1.0
    assert r.status_code == 503
    assert r.json()["error"]["code"] == "no_healthy_backend"
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    models = await gw.client.get("/v1/models")
    assert models.status_code == 503 and models.json()["error"]["code"] == "no_healthy_backend"


async def test_both_down_before_the_poll_notices_is_503_too(gateway: StartGateway) -> None:
    gw = await gateway(health_interval_s=60)
    await gw.spec.stop()
    await gw.base.stop()
    r = await gw.client.post("/v1/completions", json={"prompt": "p"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_healthy_backend"
    assert (await gw.routing())["inflight"] == 0


async def _aborted(gw: Gateway, n: int) -> bool:
    m = await gw.metrics(gw.spec.url)
    return m["sglang:num_aborted_requests_total"] == n


async def test_client_disconnect_aborts_upstream_and_releases(gateway: StartGateway) -> None:
    gw = await gateway(sim={"time_scale": 1})
    async with gw.stream(LONG) as r:
        assert r.headers["x-specgate-backend"] == "speculative"
        assert (await gw.routing())["inflight"] == 1
    await wait_until(lambda: _aborted(gw, 1))
    await wait_until(lambda: _inflight_is(gw, 0))
    m = await gw.metrics()
    assert m["specgate_client_disconnects_total"] == 1
    assert m["specgate_inflight_requests"] == 0
    assert (await gw.http.get(gw.spec.url + "/get_load")).json()[0]["num_reqs"] == 0


async def test_disconnect_while_waiting_for_first_byte(gateway: StartGateway) -> None:
    gw = await gateway(sim={"time_scale": 1, "ttft_base_ms": 5000})
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(gw.client.post("/v1/completions", json=LONG), 0.5)
    await wait_until(lambda: _inflight_is(gw, 0))
    await wait_until(lambda: _aborted(gw, 1))


async def test_read_timeout_before_first_byte_is_504(gateway: StartGateway) -> None:
    gw = await gateway(sim={"stall_rate": 1}, read_timeout_s=0.5)
    r = await gw.client.post("/v1/completions", json={"prompt": "p", "max_tokens": 1})
    assert r.status_code == 504
    assert r.json()["error"]["code"] == "upstream_timeout"
    assert (await gw.routing())["inflight"] == 0


async def test_stall_mid_stream_ends_with_error_event_and_done(gateway: StartGateway) -> None:
    gw = await gateway(sim={"stall_rate": 1, "seed": 1}, read_timeout_s=0.5)
    r = await gw.client.post("/v1/completions", json={"prompt": "p", "max_tokens": 1000, "stream": True})
    assert r.status_code == 200
    events = sse_events(r.content)
    assert events[-1] == b"[DONE]"
    assert b'"error"' in events[-2] and b"upstream_timeout" in events[-2]
    assert len(events) > 3  # some content came first
    m = await gw.metrics()
    assert m["specgate_inflight_requests"] == 0
    assert m["specgate_upstream_errors_total"] == 1
    await wait_until(lambda: _aborted(gw, 1))


async def test_server_errors_pass_through(gateway: StartGateway) -> None:
    gw = await gateway(spec={"fail_rate": 1})
    r = await gw.client.post("/v1/completions", json=SHORT)
    assert r.status_code == 500
    assert r.json()["object"] == "error" and r.json()["code"] == 500  # SGLang's own body, as sent
    again = await gw.client.post("/v1/completions", json={**SHORT, "stream": True})
    assert again.status_code == 500  # an answer from the server is not retried elsewhere
    assert again.headers["x-specgate-backend"] == "speculative"
    m = await gw.metrics()
    assert m["specgate_failovers_total"] == 0
    assert m["specgate_inflight_requests"] == 0


async def test_sglang_validation_error_passes_through(gateway: StartGateway) -> None:
    gw = await gateway()
    r = await gw.client.post("/v1/completions", json={"prompt": "p", "max_tokens": 0})
    assert r.status_code == 400
    assert r.headers["x-specgate-backend"] == "speculative"


async def test_api_keys_and_upstream_key(gateway: StartGateway) -> None:
    gw = await gateway(sim={"api_key": "upstream-secret"}, api_keys="k1,k2", upstream_api_key="upstream-secret")
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "k1"}, {"Authorization": "Basic k1"}):
        r = await gw.client.post("/v1/completions", json=SHORT, headers=headers)
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key"
    assert (await gw.client.get("/v1/models", headers={"Authorization": "Bearer wrong"})).status_code == 401
    # The client's key never travels upstream (the servers want another one), the upstream key does.
    ok = await gw.client.post("/v1/completions", json=SHORT, headers={"Authorization": "Bearer k2"})
    assert ok.status_code == 200 and ok.json()["choices"]
    models = await gw.client.get("/v1/models", headers={"Authorization": "Bearer k1"})
    assert [m["id"] for m in models.json()["data"]] == ["default"]
    assert (await gw.client.get("/health")).status_code == 200
    assert (await gw.metrics())["specgate_requests_total"] >= 5
    # Only the requests with a valid key reached a server.
    spec, base = await gw.metrics(gw.spec.url), await gw.metrics(gw.base.url)
    assert spec["sglang:num_requests_total"] + base["sglang:num_requests_total"] == 1
    assert (await gw.routing())["backends"]["speculative"]["engine_load"] is not None  # scraped with the key


@pytest.mark.parametrize(
    ("body", "headers", "status", "code"),
    [
        (b"{not json", {"Content-Type": "application/json"}, 400, "invalid_json"),
        (b"[1,2]", {"Content-Type": "application/json"}, 400, "invalid_json"),
        (b'{"prompt":"p"}', {"Content-Type": "text/plain"}, 415, "unsupported_media_type"),
        (b'{"prompt":"' + b"x" * 5000 + b'"}', {"Content-Type": "application/json"}, 413, "request_too_large"),
        (b'{"prompt":' + b"[" * 1500 + b"]" * 1500 + b"}", {"Content-Type": "application/json"}, 400, "invalid_json"),
        (b'{"prompt":"\xff\xfe"}', {"Content-Type": "application/json"}, 400, "invalid_json"),
        (b"", {"Content-Type": "application/json"}, 400, "invalid_json"),
    ],
)
async def test_bad_input_gets_openai_errors(
    gateway: StartGateway, body: bytes, headers: dict[str, str], status: int, code: str
) -> None:
    gw = await gateway(max_body_bytes=4096)
    r = await gw.client.post("/v1/completions", content=body, headers=headers)
    assert r.status_code == status
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == code
    assert (await gw.routing())["inflight"] == 0
    assert (await gw.metrics(gw.spec.url))["sglang:num_requests_total"] == 0  # nothing reached a server


async def test_unknown_route_is_openai_shaped_404(gateway: StartGateway) -> None:
    gw = await gateway()
    r = await gw.client.get("/nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


async def test_native_generate_and_other_v1_paths(gateway: StartGateway) -> None:
    gw = await gateway()
    r = await gw.client.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 3}})
    assert r.status_code == 200 and r.json()["text"] == token_text(0, 3)
    assert r.headers["x-specgate-backend"] == "speculative"
    other = await gw.client.post("/v1/embeddings", json={"input": "x"})
    assert other.status_code == 404  # the server's answer, passed through
    assert other.headers["x-specgate-backend"] == "speculative"
    assert (await gw.metrics())["specgate_output_tokens_total"] == 3


async def test_metrics_after_known_traffic(gateway: StartGateway) -> None:
    gw = await gateway()
    for _ in range(3):
        assert (await gw.client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 5})).is_success
    await gw.client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 5, "stream": True})
    text = await gw.metrics_text()
    assert 'specgate_requests_total{backend="speculative",code="2xx",endpoint="chat"} 4.0' in text
    assert 'specgate_routing_decisions_total{backend="speculative",reason="light_load"} 4.0' in text
    assert 'specgate_output_tokens_total{backend="speculative"} 20.0' in text
    assert 'specgate_request_duration_seconds_count{backend="speculative",endpoint="chat"} 4.0' in text
    assert 'specgate_time_to_first_token_seconds_count{backend="speculative"} 1.0' in text
    assert 'specgate_watermark{level="high"} 16.0' in text
    assert 'specgate_backend_up{backend="baseline"} 1.0' in text
    assert 'specgate_inflight_requests{backend="speculative"} 0.0' in text
    assert "specgate_inter_chunk_latency_seconds_count" in text
    for name in (
        "specgate_load",
        "specgate_routing_mode",
        "specgate_mode_switches_total",
        "specgate_engine_load",
        "specgate_failovers_total",
        "specgate_upstream_errors_total",
        "specgate_client_disconnects_total",
        "specgate_prompt_tokens_total",
    ):
        assert name in text, name


async def test_routing_page_describes_each_server(gateway: StartGateway) -> None:
    gw = await gateway(high_watermark=6, low_watermark=3)
    page = await gw.routing()
    assert (page["mode"], page["load"], page["inflight"]) == ("speculative", 0, 0)
    assert set(page["backends"]) == {"speculative", "baseline"}
    assert all(b["healthy"] is True and b["inflight"] == 0 for b in page["backends"].values())
    assert orjson.dumps(page)  # plain JSON throughout


async def _engine_load_is(gw: Gateway, n: int) -> bool:
    return bool((await gw.routing())["backends"]["speculative"]["engine_load"] == n)


async def test_engine_load_signal_sees_traffic_from_other_replicas(gateway: StartGateway) -> None:
    gw = await gateway(
        sim={"time_scale": 1, "live_gauges": True}, load_signal="engine", high_watermark=3, low_watermark=1
    )

    async def load_at_least_3() -> bool:
        return bool((await gw.routing())["load"] >= 3)

    # Another replica's traffic: straight to the speculative server, unseen by this gateway's counts.
    async with gw.stream(LONG, gw.spec.url), gw.stream(LONG, gw.spec.url), gw.stream(LONG, gw.spec.url):
        await wait_until(load_at_least_3)
        r = await gw.client.post("/v1/completions", json=SHORT)
        assert (r.headers["x-specgate-backend"], r.headers["x-specgate-reason"]) == ("baseline", "heavy_load")
    await wait_until(lambda: _mode_is(gw, "speculative"))


async def test_stale_idle_engine_gauges_do_not_pin_the_load(gateway: StartGateway) -> None:
    # SGLang keeps its gauges when idle; frozen values must read as an idle server.
    gw = await gateway(load_signal="max", engine_stale_s=0.5)
    await gw.client.post("/v1/completions", json={"prompt": "p", "max_tokens": 3})
    assert (await gw.metrics(gw.spec.url))["sglang:num_running_reqs"] == 1  # frozen since the prefill
    await wait_until(lambda: _engine_load_is(gw, 0))


async def test_frozen_gauges_of_a_server_with_none_of_our_requests_read_idle_soon(gateway: StartGateway) -> None:
    # The batch emptied between two refreshes: the gauges say 1 running, for as long as the server
    # stays quiet. With nothing of ours on it that reads idle after ~2 s, long before the stale limit.
    gw = await gateway(load_signal="max", engine_stale_s=60)
    await gw.client.post("/v1/completions", json={"prompt": "p", "max_tokens": 3})
    assert (await gw.metrics(gw.spec.url))["sglang:num_running_reqs"] == 1
    await wait_until(lambda: _engine_load_is(gw, 0), timeout_s=8)
    assert (await gw.metrics(gw.spec.url))["sglang:num_running_reqs"] == 1  # still frozen: read through it
