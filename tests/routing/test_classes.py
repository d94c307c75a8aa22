"""Traffic classes: acceptance learnt per class from its speculative responses, and where speculation
has room for only part of the traffic, the classes that gain most from it get it (proxy/routing/classes.py,
policy.class_choice)."""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import web

from loadtest.procs import free_port
from proxy.policy.base import ClassView, Decision, PolicyState, PoolGains, Role, marginal_gain
from proxy.policy.beliefs import UPDATE_EVERY_S
from proxy.policy.calibration import ModelFit, StepFit
from proxy.routing.classes import (
    CLASS_HALF_LIFE_S,
    MIN_STEPS,
    NAME_CHARS,
    OTHER,
    RANK_EVERY_S,
    ClassBook,
    class_of,
)
from proxy.routing.fleet import Fleet
from proxy.routing.router import Router
from proxy.routing.steps.classes import class_choice

from ..helpers import Clock, adaptive_cfg, policy_cfg, rig, wait_until
from ..inprocess import Gateway, StartGateway
from .test_adaptive import LEVELS, SPEC, calibration
from .test_adaptive_stack import FAST, calibration_file

UP = {Role.SPECULATIVE: True, Role.BASELINE: True}
YES, NO = ClassView(True), ClassView(False)
VARIED = " ".join(f"word{i} means thing{i * 7 % 13}" for i in range(60))
REPEATED = "copy this line exactly as it is. " * 40


# ---------------------------------------------------------------------------------------------
# Units


def test_what_names_a_requests_class() -> None:
    body = {"user": "alice", "model": "llama"}
    assert class_of("header", b"code", body, b"") == "code"
    assert class_of("header", None, body, b"") is None
    assert class_of("header", b"x" * 500, body, b"") == "x" * NAME_CHARS
    assert class_of("header", b'a"b\\c\x01', body, b"") == "a_b_c_"
    assert class_of("user", None, body, b"") == "alice"
    assert class_of("model", None, body, b"") == "llama"
    assert class_of("model", None, {"model": 3}, b"") is None
    key = class_of("api_key", None, body, b"Bearer sk-secret")
    assert key is not None and key.startswith("key-") and "secret" not in key
    assert class_of("api_key", None, body, b"") is None
    assert class_of("none", b"code", body, b"Bearer k") is None


def test_the_book_is_bounded_learns_and_forgets() -> None:
    book = ClassBook(2, half_life_s=10.0)
    assert (book.tracked("a", 0.0), book.tracked("b", 0.0), book.tracked("c", 0.0)) == ("a", "b", OTHER)
    assert set(book.stats) == {"a", "b", OTHER}  # a full book pools the rest
    # Acceptance counts once a class has MIN_STEPS decode steps.
    book.measured("a", 3 * (MIN_STEPS - 1), MIN_STEPS - 1, 0.0)
    assert book.accept("a") is None
    book.measured("a", 3, 1, 0.0)
    assert book.accept("a") == 3.0
    book.measured("b", 13 * MIN_STEPS // 10, MIN_STEPS, 0.0)
    assert book.accept("b") == pytest.approx(1.3, abs=0.05)
    # Equal traffic: the better class gains most, the other not.
    assert (book.gains_most("a", 0.0), book.gains_most("b", 0.0)) == (True, False)
    # Most of the traffic the weaker class's: the better one still goes first.
    for _ in range(3):
        book.tracked("b", 0.0)
    assert (book.gains_most("a", 0.0), book.gains_most("b", 0.0)) == (True, False)
    # ...and where the better class is most of the traffic, the weaker one never gains most.
    for _ in range(6):
        book.tracked("a", 0.0)
    assert book.ranked(0.0) == {"a": True, "b": False}
    # Long after, `b` has faded and makes room for a new class, its series to be dropped.
    later = 10.0 * 20
    book.tracked("a", later)
    assert book.tracked("c", later) == "c" and book.take_forgotten() == ["b"]
    assert book.take_forgotten() == []


def test_a_class_the_calibration_measured_is_known_from_its_first_request() -> None:
    book = ClassBook(2, priors={"code": 3.0, "chat": 1.3, OTHER: 2.0})
    assert book.stats == {}  # a class named in the file takes no room before it is seen
    book.tracked("chat", 0.0)
    assert book.accept("chat") == 1.3 and book.gains_most("chat", 0.0) is None  # one class known: no rank
    book.tracked("code", 0.0)
    assert book.ranked(0.0) == {"code": True, "chat": False}
    # They take no room from the others; once those fill it, the pooled rest have no prior,
    # whatever the file says.
    assert (book.tracked("a", 0.0), book.tracked("b", 0.0)) == ("a", "b")
    assert book.tracked("prose", 0.0) == OTHER and book.accept(OTHER) is None
    # The prior fades as evidence does: still known a half-life on, unknown after it without
    # live evidence.
    assert book.describe(CLASS_HALF_LIFE_S)["chat"]["accept_length"] == 1.3
    assert book.describe(CLASS_HALF_LIFE_S + 1)["chat"]["accept_length"] is None
    # A few streams of live evidence outweigh it.
    fresh = ClassBook(2, priors={"chat": 1.3})
    fresh.tracked("chat", 0.0)
    for _ in range(3):
        fresh.measured("chat", 256, 128, 0.0)  # 2.0 a step
    a = fresh.accept("chat")
    assert a is not None and 1.8 < a < 2.0
    # A class the file does not name is learnt as before.
    fresh.tracked("new", 0.0)
    assert fresh.accept("new") is None


def _junk(book: ClassBook, names: range, now: float, prefix: str = "junk") -> None:
    for i in names:
        book.tracked(f"{prefix}-{i}", now)


def test_names_sent_once_do_not_keep_a_real_class_out() -> None:
    book = ClassBook(32)
    _junk(book, range(32), 0.0)
    assert len(book.stats) == 32 and book.take_forgotten() == []
    # A second later a class with traffic comes: its own name by its second request, taking the
    # place of one of the names seen once (whose series go).
    seen = [book.tracked("real", 1.0), book.tracked("real", 2.0)]
    assert seen == [OTHER, "real"]
    (gone,) = book.take_forgotten()
    assert gone.startswith("junk-") and gone not in book.stats and "real" in book.stats
    # Its requests while it waited moved from `other` to it.
    assert book.stats["real"].traffic == pytest.approx(2.0, abs=0.01)
    assert book.stats[OTHER].traffic == pytest.approx(0.0, abs=1e-9)


def test_a_class_the_calibration_names_is_tracked_whatever_else_fills_the_book() -> None:
    book = ClassBook(32, priors={"code": 3.0, "chat": 1.3})
    _junk(book, range(1000), 0.0)
    for _ in range(50):  # junk with more traffic than any class the file names
        _junk(book, range(32), 0.0, prefix="loud")
    assert book.tracked("code", 1.0) == "code" and book.accept("code") == 3.0
    assert book.tracked("chat", 1.0) == "chat" and book.accept("chat") == 1.3
    assert book.ranked(1.0)["code"] is True
    # Nothing displaces them, and they take no room from the rest.
    _junk(book, range(1000), 2.0, prefix="later")
    assert {"code", "chat"} <= set(book.stats)
    assert len(book.stats) == 32 + 2 + 1 and "code" not in book.take_forgotten()


def test_a_class_with_steady_traffic_is_not_displaced_by_a_flood_of_names_sent_once() -> None:
    book = ClassBook(32)
    _junk(book, range(32), 0.0)
    # For ten minutes a new name five times a second, a class every 2 s, and from 100 s on a
    # second class as steady.
    steady, late = [], []
    for step in range(1, 3001):
        t = step * 0.2
        book.tracked(f"flood-{step}", t)
        if step % 10 == 0:
            steady.append(book.tracked("steady", t))
            if t >= 100.0:
                late.append(book.tracked("late", t))
        assert not {"steady", "late"} & set(book.take_forgotten())
    assert steady[0] == OTHER and set(steady[1:]) == {"steady"}
    assert late[0] == OTHER and set(late[1:]) == {"late"}
    assert len(book.stats) <= 32 + 1


def test_a_class_seen_once_gives_its_place_to_one_with_steady_traffic() -> None:
    book = ClassBook(1)
    assert book.tracked("once", 0.0) == "once"
    seen = [book.tracked("steady", 10.0 + 2 * i) for i in range(5)]
    assert seen == [OTHER, "steady", "steady", "steady", "steady"]
    assert book.take_forgotten() == ["once"]
    # Back once, it has less traffic than the class in its place: `other`.
    assert book.tracked("once", 20.0) == OTHER and book.take_forgotten() == []


def test_the_book_stays_bounded_under_many_names() -> None:
    book = ClassBook(8, priors={"a": 2.0, "b": 2.0, "c": 2.0})
    for i in range(100_000):
        now = i * 0.01
        book.tracked(f"n{i}", now)
        if i % 7 == 0:
            book.tracked(f"repeat{i % 50}", now)
        if i % 1000 == 0:
            book.tracked("abc"[i // 1000 % 3], now)
        book.take_forgotten()
    assert len(book.stats) <= 8 + 3 + 1 and {"a", "b", "c"} <= set(book.stats)
    assert len(book.candidates) <= 2 * 8


def test_without_a_speed_model_a_pools_classes_are_ranked_below_the_high_watermark() -> None:
    cfg = policy_cfg(high=8, low=2)
    state = PolicyState(Role.SPECULATIVE)
    light = Decision(Role.SPECULATIVE, "light_load", state, 1)
    yielded = class_choice(light, NO, cfg, UP, pooled=True)
    assert (yielded.backend, yielded.reason, yielded.state) == (Role.BASELINE, "class", state)
    assert class_choice(light, YES, cfg, UP, pooled=True).backend == Role.SPECULATIVE
    assert class_choice(light, ClassView(None), cfg, UP, pooled=True) is light  # rank unknown
    heavy = Decision(Role.BASELINE, "heavy_load", PolicyState(Role.BASELINE), 8)
    assert class_choice(heavy, YES, cfg, UP, pooled=True) is heavy  # no room for anyone
    for reason in ("probe", "batch", "only_healthy", "affinity", "stored_response"):
        d = Decision(Role.SPECULATIVE, reason, state, 5)
        assert class_choice(d, NO, cfg, UP, pooled=True) is d
    assert class_choice(light, NO, cfg, {**UP, Role.BASELINE: False}, pooled=True) is light
    assert class_choice(light, NO, policy_cfg("spillover", high=8, low=2), UP, pooled=True) is light
    # A pair shares one GPU: classes never split it, at any load.
    band = Decision(Role.SPECULATIVE, "light_load", state, 5)
    assert class_choice(band, NO, cfg, UP, pooled=False) is band


def test_a_pools_class_with_watermarks_of_its_own_keeps_speculation_as_long_as_it_pays() -> None:
    cfg = policy_cfg(high=20, low=15)  # the group's, at the traffic's acceptance
    spec, base = PolicyState(Role.SPECULATIVE), PolicyState(Role.BASELINE)
    weak, strong = ClassView(False, 4, 3), ClassView(True, 60, 45)  # e.g. acceptance 1.3 and 3.0

    def at(load: int, mode: PolicyState = spec) -> Decision:
        return Decision(mode.mode, "light_load" if mode is spec else "heavy_load", mode, load)

    def pooled(d: Decision, view: ClassView, s: int, held: Role | None = None) -> Decision:
        return class_choice(d, view, cfg, UP, pooled=True, spec_load=s, held=held)

    # By the speculative pool's own load S: the weak class leaves speculation early, the strong one
    # keeps it past the group's high watermark, and leaves it past its own.
    assert pooled(at(2), weak, 1).backend == Role.SPECULATIVE
    d = pooled(at(6), weak, 4)
    assert (d.backend, d.reason, d.state) == (Role.BASELINE, "class", spec)
    d = pooled(at(90, base), strong, 40)
    assert (d.backend, d.reason, d.state) == (Role.SPECULATIVE, "class", base)
    assert pooled(at(90, base), strong, 60).backend == Role.BASELINE
    # Between its own watermarks a conversation stays on the role holding its cache.
    held = pooled(at(70, base), strong, 50, held=Role.BASELINE)
    assert (held.backend, held.reason) == (Role.BASELINE, "affinity")
    assert pooled(at(70, base), strong, 44, held=Role.BASELINE).backend == Role.SPECULATIVE
    assert pooled(at(70, base), strong, 60, held=Role.SPECULATIVE).backend == Role.BASELINE
    # Between them with nothing cached, a new conversation starts where the class's rank points:
    # one that gains least on the baseline, where the next rise would send it, the others on speculation.
    for gains, role in ((False, Role.BASELINE), (True, Role.SPECULATIVE), (None, Role.SPECULATIVE)):
        d = pooled(at(12), ClassView(gains, 10, 2), 5)
        assert (d.backend, d.reason) == (role, "class")
    d = pooled(at(12), ClassView(False, 10, 2), 5, held=Role.SPECULATIVE)
    assert (d.backend, d.reason) == (Role.SPECULATIVE, "affinity")
    assert pooled(at(12), ClassView(False, 10, 2), 2).backend == Role.SPECULATIVE  # at its low: room for it
    # The other role down, a probe, spillover, a pair: the decision stands.
    assert class_choice(at(6), weak, cfg, {**UP, Role.BASELINE: False}, pooled=True, spec_load=4) == at(6)
    probe = Decision(Role.SPECULATIVE, "probe", spec, 30)
    assert pooled(probe, weak, 30) is probe
    assert class_choice(at(6), weak, policy_cfg("spillover", high=20, low=15), UP, True, 4) == at(6)
    assert class_choice(at(30), weak, cfg, UP, pooled=False, spec_load=30) == at(30)
    # The speculative pool's KV capacity caps the strong class's own watermark too.
    full = policy_cfg(high=20, low=15, capacity=30)
    assert class_choice(at(90, base), strong, full, UP, pooled=True, spec_load=29).backend == Role.SPECULATIVE
    d = class_choice(at(90, base), strong, full, UP, pooled=True, spec_load=30)
    assert (d.backend, d.reason) == (Role.BASELINE, "class")


def test_a_streams_gain_is_its_tokens_less_what_it_slows_the_others_by() -> None:
    # 4 streams accepting 2 tokens a step at 10 steps a second each, 9 each with a fifth of 3.
    assert marginal_gain(3.0, 4, 2.0, 10.0, 9.0) == 3.0 * 9.0 - 4 * 2.0 * 1.0
    assert marginal_gain(1.0, 0, 1.0, 10.0, 10.0) == 10.0  # an idle server: the stream's own speed
    # Where throughput is flat, one more stream adds nothing.
    assert marginal_gain(1.0, 100, 1.0, 1.0, 100 / 101) == pytest.approx(0.0)


def test_a_pools_class_goes_where_the_pool_gains_most() -> None:
    cfg = policy_cfg("adaptive", high=20, low=15)
    spec = PolicyState(Role.SPECULATIVE)
    light = Decision(Role.SPECULATIVE, "light_load", spec, 6)
    view = ClassView(False, 20, 15, 1.3)  # its watermarks alone would keep it on speculation
    # Each role's gain with the stream, and its own speed there (tokens/s).
    gains = PoolGains(190.0, 229.0, 250.0, 229.0)

    def pooled(g: PoolGains = gains, s: int = 5, held: Role | None = None, cached: int = 0, c: Any = cfg) -> Decision:
        return class_choice(light, view, c, UP, True, s, held, g, cached)

    d = pooled()
    assert (d.backend, d.reason, d.state, d.load) == (Role.BASELINE, "class", spec, 6)
    assert pooled(PoolGains(300.0, 229.0, 400.0, 229.0)).backend == Role.SPECULATIVE
    assert pooled(PoolGains(229.0, 229.0, 300.0, 229.0)).backend == Role.SPECULATIVE  # a tie
    # A conversation stays on the role holding its cache unless the other gains more than
    # slack * (cached / 1000) of its own speed there: 39 > 1 * 0.15 * 250, 39 <= 1 * 0.16 * 250.
    assert pooled(held=Role.SPECULATIVE, cached=150).backend == Role.BASELINE
    d = pooled(held=Role.SPECULATIVE, cached=160)
    assert (d.backend, d.reason) == (Role.SPECULATIVE, "affinity")
    loose = policy_cfg("adaptive", high=20, low=15, affinity_slack=0.5)
    assert pooled(held=Role.SPECULATIVE, cached=160, c=loose).backend == Role.BASELINE
    assert pooled(held=Role.BASELINE, cached=10_000).reason == "class"  # held where it gains most anyway
    # The speculative pool full: the baseline, whatever the gains or the cache.
    full = policy_cfg("adaptive", high=20, low=15, capacity=5)
    strong = PoolGains(900.0, 1.0, 900.0, 1.0)
    d = pooled(strong, s=5, held=Role.SPECULATIVE, cached=10_000, c=full)
    assert (d.backend, d.reason) == (Role.BASELINE, "class")
    assert pooled(strong, s=4, c=full).backend == Role.SPECULATIVE
    # The held role down: no affinity; the choice down: the decision stands.
    d = class_choice(light, view, cfg, {**UP, Role.SPECULATIVE: False}, True, 5, Role.SPECULATIVE, gains, 10_000)
    assert (d.backend, d.reason) == (Role.BASELINE, "class")
    assert class_choice(light, view, cfg, {**UP, Role.BASELINE: False}, True, 5, None, gains) is light
    # A probe, spillover, a pair: the decision stands.
    probe = Decision(Role.SPECULATIVE, "probe", spec, 6)
    assert class_choice(probe, view, cfg, UP, True, 5, None, gains) is probe
    assert class_choice(light, view, policy_cfg("spillover", high=20, low=15), UP, True, 5, None, gains) is light
    assert class_choice(light, view, cfg, UP, False, 5, None, gains) is light


def test_a_pools_classes_are_placed_by_the_calibrations_curves_and_the_load_on_each_role() -> None:
    r = rig(topology="pooled")
    r.health["speculative"].spec_accept_length = 3.0
    policy = policy_cfg("adaptive", 16, 8, probe_s=0.0)
    adaptive = adaptive_cfg(margin=0.0, min_watermark=0, max_watermark=60)
    (router,) = Fleet(r.topology, r.servers, policy, r.metrics, adaptive, calibration(), clock=Clock()).routers
    weak, strong = router.class_pricing.view(False, 1.2), router.class_pricing.view(True, 3.0)
    assert strong.low is not None and strong.low >= 5  # its own watermarks keep it on speculation at 5
    # Both idle: per the curves a stream of 1.2 makes 1.2 * 60 tokens/s on speculation and 100 on
    # the baseline, one of 3.0 makes 180.
    assert router.pool_gains(1.2) == pytest.approx(PoolGains(72.0, 100.0, 72.0, 100.0))
    assert router.decide(klass=weak)[:2] == (Role.BASELINE, "class")
    assert router.decide(klass=strong)[:2] == (Role.SPECULATIVE, "class")
    # With 5 streams on speculation a sixth adds 130 tokens/s of its own but slows the five by 50,
    # where the idle baseline adds 100: it goes there, though speculation still pays at 6 streams.
    leases = [router.admit(Role.SPECULATIVE) for _ in range(5)]
    g = router.pool_gains(3.0)
    assert g is not None and g.speculative == pytest.approx(3 * 260 / 6 - 5 * 3 * (700 / 15 - 260 / 6))
    assert router.decide(klass=strong)[:2] == (Role.BASELINE, "class")
    # A conversation cached there stays: moving it gains 20 tokens/s, its 8k tokens are worth 8
    # streams' speed. One of 100 tokens does not.
    d = router.decide(held=Role.SPECULATIVE, klass=strong, cached_tokens=8000)
    assert (d.backend, d.reason) == (Role.SPECULATIVE, "affinity")
    assert router.decide(held=Role.SPECULATIVE, klass=strong, cached_tokens=100).backend == Role.BASELINE
    for lease in leases:
        lease.release()
    # In a pair, or without a calibration: no gains, the watermarks' rule.
    paired = rig()
    (pair,) = Fleet(paired.topology, paired.servers, policy, paired.metrics, adaptive, calibration()).routers
    assert pair.pool_gains(3.0) is None
    (blind,) = Fleet(r.topology, r.servers, policy, r.metrics, adaptive, None, clock=Clock()).routers
    assert blind.pool_gains(3.0) is None


def test_under_the_model_policy_a_pools_gains_are_the_fitted_step_times_not_corrected_live() -> None:
    r = rig(topology="pooled")
    r.health["speculative"].spec_accept_length = 3.0
    fit = ModelFit(StepFit(0.012, 1e-4, 0.0), StepFit(0.006, 1e-4, 0.0), (1000, 4000), 128, 3.0)
    cal = dataclasses.replace(calibration(), model=fit)
    policy = policy_cfg("model", 16, 8, probe_s=0.0)
    (router,) = Fleet(r.topology, r.servers, policy, r.metrics, adaptive_cfg(), cal, clock=Clock()).routers
    assert router.speed is not None
    # A step of n streams takes a + b * n: with 10 on speculation, a stream there steps 1 / 0.013
    # times a second, 1 / 0.0131 with one more; the idle baseline 1 / 0.0061.
    leases = [router.admit(Role.SPECULATIVE) for _ in range(10)]
    v10, v11, base = 1 / 0.013, 1 / 0.0131, 1 / 0.0061
    expected = PoolGains(3.0 * v11 - 10 * 3.0 * (v10 - v11), base, 3.0 * v11, base)
    assert router.pool_gains(3.0) == pytest.approx(expected)
    assert router.decide(klass=router.class_pricing.view(True, 3.0))[:2] == (Role.SPECULATIVE, "class")
    assert router.decide(klass=router.class_pricing.view(False, 1.3))[:2] == (Role.BASELINE, "class")
    # Streams read at half the speculative server's fitted speed correct its watermarks, not the
    # gains: the baseline's speed, never read while speculation runs, would be compared uncorrected.
    for _ in range(40):
        router.observe(Role.SPECULATIVE, 10, 0.5 * 3.0 * v10, 10 * 1000.0, 3.0)
    assert router.speed.corrections[Role.SPECULATIVE].k > 1.2
    assert router.pool_gains(3.0) == pytest.approx(expected)
    for lease in leases:
        lease.release()


def test_the_model_policy_solves_at_the_acceptance_read_at_most_every_update() -> None:
    clock = Clock()
    r = rig()
    r.health["speculative"].spec_accept_length = 3.0
    fit = ModelFit(StepFit(0.012, 1e-4, 0.0), StepFit(0.006, 1e-4, 0.0), (1000, 4000), 128, 3.0)
    cal = dataclasses.replace(calibration(), model=fit)
    policy = policy_cfg("model", 16, 8, probe_s=0.0)
    (router,) = Fleet(r.topology, r.servers, policy, r.metrics, adaptive_cfg(), cal, clock=clock).routers
    assert router.speed is not None and router.speed.accept == 3.0
    before = router.cfg.high_watermark
    # The engine's gauge falls: every request and lease solves again, at the acceptance read last
    # (reading it is most of a decision's cost), until the next read is due.
    r.health["speculative"].spec_accept_length = 1.5
    router.decide()
    assert router.speed.accept == 3.0 and router.cfg.high_watermark == before
    clock.t += UPDATE_EVERY_S
    router.decide()
    assert (router.speed.accept, router.speed.accept_source) == (1.5, "live")
    assert router.cfg.high_watermark < before


def test_under_the_model_policy_what_a_class_is_told_follows_the_context_and_the_corrections() -> None:
    r = rig(topology="pooled")
    r.health["speculative"].spec_accept_length = 3.0
    fit = ModelFit(StepFit(0.012, 1e-3, 1e-7), StepFit(0.006, 1e-4, 1e-7), (1000, 4000), 128, 3.0)
    cal = dataclasses.replace(calibration(), model=fit)
    policy = policy_cfg("model", 16, 8, probe_s=0.0)
    adaptive = adaptive_cfg(min_watermark=0, max_watermark=200)
    (router,) = Fleet(r.topology, r.servers, policy, r.metrics, adaptive, cal, clock=Clock()).routers
    assert router.speed is not None
    short = (router.pool_gains(3.0, (4, 4)), router.class_pricing.view(True, 3.0))
    # Four streams of 20,000 tokens: each step reads 2 ms more KV a stream; both are told anew.
    leases = [router.admit(Role.SPECULATIVE, tokens=20_000) for _ in range(4)]
    assert router.speed.context == pytest.approx(20_000)
    long = (router.pool_gains(3.0, (4, 4)), router.class_pricing.view(True, 3.0))
    t = 20_000.0
    assert long[0] is not None and long[0].speed_baseline == pytest.approx(1 / fit.baseline.step_s(5, 5 * t))
    assert short[0] is not None and long[0].speed_baseline < short[0].speed_baseline
    assert long[1] != short[1]
    # Streams read at half the speculative server's fitted speed move its correction: the class's
    # watermarks are solved again at it (the gains are not, pool_gains' rule).
    for _ in range(40):
        router.observe(Role.SPECULATIVE, 4, 0.5 * 3.0 / fit.speculative.step_s(4, 4 * t), 4 * t, 3.0)
    corrected = router.class_pricing.view(True, 3.0)
    assert corrected.high is not None and long[1].high is not None and corrected.high < long[1].high
    for lease in leases:
        lease.release()


def test_the_model_policy_spreads_a_roles_load_over_its_servers_that_are_up() -> None:
    r = rig(
        topology="pooled",
        speculative_url="s0=http://127.0.0.1:9",
        baseline_url="b0=http://127.0.0.1:10,b1=http://127.0.0.1:11",
    )
    r.health["s0"].spec_accept_length = 3.0
    fit = ModelFit(StepFit(0.012, 1e-3, 0.0), StepFit(0.006, 1e-4, 0.0), (1000, 4000), 128, 3.0)
    cal = dataclasses.replace(calibration(), model=fit)
    policy = policy_cfg("model", 16, 8, probe_s=0.0)
    adaptive = adaptive_cfg(min_watermark=0, max_watermark=200)
    fleet = Fleet(r.topology, r.servers, policy, r.metrics, adaptive, cal, clock=Clock())
    (router,) = fleet.routers
    assert router.speed is not None and router.speed.servers[Role.BASELINE] == 2
    both = (router.speed.crossover, router.cfg.high_watermark, router.class_pricing.view(True, 3.0))
    gains = router.pool_gains(3.0, (1, 4))
    # One baseline server down (health's on_change refreshes the fleet): the same load on the one
    # left is a batch twice the size, slower a stream, so speculation pays to more streams, the
    # group's and a class's.
    r.health["b1"].healthy = False
    router.refresh()  # a lease taken or released: health is not counted again
    assert router.speed.servers[Role.BASELINE] == 2
    fleet.refresh()
    assert router.speed.describe()["servers_up"] == {Role.SPECULATIVE: 1, Role.BASELINE: 1}
    crossover = math.inf if router.speed.crossover is None else router.speed.crossover  # None: every load
    assert both[0] is not None and crossover > both[0]
    assert router.cfg.high_watermark > both[1]
    one = router.class_pricing.view(True, 3.0)
    assert one.high is not None and both[2].high is not None and one.high > both[2].high
    # A class's gains too (kept between asks, forgotten when health changes): the baseline's four
    # streams on one server, not two each, step slower.
    alone = router.pool_gains(3.0, (1, 4))
    assert gains is not None and alone is not None and alone.speed_baseline < gains.speed_baseline
    assert alone.speculative == pytest.approx(gains.speculative)
    # Both down: the role's load is read as spread over all of them again, for when they return.
    r.health["b0"].healthy = False
    fleet.refresh()
    assert router.speed.servers[Role.BASELINE] == 2
    r.health["b0"].healthy = r.health["b1"].healthy = True
    fleet.refresh()
    assert (router.speed.crossover, router.cfg.high_watermark, router.class_pricing.view(True, 3.0)) == both
    assert router.pool_gains(3.0, (1, 4)) == gains


def test_a_classs_watermarks_are_the_groups_curves_at_its_acceptance() -> None:
    clock = Clock()
    r = rig(topology="pooled")
    r.health["speculative"].spec_accept_length = 3.0
    policy = policy_cfg("adaptive", 16, 8, min_dwell_s=2.0, probe_s=0.0, probe_max_load=70)
    adaptive = adaptive_cfg(margin=0.0, min_watermark=0, max_watermark=60)
    (router,) = Fleet(r.topology, r.servers, policy, r.metrics, adaptive, calibration(), clock=clock).routers
    assert (router.cfg.high_watermark, router.cfg.low_watermark) == (20, 15)  # at the live 3.0
    assert router.class_pricing.view(True, 3.0) == ClassView(True, 20, 15, 3.0)
    assert router.class_pricing.view(False, 1.2) == ClassView(False, 0, 0, 1.2)  # never pays at 1.2
    strong = router.class_pricing.view(True, 6.0)
    assert strong.high == 60 and strong.low is not None and strong.low < 60  # pays to the top level, clamped
    assert router.class_pricing.view(None, None) == ClassView(None)  # acceptance not known yet
    leases = [router.admit(Role.SPECULATIVE) for _ in range(17)]
    weak = router.decide(klass=router.class_pricing.view(False, 1.2))
    assert (weak.backend, weak.reason) == (Role.BASELINE, "class")
    assert router.decide(klass=strong).backend == Role.SPECULATIVE
    leases += [router.admit(Role.BASELINE) for _ in range(8)]  # 25: past the group's high watermark
    assert router.decide().reason == "heavy_load"
    d = router.decide(klass=strong)
    assert (d.backend, d.reason) == (Role.SPECULATIVE, "class")
    # The watermarks of a class follow the estimate: a fall in the speculative server's measured
    # speed moves them down.
    for _ in range(40):
        router.observe(Role.SPECULATIVE, 20, 5.0)
        clock.t += 0.3
    lower = router.class_pricing.view(True, 6.0)
    assert lower.high is not None and lower.high < 60
    for lease in leases:
        lease.release()
    # Under the threshold policy there is no model of speed: the ranked rule.
    (plain,) = Fleet(r.topology, r.servers, policy_cfg(high=16, low=8), r.metrics).routers
    assert plain.class_pricing.view(True, 3.0) == ClassView(True, accept=3.0)


# ---------------------------------------------------------------------------------------------
# In-process: two classes through the gateway


async def _ask(gw: Gateway, cls: str, prompt: str, stream: bool = True) -> tuple[str, str]:
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 64, "stream": stream}
    r = await gw.client.post("/v1/chat/completions", json=body, headers={"x-specgate-class": cls})
    assert r.status_code == 200, r.text
    return r.headers["x-specgate-backend"], r.headers["x-specgate-reason"]


@contextlib.asynccontextmanager
async def _holding(gw: Gateway, streams: int) -> AsyncIterator[None]:
    """`streams` long unclassed streams open for the block: a load of that many requests."""
    long = {"prompt": "p", "max_tokens": 120_000, "stream": True}
    async with contextlib.AsyncExitStack() as held:
        for _ in range(streams):
            r = await held.enter_async_context(gw.client.stream("POST", "/v1/completions", json=long))
            await anext(r.aiter_lines())
        yield


async def _engine_known(gw: Gateway, engine: str = "sglang") -> bool:
    return bool((await gw.routing())["servers"]["speculative"]["engine"] == engine)


async def _learn(gw: Gateway) -> None:
    """Both classes go to the speculative server until each is known (a class whose rank is
    known may go elsewhere from then on)."""
    for _ in range(4):
        assert (await _ask(gw, "code", REPEATED))[0] == "speculative"
        await _ask(gw, "chat", VARIED)


async def _two_classes(gateway: StartGateway, **settings: object) -> tuple[Gateway, dict[str, Any]]:
    """A gateway (watermarks 4/1) whose speculative server judges acceptance by the prompt, once
    it has learnt both classes; and what /routing says of them."""
    gw = await gateway(
        sim={"time_scale": 20},
        spec={"accept_from_prompt": True},
        high_watermark=4,
        low_watermark=1,
        scrape_interval_s=0.1,
        affinity_entries=0,
        **settings,
    )
    await wait_until(lambda: _engine_known(gw))
    await _learn(gw)
    return gw, (await gw.routing())["classes"]["tracked"]


@pytest.mark.anyio
async def test_in_a_pool_the_class_that_gains_most_gets_speculation_first(gateway: StartGateway) -> None:
    gw, tracked = await _two_classes(gateway, topology="pooled")
    assert tracked["code"]["accept_length"] > 2.5 > 1.5 > tracked["chat"]["accept_length"], tracked
    assert (tracked["code"]["gains_most"], tracked["chat"]["gains_most"]) == (True, False), tracked
    # Below the high watermark the baseline pool is idle hardware: the class that gains least goes there.
    before = await gw.metrics_text()
    assert await _ask(gw, "code", REPEATED, stream=False) == ("speculative", "class")
    assert await _ask(gw, "chat", VARIED, stream=False) == ("baseline", "class")
    # At the high watermark there is no room for anyone: the policy decides for all.
    async with _holding(gw, 4):
        assert await _ask(gw, "code", REPEATED, stream=False) == ("baseline", "heavy_load")
    text = await gw.metrics_text()
    series = 'specgate_class_requests_total{backend="baseline",class="chat"}'
    assert _value(text, series) == _value(before, series) + 1
    assert 'specgate_class_accept_length{class="code"}' in text
    # Classless requests are routed as before.
    assert (await gw.client.post("/v1/completions", json={"prompt": "p", "max_tokens": 2})).status_code == 200


@pytest.mark.anyio
async def test_a_pair_is_never_split_by_class(gateway: StartGateway) -> None:
    gw, tracked = await _two_classes(gateway)
    assert (tracked["code"]["gains_most"], tracked["chat"]["gains_most"]) == (True, False), tracked
    assert tracked["code"]["gains_tok_s"] is None  # nothing to compare: one GPU
    # Between the watermarks, on one GPU shared by both servers: the mode decides for all.
    async with _holding(gw, 2):
        assert await _ask(gw, "chat", VARIED, stream=False) == ("speculative", "light_load")


def _value(text: str, series: str) -> float:
    line = next((x for x in text.splitlines() if x.startswith(series + " ")), None)
    return 0.0 if line is None else float(line.rsplit(" ", 1)[1])


@pytest.mark.anyio
async def test_classes_off_and_bounded(gateway: StartGateway) -> None:
    off = await gateway(class_key="none")
    await _ask(off, "code", "hi", stream=False)
    assert (await off.routing())["classes"] == {"key": "none", "max": 32, "tracked": {}, "mix": None}
    small = await gateway(max_classes=2)
    for name in ("a", "b", "c", "d"):
        await _ask(small, name, "hi", stream=False)
    tracked = (await small.routing())["classes"]["tracked"]
    assert set(tracked) == {"a", "b", OTHER}
    text = await small.metrics_text()
    assert 'class="c"' not in text and 'specgate_class_requests_total{backend="speculative",class="other"} 2.0' in text


@pytest.mark.anyio
async def test_names_sent_once_take_no_room_from_a_calibrated_class_nor_keep_a_steady_one_out(
    gateway: StartGateway, tmp_path: Path
) -> None:
    gw = await gateway(max_classes=2, calibration=_calibration_with_classes(tmp_path, code=3.0))
    for name in ("a", "b", "c", "d"):
        await _ask(gw, name, "hi", stream=False)
    await _ask(gw, "code", "hi", stream=False)
    tracked = (await gw.routing())["classes"]["tracked"]
    assert set(tracked) == {"a", "b", "code", OTHER}, tracked
    assert (tracked["code"]["accept_length"], tracked["code"]["calibrated_accept_length"]) == (3.0, 3.0)
    # `c` sent again, more than twice the traffic of the least of `a` and `b`: it takes that
    # one's place, and the series of the one it displaced go.
    for _ in range(2):
        await _ask(gw, "c", "hi", stream=False)
    tracked = (await gw.routing())["classes"]["tracked"]
    assert set(tracked) == {"b", "c", "code", OTHER}, tracked
    text = await gw.metrics_text()
    assert 'class="a"' not in text and 'class="c"' in text and 'class="code"' in text


# llama-server's own figures, one content event a token: 65 tokens in 21 steps (44 of 60 drafts
# accepted), so (65 - 1) / (21 - 1) = 3.2 with the first, prefill's, set aside.
LLAMA_TIMINGS = {"predicted_n": 65, "predicted_ms": 400.0, "draft_n": 60, "draft_n_accepted": 44}
LLAMA_METRICS = "llamacpp:requests_processing 0\nllamacpp:requests_deferred 0\n"


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


async def _llama_chat(request: web.Request) -> web.StreamResponse:
    """A speculative llama-server's chat completion: one event a token, its timings on the usage
    chunk when usage is asked for, or on the body."""
    body = await request.json()
    usage = {"prompt_tokens": 9, "completion_tokens": 65, "total_tokens": 74}
    if not body.get("stream"):
        message = {"index": 0, "message": {"role": "assistant", "content": "x" * 65}, "finish_reason": "length"}
        return web.json_response({"id": "1", "choices": [message], "usage": usage, "timings": LLAMA_TIMINGS})
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for _ in range(65):
        await resp.write(_sse({"id": "1", "choices": [{"index": 0, "delta": {"content": "x"}}]}))
    await resp.write(_sse({"id": "1", "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}))
    if (body.get("stream_options") or {}).get("include_usage"):
        await resp.write(_sse({"id": "1", "choices": [], "usage": usage, "timings": LLAMA_TIMINGS}))
    await resp.write(b"data: [DONE]\n\n")
    return resp


async def _llama_health(_: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def _llama_metrics(_: web.Request) -> web.Response:
    return web.Response(text=LLAMA_METRICS)


@contextlib.asynccontextmanager
async def _llama_server() -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_get("/health", _llama_health)
    app.router.add_get("/metrics", _llama_metrics)
    app.router.add_post("/v1/chat/completions", _llama_chat)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    try:
        await web.TCPSite(runner, "127.0.0.1", port).start()
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@pytest.mark.anyio
async def test_a_class_learns_its_acceptance_from_what_llama_server_reports_of_each_response(
    gateway: StartGateway,
) -> None:
    # llama-server streams a token an event, so its streams do not show its steps: each response's
    # own timings do, streamed or not.
    async with _llama_server() as url:
        gw = await gateway(speculative_url=url, scrape_interval_s=0.1)
        await wait_until(lambda: _engine_known(gw, "llamacpp"))
        for _ in range(2):
            assert (await _ask(gw, "streamed", "hi"))[0] == "speculative"
            assert (await _ask(gw, "whole", "hi", stream=False))[0] == "speculative"
        tracked = (await gw.routing())["classes"]["tracked"]
        assert tracked["streamed"]["accept_length"] == pytest.approx(3.2), tracked
        assert tracked["whole"]["accept_length"] == pytest.approx(3.2), tracked
        text = await gw.metrics_text()
        assert _value(text, 'specgate_class_accept_length{class="whole"}') == pytest.approx(3.2)


@pytest.mark.anyio
async def test_a_class_learns_its_acceptance_from_sglangs_native_responses(gateway: StartGateway) -> None:
    # Not streamed, a body has no content events to count: its meta_info's spec_verify_ct says the steps.
    gw = await gateway(sim={"time_scale": 20}, spec={"accept_from_prompt": True}, affinity_entries=0)
    await wait_until(lambda: _engine_known(gw))
    for cls, prompt in (("code", REPEATED), ("chat", VARIED)) * 3:
        body = {"text": prompt, "sampling_params": {"max_new_tokens": 64}}
        r = await gw.client.post("/generate", json=body, headers={"x-specgate-class": cls})
        assert (r.status_code, r.headers["x-specgate-backend"]) == (200, "speculative"), r.text
        assert r.json()["meta_info"]["spec_verify_ct"] > 0
    tracked = (await gw.routing())["classes"]["tracked"]
    assert tracked["code"]["accept_length"] > 2.5 > 1.5 > tracked["chat"]["accept_length"] >= 1, tracked


def _calibration_with_classes(tmp_path: Path, **accept: float) -> str:
    path = Path(calibration_file(tmp_path))
    data = orjson.loads(path.read_bytes())
    path.write_bytes(orjson.dumps({**data, "classes": {n: {"accept_length": a} for n, a in accept.items()}}))
    return str(path)


async def _calibrated_pool(gateway: StartGateway, calibration: str) -> Gateway:
    """A pooled gateway under the adaptive policy on `calibration`, its speculative server judging
    acceptance by the prompt; the group's own watermarks held where the calibration puts them
    (20/15), whatever the speculative server's live acceptance does between one class's streams and
    the other's."""
    gw = await gateway(
        sim={"time_scale": 20, "profile": "crossover"},
        spec={"accept_from_prompt": True},
        calibration=calibration,
        topology="pooled",
        scrape_interval_s=0.1,
        affinity_entries=0,
        **{**FAST, "adaptive_max_step_per_s": 0.001},
    )
    await wait_until(lambda: _engine_known(gw))
    return gw


@pytest.mark.anyio
async def test_classes_the_calibration_measured_are_routed_from_their_first_request(
    gateway: StartGateway, tmp_path: Path
) -> None:
    gw = await _calibrated_pool(gateway, _calibration_with_classes(tmp_path, code=3.0, chat=1.05))
    # Nothing of either class has run: the calibration's acceptance places their first requests.
    async with _holding(gw, 3):
        assert await _ask(gw, "code", REPEATED, stream=False) == ("speculative", "class")
        assert await _ask(gw, "chat", VARIED, stream=False) == ("baseline", "class")
    tracked = (await gw.routing())["classes"]["tracked"]
    assert (tracked["chat"]["accept_length"], tracked["code"]["accept_length"]) == (1.05, 3.0), tracked
    assert tracked["chat"]["calibrated_accept_length"] == 1.05
    # /metrics says it too, though no chat stream ran on a speculative server to set it.
    text = await gw.metrics_text()
    assert _value(text, 'specgate_class_accept_length{class="chat"}') == pytest.approx(1.05)


def test_a_classs_acceptance_gauge_goes_unknown_once_its_evidence_faded() -> None:
    book = ClassBook(4, priors={"chat": 1.3})
    book.tracked("chat", 0.0)
    r = rig()
    r.metrics.publish_class_accepts(book.accepts(0.0))
    gauge = r.metrics.class_accept_length.labels("chat")
    assert gauge._value.get() == 1.3
    r.metrics.publish_class_accepts(book.accepts(2 * CLASS_HALF_LIFE_S))
    assert math.isnan(gauge._value.get())


@pytest.mark.anyio
async def test_under_the_adaptive_policy_each_class_has_its_own_watermarks(
    gateway: StartGateway, tmp_path: Path
) -> None:
    gw = await _calibrated_pool(gateway, calibration_file(tmp_path))
    await _learn(gw)
    routing = await gw.routing()
    tracked = routing["classes"]["tracked"]
    code, chat = tracked["code"]["watermarks"], tracked["chat"]["watermarks"]
    # The calibration's curves cross at 20 streams at acceptance 3: speculation pays a class that
    # accepts more to a higher load, and one that accepts about 1 token a step at hardly any.
    assert code["high"] >= 20 > 2 >= chat["high"], tracked
    # And with both roles idle, a stream of the one gains most on speculation, of the other on the
    # baseline (what the rule compares: policy.class_choice).
    gains = {name: tracked[name]["gains_tok_s"] for name in ("code", "chat")}
    assert gains["code"]["speculative"] > gains["code"]["baseline"] > gains["chat"]["speculative"], gains
    # With the speculative pool holding a few streams, each class goes where its own watermarks say.
    async with _holding(gw, 3):
        assert await _ask(gw, "chat", VARIED, stream=False) == ("baseline", "class")
        assert await _ask(gw, "code", REPEATED, stream=False) == ("speculative", "class")


# ---------------------------------------------------------------------------------------------
# The traffic's acceptance, by its classes


def test_the_traffics_acceptance_is_its_classes_mix() -> None:
    book = ClassBook(4, priors={"code": 3.0, "chat": 1.25})
    assert book.mix(0.0) is None  # nothing seen
    book.tracked("code", 0.0)
    book.tracked("chat", 0.0)
    book.tracked("prose", 0.0)  # no acceptance known yet: not in the mean, but in the traffic
    assert book.mix(0.1) is None  # reckoned at most every RANK_EVERY_S
    assert book.mix(RANK_EVERY_S) == pytest.approx((2.125, 2 / 3), rel=1e-3)
    # Requests of no class lower the share the mix stands for.
    book.unclassed(RANK_EVERY_S)
    assert book.mix(2 * RANK_EVERY_S) == pytest.approx((2.125, 2 / 4), rel=1e-3)
    # Weighted by each class's traffic, decayed alike.
    for _ in range(2):
        book.tracked("code", 2 * RANK_EVERY_S)
    a, share = book.mix(3 * RANK_EVERY_S) or (0.0, 0.0)
    assert a == pytest.approx((3 * 3.0 + 1.25) / 4, rel=1e-3) and share == pytest.approx(4 / 6, rel=1e-3)
    # Requests of no class are not counted while no class has been seen.
    empty = ClassBook(4)
    empty.unclassed(0.0)
    assert empty.none.traffic == 0.0 and empty.mix(0.0) is None


def _paired_router(clock: Clock, engine_accept: float, book: ClassBook | None) -> Router:
    r = rig()
    r.health["speculative"].spec_accept_length = engine_accept
    policy = policy_cfg("adaptive", 16, 8, probe_s=0.0)
    adaptive = adaptive_cfg(margin=0.0, min_watermark=0, max_watermark=60, max_step_per_s=1000.0)
    fleet = Fleet(r.topology, r.servers, policy, r.metrics, adaptive, calibration(), clock=clock, classes=book)
    return fleet.routers[0]


def test_a_group_reads_its_traffics_acceptance_from_its_classes_not_from_what_it_served_last() -> None:
    clock = Clock()
    # The speculative engine's gauge says 1.25: what it served last (chat's streams, after the mode
    # left speculation), though the traffic is half code at 3.0.
    book = ClassBook(4, priors={"code": 3.0, "chat": 1.25})
    router = _paired_router(clock, 1.25, book)
    stale = _paired_router(clock, 1.25, None)
    assert router.learning.accept_live(clock()) == (1.25, "live")  # no class seen yet: the engine's reading
    book.tracked("code", clock())
    book.tracked("chat", clock())
    clock.t += RANK_EVERY_S  # the mix is reckoned anew at most this often
    accept, source = router.learning.accept_live(clock())
    assert accept == pytest.approx(2.125) and source == "from traffic classes"
    clock.t += 5.0
    router.refresh()
    stale.refresh()
    described = router.adaptive.describe(clock()) if router.adaptive is not None else {}
    assert described["accept_length_live"] == pytest.approx(2.125)
    # Speculation pays the mix to a higher load than the one class it served last.
    assert router.cfg.high_watermark > stale.cfg.high_watermark
    # Requests of no class are the engine's to read: half the traffic here.
    book.unclassed(clock())
    book.unclassed(clock())
    clock.t += RANK_EVERY_S
    accept, source = router.learning.accept_live(clock())
    assert accept == pytest.approx(0.5 * 2.125 + 0.5 * 1.25, rel=1e-2) and source == "from traffic classes and live"


def test_a_streams_speed_is_read_at_its_own_classs_acceptance() -> None:
    clock = Clock()
    routers = [_paired_router(clock, 1.25, None) for _ in range(2)]
    # A stream of a class accepting 3.0 decoding just as the calibration says the server does at
    # 3.0: no correction when read at its own acceptance, a faster server when read at the 1.25
    # the engine's gauge says.
    level = LEVELS[1]
    per_stream = SPEC[1] / level
    routers[0].observe(Role.SPECULATIVE, level, per_stream, accept=3.0)
    routers[1].observe(Role.SPECULATIVE, level, per_stream)
    ratios = [_speed_ratio(r, level) for r in routers]
    assert ratios[0] == pytest.approx(1.0, abs=0.01) and ratios[1] > 1.05


def _speed_ratio(router: Router, level: int) -> float:
    assert router.adaptive is not None
    observed = router.adaptive.describe(0.0)["observed"]["speculative"]
    return float(observed[str(level)]["speed_ratio"])


def test_batch_work_is_left_out_of_what_the_model_policy_solves_and_the_switch_is_priced_at() -> None:
    # A speculative server whose steps read much KV: the context the group holds moves its watermarks.
    r = rig()
    r.health["speculative"].spec_accept_length = 3.0
    fit = ModelFit(StepFit(0.012, 1e-4, 1e-6), StepFit(0.006, 1e-4, 1e-8), (1000, 4000), 128, 3.0)
    cal = dataclasses.replace(calibration(), model=fit)
    policy = policy_cfg("model", 16, 8, probe_s=0.0)
    adaptive = adaptive_cfg(min_watermark=0, max_watermark=200, prefill_tok_s=20_000.0)
    (router,) = Fleet(r.topology, r.servers, policy, r.metrics, adaptive, cal, clock=Clock()).routers
    interactive = [router.admit(Role.SPECULATIVE, tokens=1000) for _ in range(2)]
    router.decide(prompt_tokens=1000)
    alone = (router.cfg.high_watermark, router.speed.context if router.speed else None, router.switch_margin())
    assert alone[0] > 2
    # Ten batch jobs of 100,000 tokens on the baseline: they never run on speculation, nor move
    # on a switch, so the interactive streams' mode is solved and priced as before.
    batch = [router.admit(Role.BASELINE, tokens=100_000, batch=True) for _ in range(10)]
    for lease in batch[:3]:
        lease.add(500)  # what they generate is theirs too
    d = router.decide(prompt_tokens=1000)
    assert d.backend == Role.SPECULATIVE
    assert (router.cfg.high_watermark, router.speed.context if router.speed else None, router.switch_margin()) == alone
    assert router.tracker.tokens("baseline") == 10 * 100_000 + 3 * 500  # still the server's
    for lease in [*interactive, *batch]:
        lease.release()
    assert (router.tracker.load_of("baseline").batch_tokens, router.tracker.tokens("baseline")) == (0, 0)


def test_figures_no_server_could_make_teach_a_class_nothing() -> None:
    book = ClassBook(2)
    book.tracked("a", 0.0)
    book.measured("a", 10**12, 40, 0.0)  # a usage of a trillion tokens over 40 events
    book.measured("a", 10, 40, 0.0)  # fewer tokens than steps
    assert book.stats["a"].steps == 0 and book.accept("a") is None
    book.measured("a", 3 * MIN_STEPS, MIN_STEPS, 0.0)
    assert book.accept("a") == 3.0
    # A request that outlived its class's place in the book counts under `other` (its series went
    # with the class), and naming it makes no entry.
    assert (book.named("a"), book.named("gone")) == ("a", OTHER) and "gone" not in book.stats


def test_a_class_header_in_utf8_names_its_class_as_the_calibration_does() -> None:
    assert class_of("header", "código".encode(), {}, b"") == "código"
    assert class_of("header", b"\xff\xfe", {}, b"") == "\ufffd\ufffd"


@pytest.mark.anyio
async def test_batch_requests_neither_weigh_in_the_classes_mix_nor_rank_them(gateway: StartGateway) -> None:
    gw = await gateway()
    await _ask(gw, "chat", "hi", stream=False)
    for _ in range(3):
        r = await gw.client.post(
            "/v1/completions",
            json={"prompt": "p", "max_tokens": 2},
            headers={"x-specgate-class": "bulk", "x-specgate-priority": "batch"},
        )
        assert (r.status_code, r.headers["x-specgate-reason"]) == (200, "batch")
    tracked = (await gw.routing())["classes"]["tracked"]
    assert set(tracked) == {"chat"} and tracked["chat"]["traffic"] == pytest.approx(1.0, abs=0.01)
    # Counted, under `other`: a class seen only in batch work takes no room in the book.
    text = await gw.metrics_text()
    assert 'specgate_class_requests_total{backend="baseline",class="other"} 3.0' in text
    assert 'class="bulk"' not in text
