"""The router: the one owner of the policy's state. It snapshots load and health, asks the pure
policy, admits the request (a lease), and records every decision and mode switch."""

from __future__ import annotations

import logging

from .health import HealthMonitor
from .inflight import InflightTracker, Lease
from .metrics import Metrics
from .policy import (
    Backend,
    Decision,
    LoadSnapshot,
    PolicyConfig,
    PolicyState,
    backend_load,
    decide,
    next_mode,
    total_load,
)

log = logging.getLogger("specgate.routing")


class Router:
    def __init__(self, cfg: PolicyConfig, health: HealthMonitor, metrics: Metrics) -> None:
        self.cfg = cfg
        self._health = health
        self._metrics = metrics
        self.state = PolicyState()
        self.tracker = InflightTracker(on_change=self._inflight_changed)
        metrics.set_watermarks(cfg.high_watermark, cfg.low_watermark, cfg.spillover_limit)
        metrics.set_mode(self.state.mode)
        self.refresh()

    def snapshot(self) -> LoadSnapshot:
        return LoadSnapshot(self.tracker.snapshot(), self._health.engine_loads(), self._health.healthy_map())

    @property
    def load(self) -> int:
        return total_load(self.snapshot(), self.cfg.load_signal)

    def decide(self) -> Decision:
        decision = decide(self.snapshot(), self.state, self.cfg)
        self._set_state(decision.state)
        self._metrics.child(self._metrics.decisions, decision.backend or "none", decision.reason).inc()
        return decision

    def admit(self, backend: Backend) -> Lease:
        return self.tracker.acquire(backend)

    def failover(self, lease: Lease, to: Backend) -> Lease:
        """Move a request that failed before its first byte to the other backend."""
        self._metrics.failovers.labels(lease.backend, to).inc()
        self._metrics.decisions.labels(to, "failover").inc()
        new = self.tracker.acquire(to)
        lease.release()
        return new

    def refresh(self) -> None:
        """Re-apply the hysteresis after load or health changed, so the mode gauge tells the truth."""
        if self.cfg.load_signal == "local":
            # The common case, on every admit and release: no snapshot to build.
            load, spec_load = self.tracker.total, self.tracker.count("speculative")
        else:
            snap = self.snapshot()
            load = total_load(snap, self.cfg.load_signal)
            spec_load = backend_load(snap, "speculative", self.cfg.load_signal)
        self._metrics.load.set(load)
        if self.cfg.policy == "threshold":
            self._set_state(next_mode(load, self.state, self.cfg))
        else:
            self._set_state(PolicyState("speculative" if spec_load < self.cfg.spillover_limit else "baseline"))

    def _inflight_changed(self, backend: Backend, count: int) -> None:
        self._metrics.child(self._metrics.inflight, backend).set(count)
        self.refresh()

    def _set_state(self, state: PolicyState) -> None:
        if state.mode != self.state.mode:
            log.info("routing mode %s -> %s (load %d)", self.state.mode, state.mode, self.load)
            self._metrics.mode_switches.labels(state.mode).inc()
            self._metrics.set_mode(state.mode)
        self.state = state
