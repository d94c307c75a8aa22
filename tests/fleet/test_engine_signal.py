"""What specgate reads beside the relayed API, in-process (tests/inprocess.py): the engine load
signal and when it cannot be read, passive health, and fields passed on for the server to judge."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from ..helpers import LONG, wait_until
from ..inprocess import Gateway, StartGateway

pytestmark = pytest.mark.anyio


async def server(gw: Gateway, name: str) -> dict[str, Any]:
    found: dict[str, Any] = (await gw.routing())["backends"][name]
    return found


async def test_unreadable_engine_signal_is_said_not_hidden(gateway: StartGateway) -> None:
    # SGLang without --enable-metrics: no /metrics on the speculative server.
    gw = await gateway(spec={"metrics": False}, load_signal="engine")

    async def baseline_read() -> bool:
        return bool((await server(gw, "baseline"))["engine_signal_up"])

    await wait_until(baseline_read)
    r = await gw.routing()
    assert (r["load_signal"], r["load_signal_in_effect"]) == ("engine", "mixed")
    assert "speculative" in r["load_signal_why"] and "404" in r["load_signal_why"]
    spec, base = r["backends"]["speculative"], r["backends"]["baseline"]
    assert not spec["engine_signal_up"] and "404" in spec["engine_signal_error"] and spec["engine_load"] is None
    assert base["engine"] == "sglang" and base["engine_load"] == 0 and base["engine_signal_error"] is None
    assert (await gw.metrics())["specgate_engine_signal_up"] == 1  # summed: baseline 1, speculative 0
    text = await gw.metrics_text()
    assert 'specgate_engine_signal_up{backend="speculative"} 0.0' in text
    assert 'specgate_accept_length{backend="speculative"} NaN' in text


async def test_no_engine_signal_at_all_routes_on_the_local_count_and_says_once(
    gateway: StartGateway, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="specgate")
    gw = await gateway(sim={"metrics": False}, load_signal="max", health_interval_s=0.05)

    async def local() -> bool:
        return bool((await gw.routing())["load_signal_in_effect"] == "local")

    await wait_until(local)
    assert "no engine load readable" in (await gw.routing())["load_signal_why"]
    # The warning comes once per outage, not once per scrape: let each server fail ~20 of them.
    await wait_until(lambda: min(gw.spec.hits["/metrics"], gw.base.hits["/metrics"]) >= 20)
    warnings = [r for r in caplog.records if "engine load of" in r.getMessage() and "unreadable" in r.getMessage()]
    assert len(warnings) == 2, [r.getMessage() for r in warnings]  # one per server
    assert all("SPECGATE_LOAD_SIGNAL=max" in w.getMessage() and w.levelno == logging.WARNING for w in warnings)


async def test_engine_metrics_name_the_engine_and_its_acceptance(gateway: StartGateway) -> None:
    gw = await gateway(sim={"live_gauges": True}, spec={"accept_length": 2.5})
    await gw.client.post("/v1/completions", json={"prompt": "p", "max_tokens": 40})

    async def accept_read() -> bool:
        return 2 <= ((await server(gw, "speculative"))["spec_accept_length"] or 0) <= 2.5

    # The simulator's gauge: tokens per decode step over its last log interval (SGLang's own rule).
    await wait_until(accept_read)
    r = await gw.routing()
    assert r["backends"]["speculative"]["engine"] == "sglang" and r["engine_setting"] == "auto"
    assert r["backends"]["baseline"]["spec_accept_length"] is None  # no speculation there
    assert r["load_signal_in_effect"] == "local" and r["load_signal_why"] is None
    text = await gw.metrics_text()
    shown = (await server(gw, "speculative"))["spec_accept_length"]
    assert f'specgate_accept_length{{backend="speculative"}} {shown}' in text
    assert 'specgate_accept_length{backend="baseline"} NaN' in text


async def test_a_configured_engine_that_is_not_there_is_reported(gateway: StartGateway) -> None:
    gw = await gateway(engine="vllm", load_signal="engine")

    async def local() -> bool:
        return bool((await gw.routing())["load_signal_in_effect"] == "local")

    await wait_until(local)
    err = (await server(gw, "speculative"))["engine_signal_error"]
    assert isinstance(err, str) and "vllm:num_requests_running" in err


async def test_a_server_answering_proxied_requests_stays_up_while_its_health_is_slow(gateway: StartGateway) -> None:
    # /health takes 3 s while the server has work (as SGLang's and a saturated llama-server's do),
    # against a 0.3 s health timeout: every poll times out while a stream runs.
    gw = await gateway(spec={"busy_health_s": 3}, health_timeout_s=0.3, health_interval_s=0.2)

    async def spec_error() -> str:
        return str((await server(gw, "speculative"))["last_error"])

    async with gw.stream(LONG) as r:  # a long stream through specgate: proxied traffic flows
        assert r.headers["x-specgate-backend"] == "speculative"
        polls = gw.spec.hits["/health"]

        async def six_polls_timed_out_while_up() -> bool:
            # Up throughout six polls, each timing out (three make a server down when nothing answers).
            assert (await server(gw, "speculative"))["healthy"]
            return gw.spec.hits["/health"] >= polls + 6 and "proxied requests got answers" in await spec_error()

        await wait_until(six_polls_timed_out_while_up, timeout_s=10, interval_s=0.05)
    await wait_until(lambda: _last_error_is_none(gw))
    # The same slow /health with the work coming from elsewhere (nothing through specgate): down.
    async with gw.stream(LONG, gw.spec.url):
        await wait_until(lambda: _healthy_is(gw, False), timeout_s=10)
        assert "timed out 3 times" in await spec_error()
    await wait_until(lambda: _healthy_is(gw, True), timeout_s=10)


async def _last_error_is_none(gw: Gateway) -> bool:
    return (await server(gw, "speculative"))["last_error"] is None


async def _healthy_is(gw: Gateway, healthy: bool) -> bool:
    return (await server(gw, "speculative"))["healthy"] is healthy


async def test_fields_specgate_need_not_understand_are_the_servers_to_judge(gateway: StartGateway) -> None:
    gw = await gateway()
    for body in ({"prompt": "p", "stream": "yes"}, {"prompt": "p", "stream": True, "stream_options": 3}):
        r = await gw.client.post("/v1/completions", json=body)
        # The server's own answer (the simulator refuses both), not specgate's.
        assert r.status_code == 400 and r.headers["x-specgate-backend"] == "speculative", r.text
    r = await gw.client.post(
        "/v1/completions",
        json={"prompt": "p", "max_tokens": 2, "stream": True, "stream_options": {"include_usage": "yes"}},
    )
    assert r.headers["x-specgate-backend"] == "speculative"  # passed on as sent
    assert (await gw.routing())["inflight"] == 0
