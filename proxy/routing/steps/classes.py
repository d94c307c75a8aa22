"""Traffic class: where speculation has room for part of the traffic, a pool gives it to the
classes that gain most from it (their acceptance: proxy/routing/classes.py learns it).

a request of a traffic class whose acceptance A_c is known (classes.py), in a pooled topology
(the roles on disjoint GPUs, so that the baseline pool is idle hardware otherwise), whatever the
policy but spillover. Where the policy knows both roles' speed as measured by the calibration
(adaptive, model: ClassPricing.pool_gains), the request goes where the pool's throughput gains most from
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
            = the other role, where the role above would miss an SLO and the other would not,
              is up and (the speculative role) has room                              (reason slo)

where a role misses SPECGATE_SLO_TPOT_MS if it would decode the request slower (1000 / (A_r *
v_r(n+1)) ms a token), and SPECGATE_SLO_TTFT_MS if, with SPECGATE_PREFILL_TOK_S (P) set, its first
token would come later: 1000 * (Q_r + t - c_r) / P ms, Q_r the prompt tokens of this gateway's
requests still waiting for their first byte on the role's least backed-up server (leases.py), t the
prompt's tokens, c_r those cached there (the conversation's, on the role holding it; else none). So
a turn is not moved off a long cached conversation for its decode speed where prefilling it again
would cost its first token the SLO.

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
(ClassPricing.marks), and compared with S, the speculative pool's own load:

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
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final, Protocol

from ...policy.base import (
    BASELINE,
    MODE_REASONS,
    ROLES,
    SPECULATIVE,
    ClassView,
    Decision,
    PolicyConfig,
    PoolGains,
    Reason,
    Role,
    backend_load,
    marginal_gain,
    other,
)
from ...policy.beliefs import Adaptive
from ...policy.speedmodel import StepModel
from .base import Ask, Here

# Class views (a rank and an acceptance to 0.01) kept between estimates: more than traffic has.
MAX_CLASS_VIEWS = 256
# Loads whose curve speeds are kept (ClassPricing._rates): a pool's loads per server, and a few fractions.
MAX_RATES_SEEN = 4096
# A pool's gains kept (ClassPricing.pool_gains), by acceptance, loads and the speculative role's acceptance.
MAX_GAINS_SEEN = 4096
# A class whose acceptance says nothing more: its rank only.
_RANKED: dict[bool | None, ClassView] = {g: ClassView(g) for g in (None, True, False)}


class TrafficClass:
    name: Final = "class"
    reasons: Final[tuple[Reason, ...]] = ("class", "affinity", "slo")

    def place(self, ask: Ask, here: Here, decision: Decision | None) -> Decision | None:
        klass = ask.klass
        if klass is None or not here.pooled or decision is None or decision.reason not in MODE_REASONS:
            return None
        snapshot, cfg = here.snapshot, here.cfg
        spec = backend_load(snapshot, SPECULATIVE, cfg.load_signal)
        base = backend_load(snapshot, BASELINE, cfg.load_signal)
        gains = None if klass.accept is None else here.group.pool_gains(klass.accept, (spec, base))
        ttft = _ttft_ms(ask, here) if gains is not None else None
        found = class_choice(
            decision, klass, cfg, snapshot.healthy, True, spec, ask.held, gains, ask.cached_tokens, ttft
        )
        return None if found is decision else found


def _ttft_ms(ask: Ask, here: Here) -> Mapping[Role, float] | None:
    """Each role's predicted time to first token for the request, in ms (the module's rule; None
    where there is no TTFT SLO or no prefill rate to predict it at)."""
    cfg = here.cfg
    if cfg.slo_ttft_ms is None or cfg.prefill_tok_s <= 0:
        return None
    cached = min(ask.cached_tokens, ask.prompt_tokens)
    return {
        role: 1000.0
        * (here.group.prefill_ahead(role) + ask.prompt_tokens - (cached if role == ask.held else 0))
        / cfg.prefill_tok_s
        for role in ROLES
    }


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
    ttft_ms: Mapping[Role, float] | None = None,
) -> Decision:
    """The decision for a request of a traffic class (the module's rule); `held`: the role of the
    server holding its conversation's cache, if any, which holds `cached_tokens` of it; `gains`:
    what each role gains with it, where both roles' speeds are known; `ttft_ms`: its predicted
    time to first token on each role, where predicted."""
    if not pooled or decision.backend is None or decision.reason not in MODE_REASONS or cfg.policy == "spillover":
        return decision
    if gains is not None:
        return _gained_choice(decision, gains, cfg, healthy, spec_load, held, cached_tokens, ttft_ms)
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
    ttft_ms: Mapping[Role, float] | None = None,
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
        if _misses(gains, choice, cfg, ttft_ms):
            alt = other(choice)
            full = alt is SPECULATIVE and cfg.capacity is not None and spec_load >= cfg.capacity
            if not full and healthy.get(alt, False) and not _misses(gains, alt, cfg, ttft_ms):
                choice, reason = alt, "slo"
    if not healthy.get(choice, False):
        return decision
    return Decision(choice, reason, decision.state, decision.load)


def _misses(gains: PoolGains, role: Role, cfg: PolicyConfig, ttft_ms: Mapping[Role, float] | None) -> bool:
    """Whether the request on `role` would miss an SLO: decode slower than SPECGATE_SLO_TPOT_MS (its
    speed there, tokens/s, the curves' or the fit's at the role's load with it, under 1000 / SLO),
    or wait longer for its first token than SPECGATE_SLO_TTFT_MS, where predicted."""
    if cfg.slo_tpot_ms is not None and gains.of(role)[1] * cfg.slo_tpot_ms < 1000.0:
        return True
    return ttft_ms is not None and cfg.slo_ttft_ms is not None and ttft_ms[role] > cfg.slo_ttft_ms


def _ranked_choice(decision: Decision, gains: bool | None, cfg: PolicyConfig, healthy: Mapping[Role, bool]) -> Decision:
    """The class rule without a speed model: by the class's rank, below the high watermark."""
    if gains is None or decision.load >= cfg.high_watermark:
        return decision
    choice = SPECULATIVE if gains else BASELINE
    if not healthy.get(choice, False):
        return decision
    return Decision(choice, "class", decision.state, decision.load)


class Speeds(Protocol):
    """What pricing a class reads of its group."""

    @property
    def adaptive(self) -> Adaptive | None: ...
    @property
    def speed(self) -> StepModel | None: ...
    def engine_accept(self) -> float | None: ...
    def backend_load(self, role: Role) -> int: ...
    def up(self, role: Role) -> int: ...
    def now(self) -> float: ...


class ClassPricing:
    """What a pooled group tells the class step of a class: its view (ClassView), and what each
    role gains with one more of its streams (PoolGains), each kept until the estimate, the context
    or the servers' health move (every class's request asks, and working one out walks the curves)."""

    __slots__ = ("_gains_seen", "_group", "_pooled", "_rates_seen", "_views")

    def __init__(self, group: Speeds, pooled: bool) -> None:
        self._group = group
        self._pooled = pooled
        self._views: dict[tuple[bool | None, int, int], ClassView] = {}
        # Each role's curve speeds at a load and one more (_rates), as asked; under the model
        # policy, its fitted ones at a context too (to 1%, StepModel's key).
        self._rates_seen: dict[tuple[Role, float, int], tuple[float, float]] = {}
        self._gains_seen: dict[tuple[float, int, int, float, int], PoolGains] = {}

    def forget(self, views: bool = True, gains: bool = True) -> None:
        if views:
            self._views.clear()
        if gains:
            self._gains_seen.clear()

    def view(self, gains: bool | None, accept: float | None) -> ClassView:
        """What the policy is told of a traffic class ranked `gains`, of acceptance `accept` (a
        pair's classes never split: nothing more to solve)."""
        if accept is None or not self._pooled:
            return _RANKED[gains]
        # What stands until the estimate moves (the adaptive curves) or, under the model policy,
        # the context (to 1%) or a correction (observe). Keyed by the acceptance in hundredths:
        # round(x, 2) costs a third of a microsecond, round(x * 100) a tenth of that.
        cents = round(accept * 100)
        speed = self._group.speed
        key = (gains, cents, 0 if speed is None else speed.context_key)
        view = self._views.get(key)
        if view is None:
            if len(self._views) >= MAX_CLASS_VIEWS:
                self._views.clear()
            rounded = cents / 100
            marks = self.marks(rounded)
            high, low = (None, None) if marks is None else marks
            view = self._views[key] = ClassView(gains, high, low, rounded)
        return view

    def marks(self, accept: float) -> tuple[int, int] | None:
        """(high, low) for a traffic class of acceptance `accept` (class_choice): the speed model's
        at the group's context, or the adaptive curves'; None under a policy without a model of
        speed."""
        group = self._group
        if group.speed is not None:
            return group.speed.class_watermarks(accept)
        a = group.adaptive
        return None if a is None else a.watermarks_at(accept, group.now())

    def pool_gains(self, accept: float, loads: tuple[int, int] | None = None) -> PoolGains | None:
        """What each role of a pool gains with one more stream of acceptance `accept`
        (marginal_gain), each role's load (`loads`, speculative and baseline, where the caller has
        read them) spread over its healthy servers; None in a pair, or where a role's speed is not
        known. The speeds are the calibration's as measured (the fitted step times under the model
        policy, else the curves), not corrected live: a pool learns a role's speed only while the
        other is idle, and a speed corrected on one side compared with one that was not would pick
        a side by the correction."""
        group = self._group
        a, speed = group.adaptive, group.speed
        if not self._pooled or a is None or (speed is None and a.model.prior is None):
            return None
        spec, base = loads if loads is not None else (group.backend_load(r) for r in ROLES)
        on_spec = group.engine_accept() or a.estimate.accept_live or accept
        key = (accept, spec, base, on_spec, 0 if speed is None else speed.context_key)
        gains = self._gains_seen.get(key)
        if gains is None:
            g_spec, v_spec = self._gain(SPECULATIVE, spec, accept, on_spec)
            g_base, v_base = self._gain(BASELINE, base, 1.0, 1.0)
            if len(self._gains_seen) >= MAX_GAINS_SEEN:
                self._gains_seen.clear()
            gains = self._gains_seen[key] = PoolGains(g_spec, g_base, v_spec, v_base)
        return gains

    def _gain(self, role: Role, load: int, accept: float, held_accept: float) -> tuple[float, float]:
        """(what `role`, holding `load`, gains with one more stream of acceptance `accept`, that
        stream's speed)."""
        streams = load / self._group.up(role)
        now, more = self._rates(role, streams)
        return marginal_gain(accept, streams, held_accept, now, more), accept * more

    def _rates(self, role: Role, streams: float) -> tuple[float, float]:
        """A stream's steps a second on `role` at `streams` streams a server and at one more: the
        model policy's fitted step times at the group's context (to 1%), else the calibration's
        curves; neither changes (the fit is not corrected here, pool_gains), so each is kept, as
        every class's request asks."""
        speed = self._group.speed
        key = (role, streams, 0 if speed is None else speed.context_key)
        rates = self._rates_seen.get(key)
        if rates is None:
            if speed is not None:
                fit, t = speed.fit.of(role), speed.context
                n, m = max(streams, 1.0), streams + 1
                now, more = 1.0 / max(fit.step_s(n, n * t), 1e-9), 1.0 / max(fit.step_s(m, m * t), 1e-9)
            else:
                a = self._group.adaptive
                assert a is not None
                v = a.model.prior_v
                found, found_more = v(role, max(streams, 1.0)), v(role, streams + 1)
                assert found is not None and found_more is not None  # pool_gains checked there is a prior
                now, more = found, found_more
            if len(self._rates_seen) >= MAX_RATES_SEEN:
                self._rates_seen.clear()
            rates = self._rates_seen[key] = (now, more)
        return rates
