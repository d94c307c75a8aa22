"""The routing policy is a pure function: tables of snapshots in, decisions out."""

from __future__ import annotations

import dataclasses

import pytest

from proxy.policy.base import (
    Decision,
    LoadSignal,
    LoadSnapshot,
    PolicyConfig,
    PolicyState,
    Role,
    backend_load,
)
from proxy.policy.threshold import next_mode
from proxy.routing.steps.pipeline import decide
from proxy.routing.steps.spill import kv_spill, spills

from ..helpers import policy_cfg

UP = {Role.SPECULATIVE: True, Role.BASELINE: True}
THRESHOLD = policy_cfg("threshold", high_watermark=10, low_watermark=4)


def snap(
    spec: int, base: int, healthy: dict[Role, bool] | None = None, engine: dict[Role, int | None] | None = None
) -> LoadSnapshot:
    return LoadSnapshot({Role.SPECULATIVE: spec, Role.BASELINE: base}, engine or {}, healthy or dict(UP))


@pytest.mark.parametrize(
    ("mode", "spec", "base", "backend", "reason", "new_mode"),
    [
        ("speculative", 0, 0, "speculative", "light_load", "speculative"),
        ("speculative", 9, 0, "speculative", "light_load", "speculative"),
        ("speculative", 10, 0, "baseline", "heavy_load", "baseline"),  # reaches high: flip
        ("speculative", 6, 5, "baseline", "heavy_load", "baseline"),  # the load counts both servers
        ("baseline", 10, 3, "baseline", "heavy_load", "baseline"),
        ("baseline", 5, 2, "baseline", "hysteresis_hold", "baseline"),  # inside the band: hold
        ("baseline", 0, 5, "baseline", "hysteresis_hold", "baseline"),
        ("baseline", 2, 2, "speculative", "light_load", "speculative"),  # falls to low: flip back
        ("baseline", 0, 0, "speculative", "light_load", "speculative"),
        ("speculative", 5, 2, "speculative", "light_load", "speculative"),  # inside the band: no flip either
    ],
)
def test_threshold_with_hysteresis(mode: Role, spec: int, base: int, backend: str, reason: str, new_mode: str) -> None:
    d = decide(snap(spec, base), PolicyState(mode), THRESHOLD)
    assert (d.backend, d.reason, d.state.mode) == (backend, reason, new_mode)
    assert d.load == spec + base


def test_threshold_sequence_never_flips_inside_the_band() -> None:
    state = PolicyState()
    modes = []
    for load in [0, 3, 6, 9, 10, 9, 6, 5, 6, 9, 5, 4, 5, 9, 10]:
        state = next_mode(load, state, THRESHOLD)
        modes.append(state.mode[0])
    assert "".join(modes) == "ssssbbbbbbbsssb"


def test_speculation_returns_only_once_the_load_has_stayed_low_for_the_hold() -> None:
    cfg = dataclasses.replace(THRESHOLD, low_hold_s=2.0)
    state = PolicyState(Role.BASELINE)
    trace = []
    # (time, load): a dip of a second to the low watermark, back inside the band, then a fall that
    # lasts: the hold starts again at 2.9 and runs out at 4.9.
    for now, load in [(0, 12), (1, 4), (1.5, 3), (2.0, 5), (2.9, 4), (3.5, 2), (4.8, 4), (4.9, 4), (5.0, 9)]:
        state = next_mode(load, state, cfg, float(now))
        trace.append(state.mode[0])
    assert "".join(trace) == "bbbbbbbss"
    state = PolicyState(Role.BASELINE)
    for now, load in [(10, 4), (11, 0), (11.99, 3)]:
        state = next_mode(load, state, cfg, now)
        assert state.mode == "baseline" and state.low_since == 10
    assert next_mode(4, state, cfg, 12.0).mode == "speculative"
    # Leaving speculation is never held.
    assert next_mode(10, PolicyState(Role.SPECULATIVE), cfg, 0.0).mode == Role.BASELINE
    # A decision while the hold runs says so, and still goes to the baseline.
    held = decide(
        LoadSnapshot({Role.SPECULATIVE: 0, Role.BASELINE: 3}, {}, dict(UP), now=20.0), PolicyState(Role.BASELINE), cfg
    )
    assert (held.backend, held.reason, held.state.low_since) == ("baseline", "return_hold", 20.0)
    later = decide(LoadSnapshot({Role.SPECULATIVE: 0, Role.BASELINE: 3}, {}, dict(UP), now=22.0), held.state, cfg)
    assert (later.backend, later.reason) == ("speculative", "light_load")
    # Without a hold (the default), the first low reading switches, as before.
    assert next_mode(4, PolicyState(Role.BASELINE), THRESHOLD, 0.0).mode == Role.SPECULATIVE


@pytest.mark.parametrize(
    ("spec", "base", "backend", "reason"),
    [
        (0, 0, "speculative", "light_load"),
        (2, 50, "speculative", "light_load"),
        (3, 0, "baseline", "spillover"),
        (7, 1, "baseline", "spillover"),
    ],
)
def test_spillover(spec: int, base: int, backend: str, reason: str) -> None:
    d = decide(snap(spec, base), PolicyState(), policy_cfg("spillover", spillover_limit=3))
    assert (d.backend, d.reason) == (backend, reason)


@pytest.mark.parametrize("cfg", [THRESHOLD, policy_cfg("spillover", spillover_limit=3)])
def test_down_backends_are_never_chosen(cfg: PolicyConfig) -> None:
    spec_down = decide(snap(0, 0, {Role.SPECULATIVE: False, Role.BASELINE: True}), PolicyState(), cfg)
    assert (spec_down.backend, spec_down.reason) == ("baseline", "only_healthy")
    base_down = decide(snap(50, 0, {Role.SPECULATIVE: True, Role.BASELINE: False}), PolicyState(Role.BASELINE), cfg)
    assert (base_down.backend, base_down.reason) == ("speculative", "only_healthy")
    both = decide(snap(0, 0, {Role.SPECULATIVE: False, Role.BASELINE: False}), PolicyState(), cfg)
    assert (both.backend, both.reason) == (None, "no_healthy_backend")


@pytest.mark.parametrize(
    ("signal", "local", "engine", "expected"),
    [
        ("local", 3, 9, 3),
        ("engine", 3, 9, 9),
        ("max", 3, 9, 9),
        ("max", 12, 9, 12),
        ("engine", 3, None, 3),
        ("max", 3, None, 3),
    ],
)
def test_load_signals(signal: LoadSignal, local: int, engine: int | None, expected: int) -> None:
    s = snap(local, 0, engine={Role.SPECULATIVE: engine, Role.BASELINE: None})
    assert backend_load(s, Role.SPECULATIVE, signal) == expected


def test_engine_signal_drives_the_switch() -> None:
    cfg = policy_cfg("threshold", 10, 4, load_signal="engine")
    d = decide(snap(0, 0, engine={Role.SPECULATIVE: 12, Role.BASELINE: 0}), PolicyState(), cfg)
    assert (d.backend, d.reason, d.load) == ("baseline", "heavy_load", 12)


def test_high_watermark_zero_sends_everything_to_the_baseline() -> None:
    cfg = policy_cfg("threshold", high_watermark=0, low_watermark=0)
    state = PolicyState()
    for load in (0, 0, 5, 0):
        d = decide(snap(load, 0), state, cfg)
        state = d.state
        assert (d.backend, d.state.mode) == ("baseline", "baseline")


SPILL = policy_cfg("adaptive", high_watermark=10, low_watermark=4, kv_spill_at=0.9, kv_spill_room=0.6)
TO_BASE = Decision(Role.BASELINE, "heavy_load", PolicyState(Role.BASELINE), 20)


@pytest.mark.parametrize(
    ("base", "spec", "held", "backend"),
    [
        (0.95, 0.10, None, Role.SPECULATIVE),  # the baseline full, speculation's pool near empty
        (0.90, 0.59, None, Role.SPECULATIVE),  # at F, and under R
        (0.89, 0.10, None, Role.BASELINE),  # the baseline not yet full
        (0.95, 0.60, None, Role.BASELINE),  # no room for a new conversation at R
        (0.95, 0.75, Role.SPECULATIVE, Role.SPECULATIVE),  # one spilled already keeps its cache under F
        (0.95, 0.90, Role.SPECULATIVE, Role.BASELINE),  # ...but not at F
        (0.99, 0.10, Role.BASELINE, Role.BASELINE),  # its cache on the baseline: it waits there
        (None, 0.10, None, Role.BASELINE),  # a pool unknown: no spill
        (0.95, None, None, Role.BASELINE),
    ],
)
def test_a_full_baseline_spills_to_the_speculative_pool_with_room(
    base: float | None, spec: float | None, held: Role | None, backend: Role
) -> None:
    d = kv_spill(TO_BASE, held, SPILL, UP, base, spec)
    assert d.backend == backend
    assert d.reason == ("kv_spill" if backend == Role.SPECULATIVE else "heavy_load")
    assert (d.state, d.load) == (TO_BASE.state, TO_BASE.load)  # the mode stays; only this request moves


@pytest.mark.parametrize(
    ("decision", "cfg", "healthy"),
    [
        (TO_BASE._replace(reason="batch"), SPILL, UP),  # batch requests never take speculation's room
        (TO_BASE._replace(reason="failover"), SPILL, UP),
        (TO_BASE._replace(reason="only_healthy"), SPILL, UP),
        (TO_BASE._replace(reason="affinity"), SPILL, UP),
        (TO_BASE, dataclasses.replace(SPILL, kv_spill_at=0.0), UP),  # off
        (TO_BASE, dataclasses.replace(SPILL, policy="threshold"), UP),  # routes by its watermarks as set
        (TO_BASE, SPILL, {Role.SPECULATIVE: False, Role.BASELINE: True}),
    ],
)
def test_only_the_modes_or_a_classs_choice_spills_and_only_to_a_live_speculative_role(
    decision: Decision, cfg: PolicyConfig, healthy: dict[Role, bool]
) -> None:
    assert kv_spill(decision, None, cfg, healthy, 1.0, 0.0) is decision
    assert spills(TO_BASE._replace(reason="class"), None, SPILL)
    assert spills(TO_BASE._replace(reason="dwell_hold"), Role.SPECULATIVE, SPILL)
    assert not spills(TO_BASE._replace(backend=Role.SPECULATIVE, reason="light_load"), None, SPILL)


def test_a_spilled_request_sends_no_shadow_and_leaves_the_probes_wait_as_it_was() -> None:
    due = TO_BASE._replace(state=PolicyState(Role.BASELINE, probes=3), shadow=True)
    d = kv_spill(due, None, SPILL, UP, 0.95, 0.1)
    assert (d.backend, d.shadow, d.state.probes) == (Role.SPECULATIVE, False, 2)
