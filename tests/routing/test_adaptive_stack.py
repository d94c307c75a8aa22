"""The adaptive policy end to end, in-process: the app with a calibration file in front of two
simulators in the test's loop (tests/inprocess.py), its beliefs read back from /routing and /metrics."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ..helpers import wait_until
from ..inprocess import Gateway, StartGateway

pytestmark = pytest.mark.anyio

# The shipped `crossover` profile's curves at its acceptance (3): speculation pays below 20 streams.
CALIBRATION = {
    "format": "specgate-calibration/1",
    "levels": [1, 2, 5, 10, 20, 30, 50, 70],
    "speculative": {"output_tok_s": [180, 330, 700, 1100, 1500, 1650, 1750, 1800]},
    "baseline": {"output_tok_s": [100, 195, 470, 880, 1500, 1950, 2500, 2800]},
    "accept_length": 3.0,
    "recommendation": {"high_watermark": 20, "low_watermark": 15, "verdict": "crosses"},
}
# The rule acts at once (no dwell, no probes, no band from a margin, no price on a switch).
FAST = {
    "policy": "adaptive",
    "adaptive_max_step_per_s": 1000,
    "adaptive_min_dwell_s": 0,
    "adaptive_probe_s": 0,
    "adaptive_margin": 0,
    "prefill_tok_s": 0,
}
SIM = {"profile": "crossover"}


def calibration_file(tmp_path: Path) -> str:
    path = tmp_path / "calibration.json"
    path.write_bytes(orjson.dumps(CALIBRATION))
    return str(path)


async def stream_some(gw: Gateway, n: int, max_tokens: int = 64) -> None:
    for _ in range(n):
        body = {"model": "m", "prompt": "hello", "max_tokens": max_tokens, "stream": True}
        r = await gw.client.post("/v1/completions", json=body)
        assert r.status_code == 200 and r.content.endswith(b"data: [DONE]\n\n")


async def routing(gw: Gateway) -> dict[str, Any]:
    return await gw.routing()


async def test_starts_from_the_calibration_and_learns_from_streams(gateway: StartGateway, tmp_path: Path) -> None:
    gw = await gateway(sim=SIM, calibration=calibration_file(tmp_path), **FAST)
    r = await routing(gw)
    assert r["policy"] == "adaptive" and r["watermarks"] == {"high": 20, "low": 15}
    a = r["adaptive"]
    assert a["calibrated"] and a["curves"]["levels"] == CALIBRATION["levels"]
    await stream_some(gw, 4)

    async def observed_4() -> bool:
        return bool((await routing(gw))["adaptive"]["observations"] >= 4)

    await wait_until(observed_4)
    observed = (await routing(gw))["adaptive"]["observed"]["speculative"]
    assert observed["1"]["weight"] > 0 and observed["1"]["speed_ratio"] > 0
    m = await gw.metrics()
    assert m["specgate_crossover_estimate"] > 0
    assert m["specgate_routing_decisions_total"] >= 4


async def test_a_fall_in_live_acceptance_moves_traffic_to_the_baseline(gateway: StartGateway, tmp_path: Path) -> None:
    # The speculative server accepts 1.2 tokens a step where the calibration saw 3: its curve is
    # 0.4x, below the baseline's at every load, so the watermark falls to 0.
    gw = await gateway(sim=SIM, spec={"accept_length": 1.2}, calibration=calibration_file(tmp_path), **FAST)
    first = await gw.client.post("/v1/completions", json={"prompt": "p", "max_tokens": 4})
    assert first.headers["x-specgate-backend"] == "speculative"
    # Enough decode steps for SGLang's gauge to refresh (every 40), then a health poll to read it.
    await stream_some(gw, 2, max_tokens=200)
    await wait_until(lambda: _high_is_0(gw), timeout_s=10)
    r = await routing(gw)
    assert abs(r["adaptive"]["accept_length_live"] - 1.2) < 0.05
    assert r["adaptive"]["crossover_estimate"] == 0 and "pays at no load" in r["adaptive"]["why"]
    after = await gw.client.post("/v1/completions", json={"prompt": "p", "max_tokens": 4})
    assert (after.headers["x-specgate-backend"], after.headers["x-specgate-reason"]) == ("baseline", "heavy_load")
    assert (await gw.metrics())["specgate_watermark"] == 0 + 0 + 8  # high, low, and the spillover limit


async def _high_is_0(gw: Gateway) -> bool:
    return bool((await routing(gw))["watermarks"]["high"] == 0)


VARIED = " ".join(f"word{i} means thing{i * 7 % 13}" for i in range(60))
REPEATED = "copy this line exactly as it is. " * 40


async def complete(gw: Gateway, prompt: str, max_tokens: int = 64, api: str = "chat") -> httpx.Response:
    if api == "responses":
        r = await gw.client.post("/v1/responses", json={"model": "m", "input": prompt, "max_output_tokens": max_tokens})
    else:
        body = {"model": "m", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens}
        r = await gw.client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200
    return r


# The Responses API's probes are counted by their delta events (its `done` events repeat the text).
@pytest.mark.parametrize("api", ["chat", "responses"])
async def test_shadow_probes_see_acceptance_rise_and_bring_speculation_back(
    gateway: StartGateway, tmp_path: Path, api: str
) -> None:
    gw = await gateway(
        sim=SIM,
        spec={"accept_from_prompt": True},
        calibration=calibration_file(tmp_path),
        health_interval_s=0.2,
        **{**FAST, "adaptive_probe_s": 0.3, "adaptive_probe_max_s": 0.3},
    )
    # Varied prompts accept about 1 token a step where the calibration saw 3: once the engine's
    # gauge says so, everything goes to the baseline.
    assert (await complete(gw, VARIED, 200, api)).headers["x-specgate-backend"] == "speculative"
    await wait_until(lambda: _high_is_0(gw), timeout_s=10)
    # Shadows of varied prompts measure ~1 and change nothing; the client is served by the baseline.

    async def shadowed() -> bool:
        assert (await complete(gw, VARIED, api=api)).headers["x-specgate-backend"] == "baseline"
        return (await gw.metrics())["specgate_shadow_probes_total"] >= 1

    await wait_until(shadowed, timeout_s=10, interval_s=0.1)  # a probe is due every 0.3 s
    assert await _high_is_0(gw)
    # The traffic turns repetitive: a shadow of such a request measures ~4 tokens a step from its
    # own stream (the gauge, refreshed every 40 steps, has not moved), and speculation pays again.
    seen: list[str] = []

    async def back_to_speculation() -> bool:
        seen.append((await complete(gw, REPEATED, api=api)).headers["x-specgate-backend"])
        return seen[-1] == "speculative"

    await wait_until(back_to_speculation, timeout_s=15)
    assert seen[0] == "baseline"
    a = (await routing(gw))["adaptive"]
    assert a["accept_length_live"] > 3.0 and "from probe streams" in a["why"], a["why"]
    assert a["accept_length_source"] == "from probe streams"
    # Every shadow measured: none failed or came back without usage.
    text = await gw.metrics_text()
    shadows = {
        sample.labels["outcome"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "specgate_shadow_probes_total"
    }
    assert shadows["ok"] >= 2 and shadows["error"] == shadows["no_usage"] == 0
