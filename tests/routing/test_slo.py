"""No class starved: where SPECGATE_SLO_TPOT_MS is set, a pooled class's request that its own role
would decode slower than the SLO goes to the other role where that one would not (reason slo); and
where SPECGATE_SLO_TTFT_MS and SPECGATE_PREFILL_TOK_S are, one that would wait longer for its first
token, the prefill ahead of it and its own uncached tokens counted."""

from __future__ import annotations

import pytest

from proxy.config import Settings
from proxy.policy.base import ClassView, Decision, PolicyState, PoolGains, Role
from proxy.routing.affinity import Held
from proxy.routing.fleet import Fleet
from proxy.routing.leases import InflightTracker
from proxy.routing.steps.classes import class_choice

from ..helpers import policy_cfg, rig
from ..inprocess import StartGateway, start_sim

pytestmark = pytest.mark.inprocess

UP = {Role.SPECULATIVE: True, Role.BASELINE: True}
SPEC_DOWN = {Role.SPECULATIVE: False, Role.BASELINE: True}
LIGHT = Decision(Role.SPECULATIVE, "light_load", PolicyState(Role.SPECULATIVE), 6)
VIEW = ClassView(False, 20, 15, 1.3)


def test_a_class_its_own_role_would_starve_takes_the_other_roles_room() -> None:
    slo = policy_cfg("adaptive", high=20, low=15, slo_tpot_ms=50.0)
    # The pool gains most with it on the baseline, where it would decode at 15 tokens/s (67 ms a
    # token); on speculation, 25 tokens/s (40 ms): it goes there.
    starved = PoolGains(100.0, 150.0, 25.0, 15.0)
    d = class_choice(LIGHT, VIEW, slo, UP, True, 5, None, starved)
    assert (d.backend, d.reason) == (Role.SPECULATIVE, "slo")
    # Without the SLO, or where the other role would miss it too, the pool's gain decides.
    plain = policy_cfg("adaptive", high=20, low=15)
    assert class_choice(LIGHT, VIEW, plain, UP, True, 5, None, starved)[:2] == (Role.BASELINE, "class")
    both_miss = PoolGains(100.0, 150.0, 18.0, 15.0)
    assert class_choice(LIGHT, VIEW, slo, UP, True, 5, None, both_miss)[:2] == (Role.BASELINE, "class")
    # Not onto a role that is down, nor into a speculative KV pool that is full.
    assert class_choice(LIGHT, VIEW, slo, SPEC_DOWN, True, 5, None, starved)[:2] == (Role.BASELINE, "class")
    full = policy_cfg("adaptive", high=20, low=15, slo_tpot_ms=50.0, capacity=5)
    assert class_choice(LIGHT, VIEW, full, UP, True, 5, None, starved)[:2] == (Role.BASELINE, "class")
    # And the other way: speculation would starve it, the baseline would not.
    crowded = PoolGains(200.0, 150.0, 19.0, 40.0)
    assert class_choice(LIGHT, VIEW, slo, UP, True, 5, None, crowded)[:2] == (Role.BASELINE, "slo")


def test_the_slos_are_settings_in_ms() -> None:
    s = Settings(_env_file=None, slo_tpot_ms=50, slo_ttft_ms=1000)
    assert s.policy_config(None).slo_tpot_ms == 50.0
    assert Settings(_env_file=None).policy_config(None).slo_tpot_ms is None
    with pytest.raises(ValueError):
        Settings(_env_file=None, slo_tpot_ms=0)


def test_a_request_its_role_would_keep_past_the_ttft_slo_goes_where_it_would_not() -> None:
    slo = policy_cfg("adaptive", high=20, low=15, slo_ttft_ms=1000.0, prefill_tok_s=10_000.0)
    gains = PoolGains(100.0, 150.0, 25.0, 30.0)  # the baseline gains more, both decode in time
    # Predicted: 1.5 s to its first token on the baseline (its prefill queue), 0.4 s on speculation.
    queued = {Role.BASELINE: 1500.0, Role.SPECULATIVE: 400.0}
    d = class_choice(LIGHT, VIEW, slo, UP, True, 5, None, gains, 0, queued)
    assert (d.backend, d.reason) == (Role.SPECULATIVE, "slo")
    # Not where neither role would meet it, nor without a prediction.
    late = {Role.BASELINE: 1500.0, Role.SPECULATIVE: 1200.0}
    assert class_choice(LIGHT, VIEW, slo, UP, True, 5, None, gains, 0, late)[:2] == (Role.BASELINE, "class")
    assert class_choice(LIGHT, VIEW, slo, UP, True, 5, None, gains, 0, None)[:2] == (Role.BASELINE, "class")


def test_a_move_for_the_tpot_slo_is_not_made_where_the_re_prefill_would_miss_the_ttft_slo() -> None:
    cfg = policy_cfg("adaptive", high=20, low=15, slo_tpot_ms=50.0, slo_ttft_ms=1000.0, prefill_tok_s=10_000.0)
    starved = PoolGains(100.0, 150.0, 25.0, 15.0)  # the baseline would decode it at 67 ms a token
    # Its 12k-token conversation is cached on the baseline: 1.2 s to prefill it again on speculation.
    ttft = {Role.BASELINE: 20.0, Role.SPECULATIVE: 1200.0}
    d = class_choice(LIGHT, VIEW, cfg, UP, True, 5, Role.BASELINE, starved, 12_000, ttft)
    assert (d.backend, d.reason) != (Role.SPECULATIVE, "slo")
    # A short one moves.
    ttft = {Role.BASELINE: 20.0, Role.SPECULATIVE: 100.0}
    d = class_choice(LIGHT, VIEW, cfg, UP, True, 5, Role.BASELINE, starved, 1000, ttft)
    assert (d.backend, d.reason) == (Role.SPECULATIVE, "slo")


def test_a_leases_prompt_counts_as_prefill_ahead_until_its_first_byte() -> None:
    r = rig(topology="pooled", speculative_url="s0=http://127.0.0.1:9", baseline_url="b0=http://127.0.0.1:10")
    tracker = InflightTracker(r.servers)
    first = tracker.acquire("b0", 3000, prefill=3000)
    second = tracker.acquire("b0", 5000, prefill=1000)  # 4,000 of it cached there
    assert tracker.prefill("b0") == 4000
    first.prefilled()
    first.prefilled()  # once
    assert tracker.prefill("b0") == 1000
    second.add(3)  # output counts as tokens; the relay says when the prefill is behind it
    assert tracker.prefill("b0") == 1000
    second.prefilled()
    assert tracker.prefill("b0") == 0
    third = tracker.acquire("b0", 800, prefill=800)
    third.release()  # a request that ended with nothing back
    first.release()
    second.release()
    assert (tracker.prefill("b0"), tracker.tokens("b0"), tracker.count("b0")) == (0, 0, 0)
    # Never more than its prompt.
    assert tracker.acquire("b0", 10, prefill=99).prefill == 10


def test_a_turn_on_the_server_holding_its_conversation_prefills_only_what_is_new() -> None:
    r = rig(topology="pooled", speculative_url="s0=http://127.0.0.1:9", baseline_url="b0=http://127.0.0.1:10")
    fleet = Fleet(r.topology, r.servers, policy_cfg("threshold", 0, 0, probe_s=0.0), r.metrics)
    (router,) = fleet.routers
    held = Held("b0", 4000)
    leases = [
        router.admit(Role.BASELINE, "b0", 4200, held=held),
        router.admit(Role.SPECULATIVE, "s0", 4200, held=held),
        router.admit(Role.BASELINE, "b0", 4200),
    ]
    assert [lease.prefill for lease in leases] == [200, 4200, 4200]
    assert (router.prefill_ahead(Role.BASELINE), router.prefill_ahead(Role.SPECULATIVE)) == (4400, 4200)
    for lease in leases:
        lease.release()
    assert router.prefill_ahead(Role.BASELINE) == 0


@pytest.mark.anyio
async def test_a_streamed_requests_prompt_leaves_the_prefill_ahead_at_its_first_byte(gateway: StartGateway) -> None:
    sims = [await start_sim("baseline", time_scale=1.0), await start_sim("speculative", time_scale=1.0)]
    try:
        gw = await gateway(
            baseline_url=f"b0={sims[0].url}",
            speculative_url=f"s0={sims[1].url}",
            topology="pooled",
            high_watermark=0,
            low_watermark=0,
        )
        long = {"prompt": "word " * 400, "max_tokens": 120_000, "stream": True}
        async with gw.client.stream("POST", "/v1/completions", json=long) as r:
            await anext(r.aiter_lines())
            b0 = (await gw.routing())["servers"]["b0"]
            assert (b0["inflight"], b0["prefill_tokens"]) == (1, 0) and b0["tokens"] > 400
        routing = await gw.routing()
        b0 = routing["servers"]["b0"]
        assert (b0["inflight"], b0["prefill_tokens"], b0["tokens"]) == (0, 0, 0)
        assert routing["slo"] == {"ttft_ms": None, "tpot_ms": None, "ttft_predicted": False}
    finally:
        for sim in sims:
            await sim.stop()
