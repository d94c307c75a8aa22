"""Several servers end to end: specgate under uvicorn in front of four simulator processes, as
two paired groups and as two pools, with the real `openai` client."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from loadtest.procs import Proc

from ..conftest import Sim, StartSim
from ..helpers import start_proxy, wait_for


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    started: list[Proc] = []
    yield started
    for p in started:
        p.stop()


def gateway(procs: list[Proc], spec: list[Sim], base: list[Sim], **env: str) -> str:
    proxy = start_proxy(",".join(s.url for s in spec), ",".join(s.url for s in base), **env)
    procs.append(proxy.proc)
    return proxy.url


def by_label(url: str, name: str, label: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics").text
    return {
        s.labels[label]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    }


def load(url: str, streams: int, each: int, max_tokens: int = 48) -> list[str]:
    """`streams` concurrent clients, `each` streamed completions apiece; the servers that answered."""
    seen: list[str] = []
    errors: list[BaseException] = []

    def client() -> None:
        c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=30)
        try:
            for _ in range(each):
                raw = c.chat.completions.with_raw_response.create(
                    model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=max_tokens, stream=True
                )
                seen.append(raw.headers["x-specgate-backend"])
                for _chunk in raw.parse():
                    pass
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=client) for _ in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return seen


def test_two_paired_groups_share_the_load_each_with_its_own_mode(simulator: StartSim, procs: list[Proc]) -> None:
    sims = [simulator(role, "--time-scale", "20") for role in ("speculative", "baseline") * 2]
    spec, base = sims[0::2], sims[1::2]
    url = gateway(procs, spec, base, SPECGATE_HIGH_WATERMARK="3", SPECGATE_LOW_WATERMARK="1")
    r = httpx.get(url + "/routing").json()
    assert r["topology"] == "paired" and [g["name"] for g in r["groups"]] == ["group-0", "group-1"]
    assert {n: s["group"] for n, s in r["servers"].items()} == {
        "speculative-0": "group-0",
        "baseline-0": "group-0",
        "speculative-1": "group-1",
        "baseline-1": "group-1",
    }
    # What each replica adds to its own requests: the others' as last read, and both averages.
    assert {"inflight", "others", "others_smoothed", "others_balance"} <= set(r["servers"]["speculative-0"])
    # Eight streams over two groups: about four each, past each group's high watermark of 3.
    seen = load(url, 8, 4)
    assert set(seen) == {"speculative", "baseline"}
    sent = by_label(url, "specgate_server_requests_total", "server")
    per_group = [sent["speculative-0"] + sent["baseline-0"], sent["speculative-1"] + sent["baseline-1"]]
    assert sum(per_group) == 32 and min(per_group) >= 10, sent
    switches = by_label(url, "specgate_group_mode_switches_total", "group")
    assert switches["group-0"] >= 1 and switches["group-1"] >= 1
    # Idle again: every group back to speculation.
    wait_for(lambda: all(g["mode"] == "speculative" for g in httpx.get(url + "/routing").json()["groups"]))
    assert by_label(url, "specgate_group_mode", "group") == {"group-0": 1.0, "group-1": 1.0}


def test_a_group_that_is_down_gets_nothing(simulator: StartSim, procs: list[Proc]) -> None:
    sims = [simulator(role, "--time-scale", "20") for role in ("speculative", "baseline") * 2]
    url = gateway(procs, sims[0::2], sims[1::2])
    sims[0].proc.stop()
    sims[1].proc.stop()
    wait_for(lambda: httpx.get(url + "/ready").json()["healthy_servers"] == ["speculative-1", "baseline-1"])
    load(url, 2, 3)
    sent = by_label(url, "specgate_server_requests_total", "server")
    assert sent["speculative-1"] == 6 and sent["speculative-0"] == sent["baseline-0"] == 0


def test_pooled_roles_spread_over_their_servers(simulator: StartSim, procs: list[Proc]) -> None:
    spec = [simulator("speculative", "--time-scale", "20") for _ in range(2)]
    base = [simulator("baseline", "--time-scale", "20") for _ in range(2)]
    url = gateway(
        procs, spec, base, SPECGATE_TOPOLOGY="pooled", SPECGATE_HIGH_WATERMARK="6", SPECGATE_LOW_WATERMARK="2"
    )
    r = httpx.get(url + "/routing").json()
    assert r["topology"] == "pooled" and [g["name"] for g in r["groups"]] == ["pool"]
    seen = load(url, 10, 3)
    assert set(seen) == {"speculative", "baseline"}  # the pool's mode followed the total load
    sent = by_label(url, "specgate_server_requests_total", "server")
    for a, b in (("speculative-0", "speculative-1"), ("baseline-0", "baseline-1")):
        # Least load, ties drawn at random: both used, neither far ahead (few requests: loose).
        assert sent[a] > 0 and sent[b] > 0 and abs(sent[a] - sent[b]) <= max(3, 0.4 * (sent[a] + sent[b])), sent
    assert sum(sent.values()) == 30
    assert by_label(url, "specgate_inflight_requests", "backend") == {"speculative": 0.0, "baseline": 0.0}


def test_speculation_returns_only_after_the_low_watermark_hold(simulator: StartSim, procs: list[Proc]) -> None:
    spec, base = simulator("speculative", "--time-scale", "20"), simulator("baseline", "--time-scale", "20")
    url = gateway(
        procs,
        [spec],
        [base],
        SPECGATE_HIGH_WATERMARK="3",
        SPECGATE_LOW_WATERMARK="1",
        SPECGATE_LOW_WATERMARK_HOLD_S="60",
    )
    assert "baseline" in load(url, 6, 2)
    # The load is gone, but not for a minute: the next request still goes to the baseline, held.
    assert load(url, 1, 1) == ["baseline"]
    assert httpx.get(url + "/routing").json()["mode"] == "baseline"
    text = httpx.get(url + "/metrics").text
    held = [
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "specgate_routing_decisions_total" and s.labels["reason"] == "return_hold"
    ]
    assert sum(held) >= 1
