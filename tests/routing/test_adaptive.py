"""The adaptive policy's arithmetic on known inputs: curves, acceptance scaling, observations,
the watermark's rate and clamp, dwell and probes, and the Router that ties them together."""

from __future__ import annotations

import dataclasses
import math

import orjson
import pytest

from loadtest.calibrate import find_crossover, recommend
from proxy.fleet.servers import Health
from proxy.observability.metrics import Metrics
from proxy.policy.adaptive import dwell_mode
from proxy.policy.base import Curves, LoadSnapshot, PolicyConfig, PolicyState, Role, hysteresis_low
from proxy.policy.beliefs import WatermarkState, step_watermark, watermarks
from proxy.policy.calibration import Calibration, Curve
from proxy.policy.crossover import crossing, estimate, held_at_capacity
from proxy.policy.evidence import stream_accept
from proxy.policy.factory import policy_for
from proxy.policy.levelspeeds import MAX_CORRECTION, PRIOR_WEIGHT, Prior, SpeedModel
from proxy.relay.shadow import shadow_body
from proxy.relay.sse import completion_tokens, content_events
from proxy.routing.affinity import Held
from proxy.routing.fleet import Fleet
from proxy.routing.router import Router
from proxy.routing.steps.pipeline import decide

from ..helpers import Clock, adaptive_cfg, policy_cfg, rig

LEVELS = (1, 2, 5, 10, 20, 30, 50, 70)
# The shipped `crossover` profile: equal at 20 streams, speculation ahead below, behind above.
SPEC = (180.0, 330.0, 700.0, 1100.0, 1500.0, 1650.0, 1750.0, 1800.0)
BASE = (100.0, 195.0, 470.0, 880.0, 1500.0, 1950.0, 2500.0, 2800.0)
NAN8 = (math.nan,) * 8


def settle(
    load: int, spec_load: int, state: PolicyState, cfg: PolicyConfig, now: float, fresh: bool, margin: float = 0.0
) -> PolicyState:
    """The mode after the load changed, with no request to place (the router's refresh)."""
    return policy_for(cfg.policy).settle(load, spec_load, state, cfg, now, fresh, margin)[0]


def calibration(accept: float | None = 3.0, tpot: bool = False) -> Calibration:
    def tpots(tok_s: tuple[float, ...]) -> tuple[float, ...]:
        return tuple(1000.0 * c / t for c, t in zip(LEVELS, tok_s, strict=True)) if tpot else NAN8

    return Calibration(
        levels=LEVELS,
        speculative=Curve(SPEC, tpots(SPEC), (accept,) * 8 if accept else ()),
        baseline=Curve(BASE, tpots(BASE)),
        accept_length=accept,
        high_watermark=19,
        low_watermark=14,
        verdict="crosses",
    )


@pytest.mark.parametrize(
    ("spec", "base", "higher"),
    [
        (SPEC, BASE, True),
        (tuple(b * 0.5 for b in BASE), BASE, True),  # never pays
        (tuple(s * 3 for s in SPEC), BASE, True),  # always pays
        ((10.0, 20.0, 30.0, 40.0, 50.0, 60.0, 70.0, 80.0), (12.0, 18.0, 25.0, 40.0, 55.0, 60.0, 90.0, 95.0), False),
    ],
)
def test_crossing_agrees_with_calibrate(spec: tuple[float, ...], base: tuple[float, ...], higher: bool) -> None:
    ours = crossing(LEVELS, spec, base, higher)
    theirs = find_crossover("m", LEVELS, spec, base, higher)
    assert ours.verdict == theirs.verdict
    if theirs.verdict == "crosses":
        assert ours.at == pytest.approx(theirs.at)


def test_at_calibrated_acceptance_the_estimate_is_the_calibrations_recommendation() -> None:
    for tpot in (False, True):
        model = SpeedModel(Prior.of(calibration(tpot=tpot)))
        est = estimate(model, 3.0, now=0.0)
        tp = find_crossover("output_tok_s", LEVELS, SPEC, BASE)
        rec = recommend(tp, tp, max(LEVELS))
        assert est.throughput.verdict == "crosses" and est.crossover == pytest.approx(20.0)
        assert est.high == rec.high == 20
        assert est.speculative_tok_s == pytest.approx(SPEC) and est.baseline_tok_s == pytest.approx(BASE)
    # No live reading at all: as calibrated.
    assert estimate(SpeedModel(Prior.of(calibration())), None, 0.0).high == 20


def test_live_acceptance_scales_the_speculative_curve() -> None:
    model = SpeedModel(Prior.of(calibration(accept=3.0)))
    # Acceptance 4 of 3: the speculative curve x4/3. At 30: 2200 > 1950; at 50: 2333 < 2500.
    up = estimate(model, 4.0, 0.0)
    assert up.speculative_tok_s[5] == pytest.approx(1650 * 4 / 3)
    expected = 30 + 20 * (2200 - 1950) / ((2200 - 1950) - (1750 * 4 / 3 - 2500))
    assert up.crossover == pytest.approx(expected) and up.high == math.floor(expected)
    # Acceptance 1.2: 180 * 0.4 = 72 < 100 at one stream: speculation never pays.
    down = estimate(model, 1.2, 0.0)
    assert down.throughput.verdict == "never_pays" and down.high == 0
    assert "pays at no load" in down.why


def test_a_margin_widens_the_band_around_the_crossover() -> None:
    model = SpeedModel(Prior.of(calibration()))
    plain, wide = estimate(model, 3.0, 0.0), estimate(model, 3.0, 0.0, margin=0.05)
    assert (plain.high, plain.low) == (20, 15) and wide.crossover == plain.crossover == pytest.approx(20)
    # Leave where 1.05 x speculative = baseline (22.6), come back where speculative = 1.05 x baseline
    # (17.0), and never closer than calibrate's quarter band (16).
    assert (wide.high, wide.low) == (22, 16)
    assert "5% margin: leave at 22, come back at 16" in wide.why


def test_tpot_curves_scale_with_the_same_acceptance() -> None:
    model = SpeedModel(Prior.of(calibration(tpot=True)))
    e = estimate(model, 4.0, 0.0)
    # TPOT here is c / tok_s, so it crosses between the same levels (30 and 50), interpolated in
    # TPOT rather than tok/s; the watermark follows the earlier of the two, as calibrate's does.
    assert e.latency.verdict == "crosses" and e.latency.at is not None and e.throughput.at is not None
    assert 30 < e.latency.at < e.throughput.at < 50
    assert e.high == math.floor(e.latency.at) and e.crossover == e.latency.at


def test_observations_correct_their_level_and_its_neighbours_by_how_near() -> None:
    model = SpeedModel(Prior.of(calibration()), half_life_s=60.0)
    # The baseline streams at 30 run at 80% of the calibrated per-stream speed (1950 / 30 = 65).
    for i in range(40):
        model.observe(Role.BASELINE, 30, 0.8 * 65.0, None, now=float(i))
    e = estimate(model, 3.0, now=40.0)
    assert e.baseline_tok_s[5] == pytest.approx(0.8 * 1950, rel=0.03)
    # The levels it was not seen at take the slowdown at sqrt(c_low / c_high) of its weight: with
    # some thirty observations' worth, nearly all of it, against the prior's PRIOR_WEIGHT.
    w = model.correction(Role.BASELINE, 30, 40.0)[1]
    for i, level in ((4, 20), (6, 50), (0, 1)):
        s = math.sqrt(min(level, 30) / max(level, 30))
        expected = 0.8 ** (s * w / (s * w + PRIOR_WEIGHT))
        assert e.baseline_tok_s[i] == pytest.approx(BASE[i] * expected, rel=1e-3)
    assert e.baseline_tok_s[0] > 0.8 * BASE[0] * 1.01  # far off, a little less of it
    # The other server is not moved.
    assert e.speculative_tok_s == pytest.approx(SPEC)


def test_a_load_between_levels_is_judged_by_the_calibrations_throughput_there() -> None:
    model = SpeedModel(Prior.of(calibration()))
    # The baseline's throughput at 60 streams, halfway between 50 and 70, is 2650 tok/s: 44.2 a
    # stream. (A line between the levels' per-stream speeds, 50 and 40, would expect 45.)
    for i in range(40):
        model.observe(Role.BASELINE, 60, 2650.0 / 60, None, now=float(i))
    for level in (50, 70):
        assert model.correction(Role.BASELINE, level, 40.0)[0] == pytest.approx(0.0, abs=1e-9)
    # Past the last level, throughput stays where it was: a stream at 140 runs at 2800 / 140.
    model.observe(Role.BASELINE, 140, 20.0, None, now=41.0)
    assert model.correction(Role.BASELINE, 70, 41.0)[0] == pytest.approx(0.0, abs=1e-9)


def test_an_outlier_moves_little_and_corrections_are_bounded() -> None:
    model = SpeedModel(Prior.of(calibration()))
    model.observe(Role.BASELINE, 10, 88.0, None, now=0.0)  # exactly as calibrated
    model.observe(Role.BASELINE, 10, 88.0 * 100, None, now=0.0)  # a 100x outlier
    ratio = math.exp(model.correction(Role.BASELINE, 10, 0.0)[0])
    assert 1.0 < ratio < 1.2
    for i in range(500):
        model.observe(Role.BASELINE, 10, 88.0 * 100, None, now=float(i))
    assert math.exp(model.correction(Role.BASELINE, 10, 500.0)[0]) == pytest.approx(MAX_CORRECTION)


def test_observations_fade_back_to_the_calibration() -> None:
    model = SpeedModel(Prior.of(calibration()), half_life_s=10.0)
    for i in range(30):
        model.observe(Role.BASELINE, 10, 44.0, None, now=float(i))
    fresh = math.exp(model.correction(Role.BASELINE, 10, 30.0)[0])
    old = math.exp(model.correction(Role.BASELINE, 10, 130.0)[0])
    assert fresh < 0.6 and 0.95 < old <= 1.0


def test_speculative_observations_are_per_unit_of_acceptance() -> None:
    model = SpeedModel(Prior.of(calibration(accept=3.0)))
    # Seen at acceptance 1.5, running at half the calibrated speed: exactly what acceptance explains.
    for i in range(20):
        model.observe(Role.SPECULATIVE, 10, 110.0 / 2, 1.5, now=float(i))
    assert model.correction(Role.SPECULATIVE, 10, 20.0)[0] == pytest.approx(0.0, abs=1e-9)


def test_without_calibration_nothing_is_concluded_until_both_servers_are_seen() -> None:
    model = SpeedModel(None)
    assert estimate(model, 2.0, 0.0).high is None
    for i in range(5):
        for load, spec_v, base_v in ((4, 60.0, 50.0), (8, 40.0, 45.0)):
            model.observe(Role.SPECULATIVE, load, spec_v * 2.0, 2.0, now=float(i))
            model.observe(Role.BASELINE, load, base_v, None, now=float(i))
    e = estimate(model, 2.0, 5.0)
    # 4 streams: 4*60*2=480 vs 200; 8 streams: 8*40*2=640 vs 360: pays wherever seen, so the
    # watermark may go one level past the highest seen (10), to see the baseline there.
    assert e.throughput.verdict == "always_pays" and e.high == 10
    # Acceptance fell to a quarter: 120 vs 200 at 4 streams, the lowest seen. Below 4 nothing is
    # known: the watermark goes to the level under it, not to 0.
    e = estimate(model, 0.5, 5.0)
    assert e.throughput.verdict == "never_pays" and e.high == 3 and e.crossover == 3


def test_watermark_moves_at_a_bounded_rate_inside_its_range() -> None:
    s = WatermarkState(20.0, 15.0, 0.0)
    s = step_watermark(s, (0, 0), 1.0, max_step_per_s=4.0, lo=2, hi=40)
    assert s.high == pytest.approx(16.0) and s.low == pytest.approx(11.0)
    s = step_watermark(s, (0, 0), 10.0, 4.0, 2, 40)
    assert (s.high, s.low) == (2.0, 2.0)  # clamped at the floor
    s = step_watermark(s, (100, 90), 100.0, 4.0, 2, 40)
    assert (s.high, s.low) == (40.0, 40.0)
    # The low watermark stays at least a quarter below the high one.
    assert watermarks(WatermarkState(19.6, 19.0, 0)) == (20, hysteresis_low(20)) == (20, 15)
    assert watermarks(WatermarkState(20.0, 11.0, 0)) == (20, 11)


ADAPTIVE = policy_cfg("adaptive", 10, 7, min_dwell_s=5.0, probe_s=4.0, probe_max_s=10.0, probe_max_load=50)


def snap(spec: int, base: int, now: float, idle_since: float | None, spec_up: bool = True) -> LoadSnapshot:
    return LoadSnapshot(
        {Role.SPECULATIVE: spec, Role.BASELINE: base},
        {},
        {Role.SPECULATIVE: spec_up, Role.BASELINE: True},
        now,
        idle_since,
    )


def test_dwell_holds_a_switch_until_the_mode_is_old_enough() -> None:
    state = PolicyState(Role.SPECULATIVE, since=0.0)
    d = decide(snap(12, 0, 3.0, None), state, ADAPTIVE)
    assert (d.backend, d.reason, d.state.mode) == ("speculative", "dwell_hold", "speculative")
    d = decide(snap(12, 0, 5.0, None), state, ADAPTIVE)
    assert (d.backend, d.reason, d.state.mode, d.state.since) == ("baseline", "heavy_load", "baseline", 5.0)
    # And back: the load fell to low, but the baseline mode is 1 s old.
    held, was_held = dwell_mode(3, d.state, ADAPTIVE, 6.0)
    assert held.mode == "baseline" and was_held
    assert dwell_mode(3, d.state, ADAPTIVE, 10.0)[0].mode == "speculative"
    # Past the speculative pool's capacity the load is not wandering about a watermark: its
    # requests queue for memory and its cache is evicted. The switch goes at once.
    full = dataclasses.replace(ADAPTIVE, capacity=12)
    d = decide(snap(12, 0, 3.0, None), state, full)
    assert (d.backend, d.reason, d.state.mode, d.state.since) == ("baseline", "heavy_load", "baseline", 3.0)
    assert decide(snap(11, 0, 3.0, None), state, dataclasses.replace(full, high_watermark=11)).reason == "dwell_hold"
    # The threshold policy has no dwell: exactly as before.
    t = decide(snap(12, 0, 0.1, None), PolicyState(Role.SPECULATIVE, since=0.0), policy_cfg("threshold", 10, 7))
    assert (t.backend, t.reason) == ("baseline", "heavy_load")


# The servers tie at 20 streams; the baseline gives 1.5x at 40, speculation 1.25x at 10.
TIE_AT_20 = Curves((10.0, 20.0, 40.0), (1000.0, 1500.0, 1600.0), (800.0, 1500.0, 2400.0))


def test_a_paired_switch_waits_until_its_gain_pays_for_the_re_prefill() -> None:
    cfg = policy_cfg("adaptive", 20, 15, curves=TIE_AT_20)
    spec = PolicyState(Role.SPECULATIVE)
    # At the tie a switch that must gain 10% to win back its re-prefill waits on speculation.
    d = decide(snap(20, 0, 0.0, None)._replace(switch_margin=0.1), spec, cfg)
    assert (d.backend, d.reason, d.state.mode) == ("speculative", "switch_cost", "speculative")
    # The baseline 1.5x ahead at 40: worth it.
    d = decide(snap(40, 0, 0.0, None)._replace(switch_margin=0.1), spec, cfg)
    assert (d.backend, d.reason, d.state.mode) == ("baseline", "heavy_load", "baseline")
    # Not priced (no tokens held, or no curves): the watermark alone decides, as before.
    assert decide(snap(20, 0, 0.0, None), spec, cfg).reason == "heavy_load"
    no_curves = dataclasses.replace(cfg, curves=None)
    assert decide(snap(20, 0, 0.0, None)._replace(switch_margin=0.1), spec, no_curves).reason == "heavy_load"
    # And back to speculation, with no request to place: 1.25x at 10 streams pays 20%, not 30%.
    base = PolicyState(Role.BASELINE)
    assert settle(10, 0, base, cfg, 0.0, True, 0.3).mode == "baseline"
    assert settle(10, 0, base, cfg, 0.0, True, 0.2).mode == "speculative"
    # A held switch leaves the dwell's clock alone: it goes the moment it pays.
    held, why = dwell_mode(20, spec, cfg, 0.0, switch_margin=0.1)
    assert (held, why) == (spec, "switch_cost")
    # Speculation's KV pool full at 20 streams (its watermark capped there): staying would
    # re-prefill what it evicts at every turn, so the switch is not held for its cost.
    full = dataclasses.replace(cfg, capacity=20)
    assert decide(snap(20, 0, 0.0, None)._replace(switch_margin=0.6), spec, full).reason == "heavy_load"


def test_curves_give_a_switch_gain_between_and_beyond_their_levels() -> None:
    assert TIE_AT_20.gain(Role.BASELINE, 30.0) == pytest.approx(1950 / 1550 - 1)
    assert TIE_AT_20.gain(Role.SPECULATIVE, 5.0) == pytest.approx(0.25)  # flat below the first level
    assert TIE_AT_20.gain(Role.BASELINE, 80.0) == pytest.approx(0.5)  # and above the last
    assert Curves((1.0,), (0.0,), (5.0,)).gain(Role.BASELINE, 1.0) == math.inf  # nothing to lose
    # With TPOT curves, the better of the two gains: the watermarks follow the earlier crossing.
    tpot = TIE_AT_20._replace(speculative_tpot=(10.0, 20.0, 40.0), baseline_tpot=(12.0, 16.0, 20.0))
    assert tpot.gain(Role.BASELINE, 20.0) == pytest.approx(20 / 16 - 1)
    assert tpot.gain(Role.BASELINE, 40.0) == pytest.approx(1.0)
    assert tpot.gain(Role.SPECULATIVE, 10.0) == pytest.approx(0.25)


@pytest.mark.parametrize(
    ("topology", "prefill", "margin"),
    [("paired", 1000.0, 0.2), ("paired", 0.0, 0.0), ("pooled", 1000.0, 0.0)],
)
def test_a_router_prices_a_switch_by_the_tokens_its_group_holds(topology: str, prefill: float, margin: float) -> None:
    r = rig(topology=topology)
    policy = policy_cfg("adaptive", 16, 8)
    adaptive = adaptive_cfg(margin=0.0, prefill_tok_s=prefill, half_life_s=10.0)
    (router,) = Fleet(r.topology, r.servers, policy, r.metrics, adaptive, calibration(), clock=Clock()).routers
    assert router.snapshot().switch_margin == 0
    lease = router.admit(Role.SPECULATIVE, tokens=1500)
    other = router.admit(Role.BASELINE, tokens=500)
    # 2,000 tokens over 1,000 tok/s of prefill times a 10 s half-life: a switch must gain 20%.
    assert router.snapshot().switch_margin == pytest.approx(margin)
    assert (router.cfg.curves is not None) == (margin > 0)
    lease.release()
    assert router.snapshot().switch_margin == pytest.approx(margin / 4)
    other.release()


def test_probes_go_to_the_idle_speculative_server_at_doubling_intervals() -> None:
    state = PolicyState(Role.BASELINE, since=0.0)
    assert decide(snap(0, 12, 3.9, 0.0), state, ADAPTIVE).reason == "heavy_load"
    d = decide(snap(0, 12, 4.0, 0.0), state, ADAPTIVE)
    assert (d.backend, d.reason, d.state.mode, d.state.probes) == ("speculative", "probe", "baseline", 1)
    assert d.state.probing
    # A session goes on, one request at a time, until the Router ends it (enough tokens back).
    assert decide(snap(1, 11, 4.5, None), d.state, ADAPTIVE).reason == "heavy_load"
    more = decide(snap(0, 12, 5.0, 5.0), d.state, ADAPTIVE)
    assert (more.reason, more.state.probes) == ("probe", 1)
    ended = dataclasses.replace(more.state, probing=False)
    # The session ended at 6: the next waits 8 s from then, the one after 10 (the cap).
    assert decide(snap(0, 12, 13.9, 6.0), ended, ADAPTIVE).reason == "heavy_load"
    d2 = decide(snap(0, 12, 14.0, 6.0), ended, ADAPTIVE)
    assert d2.reason == "probe" and d2.state.probes == 2
    ended2 = dataclasses.replace(d2.state, probing=False)
    assert decide(snap(0, 12, 25.9, 16.0), ended2, ADAPTIVE).reason == "heavy_load"
    assert decide(snap(0, 12, 26.0, 16.0), ended2, ADAPTIVE).reason == "probe"
    # No probe while the speculative server has requests, is down, or past probe_max_load.
    assert decide(snap(1, 12, 100.0, None), state, ADAPTIVE).reason == "heavy_load"
    assert decide(snap(0, 12, 100.0, 0.0, spec_up=False), state, ADAPTIVE).reason == "heavy_load"
    assert decide(snap(0, 50, 100.0, 0.0), state, ADAPTIVE).reason == "heavy_load"
    # Nor above the highest low watermark the speculative pool's capacity leaves, max(low,
    # hysteresis_low(capacity)): no acceptance brings speculation back there, and on a shared GPU
    # the probe's prefill stalls the baseline's batch for nothing. 12 streams fit: back at 9 at most.
    capped = dataclasses.replace(ADAPTIVE, high_watermark=8, low_watermark=6, capacity=12)
    assert hysteresis_low(12) == 9
    assert decide(snap(0, 12, 100.0, 0.0), state, capped).reason == "heavy_load"
    assert decide(snap(0, 10, 100.0, 0.0), state, capped).reason == "heavy_load"
    assert decide(snap(0, 9, 100.0, 0.0), state, capped).reason == "probe"
    # A low watermark set above that band still gets its probes up to it.
    wide = dataclasses.replace(capped, low_watermark=10)
    assert decide(snap(0, 10, 100.0, 0.0), state, wide).reason == "probe"
    # A new mode starts the count again.
    assert PolicyState(Role.SPECULATIVE, since=1.0).probes == 0


def test_no_return_to_speculation_on_a_stale_acceptance_reading() -> None:
    state = PolicyState(Role.BASELINE, since=0.0)
    # The load fell to the low watermark, but the speculative server has been idle for 60 s:
    # what the watermarks say of it is old. A probe session first, the mode held.
    d = decide(snap(0, 5, 60.0, 0.0), state, ADAPTIVE)
    assert (d.backend, d.reason, d.state.mode, d.state.probing) == ("speculative", "probe", "baseline", True)
    # Fresh (it had traffic 5 s ago): the switch goes through.
    d = decide(snap(0, 5, 60.0, 55.0), state, ADAPTIVE)
    assert (d.backend, d.reason, d.state.mode) == ("speculative", "light_load", "speculative")
    # With probes off nothing else would re-measure it: the switch goes through.
    no_probes = dataclasses.replace(ADAPTIVE, probe_s=0.0)
    d = decide(snap(0, 5, 60.0, 0.0), state, no_probes)
    assert (d.backend, d.reason, d.state.mode) == ("speculative", "light_load", "speculative")


def router(cal: Calibration | None, clock: Clock, **cfg: float) -> tuple[Router, dict[str, Health], Metrics]:
    """One pair's router under the adaptive policy, both servers up, acceptance 3 read."""
    r = rig()
    health = r.health
    health["speculative"].spec_accept_length = 3.0
    policy = policy_cfg("adaptive", 16, 8, min_dwell_s=2.0, probe_s=0.0, probe_max_load=70)
    adaptive = adaptive_cfg(**{"margin": 0.0, **cfg})
    (router,) = Fleet(r.topology, r.servers, policy, r.metrics, adaptive, cal, clock=clock).routers
    return router, health, r.metrics


def test_router_ends_a_probe_session_once_enough_tokens_came_back() -> None:
    clock = Clock()
    r, _, _ = router(calibration(), clock, probe_tokens=100)
    r.cfg = dataclasses.replace(r.cfg, high_watermark=0, low_watermark=0, probe_s=5.0, probe_max_s=5.0)
    assert r.decide().reason == "heavy_load"  # high watermark 0: the baseline
    clock.t += 6  # the speculative server idle for 6 s: a session starts
    first = r.decide()
    assert (first.backend, first.reason) == ("speculative", "probe")
    lease = r.admit(Role.SPECULATIVE)
    assert r.decide().backend == "baseline"  # one probe at a time
    r.note_output(Role.SPECULATIVE, 60)
    lease.release()
    assert r.decide().reason == "probe"  # 60 of 100 tokens: the session goes on
    r.note_output(Role.SPECULATIVE, 60)
    assert not r.state.probing and r.decide().reason == "heavy_load"
    # Probes that bring no usage back (errors) end the session after a few requests.
    clock.t += 60
    reasons = []
    for _ in range(6):
        d = r.decide()
        reasons.append(d.reason)
        if d.backend == "speculative":
            r.admit(Role.SPECULATIVE).release()  # a probe that failed: no usage
    assert reasons == ["probe"] * 4 + ["heavy_load"] * 2


def gauge(metrics: Metrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    assert value is not None
    return value


# A sweep whose speculative server ran its KV pool dry at 256 streams (measured on the simulated
# H200 pair at 1k tokens: throughput fell from 3,102 to 1,649 tok/s and TPOT rose from 16 to 72 ms).
DRY_LEVELS = (4, 16, 64, 256)
DRY_SPEC = (400.0, 1250.0, 3100.0, 1650.0)
DRY_BASE = (290.0, 1000.0, 2600.0, 4450.0)


def dry_calibration() -> Calibration:
    def tpots(tok_s: tuple[float, ...]) -> tuple[float, ...]:
        return tuple(1000.0 * c / t for c, t in zip(DRY_LEVELS, tok_s, strict=True))

    return Calibration(
        levels=DRY_LEVELS,
        speculative=Curve(DRY_SPEC, tpots(DRY_SPEC), (2.0,) * 4),
        baseline=Curve(DRY_BASE, tpots(DRY_BASE)),
        accept_length=2.0,
        high_watermark=93,
        low_watermark=69,
        verdict="crosses",
    )


def step_line(c: float) -> float:
    """The speculative step time (s per token of throughput) run on through 16 and 64 streams."""
    s16, s64 = 16 / DRY_SPEC[1], 64 / DRY_SPEC[2]
    return s64 + (s64 - s16) / 48 * (c - 64)


def test_a_level_whose_throughput_falls_ran_the_pool_dry_and_says_nothing_below_it() -> None:
    e = estimate(SpeedModel(Prior.of(dry_calibration())), 2.0, 0.0)
    # 256 left out: past 64 the speculative curve is flat at 3,100, which the baseline's line from
    # 2,600 to 4,450 reaches at 64 + 192 * 500 / 1,850. Interpolating toward 1,650 gave 93.1.
    assert e.speculative_tok_s == pytest.approx((400.0, 1250.0, 3100.0, 3100.0))
    assert e.baseline_tok_s == pytest.approx(DRY_BASE)
    assert e.crossover == pytest.approx(64 + 192 * 500 / 1850)
    # Its TPOT goes with it (72 ms there): flat past 64, as the step time is.
    assert e.speculative_tpot[3] == pytest.approx(e.speculative_tpot[2])


def test_a_server_holds_what_its_pool_holds_and_its_curve_runs_on_to_the_cap() -> None:
    tpot = tuple(1000.0 * c / t for c, t in zip(DRY_LEVELS, DRY_SPEC, strict=True))
    grid = (4, 16, 64, 150, 256)
    x, t = held_at_capacity(DRY_LEVELS, DRY_SPEC, tpot, 150, grid)
    # Up to the last level kept as measured; to the cap on the step time's line through 16 and 64;
    # past the cap, what it does at the cap.
    assert x[:3] == pytest.approx(DRY_SPEC[:3])
    assert x[3] == pytest.approx(150 / step_line(150)) and x[4] == x[3]
    assert t[3] == pytest.approx(tpot[2] * step_line(150) / step_line(64)) and t[4] == t[3]
    # A cap under the highest level kept: interpolated up to it, flat past it.
    x, _ = held_at_capacity(DRY_LEVELS, DRY_SPEC, tpot, 40, (16, 40, 64))
    assert x == pytest.approx((1250.0, 1250 + 1850 * 24 / 48, 1250 + 1850 * 24 / 48))
    # One level kept: throughput flat past it; a cap under the lowest level: its per-stream speed.
    x, _ = held_at_capacity((4, 16), (400.0, 300.0), (10.0, 53.0), 12, (4, 12, 16))
    assert x == pytest.approx((400.0, 400.0, 400.0))
    x, t = held_at_capacity(DRY_LEVELS, DRY_SPEC, tpot, 2, (2, 4))
    assert x == pytest.approx((200.0, 200.0)) and t == pytest.approx((tpot[0], tpot[0]))
    # No cap known: the curve as measured, levels that ran dry left out.
    x, _ = held_at_capacity(DRY_LEVELS, DRY_SPEC, tpot, None, (64, 150, 256))
    assert x == pytest.approx((3100.0, 3100.0, 3100.0))


def test_a_router_reads_each_servers_cap_from_its_pool_and_the_context_its_streams_hold() -> None:
    clock = Clock()
    # The footprint as it is (test_a_paired_groups_cap_is_read_where_the_footprints_growth_takes_it).
    r, health, _ = router(dry_calibration(), clock, margin=0.1, min_watermark=0, max_watermark=256, kv_forecast_s=0)
    health["speculative"].spec_accept_length = 2.0
    before = r.adaptive.estimate if r.adaptive else None
    assert before is not None and before.levels == DRY_LEVELS
    health["speculative"].engine_kv_capacity = 150_000
    health["baseline"].engine_kv_capacity = 277_000
    leases = []
    for _ in range(4):
        clock.t += 1  # the estimate is re-made at most every UPDATE_EVERY_S
        leases.append(r.admit(Role.SPECULATIVE, tokens=1000))
    # 1,000 tokens a stream: 150 streams on the speculative server, 277 on the baseline.
    a = r.adaptive
    assert a is not None and a.caps == {Role.SPECULATIVE: 150, Role.BASELINE: 277}
    e = a.estimate
    assert e.levels == (4, 16, 64, 150, 256)
    assert e.speculative_tok_s[3] == pytest.approx(150 / step_line(150))
    # The speculative server ahead up to its cap (4,323 against 3,407 tok/s): the watermark is the
    # pool's (150), not the crossing of a curve run through the level that ran dry (93).
    assert e.crossover is not None and e.crossover > 150
    assert r.policy_cfg().high_watermark == 150
    assert a.describe(clock.t)["kv_capacity_streams"] == {"speculative": 150, "baseline": 277}
    # Nothing in flight: the last reading stands.
    for lease in leases:
        lease.release()
    clock.t += 1
    r.refresh()
    assert a.caps == {Role.SPECULATIVE: 150, Role.BASELINE: 277}


def test_router_follows_live_acceptance_at_a_bounded_rate() -> None:
    clock = Clock()
    r, health, metrics = router(calibration(), clock, max_step_per_s=2.0, min_watermark=0, max_watermark=60)
    assert (r.cfg.high_watermark, r.cfg.low_watermark) == (20, 15)  # the calibration's, from the start
    assert gauge(metrics, "specgate_crossover_estimate") == pytest.approx(20.0)
    health["speculative"].spec_accept_length = 1.2  # diverse traffic: never pays
    highs = []
    for _ in range(12):
        clock.t += 1.0
        r.refresh()
        highs.append(r.cfg.high_watermark)
    assert highs[:3] == [18, 16, 14] and highs[-1] == 0  # 2 streams a second, down to 0
    assert gauge(metrics, "specgate_watermark", level="high") == 0
    assert gauge(metrics, "specgate_crossover_estimate") == 0
    # Everything now goes to the baseline; the mode changed once.
    assert r.decide().backend == "baseline"
    assert gauge(metrics, "specgate_mode_switches_total", to="baseline") == 1
    info = r.adaptive.describe(clock.t) if r.adaptive else {}
    assert info["accept_length_live"] == 1.2 and info["watermarks"] == {"high": 0, "low": 0}


def test_router_without_calibration_keeps_the_static_watermarks_until_it_knows() -> None:
    clock = Clock()
    r, _, _ = router(None, clock)
    clock.t += 5
    r.refresh()
    assert (r.cfg.high_watermark, r.cfg.low_watermark) == (16, 8)
    assert r.adaptive is not None and "static watermarks" in r.adaptive.estimate.why


def test_a_changed_acceptance_reading_restarts_the_probes_back_off() -> None:
    clock = Clock()
    r, health, _ = router(calibration(), clock)
    held = [r.admit(Role.BASELINE) for _ in range(30)]  # above the high watermark: baseline mode
    assert r.state.mode == "baseline"
    r.state = dataclasses.replace(r.state, probes=3)
    health["speculative"].spec_accept_length = 3.05  # within 10% of the last: no news
    clock.t += 1
    r.refresh()
    assert r.state.probes == 3
    health["speculative"].spec_accept_length = 1.6  # the traffic is changing
    clock.t += 1
    r.refresh()
    assert r.state.probes == 0 and len(held) == 30


# A stream as SGLang writes it: role chunk, one content chunk per decode step, finish, usage, done.
def sglang_stream(steps: list[str], kind: str = "content") -> bytes:
    def event(delta: str, finish: str = "null") -> bytes:
        return b'data: {"id":"x","choices":[{"index":0,"delta":%s,"finish_reason":%s}]}\n\n' % (
            delta.encode(),
            finish.encode(),
        )

    out = [event('{"role":"assistant","content":""}')]
    out += [event(f'{{"{kind}":"{text}"}}') for text in steps]
    out.append(event('{"content":""}', '"length"'))
    out.append(b'data: {"id":"x","choices":[],"usage":{"prompt_tokens":5,"completion_tokens":16}}\n\n')
    out.append(b"data: [DONE]\n\n")
    return b"".join(out)


def test_a_streams_acceptance_is_its_tokens_over_its_decode_steps() -> None:
    body = sglang_stream(["one", " two three four five", " six seven eight nine", " ten"])
    assert content_events(body) == 4  # not the role, finish or usage chunk, nor [DONE]
    # A reasoning model's steps count as steps; the completions API's `text` too.
    assert content_events(sglang_stream(["a", "b c"], kind="reasoning_content")) == 2
    assert content_events(b'data: {"choices":[{"text":"ab","index":0}]}\n\ndata: {"choices":[{"text":""}]}\n\n') == 1
    assert completion_tokens(body) == 16
    assert completion_tokens(b"data: [DONE]\n\n") is None
    # SGLang: the first token from prefill, then steps of 4, the last cut: 1 + 4 + 4 + 4 + 3 tokens.
    assert stream_accept(16, 5) == pytest.approx(3.75)
    assert stream_accept(16, 16) == 1.0  # no speculation, or nothing accepted: exact
    assert stream_accept(9, 3) is None  # too few steps to say
    assert stream_accept(3, 5) is None  # fewer tokens than steps: not one event per step


def test_a_shadow_is_the_request_capped_streamed_and_single() -> None:
    body = orjson.dumps(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "temperature": 0.7,
            "max_completion_tokens": 900,
            "n": 3,
            "stream": False,
            "stream_options": {"include_usage": False},
        }
    )
    copy = orjson.loads(shadow_body(body, 16) or b"")
    assert copy == {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "temperature": 0.7,  # sampling decides what is accepted: kept
        "max_tokens": 16,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    assert shadow_body(b"[1, 2]", 16) is None and shadow_body(b"{", 16) is None


SHADOW = dataclasses.replace(ADAPTIVE, probe_shadow=True)


def test_a_shadow_probe_leaves_the_request_where_the_mode_sends_it() -> None:
    state = PolicyState(Role.BASELINE, since=0.0)
    assert not decide(snap(0, 12, 3.9, 0.0), state, SHADOW).shadow
    d = decide(snap(0, 12, 4.0, 0.0), state, SHADOW)
    assert (d.backend, d.reason, d.shadow) == ("baseline", "heavy_load", True)
    assert d.state.probes == 1 and not d.state.probing  # a session of one
    # The next waits twice as long, from when the speculative server was last busy (the shadow).
    assert not decide(snap(0, 12, 12.9, 5.0), d.state, SHADOW).shadow
    assert decide(snap(0, 12, 13.0, 5.0), d.state, SHADOW).shadow
    # Not while the shadow (or anything) runs there, nor when it is down.
    assert not decide(snap(1, 12, 100.0, None), state, SHADOW).shadow
    assert not decide(snap(0, 12, 100.0, 0.0, spec_up=False), state, SHADOW).shadow
    # A stale reading holds a return to speculation and asks for a shadow instead of a request.
    d = decide(snap(0, 5, 60.0, 0.0), state, SHADOW)
    assert (d.backend, d.reason, d.state.mode, d.shadow, d.state.probing) == (
        "baseline",
        "dwell_hold",
        "baseline",
        True,
        False,
    )
    # Fresh after it: the switch goes through.
    d = decide(snap(0, 5, 61.0, 60.5), d.state, SHADOW)
    assert (d.backend, d.reason, d.shadow) == ("speculative", "light_load", False)


def test_router_reads_acceptance_from_probe_streams_while_fresh() -> None:
    clock = Clock()
    r, health, _ = router(calibration(), clock)
    spec = health["speculative"]
    spec.engine = "sglang"
    assert r.learning.accept_live(clock.t) == (3.0, "live")
    r.note_shadow(61, 17)  # (61 - 1) / (17 - 1) tokens a step
    assert r.learning.accept_live(clock.t) == (3.75, "from probe streams")
    assert r.adaptive is not None and r.adaptive.estimate.accept_live == 3.75
    assert "3.75 from probe streams" in r.adaptive.estimate.why
    clock.t += r.cfg.accept_fresh_s + 0.1  # then the engine's own reading again
    assert r.learning.accept_live(clock.t) == (3.0, "live")
    # llama-server sends an event per token: its streams say nothing of acceptance.
    spec.engine = "llamacpp"
    r.note_shadow(61, 17)
    assert r.learning.accept_live(clock.t) == (3.0, "live")


def test_router_pools_a_request_probe_sessions_streams() -> None:
    clock = Clock()
    r, health, _ = router(calibration(), clock, probe_tokens=100)
    health["speculative"].engine = "vllm"
    r.cfg = dataclasses.replace(r.cfg, high_watermark=0, low_watermark=0, probe_s=5.0, probe_max_s=5.0)
    assert r.decide().reason == "heavy_load"
    clock.t += 6
    assert r.decide().reason == "probe"
    r.note_output(Role.SPECULATIVE, 64, 64)  # a diverse prompt: 1 token a step
    assert r.learning.accept_live(clock.t)[0] == 1.0
    r.note_output(Role.SPECULATIVE, 64, 17)  # a repetitive one: ~4 a step; pooled by steps
    pooled = 128 / (64 + 64 / (63 / 16))
    assert r.learning.accept_live(clock.t)[0] == pytest.approx(pooled)
    # A model list or embeddings says nothing of acceptance: never a probe.
    r.state = dataclasses.replace(r.state, probing=False)
    clock.t += 60
    assert r.decide(can_probe=False).reason == "heavy_load"
    assert r.decide().reason == "probe"


def test_a_routers_watermarks_are_capped_to_what_the_speculative_kv_pool_holds() -> None:
    r = rig()
    clock = Clock()
    policy = policy_cfg("adaptive", 16, 8)
    adaptive = adaptive_cfg(kv_forecast_s=0)  # the footprint as it is: the next test forecasts it
    (router,) = Fleet(r.topology, r.servers, policy, r.metrics, adaptive, clock=clock).routers
    r.health["speculative"].engine_kv_capacity = 10_000
    leases = []
    for _ in range(4):
        clock.t += 1  # the capacity is re-read at most every UPDATE_EVERY_S
        leases.append(router.admit(Role.SPECULATIVE, tokens=1000))
    # 10,000 tokens of pool over 1,000 a stream: 10 streams, the low watermark a quarter below.
    assert router.kv.kv_streams == 10
    cfg = router.policy_cfg()
    assert (cfg.high_watermark, cfg.low_watermark, cfg.capacity) == (10, 7, 10)
    assert router.cfg.high_watermark == 16  # the configured ones stand
    assert router.policy_cfg() is cfg  # built once for as long as it holds
    # What operators see: the capacity and the watermarks in effect, capped.
    assert gauge(r.metrics, "specgate_group_kv_capacity_streams", group="group-0") == 10
    assert gauge(r.metrics, "specgate_group_watermark", group="group-0", level="high") == 10
    assert gauge(r.metrics, "specgate_watermark", level="high") == 10
    for _ in range(6):
        assert router.decide().backend == Role.SPECULATIVE
        clock.t += 1
        leases.append(router.admit(Role.SPECULATIVE, tokens=1000))
    d = router.decide()
    assert (d.backend, d.reason) == (Role.BASELINE, "heavy_load")
    # Past the pool with speculation still paying (16 > 10), the conversations cached on the
    # speculative server go to the baseline too, where the mode says (they are prefilled there
    # once; kept on speculation, the two servers would time-slice the GPU while they last).
    leases += [router.admit(Role.BASELINE, tokens=1000) for _ in range(4)]
    for lease in leases[:3]:
        lease.release()
    leases = leases[3:]
    clock.t += 1
    router.refresh()
    assert router.kv.kv_streams == 10 and router.loads.role_count(Role.SPECULATIVE) == 7
    d = router.decide(held=Role.SPECULATIVE)
    assert (d.backend, d.reason, d.state.mode) == (Role.BASELINE, "heavy_load", Role.BASELINE)
    assert router.decide().backend == router.decide(held=Role.BASELINE).backend == Role.BASELINE
    # A pool's size unknown, or nothing in flight to size a stream by: the watermarks as configured.
    for lease in leases:
        clock.t += 1
        lease.release()
    assert router.kv.capacity() is None and router.policy_cfg() is router.cfg
    # threshold routes by its watermarks as configured.
    (plain,) = Fleet(r.topology, r.servers, policy_cfg("threshold", 16, 8), r.metrics, clock=clock).routers
    plain.kv.kv_streams = 10
    assert plain.policy_cfg() is plain.cfg


def test_the_pools_capacity_is_told_above_the_high_watermark_too() -> None:
    r = rig()
    clock = Clock()
    adaptive = adaptive_cfg(kv_forecast_s=0)
    (router,) = Fleet(r.topology, r.servers, policy_cfg("adaptive", 16, 8), r.metrics, adaptive, clock=clock).routers
    r.health["speculative"].engine_kv_capacity = 20_000
    clock.t += 1
    lease = router.admit(Role.SPECULATIVE, tokens=1000)
    # 20 streams of 1,000 tokens: above the high watermark (16), which stands; the capacity is told,
    # so that no probe goes out past it and a class's own high watermark is capped to it.
    cfg = router.policy_cfg()
    assert (cfg.high_watermark, cfg.low_watermark, cfg.capacity) == (16, 8, 20)
    assert router.policy_cfg() is cfg
    lease.release()


@pytest.mark.parametrize(("topology", "forecast_s", "forecast"), [("paired", 10.0, True), ("paired", 0.0, False),
                                                                   ("pooled", 10.0, False)])  # fmt: skip
def test_a_paired_groups_cap_is_read_where_the_footprints_growth_takes_it(
    topology: str, forecast_s: float, forecast: bool
) -> None:
    r = rig(topology=topology)
    clock = Clock()
    adaptive = adaptive_cfg(kv_forecast_s=forecast_s)
    (router,) = Fleet(r.topology, r.servers, policy_cfg("adaptive", 64, 48), r.metrics, adaptive, clock=clock).routers
    r.health["speculative"].engine_kv_capacity = 100_000
    # Conversations opening one every half second, 5,000 tokens each: the footprint climbs
    # 10,000 tokens a second, and 10 s on it is 100,000 tokens more than the 20,000 it is.
    leases = []
    for _ in range(4):
        clock.t += 0.5
        leases.append(router.admit(Role.SPECULATIVE, tokens=5000))
    if forecast:
        # 100,000 tokens over (20,000 + 100,000) for 4 streams: 3, under the 4 in flight.
        assert router.kv.kv_streams == 3
        d = router.decide()
        assert (d.backend, d.reason) == (Role.BASELINE, "heavy_load")
        assert router.kv.footprint is not None and router.kv.footprint.rate() == pytest.approx(10_000)
    else:
        assert router.kv.footprint is None
        assert router.kv.kv_streams == 20  # 100,000 over 5,000 a stream
        assert router.decide().backend == Role.SPECULATIVE
    # The climb over, the footprint level for a span: read as it is.
    for _ in range(50):
        clock.t += 0.25
        router.refresh()
    assert router.kv.kv_streams == 20
    # Past half the pool, a climb is read as it is: a switch there would save at most half the
    # re-prefill, and a climb that stops short of the cap would cost a switch and a return.
    for _ in range(8):
        clock.t += 0.5
        leases.append(router.admit(Role.SPECULATIVE, tokens=5000))
    # 60,000 tokens in 12 streams: read ahead, (60,000 + 100,000) would give 7.
    assert router.kv.kv_streams == 20
    assert router.decide().backend == Role.SPECULATIVE
    for lease in leases:
        lease.release()


def test_the_pools_capacity_leaves_room_for_each_conversations_next_turn() -> None:
    r = rig()
    clock = Clock()
    adaptive = adaptive_cfg(kv_forecast_s=0)
    fleet = Fleet(r.topology, r.servers, policy_cfg("adaptive", 64, 48), r.metrics, adaptive, clock=clock)
    (router,) = fleet.routers
    r.health["speculative"].engine_kv_capacity = 60_000
    leases = []
    for _ in range(4):
        clock.t += 1
        leases.append(router.admit(Role.SPECULATIVE, tokens=1000))
    assert router.kv.kv_streams == 60 and router.kv.turn_growth == 0  # no conversation came back yet
    # Turns of known conversations: each resends its last turn's 1,000 tokens and adds 2,000, then
    # 4,000 (the mean, 3,000); one cut short counts as adding nothing.
    fleet.decide(held=Held("speculative", 1000), prompt_tokens=3000)
    fleet.decide(held=Held("speculative", 1000), prompt_tokens=5000)
    assert router.kv.turn_growth == 3000
    fleet.decide(held=Held("speculative", 5000), prompt_tokens=2000)
    assert router.kv.turn_growth == 2000
    fleet.decide(held=None, prompt_tokens=9000)  # a new conversation: no growth to read
    fleet.decide(held=Held("speculative", 1000))  # no prompt estimate
    assert router.kv.turn_growth == 2000
    clock.t += 1
    router.refresh()
    # 60,000 tokens of pool over 1,000 a stream and 2,000 to come: 20 streams, not 60.
    assert router.kv.kv_streams == 20 and router.kv.capacity() == 20
    assert router.policy_cfg().high_watermark == 20
    # The mean stays bounded to the last GROWTH_TURNS turns.
    for _ in range(500):
        fleet.decide(held=Held("speculative", 1000), prompt_tokens=1500)
    assert router.kv.turn_growth == pytest.approx(500, abs=1)
    for lease in leases:
        lease.release()


def test_a_full_baseline_spills_until_what_was_sent_fills_the_speculative_pool_between_readings() -> None:
    r = rig()
    clock = Clock()
    # A high watermark of 0: the mode is the baseline's, whatever the load.
    (router,) = Fleet(
        r.topology, r.servers, policy_cfg("adaptive", 0, 0), r.metrics, adaptive_cfg(), clock=clock
    ).routers
    spec, base = r.health["speculative"], r.health["baseline"]
    spec.engine_kv_usage, spec.engine_kv_capacity = 0.10, 100_000
    base.engine_kv_usage = 0.95
    d = router.decide()
    assert (d.backend, d.reason, d.state.mode) == (Role.SPECULATIVE, "kv_spill", Role.BASELINE)
    assert router.kv_used(Role.SPECULATIVE) == (0.10, 0.10)
    # The engine's reading stands between scrapes; what went there since counts: 60,000 tokens
    # over the pool's 100,000 is at the room a new conversation needs.
    leases = [router.admit(Role.SPECULATIVE, tokens=15_000) for _ in range(4)]
    assert router.kv_used(Role.SPECULATIVE) == (0.6, 0.6)
    assert router.decide().reason == "heavy_load"
    # A conversation spilled already stays with its cache while the pool is under the spill's mark.
    assert router.decide(held=Role.SPECULATIVE).reason == "kv_spill"
    # One cached on the baseline waits there; a batch request never spills.
    assert router.decide(held=Role.BASELINE).reason == "heavy_load"
    assert router.decide(batch=True).reason == "batch"
    for lease in leases:
        lease.release()
    assert router.decide().reason == "kv_spill"
    # The baseline with room, or its reading gone: no spill.
    base.engine_kv_usage = 0.5
    assert router.decide().reason == "heavy_load"
    base.engine_kv_usage = None
    assert router.kv_used(Role.BASELINE) is None and router.decide().reason == "heavy_load"
    assert r.metrics.decisions.value("speculative", "kv_spill") == 3


def test_the_pools_a_spill_reads_are_the_servers_that_are_up() -> None:
    r = rig(
        topology="pooled",
        speculative_url="http://127.0.0.1:30001",
        baseline_url="http://127.0.0.1:30002,http://127.0.0.1:30003",
    )
    (router,) = Fleet(
        r.topology, r.servers, policy_cfg("adaptive", 0, 0), r.metrics, adaptive_cfg(), clock=Clock()
    ).routers
    names = router.group.of(Role.BASELINE)
    r.health[names[0]].engine_kv_usage, r.health[names[1]].engine_kv_usage = 0.95, 0.40
    assert router.kv_used(Role.BASELINE) == (0.40, 0.95)
    # One baseline server with room: no spill, the role's placement has somewhere to put it.
    r.health["speculative"].engine_kv_usage = 0.0
    assert router.decide().reason == "heavy_load"
    # That one down: the role is full.
    r.health[names[1]].healthy = False
    assert router.kv_used(Role.BASELINE) == (0.95, 0.95)
    assert router.decide().reason == "kv_spill"
    r.health[names[0]].healthy = False  # none up: unknown (only_healthy decides)
    assert router.kv_used(Role.BASELINE) is None
