"""Cache affinity: a conversation's next turn goes where its prefix is cached, unless that server's
predicted cost exceeds the alternative's by more than the re-prefill saved (proxy/routing/affinity.py), and
the engines' prefix cache hit rate per server."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import random
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from proxy.fleet.engines import ENGINES
from proxy.fleet.readings import read
from proxy.fleet.servers import Health
from proxy.policy.base import Decision, PolicyName, PolicyState, Role
from proxy.policy.calibration import ModelFit, StepFit
from proxy.routing.affinity import (
    MAX_ID_BYTES,
    AffinityTable,
    Held,
    conversation_key,
    keep,
    moved_cost,
    stays,
    turn_cost,
)
from proxy.routing.fleet import Fleet
from proxy.routing.steps.affinity import affinity_choice

from ..helpers import Clock, adaptive_cfg, policy_cfg, rig, wait_until
from ..inprocess import Gateway, StartGateway, start_sim
from .test_adaptive import calibration
from .test_model_stack import calibration_file
from .test_speedmodel import MODEL

SYSTEM = {"role": "system", "content": "You are a careful assistant. " * 20}


def _chat(*users: str) -> dict[str, Any]:
    messages: list[dict[str, str]] = [SYSTEM]
    for i, text in enumerate(users):
        if i:
            messages.append({"role": "assistant", "content": f"answer {i}"})
        messages.append({"role": "user", "content": text})
    return {"messages": messages}


# ---------------------------------------------------------------------------------------------
# Units


def test_a_conversation_keeps_its_key_from_turn_to_turn() -> None:
    first = conversation_key(None, _chat("plan a trip to Lisbon"), "chat")
    later = conversation_key(None, _chat("plan a trip to Lisbon", "and the hotels?", "and food?"), "chat")
    other = conversation_key(None, _chat("write a sonnet"), "chat")
    assert first is not None and first == later and first != other
    # A session id or the body's `user` names the conversation outright.
    assert conversation_key(b"abc", _chat("x"), "chat") == conversation_key(b"abc", _chat("y"), "chat") == b"s:abc"
    assert conversation_key(None, {**_chat("x"), "user": "u1"}, "chat") == b"u:u1"
    long = conversation_key(b"z" * (MAX_ID_BYTES + 1), {}, "chat")
    assert long is not None and len(long) < 40  # hashed: the table never holds a client's megabytes
    # The other APIs: a completion's leading characters, a Responses request's instructions and input.
    assert conversation_key(None, {"prompt": "p" * 5000}, "completions") == conversation_key(
        None, {"prompt": "p" * 4096 + "q"}, "completions"
    )
    responses = conversation_key(None, {"instructions": "be brief", "input": "hi"}, "responses")
    assert responses is not None and responses != conversation_key(None, {"input": "hi"}, "responses")
    for nothing in ({}, {"messages": "x"}, {"prompt": [1, 2, 3]}):
        assert conversation_key(None, nothing, "chat") is None
        assert conversation_key(None, nothing, "completions") is None


def test_the_priced_rule() -> None:
    # 100 decode steps on a server of 4 streams whose step goes from 10 to 11 ms with the turn: its
    # own 1.1 s, and 0.1 s of delay to each of the 4; its 1,000 new tokens at 20k/s hold up 5.
    assert turn_cost(100, 4, 0.010, 0.011, 1000, 20_000) == pytest.approx(1.1 + 0.4 + 0.25)
    assert turn_cost(100, 0, 0.010, 0.010, 0, 20_000) == pytest.approx(1.0)  # an idle server: its own
    # A server costing 1 s for the turn, whose 3 streams and the turn would wait 10,000 / 20,000 s
    # each for the re-prefill: 3 s in all at slack 1, the line a held server's cost stays under.
    assert moved_cost(1.0, 3, 10_000, 20_000, 1.0) == pytest.approx(3.0)
    assert moved_cost(1.0, 3, 10_000, 20_000, 0.5) == pytest.approx(2.0)
    assert moved_cost(1.0, 3, 10**9, 20_000, 0.0) == 1.0  # slack 0: the cheapest, always
    # A turn leaves only for a saving beyond the fit's error, a share of its cost where it is.
    assert stays(1.0, 0.9, 0.1) and not stays(1.0, 0.89, 0.1)
    assert not stays(1.0, 0.99, 0.0) and not stays(1.0, 0.99, math.nan)
    assert stays(1.0, 0.5, 5.0) and not stays(1.0, 0.49, 5.0)  # at most MAX_FIT_ERROR = 0.5


def _priced_pool(
    slack: float,
    policy: PolicyName = "model",
    high: int = 16,
    baselines: int = 2,
    load_signal: str = "local",
    fit_error: float = 0.0,
    rule: str = "priced",
    affinity_balance: float = 1.0,
) -> Fleet:
    """A pool of one speculative server and `baselines` baseline ones, b0, b1..., whose mode is the
    baseline at every load (speculation never pays on this fit, whose baseline step times are off
    by `fit_error`), priced at 20,000 prefill tokens/s."""
    r = rig(
        topology="pooled",
        speculative_url="s0=http://127.0.0.1:9",
        baseline_url=",".join(f"b{i}=http://127.0.0.1:{10 + i}" for i in range(baselines)),
    )
    base = StepFit(0.006, 1e-4, 1e-7, rms_rel=fit_error)
    fit = ModelFit(StepFit(0.05, 1e-4, 1e-7), base, (1000, 4000), 128, 1.0)
    cal = dataclasses.replace(calibration(), model=fit)
    cfg = policy_cfg(
        policy,
        high,
        min(high, 8),
        probe_s=0.0,
        affinity_slack=slack,
        load_signal=load_signal,
        affinity_rule=rule,
        affinity_balance=affinity_balance,
    )
    adaptive = adaptive_cfg(min_watermark=0, max_watermark=0, prefill_tok_s=20_000.0)
    return Fleet(r.topology, r.servers, cfg, r.metrics, adaptive, cal, clock=Clock())


def test_a_turn_leaves_a_server_whose_tokens_cost_more_than_its_cache_saves() -> None:
    # b0 and b1 hold 4 streams each, b0's of 8,000 tokens, b1's of 500: requests in flight tie.
    slack_line = 0.384  # where the decode b0 would cost more equals slack * the re-prefill saved
    for slack, cached, where, outcome in (
        (slack_line + 0.001, 8000, "b0", "hit"),
        (slack_line - 0.001, 8000, "b1", "break_load"),
        (1.0, 1000, "b1", "break_load"),  # little cached: little to lose
    ):
        fleet = _priced_pool(slack)
        (router,) = fleet.routers
        assert router.turns.priced()
        leases = [router.admit(Role.BASELINE, "b0", 8000) for _ in range(4)]
        leases += [router.admit(Role.BASELINE, "b1", 500) for _ in range(4)]
        placed = fleet.decide(held=Held("b0", cached), prompt_tokens=8500)
        assert placed.decision.backend == Role.BASELINE
        assert (placed.server, placed.affinity) == (where, outcome), (slack, cached)
        # The figures: 256 output tokens a turn until responses say. On b0 a step goes from
        # 6 + 0.4 + 3.2 = 9.6 ms to 6 + 0.5 + 4.05 = 10.55 ms with the turn; on b1 from 6.6 to
        # 7.55 ms. Both prefill the turn's new tokens; b1 would also prefill the 8,000 cached ones,
        # holding up its 4 streams and the turn 0.4 s each: 2 s to weigh against 256 * 3 ms.
        new = 8500 - cached
        b0 = turn_cost(256, 4, 0.0096, 0.01055, new, 20_000)
        b1 = turn_cost(256, 4, 0.0066, 0.00755, new, 20_000)
        assert router.turns.turn_cost("b0", 8500, new) == pytest.approx((b0, 4.0))
        assert router.turns.turn_cost("b1", 8500, new) == pytest.approx((b1, 4.0))
        assert (b0 - b1) / (5 * 8000 / 20_000) == pytest.approx(slack_line, abs=5e-4)
        # A turn held on the server with no more streams or tokens than any other stays, even with
        # nothing cached.
        assert fleet.decide(held=Held("b1", 0), prompt_tokens=8500)[2:] == ("b1", "hit")
        for lease in leases:
            lease.release()
    # Without a fitted step model, requests in flight stand for the cost: 4 and 4, the turn stays.
    # Not the adaptive policy's curves, whose slope carries each stream's later prefills too.
    (curves,) = _priced_pool(1.0, "adaptive").routers
    assert curves.adaptive is not None and curves.adaptive.model.prior is not None and not curves.turns.priced()
    fleet = _priced_pool(0.0, "threshold", high=0)
    (router,) = fleet.routers
    assert not router.turns.priced()
    leases = [router.admit(Role.BASELINE, "b0", 8000) for _ in range(4)]
    leases += [router.admit(Role.BASELINE, "b1", 500) for _ in range(4)]
    placed = fleet.decide(held=Held("b0", 1000), prompt_tokens=8500)
    assert (placed.server, placed.affinity) == ("b0", "hit")
    leases.append(router.admit(Role.BASELINE, "b0"))
    placed = fleet.decide(held=Held("b0", 999), prompt_tokens=8500)
    assert (placed.server, placed.affinity) == ("b1", "break_load")  # 5 against 4, slack 0
    for lease in leases:
        lease.release()


def test_under_both_rules_a_turn_moves_only_where_each_would_move_it() -> None:
    # As above: b0's 4 long conversations cost a turn more than b1's 4 short chats, beyond the 1,000
    # tokens it has cached; the priced rule moves it, the rule by requests in flight (4 and 4) not.
    for rule, where in (("priced", "b1"), ("both", "b0"), ("in_flight", "b0")):
        fleet = _priced_pool(1.0, rule=rule)
        (router,) = fleet.routers
        assert router.turns.rule() == rule and router.turns.priced() == (rule != "in_flight")
        leases = [router.admit(Role.BASELINE, "b0", 8000) for _ in range(4)]
        leases += [router.admit(Role.BASELINE, "b1", 500) for _ in range(4)]
        assert fleet.decide(held=Held("b0", 1000), prompt_tokens=8500).server == where, rule
        # Two requests more on b0: a thousand cached tokens are worth one, so each rule moves it.
        leases += [router.admit(Role.BASELINE, "b0", 100) for _ in range(2)]
        placed = fleet.decide(held=Held("b0", 1000), prompt_tokens=8500)
        assert (placed.server, placed.affinity) == ("b1", "break_load"), rule
        for lease in leases:
            lease.release()
    # The priced rule's pick must be one the rule by requests in flight would leave for: not b2,
    # cheapest for its short chats but holding more requests than the held server. b1, which that
    # rule picks, costs more than staying for its long conversations: the turn stays.
    for rule, where in (("priced", "b2"), ("both", "b0"), ("in_flight", "b1")):
        fleet = _priced_pool(1.0, rule=rule, baselines=3)
        (router,) = fleet.routers
        leases = [router.admit(Role.BASELINE, "b0", 40_000) for _ in range(3)]
        leases += [router.admit(Role.BASELINE, "b1", 200_000) for _ in range(2)]
        leases += [router.admit(Role.BASELINE, "b2", 100) for _ in range(4)]
        placed = fleet.decide(held=Held("b0", 100), prompt_tokens=8500)
        assert placed.server == where, rule
        for lease in leases:
            lease.release()
    # Without a fit there is nothing to price: by requests in flight, whatever the setting.
    (plain,) = _priced_pool(1.0, "threshold", high=0, rule="both").routers
    assert (plain.turns.priced(), plain.turns.rule()) == (False, "in_flight")


def test_a_turn_moves_where_it_costs_least_with_its_re_prefill() -> None:
    # b1's 4 short chats cost the turn least, b2's 2 long ones more; but re-prefilling the 8,000
    # cached tokens would hold up b1's 4 streams and b2's 2: in all b2 costs least, and only it
    # less than staying on b0.
    for slack, fit_error in ((0.45, 0.0), (0.1, 0.0), (0.45, 0.05)):
        fleet = _priced_pool(slack, baselines=3, fit_error=fit_error)
        (router,) = fleet.routers
        leases = [router.admit(Role.BASELINE, "b0", 8000) for _ in range(4)]
        leases += [router.admit(Role.BASELINE, "b1", 200) for _ in range(4)]
        leases += [router.admit(Role.BASELINE, "b2", 16000) for _ in range(2)]
        if fit_error:
            # b2 would save the turn 1.3% of its cost on b0: within the fit's 5% error, it stays.
            costs = {s: router.turns.turn_cost(s, 8500, 500) for s in ("b0", "b2")}
            gain = costs["b0"][0] - moved_cost(*costs["b2"], 8000, 20_000, slack)
            assert 0 < gain < 0.05 * costs["b0"][0]
            placed = fleet.decide(held=Held("b0", 8000), prompt_tokens=8500)
            assert (placed.server, placed.affinity) == ("b0", "hit")
        elif slack == 0.45:
            costs = {s: router.turns.turn_cost(s, 8500, 500) for s in ("b0", "b1", "b2")}
            assert costs["b1"][0] < costs["b2"][0] < costs["b0"][0]
            moved = {s: moved_cost(cost, batch, 8000, 20_000, slack) for s, (cost, batch) in costs.items()}
            assert moved["b2"] < costs["b0"][0] < moved["b1"]
            placed = fleet.decide(held=Held("b0", 8000), prompt_tokens=8500)
            assert (placed.server, placed.affinity) == ("b2", "break_load")
        else:
            # A conversation cut short: its server has more cached than the prompt, which is all
            # staying can save. Counted whole, 100,000 tokens cached would keep it there.
            placed = fleet.decide(held=Held("b0", 100_000), prompt_tokens=8500)
            assert (placed.server, placed.affinity) == ("b1", "break_load")
        for lease in leases:
            lease.release()


def test_under_an_engine_signal_a_turn_is_priced_with_the_other_gateways_streams() -> None:
    # b0 holds 4 streams of other gateways' (at the group's context, over 5,000 tokens a stream here),
    # none of ours; b1 4 of ours of 500 tokens. Streams tie; b0's tokens, as priced, do not.
    fleet = _priced_pool(1.0, load_signal="max")
    (router,) = fleet.routers
    leases = [router.admit(Role.BASELINE, "b1", 500) for _ in range(4)]
    leases += [router.admit(Role.SPECULATIVE, "s0", 40_000)]
    for server, streams in (("b0", 4), ("b1", 4), ("s0", 1)):
        router.tracker.scraping(server)
        router.tracker.scraped(server, streams)
    router.refresh()
    assert router.speed is not None and router.speed.context > 5000
    assert router.loads.placement_load("b0") == router.loads.placement_load("b1") == 4
    b0, b1 = router.turns.turn_cost("b0", 1000, 500)[0], router.turns.turn_cost("b1", 1000, 500)[0]
    assert b0 - b1 > 5 * 500 / 20_000  # more than the re-prefill moving saves
    placed = fleet.decide(held=Held("b0", 500), prompt_tokens=1000)
    assert (placed.server, placed.affinity) == ("b1", "break_load")
    for lease in leases:
        lease.release()


def test_the_slack_rule() -> None:
    # A server 4 requests busier than the best keeps a turn that has 4,000 tokens cached, at slack 1.
    assert keep(10, 6, 4000, 1.0)
    assert not keep(10, 6, 3999, 1.0)
    assert keep(10, 6, 2000, 2.0)
    assert not keep(1, 0, 100_000, 0.0)  # slack 0: the least loaded, always
    assert keep(3, 3, 0, 0.0)
    # With a balance the held server may hold that many times the best's load as well: at a full
    # batch a few requests more, at a light one few.
    assert keep(64, 52, 1000, 1.0, 1.25) and not keep(64, 52, 1000, 1.0, 1.2)
    assert not keep(3, 1, 1000, 1.0, 1.5) and keep(3, 2, 1000, 1.0, 1.5)
    assert not keep(0.3, 0, 100, 0.0, 1000.0)  # an idle peer takes a turn off a busy server whatever the balance


def test_the_balance_keeps_a_turn_on_a_full_server_that_the_slack_alone_would_move() -> None:
    # Two baseline servers at a full batch, the held one 8 streams busier: past slack 1's line for
    # 1,000 cached tokens, within balance 1.25's.
    moved = {}
    for balance in (1.0, 1.25):
        fleet = _priced_pool(1.0, "threshold", high=0, load_signal="max", affinity_balance=balance)
        (router,) = fleet.routers
        for s, streams in (("b0", 40), ("b1", 32), ("s0", 0)):
            router.tracker.scraping(s)
            router.tracker.scraped(s, streams)
        placed = fleet.decide(held=Held("b0", 1000), prompt_tokens=1100)
        moved[balance] = (placed.affinity, placed.server)
    assert moved == {1.0: ("break_load", "b1"), 1.25: ("hit", "b0")}


def test_the_table_is_bounded_and_forgets_the_longest_unused() -> None:
    table = AffinityTable(2)
    table.remember(b"a", "s1", 10)
    table.remember(b"b", "s2", 20)
    assert table.get(b"a") is not None
    table.remember(b"c", "s1", 30)
    assert (len(table), table.get(b"b"), table.get(b"a")) == (2, None, table.get(b"a"))
    held = table.get(b"c")
    assert held is not None and (held.server, held.tokens) == ("s1", 30)
    off = AffinityTable(0)
    off.remember(b"a", "s1", 1)
    assert len(off) == 0


def test_between_the_watermarks_a_turn_keeps_its_role() -> None:
    cfg = policy_cfg(high=8, low=2)
    up = {Role.SPECULATIVE: True, Role.BASELINE: True}
    state = PolicyState(Role.BASELINE)
    band = Decision(Role.BASELINE, "hysteresis_hold", state, 5)
    kept = affinity_choice(band, Role.SPECULATIVE, cfg, up)
    assert (kept.backend, kept.reason, kept.state) == (Role.SPECULATIVE, "affinity", state)
    # At or past a watermark the policy's choice stands; so do probes, batch requests, and a role that is down.
    for load, reason in ((8, "heavy_load"), (2, "light_load")):
        d = Decision(Role.BASELINE, reason, state, load)  # type: ignore[arg-type]
        assert affinity_choice(d, Role.SPECULATIVE, cfg, up) is d
    for reason in ("probe", "batch", "only_healthy", "failover"):
        d = Decision(Role.BASELINE, reason, state, 5)  # type: ignore[arg-type]
        assert affinity_choice(d, Role.SPECULATIVE, cfg, up) is d
    assert affinity_choice(band, Role.SPECULATIVE, cfg, {**up, Role.SPECULATIVE: False}) is band
    assert affinity_choice(band, Role.SPECULATIVE, policy_cfg("spillover", high=8, low=2), up) is band
    # A pair's roles share one GPU: a turn sent back to the role the mode left would time-slice it.
    assert affinity_choice(band, Role.SPECULATIVE, cfg, up, pooled=False) is band


def test_the_engines_prefix_cache_hit_rate() -> None:
    h = Health()
    sglang = "sglang:num_running_reqs 0\nsglang:num_queue_reqs 0\nsglang:cache_hit_rate 0.625\n"
    found = read(h, 200, sglang.encode(), 1.0, ENGINES["sglang"], 60.0, 0)
    assert not isinstance(found, str) and found.cache_hit_rate == 0.625
    h = Health()
    rates = []
    for hits, queries in ((100, 400), (400, 800), (400, 800), (10, 20)):  # the last: a restart
        text = (
            "vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n"
            f"vllm:prefix_cache_hits_total {hits}\nvllm:prefix_cache_queries_total {queries}\n"
        )
        found = read(h, 200, text.encode(), 1.0, ENGINES["vllm"], 60.0, 0)
        assert not isinstance(found, str)
        rates.append(found.cache_hit_rate)
        h.engine_cache_hit_rate = found.cache_hit_rate  # as the health loop keeps it
    # None until two scrapes; hits over queries between them; it stands while no prompt came; a
    # counter that went back starts afresh, the last value standing meanwhile.
    assert rates == [None, 0.75, 0.75, 0.75]


# ---------------------------------------------------------------------------------------------
# In-process: conversations through the gateway, in front of a pool of two baseline servers


@contextlib.asynccontextmanager
async def _pool(gateway: StartGateway, **settings: Any) -> AsyncIterator[Gateway]:
    """A gateway whose baseline is a pool of two servers, b0 and b1, that report cached tokens;
    everything goes to the baseline (watermark 0)."""
    sims = [await start_sim("baseline", time_scale=20.0, enable_cache_report=True) for _ in range(2)]
    try:
        yield await gateway(
            baseline_url=f"b0={sims[0].url},b1={sims[1].url}",
            topology="pooled",
            high_watermark=0,
            low_watermark=0,
            **settings,
        )
    finally:
        for sim in sims:
            await sim.stop()


async def _server_requests(gw: Gateway) -> dict[str, float]:
    text = await gw.metrics_text()
    out = {}
    for line in text.splitlines():
        if line.startswith("specgate_server_requests_total{"):
            name = line.split('server="', 1)[1].split('"', 1)[0]
            out[name] = float(line.rsplit(" ", 1)[1])
    return out


async def _served_by(gw: Gateway, before: dict[str, float]) -> str:
    after = await _server_requests(gw)
    moved = [name for name in after if after[name] > before.get(name, 0)]
    assert len(moved) == 1, (before, after)
    return moved[0]


@pytest.mark.anyio
async def test_later_turns_land_on_their_server_and_find_their_prefix_cached(gateway: StartGateway) -> None:
    async with _pool(gateway) as gw:
        cached_later: list[int] = []
        for c in range(6):
            users: list[str] = []
            where: list[str] = []
            for turn in range(4):
                users.append(f"conversation {c} turn {turn}: tell me more. " * 8)
                before = await _server_requests(gw)
                r = await gw.client.post("/v1/chat/completions", json={**_chat(*users), "max_tokens": 4})
                assert r.status_code == 200, r.text
                where.append(await _served_by(gw, before))
                if turn:
                    cached_later.append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
            assert len(set(where)) == 1, f"conversation {c} moved: {where}"
        # Every later turn found its conversation so far in its server's cache.
        assert all(cached > 100 for cached in cached_later), cached_later
        m = await gw.metrics()
        assert (m["specgate_affinity_hits_total"], m["specgate_affinity_misses_total"]) == (6 * 3, 6)
        assert m["specgate_affinity_entries"] == 6
        assert m["specgate_affinity_breaks_total"] == 0


async def _a_turn_beside_a_long_one(gw: Gateway) -> tuple[str, str, str]:
    """A conversation's short first turn, a long streamed turn of it, and while that streams a
    third short one: the server each went to."""
    hdr = {"x-session-id": "conv-1"}
    body = {**_chat("hello there"), "max_tokens": 2}
    before = await _server_requests(gw)
    assert (await gw.client.post("/v1/chat/completions", json=body, headers=hdr)).status_code == 200
    first = await _served_by(gw, before)
    long = {"prompt": "p", "max_tokens": 120_000, "stream": True}
    before = await _server_requests(gw)
    async with gw.client.stream("POST", "/v1/completions", json=long, headers=hdr) as r:
        await anext(r.aiter_lines())
        second = await _served_by(gw, before)
        before = await _server_requests(gw)
        assert (await gw.client.post("/v1/chat/completions", json=body, headers=hdr)).status_code == 200
        third = await _served_by(gw, before)
    return first, second, third


@pytest.mark.anyio
async def test_a_turn_leaves_a_server_busier_than_its_cache_is_worth(gateway: StartGateway) -> None:
    async with _pool(gateway, affinity_slack=0.0, sim={"time_scale": 1.0}) as gw:
        # While the long turn streams its server holds one request more than the other server,
        # and slack 0 allows none.
        held, long, third = await _a_turn_beside_a_long_one(gw)
        assert long == held and third != held
        text = await gw.metrics_text()
        assert 'specgate_affinity_breaks_total{reason="load"} 1.0' in text
        assert "specgate_affinity_hits_total 1.0" in text


@pytest.mark.anyio
async def test_under_the_model_policy_the_pool_prices_a_turns_stay(gateway: StartGateway, tmp_path: Path) -> None:
    # A fit on which speculation never pays: every request goes to the baseline pool.
    spec, base = MODEL["speculative"], MODEL["baseline"]
    assert isinstance(spec, dict) and isinstance(base, dict)
    # Its baseline's error 0: the turn below saves little, but more than nothing.
    never = {**MODEL, "speculative": {**spec, "a": 1.0}, "baseline": {**base, "rms_rel": 0.0}}
    cal = calibration_file(tmp_path, never)
    async with _pool(
        gateway, policy="model", calibration=cal, prefill_tok_s=20_000, affinity_rule="both", sim={"time_scale": 1.0}
    ) as gw:
        routing = await gw.routing()
        # Under `both` a turn moves only where the priced rule and the one by requests in flight agree.
        assert routing["affinity"]["rule"] == "both"
        assert (routing["groups"][0]["affinity_rule"], routing["groups"][0]["turn_out_tokens"]) == ("both", 256)
        # The third turn's few cached tokens save the idle server a prefill of milliseconds: less
        # than the decode the long stream would cost it on its server, and less than one request.
        held, long, third = await _a_turn_beside_a_long_one(gw)
        assert long == held and third != held
        # The group learns a turn's output from responses: 2 tokens a turn moved it off 256.
        assert (await gw.routing())["groups"][0]["turn_out_tokens"] < 256
        assert 'specgate_affinity_breaks_total{reason="load"} 1.0' in await gw.metrics_text()


@pytest.mark.anyio
async def test_affinity_off_and_a_server_that_went_down(gateway: StartGateway) -> None:
    off = await gateway(affinity_entries=0)
    await off.client.post("/v1/chat/completions", json={**_chat("hi"), "max_tokens": 2})
    m = await off.metrics()
    assert (m["specgate_affinity_entries"], m["specgate_affinity_misses_total"]) == (0, 0)
    assert (await off.routing())["affinity"] == {"entries": 0, "slack": 1.0, "balance": 1.5, "rule": "in_flight"}
    on = await gateway(health_interval_s=0.2)
    first = await on.client.post("/v1/chat/completions", json={**_chat("hi"), "max_tokens": 2})
    assert first.headers["x-specgate-backend"] == "speculative"
    await on.spec.stop()

    async def down() -> bool:
        return (await on.routing())["servers"]["speculative"]["healthy"] is False

    await wait_until(down)
    r = await on.client.post("/v1/chat/completions", json={**_chat("hi", "again"), "max_tokens": 2})
    assert r.headers["x-specgate-backend"] == "baseline"
    assert 'specgate_affinity_breaks_total{reason="down"} 1.0' in await on.metrics_text()


def test_a_turn_that_breaks_off_its_server_or_group_never_draws_it_again() -> None:
    # Under an engine signal a server's load carries another gateway's smoothed streams: 0.3 here,
    # within a near-tie of its peer's, yet past slack 0's line. The turn breaks off, to the peer.
    for seed in range(12):
        fleet = _priced_pool(0.0, "threshold", high=0, load_signal="max")
        (router,) = fleet.routers
        router._rng = random.Random(seed)
        for s in ("b0", "b1", "s0"):
            router.tracker.scraping(s)
            router.tracker.scraped(s, 0)
        router.tracker.load_of("b0").others_balance = 0.3
        placed = fleet.decide(held=Held("b0", 100), prompt_tokens=1000)
        assert (placed.affinity, placed.server) == ("break_load", "b1")
    # Between groups alike: two pairs, the turn's group 0.3 busier.
    r = rig(
        speculative_url="s0=http://127.0.0.1:9,s1=http://127.0.0.1:10",
        baseline_url="b0=http://127.0.0.1:11,b1=http://127.0.0.1:12",
    )
    cfg = policy_cfg("threshold", 0, 0, probe_s=0.0, affinity_slack=0.0, load_signal="max")
    for seed in range(12):
        pairs = Fleet(r.topology, r.servers, cfg, r.metrics, clock=Clock(), rng=random.Random(seed))
        for s in r.servers:
            pairs.tracker.scraping(s)
            pairs.tracker.scraped(s, 0)
        pairs.tracker.load_of("b0").others_balance = 0.3
        placed = pairs.decide(held=Held("b0", 100), prompt_tokens=1000)
        assert placed.affinity == "break_load" and placed.router is not pairs.router_of("b0")


def test_what_has_no_conversation_to_remember() -> None:
    # An embedding's tokens are cached nowhere a chat turn reads them, whatever its session.
    assert conversation_key(b"abc", {"input": "embed me"}, "other") is None
    # A Responses continuation goes where its stored response is; its input is no conversation's lead.
    assert conversation_key(None, {"input": "go on", "previous_response_id": "resp_1"}, "responses") is None
    assert conversation_key(b"abc", {"input": "go on", "previous_response_id": "resp_1"}, "responses") == b"s:abc"


@pytest.mark.anyio
async def test_a_turn_not_streamed_leaves_its_reply_cached_as_the_servers_usage_says(gateway: StartGateway) -> None:
    # A first turn of 300 tokens' reply, not streamed (its body passes as one event), then one
    # request more on its server: at slack 2.5 its next turn stays only if the reply counts as
    # cached (2.5 * ~460 / 1000 >= 1; its ~160 prompt tokens alone would give 0.4).
    async with _pool(gateway, affinity_slack=2.5, sim={"time_scale": 1.0}) as gw:
        hdr = {"x-session-id": "conv-2"}
        first = {**_chat("hello there"), "max_tokens": 300, "ignore_eos": True}
        before = await _server_requests(gw)
        r = await gw.client.post("/v1/chat/completions", json=first, headers=hdr)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 300
        held = await _served_by(gw, before)
        long = {"prompt": "p", "max_tokens": 120_000, "stream": True}
        before = await _server_requests(gw)
        async with gw.client.stream("POST", "/v1/completions", json=long, headers=hdr) as s:
            await anext(s.aiter_lines())
            assert await _served_by(gw, before) == held
            # The next turn resends the reply: its prompt holds all that is cached.
            later = {**_chat("hello there", "and now in detail: " + "more " * 400), "max_tokens": 2}
            before = await _server_requests(gw)
            assert (await gw.client.post("/v1/chat/completions", json=later, headers=hdr)).status_code == 200
            assert await _served_by(gw, before) == held
        assert "specgate_affinity_hits_total 2.0" in await gw.metrics_text()


@pytest.mark.anyio
async def test_a_turn_whose_stream_broke_is_not_remembered(gateway: StartGateway) -> None:
    gw = await gateway(sim={"time_scale": 1.0}, spec={"stall_rate": 1.0}, read_timeout_s=0.5, high_watermark=8)
    body = {"prompt": "hello " * 50, "max_tokens": 2000, "stream": True}
    async with gw.client.stream("POST", "/v1/completions", json=body, headers={"x-session-id": "t"}) as r:
        assert r.headers["x-specgate-backend"] == "speculative"
        raw = b"".join([c async for c in r.aiter_bytes()])
    assert b"upstream_timeout" in raw
    m = await gw.metrics()
    assert (m["specgate_affinity_entries"], m["specgate_affinity_misses_total"]) == (0, 1)


@pytest.mark.anyio
async def test_continuations_of_stored_responses_teach_the_token_estimate_nothing(gateway: StartGateway) -> None:
    gw = await gateway()
    r = await gw.client.post("/v1/responses", json={"input": "Tell me about Lisbon. " * 30, "max_output_tokens": 200})
    assert r.status_code == 200, r.text
    learnt = (await gw.routing())["prompt_token_ratio"]
    previous = r.json()["id"]
    for _ in range(10):
        body = {"input": "go on", "previous_response_id": previous, "max_output_tokens": 50}
        r = await gw.client.post("/v1/responses", json=body)
        assert r.status_code == 200, r.text
        previous = r.json()["id"]
    # Each continuation's usage counts the whole stored conversation, its estimate two words.
    assert (await gw.routing())["prompt_token_ratio"] == learnt
    assert (await gw.metrics())["specgate_affinity_entries"] == 1
