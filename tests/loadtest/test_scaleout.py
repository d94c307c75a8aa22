"""`python -m loadtest scaleout`: the scoring on known inputs (split evenness, switches per level step,
in-flight imbalance, the ratio to the better configuration, the drift between replicas and their
error against the servers, reading specgate's and the servers' /metrics), and one short real run for
each topology. The runs check where requests went, at the
servers; the throughput targets are the scenario's to report, not a test's to assert."""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest

from loadtest import scaleout
from loadtest.scaleout import (
    GateSample,
    Round,
    Server,
    ServerSample,
    drift_lines,
    drift_of,
    error_summary,
    gate_sample,
    group_loads,
    group_shares,
    group_spreads,
    imbalance,
    instant_deviation,
    mean_inflight,
    replica_rounds,
    server_sample,
    split_deviation,
    spread,
    switches_between,
    view_errors,
    vs_better,
)
from loadtest.simulator.profile import load_profile
from proxy.config import Settings

# Two cores run three configurations side by side: a time scale of 2 keeps the baseline's chunks
# (one a token) at a few thousand a second in all.
TIME_SCALE = 2


# ---------------------------------------------------------------------------------------------
# Scoring on known inputs


def test_split_deviation_is_the_most_uneven_group_relative_to_its_even_share() -> None:
    assert split_deviation({"group-0": 0.5, "group-1": 0.5}) == 0.0
    assert split_deviation({"group-0": 0.575, "group-1": 0.425}) == pytest.approx(0.15)
    assert split_deviation({"group-0": 0.6, "group-1": 0.4}) == pytest.approx(0.2)
    # Three groups: the one at 20% is 40% below its third.
    assert split_deviation({"a": 0.4, "b": 0.4, "c": 0.2}) == pytest.approx(0.4)
    assert split_deviation({"group-0": 1.0}) is None


def test_group_shares_add_up_each_groups_servers() -> None:
    tokens = {"speculative-0": 300.0, "baseline-0": 100.0, "speculative-1": 0.0, "baseline-1": 600.0}
    group = {"speculative-0": "group-0", "baseline-0": "group-0", "speculative-1": "group-1", "baseline-1": "group-1"}
    assert group_shares(tokens, group) == {"group-0": pytest.approx(0.4), "group-1": pytest.approx(0.6)}
    nothing = group_shares(dict.fromkeys(tokens, 0.0), group)
    assert all(math.isnan(v) for v in nothing.values())


def test_instant_deviation_sees_load_sloshing_that_an_even_total_hides() -> None:
    # 20 streams moving wholesale from one group to the other every second: even over the window,
    # as uneven as can be at each moment.
    sloshing = [(float(t), {"group-0": 20.0 * (t % 2), "group-1": 20.0 * (1 - t % 2)}) for t in range(10)]
    assert instant_deviation(sloshing, 0.0, 10.0) == pytest.approx(1.0)
    steady = [(float(t), {"group-0": 11.0, "group-1": 9.0}) for t in range(10)]
    assert instant_deviation(steady, 0.0, 10.0) == pytest.approx(0.1)
    # Moments with nothing in flight say nothing; neither do samples outside the window.
    idle = [(0.0, {"group-0": 0.0, "group-1": 0.0}), (1.0, {"group-0": 4.0, "group-1": 4.0})]
    assert instant_deviation(idle, 0.0, 10.0) == 0.0
    assert instant_deviation(idle, 5.0, 10.0) is None
    assert instant_deviation([(0.0, {"group-0": 3.0})], 0.0, 1.0) is None


def test_the_profile_at_the_loads_held_shows_what_an_uneven_split_costs() -> None:
    plan = scaleout.ScaleoutPlan(groups=2, time_scale=2.0)
    run = scaleout.ConfigRun("all-baseline", 0, 0)
    run.servers = [Server("baseline-0", "baseline", "group-0", ""), Server("baseline-1", "baseline", "group-1", "")]
    # 6 and 2 in flight, read as 7.5 and 2.5 (a lagging gauge over-counts): scaled back to 8 streams.
    run.server_samples = {
        "baseline-0": [tick(t, 7.5, 10.0 * t) for t in range(5)],
        "baseline-1": [tick(t, 2.5, 10.0 * t) for t in range(5)],
    }
    profile = load_profile("crossover")
    held = scaleout.profile_throughput(plan, run, "baseline", 8, 0.0, 10.0)
    assert held == pytest.approx(2.0 * (profile.throughput("baseline", 6) + profile.throughput("baseline", 2)))
    even = scaleout.even_throughput(plan, "baseline", 8)
    assert even == pytest.approx(2.0 * 2 * profile.throughput("baseline", 4))
    assert held < even  # the profile is concave: an uneven split loses throughput


def test_group_loads_add_up_each_groups_servers_round_by_round() -> None:
    servers = [Server("speculative-0", "speculative", "group-0", ""), Server("baseline-0", "baseline", "group-0", ""),
               Server("speculative-1", "speculative", "group-1", "")]  # fmt: skip
    samples = {
        "speculative-0": [tick(t, 2.0, 10.0 * t) for t in range(4)],
        # Scraped a few ms after the first server each round; idle (frozen) after t=1.
        "baseline-0": [tick(t + 0.004, 5.0, 10.0 * min(t, 1)) for t in range(4)],
        "speculative-1": [tick(t + 0.002, 7.0, 10.0 * t) for t in range(4)],
    }
    assert group_loads(servers, samples) == [
        (1.0, {"group-0": 7.0, "group-1": 7.0}),
        (2.0, {"group-0": 2.0, "group-1": 7.0}),
        (3.0, {"group-0": 2.0, "group-1": 7.0}),
    ]


def gate(t: float, switches: dict[str, float] | None) -> GateSample:
    return GateSample(t, {}, switches, tick=False)


def test_switches_are_counted_from_a_level_step_to_the_next() -> None:
    replica = [
        gate(0.0, {"group-0": 0, "group-1": 0}),
        gate(10.0, {"group-0": 0, "group-1": 0}),  # level 2 starts
        gate(12.0, {"group-0": 1, "group-1": 0}),
        gate(15.0, {"group-0": 3, "group-1": 1}),
        gate(20.0, {"group-0": 3, "group-1": 1}),  # level 3 starts
        gate(30.0, {"group-0": 4, "group-1": 1}),
    ]
    assert switches_between(replica, 0.0, 10.0) == {"group-0": 0, "group-1": 0}
    assert switches_between(replica, 10.0, 20.0) == {"group-0": 3, "group-1": 1}
    assert switches_between(replica, 20.0, 30.0) == {"group-0": 1, "group-1": 0}
    # The nearest sample stands for a boundary scraped a little late.
    assert switches_between(replica, 10.05, 19.9) == {"group-0": 3, "group-1": 1}
    assert switches_between([gate(0.0, None), gate(10.0, None)], 0.0, 10.0) is None
    assert switches_between([], 0.0, 10.0) is None


def tick(t: float, inflight: float, generated: float) -> ServerSample:
    return ServerSample(t, inflight, 0.0, generated, 0.0, tick=True)


def test_mean_inflight_counts_a_frozen_gauge_as_idle() -> None:
    busy = [tick(t, 4.0, 100.0 * t) for t in range(11)]
    assert mean_inflight(busy, 2.0, 10.0) == (4.0, 9)
    # The gauge kept reading 4 after the server stopped generating at t=5 (SGLang's stay put).
    # Generating at t = 1..5, frozen at 6..10: half the samples count 4, half 0.
    frozen = [tick(t, 4.0, 100.0 * min(t, 5)) for t in range(11)]
    assert mean_inflight(frozen, 1.0, 10.0) == (2.0, 10)
    # Samples taken at a boundary are not periodic ones: they neither count nor serve as "previous".
    boundary = ServerSample(5.5, 50.0, 0.0, 1.0, 0.0, tick=False)
    assert mean_inflight([*busy[:6], boundary, *busy[6:]], 2.0, 10.0) == (4.0, 9)
    value, n = mean_inflight(busy, 20.0, 30.0)
    assert math.isnan(value) and n == 0


def test_imbalance_is_the_busiest_server_over_its_roles_mean() -> None:
    assert imbalance([4.0, 4.0]) == 1.0
    assert imbalance([6.0, 2.0]) == pytest.approx(1.5)
    assert imbalance([3.0, 3.0, 0.0]) == pytest.approx(1.5)
    assert imbalance([0.4, 0.2]) is None  # idle: 0.3 in flight a server on average
    assert imbalance([2.0, math.nan]) is None
    assert imbalance([]) is None


def test_ratio_is_to_the_better_fixed_configuration() -> None:
    assert vs_better(95.0, 100.0, 80.0) == pytest.approx(0.95)
    assert vs_better(95.0, 80.0, 100.0) == pytest.approx(0.95)
    assert vs_better(110.0, 100.0, 100.0) == pytest.approx(1.1)
    assert math.isnan(vs_better(95.0, math.nan, 100.0))
    assert math.isnan(vs_better(95.0, 0.0, 0.0))


# ---------------------------------------------------------------------------------------------
# Drift between replicas


def test_spread_is_how_far_apart_the_replicas_views_are() -> None:
    assert spread([3.0, 5.0, 4.0]) == 2.0
    assert spread([7.0, 7.0]) == 0.0
    assert spread([4.0]) is None  # one replica: nothing to drift from
    assert spread([]) is None


def view(t: float, loads: dict[str, float], own: dict[str, float] | None = None, tick: bool = True) -> GateSample:
    return GateSample(t, {}, None, tick, loads, own)


PAIRS = [
    Server("speculative-0", "speculative", "group-0", ""),
    Server("baseline-0", "baseline", "group-0", ""),
    Server("speculative-1", "speculative", "group-1", ""),
    Server("baseline-1", "baseline", "group-1", ""),
]


def test_replica_rounds_align_each_replicas_view_with_the_servers_round() -> None:
    samples = {
        "speculative-0": [tick(t, 3.0, 10.0 * t) for t in range(4)],
        "baseline-0": [tick(t + 0.003, 1.0, 10.0 * t) for t in range(4)],
        "speculative-1": [tick(t + 0.001, 6.0, 10.0 * t) for t in range(4)],
        # Idle after t=1: its gauge still reads 2 but counts 0 (trusted_inflight).
        "baseline-1": [tick(t + 0.002, 2.0, 10.0 * min(t, 1)) for t in range(4)],
    }
    own = {"speculative-0": 1.0, "baseline-0": 1.0, "speculative-1": 2.0}
    r0 = [view(t + 0.01, {"group-0": 4.0, "group-1": 7.0}, own) for t in range(4)]
    # Replica 1: a boundary sample (not periodic) right at t=2, and its periodic one there too late.
    r1 = [
        view(1.02, {"group-0": 5.0, "group-1": 6.0}, {}),
        view(2.0, {"group-0": 99.0, "group-1": 99.0}, {}, tick=False),
        view(2.4, {"group-0": 99.0, "group-1": 99.0}, {}),
        view(3.0, {"group-0": 5.0, "group-1": 6.0}, None),  # exports no own in-flight
    ]
    rounds = replica_rounds(PAIRS, samples, [r0, r1], tolerance=0.25)
    assert [r.t for r in rounds] == [1.0, 2.0, 3.0]
    assert rounds[0].truth == {"group-0": 4.0, "group-1": 8.0}
    assert rounds[1].truth == {"group-0": 4.0, "group-1": 6.0}
    assert rounds[0].views == [{"group-0": 4.0, "group-1": 7.0}, {"group-0": 5.0, "group-1": 6.0}]
    assert rounds[1].views == [{"group-0": 4.0, "group-1": 7.0}, None]
    # Own in flight added up by group; a replica that has sent nothing yet has none.
    assert rounds[0].own == [{"group-0": 2.0, "group-1": 2.0}, {"group-0": 0.0, "group-1": 0.0}]
    assert rounds[0].gateways() == {"group-0": 2.0, "group-1": 2.0}
    assert rounds[1].gateways() is None and rounds[2].gateways() is None


def rnd(t: float, truth: dict[str, float], *views: dict[str, float] | None) -> Round:
    return Round(t, truth, list(views), [None] * len(views))


def test_spreads_need_every_replicas_view_and_stay_in_the_window() -> None:
    rounds = [
        rnd(1.0, {"g": 10.0}, {"g": 9.0}, {"g": 12.0}, {"g": 10.0}),
        rnd(2.0, {"g": 10.0}, {"g": 10.0}, None, {"g": 10.0}),  # a replica missing: no spread
        rnd(3.0, {"g": 10.0}, {"g": 11.0}, {"g": 10.0}, {"g": 10.0}),
        rnd(9.0, {"g": 10.0}, {"g": 0.0}, {"g": 20.0}, {"g": 10.0}),
    ]
    assert group_spreads(rounds, 0.0, 5.0) == {"g": [3.0, 1.0]}
    assert group_spreads(rounds, 0.0, 10.0) == {"g": [3.0, 1.0, 20.0]}
    assert group_spreads([rnd(1.0, {"g": 1.0}, {"g": 1.0})], 0.0, 5.0) == {}  # one replica


def test_errors_are_each_replicas_view_minus_the_truth() -> None:
    rounds = [
        rnd(1.0, {"a": 10.0, "b": 4.0}, {"a": 12.0, "b": 4.0}, {"a": 9.0, "b": 5.0}),
        rnd(2.0, {"a": 10.0, "b": 4.0}, {"a": 10.0, "b": 2.0}, None),  # a missing view counts nothing
        rnd(7.0, {"a": 0.0, "b": 0.0}, {"a": 50.0, "b": 50.0}, {"a": 50.0, "b": 50.0}),  # outside
    ]
    errors = view_errors(rounds, 0.0, 5.0, lambda r: r.truth)
    assert errors == [2.0, 0.0, -1.0, 1.0, 0.0, -2.0]
    mae, bias = error_summary(errors)
    assert mae == pytest.approx(1.0) and bias == pytest.approx(0.0)
    assert error_summary([3.0, 1.0]) == (2.0, 2.0)  # over-counting: a positive bias
    assert error_summary([-3.0, 1.0]) == (2.0, -1.0)
    assert all(math.isnan(x) for x in error_summary([]))
    assert view_errors(rounds, 0.0, 5.0, lambda r: None) == []


def test_drift_figures_of_a_level() -> None:
    # Two replicas, one group: spreads 0, 1, ..., 20 over the scored part [10, 40] (p95 19.0, linear
    # interpolation), and 30 at the level step before it (t=5), which only the level's maximum sees.
    rounds = [Round(5.0, {"g": 10.0}, [{"g": 0.0}, {"g": 30.0}], [None, None])]
    for i in range(21):
        own = [{"g": 4.0}, {"g": 6.0}]
        rounds.append(Round(10.0 + i, {"g": 10.0}, [{"g": 10.0 + i}, {"g": 10.0}], list(own)))
    d = drift_of(rounds, 0.0, 10.0, 40.0)
    assert d is not None
    assert d.rounds == 21
    assert d.spread_mean == {"g": pytest.approx(10.0)} and d.worst_mean == pytest.approx(10.0)
    assert d.spread_p95 == {"g": pytest.approx(19.0)} and d.worst_p95 == pytest.approx(19.0)
    assert d.spread_max == {"g": 20.0} and d.level_max == 30.0
    # The first replica over-counts by i, the second is exact: 42 errors, mean i / 2.
    assert d.error_samples == 42
    assert d.error_abs == pytest.approx(5.0) and d.error_bias == pytest.approx(5.0)
    # The replicas' own in flight add up to the truth here: the same error against them.
    assert d.gateway_error_abs == pytest.approx(5.0) and d.gateway_error_bias == pytest.approx(5.0)
    # The worst group's figures make the table's.
    two = [Round(10.0 + i, {"a": 1.0, "b": 1.0}, [{"a": 1.0, "b": 1.0 + i}, {"a": 2.0, "b": 1.0}], [None, None])
           for i in range(3)]  # fmt: skip
    d2 = drift_of(two, 0.0, 10.0, 20.0)
    assert d2 is not None
    assert d2.spread_mean == {"a": 1.0, "b": 1.0} and d2.spread_max == {"a": 1.0, "b": 2.0}
    assert d2.worst_p95 == pytest.approx(1.9) and math.isnan(d2.gateway_error_abs)
    assert drift_of([rnd(11.0, {"g": 1.0}, {"g": 1.0})], 0.0, 10.0, 20.0) is None  # one replica


def test_drift_lines_name_the_largest_drift_as_a_share_of_the_band() -> None:
    def level(c: int, d: scaleout.Drift | None) -> Any:
        sg = argparse.Namespace(drift=d)
        return argparse.Namespace(concurrency=c, configs={"specgate": sg})

    def drift(p95: float, top: float) -> scaleout.Drift:
        return scaleout.Drift(10, {"g": 1.0}, {"g": p95}, {"g": top}, 1.0, p95, top, 1.0, 0.5, 20, 0.4, -0.2)

    lines = drift_lines([level(2, None), level(10, drift(2.5, 3.0)), level(20, drift(1.0, 6.0))], 19, 14)
    assert "largest p95 2.5 requests at c=10 (50% of the band high - low = 19 - 14 = 5)" in lines[0]
    assert "largest single spread 6 at c=20" in lines[0] and "(120% of the band" in lines[0]
    assert "c=10 0.4/-0.2, c=20 0.4/-0.2" in lines[1]
    assert "n/a" in drift_lines([level(2, None)], 19, 14)[0]
    assert "no band" in drift_lines([level(10, drift(2.5, 3.0))], 8, 8)[0]


SIM_METRICS = """\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{engine_type="unified",model_name="default",pp_rank="0",tp_rank="0"} 7.0
sglang:num_queue_reqs{engine_type="unified",model_name="default",pp_rank="0",tp_rank="0"} 2.0
sglang:generation_tokens_total{engine_type="unified",model_name="default",pp_rank="0",tp_rank="0"} 1234.0
sglang:num_requests_total{engine_type="unified",model_name="default",pp_rank="0",tp_rank="0"} 17.0
sglang:num_requests_created{engine_type="unified",model_name="default",pp_rank="0",tp_rank="0"} 1.7e9
sglang:time_to_first_token_seconds_count{engine_type="unified",model_name="default",pp_rank="0",tp_rank="0"} 17.0
"""


def test_a_servers_sample_reads_its_running_queued_and_counters() -> None:
    s = server_sample(SIM_METRICS, 3.0, tick=True)
    assert (s.t, s.running, s.queued, s.inflight, s.generated, s.requests) == (3.0, 7.0, 2.0, 9.0, 1234.0, 17.0)


GROUPED = """\
# HELP specgate_group_mode_switches_total Mode switches by group.
# TYPE specgate_group_mode_switches_total counter
specgate_group_mode{group="group-0"} 1.0
specgate_group_mode{group="group-1"} 0.0
specgate_group_mode_switches_total{group="group-1",to="baseline"} 2.0
specgate_group_mode_switches_total{group="group-1",to="speculative"} 1.0
specgate_routing_mode 1.0
specgate_mode_switches_total{to="baseline"} 9.0
specgate_load 21.0
specgate_load_signal_fallback 0.0
specgate_group_load{group="group-0"} 12.0
specgate_group_load{group="group-1"} 9.0
# HELP specgate_server_inflight Requests in flight from this gateway on each server.
specgate_server_inflight{server="speculative-0"} 3.0
specgate_server_inflight{server="baseline-1"} 2.0
"""
UNGROUPED = """\
# HELP specgate_mode_switches_total Routing mode switches.
# TYPE specgate_mode_switches_total counter
specgate_mode_switches_total{to="baseline"} 2.0
specgate_mode_switches_total{to="speculative"} 1.0
specgate_routing_mode 0.0
"""


def test_specgates_modes_and_switches_by_group() -> None:
    s = gate_sample(GROUPED, ["group-0", "group-1"], 1.0, tick=True)
    assert s.modes == {"group-0": "speculative", "group-1": "baseline"}
    # group-0 has switched never: its labelled counter has no sample yet, and counts 0.
    assert s.switches == {"group-0": 0.0, "group-1": 3.0}
    # Each group's load (the gateway-wide sum is not one), and this replica's own in flight by server.
    assert s.loads == {"group-0": 12.0, "group-1": 9.0}
    assert s.own == {"speculative-0": 3.0, "baseline-1": 2.0}


def test_without_group_metrics_one_group_reads_the_ungrouped_series_and_more_read_none() -> None:
    one = gate_sample(UNGROUPED, ["group-0"], 1.0, tick=True)
    assert one.modes == {"group-0": "baseline"} and one.switches == {"group-0": 3.0}
    two = gate_sample(UNGROUPED, ["group-0", "group-1"], 1.0, tick=True)
    assert two.modes == {} and two.switches is None
    # One group is the gateway's: specgate_load is its load; with more, the sum is no group's.
    pool = gate_sample(UNGROUPED + "specgate_load 7.0\n", ["pool"], 1.0, tick=True)
    assert pool.loads == {"pool": 7.0} and pool.own is None
    assert gate_sample(UNGROUPED + "specgate_load 7.0\n", ["group-0", "group-1"], 1.0, tick=True).loads == {}
    fresh = gate_sample("# HELP specgate_mode_switches_total x\nspecgate_routing_mode 1.0\n", ["group-0"], 0.0, True)
    assert fresh.switches == {"group-0": 0.0}


def args(**overrides: Any) -> argparse.Namespace:
    base: dict[str, Any] = dict(
        topology="paired", groups=2, replicas=3, speculative_servers=2, baseline_servers=2, profile="crossover",
        concurrency=(2, 5), level_s=10.0, settle_s=3.0, time_scale=1.0, spread="request", sequential=False,
        max_tokens=64, seed=0, min_requests=10, scrape_interval_s=None, low_hold_s=2.0, live_gauges=False,
        high=20, low=15, calibration=None, defaults=False,
    )  # fmt: skip
    base.update(overrides)
    return argparse.Namespace(**base)


def test_plan_refuses_what_it_cannot_run() -> None:
    with pytest.raises(ValueError, match="--settle-s"):
        scaleout.plan_of(args(settle_s=10.0))
    with pytest.raises(ValueError, match="go together"):
        scaleout.plan_of(args(low=None))
    with pytest.raises(ValueError, match="--low"):
        scaleout.plan_of(args(high=4, low=5))
    plan, wm = scaleout.plan_of(args(groups=1, high=None, low=None))
    assert wm is None and plan.watermark_scale() == 1  # no watermarks: a pair is calibrated first
    # Pooled: the per-pair watermarks of a calibration are the pool's times the speculative servers.
    assert scaleout.ScaleoutPlan(topology="pooled", speculative_servers=3).watermark_scale() == 3
    plan, wm = scaleout.plan_of(args(groups=1))
    assert plan.group_names() == ["group-0"] and wm is not None and (wm.high, wm.low) == (20, 15)


def test_replicas_get_the_scaled_hold_and_scrape_interval() -> None:
    plan, _ = scaleout.plan_of(args(time_scale=4.0, low_hold_s=2.0, scrape_interval_s=0.8))
    env = scaleout.gate_env(plan, [], 8000, 19, 14)
    assert env["SPECGATE_LOW_WATERMARK_HOLD_S"] == "0.5" and env["SPECGATE_SCRAPE_INTERVAL_S"] == "0.2"
    assert "low-watermark hold 2 s" in scaleout.describe(plan)
    # As a new user has it: specgate's own defaults, scaled to the simulators' clock.
    plan, _ = scaleout.plan_of(args(time_scale=4.0, low_hold_s=2.0, scrape_interval_s=0.8, defaults=True))
    env = scaleout.gate_env(plan, [], 8000, 19, 14)
    hold = Settings.model_fields["low_watermark_hold_s"].default
    assert env["SPECGATE_LOW_WATERMARK_HOLD_S"] == f"{hold / 4:g}" == "0.5"
    assert env["SPECGATE_SCRAPE_INTERVAL_S"] == "0.125"  # the engine signal's default, 0.5 s
    assert "specgate's default scrape interval and hold" in scaleout.describe(plan)


# ---------------------------------------------------------------------------------------------
# Short real runs


def run_cli(out: Path, *extra: str) -> dict[str, Any]:
    cmd = [
        sys.executable, "-m", "loadtest", "scaleout", "--replicas", "2", "--high", "8", "--low", "4",
        "--level-s", "4", "--settle-s", "1.2", "--time-scale", str(TIME_SCALE), "--max-tokens", "32",
        "--min-requests", "3", "--out-dir", str(out), "--quiet", *extra,
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "sg/better" in done.stdout and f"plot: {out / 'scaleout.png'}" in done.stdout
    png = (out / "scaleout.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
    report: dict[str, Any] = orjson.loads((out / "scaleout.json").read_bytes())
    assert report["verdicts"] and isinstance(report["warnings"], list)
    assert "drift m/p95" in done.stdout and report["drift"][0] in done.stdout
    for level in report["levels"]:
        for name, cl in level["configs"].items():
            assert cl["tok_s"] > 0 and cl["stats"]["completed"] > 0, (level["concurrency"], name)
            assert cl["stats"]["errors"] == 0, (level["concurrency"], name, cl["stats"]["error_samples"])
            # The drift is specgate's replicas', read at every round of samples of the scored part.
            drift = cl["drift"]
            if name != "specgate":
                assert drift is None, name
                continue
            assert drift is not None and drift["rounds"] >= 5, (level["concurrency"], drift)
            assert drift["error_samples"] > 0 and drift["error_abs"] >= 0 and drift["gateway_error_abs"] >= 0
            assert 0 <= max(drift["worst_mean"], drift["worst_p95"]) <= drift["level_max"]
    return report


def tokens(level: dict[str, Any], config: str, role: str) -> float:
    by_server = level["configs"][config]["tok_s_by_server"]
    return float(sum(v for name, v in by_server.items() if name.startswith(role)))


def test_paired_groups_behind_replicas(tmp_path: Path) -> None:
    """Two groups behind the replicas."""
    groups = 2
    report = run_cli(tmp_path, "--groups", str(groups), "--concurrency", f"2,{12 * groups}")
    low, high = report["levels"]
    assert [low["concurrency"], high["concurrency"]] == [2, 12 * groups]
    # Measured at the servers: each fixed configuration sent nothing to the other role...
    for level in (low, high):
        assert tokens(level, "all-speculative", "baseline") == 0
        assert tokens(level, "all-baseline", "speculative") == 0
    # ...and specgate, under its watermarks (8 a group) at 1 stream a group, all to speculation; at
    # 12 a group mostly to the baseline. (Not every replica need end the level in baseline mode for
    # every group: load that sloshes between groups can take one down to its low watermark.)
    names = [f"group-{i}" for i in range(groups)]
    assert tokens(low, "specgate", "baseline") == 0
    assert low["configs"]["specgate"]["modes_at_end"] == [dict.fromkeys(names, "speculative")] * 2
    assert all(s == dict.fromkeys(names, 0) for s in low["configs"]["specgate"]["switches"])
    sg = high["configs"]["specgate"]
    assert tokens(high, "specgate", "baseline") > tokens(high, "specgate", "speculative")
    # Every replica reports each group's mode and switch count, and switched at the step.
    assert all(set(m) == set(names) for m in sg["modes_at_end"])
    assert all(s is not None and set(s) == set(names) and sum(s.values()) >= 1 for s in sg["switches"])
    if groups > 1:
        # Both groups worked in every configuration at every level.
        for level in (low, high):
            for cl in level["configs"].values():
                assert set(cl["group_shares"]) == set(names) and min(cl["group_shares"].values()) > 0
                assert cl["split_deviation"] is not None


def test_pooled_servers_behind_replicas(tmp_path: Path) -> None:
    report = run_cli(
        tmp_path, "--topology", "pooled", "--speculative-servers", "2", "--baseline-servers", "2",
        "--concurrency", "2,16",
    )  # fmt: skip
    assert report["settings"]["topology"] == "pooled"
    low, high = report["levels"]
    for level in (low, high):
        assert tokens(level, "all-speculative", "baseline") == 0
        assert tokens(level, "all-baseline", "speculative") == 0
        # Each server of the role in use took work: the replicas spread requests within a role.
        for config, role in (("all-speculative", "speculative"), ("all-baseline", "baseline")):
            per_server = level["configs"][config]["tok_s_by_server"]
            assert all(v > 0 for name, v in per_server.items() if name.startswith(role)), (config, per_server)
    # 16 streams on two servers of a role: neither idle (2.0 would be all of them on one).
    for config, role in (("all-speculative", "speculative"), ("all-baseline", "baseline")):
        x = high["configs"][config]["role_imbalance"][role]
        assert x is not None and 1.0 <= x < 2.0, (config, x)
    # specgate's pool: speculation at 2 streams, mostly the baseline at 16 (watermarks 8 and 4).
    assert tokens(low, "specgate", "baseline") == 0
    assert tokens(high, "specgate", "baseline") > tokens(high, "specgate", "speculative")
    assert all(s is not None and s["pool"] >= 1 for s in high["configs"]["specgate"]["switches"])
