"""What every policy speaks in: the roles, a load snapshot, the mode's state, a decision and its
reason, the rule's parameters, and the `Policy` protocol a mode rule implements. Pure.

A new request's placement is a pipeline (proxy/routing/steps/): a few ordered steps, each giving a
decision with its reason or passing. The mode for a group, the one step every request reaches, is a
`Policy` (threshold, spillover, adaptive, model: one module each, built by policy/factory.py from
the settings); the others refine it (priority, probe, health, class, affinity, KV spill).

In every rule, L is the load (in-flight interactive requests over both servers, by the configured signal) and
S the speculative server's own load, both measured before the new request is admitted. A backend that is
down is never chosen: its share goes to the other (`only_healthy`); with both down there is no
backend (`no_healthy_backend`). Running requests never move: only new requests are routed.

With several servers (topology.py) these rules run once per group, on the group's own load: a
paired group's two servers, or a pool's roles summed (a role is up while any of its servers is).
Which group, and which server of a pooled role, is `least_loaded`: the least load, at random among
near-ties.
"""

from __future__ import annotations

import bisect
import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final, Literal, NamedTuple, Protocol


class Role(enum.StrEnum):
    """What a server is for: speculative decoding, plain decoding (the baseline), or drafting as its
    engine decides batch by batch (adaptive: SGLang's --speculative-adaptive). Its value is what
    metrics, headers and /routing say."""

    SPECULATIVE = "speculative"
    BASELINE = "baseline"
    ADAPTIVE = "adaptive"


# The two roles a group's mode chooses between (a pair's, a pool's); adaptive servers form a group
# of their own, whose engines choose (proxy/routing/homogeneous.py).
ROLES: tuple[Role, ...] = (Role.SPECULATIVE, Role.BASELINE)
ALL_ROLES: tuple[Role, ...] = tuple(Role)
# The roles as module constants: in Python 3.11 an enum member read off its class is a slow lookup
# (the enum metaclass defines __getattr__), 48 ns a time against 5 for a global, measured with
# timeit, and the per-request decision names them a few dozen times (loadtest/decisions.py).
SPECULATIVE: Final = Role.SPECULATIVE
BASELINE: Final = Role.BASELINE
ADAPTIVE: Final = Role.ADAPTIVE
Mode = Role
PolicyName = Literal["threshold", "spillover", "adaptive", "model"]
# The policies that learn from live traffic: `model` is adaptive's rule with watermarks from the
# speed model (speedmodel.py) where the calibration has one.
LEARNING: tuple[PolicyName, ...] = ("adaptive", "model")
LoadSignal = Literal["local", "engine", "max"]
# Which rule keeps a turn on its server among a role's servers (affinity.py): the priced one, the one
# by requests in flight, or both (a turn moves only where each would move it).
AffinityRule = Literal["priced", "in_flight", "both"]
# What a client asked of speculation (proxy/routing/switch.py): None is auto.
Switch = Literal["on", "off"]
Reason = Literal[
    "light_load",  # speculative: the load is below the high watermark / spillover limit
    "heavy_load",  # baseline: the load reached the high watermark
    "hysteresis_hold",  # baseline: the load fell, but not yet to the low watermark
    "return_hold",  # baseline: the load is at or below the low watermark, but not yet for low_hold_s
    "spillover",  # baseline: the speculative server holds its limit
    "dwell_hold",  # adaptive: the watermarks call for a switch, but the mode is younger than min_dwell_s
    "probe",  # adaptive: one request to the idle speculative server, to re-measure its acceptance
    "switch_cost",  # adaptive, paired: the watermarks call for a switch, but it would not win back its re-prefill
    "only_healthy",  # the policy's choice is down; the other server takes it
    "failover",  # a retry on the other server after the first failed before any byte
    "stored_response",  # the request continues a response stored on one server (previous_response_id)
    "batch",  # baseline: a batch request (x-specgate-priority: batch) leaves speculation to interactive ones
    "affinity",  # between the watermarks: the role of the server that holds the conversation's cache
    "class",  # where speculation has room for part of the traffic: by whether the class gains most from it
    "kv_spill",  # speculative: every baseline KV pool is full, and the speculative role's has room
    "client_on",  # speculative: the client asked for speculation (x-specgate-speculation, its class's default)
    "client_off",  # baseline: the client asked for none
    "in_engine",  # adaptive: servers whose engines choose how far to draft, batch by batch
    "slo",  # a pooled class's request on the other role: its own would miss an SLO (TPOT, TTFT), the other not
    "no_healthy_backend",
]
REASONS: tuple[Reason, ...] = (
    "light_load",
    "heavy_load",
    "hysteresis_hold",
    "return_hold",
    "spillover",
    "dwell_hold",
    "probe",
    "switch_cost",
    "only_healthy",
    "failover",
    "stored_response",
    "batch",
    "affinity",
    "class",
    "kv_spill",
    "client_on",
    "client_off",
    "in_engine",
    "slo",
    "no_healthy_backend",
)


# Loads within this many requests of the least are ties, broken at random.
NEAR_TIE = 0.5


def other(backend: Role) -> Role:
    """Where a request goes when its role cannot take it: the group's other role (an adaptive
    group's one role is its own other: another of its servers)."""
    if backend is ADAPTIVE:
        return ADAPTIVE
    return BASELINE if backend == SPECULATIVE else SPECULATIVE


@dataclass(frozen=True, kw_only=True)
class PolicyConfig:
    """The rule's parameters, built from the settings by `Settings.policy_config` (which owns every
    default)."""

    policy: PolicyName
    high_watermark: int
    low_watermark: int
    spillover_limit: int
    load_signal: LoadSignal
    # The load must stay at or below the low watermark this long before speculation returns.
    low_hold_s: float
    # adaptive only: the watermarks above are the live ones (the Router replaces them).
    min_dwell_s: float
    probe_s: float  # 0: never probe
    probe_max_s: float
    # A reading of the speculative server's acceptance counts as current this long after it last
    # had traffic from this gateway.
    accept_fresh_s: float
    # No probes at or above this load: beyond it the watermarks cannot reach.
    probe_max_load: int
    # Probe with a capped copy of a request (a session of one) rather than the request itself.
    probe_shadow: bool
    # adaptive, paired group: the curves as believed now (the Router replaces them), which price a
    # switch against its re-prefill (LoadSnapshot.switch_margin); None: switches are not priced.
    curves: Curves | None = None
    # Streams the speculative role holds before its KV pool is full, K / (t + g) (the Router's;
    # None: unknown): the watermarks above are capped to it already.
    capacity: int | None = None
    # Pooled classes: a turn stays on the role holding its cache unless the other gains more than
    # this many streams' speed per thousand tokens cached (SPECGATE_AFFINITY_SLACK, as affinity.py).
    affinity_slack: float = 1.0
    # ... or while it holds at most this many times the best's load (SPECGATE_AFFINITY_BALANCE).
    affinity_balance: float = 1.5
    # Among a role's servers (SPECGATE_AFFINITY_RULE; priced and both need the model policy's fit).
    affinity_rule: AffinityRule = "both"
    # The learning policies' spill to speculation once the baseline's KV pools are full (the
    # module's F and R: SPECGATE_KV_SPILL_AT, 0 off, and SPECGATE_KV_SPILL_ROOM), as fractions.
    kv_spill_at: float = 0.0
    kv_spill_room: float = 0.0
    # A stream's time per output token the pooled class rule keeps each request within where it can
    # (SPECGATE_SLO_TPOT_MS; None: no SLO): routing/steps/classes.py.
    slo_tpot_ms: float | None = None
    # ... and the time to first token, predicted from the prefill ahead at `prefill_tok_s`
    # (SPECGATE_SLO_TTFT_MS, SPECGATE_PREFILL_TOK_S; either None or 0: not predicted).
    slo_ttft_ms: float | None = None
    prefill_tok_s: float = 0.0
    # Which adaptive server a request goes to (SPECGATE_ADAPTIVE_PLACEMENT: proxy/routing/homogeneous.py).
    adaptive_placement: Literal["homogeneous", "least_loaded"] = "least_loaded"


class Curves(NamedTuple):
    """Each role's throughput (output tok/s) and TPOT (ms; NaN where not measured) at a few group
    loads (streams), increasing."""

    levels: tuple[float, ...]
    speculative: tuple[float, ...]
    baseline: tuple[float, ...]
    speculative_tpot: tuple[float, ...] = ()
    baseline_tpot: tuple[float, ...] = ()

    def gain(self, to: Role, load: float) -> float:
        """What `to` gives at `load` over the other role, less 1, by the better of throughput and
        TPOT, as the watermarks are set by the earlier of their crossings (infinite where the other
        gives nothing: nothing to lose)."""
        spec = interpolate(self.levels, self.speculative, load)
        base = interpolate(self.levels, self.baseline, load)
        new, old = (spec, base) if to == SPECULATIVE else (base, spec)
        gain = new / old - 1 if old > 0 else math.inf
        if self.speculative_tpot and self.baseline_tpot:
            t_spec = interpolate(self.levels, self.speculative_tpot, load)
            t_base = interpolate(self.levels, self.baseline_tpot, load)
            t_new, t_old = (t_spec, t_base) if to == SPECULATIVE else (t_base, t_spec)
            if t_new > 0 and math.isfinite(t_old / t_new):
                gain = max(gain, t_old / t_new - 1)
        return gain


def hysteresis_low(high: int) -> int:
    """A band of a quarter of the high watermark (at least one request), as `calibrate` uses."""
    return max(0, high - max(1, math.ceil(high / 4)))


def interpolate(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Linear between points, flat outside them (NaN points are not skipped: callers avoid them)."""
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    i = bisect.bisect_right(xs, x)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


# LoadSnapshot, Decision (and routing.Placement) are immutable records built a few times for every
# request: NamedTuples, since a frozen dataclass's __init__ sets each field through
# object.__setattr__ (measured: 0.65 us for five fields, against 0.15 us).
class LoadSnapshot(NamedTuple):
    """What the policy sees. `engine` is None for a server whose engine load is unknown or stale."""

    inflight: Mapping[Role, int]
    engine: Mapping[Role, int | None]
    healthy: Mapping[Role, bool]
    # adaptive only: the clock, and since when the speculative server had nothing in flight from
    # this gateway (None: it has some now).
    now: float = 0.0
    speculative_idle_since: float | None = None
    # adaptive, paired group: the relative gain (Curves.gain) a switch needs to win back the
    # re-prefill of the group's conversations on the other server, R / (P * H) (0: not priced).
    switch_margin: float = 0.0


@dataclass(frozen=True)
class PolicyState:
    mode: Mode = SPECULATIVE
    # When the mode began, the probe sessions since, and whether one is under way (adaptive only).
    since: float = float("-inf")
    probes: int = 0
    probing: bool = False
    # In baseline mode: since when the load has been at or below the low watermark (None: it is not).
    low_since: float | None = None
    # The probe session under way (adaptive only): its number (its streams pool into one reading),
    # the requests it sent and the output tokens they brought back.
    session: int = 0
    session_requests: int = 0
    session_tokens: int = 0


@dataclass(frozen=True)
class ClassView:
    """What the policy knows of a request's traffic class: whether it is among those that gain most
    from speculation (ClassBook's ranking; None: fewer than two classes known), the watermarks
    its own acceptance calls for (None: no speed model to solve them, or its acceptance unknown),
    and its acceptance (None: unknown)."""

    gains: bool | None
    high: int | None = None
    low: int | None = None
    accept: float | None = None


class PoolGains(NamedTuple):
    """A pooled group's throughput gain (tokens/s) from one more stream of a class on each role
    (marginal_gain), and the stream's own speed there: the class rule's inputs where both roles'
    speeds are known."""

    speculative: float
    baseline: float
    speed_speculative: float
    speed_baseline: float

    def of(self, role: Role) -> tuple[float, float]:
        """(gain, the stream's own speed) on `role`."""
        if role == SPECULATIVE:
            return self.speculative, self.speed_speculative
        return self.baseline, self.speed_baseline


def marginal_gain(accept: float, streams: float, held_accept: float, v_now: float, v_next: float) -> float:
    """A server's throughput gain from one more stream of acceptance `accept`, where `streams`
    streams of mean acceptance `held_accept` run at `v_now` steps a second each and all run at
    `v_next` with it (the module's G_r)."""
    return accept * v_next - streams * held_accept * (v_now - v_next)


class Decision(NamedTuple):
    backend: Role | None
    reason: Reason
    state: PolicyState
    load: int
    # Also send a capped copy of this request to the speculative server, to measure its acceptance.
    shadow: bool = False


def backend_load(snapshot: LoadSnapshot, backend: Role, signal: LoadSignal) -> int:
    local = snapshot.inflight.get(backend, 0)
    engine = snapshot.engine.get(backend)
    if signal == "local" or engine is None:
        return local
    if signal == "engine":
        return engine
    return max(local, engine)


def total_load(snapshot: LoadSnapshot, signal: LoadSignal) -> int:
    # The two roles spelled out: this runs for every request, and a generator over ROLES costs more
    # than the sum.
    return backend_load(snapshot, SPECULATIVE, signal) + backend_load(snapshot, BASELINE, signal)


def near_ties(loads: Sequence[tuple[str, float]]) -> list[str]:
    """The names whose load is within NEAR_TIE of the least: a choice among them is as good as
    any. Choosing at random among them, not the first, is what keeps several gateways from all
    sending the next request to the same server. The band is narrow because the loads it compares
    are this gateway's own requests now plus a slow average of the others' (routing/leases.py): each
    choice moves the chooser's own figure at once, so no gateway herds between load readings, and
    a wider band (a tenth of the load, at first) let each of three replicas lean two requests the
    same way at random, which is what the groups' loads then wandered by."""
    if not loads:
        return []
    low = min(load for _, load in loads)
    return [name for name, load in loads if load <= low + NEAR_TIE]


def least_loaded(loads: Sequence[tuple[str, float]], pick: float) -> str | None:
    """The least-loaded name, `pick` in [0, 1) drawing among near-ties; None for no candidates."""
    near = near_ties(loads)
    if not near:
        return None
    return near[min(int(pick * len(near)), len(near) - 1)]


# The reasons a decision is the mode's own choice (not a probe, a batch request, a failover...):
# what the steps after the mode may refine.
MODE_REASONS = frozenset({"light_load", "heavy_load", "hysteresis_hold", "return_hold", "dwell_hold", "switch_cost"})


def accept_fresh(idle_since: float | None, now: float, cfg: PolicyConfig) -> bool:
    """Whether the speculative server had traffic recently enough for its acceptance reading."""
    return idle_since is None or now - idle_since <= cfg.accept_fresh_s


class Policy(Protocol):
    """A group's mode: which role new requests go to at a load, and when that changes."""

    @property
    def name(self) -> PolicyName:
        """SPECGATE_POLICY's value."""
        ...

    @property
    def learns(self) -> bool:
        """Whether the router keeps what the policy learns from traffic (beliefs.py's curves,
        probes' evidence, the KV capacity)."""
        ...

    @property
    def solves(self) -> bool:
        """Whether its watermarks are solved from the step-time model (speedmodel.py)."""
        ...

    def settle(
        self, load: int, spec_load: int, state: PolicyState, cfg: PolicyConfig, now: float, fresh: bool, margin: float
    ) -> tuple[PolicyState, Reason | None]:
        """The next state at `load` (and `spec_load`, the speculative role's), and why a switch
        was held back (None: none was). `fresh`: accept_fresh; `margin`: LoadSnapshot's
        switch_margin."""
        ...

    def reason(self, mode: Role, load: int, state: PolicyState, cfg: PolicyConfig) -> Reason:
        """Why the new request goes to `mode`, where no switch was held back."""
        ...


def mode_decision(policy: Policy, snapshot: LoadSnapshot, state: PolicyState, cfg: PolicyConfig) -> Decision:
    """The mode's choice for a new request (its server not yet checked: steps/health.py)."""
    signal, now = cfg.load_signal, snapshot.now
    spec_load = backend_load(snapshot, SPECULATIVE, signal)
    load = spec_load + backend_load(snapshot, BASELINE, signal)
    idle = snapshot.speculative_idle_since
    fresh = idle is None or now - idle <= cfg.accept_fresh_s  # accept_fresh, inline: every request asks
    state, held = policy.settle(load, spec_load, state, cfg, now, fresh, snapshot.switch_margin)
    return Decision(state.mode, held or policy.reason(state.mode, load, state, cfg), state, load)
