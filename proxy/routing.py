"""The router: the one owner of the policy's state. It snapshots load and health, asks the pure
policy, admits the request (a lease), and records every decision and mode switch.

Under the adaptive policy it also owns what the policy believes: the speed model (adaptive.py)
fed by relayed streams and the speculative server's live acceptance, and the live watermarks,
re-estimated at most every UPDATE_EVERY_S and moved at a bounded rate.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .adaptive import (
    Estimate,
    Prior,
    SpeedModel,
    WatermarkState,
    estimate,
    step_watermark,
    stream_accept,
    watermarks,
)
from .calibration import Calibration
from .engines import ENGINES
from .evidence import AcceptanceEvidence
from .health import HealthMonitor
from .inflight import InflightTracker, Lease
from .metrics import Metrics
from .policy import (
    BACKENDS,
    Backend,
    Decision,
    LoadSnapshot,
    PolicyConfig,
    PolicyState,
    accept_fresh,
    backend_load,
    decide,
    dwell_mode,
    least_loaded,
    next_mode,
    total_load,
)
from .topology import Group, Topology

log = logging.getLogger("specgate.routing")

# One server of each role, named by its role.
SOLO_GROUP = Group("group-0", {"speculative": ("speculative",), "baseline": ("baseline",)})
# The adaptive estimate is recomputed at most this often (health polls and finished streams ask).
UPDATE_EVERY_S = 0.25
# A probe session sends at most this many requests.
PROBE_MAX_REQUESTS = 4
# A reading of acceptance this much (relative) off the last one restarts the probes' back-off.
ACCEPT_CHANGE = 0.1


@dataclass(frozen=True)
class AdaptiveConfig:
    min_watermark: int = 0
    max_watermark: int = 256
    max_step_per_s: float = 10.0
    half_life_s: float = 60.0
    # A probe session lasts until this many output tokens came back from the speculative server:
    # SGLang refreshes its acceptance gauge every 40 decode steps, 160 tokens at acceptance 4.
    probe_tokens: int = 160
    # Leave speculation where the baseline is ahead by this share, come back where speculation
    # is: two servers this close do not pull traffic back and forth.
    margin: float = 0.05


class Adaptive:
    """What the adaptive policy believes, and the live watermarks that follow from it."""

    def __init__(
        self, cfg: AdaptiveConfig, calibration: Calibration | None, static: tuple[int, int], now: float
    ) -> None:
        self.cfg = cfg
        self.model = SpeedModel(Prior.of(calibration) if calibration else None, cfg.half_life_s)
        self.static_high, self.static_low = static
        self.estimate: Estimate = estimate(self.model, None, now, cfg.margin)
        self.accept_source = "live"
        high, low = self._target()
        self.wm = WatermarkState(self._clamp(high), self._clamp(low), now)
        self.updated_at = now

    def _target(self) -> tuple[int, int]:
        e = self.estimate
        if e.high is None or e.low is None:
            return self.static_high, self.static_low
        return e.high, e.low

    def _clamp(self, high: int) -> float:
        return float(min(max(high, self.cfg.min_watermark), self.cfg.max_watermark))

    def watermarks(self) -> tuple[int, int]:
        """(high, low) in effect."""
        return watermarks(self.wm)

    def update(self, accept_live: float | None, now: float, source: str = "live") -> bool:
        """Re-estimate and move the watermark; True when the watermarks in effect changed."""
        before = self.watermarks()
        self.estimate = estimate(self.model, accept_live, now, self.cfg.margin, source)
        self.accept_source = source
        self.wm = step_watermark(
            self.wm, self._target(), now, self.cfg.max_step_per_s, self.cfg.min_watermark, self.cfg.max_watermark
        )
        self.updated_at = now
        return self.watermarks() != before

    def describe(self, now: float) -> dict[str, Any]:
        e = self.estimate

        def rounded(values: tuple[float, ...]) -> list[float | None]:
            return [None if math.isnan(v) else round(v, 2) for v in values]

        prior = self.model.prior
        high, low = self.watermarks()
        return {
            "calibrated": prior is not None,
            "accept_length_live": e.accept_live,
            # "live": the engine's metrics; "from probe streams": tokens per decode step of probes.
            "accept_length_source": self.accept_source,
            "accept_length_calibrated": list(prior.accept) if prior is not None else None,
            "crossover_estimate": e.crossover,
            "throughput_verdict": e.throughput.verdict,
            "latency_verdict": e.latency.verdict,
            "target_watermarks": dict(zip(("high", "low"), self._target(), strict=True)),
            "watermarks_exact": {"high": round(self.wm.high, 3), "low": round(self.wm.low, 3)},
            "watermarks": {"high": high, "low": low},
            "why": e.why,
            "curves": {
                "levels": list(e.levels),
                "speculative_tok_s": rounded(e.speculative_tok_s),
                "baseline_tok_s": rounded(e.baseline_tok_s),
            },
            "observations": self.model.observations,
            "observed": self.model.describe(now),
            "settings": dataclasses.asdict(self.cfg),
        }


class Router:
    """One group's router (a paired group, or the pool): its mode, its adaptive beliefs, and the
    load and health of its servers. `Fleet` holds one per group; alone, it is the simple case."""

    def __init__(
        self,
        cfg: PolicyConfig,
        health: HealthMonitor,
        metrics: Metrics,
        adaptive: AdaptiveConfig | None = None,
        calibration: Calibration | None = None,
        clock: Callable[[], float] = time.monotonic,
        group: Group = SOLO_GROUP,
        tracker: InflightTracker | None = None,
        rng: random.Random | None = None,
        solo: bool = True,
    ) -> None:
        self.static_cfg = cfg
        self.cfg = cfg
        self.group = group
        self._health = health
        self._metrics = metrics
        self._clock = clock
        self._rng = rng or random.Random()
        # Alone, it writes the gateway-wide gauges itself; among several groups, the fleet sums them.
        self.solo = solo
        self.last_load = 0
        self.state = PolicyState()  # no dwell before the first switch
        self.tracker = tracker or InflightTracker(on_change=self.server_changed)
        self._spec_idle_since: float | None = clock()
        self._probe_tokens = self._probe_requests = 0
        self._probe_session = 0  # numbers the probe sessions: their streams pool into one reading
        # Acceptance measured from probe streams, pooled by client (evidence.py): it stands while
        # the newest reading is younger than accept_fresh_s, then the engine's reading (which
        # includes the probes' steps once refreshed) takes over again.
        self.evidence = AcceptanceEvidence(cfg.accept_fresh_s)
        self._accept_seen: float | None = None
        self.adaptive: Adaptive | None = None
        if cfg.policy == "adaptive":
            static = (cfg.high_watermark, cfg.low_watermark)
            self.adaptive = Adaptive(adaptive or AdaptiveConfig(), calibration, static, clock())
            high, low = self.adaptive.watermarks()
            self.cfg = dataclasses.replace(cfg, high_watermark=high, low_watermark=low)
        self._publish_watermarks()
        self._publish_mode()
        self.refresh()

    def now(self) -> float:
        return self._clock()

    def role_count(self, role: Backend) -> int:
        """This gateway's requests in flight on the group's servers of `role`."""
        return sum(self.tracker.count(s) for s in self.group.of(role))

    def healthy_map(self) -> dict[Backend, bool]:
        b = self._health.backends
        return {role: any(b[s].healthy for s in self.group.of(role)) for role in BACKENDS}

    def engine_loads(self) -> dict[Backend, int | None]:
        """Each role's engine load: the others' requests as last read plus ours now (None: unknown)."""
        out: dict[Backend, int | None] = {}
        for role in BACKENDS:
            servers = self.group.of(role)
            if not any(self.tracker.was_read(s) for s in servers):
                out[role] = None  # never read: the policy counts ours (backend_load)
            else:
                out[role] = sum(self.server_load(s) for s in servers)
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
        if self._health.backends[server].engine_load is None:
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
        return sum(self.placement_load(s) for role in BACKENDS for s in self.group.of(role))

    def snapshot(self) -> LoadSnapshot:
        return LoadSnapshot(
            {role: self.role_count(role) for role in BACKENDS},
            self.engine_loads(),
            self.healthy_map(),
            self._clock(),
            self._spec_idle_since,
        )

    @property
    def load(self) -> int:
        return total_load(self.snapshot(), self.cfg.load_signal)

    def backend_load(self, backend: Backend) -> int:
        """The load on one role by the configured signal (what its curve is indexed by)."""
        if self.cfg.load_signal == "local":
            return self.role_count(backend)
        return backend_load(self.snapshot(), backend, self.cfg.load_signal)

    def decide(self, can_probe: bool = True) -> Decision:
        """The backend for a new request. `can_probe` False: the request says nothing of acceptance
        (a model list, embeddings), so it is no probe, not even a shadow's original."""
        cfg = self.cfg if can_probe or self.cfg.probe_s <= 0 else dataclasses.replace(self.cfg, probe_s=0.0)
        decision = decide(self.snapshot(), self.state, cfg)
        if decision.reason == "probe":
            if not self.state.probing:
                self._probe_tokens = self._probe_requests = 0
                self._probe_session += 1
            self._probe_requests += 1
            if self._probe_requests >= PROBE_MAX_REQUESTS:
                self._probe_tokens = self._probe_requests = 0
                # Requests that bring back no usage (errors) must not make a session endless.
                decision = dataclasses.replace(decision, state=dataclasses.replace(decision.state, probing=False))
        self._set_state(decision.state)
        self._metrics.child(self._metrics.decisions, decision.backend or "none", decision.reason).inc()
        return decision

    def pick(self, backend: Backend) -> str:
        """The group's server for a role: the least loaded healthy one, at random among near-ties
        (a paired group has one)."""
        servers = self.group.of(backend)
        if len(servers) == 1:
            return servers[0]
        up = [s for s in servers if self._health.backends[s].healthy] or list(servers)
        chosen = least_loaded([(s, self.placement_load(s)) for s in up], self._rng.random())
        assert chosen is not None
        return chosen

    def admit(self, backend: Backend) -> Lease:
        return self.tracker.acquire(self.pick(backend))

    def failover(self, lease: Lease, to: Backend) -> Lease:
        """Move a request that failed before its first byte to the group's other role."""
        self._metrics.failovers.labels(lease.backend, to).inc()
        self._metrics.decisions.labels(to, "failover").inc()
        new = self.admit(to)
        lease.release()
        return new

    def observe(self, backend: Backend, load: float, tok_s: float) -> None:
        """A finished stream's decode speed (tokens/s per stream) at `load` streams on its server."""
        a = self.adaptive
        if a is None:
            return
        now = self._clock()
        accept = self.accept_live(now)[0] if backend == "speculative" else None
        a.model.observe(backend, load, tok_s, accept, now)
        self._update(now)

    def counts_steps(self) -> bool:
        """Whether the speculative servers' streams send one content event per decode step."""
        names = [self._health.backends[s].engine for s in self.group.of("speculative")]
        return bool(names) and all(n is not None and ENGINES[n].stream_steps for n in names)

    def engine_accept(self) -> float | None:
        """The speculative servers' acceptance as their engines report it (their mean)."""
        found = [
            a for s in self.group.of("speculative") if (a := self._health.backends[s].spec_accept_length) is not None
        ]
        return sum(found) / len(found) if found else None

    def note_output(self, backend: Backend, tokens: int, events: int | None = None, client: str = "") -> None:
        """A response from `backend` ended with `tokens` output tokens (from its usage), in `events`
        content events (counted only for probes), for client `client`."""
        if self.adaptive is None:
            return
        # What each client is served weighs its acceptance (evidence.py).
        self.evidence.served(client, tokens, self._clock())
        if backend != "speculative" or not self.state.probing:
            return
        self._probe_tokens += tokens
        a = stream_accept(tokens, events) if events is not None and self.counts_steps() else None
        if a is not None:
            self._add_evidence(client, tokens, a, self._probe_session)
        if self._probe_tokens >= self.adaptive.cfg.probe_tokens:
            self._probe_tokens = self._probe_requests = 0
            self.state = dataclasses.replace(self.state, probing=False)

    def note_shadow(self, tokens: int, events: int, client: str = "") -> None:
        """A shadow probe of client `client`'s request came back with `tokens` output tokens in
        `events` content events."""
        a = stream_accept(tokens, events) if self.adaptive is not None and self.counts_steps() else None
        if a is not None:
            self._add_evidence(client, tokens, a)

    def shadow_not_sent(self) -> None:
        """The shadow the last decision asked for was not sent: its probe is not counted."""
        self.state = dataclasses.replace(self.state, probes=max(0, self.state.probes - 1))

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
        """The speculative server's acceptance as believed now, and where it was read."""
        measured = self.evidence.value(now)
        if measured is not None:
            return measured, "from probe streams"
        return self.engine_accept(), "live"

    def refresh(self) -> None:
        """Re-apply the hysteresis after load or health changed, so the mode gauge tells the truth."""
        if self.cfg.load_signal == "local":
            # The common case, on every admit and release: no snapshot to build.
            spec_load = self.role_count("speculative")
            load = spec_load + self.role_count("baseline")
        else:
            snap = self.snapshot()
            load = total_load(snap, self.cfg.load_signal)
            spec_load = backend_load(snap, "speculative", self.cfg.load_signal)
        self.last_load = load
        self._metrics.child(self._metrics.group_load, self.group.name).set(load)
        if self.solo:
            self._metrics.load.set(load)
        if self.cfg.policy == "threshold":
            self._set_state(next_mode(load, self.state, self.cfg, self._clock()))
        elif self.cfg.policy == "adaptive":
            now = self._clock()
            self._update(now)
            fresh = accept_fresh(self._spec_idle_since, now, self.cfg)
            self._set_state(dwell_mode(load, self.state, self.cfg, now, fresh)[0])
        else:
            self._set_state(PolicyState("speculative" if spec_load < self.cfg.spillover_limit else "baseline"))

    def _update(self, now: float) -> None:
        a = self.adaptive
        if a is None or now - a.updated_at < UPDATE_EVERY_S:
            return
        accept, source = self.accept_live(now)
        seen, self._accept_seen = self._accept_seen, accept
        if accept is not None and seen is not None and abs(accept - seen) > ACCEPT_CHANGE * seen and self.state.probes:
            # The traffic is changing: probe again soon rather than after a doubled wait.
            self.state = dataclasses.replace(self.state, probes=0)
        if a.update(accept, now, source):
            high, low = a.watermarks()
            log.info("adaptive watermarks now high=%d low=%d: %s", high, low, a.estimate.why)
            self.cfg = dataclasses.replace(self.cfg, high_watermark=high, low_watermark=low)
        self._publish_watermarks()

    def _publish_watermarks(self) -> None:
        m, c = self._metrics, self.cfg
        crossover = _nan(self.adaptive.estimate.crossover) if self.adaptive is not None else None
        for level, value in (("high", c.high_watermark), ("low", c.low_watermark)):
            m.child(m.group_watermark, self.group.name, level).set(value)
        if crossover is not None:
            m.child(m.group_crossover, self.group.name).set(crossover)
        if self.solo or self.group.name == "group-0":
            # The gateway-wide gauges show the first group's (with the threshold policy, every group's).
            m.set_watermarks(c.high_watermark, c.low_watermark, c.spillover_limit)
            if crossover is not None:
                m.crossover_estimate.set(crossover)

    def _publish_mode(self) -> None:
        m = self._metrics
        m.child(m.group_mode, self.group.name).set(1 if self.state.mode == "speculative" else 0)
        if self.solo:
            m.set_mode(self.state.mode)

    def server_changed(self, server: str, count: int) -> None:
        """A lease on one of the group's servers was taken or released."""
        role = self.tracker.roles[server]
        if self.solo:
            self._metrics.child(self._metrics.inflight, role).set(self.role_count(role))
        if role == "speculative":
            self._spec_idle_since = self._clock() if self.role_count("speculative") == 0 else None
        self.refresh()

    def _set_state(self, state: PolicyState) -> None:
        before, self.state = self.state.mode, state
        if state.mode != before:
            log.info("routing mode of %s: %s -> %s (load %d)", self.group.name, before, state.mode, self.load)
            self._metrics.mode_switches.labels(state.mode).inc()
            self._metrics.child(self._metrics.group_mode_switches, self.group.name, state.mode).inc()
            self._publish_mode()


@dataclass(frozen=True)
class Placement:
    """Where a new request goes: the group's router and its decision (the server is picked at
    admission, `Router.admit`)."""

    decision: Decision
    router: Router


class Fleet:
    """Every group's Router over one in-flight tracker of every server: which group a new request
    goes to (the least loaded healthy one, at random among near-ties), and the gateway-wide
    gauges summed over groups."""

    def __init__(
        self,
        topology: Topology,
        cfg: PolicyConfig,
        health: HealthMonitor,
        metrics: Metrics,
        adaptive: AdaptiveConfig | None = None,
        calibration: Calibration | None = None,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        self.topology = topology
        self._metrics = metrics
        self._rng = rng or random.Random()
        self.tracker = InflightTracker({s.name: s.role for s in topology.servers}, self._changed, clock)
        solo = len(topology.groups) == 1
        self.routers = tuple(
            Router(cfg, health, metrics, adaptive, calibration, clock, g, self.tracker, self._rng, solo)
            for g in topology.groups
        )
        self._router_of = {s: r for r in self.routers for role in BACKENDS for s in r.group.of(role)}
        self.solo = solo
        self._publish()

    def router_of(self, server: str) -> Router:
        return self._router_of[server]

    def choose(self) -> Router:
        if self.solo:
            return self.routers[0]
        up = [(r.group.name, r.group_placement_load()) for r in self.routers if any(r.healthy_map().values())]
        name = least_loaded(up, self._rng.random())
        return next((r for r in self.routers if r.group.name == name), self.routers[0])

    def decide(self, can_probe: bool = True) -> Placement:
        router = self.choose()
        return Placement(router.decide(can_probe), router)

    def refresh(self) -> None:
        for r in self.routers:
            r.refresh()
        self._publish()

    def _changed(self, server: str, count: int) -> None:
        self._metrics.child(self._metrics.server_inflight, server).set(count)
        self._router_of[server].server_changed(server, count)
        if not self.solo:
            self._publish()

    def _publish(self) -> None:
        if self.solo:
            return
        m = self._metrics
        for role in BACKENDS:
            m.child(m.inflight, role).set(sum(r.role_count(role) for r in self.routers))
        m.load.set(sum(r.last_load for r in self.routers))
        # The share of groups in speculative mode: 1 or 0 as with one group, between with several.
        m.mode.set(sum(r.state.mode == "speculative" for r in self.routers) / len(self.routers))


def _nan(value: float | None) -> float:
    return math.nan if value is None else value
