"""Load in tokens: each request's lease holds its prompt (estimated from the body, the estimate
scaled by what servers reported of earlier prompts) and the tokens generated so far, so a server's
tokens in flight are exact on every path a request can end by; and the engine's own count of its
KV cache, read through the engine adapters."""

from __future__ import annotations

import contextlib
import math
from typing import Any

import pytest

from proxy.fleet.adapter import BadReading
from proxy.fleet.engines import ENGINES
from proxy.fleet.servers import Server
from proxy.policy.base import Role
from proxy.routing.leases import InflightTracker
from proxy.routing.tokens import (
    CHARS_PER_TOKEN,
    MAX_RATIO,
    OWN_AFTER,
    TEMPLATE_TOKENS_PER_MESSAGE,
    TokenRatio,
    prompt_estimate,
)

from ..helpers import wait_until
from ..inprocess import Gateway, StartGateway

LONG = {"prompt": "p" * 400, "max_tokens": 120_000, "stream": True}


# ---------------------------------------------------------------------------------------------
# Units


def test_prompt_estimates_count_the_text_of_each_api() -> None:
    per = TEMPLATE_TOKENS_PER_MESSAGE
    chat = {
        "messages": [
            {"role": "system", "content": "s" * 40},
            {"role": "user", "content": [{"type": "text", "text": "u" * 80}]},
        ]
    }
    assert prompt_estimate(chat, "chat") == 2 * per + 120 / CHARS_PER_TOKEN
    assert prompt_estimate({"prompt": "p" * 41}, "completions") == 11  # rounded up
    assert prompt_estimate({"prompt": [1, 2, 3, 4, 5]}, "completions") == 5  # token ids are tokens
    assert prompt_estimate({"prompt": ["a" * 40, "b" * 40]}, "completions") == 20
    responses = {"instructions": "i" * 40, "input": [{"role": "user", "content": "x" * 40}]}
    assert prompt_estimate(responses, "responses") == per + 20
    assert prompt_estimate({"input": "y" * 80}, "responses") == per + 20
    assert prompt_estimate({"text": "t" * 80}, "generate") == 20
    assert prompt_estimate({"input_ids": [7] * 9}, "generate") == 9
    assert prompt_estimate({"input": "e" * 80}, "other") == 20
    # An agent's tools go into the prompt as JSON: counted as their serialised characters.
    tools = [{"type": "function", "function": {"name": "n" * 60}}]
    serialised = len('[{"type":"function","function":{"name":""}}]') + 60
    assert prompt_estimate({"messages": [], "tools": tools}, "chat") == math.ceil(serialised / CHARS_PER_TOKEN)
    assert prompt_estimate({"input": "", "tools": tools}, "responses") == per + math.ceil(serialised / CHARS_PER_TOKEN)
    # Tools nested past what orjson writes (255 levels) are the server's to refuse, uncounted.
    deep: list[Any] = []
    inner = deep
    for _ in range(300):
        inner.append([])
        inner = inner[0]
    assert prompt_estimate({"messages": [], "tools": deep}, "chat") == 1
    # Nonsense is the server's to refuse; its estimate is a floor, never an error.
    junk: dict[str, Any]
    for junk in ({"messages": "x"}, {"messages": [1, None, {"content": 3}]}, {"prompt": {}}, {}):
        assert prompt_estimate(junk, "chat") >= 1 and prompt_estimate(junk, "completions") >= 1


def test_the_ratio_learns_what_servers_report_within_bounds() -> None:
    ratio = TokenRatio()
    assert ratio.scaled(100) == 100
    for _ in range(400):
        ratio.learn(100, 130)
    assert ratio.scaled(100) == 130
    for _ in range(400):
        ratio.learn(10, 10_000)  # a server whose usage is nonsense moves it only so far
    assert ratio.scaled(100) == round(100 * MAX_RATIO)
    before = ratio.value
    ratio.learn(0, 5)
    ratio.learn(5, 0)
    assert ratio.value == before


def test_only_what_a_chat_template_renders_is_counted() -> None:
    per = TEMPLATE_TOKENS_PER_MESSAGE
    plain = {"messages": [{"role": "user", "content": "u" * 40}]}
    # Fields a template leaves out, however large, and parts that are not text: nothing.
    padded = {"messages": [{"role": "user", "content": "u" * 40, "output": "o" * 9000, "arguments": "a" * 9000,
                            "extra": {"text": "e" * 9000}}]}  # fmt: skip
    assert prompt_estimate(padded, "chat") == prompt_estimate(plain, "chat") == per + 10
    image = {"messages": [{"role": "user", "content": [{"type": "image_url", "text": "i" * 9000}]}]}
    assert prompt_estimate(image, "chat") == per
    # An assistant's tool calls are rendered: their names and arguments count.
    call = {"type": "function", "function": {"name": "n" * 20, "arguments": "a" * 60}}
    assert prompt_estimate({"messages": [{"role": "assistant", "tool_calls": [call]}]}, "chat") == per + 20
    # A Responses input by item type: a call's name and arguments, its output, a message's text.
    items = [
        {"type": "function_call", "name": "n" * 20, "arguments": "a" * 60, "output": "x" * 9000},
        {"type": "function_call_output", "output": "o" * 40, "arguments": "x" * 9000},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "t" * 40}]},
        {"type": "reasoning", "output": "x" * 9000},
    ]
    assert prompt_estimate({"input": items}, "responses") == 4 * per + 40


def test_one_clients_requests_scale_its_own_estimates_and_barely_the_fleets() -> None:
    ratio = TokenRatio()
    for _ in range(20):
        for honest in ("a", "b", "c"):
            ratio.learn(100, 102, honest)
    assert ratio.value == pytest.approx(1.02)
    for _ in range(150):
        ratio.learn(100, 25, "x")  # text made so that its estimate is four times the truth
    assert ratio.of("x") == pytest.approx(0.25)
    assert all(ratio.of(k) == pytest.approx(1.02) for k in ("a", "b", "c"))
    assert ratio.value == pytest.approx(1.02)  # a new client's starting point did not move
    assert ratio.scaled(100, "new") == 102
    # A client's own ratio scales it once it has a few requests of its own.
    ratio.learn(100, 200, "d")
    assert ratio.scaled(100, "d") == 102
    for _ in range(OWN_AFTER):
        ratio.learn(100, 200, "d")
    assert ratio.scaled(100, "d") == 200


def test_the_clients_kept_are_bounded() -> None:
    ratio = TokenRatio(max_clients=64)
    for i in range(5000):
        ratio.learn(100, 100, f"k{i}")
    assert len(ratio) == 64


def test_a_lease_holds_its_tokens_until_released_once() -> None:
    servers = {"s": Server("s", Role.SPECULATIVE, "http://x", "g")}
    tracker = InflightTracker(servers)
    a = tracker.acquire("s", 100)
    b = tracker.acquire("s", 50)
    a.add(7)
    a.add(0)
    a.add(-3)  # nothing is taken back but by release
    assert (tracker.count("s"), tracker.tokens("s")) == (2, 157)
    a.release()
    a.release()
    a.add(5)  # a released lease adds nothing
    assert (tracker.count("s"), tracker.tokens("s")) == (1, 50)
    b.release()
    assert (tracker.count("s"), tracker.tokens("s")) == (0, 0)


def test_the_engine_adapters_read_the_kv_cache_in_use() -> None:
    sglang = ENGINES["sglang"].read(
        {
            "sglang:num_running_reqs": 2,
            "sglang:num_queue_reqs": 0,
            "sglang:num_used_tokens": 5120,
            "sglang:token_usage": 0.25,
        }
    )
    assert (sglang.kv_tokens, sglang.kv_usage, sglang.kv_capacity) == (5120, 0.25, None)
    pool = ENGINES["sglang"].read({"sglang:num_running_reqs": 0, "sglang:num_queue_reqs": 0,
                                   "sglang:max_total_num_tokens": 229_376})  # fmt: skip
    assert pool.kv_capacity == 229_376
    vllm = ENGINES["vllm"].read(
        {"vllm:num_requests_running": 1, "vllm:num_requests_waiting": 0, "vllm:kv_cache_usage_perc": 0.5}
    )
    assert (vllm.kv_tokens, vllm.kv_usage) == (None, 0.5)
    llama = ENGINES["llamacpp"].read({"llamacpp:requests_processing": 1, "llamacpp:requests_deferred": 0})
    assert (llama.kv_tokens, llama.kv_usage) == (None, None)
    for bad in (
        {"sglang:num_used_tokens": -1},
        {"sglang:num_used_tokens": float("inf")},
        {"sglang:token_usage": 1e9},
        {"sglang:max_total_num_tokens": float("nan")},
    ):
        with pytest.raises(BadReading):
            ENGINES["sglang"].read({"sglang:num_running_reqs": 0, "sglang:num_queue_reqs": 0, **bad})


def test_a_servers_kv_pool_is_its_engines_figure_else_read_from_its_use() -> None:
    def server(tokens: int | None, usage: float | None, pool: int | None = None) -> Server:
        s = Server("s", Role.SPECULATIVE, "http://127.0.0.1:1", "group-0")
        s.health.engine_tokens, s.health.engine_kv_usage, s.health.engine_kv_capacity = tokens, usage, pool
        return s

    assert server(None, None).kv_capacity is None
    assert server(5120, 0.25).kv_capacity == 20480
    assert server(5120, 0.01).kv_capacity is None  # too little in use to size the pool by
    assert server(5120, 0.01, 30000).kv_capacity == 30000


# ---------------------------------------------------------------------------------------------
# In-process: the gateway's counts on every path


async def _tokens(gw: Gateway) -> dict[str, Any]:
    servers = (await gw.routing())["servers"]
    return {name: s["tokens"] for name, s in servers.items()}


async def _all_zero(gw: Gateway) -> bool:
    m = await gw.metrics()
    return m["specgate_server_tokens"] == 0 and set((await _tokens(gw)).values()) == {0}


@pytest.mark.anyio
async def test_tokens_in_flight_grow_with_a_stream_and_return_to_zero(gateway: StartGateway) -> None:
    gw = await gateway(sim={"time_scale": 1, "live_gauges": True}, scrape_interval_s=0.1)
    async with gw.client.stream("POST", "/v1/completions", json=LONG) as r:
        assert r.headers["x-specgate-backend"] == "speculative"
        lines = r.aiter_lines()
        await anext(lines)
        held = (await _tokens(gw))["speculative"]
        assert held >= 100  # 400 characters of prompt

        async def grown() -> bool:
            await anext(lines)
            return bool((await _tokens(gw))["speculative"] >= held + 5)

        await wait_until(grown)

        async def engine_read() -> bool:
            s = (await gw.routing())["servers"]["speculative"]
            return bool(s["engine_tokens"] and s["engine_tokens"] > 100 and s["engine_kv_usage"] > 0)

        await wait_until(engine_read)  # the engine's own count, beside ours
        m = await gw.metrics()
        assert m["specgate_server_engine_tokens"] > 100 - 1  # the baseline's -1 is in the sum
    await wait_until(lambda: _all_zero(gw))


@pytest.mark.anyio
async def test_no_token_is_left_behind_on_any_exit_path(gateway: StartGateway) -> None:
    gw = await gateway(sim={"time_scale": 1}, read_timeout_s=1.0, health_interval_s=60)
    body = {"prompt": "q" * 200, "max_tokens": 4}
    # Finished, streamed and not, on every API.
    for path, extra in (
        ("/v1/completions", {}),
        ("/v1/completions", {"stream": True}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "c" * 200}]}),
        ("/v1/responses", {"input": "r" * 200, "stream": True}),
    ):
        assert (await gw.client.post(path, json={**body, **extra})).status_code == 200
        assert await _all_zero(gw)
    # Refused by the server (400 passes through).
    assert (await gw.client.post("/v1/completions", json={"prompt": "p", "max_tokens": 0})).status_code == 400
    assert await _all_zero(gw)
    # A client that leaves mid-stream.
    async with gw.client.stream("POST", "/v1/completions", json=LONG) as r:
        await anext(r.aiter_lines())
        assert (await _tokens(gw))["speculative"] > 0
    await wait_until(lambda: _all_zero(gw))
    # A client that leaves before the first byte.
    with contextlib.suppress(TimeoutError):
        async with gw.client.stream("POST", "/v1/completions", json={**LONG, "prompt": "p"}) as r:
            pass
    await wait_until(lambda: _all_zero(gw))
    # A failover: the speculative server is gone, the request moves with its tokens to the baseline.
    await gw.spec.stop()
    r = await gw.client.post("/v1/completions", json={**body, "stream": True})
    assert (r.status_code, r.headers["x-specgate-reason"]) == (200, "failover")
    assert await _all_zero(gw)
    # Both gone: 503 before or after an attempt.
    await gw.base.stop()
    assert (await gw.client.post("/v1/completions", json=body)).status_code in (502, 503)
    assert await _all_zero(gw)


@pytest.mark.anyio
async def test_a_stream_that_breaks_releases_its_tokens(gateway: StartGateway) -> None:
    gw = await gateway(sim={"stall_rate": 1, "seed": 1}, read_timeout_s=0.5)
    r = await gw.client.post("/v1/completions", json={"prompt": "p" * 100, "max_tokens": 1000, "stream": True})
    assert b"upstream_timeout" in r.content
    assert await _all_zero(gw)


@pytest.mark.anyio
async def test_the_estimate_is_scaled_by_what_the_servers_report(gateway: StartGateway) -> None:
    gw = await gateway(sim={"time_scale": 1})
    assert (await gw.routing())["prompt_token_ratio"] == 1.0
    # Two bytes a character: the simulator counts twice the tokens the characters suggest.
    for _ in range(30):
        await gw.client.post("/v1/completions", json={"prompt": "\u00e9" * 400, "max_tokens": 1})
    ratio = (await gw.routing())["prompt_token_ratio"]
    assert 1.3 < ratio <= 2.0
    async with gw.client.stream("POST", "/v1/completions", json={**LONG, "prompt": "\u00e9" * 400}) as r:
        await anext(r.aiter_lines())
        assert (await _tokens(gw))["speculative"] >= round(100 * ratio)


@pytest.mark.anyio
async def test_one_clients_text_does_not_move_another_clients_estimates(gateway: StartGateway) -> None:
    gw = await gateway(sim={"time_scale": 1}, api_keys=("honest", "other"))
    honest, other = {"authorization": "Bearer honest"}, {"authorization": "Bearer other"}
    for _ in range(5):
        await gw.client.post("/v1/completions", json={"prompt": "p" * 400, "max_tokens": 1}, headers=honest)
    # Two bytes a character: the simulator counts twice the tokens this client's characters suggest.
    for _ in range(40):
        await gw.client.post("/v1/completions", json={"prompt": "\u00e9" * 400, "max_tokens": 1}, headers=other)
    async with gw.client.stream("POST", "/v1/completions", json=LONG, headers=honest) as r:
        await anext(r.aiter_lines())
        assert 100 <= (await _tokens(gw))["speculative"] < 110  # its own ratio: about 1
    assert (await gw.routing())["prompt_token_ratio_clients"] == 2


@pytest.mark.anyio
async def test_keys_nobody_checks_do_not_make_one_client_many(gateway: StartGateway) -> None:
    gw = await gateway(sim={"time_scale": 1})
    for i in range(8):
        headers = {"authorization": f"Bearer made-up-{i}"}
        await gw.client.post("/v1/completions", json={"prompt": "p" * 40, "max_tokens": 1}, headers=headers)
    assert (await gw.routing())["prompt_token_ratio_clients"] == 1  # one address, one vote


@pytest.mark.anyio
async def test_speculation_takes_no_more_streams_than_its_kv_pool_holds(gateway: StartGateway) -> None:
    # A pool of 6,000 tokens and prompts of about 750: some 8 streams fill it, though the
    # watermark would let 16 speculate.
    # adaptive with no calibration: the watermarks as set until both servers were seen; no dwell;
    # the pool's footprint as it is, not forecast (the streams open as fast as the test sends them).
    gw = await gateway(sim={"time_scale": 1}, spec={"max_total_tokens": 6000}, policy="adaptive", high_watermark=16,
                       low_watermark=8, adaptive_min_dwell_s=0, adaptive_probe_s=0, kv_forecast_s=0)  # fmt: skip

    async def pool_read() -> bool:
        return bool((await gw.routing())["servers"]["speculative"]["engine_kv_capacity"] == 6000)

    await wait_until(pool_read)
    body = {"model": "m", "prompt": "lorem ipsum " * 250, "max_tokens": 200, "stream": True}
    sent = 0
    async with contextlib.AsyncExitStack() as held:
        for _ in range(16):
            r = await held.enter_async_context(gw.stream(body))
            if r.headers["x-specgate-backend"] == "baseline":
                break
            sent += 1

            async def capacity_known() -> bool:
                return (await gw.routing())["groups"][0]["kv_capacity_streams"] is not None

            await wait_until(capacity_known)
        group = (await gw.routing())["groups"][0]
        assert 6 <= sent <= 9, sent
        assert group["watermarks"]["high"] == 16
        assert group["watermarks_in_effect"]["high"] == group["kv_capacity_streams"] <= sent
        assert r.headers["x-specgate-reason"] == "heavy_load"

    async def uncapped() -> bool:
        return bool((await gw.routing())["groups"][0]["watermarks_in_effect"]["high"] == 16)

    await wait_until(uncapped)  # nothing in flight: nothing to size a stream by


@pytest.mark.anyio
async def test_a_full_baseline_spills_new_requests_to_the_speculative_pool(gateway: StartGateway) -> None:
    # The baseline's pool of 6,000 tokens and prompts of about 750, none sharing a prefix: some 7
    # streams fill it to 90% as its engine reports it, while the mode (a high watermark of 0, at
    # most 1 learnt) sends everything there.
    gw = await gateway(sim={"time_scale": 0.5}, base={"max_total_tokens": 6000}, policy="adaptive", high_watermark=0,
                       low_watermark=0, adaptive_max_watermark=1, adaptive_min_dwell_s=0, adaptive_probe_s=0,
                       scrape_interval_s=0.1)  # fmt: skip

    async def spill() -> dict[str, Any]:
        found: dict[str, Any] = (await gw.routing())["groups"][0]["kv_spill"]
        return found

    async def pools_read() -> bool:
        s = await spill()
        return s["on"] and s["baseline_least_used"] is not None and s["speculative_most_used"] is not None

    await wait_until(pools_read)
    body = {"model": "m", "prompt": "lorem ipsum " * 250, "max_tokens": 100, "stream": True}
    reasons = []
    async with contextlib.AsyncExitStack() as held:
        for i in range(12):
            r = await held.enter_async_context(gw.stream({**body, "prompt": f"{i} {body['prompt']}"}))
            reasons.append((r.headers["x-specgate-backend"], r.headers["x-specgate-reason"]))
            if r.headers["x-specgate-reason"] == "kv_spill":
                break
            before = (await spill())["baseline_least_used"]

            async def read_again(before: float = before) -> bool:
                used = (await spill())["baseline_least_used"]
                return bool(used > before or used >= 0.9)

            await wait_until(read_again)  # the engine's reading, which alone says the baseline is full
        assert reasons[-1] == ("speculative", "kv_spill"), reasons
        assert set(reasons[:-1]) == {("baseline", "heavy_load")} and 6 <= len(reasons) <= 10, reasons
        assert (await spill())["baseline_least_used"] >= 0.9
        # A batch request never takes speculation's room, full baseline or not.
        r = await held.enter_async_context(
            gw.stream({**body, "max_tokens": 2}, headers={"x-specgate-priority": "batch"})
        )
        assert r.headers["x-specgate-reason"] == "batch"
    assert 'specgate_routing_decisions_total{backend="speculative",reason="kv_spill"} 1.0' in await gw.metrics_text()

    async def room_again() -> bool:
        used = (await spill())["baseline_least_used"]
        return used is not None and used < 0.9

    await wait_until(room_again)
    async with gw.stream(body) as r:
        assert (r.headers["x-specgate-backend"], r.headers["x-specgate-reason"]) == ("baseline", "heavy_load")
