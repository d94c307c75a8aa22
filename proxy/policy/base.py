"""The routing policy: a pure function of a load snapshot, the policy's own state, and health.

threshold (one mode for new requests, with hysteresis):

    mode' = baseline     if mode = speculative and L >= high
          = speculative  if mode = baseline    and L <= low (for low_hold_s, when set)
          = mode         otherwise
    backend = mode'

The hold (SPECGATE_LOW_WATERMARK_HOLD_S, 2 s by default) is asymmetric on purpose: leaving
speculation early costs little, since the baseline serves a light load well, but a request sent to
the speculative server during a dip of a second stays there for its whole length, and the load is
back by then (reason return_hold while the load waits out the hold). Where the two servers tie, a
load wandering about the low watermark otherwise switches back and forth, and on a shared GPU each
switch leaves both servers busy while the old mode drains: measured in `loadtest scaleout
--defaults` at 40 streams, 0.94x the better fixed choice with no hold, 0.97x with 2 s (and
0.99-1.00x with the engine signal's /metrics read every 0.5 s, config.ENGINE_SCRAPE_INTERVAL_S).

spillover (the speculative server as a bounded first choice):

    backend = speculative if S < limit else baseline

model: adaptive, with the watermarks the speed model (speedmodel.py) solves for the group's load,
context and acceptance, where the calibration file has a fit (else adaptive's).

adaptive (threshold whose watermarks move with the live workload, see adaptive.py): the
threshold rule with the live watermarks, plus

    a switch waits until the mode has lasted min_dwell_s      (reason dwell_hold)
    but a switch off speculation whose KV pool is full (below)
    in baseline mode, a probe session goes to an idle speculative server after probe_s, the wait
    doubling per session up to probe_max_s until the mode changes: requests one at a time until
    enough tokens came back to refresh its acceptance reading  (reason probe)
    or, with probe_shadow, the request goes where the mode says and a copy of it, capped to a
    few tokens and never shown to the client, goes to the idle speculative server (Decision.shadow)
    no return to speculation on an acceptance reading older than accept_fresh_s: a probe
    session first                                              (reason dwell_hold, then probe)
    no probe while the load is above max(low, hysteresis_low(C)), C the speculative pool's capacity
    in streams (below): speculation returns only at the low watermark, which no acceptance lifts
    past the band under a high watermark capped to C, and on a shared GPU each probe's prefill
    of a whole prompt takes the GPU from the baseline's batch

so that the speculative server's acceptance on today's traffic stays known while it gets none. And in
a paired group (the two servers on one GPU), where a switch moves every conversation to the other
server, which must prefill it again:

    a switch to role r waits while  G_r(L)  <  R / (P * H)                        (reason switch_cost)

G_r(L) what r gives at L over the mode now, less 1, by the better of the curves' throughput and
TPOT (adaptive.py), as the watermarks follow the earlier of their crossings; R the tokens the group's requests hold
now (prompts and what they generated: each one's next turn resends them), P the prefill rate
(SPECGATE_PREFILL_TOK_S; 0: switches are not priced), H the curves' half-life
(SPECGATE_ADAPTIVE_HALF_LIFE_S): the span the estimate that calls for the switch weighs, taken as
how long the load it saw will last. The gain over H must pay for the GPU time the re-prefill takes.
Where the two servers tie, that holds the mode: measured on the simulated
H200 with 8k-token chats at 32 sessions, a switch half-way through a 12 s window re-prefilled
about 256k tokens (some 8 s of the GPU) and took the window's goodput to 0.58-0.79x of either fixed
choice. With short contexts R / P is a fraction of a second, and the rule changes little.

the speculative server's memory, under the policies that learn (adaptive, model): its KV pool holds
K tokens (the engine's own figure, SGLang's max_total_num_tokens), the group's requests t tokens
each on average (prompts and output so far, this gateway's), and each conversation comes back g
tokens larger (its new message: routing.Router.note_turn), so past K / (t + g) streams its
requests queue for memory and its prefix cache is evicted, however fast its steps are. So

    high' = min(high, floor(K / (t + g)))      low' = min(low, high' - max(1, ceil(high' / 4)))

(K summed over a pool's speculative servers), a class's high_c is capped alike. In a paired group
(SPECGATE_KV_FORECAST_S, F, 10 s by default) the tokens are read F seconds ahead, at their growth
over the last F (forecast.py: the least-squares slope less half its standard error, never a fall),
while they are under half the pool (routing.Router._growth_ahead), so that the cap a climbing load
will reach stops speculation while few conversations are there to prefill again on the baseline:
measured on the simulated H200, 8k-token chats opening over 20 s at 32 sessions, 12 s windows,
seeds 0-7, 0.98-1.02 of all-baseline's goodput against 0.84 reading them as they are (at 8 sessions,
where the pool never fills, 1.00 and 0.99 of all-speculative's). A switch off speculation at the
cap is not held for its re-prefill: staying re-prefills what the full pool evicts at every turn, a
switch once. On a shared GPU the speculative server's pool is the smaller (the draft's weights and
KV take their share): on the simulated H200, 229k tokens against the baseline's 419k, so 8k-token
chats fill it at about 27 streams, where the curves, which measure step times, put the crossover
near 40. Measured there at 32 sessions over 48 s: 2.81 requests a second of goodput with the cap
against 2.46 all-baseline and 1.37 all-speculative (new conversations, still short, go to
speculation until they grow); 0.71-0.94 with the cap's switch priced like any other, whose switches
came late and re-prefilled everything. In 12 s windows from a cold start the switch's one
re-prefill is most of the window (0.15-0.22x). threshold routes by its watermarks as configured.

Where memory, not speed, ends speculation in a paired group, every turn goes where the mode says,
the conversations cached on the speculative server included: they are prefilled again on the
baseline once. Keeping them on speculation until they ended (measured with the benchmark's
calibration at the wrong time scale, when it looked better) time-slices the shared GPU between
the two servers for as long as they last, with the speculative pool over-full: on the simulated
H200, 8k-token chats at 32 sessions, 12 s windows, seeds 0-3, 0.61, 0.44, 0.38 and 0.42 of
all-baseline's goodput against 1.03, 0.91, 0.76 and 0.74 with the switch (48 s windows, seeds 0
and 1: 5.27 and 4.94 requests a second against 5.27 and 5.08).

the baseline's memory, under the policies that learn: once every baseline server's KV pool is full,
a new request waits there for memory however fast its steps would be, while the speculative
servers' pools may stand half empty (on a shared GPU each server has a pool of its own). So a
request the mode or its class sends to the baseline goes to the speculative role instead when

    min_b u_b >= F   and   max_s u_s < (F if its conversation's cache is on the speculative role, else R)
    and its conversation's cache is not on the baseline, and the speculative role is up
                                                                                (reason kv_spill)

u a server's KV pool in use, over the servers that are up: its engine's reading (SGLang
token_usage, vLLM kv_cache_usage_perc), and for a speculative server the larger of that and this
gateway's tokens in flight there over the pool's size (the reading is a scrape old, and what was
spilled since is in the second; routing.Router.kv_used; where its engine says nothing, the
second alone), unknown (no spill) where neither is known; F
SPECGATE_KV_SPILL_AT (0: off), R SPECGATE_KV_SPILL_ROOM. In a fleet of groups, the group chosen
(by load) is the one whose pools are read. New conversations spill only while
the speculative pools are under R, leaving room for those there to grow; a conversation whose cache
is on the speculative role (the affinity table's: one spilled already) keeps it while they are
under F. A conversation whose cache is on the baseline waits
there: a move would prefill it again into the pool that has room, which costs more than waiting
for memory where it is cached. Probes, batch requests, failovers and stored responses never spill.
Measured on the simulated H200 pair, 8k-token chats at 128 sessions (the baseline's 419k tokens
full, the speculative server's 229k all but empty under the mode), 12 s windows, seeds 0-2: with
F 0.9 and R 0.6, 28-32% of requests spilled, 0.08-0.32 requests a second met the SLOs where
neither fixed choice served one, and 1.16-1.23x the better fixed choice's output tokens a second
(R 0.8, with the baseline read as the larger of its gauge and this gateway's count: 22-36%,
0.07-0.22, 0.98-1.19x); at 32 sessions, whose conversations fit, none spilled, and
on a pool at 128 sessions the goodput was the same with it and without (1.83 requests a second,
the mean of two seeds and two copies, each way).

batch requests (x-specgate-priority: batch), whatever the policy:

    backend = baseline                                          (reason batch)

and they are left out of L and S: a batch job of any size never moves interactive requests off
speculation, nor takes its room.

a turn of a conversation whose cache one server holds (affinity.py), whatever the policy but spillover,
in a pooled topology (the roles on disjoint GPUs):

    backend = the held server's role   if low < L < high and that role is up      (reason affinity)

since between the watermarks either role pays, and moving costs the conversation's re-prefill. Not
in a paired group: there the held role is the one the mode left, and a turn sent back to it
time-slices the shared GPU for as long as it decodes, every step of the other server's batch waiting
for one of its own. That costs far more than the re-prefill it saves (measured on the simulated
H200, 1k-token chats at 128 sessions: one turn held on the speculative server while 127 decoded on
the baseline took the window's goodput from 41.3 to 36.3 requests a second), so in a pair the
mode decides every turn's role, as it does every class's; affinity still picks the group.

a request of a traffic class whose acceptance A_c is known (classes.py), in a pooled topology
(the roles on disjoint GPUs, so that the baseline pool is idle hardware otherwise), whatever the
policy but spillover. Where the policy knows both roles' speed as measured by the calibration
(adaptive, model: Router.pool_gains), the request goes where the pool's throughput gains most from
it. With S and B each role's load per server (before the request), v_r(n) the per-stream steps a
second of role r at n streams (the calibration's curves; the model policy's fitted step times,
1 / step_r(n, n*t)), and A_S the mean acceptance of the streams on the speculative role (its
engine's reading, else the traffic's):

    G_spec = A_c * v_s(S+1) - S * A_S * (v_s(S) - v_s(S+1))        its tokens, less what it slows
    G_base =       v_b(B+1) - B *       (v_b(B) - v_b(B+1))          the others by
    backend = baseline                      if S >= K / (t + g) (memory, below)       (reason class)
            = the held role                 if G_other - G_held <= slack * c / 1000 * A_h * v_h(n+1)
                                                                                      (reason affinity)
            = speculative if G_spec >= G_base, else baseline                          (reason class)

where a conversation's cache is held (c its tokens cached there, A_h * v_h(n+1) the turn's own
speed on the held role, slack SPECGATE_AFFINITY_SLACK): the other role must gain more than `slack`
streams' speed per thousand tokens it would prefill again. So a class that accepts more takes the
speculative role to a higher load, one that accepts less leaves it for the idle baseline first,
and once both run, each new conversation goes where it adds most. The speeds are the calibration's
as measured, not corrected live: a pool learns a role's speed only while the other is idle, and a
corrected speed compared with one that was not picks the side the correction favours (measured on
the simulated H200, pooled, 8k-token chats at 8 sessions: the live correction read speculation
1.48x its curve at 4 streams from streams' decode alone, while the baseline's curve, which counts
prefill as well, was never corrected; class A, accepting 1.3, kept going to speculation, where its
turns decoded at 14-15 ms a token against 10 ms on the idle baseline, and the cell had 4.58 requests
a second of goodput against 5.17 with the curves as measured and 5.25 for the static split).
Where they are not (adaptive without a calibration file, its curves learnt live), each class has
watermarks of its own, high_c and low_c: the group's, solved at A_c instead of the traffic's acceptance
(Router.class_marks), and compared with S, the speculative pool's own load:

    backend = baseline                        if S >= high_c                          (reason class)
            = speculative                     if S <= low_c                           (reason class)
            = the role holding the conversation's cache, between them, where one is (reason affinity)
            = baseline if the class gains least, else speculative, where none is     (reason class)

Without any model of speed (threshold, or adaptive before its curves conclude anything) the
classes are ranked instead, below the high watermark:

    backend = speculative if the class gains most (acceptance >= the traffic's median) else baseline
                                                                              (reason class)

A paired group's two servers share one GPU, and there classes never split: a split time-slices
the GPU, so every stream waits for both servers' steps (measured on the simulated H200, 1k-token
chats of two classes at 128 sessions: 0.79-0.82x of the better fixed choice, where sending each
class to the server it does best on alone looked like a gain); the group's rule decides for all.

where L is the load (in-flight interactive requests over both servers, by the configured signal) and
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
import dataclasses
import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final, Literal, NamedTuple


class Role(enum.StrEnum):
    """What a server is for: speculative decoding, or plain decoding (the baseline). Its value is
    what metrics, headers and /routing say."""

    SPECULATIVE = "speculative"
    BASELINE = "baseline"


ROLES: tuple[Role, ...] = tuple(Role)
# The roles as module constants: in Python 3.11 an enum member read off its class is a slow lookup
# (the enum metaclass defines __getattr__), 48 ns a time against 5 for a global, measured with
# timeit, and the per-request decision names them a few dozen times (loadtest/decisions.py).
SPECULATIVE: Final = Role.SPECULATIVE
BASELINE: Final = Role.BASELINE
Mode = Role
PolicyName = Literal["threshold", "spillover", "adaptive", "model"]
# The policies that learn from live traffic: `model` is adaptive's rule with watermarks from the
# speed model (speedmodel.py) where the calibration has one.
LEARNING: tuple[PolicyName, ...] = ("adaptive", "model")
LoadSignal = Literal["local", "engine", "max"]
# Which rule keeps a turn on its server among a role's servers (affinity.py): the priced one, the one
# by requests in flight, or both (a turn moves only where each would move it).
AffinityRule = Literal["priced", "in_flight", "both"]
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
    "no_healthy_backend",
)


# Loads within this many requests of the least are ties, broken at random.
NEAR_TIE = 0.5


def other(backend: Role) -> Role:
    return BASELINE if backend == SPECULATIVE else SPECULATIVE


# Doublings of the wait between probes that are counted (2**32 times any wait is past any maximum).
MAX_PROBE_DOUBLINGS = 32
# A probe session sends at most this many requests: requests that bring back no usage (errors)
# must not make a session endless.
PROBE_MAX_REQUESTS = 4


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
    # Among a role's servers (SPECGATE_AFFINITY_RULE; priced and both need the model policy's fit).
    affinity_rule: AffinityRule = "both"
    # The learning policies' spill to speculation once the baseline's KV pools are full (the
    # module's F and R: SPECGATE_KV_SPILL_AT, 0 off, and SPECGATE_KV_SPILL_ROOM), as fractions.
    kv_spill_at: float = 0.0
    kv_spill_room: float = 0.0


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


def next_mode(load: int, state: PolicyState, cfg: PolicyConfig, now: float = 0.0) -> PolicyState:
    """The threshold policy's hysteresis, also applied when requests finish. A high watermark of 0
    means speculation never pays: everything goes to the baseline."""
    if cfg.high_watermark == 0:
        # Kept as it is when already there: an adaptive probe session lives in this state.
        return state if state.mode == BASELINE else PolicyState(BASELINE)
    if state.mode == SPECULATIVE and load >= cfg.high_watermark:
        return PolicyState(BASELINE)
    if state.mode == BASELINE:
        if load > cfg.low_watermark:
            return state if state.low_since is None else dataclasses.replace(state, low_since=None)
        since = now if state.low_since is None else state.low_since
        if now - since >= cfg.low_hold_s:
            return PolicyState(SPECULATIVE)
        return state if state.low_since is not None else dataclasses.replace(state, low_since=since)
    return state


def return_held(load: int, state: PolicyState, cfg: PolicyConfig) -> bool:
    """Whether the state stays in baseline mode only because the low watermark's hold runs."""
    return state.mode == BASELINE and state.low_since is not None and load <= cfg.low_watermark


def leaves_full_pool(to: Role, load: int, cfg: PolicyConfig) -> bool:
    """Whether a switch to `to` leaves a speculative KV pool that `load` fills (cfg.capacity)."""
    return to == BASELINE and cfg.capacity is not None and load >= cfg.capacity


def switch_pays(to: Role, load: int, cfg: PolicyConfig, margin: float) -> bool:
    """Whether a switch to `to` gains at least `margin` (LoadSnapshot.switch_margin) at `load`; a
    switch off speculation whose KV pool is full always does."""
    if margin <= 0 or cfg.curves is None or leaves_full_pool(to, load, cfg):
        return True
    return cfg.curves.gain(to, load) >= margin


def dwell_mode(
    load: int, state: PolicyState, cfg: PolicyConfig, now: float, fresh: bool = True, switch_margin: float = 0.0
) -> tuple[PolicyState, Reason | None]:
    """The adaptive policy's hysteresis: next_mode, but no switch before the mode is min_dwell_s
    old, none that would not win back its re-prefill (`switch_margin`, switch_pays), and no return
    to speculation on a stale acceptance reading (`fresh` False: the speculative server has had no
    traffic for accept_fresh_s, so what the watermarks say of it may be minutes old; a probe
    session re-measures it first, unless probes are off). A switch off a full speculative pool
    (load at or past cfg.capacity) waits for neither the dwell nor the price: the dwell keeps a
    load wandering about a watermark from switching back and forth, and past the pool's capacity
    the load is not wandering, speculation's requests queue for memory and its cache is evicted at
    every turn. Returns the state and why a switch was held back (None: none was)."""
    nxt = next_mode(load, state, cfg, now)
    if nxt.mode == state.mode:
        return nxt, None
    if now - state.since < cfg.min_dwell_s and not leaves_full_pool(nxt.mode, load, cfg):
        return state, "dwell_hold"
    if not switch_pays(nxt.mode, load, cfg, switch_margin):
        return state, "switch_cost"
    if nxt.mode == SPECULATIVE and not fresh and cfg.probe_s > 0:
        return dataclasses.replace(state, probing=True), "dwell_hold"
    return PolicyState(nxt.mode, since=now), None


def accept_fresh(idle_since: float | None, now: float, cfg: PolicyConfig) -> bool:
    """Whether the speculative server had traffic recently enough for its acceptance reading."""
    return idle_since is None or now - idle_since <= cfg.accept_fresh_s


def probe_due(snapshot: LoadSnapshot, state: PolicyState, cfg: PolicyConfig, load: int) -> bool:
    """Whether the next request should go to the idle speculative server to re-measure acceptance:
    at once during a probe session, else after a wait that doubles with each probe."""
    idle = snapshot.speculative_idle_since
    if cfg.probe_s <= 0 or state.mode != BASELINE or idle is None or load >= cfg.probe_max_load:
        return False
    if cfg.capacity is not None and load > max(cfg.low_watermark, hysteresis_low(cfg.capacity)):
        return False
    if not snapshot.healthy.get(SPECULATIVE, False):
        return False
    if state.probing:
        return True
    # The exponent is bounded: past the maximum wait more doublings change nothing, and 2.0**1024
    # overflows (a count that once grew by one a request while no copy could be sent).
    wait = min(cfg.probe_s * 2.0 ** min(state.probes, MAX_PROBE_DOUBLINGS), max(cfg.probe_s, cfg.probe_max_s))
    return snapshot.now - max(idle, state.since) >= wait


def near_ties(loads: Sequence[tuple[str, float]]) -> list[str]:
    """The names whose load is within NEAR_TIE of the least: a choice among them is as good as
    any. Choosing at random among them, not the first, is what keeps several gateways from all
    sending the next request to the same server. The band is narrow because the loads it compares
    are this gateway's own requests now plus a slow average of the others' (inflight.py): each
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


def settle(
    load: int,
    spec_load: int,
    state: PolicyState,
    cfg: PolicyConfig,
    now: float,
    fresh: bool,
    switch_margin: float = 0.0,
) -> PolicyState:
    """The mode after the load or health changed, with no request to place: every policy's rule
    (`fresh`: accept_fresh, and `switch_margin`: LoadSnapshot's, read by the adaptive rule only)."""
    return _settled(load, spec_load, state, cfg, now, fresh, switch_margin)[0]


def _settled(
    load: int, spec_load: int, state: PolicyState, cfg: PolicyConfig, now: float, fresh: bool, switch_margin: float
) -> tuple[PolicyState, Reason | None]:
    """The next state, and why a switch was held back (adaptive's dwell and switch cost)."""
    if cfg.policy == "threshold":
        return next_mode(load, state, cfg, now), None
    if cfg.policy in LEARNING:
        return dwell_mode(load, state, cfg, now, fresh, switch_margin)
    return PolicyState(SPECULATIVE if spec_load < cfg.spillover_limit else BASELINE), None


def decide(snapshot: LoadSnapshot, state: PolicyState, cfg: PolicyConfig) -> Decision:
    spec_load = backend_load(snapshot, SPECULATIVE, cfg.load_signal)
    load = spec_load + backend_load(snapshot, BASELINE, cfg.load_signal)
    fresh = accept_fresh(snapshot.speculative_idle_since, snapshot.now, cfg)
    was_probing = state.probing
    state, held = _settled(load, spec_load, state, cfg, snapshot.now, fresh, snapshot.switch_margin)
    choice: Role = state.mode
    reason: Reason
    if cfg.policy == "spillover":
        reason = "light_load" if choice == SPECULATIVE else "spillover"
    else:
        reason = held or _reason(choice, load, state, cfg)
    if cfg.policy in LEARNING and probe_due(snapshot, state, cfg, load):
        # A session's first probe counts toward the wait before the next session.
        probes = state.probes if state.probing else min(state.probes + 1, MAX_PROBE_DOUBLINGS)
        if cfg.probe_shadow:
            # A shadow is a session of its own; the request itself goes on as decided.
            shadow = dataclasses.replace(state, probes=probes, probing=False)
            return _checked(choice, reason, shadow, snapshot, load)._replace(shadow=True)
        state = _probe_sent(dataclasses.replace(state, probes=probes, probing=True), was_probing)
        return Decision(SPECULATIVE, "probe", state, load)
    return _checked(choice, reason, state, snapshot, load)


# The reasons a decision is the mode's own choice (not a probe, a batch request, a failover...).
_MODE_REASONS = frozenset({"light_load", "heavy_load", "hysteresis_hold", "return_hold", "dwell_hold", "switch_cost"})


def affinity_choice(
    decision: Decision, held: Role, cfg: PolicyConfig, healthy: Mapping[Role, bool], pooled: bool = True
) -> Decision:
    """The decision for a turn whose cache a server of role `held` holds (the module's rule);
    `pooled`: the roles are on disjoint GPUs (a pair's are not, and there the mode decides)."""
    if not pooled or decision.backend is None or decision.backend == held or decision.reason not in _MODE_REASONS:
        return decision
    if cfg.policy == "spillover" or not healthy.get(held, False):
        return decision
    if cfg.low_watermark < decision.load < cfg.high_watermark:
        return Decision(held, "affinity", decision.state, decision.load)
    return decision


def class_choice(
    decision: Decision,
    view: ClassView,
    cfg: PolicyConfig,
    healthy: Mapping[Role, bool],
    pooled: bool,
    spec_load: int = 0,
    held: Role | None = None,
    gains: PoolGains | None = None,
    cached_tokens: int = 0,
) -> Decision:
    """The decision for a request of a traffic class (the module's rule); `held`: the role of the
    server holding its conversation's cache, if any, which holds `cached_tokens` of it; `gains`:
    what each role gains with it, where both roles' speeds are known."""
    if not pooled or decision.backend is None or decision.reason not in _MODE_REASONS or cfg.policy == "spillover":
        return decision
    if gains is not None:
        return _gained_choice(decision, gains, cfg, healthy, spec_load, held, cached_tokens)
    if view.high is None or view.low is None:
        return _ranked_choice(decision, view.gains, cfg, healthy)
    reason: Reason
    choice: Role
    if spec_load >= (view.high if cfg.capacity is None else min(view.high, cfg.capacity)):
        choice, reason = BASELINE, "class"
    elif spec_load <= view.low:
        choice, reason = SPECULATIVE, "class"
    elif held is not None and healthy.get(held, False):
        choice, reason = held, "affinity"
    else:
        choice, reason = (BASELINE if view.gains is False else SPECULATIVE), "class"
    if not healthy.get(choice, False):
        return decision
    return Decision(choice, reason, decision.state, decision.load)


def _gained_choice(
    decision: Decision,
    gains: PoolGains,
    cfg: PolicyConfig,
    healthy: Mapping[Role, bool],
    spec_load: int,
    held: Role | None,
    cached_tokens: int,
) -> Decision:
    """The class rule where each role's gain is known (the module's rule)."""
    reason: Reason = "class"
    if cfg.capacity is not None and spec_load >= cfg.capacity:
        choice = BASELINE
    else:
        choice = SPECULATIVE if gains.speculative >= gains.baseline else BASELINE
        if held is not None and held != choice and healthy.get(held, False):
            gain_held, speed_held = gains.of(held)
            if gains.of(choice)[0] - gain_held <= cfg.affinity_slack * cached_tokens / 1000 * speed_held:
                choice, reason = held, "affinity"
    if not healthy.get(choice, False):
        return decision
    return Decision(choice, reason, decision.state, decision.load)


def _ranked_choice(decision: Decision, gains: bool | None, cfg: PolicyConfig, healthy: Mapping[Role, bool]) -> Decision:
    """The class rule without a speed model: by the class's rank, below the high watermark."""
    if gains is None or decision.load >= cfg.high_watermark:
        return decision
    choice = SPECULATIVE if gains else BASELINE
    if not healthy.get(choice, False):
        return decision
    return Decision(choice, "class", decision.state, decision.load)


# The decisions a full baseline may send to speculation: the mode's and a class's.
_SPILLABLE = _MODE_REASONS | {"class"}


def spill_on(cfg: PolicyConfig) -> bool:
    """Whether a full baseline spills at all: a learning policy, with SPECGATE_KV_SPILL_AT above 0."""
    return cfg.kv_spill_at > 0 and cfg.policy in LEARNING


def spills(decision: Decision, held: Role | None, cfg: PolicyConfig) -> bool:
    """Whether the baseline's full KV pools may send `decision` to speculation (the module's rule),
    before any pool is read: a mode's or a class's choice of the baseline, with the spill on, for a
    request whose conversation's cache (`held`) is not on the baseline."""
    return decision.backend == BASELINE and held != BASELINE and decision.reason in _SPILLABLE and spill_on(cfg)


def kv_spill(
    decision: Decision,
    held: Role | None,
    cfg: PolicyConfig,
    healthy: Mapping[Role, bool],
    baseline_used: float | None,
    speculative_used: float | None,
) -> Decision:
    """The decision once the KV pools are read (the module's rule): `baseline_used` the least full
    of the baseline's pools, `speculative_used` the most full of the speculative role's (fractions;
    None: unknown, no spill)."""
    if not spills(decision, held, cfg) or not healthy.get(SPECULATIVE, False):
        return decision
    if baseline_used is None or speculative_used is None or baseline_used < cfg.kv_spill_at:
        return decision
    room = cfg.kv_spill_at if held == SPECULATIVE else cfg.kv_spill_room
    if speculative_used >= room:
        return decision
    # The request itself measures the speculative server now: a shadow due goes unsent, uncounted.
    state = shadow_unsent(decision.state) if decision.shadow else decision.state
    return Decision(SPECULATIVE, "kv_spill", state, decision.load)


def decide_batch(snapshot: LoadSnapshot, state: PolicyState, cfg: PolicyConfig) -> Decision:
    """A batch request's backend: the baseline (the throughput choice), the mode left as it is."""
    return _checked(BASELINE, "batch", state, snapshot, total_load(snapshot, cfg.load_signal))


def _probe_sent(state: PolicyState, was_probing: bool) -> PolicyState:
    """A probe request went out: counted in its session (a new one unless one was under way); the
    session ends at PROBE_MAX_REQUESTS."""
    if not was_probing:
        state = dataclasses.replace(state, session=state.session + 1, session_requests=0, session_tokens=0)
    sent = state.session_requests + 1
    if sent >= PROBE_MAX_REQUESTS:
        return dataclasses.replace(state, probing=False, session_requests=0, session_tokens=0)
    return dataclasses.replace(state, session_requests=sent)


def probe_returned(state: PolicyState, tokens: int, probe_tokens: int) -> PolicyState:
    """A probe of the session under way came back with `tokens` output tokens: the session ends
    once `probe_tokens` came back (enough for the engine to refresh its acceptance reading)."""
    total = state.session_tokens + tokens
    if total >= probe_tokens:
        return dataclasses.replace(state, probing=False, session_requests=0, session_tokens=0)
    return dataclasses.replace(state, session_tokens=total)


def shadow_unsent(state: PolicyState) -> PolicyState:
    """The shadow a decision asked for could not be sent: it does not count as a probe."""
    return dataclasses.replace(state, probes=max(0, state.probes - 1))


def probes_restarted(state: PolicyState) -> PolicyState:
    """The traffic changed (acceptance moved): probe again soon rather than after a doubled wait."""
    return dataclasses.replace(state, probes=0) if state.probes else state


def _reason(choice: Role, load: int, state: PolicyState, cfg: PolicyConfig) -> Reason:
    if choice == SPECULATIVE:
        return "light_load"
    if load >= cfg.high_watermark:
        return "heavy_load"
    return "return_hold" if return_held(load, state, cfg) else "hysteresis_hold"


def _checked(choice: Role, reason: Reason, state: PolicyState, snapshot: LoadSnapshot, load: int) -> Decision:
    """The decision, unless the chosen server is down."""
    if not snapshot.healthy.get(choice, False):
        if snapshot.healthy.get(other(choice), False):
            return Decision(other(choice), "only_healthy", state, load)
        return Decision(None, "no_healthy_backend", state, load)
    return Decision(choice, reason, state, load)
