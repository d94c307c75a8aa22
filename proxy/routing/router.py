"""The router: the one owner of the policy's state. It snapshots load and health, asks the pure
policy, admits the request (a lease), and records every decision and mode switch.

Under the adaptive policy it also owns what the policy believes: the speed model (adaptive.py)
fed by relayed streams and the speculative server's live acceptance, and the live watermarks,
re-estimated at most every UPDATE_EVERY_S and moved at a bounded rate. Under the model policy, with
a fit in the calibration file, the watermarks come from the step-time model (speedmodel.py) instead,
solved for each new request at the group's load, context and acceptance.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import random
import time
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

from ..fleet.engines import ENGINES
from ..fleet.servers import Server, ServerView
from ..fleet.topology import Group, Topology
from ..observability.metrics import Metrics
from ..policy.base import (
    BASELINE,
    LEARNING,
    ROLES,
    SPECULATIVE,
    ClassView,
    Decision,
    LoadSnapshot,
    PolicyConfig,
    PolicyState,
    PoolGains,
    Role,
    accept_fresh,
    affinity_choice,
    backend_load,
    class_choice,
    decide,
    decide_batch,
    hysteresis_low,
    kv_spill,
    least_loaded,
    marginal_gain,
    probe_returned,
    probes_restarted,
    settle,
    shadow_unsent,
    spills,
    total_load,
)
from ..policy.beliefs import ACCEPT_CHANGE, UPDATE_EVERY_S, Adaptive, AdaptiveConfig, stream_accept
from ..policy.calibration import MAX_WATERMARK, Calibration
from ..policy.evidence import AcceptanceEvidence
from ..policy.forecast import Trend
from ..policy.speedmodel import ModelLimits, StepModel
from .affinity import Held, Outcome, keep, moved_cost, stays, turn_cost
from .classes import ClassBook
from .leases import InflightTracker, Lease

log = logging.getLogger("specgate.routing")

# Class views (a rank and an acceptance to 0.01) kept between estimates: more than traffic has.
MAX_CLASS_VIEWS = 256
# Loads whose curve speeds are kept (Router._rates): a pool's loads per server, and a few fractions.
MAX_RATES_SEEN = 4096
# A pool's gains kept (Router.pool_gains), by acceptance, loads and the speculative role's acceptance.
MAX_GAINS_SEEN = 4096
# Returning turns a router's turn_growth is the mean of, at most (then a moving average).
GROWTH_TURNS = 64
# The share of the speculative pool under which its footprint is read ahead (_growth_ahead).
FORECAST_UNDER = 0.5
# A response's output tokens until responses say (Router.out_tokens): chat turns run a few hundred,
# and the affinity rule only weighs one server's cost against another's with it.
DEFAULT_OUT_TOKENS = 256.0
# The weight of one response in Router.out_tokens' moving average.
OUT_ALPHA = 0.05
# A class whose acceptance says nothing more: its rank only.
_RANKED: dict[bool | None, ClassView] = {g: ClassView(g) for g in (None, True, False)}
# Where the traffic's acceptance was read, when its classes' mix stands for part of it.
_MIXED = {s: f"from traffic classes and {s}" for s in ("from probe streams", "live")}


class Router:
    """One group's router (a paired group, or the pool): its mode, its adaptive beliefs, and the
    load and health of its servers, read through their views. `Fleet` holds one per group."""

    # Every request reads a dozen of these. Slots keep each read a fixed offset: an instance dict
    # shares its keys with its class's only up to 30 of them in CPython 3.11, past which each read
    # is a lookup (a 31st attribute made the plain model policy's decision 0.2 us slower).
    __slots__ = (
        "_accept_now",
        "_accept_seen",
        "_capped",
        "_class_views",
        "_classes",
        "_clock",
        "_gains_seen",
        "_kv_read_at",
        "_members",
        "_metrics",
        "_pooled",
        "_rates_seen",
        "_rng",
        "_server_caps",
        "_servers",
        "_spec_idle_since",
        "_spec_views",
        "_switch_per_token",
        "_turns",
        "adaptive",
        "cfg",
        "evidence",
        "footprint",
        "group",
        "kv_streams",
        "last_load",
        "out_tokens",
        "speed",
        "state",
        "tracker",
        "turn_growth",
    )

    def __init__(
        self,
        cfg: PolicyConfig,
        servers: Mapping[str, ServerView],
        metrics: Metrics,
        tracker: InflightTracker,
        group: Group,
        adaptive: AdaptiveConfig | None = None,
        calibration: Calibration | None = None,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
        pooled: bool = False,
        classes: ClassBook | None = None,
    ) -> None:
        self.cfg = cfg
        self.group = group
        # The traffic classes' acceptance (classes.py), which the traffic's own is reckoned from
        # where they know it (accept_live).
        self._classes = classes
        # A pool's roles run on disjoint GPUs (topology.py): its baseline is idle hardware otherwise.
        self._pooled = pooled
        self._servers = servers
        self._metrics = metrics
        self._clock = clock
        self._rng = rng or random.Random()
        self.last_load = 0
        self.state = PolicyState()  # no dwell before the first switch
        self.tracker = tracker
        # Each role's servers with their views and in-flight counters, for the per-request snapshot
        # (the group's membership is fixed, as is each server's counters object).
        self._members = tuple(
            (role, tuple((s, servers[s], tracker.load_of(s)) for s in group.of(role))) for role in ROLES
        )
        self._spec_views = tuple(servers[s] for s in group.of(SPECULATIVE))
        self._spec_idle_since: float | None = clock()
        # Acceptance measured from probe streams, pooled by client (evidence.py): it stands while
        # the newest reading is younger than accept_fresh_s, then the engine's reading (which
        # includes the probes' steps once refreshed) takes over again.
        self.evidence = AcceptanceEvidence(cfg.accept_fresh_s)
        self._accept_seen: float | None = None
        # The acceptance and its source as _update last read them (accept_live), which the model
        # policy solves at for every request and lease: read at most every UPDATE_EVERY_S, and at
        # once when a probe's evidence comes, as the adaptive policy reads it.
        self._accept_now: tuple[float | None, str] = (None, "live")
        self.adaptive: Adaptive | None = None
        # What the policy is told of a class, by rank and acceptance (rounded): a class's every
        # request asks, and solving its watermarks walks the curves. Solved again once the
        # estimate moves.
        self._class_views: dict[tuple[bool | None, int, int], ClassView] = {}
        # Each role's curve speeds at a load and one more (_rates), as asked; under the model
        # policy, its fitted ones at a context too (to 1%, StepModel's key).
        self._rates_seen: dict[tuple[Role, float, int], tuple[float, float]] = {}
        # pool_gains' answers, as asked by every class's request in a pool (a microsecond each to
        # work out, where the loads and acceptances repeat): forgotten with the class views, when
        # the estimate is read again or a server's health changes.
        self._gains_seen: dict[tuple[float, int, int, float, int], PoolGains] = {}
        # The model policy's step-time model: None without a fit (the adaptive rule then, as it is).
        self.speed: StepModel | None = None
        # 1 / (P * H), which prices a switch of a paired group per token it re-prefills
        # (policy.switch_pays; 0: not priced, as in a pool, whose conversations stay where their
        # cache is between the watermarks).
        self._switch_per_token = 0.0
        # Streams the speculative role holds before its KV pool is full (capacity(), re-read at
        # most every UPDATE_EVERY_S), and the configuration capped to it, for the one it capped.
        self.kv_streams: int | None = None
        self._server_caps: dict[Role, int] = {}
        # Tokens a conversation's next turn adds to what its last left cached (note_turn): the mean
        # of the last GROWTH_TURNS returning turns, at most.
        self.turn_growth = 0.0
        self._turns = 0
        # The group's output tokens per response, a moving average (note_output): a turn's decode
        # steps as the affinity rule prices them (turn_cost).
        self.out_tokens = DEFAULT_OUT_TOKENS
        self._kv_read_at = -math.inf
        # The tokens the group's conversations would hold on the speculative pool, sampled with each
        # capacity reading, in a paired group under a learning policy with kv_forecast_s (policy.py:
        # the cap is read at where their growth takes them kv_forecast_s ahead). None: read as they are.
        self.footprint: Trend | None = None
        self._capped: tuple[PolicyConfig, int, PolicyConfig] | None = None
        if cfg.policy in LEARNING:
            if adaptive is None:
                raise ValueError("the adaptive policy needs its AdaptiveConfig")
            static = (cfg.high_watermark, cfg.low_watermark)
            self.adaptive = Adaptive(adaptive, calibration, static, clock())
            high, low = self.adaptive.watermarks()
            self.cfg = dataclasses.replace(cfg, high_watermark=high, low_watermark=low)
            if not pooled and adaptive.kv_forecast_s > 0:
                self.footprint = Trend(adaptive.kv_forecast_s)
            if not pooled and adaptive.prefill_tok_s > 0:
                self._switch_per_token = 1.0 / (adaptive.prefill_tok_s * adaptive.half_life_s)
                self.cfg = dataclasses.replace(self.cfg, curves=self.adaptive.curves())
            if cfg.policy == "model" and calibration is not None and calibration.model is not None:
                limits = ModelLimits(
                    min_watermark=adaptive.min_watermark, max_watermark=adaptive.max_watermark, margin=adaptive.margin
                )
                counts = {role: len(group.of(role)) for role in ROLES}
                self.speed = StepModel(calibration.model, limits, counts)
                self._accept_now = self.accept_live(clock())
                self._model_watermarks()
        self._publish_watermarks()
        self._publish_mode()
        self.refresh()

    def now(self) -> float:
        return self._clock()

    def role_count(self, role: Role) -> int:
        """This gateway's requests in flight on the group's servers of `role`."""
        return sum(self.tracker.count(s) for s in self.group.of(role))

    def interactive_count(self, role: Role) -> int:
        """Of `role_count`, the interactive requests: the load the mode compares."""
        return sum(self.tracker.count(s) - self.tracker.batch(s) for s in self.group.of(role))

    def server_healthy(self, server: str) -> bool:
        return self._servers[server].healthy

    def server_role(self, server: str) -> Role:
        return self._servers[server].role

    def server_accept(self, server: str) -> float | None:
        """The server's acceptance length as its engine last reported it (None: none)."""
        return self._servers[server].spec_accept_length

    def healthy_map(self) -> dict[Role, bool]:
        return {role: any(self._servers[s].healthy for s in self.group.of(role)) for role in ROLES}

    def engine_loads(self) -> dict[Role, int | None]:
        """Each role's engine load: the others' requests as last read plus ours now (None: unknown)."""
        out: dict[Role, int | None] = {}
        for role in ROLES:
            servers = self.group.of(role)
            if not any(self.tracker.was_read(s) for s in servers):
                out[role] = None  # never read: the policy counts ours (backend_load)
            else:
                out[role] = sum(self.server_load(s) - self.tracker.batch(s) for s in servers)
        return out

    def server_load(self, server: str) -> int:
        """One server's load by the configured signal, as the mode compares it (`max` is the
        engine's: it includes ours): the others' part is the larger of the last reading and its
        smoothed value, so a rise counts at once and a fall only once it lasts (a flickering gauge,
        llama-server's, or a group whose load wanders around a watermark, does not flap)."""
        local = self.tracker.count(server)
        if self.cfg.load_signal == "local" or not self.tracker.was_read(server):
            return local
        t = self.tracker
        if self._servers[server].engine_load is None:
            # Unreadable now: the others as they last stood, not nothing (with several replicas
            # ours alone is a fraction, and reading it as the whole would flip the mode at full load).
            return round(t.others_smooth(server)) + local
        return max(t.others(server), round(t.others_smooth(server))) + local

    def placement_load(self, server: str) -> float:
        """One server's load, unrounded, for choosing among servers and groups: ours now, plus the
        others' (slowly smoothed, see inflight.py) under the engine signals."""
        local = self.tracker.count(server)
        if self.cfg.load_signal == "local" or not self.tracker.was_read(server):
            return local
        return self.tracker.others_balance(server) + local

    def group_placement_load(self) -> float:
        return sum(self.placement_load(s) for role in ROLES for s in self.group.of(role))

    def snapshot(self) -> LoadSnapshot:
        # Built for every request: one pass over each role's servers, the same figures as
        # interactive_count, engine_loads and healthy_map (measured: 4.3 us before, on two servers).
        counts: dict[Role, int] = {}
        engine: dict[Role, int | None] = {}
        healthy: dict[Role, bool] = {}
        local = self.cfg.load_signal == "local"
        for role, members in self._members:
            ours = loads = 0
            up = read = False
            for name, view, counters in members:
                batch = counters.batch
                ours += counters.count - batch
                up = up or view.healthy
                if counters.read_at is not None:
                    read = True
                if not local:
                    loads += self.server_load(name) - batch
            counts[role] = ours
            healthy[role] = up
            # Never read: the policy counts ours (backend_load). Under the local signal a server's
            # load is ours (server_load), so the sum is the count.
            engine[role] = (ours if local else loads) if read else None
        margin = self.switch_margin() if self._switch_per_token else 0.0
        return LoadSnapshot(counts, engine, healthy, self._clock(), self._spec_idle_since, margin)

    def switch_margin(self) -> float:
        """The gain a switch of the group's mode needs (LoadSnapshot.switch_margin): the tokens its
        requests hold (each one's next turn resends them to the other server), priced; 0 where
        switches are not priced."""
        if not self._switch_per_token:
            return 0.0
        return self.group_interactive()[1] * self._switch_per_token

    @property
    def load(self) -> int:
        return total_load(self.snapshot(), self.cfg.load_signal)

    def backend_load(self, backend: Role) -> int:
        """The load on one role by the configured signal (what its curve is indexed by)."""
        if self.cfg.load_signal == "local":
            return self.role_count(backend)
        return backend_load(self.snapshot(), backend, self.cfg.load_signal)

    def decide(
        self,
        can_probe: bool = True,
        batch: bool = False,
        held: Role | None = None,
        klass: ClassView | None = None,
        prompt_tokens: int = 0,
        cached_tokens: int = 0,
    ) -> Decision:
        """The backend for a new request. `can_probe` False: the request says nothing of acceptance
        (a model list, embeddings), so it is no probe, not even a shadow's original. `batch`: the
        request leaves speculation to interactive ones (policy.decide_batch). `held`: the role of
        the server holding the request's conversation cache (policy.affinity_choice), which holds
        `cached_tokens` of it. `klass`:
        what is known of the request's traffic class (policy.class_choice, which goes before
        affinity: a conversation's cache is worth one prefill, its class's gain every token).
        `prompt_tokens`: its prompt's, which the model policy counts in the context the group
        would hold."""
        if self.speed is not None and not batch:
            self._update(self._clock())
            self._model_watermarks(prompt_tokens, new=True)
        snapshot = self.snapshot()
        if batch:
            decision = decide_batch(snapshot, self.state, self.cfg)
            self._metrics.decisions.inc(decision.backend or "none", decision.reason)
            return decision
        cfg = self.cfg if self.kv_streams is None else self.policy_cfg()
        if not can_probe and cfg.probe_s > 0:
            cfg = dataclasses.replace(cfg, probe_s=0.0)
        decision = decide(snapshot, self.state, cfg)
        if klass is not None and self._pooled:
            spec = backend_load(snapshot, SPECULATIVE, cfg.load_signal)
            base = backend_load(snapshot, BASELINE, cfg.load_signal)
            gains = None if klass.accept is None else self.pool_gains(klass.accept, (spec, base))
            healthy, pooled = snapshot.healthy, self._pooled
            decision = class_choice(decision, klass, cfg, healthy, pooled, spec, held, gains, cached_tokens)
        if held is not None and decision.reason not in ("class", "affinity"):
            decision = affinity_choice(decision, held, cfg, snapshot.healthy, self._pooled)
        if decision.backend is BASELINE and spills(decision, held, cfg):
            decision = self._spilled(decision, held, cfg, snapshot.healthy)
        self._set_state(decision.state)
        self._metrics.decisions.inc(decision.backend or "none", decision.reason)
        return decision

    def _spilled(
        self, decision: Decision, held: Role | None, cfg: PolicyConfig, healthy: Mapping[Role, bool]
    ) -> Decision:
        """policy.kv_spill with the pools read: the speculative role's only where the baseline's are
        full (the decision is made for every request, and mostly they are not)."""
        pools = self.kv_used(BASELINE)
        if pools is None or pools[0] < cfg.kv_spill_at:
            return decision
        room = self.kv_used(SPECULATIVE)
        return kv_spill(decision, held, cfg, healthy, pools[0], None if room is None else room[1])

    def kv_used(self, role: Role) -> tuple[float, float] | None:
        """The least and the most full of the role's KV pools, as fractions (policy.kv_spill), over
        its servers that are up (a server down takes no request); None where an up server's is
        unknown, or none is up. A baseline pool is its engine's reading. A speculative one is that,
        or this gateway's tokens in flight there over the pool's size where that is more: the
        reading is a scrape old, and a burst spilled since would otherwise all go on it. That count
        takes each request's whole prompt, where the engine keeps a prefix they share once, so it
        errs toward full: on the speculative side toward no spill, and on the baseline's it would
        spill from a pool with room."""
        least, most = math.inf, 0.0
        local = role is SPECULATIVE
        for s in self.group.of(role):
            view = self._servers[s]
            if not view.healthy:
                continue
            used, pool = view.kv_usage, view.kv_capacity
            ours = self.tracker.tokens(s) / pool if local and pool else None
            if used is None or (ours is not None and ours > used):
                used = ours
            if used is None:
                return None
            least, most = min(least, used), max(most, used)
        return None if least == math.inf else (least, most)

    def class_view(self, gains: bool | None, accept: float | None) -> ClassView:
        """What the policy is told of a traffic class ranked `gains`, of acceptance `accept` (a
        pair's classes never split: nothing more to solve)."""
        if accept is None or not self._pooled:
            return _RANKED[gains]
        # What stands until the estimate moves (the adaptive curves) or, under the model policy,
        # the context (to 1%) or a correction (observe). Keyed by the acceptance in hundredths:
        # round(x, 2) costs a third of a microsecond, round(x * 100) a tenth of that.
        cents = round(accept * 100)
        key = (gains, cents, 0 if self.speed is None else self.speed.context_key)
        view = self._class_views.get(key)
        if view is None:
            if len(self._class_views) >= MAX_CLASS_VIEWS:
                self._class_views.clear()
            rounded = cents / 100
            view = self._class_views[key] = self._view_of(gains, self.class_marks(rounded), rounded)
        return view

    @staticmethod
    def _view_of(gains: bool | None, marks: tuple[int, int] | None, accept: float) -> ClassView:
        high, low = (None, None) if marks is None else marks
        return ClassView(gains, high, low, accept)

    def pool_gains(self, accept: float, loads: tuple[int, int] | None = None) -> PoolGains | None:
        """What each role of a pool gains with one more stream of acceptance `accept`
        (policy.marginal_gain), each role's load (`loads`, speculative and baseline, where the caller
        has read them) spread over its healthy servers; None in a pair, or where a role's speed is
        not known. The speeds are the calibration's as measured (the fitted step times under the
        model policy, else the curves), not corrected live: a pool learns a role's speed only while
        the other is idle, and a speed corrected on one side compared with one that was not would
        pick a side by the correction."""
        a = self.adaptive
        if not self._pooled or a is None or (self.speed is None and a.model.prior is None):
            return None
        spec, base = loads if loads is not None else (self.backend_load(r) for r in ROLES)
        on_spec = self.engine_accept() or a.estimate.accept_live or accept
        key = (accept, spec, base, on_spec, 0 if self.speed is None else self.speed.context_key)
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
        servers = self.group.of(role)
        n = len(servers) if len(servers) == 1 else sum(1 for s in servers if self._servers[s].healthy) or len(servers)
        streams = load / n
        now, more = self._rates(role, streams)
        return marginal_gain(accept, streams, held_accept, now, more), accept * more

    def _rates(self, role: Role, streams: float) -> tuple[float, float]:
        """A stream's steps a second on `role` at `streams` streams a server and at one more: the
        model policy's fitted step times at the group's context (to 1%), else the calibration's
        curves; neither changes (the fit is not corrected here, pool_gains), so each is kept, as
        every class's request asks."""
        speed = self.speed
        key = (role, streams, 0 if speed is None else speed.context_key)
        rates = self._rates_seen.get(key)
        if rates is None:
            if speed is not None:
                fit, t = speed.fit.of(role), speed.context
                n, m = max(streams, 1.0), streams + 1
                now, more = 1.0 / max(fit.step_s(n, n * t), 1e-9), 1.0 / max(fit.step_s(m, m * t), 1e-9)
            else:
                assert self.adaptive is not None
                v = self.adaptive.model.prior_v
                found, found_more = v(role, max(streams, 1.0)), v(role, streams + 1)
                assert found is not None and found_more is not None  # pool_gains checked there is a prior
                now, more = found, found_more
            if len(self._rates_seen) >= MAX_RATES_SEEN:
                self._rates_seen.clear()
            rates = self._rates_seen[key] = (now, more)
        return rates

    def priced(self) -> bool:
        """Whether the affinity rule prices a turn's cost among a role's servers (affinity.py): the
        group has the model policy's fitted step times and a prefill rate, and the rule is not the
        one by requests in flight alone."""
        a = self.adaptive
        return (
            a is not None
            and a.cfg.prefill_tok_s > 0
            and self.speed is not None
            and self.cfg.affinity_rule != "in_flight"
        )

    def affinity_rule(self) -> str:
        """The rule in effect among a role's servers (SPECGATE_AFFINITY_RULE where the group can
        price, else `in_flight`)."""
        return self.cfg.affinity_rule if self.priced() else "in_flight"

    def turn_cost(
        self, server: str, prompt_tokens: int, new_tokens: int, batch: float | None = None
    ) -> tuple[float, float]:
        """(the stream-seconds a turn of `prompt_tokens`, `new_tokens` of them not cached, adds on
        `server`, the streams the server holds now): affinity.turn_cost at the fitted step times, at
        the server's own tokens (ours, and the others' at the group's context); the group must be
        priced(); `batch`: its placement_load, where the caller has read it."""
        a, speed = self.adaptive, self.speed
        assert a is not None and speed is not None
        role = self._servers[server].role
        if batch is None:
            batch = self.placement_load(server)
        fit = speed.step(role)
        held = self._tokens_on(server, batch)
        now, more = fit.step_s(max(batch, 1.0), held), fit.step_s(batch + 1.0, held + prompt_tokens)
        per_step = 1.0
        if role == SPECULATIVE:
            per_step = self.engine_accept() or a.estimate.accept_live or speed.accept or 1.0
        steps = self.out_tokens / per_step
        return turn_cost(steps, batch, now, more, new_tokens, a.cfg.prefill_tok_s), batch

    def _tokens_on(self, server: str, batch: float) -> float:
        """The tokens `server` holds with `batch` streams (placement_load): ours, and the others'
        streams at the group's context where the model policy knows it (turn_cost)."""
        ours = self.tracker.tokens(server)
        others = batch - self.tracker.count(server)
        if self.speed is None or others <= 0:  # the local signal's always: its load is ours
            return ours
        return ours + others * self.speed.context

    def affinity_move(
        self, held: str, peers: Sequence[str], cached_tokens: int, prompt_tokens: int, slack: float
    ) -> tuple[bool, str | None]:
        """Whether a turn whose cache `held` holds moves off it to one of its role's other healthy
        servers `peers` (affinity.py's rule: priced where the group is, else by requests in flight),
        and where to (None where it stays)."""
        held_load = self.placement_load(held)
        held_tokens = self._tokens_on(held, held_load)
        loads = [(s, self.placement_load(s)) for s in peers]
        if all(held_load <= load and held_tokens <= self._tokens_on(s, load) for s, load in loads):
            # No peer holds fewer streams or tokens (as turn_cost counts them): none costs less,
            # cost(s) rising with both, under either rule. Most turns end here, without pricing.
            return False, None
        if self.priced():
            a, speed = self.adaptive, self.speed
            assert a is not None and speed is not None
            if self.cfg.affinity_rule == "both":
                # Only servers the rule by requests in flight would leave the held one for: fewer
                # requests than it by more than its cache is worth.
                loads = [(s, load) for s, load in loads if not keep(held_load, load, cached_tokens, slack)]
                if not loads:
                    return False, None
            new = max(prompt_tokens - cached_tokens, 0)
            prefill = a.cfg.prefill_tok_s
            held_cost, _ = self.turn_cost(held, prompt_tokens, new, held_load)
            # Where it would cost least elsewhere, its re-prefill there counted.
            moved, best = min(
                (moved_cost(*self.turn_cost(s, prompt_tokens, new, load), cached_tokens, prefill, slack), s)
                for s, load in loads
            )
            if stays(held_cost, moved, speed.step(self._servers[held].role).rms_rel):
                return False, None
            return True, best
        least = min(load for _, load in loads)
        if keep(held_load, least, cached_tokens, slack):
            return False, None
        # The least loaded of the others: a turn that breaks off its server never draws it again.
        return True, least_loaded(loads, self._rng.random())

    def class_marks(self, accept: float) -> tuple[int, int] | None:
        """(high, low) for a traffic class of acceptance `accept` (policy.class_choice): the speed
        model's at the group's context, or the adaptive curves'; None under a policy without a
        model of speed."""
        if self.speed is not None:
            return self.speed.class_watermarks(accept)
        a = self.adaptive
        return None if a is None else a.watermarks_at(accept, self._clock())

    def pick(self, backend: Role) -> str:
        """The group's server for a role: the least loaded healthy one, at random among near-ties
        (a paired group has one)."""
        servers = self.group.of(backend)
        if len(servers) == 1:
            return servers[0]
        up = [s for s in servers if self._servers[s].healthy] or list(servers)
        chosen = least_loaded([(s, self.placement_load(s)) for s in up], self._rng.random())
        assert chosen is not None
        return chosen

    def admit(self, backend: Role, server: str | None = None, tokens: int = 0, batch: bool = False) -> Lease:
        """A lease on `server`, or on the group's pick for `backend`, holding `tokens` (the prompt's)."""
        return self.tracker.acquire(server if server is not None else self.pick(backend), tokens, batch)

    def pinned(self, server: str) -> Decision:
        """The decision for a request that must go to `server` (it holds what the request
        continues): no policy runs, and the mode's state is left as it is."""
        role = self._servers[server].role
        self._metrics.decisions.inc(role, "stored_response")
        return Decision(role, "stored_response", self.state, self.last_load)

    def failover(self, lease: Lease, to: Role) -> Lease:
        """Move a request that failed before its first byte to the group's other role."""
        self._metrics.failovers.labels(lease.role, to).inc()
        self._metrics.decisions.inc(to, "failover")
        new = self.admit(to, tokens=lease.tokens, batch=lease.batch)
        lease.release()
        return new

    def observe(
        self, backend: Role, load: float, tok_s: float, tokens: float = 0.0, accept: float | None = None
    ) -> None:
        """A finished stream's decode speed (tokens/s per stream) at `load` streams on its server,
        which held `tokens` tokens of context meanwhile; `accept`: its own acceptance where its
        traffic class's is known (else the traffic's is taken)."""
        a = self.adaptive
        if a is None:
            return
        now = self._clock()
        if backend != SPECULATIVE:
            accept = None
        elif accept is None:
            accept = self.accept_live(now)[0]
        a.model.observe(backend, load, tok_s, accept, now)
        if self.speed is not None:
            self.speed.observe(backend, load, tokens, tok_s, accept)
            self._class_views.clear()  # solved at the corrections that stood
        self._update(now)

    def role_tokens(self, role: Role) -> int:
        """Tokens this gateway's requests hold on the group's servers of `role`."""
        return sum(self.tracker.tokens(s) for s in self.group.of(role))

    def group_interactive(self) -> tuple[int, int]:
        """(streams, tokens) of this gateway's interactive requests in flight on the group's
        servers, in one pass (read for every request where switches are priced, and by the model
        policy). Batch requests never move on a switch, nor take speculation's room, so they and
        what they hold are left out."""
        streams = tokens = 0
        for _, members in self._members:
            for _, _, c in members:
                streams += c.count - c.batch
                tokens += c.tokens - c.batch_tokens
        return streams, tokens

    def _model_watermarks(self, prompt_tokens: int = 0, new: bool = False) -> None:
        """The model policy's watermarks for the group as it is, or with a new request of
        `prompt_tokens` (`new`): its context is the mean over this gateway's interactive streams in
        the group (batch ones take no room of speculation's, policy.py)."""
        speed = self.speed
        assert speed is not None
        streams, tokens = self.group_interactive()
        accept, source = self._accept_now
        high, low = speed.watermarks(self.last_load, tokens + max(0, prompt_tokens), streams + new, accept, source)
        if (high, low) != (self.cfg.high_watermark, self.cfg.low_watermark):
            self.cfg = dataclasses.replace(self.cfg, high_watermark=high, low_watermark=low)
            self._publish_watermarks()

    def counts_steps(self) -> bool:
        """Whether the speculative servers' streams send one content event per decode step."""
        names = [self._servers[s].engine for s in self.group.of(SPECULATIVE)]
        return bool(names) and all(n is not None and ENGINES[n].stream_steps for n in names)

    def engine_accept(self) -> float | None:
        """The speculative servers' acceptance as their engines report it (their mean)."""
        views = self._spec_views
        if len(views) == 1:  # most groups: read for every pool's class request
            return views[0].spec_accept_length
        found = [a for v in views if (a := v.spec_accept_length) is not None]
        return sum(found) / len(found) if found else None

    def note_output(self, backend: Role, tokens: int, events: int | None = None, client: str = "") -> None:
        """A response from `backend` ended with `tokens` output tokens (from its usage), in `events`
        content events (counted only for probes), for client `client`."""
        if tokens > 0:
            self.out_tokens += OUT_ALPHA * (tokens - self.out_tokens)
        if self.adaptive is None:
            return
        # What each client is served weighs its acceptance (evidence.py).
        self.evidence.served(client, tokens, self._clock())
        if backend != SPECULATIVE or not self.state.probing:
            return
        session = self.state.session
        self.state = probe_returned(self.state, tokens, self.adaptive.cfg.probe_tokens)
        a = stream_accept(tokens, events) if events is not None and self.counts_steps() else None
        if a is not None:
            self._add_evidence(client, tokens, a, session)

    def note_shadow(self, tokens: int, events: int, client: str = "") -> None:
        """A shadow probe of client `client`'s request came back with `tokens` output tokens in
        `events` content events."""
        a = stream_accept(tokens, events) if self.adaptive is not None and self.counts_steps() else None
        if a is not None:
            self._add_evidence(client, tokens, a)

    def shadow_not_sent(self) -> None:
        """The shadow the last decision asked for was not sent: its probe is not counted."""
        self.state = shadow_unsent(self.state)

    def wants_shadow_of(self, client: str) -> bool:
        """Whether a shadow copy of this client's request would add to the evidence: not while its
        measurement counts in full and others are served, so that one client's requests do not
        take every probe. A lone client is always read: its traffic is all there is."""
        return self.evidence.wants_copy(client, self._clock())

    def _add_evidence(self, client: str, tokens: int, accept: float, session: int | None = None) -> None:
        assert self.adaptive is not None
        now = self._clock()
        self.evidence.measured(client, tokens, accept, now, session)
        self.adaptive.updated_at = -math.inf  # act on it now
        self._update(now)

    def accept_live(self, now: float) -> tuple[float | None, str]:
        """The traffic's acceptance on the speculative servers as believed now, and where it was
        read: its traffic classes' mix for the share of the traffic whose class's acceptance is
        known, and for the rest what probes or the engine read (classes.py)."""
        measured = self.evidence.value(now)
        live, source = (measured, "from probe streams") if measured is not None else (self.engine_accept(), "live")
        mix = self._classes.mix(now) if self._classes is not None else None
        if mix is None:
            return live, source
        accept, share = mix
        if live is None or share >= 1.0:
            return accept, "from traffic classes"
        return share * accept + (1.0 - share) * live, _MIXED[source]

    def refresh(self, health: bool = False) -> None:
        """Re-apply the policy's rule after load or (`health`) health changed, so the mode gauge
        tells the truth."""
        if self.cfg.load_signal == "local":
            # The common case, on every admit and release: no snapshot to build.
            spec_load = self.interactive_count(SPECULATIVE)
            load = spec_load + self.interactive_count(BASELINE)
        else:
            snap = self.snapshot()
            load = total_load(snap, self.cfg.load_signal)
            spec_load = backend_load(snap, SPECULATIVE, self.cfg.load_signal)
        self.last_load = load
        now = self._clock()
        self._update(now)
        if health:
            self._gains_seen.clear()  # a role's load is spread over its servers that are up
        if self.speed is not None:
            if health:
                # A role's load is spread over its servers that are up (all while none is).
                up = {role: sum(v.healthy for _, v, _ in members) or len(members) for role, members in self._members}
                if self.speed.serve(up):
                    self._class_views.clear()
            self._model_watermarks()
        if now - self._kv_read_at >= UPDATE_EVERY_S:
            before, self._kv_read_at, self.kv_streams = self.kv_streams, now, self.capacity()
            if self.kv_streams != before:
                self._publish_watermarks()
        fresh = accept_fresh(self._spec_idle_since, now, self.cfg)
        self._set_state(settle(load, spec_load, self.state, self.policy_cfg(), now, fresh, self.switch_margin()))

    def note_turn(self, added: int) -> None:
        """A conversation came back with `added` more prompt tokens than its last turn left cached
        (its new message; negative, a conversation cut short, counts as none)."""
        self._turns = min(self._turns + 1, GROWTH_TURNS)
        self.turn_growth += (max(0, added) - self.turn_growth) / self._turns

    def _footprint(self) -> tuple[int, float]:
        """The group's streams, and the tokens they hold, each with room for its next turn
        (turn_growth: a conversation's cache is worth keeping only if the pool holds it when it
        comes back, larger)."""
        streams, tokens = self.group_interactive()
        return streams, tokens + streams * self.turn_growth

    def _streams_in(self, pool: int, ahead: float = 0.0) -> int | None:
        """Streams a KV pool of `pool` tokens holds at the tokens this gateway's streams in the
        group hold on average, each with room for its next turn (_footprint), and `ahead` more
        tokens over them all (the footprint's forecast growth); None while the group has no
        streams."""
        streams, held = self._footprint()
        tokens = held + ahead
        if not streams or tokens <= 0:
            return None
        return int(pool * streams // tokens)

    def capacity(self) -> int | None:
        """Streams the speculative role holds before its KV pool is full (policy.py): its servers'
        pools over the tokens this gateway's streams in the group hold on average, each with room
        for its next turn (_streams_in); None while a pool's size or the streams' tokens are
        unknown."""
        pools = 0
        for s in self.group.of(SPECULATIVE):
            pool = self._servers[s].kv_capacity
            if pool is None:
                return None
            pools += pool
        held = self._streams_in(pools, self._growth_ahead(pools))
        return None if held is None else min(held, MAX_WATERMARK)

    def _growth_ahead(self, pool: int) -> float:
        """Tokens the group's footprint (its requests' tokens, each with room for its next turn)
        grows by over the next kv_forecast_s, at its rate over the last (forecast.py); 0 without a
        forecast, or once the footprint is past FORECAST_UNDER of the `pool`: a switch then saves
        at most half the re-prefill one at the cap would cost, and a climb that stops short of the
        cap would have cost a switch and a return for nothing (measured on the simulated H200 pair,
        1k-token chats opening over 20 s at 128 sessions, whose footprint levels off at about 70% of
        the pool: read ahead to the end, a switch at 106 streams and a return in the window took its
        goodput from 46.0 to 29.4). Sampled here, at most every UPDATE_EVERY_S."""
        trend = self.footprint
        if trend is None:
            return 0.0
        _, held = self._footprint()
        trend.add(self._clock(), held)
        if held > pool * FORECAST_UNDER:
            return 0.0
        return trend.ahead(held) - held

    def server_caps(self) -> dict[Role, int]:
        """Streams one server of each role holds before its KV pool is full (the smallest of the
        role's pools, _streams_in), for the adaptive curves (adaptive.held_at_capacity); a role
        whose pools are unknown is left out, and while the group has no streams the last reading
        stands."""
        for role in ROLES:
            pools = [p for s in self.group.of(role) if (p := self._servers[s].kv_capacity) is not None]
            if pools and len(pools) == len(self.group.of(role)):
                held = self._streams_in(min(pools))
                if held is not None:
                    self._server_caps[role] = max(1, held)
        return self._server_caps

    def policy_cfg(self) -> PolicyConfig:
        """The configuration the policy runs with: under a learning policy, the speculative role's
        KV capacity, and the watermarks capped to it where it is below the high one (policy.py);
        else as it is. The capacity is told where it is above the high watermark too: no probe
        goes out above the low watermark it allows, and a class's own high watermark is capped to
        it."""
        cap, cfg = self.kv_streams, self.cfg
        if cap is None or cfg.policy not in LEARNING:
            return cfg
        done = self._capped
        if done is not None and done[0] is cfg and done[1] == cap:
            return done[2]
        if cap >= cfg.high_watermark:
            capped = dataclasses.replace(cfg, capacity=cap)
        else:
            low = min(cfg.low_watermark, hysteresis_low(cap))
            capped = dataclasses.replace(cfg, high_watermark=cap, low_watermark=low, capacity=cap)
        self._capped = (cfg, cap, capped)
        return capped

    def _update(self, now: float) -> None:
        a = self.adaptive
        if a is None or now - a.updated_at < UPDATE_EVERY_S:
            return
        accept, source = self._accept_now = self.accept_live(now)
        seen, self._accept_seen = self._accept_seen, accept
        if accept is not None and seen is not None and abs(accept - seen) > ACCEPT_CHANGE * seen:
            self.state = probes_restarted(self.state)
        self._class_views.clear()
        self._gains_seen.clear()
        if a.update(accept, now, source, self.server_caps()) and self.speed is None:
            high, low = a.watermarks()
            log.info("adaptive watermarks now high=%d low=%d: %s", high, low, a.estimate.why)
            self.cfg = dataclasses.replace(self.cfg, high_watermark=high, low_watermark=low)
        if self._switch_per_token:
            self.cfg = dataclasses.replace(self.cfg, curves=a.curves())
        if self.speed is not None:
            self._model_watermarks()
        self._publish_watermarks()

    def _publish_watermarks(self) -> None:
        m, c = self._metrics, self.policy_cfg()
        for level, value in (("high", c.high_watermark), ("low", c.low_watermark)):
            m.child(m.group_watermark, self.group.name, level).set(value)
        if self.adaptive is not None:
            m.child(m.group_crossover, self.group.name).set(_nan(self.adaptive.estimate.crossover))

    def _publish_mode(self) -> None:
        m = self._metrics
        m.child(m.group_mode, self.group.name).set(1 if self.state.mode == SPECULATIVE else 0)

    def server_changed(self, server: str) -> None:
        """A lease on one of the group's servers was taken or released."""
        if self.tracker.role(server) == SPECULATIVE:
            self._spec_idle_since = self._clock() if self.role_count(SPECULATIVE) == 0 else None
        self.refresh()

    def _set_state(self, state: PolicyState) -> None:
        before, self.state = self.state.mode, state
        if state.mode != before:
            log.info("routing mode of %s: %s -> %s (load %d)", self.group.name, before, state.mode, self.load)
            self._metrics.mode_switches.labels(state.mode).inc()
            self._metrics.child(self._metrics.group_mode_switches, self.group.name, state.mode).inc()
            self._publish_mode()


class Placement(NamedTuple):
    """Where a new request goes: the group's router and its decision (the server is picked at
    admission, `Router.admit`)."""

    decision: Decision
    router: Router
    # The server the request goes to (Router.pinned; its conversation's, affinity; or the cheapest
    # of the role's servers, where a priced turn moved off its own); None: the router picks one at
    # admission.
    server: str | None = None
    # How a turn whose conversation has a remembered server went (affinity.Outcome); None: no such turn.
    affinity: Outcome | None = None


class Fleet:
    """Every group's Router over one in-flight tracker of every server: which group a new request
    goes to (the least loaded healthy one, at random among near-ties), and the gateway-wide
    gauges, which are the groups' summed (load, in-flight) or averaged (mode, watermarks)."""

    def __init__(
        self,
        topology: Topology,
        servers: Mapping[str, Server],
        cfg: PolicyConfig,
        metrics: Metrics,
        adaptive: AdaptiveConfig | None = None,
        calibration: Calibration | None = None,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
        classes: ClassBook | None = None,
    ) -> None:
        self.topology = topology
        # Requests of load a turn's server may have beyond the best, per thousand tokens it has cached.
        self.affinity_slack = cfg.affinity_slack
        self._metrics = metrics
        self._rng = rng or random.Random()
        self.tracker = InflightTracker(servers, self._changed, clock)
        self.routers = tuple(
            Router(
                cfg,
                servers,
                metrics,
                self.tracker,
                g,
                adaptive,
                calibration,
                clock,
                self._rng,
                topology.kind == "pooled",
                classes,
            )
            for g in topology.groups
        )
        self._router_of = {s: r for r in self.routers for role in ROLES for s in r.group.of(role)}
        self._bind_gauges(servers)

    def router_of(self, server: str) -> Router:
        return self._router_of[server]

    def choose(self, among: Sequence[Router] | None = None) -> Router:
        """The least loaded healthy group (of `among`, where given), at random among near-ties."""
        if among is None and len(self.routers) == 1:
            return self.routers[0]
        candidates = self.routers if among is None else among
        up = [(r.group.name, r.group_placement_load()) for r in candidates if any(r.healthy_map().values())]
        name = least_loaded(up, self._rng.random())
        return next((r for r in self.routers if r.group.name == name), self.routers[0])

    def decide(
        self,
        can_probe: bool = True,
        server: str | None = None,
        batch: bool = False,
        held: Held | None = None,
        klass: tuple[bool | None, float | None] | None = None,
        prompt_tokens: int = 0,
    ) -> Placement:
        """Where a new request goes; `server`: where it must go if that server is up (it holds what
        the request continues); `batch`: a batch request (Router.decide); `held`: where its
        conversation's last turn went (affinity.py's rule, group first, then role, then server);
        `klass`: its traffic class's rank and acceptance, when it has a class (Router.class_view);
        `prompt_tokens`: its prompt's (the model policy's context)."""
        if server is not None:
            router = self._router_of.get(server)
            if router is not None and router.server_healthy(server):
                return Placement(router.pinned(server), router, server)
        if held is None:
            router = self.choose()
            return Placement(router.decide(can_probe, batch, None, _view(router, klass), prompt_tokens), router)
        mine = self._router_of.get(held.server)
        if mine is not None and prompt_tokens:
            mine.note_turn(prompt_tokens - held.tokens)
        # What its server has cached of this prompt: no more than the prompt (a conversation cut
        # short, or another with the same opening), under every rule.
        cached = min(held.tokens, prompt_tokens) if prompt_tokens > 0 else held.tokens
        if mine is None or not mine.server_healthy(held.server):
            router = self.choose()
            decision = router.decide(can_probe, batch, None, _view(router, klass), prompt_tokens)
            return Placement(decision, router, affinity="break_down")
        if len(self.routers) > 1:
            others = [r for r in self.routers if r is not mine and any(r.healthy_map().values())]
            least = min((r.group_placement_load() for r in others), default=math.inf)
            if not keep(mine.group_placement_load(), least, cached, self.affinity_slack):
                router = self.choose(others)
                decision = router.decide(can_probe, batch, None, _view(router, klass), prompt_tokens)
                return Placement(decision, router, affinity="break_load")
        role = mine.server_role(held.server)
        decision = mine.decide(can_probe, batch, role, _view(mine, klass), prompt_tokens, cached)
        if decision.backend != role:
            return Placement(decision, mine, affinity="break_mode")
        peers = [s for s in mine.group.of(role) if s != held.server and mine.server_healthy(s)]
        if not peers:  # a pair, or the role's only server up: none to compare with
            return Placement(decision, mine, held.server, "hit")
        moves, to = mine.affinity_move(held.server, peers, cached, prompt_tokens, self.affinity_slack)
        if moves:
            return Placement(decision, mine, to, "break_load")
        return Placement(decision, mine, held.server, "hit")

    def refresh(self) -> None:
        """After a round of health checks or a change of health (health.py's on_change)."""
        for r in self.routers:
            r.refresh(health=True)

    def _changed(self, server: str, count: int) -> None:
        self._router_of[server].server_changed(server)

    def _bind_gauges(self, servers: Mapping[str, Server]) -> None:
        """The gateway-wide and per-server gauges read the routers when scraped: nothing to update
        on every admit and release. The gateway's are the groups' summed (load, in-flight) or
        averaged (mode, watermarks: every group's with the threshold policy, while the adaptive one
        moves each group's on its own)."""
        m, routers = self._metrics, self.routers
        n = len(routers)
        for name, server in servers.items():
            m.child(m.server_inflight, name).set_function(lambda load=server.load: load.count)
            m.child(m.server_tokens, name).set_function(lambda load=server.load: load.tokens)
        for r in routers:
            m.child(m.group_load, r.group.name).set_function(lambda r=r: r.last_load)
        for role in ROLES:
            m.child(m.inflight, role).set_function(lambda role=role: sum(r.role_count(role) for r in routers))
        m.load.set_function(lambda: sum(r.last_load for r in routers))
        # The share of groups in speculative mode: 1 or 0 as with one group, between with several.
        m.mode.set_function(lambda: sum(r.state.mode == SPECULATIVE for r in routers) / n)
        m.watermark.labels("high").set_function(lambda: sum(r.policy_cfg().high_watermark for r in routers) / n)
        m.watermark.labels("low").set_function(lambda: sum(r.policy_cfg().low_watermark for r in routers) / n)
        for r in routers:
            m.child(m.group_kv_streams, r.group.name).set_function(lambda r=r: _nan(r.kv_streams))
        m.watermark.labels("spillover").set(routers[0].cfg.spillover_limit)
        if any(r.adaptive is not None for r in routers):
            m.crossover_estimate.set_function(lambda: _mean_crossover(routers))


def _mean_crossover(routers: Sequence[Router]) -> float:
    found = [c for r in routers if r.adaptive is not None and (c := r.adaptive.estimate.crossover) is not None]
    return sum(found) / len(found) if found else math.nan


def _view(router: Router, klass: tuple[bool | None, float | None] | None) -> ClassView | None:
    return None if klass is None else router.class_view(*klass)


def _nan(value: float | None) -> float:
    return math.nan if value is None else value
