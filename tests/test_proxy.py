"""The gateway end to end: the proxy under uvicorn in front of two simulator processes, driven by
the real openai SDK and raw HTTP."""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Callable, Iterator

import httpx
import openai
import orjson
import pytest
from openai.types.chat import ChatCompletionMessageParam

from loadtest.simulator.wire import token_text

from .conftest import Stack, StartSim, StartStack
from .helpers import scrape, sse_events, sse_json

CHAT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "What is speculative decoding?"}]
# A generation that outlasts any test, within the simulator's context (131072 tokens: SGLang, and so
# the simulator, refuses prompt + max_tokens past it with 400).
LONG = {"prompt": "p", "max_tokens": 120_000, "stream": True}


def client(url: str, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=30)


def routing(stack: Stack) -> dict:  # type: ignore[type-arg]
    return httpx.get(stack.url + "/routing").json()  # type: ignore[no-any-return]


def wait_for(check: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


@contextlib.contextmanager
def open_stream(url: str, body: dict | None = None, **kw: object) -> Iterator[httpx.Response]:  # type: ignore[type-arg]
    """A streaming request held open (first event read) until the block ends."""
    with httpx.Client(timeout=30) as http, http.stream("POST", url + "/v1/completions", json=body or LONG, **kw) as r:  # type: ignore[arg-type]
        lines = r.iter_lines()
        next(lines)
        r.extensions["lines"] = lines  # keep the generator referenced: dropping it closes the stream
        yield r


def test_openai_sdk_chat_and_completions_streaming_and_not(stack: StartStack) -> None:
    s = stack()
    c = client(s.url)
    chat = c.chat.completions.create(model="m", messages=CHAT, max_tokens=8)
    assert chat.choices[0].message.content == token_text(0, 8)
    assert chat.usage is not None and chat.usage.completion_tokens == 8
    chunks = list(c.chat.completions.create(model="m", messages=CHAT, max_tokens=8, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == token_text(0, 8)
    assert all(ch.usage is None for ch in chunks)  # the usage chunk specgate asked for is dropped
    comp = c.completions.create(model="m", prompt="hello", max_tokens=5)
    assert comp.choices[0].text == token_text(0, 5)
    texts = [ch.choices[0].text for ch in c.completions.create(model="m", prompt="hello", max_tokens=5, stream=True)]
    assert "".join(texts) == token_text(0, 5)


def test_routing_headers_and_request_id(stack: StartStack) -> None:
    s = stack()
    r = httpx.post(s.url + "/v1/completions", json={"prompt": "p", "max_tokens": 2}, headers={"x-request-id": "abc-1"})
    assert r.status_code == 200
    assert r.headers["x-specgate-backend"] == "speculative"
    assert r.headers["x-specgate-reason"] == "light_load"
    assert r.headers["x-request-id"] == "abc-1"
    generated = httpx.post(s.url + "/v1/completions", json={"prompt": "p", "max_tokens": 2}).headers["x-request-id"]
    assert len(generated) == 32


@pytest.mark.parametrize("include_usage", [True, False])
def test_streams_are_byte_identical_through_the_proxy(stack: StartStack, include_usage: bool) -> None:
    s = stack(sim_args=("--time-scale", "20", "--created", "1700000000"))
    body = {"messages": CHAT, "max_tokens": 40, "stream": True, "rid": "fixed-rid"}
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    direct = httpx.post(s.spec.url + "/v1/chat/completions", json=body).content
    proxied = httpx.post(s.url + "/v1/chat/completions", json=body)
    assert proxied.headers["x-specgate-backend"] == "speculative"
    assert proxied.content == direct
    has_usage = any("usage" in e for e in sse_json(proxied.content))
    assert has_usage == include_usage


def test_usage_counted_whether_or_not_the_client_asked(stack: StartStack) -> None:
    s = stack()
    c = client(s.url)
    list(c.chat.completions.create(model="m", messages=CHAT, max_tokens=6, stream=True))
    asked = list(
        c.chat.completions.create(
            model="m", messages=CHAT, max_tokens=4, stream=True, stream_options={"include_usage": True}
        )
    )
    assert asked[-1].usage is not None and asked[-1].usage.completion_tokens == 4
    c.completions.create(model="m", prompt="x" * 40, max_tokens=3)
    m = scrape(s.url)
    assert m["specgate_output_tokens_total"] == 6 + 4 + 3
    assert m["specgate_prompt_tokens_total"] > 0


def test_switches_to_baseline_under_load_and_back_with_hysteresis(stack: StartStack) -> None:
    s = stack(SPECGATE_HIGH_WATERMARK="4", SPECGATE_LOW_WATERMARK="2")
    with contextlib.ExitStack() as held:
        streams = [held.enter_context(contextlib.ExitStack()) for _ in range(4)]
        backends = [st.enter_context(open_stream(s.url)).headers["x-specgate-backend"] for st in streams]
        assert backends == ["speculative"] * 4
        assert routing(s)["mode"] == "baseline"  # the load reached the high watermark
        with open_stream(s.url) as fifth:
            assert (fifth.headers["x-specgate-backend"], fifth.headers["x-specgate-reason"]) == (
                "baseline",
                "heavy_load",
            )
        # Load 4 -> 3: inside the band, the mode holds.
        streams[0].close()
        wait_for(lambda: routing(s)["load"] == 3)
        with open_stream(s.url) as held_back:
            assert held_back.headers["x-specgate-reason"] == "hysteresis_hold"
            assert held_back.headers["x-specgate-backend"] == "baseline"
        assert routing(s)["mode"] == "baseline"
        # Load falls to the low watermark: back to speculative.
        streams[1].close()
        wait_for(lambda: routing(s)["mode"] == "speculative")
        with open_stream(s.url) as after:
            assert after.headers["x-specgate-backend"] == "speculative"
    wait_for(lambda: routing(s)["inflight"] == 0)
    m = scrape(s.url)
    assert m["specgate_mode_switches_total"] == 2
    assert m["specgate_routing_mode"] == 1


def test_spillover(stack: StartStack) -> None:
    s = stack(SPECGATE_POLICY="spillover", SPECGATE_SPILLOVER_LIMIT="2")
    with open_stream(s.url) as a, open_stream(s.url) as b, open_stream(s.url) as c:
        assert [r.headers["x-specgate-backend"] for r in (a, b, c)] == ["speculative", "speculative", "baseline"]
        assert c.headers["x-specgate-reason"] == "spillover"
        assert routing(s)["backends"]["baseline"]["inflight"] == 1


def test_retry_on_refused_connection_and_immediate_mark_down(stack: StartStack) -> None:
    s = stack(SPECGATE_HEALTH_INTERVAL_S="60")  # no poll will notice the kill: the request must
    s.spec.proc.stop()
    r = httpx.post(s.url + "/v1/completions", json={"prompt": "p", "max_tokens": 3})
    assert r.status_code == 200
    assert (r.headers["x-specgate-backend"], r.headers["x-specgate-reason"]) == ("baseline", "failover")
    m = scrape(s.url)
    assert m["specgate_failovers_total"] == 1
    assert m["specgate_upstream_errors_total"] == 1
    assert routing(s)["backends"]["speculative"]["healthy"] is False
    nxt = httpx.post(s.url + "/v1/completions", json={"prompt": "p", "max_tokens": 3})
    assert nxt.headers["x-specgate-reason"] == "only_healthy"


def test_failover_when_killed_and_recovery_when_back(stack: StartStack) -> None:
    s = stack()
    s.spec.proc.stop()
    wait_for(lambda: not routing(s)["backends"]["speculative"]["healthy"])
    r = client(s.url).completions.with_raw_response.create(model="m", prompt="p", max_tokens=3)
    assert r.headers["x-specgate-backend"] == "baseline" and r.headers["x-specgate-reason"] == "only_healthy"
    assert scrape(s.url)["specgate_backend_up"] == 1
    s.restart_sim("speculative")
    wait_for(lambda: routing(s)["backends"]["speculative"]["healthy"])
    r = client(s.url).completions.with_raw_response.create(model="m", prompt="p", max_tokens=3)
    assert r.headers["x-specgate-backend"] == "speculative"


def test_both_down_gives_503_at_once(stack: StartStack) -> None:
    s = stack()
    s.spec.proc.stop()
    s.base.proc.stop()
    wait_for(lambda: httpx.get(s.url + "/ready").status_code == 503)
    t0 = time.monotonic()
    r = httpx.post(s.url + "/v1/chat/completions", json={"messages": CHAT, "stream": True})
    assert time.monotonic() - t0 < 1.0
    assert r.status_code == 503
    assert r.json()["error"]["code"] == "no_healthy_backend"
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    with pytest.raises(openai.InternalServerError):
        client(s.url).models.list()


def test_both_down_before_the_poll_notices_is_503_too(stack: StartStack) -> None:
    s = stack(SPECGATE_HEALTH_INTERVAL_S="60")
    s.spec.proc.stop()
    s.base.proc.stop()
    r = httpx.post(s.url + "/v1/completions", json={"prompt": "p"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_healthy_backend"
    assert routing(s)["inflight"] == 0


def test_client_disconnect_aborts_upstream_and_releases(stack: StartStack) -> None:
    s = stack(sim_args=("--time-scale", "1"))
    with open_stream(s.url) as r:
        assert r.headers["x-specgate-backend"] == "speculative"
        assert routing(s)["inflight"] == 1
    wait_for(lambda: scrape(s.spec.url)["sglang:num_aborted_requests_total"] == 1)
    wait_for(lambda: routing(s)["inflight"] == 0)
    m = scrape(s.url)
    assert m["specgate_client_disconnects_total"] == 1
    assert m["specgate_inflight_requests"] == 0
    assert httpx.get(s.spec.url + "/get_load").json()[0]["num_reqs"] == 0


def test_disconnect_while_waiting_for_first_byte(stack: StartStack) -> None:
    s = stack(sim_args=("--time-scale", "1", "--ttft-base-ms", "5000"))
    with (
        pytest.raises(httpx.ReadTimeout),
        httpx.stream("POST", s.url + "/v1/completions", json=LONG, timeout=httpx.Timeout(10, read=0.5)),
    ):
        pass
    wait_for(lambda: routing(s)["inflight"] == 0)
    wait_for(lambda: scrape(s.spec.url)["sglang:num_aborted_requests_total"] == 1)


def test_read_timeout_before_first_byte_is_504(stack: StartStack) -> None:
    s = stack(sim_args=("--time-scale", "20", "--stall-rate", "1"), SPECGATE_READ_TIMEOUT_S="0.5")
    r = httpx.post(s.url + "/v1/completions", json={"prompt": "p", "max_tokens": 1})
    assert r.status_code == 504
    assert r.json()["error"]["code"] == "upstream_timeout"
    assert routing(s)["inflight"] == 0


def test_stall_mid_stream_ends_with_error_event_and_done(stack: StartStack) -> None:
    s = stack(sim_args=("--time-scale", "20", "--stall-rate", "1", "--seed", "1"), SPECGATE_READ_TIMEOUT_S="0.5")
    r = httpx.post(s.url + "/v1/completions", json={"prompt": "p", "max_tokens": 1000, "stream": True})
    assert r.status_code == 200
    events = sse_events(r.content)
    assert events[-1] == b"[DONE]"
    assert b'"error"' in events[-2] and b"upstream_timeout" in events[-2]
    assert len(events) > 3  # some content came first
    m = scrape(s.url)
    assert m["specgate_inflight_requests"] == 0
    assert m["specgate_upstream_errors_total"] == 1
    wait_for(lambda: scrape(s.spec.url)["sglang:num_aborted_requests_total"] == 1)


def test_server_errors_pass_through(stack: StartStack) -> None:
    s = stack(spec_args=("--fail-rate", "1"))
    r = httpx.post(s.url + "/v1/completions", json={"prompt": "p", "max_tokens": 2})
    assert r.status_code == 500
    assert r.json()["object"] == "error" and r.json()["code"] == 500  # SGLang's own body, as sent
    again = httpx.post(s.url + "/v1/completions", json={"prompt": "p", "max_tokens": 2, "stream": True})
    assert again.status_code == 500  # an answer from the server is not retried elsewhere
    assert again.headers["x-specgate-backend"] == "speculative"
    m = scrape(s.url)
    assert m["specgate_failovers_total"] == 0
    assert m["specgate_inflight_requests"] == 0


def test_sglang_validation_error_passes_through(stack: StartStack) -> None:
    s = stack()
    with pytest.raises(openai.BadRequestError):
        client(s.url).completions.create(model="m", prompt="p", max_tokens=0)


def test_api_keys_and_upstream_key(stack: StartStack) -> None:
    s = stack(
        sim_args=("--time-scale", "20", "--api-key", "upstream-secret"),
        SPECGATE_API_KEYS="k1,k2",
        SPECGATE_UPSTREAM_API_KEY="upstream-secret",
    )
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "k1"}, {"Authorization": "Basic k1"}):
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "p", "max_tokens": 2}, headers=headers)
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        client(s.url, "wrong").models.list()
    # The client's key never travels upstream (the servers want another one), the upstream key does.
    assert client(s.url, "k2").completions.create(model="m", prompt="p", max_tokens=2).choices
    assert [m.id for m in client(s.url, "k1").models.list()] == ["default"]
    assert httpx.get(s.url + "/health").status_code == 200
    assert scrape(s.url)["specgate_requests_total"] >= 5
    # Only the requests with a valid key reached a server.
    assert scrape(s.spec.url)["sglang:num_requests_total"] + scrape(s.base.url)["sglang:num_requests_total"] == 1
    assert routing(s)["backends"]["speculative"]["engine_load"] is not None  # scraped with the upstream key


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
def test_bad_input_gets_openai_errors(
    stack: StartStack, body: bytes, headers: dict[str, str], status: int, code: str
) -> None:
    s = stack(SPECGATE_MAX_BODY_BYTES="4096")
    r = httpx.post(s.url + "/v1/completions", content=body, headers=headers)
    assert r.status_code == status
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == code
    assert routing(s)["inflight"] == 0
    assert scrape(s.spec.url)["sglang:num_requests_total"] == 0  # nothing reached a server


def test_unknown_route_is_openai_shaped_404(stack: StartStack) -> None:
    s = stack()
    r = httpx.get(s.url + "/nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


def test_native_generate_and_other_v1_paths(stack: StartStack) -> None:
    s = stack()
    r = httpx.post(s.url + "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 3}})
    assert r.status_code == 200 and r.json()["text"] == token_text(0, 3)
    assert r.headers["x-specgate-backend"] == "speculative"
    other = httpx.post(s.url + "/v1/embeddings", json={"input": "x"})
    assert other.status_code == 404  # the server's answer, passed through
    assert other.headers["x-specgate-backend"] == "speculative"
    assert scrape(s.url)["specgate_output_tokens_total"] == 3


def test_metrics_after_known_traffic(stack: StartStack) -> None:
    s = stack()
    c = client(s.url)
    for _ in range(3):
        c.chat.completions.create(model="m", messages=CHAT, max_tokens=5)
    list(c.chat.completions.create(model="m", messages=CHAT, max_tokens=5, stream=True))
    text = httpx.get(s.url + "/metrics").text
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
    assert "_created" not in text


def test_engine_load_signal_sees_traffic_from_other_replicas(stack: StartStack, simulator: StartSim) -> None:
    s = stack(
        sim_args=("--time-scale", "1", "--live-gauges"),
        SPECGATE_LOAD_SIGNAL="engine",
        SPECGATE_HIGH_WATERMARK="3",
        SPECGATE_LOW_WATERMARK="1",
    )
    # Another replica's traffic: straight to the speculative server, unseen by this proxy's counts.
    with open_stream(s.spec.url), open_stream(s.spec.url), open_stream(s.spec.url):
        wait_for(lambda: routing(s)["load"] >= 3)
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "p", "max_tokens": 2})
        assert (r.headers["x-specgate-backend"], r.headers["x-specgate-reason"]) == ("baseline", "heavy_load")
    wait_for(lambda: routing(s)["mode"] == "speculative")


def test_stale_idle_engine_gauges_do_not_pin_the_load(stack: StartStack) -> None:
    # SGLang keeps its gauges when idle; frozen values must read as an idle server.
    s = stack(SPECGATE_LOAD_SIGNAL="max", SPECGATE_ENGINE_STALE_S="0.5")
    c = client(s.url)
    c.completions.create(model="m", prompt="p", max_tokens=3)
    assert scrape(s.spec.url)["sglang:num_running_reqs"] == 1  # frozen since the prefill
    wait_for(lambda: routing(s)["backends"]["speculative"]["engine_load"] == 0)


def test_frozen_gauges_of_a_server_with_none_of_our_requests_read_idle_soon(stack: StartStack) -> None:
    # The batch emptied between two refreshes: the gauges say 1 running, for as long as the server
    # stays quiet. With nothing of ours on it that reads idle after ~2 s, long before the stale limit.
    s = stack(SPECGATE_LOAD_SIGNAL="max", SPECGATE_ENGINE_STALE_S="60")
    client(s.url).completions.create(model="m", prompt="p", max_tokens=3)
    assert scrape(s.spec.url)["sglang:num_running_reqs"] == 1
    wait_for(lambda: routing(s)["backends"]["speculative"]["engine_load"] == 0, timeout_s=8)
    assert scrape(s.spec.url)["sglang:num_running_reqs"] == 1  # still frozen: specgate read through it


def test_sigterm_lets_running_streams_finish(stack: StartStack) -> None:
    s = stack(sim_args=("--time-scale", "1"))
    body = {"prompt": "p", "max_tokens": 40, "stream": True}  # ~0.5 s at the seed profile's speed
    with httpx.Client(timeout=30) as http, http.stream("POST", s.url + "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        next(lines)
        s.proxy.popen.send_signal(signal.SIGTERM)
        rest = list(lines)
    events = [line for line in rest if line]
    assert events[-1] == "data: [DONE]"
    texts = [orjson.loads(e[len("data: ") :])["choices"][0]["text"] for e in events[:-1]]
    assert "".join(texts) == token_text(1, 39)  # nothing cut: every token after the first arrived
    assert s.proxy.popen.wait(10) == 0
    with pytest.raises(httpx.ConnectError):
        httpx.get(s.url + "/health")
