"""Servers that draft adaptively in the engine (SPECGATE_ADAPTIVE_URL): a group of their own, alone
or beside a pool, each request to one of them by SPECGATE_ADAPTIVE_PLACEMENT, a client's switch
sent to the pool beside them, and failover among them."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from proxy.config import Settings
from proxy.fleet.topology import build
from proxy.policy.base import Role
from proxy.routing.homogeneous import SLACK_REQUESTS, half_of, homogeneous_choice

from ..inprocess import StartGateway
from ..recorder import Recorder, serving

pytestmark = pytest.mark.inprocess

_CONVERSATIONS = itertools.count()
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}


def test_adaptive_servers_are_a_group_alone_or_beside_a_pool() -> None:
    alone = build("", "", None, "a=http://a:1,http://b:2")
    assert alone.kind == "adaptive"
    assert [(g.name, g.adaptive, g.of(Role.ADAPTIVE)) for g in alone.groups] == [
        ("adaptive", True, ("a", "adaptive-1"))
    ]
    assert alone.groups[0].of(Role.SPECULATIVE) == ()
    mixed = build("http://s:1", "http://b:1", "pooled", "http://a:1,http://a:2")
    assert mixed.kind == "pooled"
    assert [g.name for g in mixed.groups] == ["pool", "adaptive"]
    with pytest.raises(ValueError, match="no server given"):
        build("", "", None, "")
    with pytest.raises(ValueError, match="needs both roles"):
        build("http://s:1", "", None, "http://a:1")


def test_the_settings_take_empty_pair_urls_only_beside_adaptive_servers() -> None:
    s = Settings(_env_file=None, speculative_url="", baseline_url="", adaptive_url="http://a:1")
    assert s.routing_topology().kind == "adaptive"
    with pytest.raises(ValueError, match="no server given"):
        Settings(_env_file=None, speculative_url="", baseline_url="")
    with pytest.raises(ValueError):
        Settings(_env_file=None, adaptive_placement="random")


def test_homogeneous_placement_keeps_each_kind_on_its_half_while_load_allows() -> None:
    servers = ("a", "b", "c", "d")
    assert half_of(True, servers) == ("a", "b") and half_of(False, servers) == ("c", "d")
    assert half_of(True, ("a", "b", "c")) == ("a", "b")
    even = [(s, 3.0) for s in servers]
    assert homogeneous_choice(servers, even, True, 0.0) in ("a", "b")
    assert homogeneous_choice(servers, even, False, 0.99) in ("c", "d")
    # Its half holds more than the slack beyond the least loaded: the least loaded takes it.
    skewed = [("a", 10.0), ("b", 10.0), ("c", 2.0), ("d", 2.0)]
    assert homogeneous_choice(servers, skewed, True, 0.0) in ("c", "d")
    within = [("a", SLACK_REQUESTS), ("b", 9.0), ("c", 0.0), ("d", 0.0)]
    assert homogeneous_choice(servers, within, True, 0.0) == "a"
    # No rank, or its half all down: the least loaded.
    assert homogeneous_choice(servers, skewed, None, 0.0) in ("c", "d")
    assert homogeneous_choice(servers, [("c", 5.0), ("d", 1.0)], True, 0.0) == "d"
    assert homogeneous_choice(servers, [], True, 0.0) is None


async def _chat(gw: Any, headers: dict[str, str] | None = None) -> tuple[str, str]:
    # A new conversation each time: one's next turn would stay where its cache is.
    body = {**CHAT, "messages": [{"role": "user", "content": f"hi {next(_CONVERSATIONS)}"}]}
    r = await gw.client.post("/v1/chat/completions", json=body, headers=headers)
    assert r.status_code == 200, r.text
    return r.headers["x-specgate-backend"], r.headers["x-specgate-reason"]


@pytest.mark.anyio
async def test_a_fleet_of_adaptive_servers_alone(gateway: StartGateway) -> None:
    a, b = Recorder(), Recorder()
    async with serving(a) as ua, serving(b) as ub:
        gw = await gateway(speculative_url="", baseline_url="", adaptive_url=f"a={ua},b={ub}")
        for _ in range(4):
            assert await _chat(gw) == ("adaptive", "in_engine")
        # No server here takes a switch: the request goes on, and its reason says where.
        assert await _chat(gw, {"x-specgate-speculation": "off"}) == ("adaptive", "in_engine")
        assert await _chat(gw, {"x-specgate-priority": "batch"}) == ("adaptive", "in_engine")
        page = await gw.routing()
        assert page["topology"] == "adaptive"
        assert [s["step"] for s in page["pipeline"]] == ["stored_response", "in_engine"]
        assert page["groups"][0]["servers"] == {"adaptive": ["a", "b"]}
        assert page["speculation"]["asked"]["off"] == {"honoured": 0, "not_honoured": 1}
        assert len(a.raw) + len(b.raw) == 6 and a.raw and b.raw
        m = await gw.metrics_text()
        assert 'specgate_routing_decisions_total{backend="adaptive",reason="in_engine"} 6.0' in m
        # One of them down: the other takes every request, a refused connection retried there.
        await gw.client.post("/v1/chat/completions", json=CHAT)
    async with serving(Recorder()) as uc:
        gw = await gateway(
            speculative_url="", baseline_url="", adaptive_url=f"a=http://127.0.0.1:9,c={uc}", health_interval_s=60
        )
        for _ in range(3):
            r = await gw.client.post("/v1/chat/completions", json=CHAT)
            assert r.status_code == 200 and r.headers["x-specgate-backend"] == "adaptive"


@pytest.mark.anyio
async def test_a_switch_beside_adaptive_servers_goes_to_the_pool(gateway: StartGateway) -> None:
    a = Recorder()
    async with serving(a) as ua:
        gw = await gateway(topology="pooled", adaptive_url=f"a={ua}")
        seen = {await _chat(gw, {"x-specgate-speculation": "off"}) for _ in range(6)}
        assert seen == {("baseline", "client_off")}
        seen = {await _chat(gw, {"x-specgate-speculation": "on"}) for _ in range(6)}
        assert seen == {("speculative", "client_on")}
        assert not a.raw
        # Without a switch the groups share the load, per server.
        backends = {(await _chat(gw))[0] for _ in range(12)}
        assert "adaptive" in backends
