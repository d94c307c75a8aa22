"""The adaptive policy end to end: specgate under uvicorn with a calibration file, in front of two
simulator processes, its beliefs read back from /routing and /metrics."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import orjson
from prometheus_client.parser import text_string_to_metric_families

from .conftest import Stack, StartStack
from .helpers import routing, scrape, wait_for

# The shipped `crossover` profile's curves at its acceptance (3): speculation pays below 20 streams.
CALIBRATION = {
    "format": "specgate-calibration/1",
    "levels": [1, 2, 5, 10, 20, 30, 50, 70],
    "speculative": {"output_tok_s": [180, 330, 700, 1100, 1500, 1650, 1750, 1800]},
    "baseline": {"output_tok_s": [100, 195, 470, 880, 1500, 1950, 2500, 2800]},
    "accept_length": 3.0,
    "recommendation": {"high_watermark": 20, "low_watermark": 15, "verdict": "crosses"},
}
FAST = {
    "SPECGATE_POLICY": "adaptive",
    "SPECGATE_ADAPTIVE_MAX_STEP_PER_S": "1000",
    "SPECGATE_ADAPTIVE_MIN_DWELL_S": "0",
    "SPECGATE_ADAPTIVE_PROBE_S": "0",
    "SPECGATE_ADAPTIVE_MARGIN": "0",
}


def calibration_file(tmp_path: Path) -> str:
    path = tmp_path / "calibration.json"
    path.write_bytes(orjson.dumps(CALIBRATION))
    return str(path)


def stream_some(s: Stack, n: int, max_tokens: int = 64) -> None:
    c = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=30)
    for _ in range(n):
        for _chunk in c.completions.create(model="m", prompt="hello", max_tokens=max_tokens, stream=True):
            pass


def test_starts_from_the_calibration_and_learns_from_streams(stack: StartStack, tmp_path: Path) -> None:
    s = stack(("--time-scale", "20", "--profile", "crossover"), SPECGATE_CALIBRATION=calibration_file(tmp_path), **FAST)
    r = routing(s.url)
    assert r["policy"] == "adaptive" and r["watermarks"] == {"high": 20, "low": 15}
    a = r["adaptive"]
    assert a["calibrated"] and a["curves"]["levels"] == CALIBRATION["levels"]
    stream_some(s, 4)
    wait_for(lambda: routing(s.url)["adaptive"]["observations"] >= 4)
    observed = routing(s.url)["adaptive"]["observed"]["speculative"]
    assert observed["1"]["weight"] > 0 and observed["1"]["speed_ratio"] > 0
    m = scrape(s.url)
    assert m["specgate_crossover_estimate"] > 0
    assert m["specgate_routing_decisions_total"] >= 4


def test_a_fall_in_live_acceptance_moves_traffic_to_the_baseline(stack: StartStack, tmp_path: Path) -> None:
    # The speculative server accepts 1.2 tokens a step where the calibration saw 3: its curve is
    # 0.4x, below the baseline's at every load, so the watermark falls to 0.
    s = stack(
        ("--time-scale", "20", "--profile", "crossover"),
        spec_args=("--accept-length", "1.2"),
        SPECGATE_CALIBRATION=calibration_file(tmp_path),
        **FAST,
    )
    first = httpx.post(s.url + "/v1/completions", json={"prompt": "p", "max_tokens": 4}, timeout=30)
    assert first.headers["x-specgate-backend"] == "speculative"
    # Enough decode steps for SGLang's gauge to refresh (every 40), then a health poll to read it.
    stream_some(s, 2, max_tokens=200)
    wait_for(lambda: routing(s.url)["watermarks"]["high"] == 0, timeout_s=10)
    r = routing(s.url)
    assert abs(r["adaptive"]["accept_length_live"] - 1.2) < 0.05
    assert r["adaptive"]["crossover_estimate"] == 0 and "pays at no load" in r["adaptive"]["why"]
    after = httpx.post(s.url + "/v1/completions", json={"prompt": "p", "max_tokens": 4}, timeout=30)
    assert (after.headers["x-specgate-backend"], after.headers["x-specgate-reason"]) == ("baseline", "heavy_load")
    assert scrape(s.url)["specgate_watermark"] == 0 + 0 + 8  # high, low, and the spillover limit


VARIED = " ".join(f"word{i} means thing{i * 7 % 13}" for i in range(60))
REPEATED = "copy this line exactly as it is. " * 40


def complete(s: Stack, prompt: str, max_tokens: int = 64) -> httpx.Response:
    body = {"model": "m", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens}
    r = httpx.post(s.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200
    return r


def test_shadow_probes_see_acceptance_rise_and_bring_speculation_back(stack: StartStack, tmp_path: Path) -> None:
    s = stack(
        ("--time-scale", "20", "--profile", "crossover"),
        spec_args=("--accept-from-prompt",),
        SPECGATE_CALIBRATION=calibration_file(tmp_path),
        SPECGATE_HEALTH_INTERVAL_S="0.2",
        **{**FAST, "SPECGATE_ADAPTIVE_PROBE_S": "0.3", "SPECGATE_ADAPTIVE_PROBE_MAX_S": "0.3"},
    )
    # Varied prompts accept about 1 token a step where the calibration saw 3: once the engine's
    # gauge says so, everything goes to the baseline.
    assert complete(s, VARIED, 200).headers["x-specgate-backend"] == "speculative"
    wait_for(lambda: routing(s.url)["watermarks"]["high"] == 0, timeout_s=10)
    # Shadows of varied prompts measure ~1 and change nothing; the client is served by the baseline.

    def shadowed() -> bool:
        assert complete(s, VARIED).headers["x-specgate-backend"] == "baseline"
        return scrape(s.url)["specgate_shadow_probes_total"] >= 1

    wait_for(shadowed, timeout_s=10, interval_s=0.1)  # a probe is due every 0.3 s
    assert routing(s.url)["watermarks"]["high"] == 0
    # The traffic turns repetitive: a shadow of such a request measures ~4 tokens a step from its
    # own stream (the gauge, refreshed every 40 steps, has not moved), and speculation pays again.
    seen: list[str] = []

    def back_to_speculation() -> bool:
        seen.append(complete(s, REPEATED).headers["x-specgate-backend"])
        return seen[-1] == "speculative"

    wait_for(back_to_speculation, timeout_s=15)
    assert seen[0] == "baseline"
    a = routing(s.url)["adaptive"]
    assert a["accept_length_live"] > 3.0 and "from probe streams" in a["why"], a["why"]
    assert a["accept_length_source"] == "from probe streams"
    # Every shadow measured: none failed or came back without usage.
    text = httpx.get(s.url + "/metrics").text
    shadows = {
        sample.labels["outcome"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "specgate_shadow_probes_total"
    }
    assert shadows["ok"] >= 2 and shadows["error"] == shadows["no_usage"] == 0
