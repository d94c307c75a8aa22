"""Health of each SGLang server, and the load its engine reports.

A background task polls `/health` (and `/metrics` when the load signal needs the engine's view)
every `health_interval_s`. A refused or failed connection is the sure sign of a dead server; a
slow `/health` is only a hint (SGLang runs a one-token generation for it), so timeouts mark a
server down only after several in a row. Requests that cannot connect call `mark_down` so traffic
moves at once instead of at the next poll.

SGLang refreshes its gauges every 40 decode steps and keeps them when idle, so a server that went
quiet can report running requests forever. Gauges and counters that have not moved for
`engine_stale_s` are read as an idle server: engine load 0.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from .config import Settings
from .metrics import Metrics
from .policy import BACKENDS, Backend
from .upstream import Upstream

log = logging.getLogger("specgate.health")

# Consecutive /health timeouts that mark a server down.
TIMEOUTS_BEFORE_DOWN = 3
_PREFIXES = ("sglang:", "sglang_")
_LOAD_GAUGES = ("num_running_reqs", "num_queue_reqs")
# Values whose standing still means an idle server (they move on every 40-step refresh or finish).
_ACTIVITY = (
    "num_running_reqs",
    "num_queue_reqs",
    "gen_throughput",
    "generation_tokens_total",
    "prompt_tokens_total",
    "num_requests_total",
)


@dataclass
class BackendHealth:
    name: Backend
    healthy: bool = False
    last_error: str | None = None
    consecutive_timeouts: int = 0
    engine_load: int | None = None
    spec_accept_length: float | None = None
    _activity: tuple[float, ...] | None = field(default=None, repr=False)
    _activity_since: float = 0.0


def parse_engine_metrics(text: str) -> dict[str, float]:
    """SGLang metric values by name without prefix, summed over label sets (tp/dp ranks)."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            for prefix in _PREFIXES:
                if sample.name.startswith(prefix):
                    name = sample.name[len(prefix) :]
                    out[name] = out.get(name, 0.0) + sample.value
                    break
    return out


class HealthMonitor:
    def __init__(
        self,
        settings: Settings,
        upstream: Upstream,
        metrics: Metrics,
        on_change: Callable[[], None] = lambda: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._settings = settings
        self._upstream = upstream
        self._metrics = metrics
        self.on_change = on_change
        self._clock = clock
        self.backends: dict[Backend, BackendHealth] = {b: BackendHealth(b) for b in BACKENDS}

    def healthy(self, backend: Backend) -> bool:
        return self.backends[backend].healthy

    def healthy_map(self) -> dict[Backend, bool]:
        return {b: h.healthy for b, h in self.backends.items()}

    def engine_loads(self) -> dict[Backend, int | None]:
        return {b: h.engine_load for b, h in self.backends.items()}

    def mark_down(self, backend: Backend, reason: str) -> None:
        self._set(backend, False, reason)

    def _set(self, backend: Backend, healthy: bool, error: str | None) -> None:
        h = self.backends[backend]
        h.last_error = error
        if h.healthy != healthy:
            h.healthy = healthy
            self._metrics.backend_up.labels(backend).set(1 if healthy else 0)
            if healthy:
                log.info("backend %s is up", backend)
            else:
                log.warning("backend %s is down: %s", backend, error)
            self.on_change()

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self._settings.health_interval_s)
            await self.poll_once()

    async def poll_once(self) -> None:
        await asyncio.gather(*(self._poll(b) for b in BACKENDS))
        self.on_change()

    async def _poll(self, backend: Backend) -> None:
        s = self._settings
        probe = await self._upstream.get(backend, "/health", s.health_timeout_s)
        h = self.backends[backend]
        if probe.status == 200:
            h.consecutive_timeouts = 0
            self._set(backend, True, None)
        elif probe.error is not None and probe.error.kind == "timeout":
            h.consecutive_timeouts += 1
            if h.consecutive_timeouts >= TIMEOUTS_BEFORE_DOWN:
                self._set(backend, False, f"/health timed out {h.consecutive_timeouts} times in a row")
        elif probe.error is not None:
            self._set(backend, False, str(probe.error))
        else:
            self._set(backend, False, f"/health answered {probe.status}")
        # Scraped under every load signal: the dashboard and /routing show the engine's view too.
        await self._scrape(backend)

    async def _scrape(self, backend: Backend) -> None:
        h = self.backends[backend]
        probe = await self._upstream.get(backend, "/metrics", self._settings.health_timeout_s)
        values: dict[str, float] | None = None
        if probe.status == 200:
            try:
                values = parse_engine_metrics(probe.body.decode("utf-8", "replace"))
            except ValueError:
                values = None
        if not values or not all(g in values for g in _LOAD_GAUGES):
            h.engine_load = None
            h._activity = None
            self._metrics.engine_load.labels(backend).set(-1)
            return
        now = self._clock()
        activity = tuple(values.get(k, 0.0) for k in _ACTIVITY)
        if activity != h._activity:
            h._activity, h._activity_since = activity, now
        stale = now - h._activity_since >= self._settings.engine_stale_s
        load = 0 if stale else int(values["num_running_reqs"] + values["num_queue_reqs"])
        h.engine_load = load
        h.spec_accept_length = values.get("spec_accept_length")
        self._metrics.engine_load.labels(backend).set(load)
