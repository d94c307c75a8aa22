"""The fleet: every group's router over one in-flight tracker of every server. A new request's
placement starts here: a request continuing a stored response goes to the server that stored it
(steps/stored.py); a conversation's turn to the group, and then the server, holding its cache,
unless that group or server is loaded past what the cache is worth (affinity.py); any other to the
least loaded group. The group's router runs the rest of the steps (router.py).
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

from ..fleet.servers import Server
from ..fleet.topology import Topology
from ..observability.metrics import Metrics
from ..policy.base import ADAPTIVE, ALL_ROLES, SPECULATIVE, ClassView, Decision, PolicyConfig, least_loaded
from ..policy.beliefs import AdaptiveConfig
from ..policy.calibration import Calibration
from .affinity import Held, Outcome, keep
from .classes import ClassBook
from .leases import InflightTracker
from .router import Router
from .switch import Switch


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
        self.affinity_balance = cfg.affinity_balance
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
        self._router_of = {s: r for r in self.routers for role in ALL_ROLES for s in r.group.of(role)}
        self._sizes = {r.group.name: sum(len(names) for names in r.group.servers.values()) for r in self.routers}
        self._uneven = len(set(self._sizes.values())) > 1
        # The groups a client's switch can be honoured in (a pair or pool: not the adaptive servers').
        self._switchable = tuple(r for r in self.routers if not r.group.adaptive)
        self._bind_gauges(servers)

    def router_of(self, server: str) -> Router:
        return self._router_of[server]

    def choose(self, among: Sequence[Router] | None = None) -> Router:
        """The least loaded healthy group (of `among`, where given), at random among near-ties."""
        if among is None and len(self.routers) == 1:
            return self.routers[0]
        candidates = self.routers if among is None else among
        up = [(r.group.name, self._group_load(r)) for r in candidates if _up(r)]
        name = least_loaded(up, self._rng.random())
        return next((r for r in self.routers if r.group.name == name), self.routers[0])

    def _group_load(self, router: Router) -> float:
        """A group's load as groups are compared: its servers' summed, or, where groups differ in
        size (a pool or pair beside the adaptive servers), per server."""
        load = router.loads.group_placement_load()
        return load / self._sizes[router.group.name] if self._uneven else load

    def _fresh(
        self,
        among: Sequence[Router] | None,
        can_probe: bool,
        batch: bool,
        klass: tuple[bool | None, float | None] | None,
        prompt_tokens: int,
        speculation: Switch | None,
    ) -> tuple[Router, Decision, str | None]:
        """A request with no server to return to: its group (a client's switch picks among the
        groups with a pair or pool, which have the server it asks for), its decision there, and,
        among adaptive servers, which (Router.pick)."""
        if speculation is not None and self._switchable:
            # Only a pair or pool has the server it asks for; where none is up, the others serve it.
            pool = self._switchable if among is None else [r for r in among if r in self._switchable]
            up = [r for r in pool if _up(r)]
            among = up or among
        router = self.choose(among)
        decision = router.decide(can_probe, batch, None, _view(router, klass), prompt_tokens, 0, speculation)
        server = None
        if decision.backend is ADAPTIVE:
            server = router.pick(decision.backend, None if klass is None else klass[0])
        return router, decision, server

    def decide(
        self,
        can_probe: bool = True,
        server: str | None = None,
        batch: bool = False,
        held: Held | None = None,
        klass: tuple[bool | None, float | None] | None = None,
        prompt_tokens: int = 0,
        speculation: Switch | None = None,
    ) -> Placement:
        """Where a new request goes; `server`: where it must go if that server is up (it holds what
        the request continues); `batch`: a batch request (Router.decide); `held`: where its
        conversation's last turn went (affinity.py's rule, group first, then role, then server);
        `klass`: its traffic class's rank and acceptance, when it has a class (ClassPricing.view);
        `prompt_tokens`: its prompt's (the model policy's context); `speculation`: what its client
        asked of speculation (switch.py)."""
        if server is not None:
            router = self._router_of.get(server)
            if router is not None and router.server_healthy(server):
                return Placement(router.pinned(server), router, server)
        if held is None:
            router, decision, picked = self._fresh(None, can_probe, batch, klass, prompt_tokens, speculation)
            return Placement(decision, router, picked)
        mine = self._router_of.get(held.server)
        if mine is not None and prompt_tokens:
            mine.kv.note_turn(prompt_tokens - held.tokens)
        # What its server has cached of this prompt: no more than the prompt (a conversation cut
        # short, or another with the same opening), under every rule.
        cached = min(held.tokens, prompt_tokens) if prompt_tokens > 0 else held.tokens
        if mine is None or not mine.server_healthy(held.server):
            router, decision, picked = self._fresh(None, can_probe, batch, klass, prompt_tokens, speculation)
            return Placement(decision, router, picked, "break_down")
        if speculation is not None and mine.group.adaptive and any(_up(r) for r in self._switchable):
            # Its cache is on an adaptive server, which cannot do what the client asked.
            router, decision, picked = self._fresh(None, can_probe, batch, klass, prompt_tokens, speculation)
            return Placement(decision, router, picked, "break_mode")
        if len(self.routers) > 1:
            others = [r for r in self.routers if r is not mine and _up(r)]
            least = min((self._group_load(r) for r in others), default=math.inf)
            if not keep(self._group_load(mine), least, cached, self.affinity_slack, self.affinity_balance):
                router, decision, picked = self._fresh(others, can_probe, batch, klass, prompt_tokens, speculation)
                return Placement(decision, router, picked, "break_load")
        role = mine.role_of(held.server)
        decision = mine.decide(can_probe, batch, role, _view(mine, klass), prompt_tokens, cached, speculation)
        if decision.backend != role:
            return Placement(decision, mine, affinity="break_mode")
        peers = [s for s in mine.group.of(role) if s != held.server and mine.server_healthy(s)]
        if not peers:  # a pair, or the role's only server up: none to compare with
            return Placement(decision, mine, held.server, "hit")
        moves, to = mine.turns.move(
            held.server, peers, cached, prompt_tokens, self.affinity_slack, self.affinity_balance
        )
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
        for name, server in servers.items():
            m.child(m.server_inflight, name).set_function(lambda load=server.load: load.count)
            m.child(m.server_tokens, name).set_function(lambda load=server.load: load.tokens)
        for r in routers:
            m.child(m.group_load, r.group.name).set_function(lambda r=r: r.last_load)
        # The roles configured (a gauge at 0 rather than none; an adaptive fleet alone has no pair's).
        present = [role for role in ALL_ROLES if any(r.group.of(role) for r in routers)]
        for role in present:
            m.child(m.inflight, role).set_function(lambda role=role: sum(r.loads.role_count(role) for r in routers))
        m.load.set_function(lambda: sum(r.last_load for r in routers))
        # The share of groups in speculative mode: 1 or 0 as with one group, between with several
        # (of the pairs and pools: the adaptive servers' group has no mode).
        moded = [r for r in routers if not r.group.adaptive] or list(routers)
        n = len(moded)
        m.mode.set_function(lambda: sum(r.state.mode == SPECULATIVE for r in moded) / n)
        m.watermark.labels("high").set_function(lambda: sum(r.policy_cfg().high_watermark for r in moded) / n)
        m.watermark.labels("low").set_function(lambda: sum(r.policy_cfg().low_watermark for r in moded) / n)
        for r in routers:
            m.child(m.group_kv_streams, r.group.name).set_function(lambda r=r: _nan(r.kv.kv_streams))
        m.watermark.labels("spillover").set(routers[0].cfg.spillover_limit)
        if any(r.adaptive is not None for r in routers):
            m.crossover_estimate.set_function(lambda: _mean_crossover(routers))


def _up(router: Router) -> bool:
    """Whether any of the group's servers is up."""
    return any(router.loads.healthy_map().values())


def _mean_crossover(routers: Sequence[Router]) -> float:
    found = [c for r in routers if r.adaptive is not None and (c := r.adaptive.estimate.crossover) is not None]
    return sum(found) / len(found) if found else math.nan


def _view(router: Router, klass: tuple[bool | None, float | None] | None) -> ClassView | None:
    return None if klass is None else router.class_pricing.view(*klass)


def _nan(value: float | None) -> float:
    return math.nan if value is None else value
