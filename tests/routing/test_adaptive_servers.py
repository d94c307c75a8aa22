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

from ..helpers import wait_until
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


def test_adaptive_servers_alone_need_no_pair_urls_and_take_no_topology() -> None:
    # The pair's URLs have defaults (a server on this host): beside adaptive servers, unset is none.
    assert Settings(_env_file=None, adaptive_url="http://a:1").routing_topology().kind == "adaptive"
    explicit = Settings(_env_file=None, adaptive_url="http://a:1", speculative_url="none", baseline_url="NONE")
    assert explicit.routing_topology().kind == "adaptive"
    with pytest.raises(ValueError, match="needs both roles"):
        Settings(_env_file=None, adaptive_url="http://a:1", speculative_url="http://s:1")
    with pytest.raises(ValueError, match="leave it unset"):
        Settings(_env_file=None, adaptive_url="http://a:1", topology="pooled")


@pytest.mark.anyio
async def test_a_failed_request_moves_to_another_adaptive_server_not_the_same(gateway: StartGateway) -> None:
    alive = Recorder()
    async with serving(alive) as url:
        # `gone` refuses connections; with health polls far apart it still counts as up.
        gw = await gateway(
            speculative_url="none",
            baseline_url="none",
            adaptive_url=f"gone=http://127.0.0.1:9,alive={url}",
            health_interval_s=60,
        )
        results = [await _chat(gw) for _ in range(4)]
        assert set(results) <= {("adaptive", "in_engine"), ("adaptive", "failover")}
        assert len(alive.raw) == 4
        # Alone, a server that fails has nowhere else to go: the error is the client's at once.
    async with serving(Recorder()) as url:
        gw = await gateway(speculative_url="none", baseline_url="none", adaptive_url=f"one={url}")
        page = await gw.routing()
        assert set(page["backends"]) == {"adaptive"}
        m = await gw.metrics_text()
        assert 'specgate_backend_up{backend="speculative"}' not in m and 'backend="baseline"' not in m


@pytest.mark.anyio
async def test_a_switched_turn_held_on_an_adaptive_server_goes_to_the_pool(gateway: StartGateway) -> None:
    a = Recorder()
    async with serving(a) as ua:
        gw = await gateway(topology="pooled", adaptive_url=f"a={ua}")
        await gw.base.stop()
        await gw.spec.stop()

        async def pool_down() -> bool:
            servers = (await gw.routing())["servers"]
            return not servers["speculative"]["healthy"] and not servers["baseline"]["healthy"]

        await wait_until(pool_down)
        # The pool down: a switch has no server to honour it, and the adaptive server serves.
        assert await _chat(gw, {"x-specgate-speculation": "off"}) == ("adaptive", "in_engine")
        await gw.base.restart()
        await gw.spec.restart()

        async def pool_up() -> bool:
            servers = (await gw.routing())["servers"]
            return bool(servers["speculative"]["healthy"] and servers["baseline"]["healthy"])

        await wait_until(pool_up)
        body = {**CHAT, "messages": [{"role": "user", "content": "one conversation"}]}
        session = {"x-session-id": "s1"}
        first = await gw.client.post("/v1/chat/completions", json=body, headers=session)
        for _ in range(20):
            if first.headers["x-specgate-backend"] == "adaptive":
                break
            session = {"x-session-id": f"s{next(_CONVERSATIONS)}"}
            first = await gw.client.post("/v1/chat/completions", json=body, headers=session)
        assert first.headers["x-specgate-backend"] == "adaptive"
        r = await gw.client.post("/v1/chat/completions", json=body, headers={**session, "x-specgate-speculation": "on"})
        assert (r.headers["x-specgate-backend"], r.headers["x-specgate-reason"]) == ("speculative", "client_on")
