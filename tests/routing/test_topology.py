"""Several servers: the topology settings, group and server choice (least load, random among
near-ties), the sent-since-scrape correction, and the per-server and per-group view."""

from __future__ import annotations

import dataclasses
import math
import random
from collections import Counter

import pytest
from pydantic import ValidationError

from proxy.config import Settings
from proxy.fleet.servers import Health
from proxy.fleet.topology import build
from proxy.policy.base import ROLES, Role, least_loaded, near_ties
from proxy.routing.fleet import Fleet

from ..helpers import Clock, policy_cfg, rig

S0, S1, B0, B1 = (f"http://127.0.0.1:{p}" for p in (30001, 30011, 30002, 30012))


def test_lists_of_servers_name_and_group_them() -> None:
    t = build(f"{S0},{S1}", f"{B0},{B1}", None)
    assert t.kind == "paired"
    assert t.names() == ("speculative-0", "speculative-1", "baseline-0", "baseline-1")
    assert [(g.name, g.of(Role.SPECULATIVE), g.of(Role.BASELINE)) for g in t.groups] == [
        ("group-0", ("speculative-0",), ("baseline-0",)),
        ("group-1", ("speculative-1",), ("baseline-1",)),
    ]
    # One server a role keeps its role's name: the simple case, as before.
    solo = build(S0, B0, None)
    assert solo.names() == ("speculative", "baseline") and [g.name for g in solo.groups] == ["group-0"]
    # Names given; unequal lists are pools unless paired is asked for.
    pooled = build(f"eagle-a={S0}, eagle-b={S1}", B0, None)
    assert pooled.kind == "pooled" and pooled.names() == ("eagle-a", "eagle-b", "baseline")
    assert pooled.groups[0].name == "pool" and pooled.groups[0].of(Role.SPECULATIVE) == ("eagle-a", "eagle-b")
    assert build(f"{S0},{S1}", f"{B0},{B1}", "pooled").groups[0].of(Role.BASELINE) == ("baseline-0", "baseline-1")
    with pytest.raises(ValueError, match="as many speculative as baseline"):
        build(f"{S0},{S1}", B0, "paired")
    with pytest.raises(ValueError, match="unique: x"):
        build(f"x={S0}", f"x={B0}", None)
    with pytest.raises(ValueError, match="server name"):
        build(f"a b={S0}", B0, None)


def test_bad_lists_are_refused_at_start_naming_the_setting() -> None:
    with pytest.raises(ValidationError, match="SPECGATE_SPECULATIVE_URL / SPECGATE_BASELINE_URL"):
        Settings(_env_file=None, speculative_url=f"{S0},{S1}", baseline_url=B0, topology="paired")
    with pytest.raises(ValidationError, match="not-a-url"):
        Settings(_env_file=None, speculative_url=f"{S0},not-a-url")
    with pytest.raises(ValidationError, match="scrape_interval_s"):
        Settings(_env_file=None, scrape_interval_s=0.05)
    ok = Settings(_env_file=None, speculative_url=f" a={S0}/ , {S1} ", baseline_url=f"{B0},{B1}")
    assert ok.speculative_url == f"a={S0},{S1}"
    assert ok.routing_topology().names() == ("a", "speculative-1", "baseline-0", "baseline-1")


def test_near_ties_are_within_half_a_request_of_the_least() -> None:
    assert near_ties([("a", 0), ("b", 0.5), ("c", 1)]) == ["a", "b"]
    assert near_ties([("a", 40), ("b", 40.4), ("c", 44)]) == ["a", "b"]
    assert near_ties([]) == [] and least_loaded([], 0.5) is None
    # The draw picks among them; a clear winner is always chosen.
    assert [least_loaded([("a", 3), ("b", 3), ("c", 9)], p) for p in (0.0, 0.49, 0.5, 0.99)] == ["a", "a", "b", "b"]
    assert {least_loaded([("a", 3), ("b", 4)], p) for p in (0.0, 0.99)} == {"a"}


def fleet(
    spec: str, base: str, topology: str | None = None, signal: str = "local", high: int = 16, clock: Clock | None = None
) -> tuple[Fleet, dict[str, Health]]:
    r = rig(speculative_url=spec, baseline_url=base, topology=topology, load_signal=signal)
    health = r.health
    cfg = policy_cfg("threshold", high, high // 2, load_signal=signal)
    return Fleet(r.topology, r.servers, cfg, r.metrics, clock=clock or Clock(), rng=random.Random(7)), health


def test_a_request_goes_to_the_least_loaded_group_then_to_its_server_for_the_mode() -> None:
    f, health = fleet(f"{S0},{S1}", f"{B0},{B1}", high=4)
    g0, g1 = f.routers
    held = [g0.admit(Role.SPECULATIVE) for _ in range(3)]
    for _ in range(2):  # 3 against 0, then 1: group-1 is clearly the least loaded
        p = f.decide()
        assert p.router is g1 and p.decision.backend == "speculative"
        held.append(p.router.admit(p.decision.backend))
    assert g1.loads.role_count(Role.SPECULATIVE) == 2
    # Each group has its own mode: group-1 reaches its high watermark and turns to its baseline.
    held += [g1.admit(Role.SPECULATIVE) for _ in range(3)]
    assert g1.state.mode == "baseline" and g0.state.mode == "speculative"
    p = f.decide()  # 3 against 5
    assert p.router is g0 and p.decision.backend == "speculative"
    assert g1.decide().backend == "baseline"
    # A group whose servers are both down gets nothing.
    for name in ("speculative-0", "baseline-0"):
        health[name].healthy = False
    assert all(f.decide().router is g1 for _ in range(10))
    for lease in held:
        lease.release()
    assert f.tracker.total == 0


def test_equal_groups_share_the_load_at_random_not_in_a_herd() -> None:
    f, health = fleet(f"{S0},{S1}", f"{B0},{B1}", signal="engine", high=1000)
    # Engine readings of 10 each and nothing sent since: a tie, every time.
    for r in f.routers:
        for s in ROLES:
            health[r.group.of(s)[0]].engine_load = 10 if s == Role.SPECULATIVE else 0
    chosen = Counter(f.decide().router.group.name for _ in range(400))
    assert set(chosen) == {"group-0", "group-1"} and min(chosen.values()) > 150


def test_a_servers_engine_load_is_the_others_as_last_read_plus_ours_now() -> None:
    f, health = fleet(f"{S0},{S1}", B0, signal="engine", high=1000)
    r = f.routers[0]
    t = f.tracker
    for name in ("speculative-0", "speculative-1", "baseline"):
        health[name].engine_load = 5
        t.scraping(name)
        t.scraped(name, 5)
    assert r.loads.server_load("speculative-0") == 5 and t.others("speculative-0") == 5
    # Three of ours go to speculative-0: they count at once, before any scrape sees them.
    held = [t.acquire("speculative-0") for _ in range(3)]
    assert r.loads.server_load("speculative-0") == 8
    # The scrape sees them (5 others + 3 ours): nothing counts twice.
    t.scraping("speculative-0")
    t.scraped("speculative-0", 8)
    assert t.others("speculative-0") == 5 and r.loads.server_load("speculative-0") == 8
    # One of ours ends: gone at once, though the engine reading still holds it.
    held[0].release()
    assert r.loads.server_load("speculative-0") == 7
    # Under `local` only ours count; `max` is the engine's figure, which includes ours.
    assert r.loads.engine_loads() == {"speculative": 7 + 5, "baseline": 5}
    # A server whose engine load turns unreadable keeps the others as they last stood (ours alone
    # would be a fraction of the load with several replicas); one never read is counted by ours.
    health["speculative-1"].engine_load = None
    assert r.loads.server_load("speculative-1") == 5 and r.loads.engine_loads()[Role.SPECULATIVE] == 7 + 5
    f2, _ = fleet(S0, B0, signal="engine")
    assert f2.routers[0].loads.engine_loads() == {"speculative": None, "baseline": None}


def test_the_others_are_smoothed_slowly_for_placement_and_over_a_second_for_the_mode() -> None:
    clock = Clock()
    f, health = fleet(f"{S0},{S1}", B0, signal="engine", high=1000, clock=clock)
    r, t = f.routers[0], f.tracker
    for name in ("speculative-0", "speculative-1"):
        health[name].engine_load = 0
        t.scraping(name)
        t.scraped(name, 0)
    # 0.2 s later a scrape says another replica put 10 on speculative-0: every replica reads it at
    # once, so each moves its placement a small share of the way (1 - e^(-0.2/5)), not all of it.
    clock.t += 0.2
    t.scraping("speculative-0")
    t.scraped("speculative-0", 10)
    assert t.others("speculative-0") == 10
    assert r.loads.placement_load("speculative-0") == pytest.approx(10 * (1 - math.exp(-0.2 / 5)))
    # The mode counts a rise at once (the larger of the reading and its one-second average).
    assert r.loads.server_load("speculative-0") == 10
    # As it stands over several seconds of scrapes, placement follows it too.
    for _ in range(150):
        clock.t += 0.2
        t.scraping("speculative-0")
        t.scraped("speculative-0", 10)
    assert r.loads.placement_load("speculative-0") == pytest.approx(10, abs=0.5)
    assert {r.admit(Role.SPECULATIVE).server for _ in range(5)} == {"speculative-1"}
    # A fall counts for the mode only as it lasts: one reading of 0 leaves most of the 10.
    clock.t += 0.2
    t.scraping("speculative-0")
    t.scraped("speculative-0", 0)
    assert r.loads.server_load("speculative-0") == 8
    # At the 2 s default interval one gateway's mode hardly smooths: 86% of the way in one scrape.
    mode_before, place_before = t.others_smooth("speculative-0"), t.others_balance("speculative-0")
    clock.t += 2.0
    t.scraping("speculative-0")
    t.scraped("speculative-0", 0)
    assert t.others_smooth("speculative-0") == pytest.approx(mode_before * math.exp(-2.0))
    assert t.others_balance("speculative-0") == pytest.approx(place_before * math.exp(-2.0 / 5))


def test_a_second_of_one_stale_reading_does_not_move_a_replicas_requests_away_together() -> None:
    """The replicas' sloshing: every replica reads the same figure, up to a second old, for a
    second, and each placing by it in full moved them all to the other group at once."""
    clock = Clock()
    f, health = fleet(f"{S0},{S1}", f"{B0},{B1}", signal="engine", high=1000, clock=clock)
    t = f.tracker
    for name in health:
        health[name].engine_load = 0
        t.scraping(name)
        t.scraped(name, 0)
    for _ in range(5):  # 1 s of readings: group-0's speculative server shows 10 of the others'
        clock.t += 0.2
        for name in health:
            t.scraping(name)
            t.scraped(name, 10 if name == "speculative-0" else 0)
    placed: Counter[str] = Counter()
    held = []
    for _ in range(10):
        p = f.decide()
        assert p.decision.backend is not None
        held.append(p.router.admit(p.decision.backend))
        placed[p.router.group.name] += 1
    # It leans a little, by about the two requests the slow average has moved, not all ten.
    assert 3 <= placed["group-0"] <= 5, placed


def test_a_pooled_role_spreads_over_its_servers() -> None:
    f, health = fleet(f"{S0},{S1}", f"{B0},{B1}", topology="pooled", high=1000)
    (pool,) = f.routers
    leases = [pool.admit(Role.SPECULATIVE) for _ in range(20)]
    counts = Counter(lease.server for lease in leases)
    assert counts == {"speculative-0": 10, "speculative-1": 10}
    for lease in leases[::2]:
        lease.release()
    more = [pool.admit(Role.SPECULATIVE) for _ in range(10)]
    assert Counter(lease.server for lease in more + leases[1::2]) == {"speculative-0": 10, "speculative-1": 10}
    # A server that is down gets nothing while its peer is up.
    health["speculative-0"].healthy = False
    assert {pool.admit(Role.SPECULATIVE).server for _ in range(5)} == {"speculative-1"}


def test_metrics_and_gauges_per_group_and_server() -> None:
    f, _ = fleet(f"{S0},{S1}", f"{B0},{B1}", high=2)
    g0, _ = f.routers
    held = [g0.admit(Role.SPECULATIVE), g0.admit(Role.SPECULATIVE)]
    m = g0._metrics

    def value(name: str, **labels: str) -> float:
        v = m.registry.get_sample_value(name, labels)
        assert v is not None, (name, labels)
        return v

    assert value("specgate_group_mode", group="group-0") == 0 and value("specgate_group_mode", group="group-1") == 1
    assert value("specgate_group_mode_switches_total", group="group-0", to="baseline") == 1
    assert value("specgate_server_inflight", server="speculative-0") == 2
    assert value("specgate_inflight_requests", backend="speculative") == 2
    assert value("specgate_routing_mode") == 0.5  # half the groups speculate
    assert value("specgate_load") == 2 and value("specgate_group_load", group="group-0") == 2
    for lease in held:
        lease.release()
    assert value("specgate_group_mode", group="group-0") == 1 and value("specgate_routing_mode") == 1


def test_a_group_returns_to_speculation_once_its_load_stayed_low_for_the_hold() -> None:
    clock = Clock()
    f, _ = fleet(S0, B0, high=4, clock=clock)
    (r,) = f.routers
    r.cfg = dataclasses.replace(r.cfg, low_hold_s=2.0)
    modes = []
    held = [r.admit(Role.SPECULATIVE) for _ in range(4)]
    modes.append(r.state.mode)
    for lease in held[1:]:
        lease.release()  # down to 1, under the low watermark of 2: the hold starts
    clock.t += 1.9
    f.refresh()
    modes.append(r.state.mode)
    assert r.decide().reason == "return_hold"
    # The periodic refresh switches once the hold has run out, with no request needed.
    clock.t += 0.2
    f.refresh()
    modes.append(r.state.mode)
    assert modes == ["baseline", "baseline", "speculative"]
    held[0].release()
