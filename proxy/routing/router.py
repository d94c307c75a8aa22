"""The router: one group's owner of the policy's state. For a new request it snapshots load and
health and runs the decision's steps (steps/pipeline.py), admits the request (a lease), and records
every decision and mode switch; as requests end it re-applies the mode's rule and feeds what the
learning policies learn from.

Under the adaptive policy what the policy believes (learning.py) is re-read at most every
UPDATE_EVERY_S and the live watermarks moved at a bounded rate. Under the model policy, with a fit
in the calibration file, the watermarks come from the step-time model (speedmodel.py) instead,
solved for each new request at the group's load, context and acceptance. capacity.py caps them to
the speculative role's KV pool.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import random
import time
from collections.abc import Callable, Mapping

from ..fleet.servers import ServerView
from ..fleet.topology import Group
from ..observability.metrics import Metrics
from ..policy.base import (
    ADAPTIVE,
    BASELINE,
    SPECULATIVE,
    ClassView,
    Decision,
    LoadSnapshot,
    PolicyConfig,
    PolicyState,
    PoolGains,
    Role,
    accept_fresh,
    backend_load,
    least_loaded,
    other,
    total_load,
)
from ..policy.beliefs import UPDATE_EVERY_S, AdaptiveConfig
from ..policy.calibration import Calibration
from ..policy.factory import policy_for
from .affinity import Held, ServerChoice
from .capacity import Capacity
from .classes import ClassBook
from .homogeneous import homogeneous_choice
from .learning import Learning
from .leases import InflightTracker, Lease
from .loads import GroupLoads
from .steps import stored
from .steps.base import Ask, Here
from .steps.classes import ClassPricing
from .steps.pipeline import run, steps_for
from .steps.probe import probe_returned, shadow_unsent
from .switch import Switch

log = logging.getLogger("specgate.routing")


class Router:
    """One group's router (a paired group, or the pool): its mode, its beliefs, and the load and
    health of its servers, read through their views. `Fleet` holds one per group."""

    # Every request reads a dozen of these. Slots keep each read a fixed offset: an instance dict
    # shares its keys with its class's only up to 30 of them in CPython 3.11, past which each read
    # is a lookup.
    __slots__ = (
        "_clock", "_metrics", "_rng", "_servers", "_spec_idle_since", "adaptive", "cfg",
        "class_pricing", "group", "kv", "last_load", "learning", "loads", "policy", "pooled", "speed", "state", "steps",
        "tracker", "turns",
    )  # fmt: skip

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
        # A pool's roles run on disjoint GPUs (topology.py): its baseline is idle hardware otherwise.
        self.pooled = pooled
        self._servers = servers
        self._metrics = metrics
        self._clock = clock
        self._rng = rng or random.Random()
        self.last_load = 0
        self.state = PolicyState()  # no dwell before the first switch
        self.tracker = tracker
        self.policy = policy_for(cfg.policy)
        self.steps = steps_for(self.policy, pooled, group.adaptive)
        self.loads = GroupLoads(group, servers, tracker, cfg.load_signal)
        self._spec_idle_since: float | None = clock()
        self.learning = Learning(cfg, self.policy, group, servers, adaptive, calibration, classes, clock, pooled)
        # The adaptive servers' group has no two roles to learn speeds of: their engines choose.
        self.adaptive, self.speed = (None, None) if group.adaptive else (self.learning.adaptive, self.learning.speed)
        self.cfg = self.learning.configured(cfg)
        self.kv = Capacity(group, servers, tracker, self.loads.interactive, clock, self.learning.forecast_s)
        self.class_pricing = ClassPricing(self, pooled)
        self.turns = ServerChoice(self)
        if self.speed is not None:
            self._model_watermarks()
        self._publish_watermarks()
        self._publish_mode()
        self.refresh()

    # What the steps and the pricing read of the group (steps/base.GroupReads, steps/classes.Speeds,
    # affinity.Turns).
    def now(self) -> float:
        return self._clock()

    def random(self) -> float:
        return self._rng.random()

    def role_of(self, server: str) -> Role:
        return self._servers[server].role

    def server_healthy(self, server: str) -> bool:
        return self._servers[server].healthy

    def ours(self, server: str) -> tuple[int, int]:
        return self.tracker.count(server), self.tracker.tokens(server)

    def up(self, role: Role) -> int:
        return self.loads.up(role)

    def placement_load(self, server: str) -> float:
        return self.loads.placement_load(server)

    def engine_accept(self) -> float | None:
        return self.learning.engine_accept()

    def engine_accept_of(self, server: str) -> float | None:
        """The server's acceptance length as its engine last reported it (None: none)."""
        return self._servers[server].spec_accept_length

    def kv_used(self, role: Role) -> tuple[float, float] | None:
        return self.kv.kv_used(role)

    def pool_gains(self, accept: float, loads: tuple[int, int] | None = None) -> PoolGains | None:
        return self.class_pricing.pool_gains(accept, loads)

    def kv_streams(self) -> int | None:
        return self.kv.kv_streams

    def prefill_ahead(self, role: Role) -> int:
        return self.loads.prefill_ahead(role)

    def snapshot(self) -> LoadSnapshot:
        margin = self.switch_margin()
        return self.loads.snapshot(self._clock(), self._spec_idle_since, margin)

    def switch_margin(self) -> float:
        """The gain a switch of the group's mode needs (LoadSnapshot.switch_margin): the tokens its
        requests hold (each one's next turn resends them to the other server), priced; 0 where
        switches are not priced."""
        per_token = self.learning.switch_per_token
        return self.loads.interactive()[1] * per_token if per_token else 0.0

    @property
    def load(self) -> int:
        return total_load(self.snapshot(), self.cfg.load_signal)

    def backend_load(self, backend: Role) -> int:
        """The load on one role by the configured signal (what its curve is indexed by)."""
        return self.loads.backend_load(backend, self.snapshot)

    def policy_cfg(self) -> PolicyConfig:
        """The configuration the policy runs with: the watermarks capped to the KV pool (capacity.py)."""
        return self.cfg if self.kv.kv_streams is None else self.kv.capped(self.cfg)

    def decide(
        self,
        can_probe: bool = True,
        batch: bool = False,
        held: Role | None = None,
        klass: ClassView | None = None,
        prompt_tokens: int = 0,
        cached_tokens: int = 0,
        speculation: Switch | None = None,
    ) -> Decision:
        """The backend for a new request (steps/base.Ask says what each argument is)."""
        if self.speed is not None and not batch:
            self._update(self._clock())
            self._model_watermarks(prompt_tokens, new=True)
        cfg = self.cfg if self.kv.kv_streams is None else self.kv.capped(self.cfg)
        if not can_probe and cfg.probe_s > 0:
            cfg = dataclasses.replace(cfg, probe_s=0.0)
        margin = self.switch_margin() if self.learning.switch_per_token else 0.0
        snapshot = self.loads.snapshot(self._clock(), self._spec_idle_since, margin)
        ask = Ask(can_probe, batch, held, klass, prompt_tokens, cached_tokens, speculation)
        decision = run(self.steps, ask, Here(snapshot, cfg, self.state, self.pooled, self))
        if decision.state is not self.state:
            self._set_state(decision.state)
        self._metrics.decisions.inc(decision.backend or "none", decision.reason)
        return decision

    def pinned(self, server: str) -> Decision:
        """The decision for a request that must go to `server` (steps/stored.py)."""
        decision = stored.pinned(self._servers[server].role, self.state, self.last_load)
        self._metrics.decisions.inc(decision.backend or "none", decision.reason)
        return decision

    def pick(self, backend: Role, gains: bool | None = None, exclude: str | None = None) -> str:
        """The group's server for a role: the least loaded healthy one, at random among near-ties
        (a paired group has one); an adaptive server as SPECGATE_ADAPTIVE_PLACEMENT says, for a
        request of a class ranked `gains` (homogeneous.py); never `exclude` where another is."""
        servers = self.group.of(backend)
        if len(servers) == 1:
            return servers[0]
        others = [s for s in servers if s != exclude] or list(servers)
        up = [s for s in others if self._servers[s].healthy] or others
        loads = [(s, self.loads.placement_load(s)) for s in up]
        if backend is ADAPTIVE and self.cfg.adaptive_placement == "homogeneous":
            chosen = homogeneous_choice(servers, loads, gains, self._rng.random())
        else:
            chosen = least_loaded(loads, self._rng.random())
        assert chosen is not None
        return chosen

    def admit(
        self, backend: Role, server: str | None = None, tokens: int = 0, batch: bool = False, held: Held | None = None
    ) -> Lease:
        """A lease on `server`, or on the group's pick for `backend`, holding `tokens` (the prompt's),
        all of them to prefill but what `held`, the conversation's last turn, left cached there."""
        chosen = server if server is not None else self.pick(backend)
        cached = min(held.tokens, tokens) if held is not None and held.server == chosen else 0
        return self.tracker.acquire(chosen, tokens, batch, tokens - cached)

    def can_fail_over(self, lease: Lease) -> bool:
        """Whether a request that failed on its server has somewhere else to go: the group's other
        role up, or, among adaptive servers, another one up."""
        if lease.role is ADAPTIVE:
            return any(s != lease.server and self._servers[s].healthy for s in self.group.of(ADAPTIVE))
        return self.loads.healthy_map()[other(lease.role)]

    def failover(self, lease: Lease, to: Role) -> Lease:
        """Move a request that failed before its first byte to the group's other role (steps/health.py),
        or to another of the adaptive servers."""
        self._metrics.failovers.labels(lease.role, to).inc()
        self._metrics.decisions.inc(to, "failover")
        server = self.pick(to, exclude=lease.server) if to is ADAPTIVE else None
        new = self.admit(to, server, tokens=lease.tokens, batch=lease.batch)
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
            accept = self.learning.accept_live(now)[0]
        a.model.observe(backend, load, tok_s, accept, now)
        if self.speed is not None:
            self.speed.observe(backend, load, tokens, tok_s, accept)
            self.class_pricing.forget(gains=False)  # solved at the corrections that stood
        self._update(now)

    def note_output(self, backend: Role, tokens: int, events: int | None = None, client: str = "") -> None:
        """A response from `backend` ended with `tokens` output tokens (from its usage), in `events`
        content events (counted only for probes), for client `client`."""
        self.turns.note_output(tokens)
        if self.adaptive is None:
            return
        # What each client is served weighs its acceptance (evidence.py).
        self.learning.evidence.served(client, tokens, self._clock())
        if backend != SPECULATIVE or not self.state.probing:
            return
        session = self.state.session
        self.state = probe_returned(self.state, tokens, self.adaptive.cfg.probe_tokens)
        a = self.learning.stream_accept(tokens, events) if events is not None else None
        if a is not None:
            self._add_evidence(client, tokens, a, session)

    def note_shadow(self, tokens: int, events: int, client: str = "") -> None:
        """A shadow probe of client `client`'s request came back with `tokens` output tokens in
        `events` content events."""
        a = self.learning.stream_accept(tokens, events)
        if a is not None:
            self._add_evidence(client, tokens, a)

    def shadow_not_sent(self) -> None:
        """The shadow the last decision asked for was not sent: its probe is not counted."""
        self.state = shadow_unsent(self.state)

    def wants_shadow_of(self, client: str) -> bool:
        """Whether a shadow copy of this client's request would add to the evidence (evidence.py)."""
        return self.learning.evidence.wants_copy(client, self._clock())

    def _add_evidence(self, client: str, tokens: int, accept: float, session: int | None = None) -> None:
        now = self._clock()
        self.learning.measured(client, tokens, accept, now, session)
        self._update(now)

    def refresh(self, health: bool = False) -> None:
        """Re-apply the policy's rule after load or (`health`) health changed, so the mode gauge
        tells the truth."""
        signal = self.cfg.load_signal
        if self.group.adaptive:
            self.last_load = self.loads.interactive_count(ADAPTIVE)
            return  # no mode to settle: the engines choose
        if signal == "local":
            # The common case, on every admit and release: no snapshot to build.
            spec_load = self.loads.interactive_count(SPECULATIVE)
            load = spec_load + self.loads.interactive_count(BASELINE)
        else:
            snap = self.snapshot()
            load = total_load(snap, signal)
            spec_load = backend_load(snap, SPECULATIVE, signal)
        self.last_load = load
        now = self._clock()
        self._update(now)
        if health:
            self.class_pricing.forget(views=False)  # a role's load is spread over its servers that are up
        if self.speed is not None:
            if health and self.speed.serve({role: self.loads.up(role) for role in (SPECULATIVE, BASELINE)}):
                self.class_pricing.forget(gains=False)
            self._model_watermarks()
        if now - self.kv.read_at >= UPDATE_EVERY_S and self.kv.read(now):
            self._publish_watermarks()
        fresh = accept_fresh(self._spec_idle_since, now, self.cfg)
        state, _ = self.policy.settle(load, spec_load, self.state, self.policy_cfg(), now, fresh, self.switch_margin())
        self._set_state(state)

    def _update(self, now: float) -> None:
        """Act on what the learning policies believe, read again at most every UPDATE_EVERY_S."""
        found = self.learning.update(now, self.state, self.cfg, self.kv.server_caps)
        if found is None:
            return
        self.state, self.cfg = found
        self.class_pricing.forget()
        if self.speed is not None:
            self._model_watermarks()
        self._publish_watermarks()

    def _model_watermarks(self, prompt_tokens: int = 0, new: bool = False) -> None:
        """The model policy's watermarks for the group as it is, or with a new request of
        `prompt_tokens` (`new`): its context is the mean over this gateway's interactive streams in
        the group (batch ones take no room of speculation's)."""
        streams, tokens = self.loads.interactive()
        high, low = self.learning.model_marks(self.last_load, streams + new, tokens + max(0, prompt_tokens))
        if (high, low) != (self.cfg.high_watermark, self.cfg.low_watermark):
            self.cfg = dataclasses.replace(self.cfg, high_watermark=high, low_watermark=low)
            self._publish_watermarks()

    def _publish_watermarks(self) -> None:
        m, c = self._metrics, self.policy_cfg()
        for level, value in (("high", c.high_watermark), ("low", c.low_watermark)):
            m.child(m.group_watermark, self.group.name, level).set(value)
        if self.adaptive is not None:
            crossover = self.adaptive.estimate.crossover
            m.child(m.group_crossover, self.group.name).set(math.nan if crossover is None else crossover)

    def _publish_mode(self) -> None:
        m = self._metrics
        m.child(m.group_mode, self.group.name).set(1 if self.state.mode == SPECULATIVE else 0)

    def server_changed(self, server: str) -> None:
        """A lease on one of the group's servers was taken or released."""
        if self.tracker.role(server) == SPECULATIVE:
            self._spec_idle_since = self._clock() if self.loads.role_count(SPECULATIVE) == 0 else None
        self.refresh()

    def _set_state(self, state: PolicyState) -> None:
        before, self.state = self.state.mode, state
        if state.mode != before:
            log.info("routing mode of %s: %s -> %s (load %d)", self.group.name, before, state.mode, self.load)
            self._metrics.mode_switches.labels(state.mode).inc()
            self._metrics.child(self._metrics.group_mode_switches, self.group.name, state.mode).inc()
            self._publish_mode()
