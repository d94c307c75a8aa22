"""Health of each server, and the load and acceptance its engine reports.

A background task polls `/health` of every server every `health_interval_s`, and another reads
`/metrics` every `scrape_interval_s` (as often as 0.1 s: several gateways route on it), so a slow
`/health` never delays the load reading. A refused or failed connection is
the sure sign of a dead server; a slow `/health` is only a hint (SGLang runs a one-token
generation for it, and a saturated llama-server answers it after the running batch), so timeouts
mark a server down only after several in a row, and not at all while the server is answering
proxied requests: that is the best proof of life there is (passive health). Requests that cannot
connect call `mark_down` so traffic moves at once instead of at the next poll.

What `/metrics` means is the engine adapters' business (engines.py): detected from the names,
or fixed by `SPECGATE_ENGINE`. When the engine load cannot be read, nothing is silent: a warning
once per outage, `specgate_engine_signal_up{backend}` 0, and `/routing` says why and which signal
is in effect (the policy then counts that server by this proxy's own in-flight requests). A
reading holding a value no server could report (adapter.py) is such an unreadable signal too.

The two loops are the only source of health and load: one that died would leave its last values
standing, unsaid. So a round that fails (a probe, a reading, a callback) is logged once per
outage, with its traceback, and the next round runs as usual; a line says when rounds work again.

What a /metrics answer says (and SGLang's gauges that freeze when idle) is readings.py's business;
the servers' records are in servers.py, and the role-level gauges are metrics.py's.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping

from ..config import Settings
from ..fleet import readings
from ..fleet.adapter import Engine
from ..fleet.engines import ENGINES, describe_health
from ..fleet.servers import Server, of_role
from ..observability.metrics import Metrics
from ..policy.base import ALL_ROLES, Role
from .upstream import Upstream

log = logging.getLogger("specgate.health")

# Consecutive /health timeouts that mark a server down (unless it is answering proxied requests).
TIMEOUTS_BEFORE_DOWN = 3


class _Outage:
    """A background loop's failing rounds: said once, with the traceback, until a round works."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.failing = False

    def failed(self, exc: BaseException) -> None:
        if not self.failing:
            self.failing = True
            log.error(
                "%s failed (%s: %s); it goes on every round, and is logged again once it works",
                self.what,
                type(exc).__name__,
                exc,
                exc_info=exc,
            )

    def worked(self) -> None:
        if self.failing:
            self.failing = False
            log.info("%s works again", self.what)


class HealthMonitor:
    """Writes each Server's `health`; tells its sinks (given here, never patched on later) what it
    found: `on_change` after every round and every change of health, `on_scrape` just before a
    server's /metrics is read and `on_reading` with the engine load it gave; `own` is this
    gateway's requests in flight on a server."""

    def __init__(
        self,
        settings: Settings,
        upstream: Upstream,
        servers: Mapping[str, Server],
        metrics: Metrics,
        *,
        on_change: Callable[[], None] = lambda: None,
        on_scrape: Callable[[str], None] = lambda server: None,
        on_reading: Callable[[str, int], None] = lambda server, load: None,
        own: Callable[[str], int] = lambda server: 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._settings = settings
        self._upstream = upstream
        self._metrics = metrics
        self._on_change = on_change
        self._on_scrape = on_scrape
        self._on_reading = on_reading
        self._own = own
        self._clock = clock
        self._engine: Engine | None = None if settings.engine == "auto" else ENGINES[settings.engine]
        # Proxied traffic younger than this keeps a server with a timing-out /health up: as long as
        # the timeouts would have taken to mark it down.
        self.alive_window_s = TIMEOUTS_BEFORE_DOWN * (settings.health_interval_s + settings.health_timeout_s)
        self.servers = servers
        self._roles = {role: of_role(servers, role) for role in ALL_ROLES}
        self._polls = _Outage("the /health poll of the servers")
        self._scrapes = _Outage("the /metrics scrape of the servers")

    def role_healthy(self, role: Role) -> bool:
        """Whether any server of the role is healthy."""
        return any(s.healthy for s in self._roles[role])

    def signal_in_effect(self) -> tuple[str, str | None]:
        """The load signal the policy really uses, and why it differs from the configured one."""
        configured = self._settings.load_signal
        if configured == "local":
            return "local", None
        down = {n: s.health.engine_signal_error for n, s in self.servers.items() if not s.health.engine_signal_up}
        if not down:
            return configured, None
        why = "; ".join(f"{b}: {err}" for b, err in down.items())
        if len(down) == len(self.servers):
            return "local", f"no engine load readable ({why}): counting this proxy's in-flight requests"
        return "mixed", f"engine load unreadable for {why}: that server counted by this proxy's in-flight requests"

    def mark_down(self, server: str, reason: str) -> None:
        self._set(server, False, reason)

    def note_alive(self, server: str) -> None:
        """A proxied request got bytes from this server just now."""
        h = self.servers[server].health
        h.last_alive = self._clock()
        if not h.healthy and h.consecutive_timeouts >= TIMEOUTS_BEFORE_DOWN:
            # Down only for slow /health answers, yet it serves: it is alive.
            h.consecutive_timeouts = 0
            self._set(server, True, None)

    def _set(self, server: str, healthy: bool, error: str | None) -> None:
        srv = self.servers[server]
        h = srv.health
        h.last_error = error
        if h.healthy != healthy:
            h.healthy = healthy
            self._metrics.server_up.labels(server).set(1 if healthy else 0)
            self._metrics.backend_up.labels(srv.role).set(1 if self.role_healthy(srv.role) else 0)
            if healthy:
                log.info("server %s is up", server)
            else:
                log.warning("server %s is down: %s", server, error)
            self._on_change()

    async def run(self) -> None:
        """Poll /health every health_interval_s and scrape /metrics every scrape_every_s."""
        s = self._settings
        await asyncio.gather(
            self._every(s.health_interval_s, self._poll, self._polls),
            self._every(s.scrape_every_s, self._scrape_safely, self._scrapes),
        )

    async def _every(self, interval_s: float, each: Callable[[str], Awaitable[None]], outage: _Outage) -> None:
        while True:
            await asyncio.sleep(interval_s)
            await self._round(each, outage)

    async def poll_once(self) -> None:
        await asyncio.gather(self._round(self._poll, self._polls), self._round(self._scrape_safely, self._scrapes))

    async def _round(self, each: Callable[[str], Awaitable[None]], outage: _Outage) -> None:
        """`each` for every server, then `on_change`. A failure is the outage's to say; it never ends
        the loop. Each server's failure stays its own: the others' rounds finish."""
        results = await asyncio.gather(*(each(name) for name in self.servers), return_exceptions=True)
        failures = [r for r in results if isinstance(r, BaseException)]
        for failure in failures:
            if not isinstance(failure, Exception):
                raise failure  # cancelled, or the interpreter going: not a round's failure
        try:
            self._on_change()
        except Exception as exc:
            failures.append(exc)
        if failures:
            outage.failed(failures[0])
        else:
            outage.worked()

    async def _poll(self, backend: str) -> None:
        s = self._settings
        probe = await self._upstream.get(backend, "/health", s.health_timeout_s)
        h = self.servers[backend].health
        if probe.status == 200:
            h.consecutive_timeouts = 0
            self._set(backend, True, None)
        elif probe.error is not None and probe.error.kind == "timeout":
            since = None if h.last_alive is None else self._clock() - h.last_alive
            if h.healthy and since is not None and since <= self.alive_window_s:
                h.consecutive_timeouts = 0
                h.last_error = f"/health timed out, but proxied requests got answers {since:.1f} s ago"
                return
            h.consecutive_timeouts += 1
            if h.consecutive_timeouts >= TIMEOUTS_BEFORE_DOWN:
                self._set(backend, False, f"/health timed out {h.consecutive_timeouts} times in a row")
        elif probe.error is not None:
            self._set(backend, False, str(probe.error))
        else:
            self._set(backend, False, describe_health(probe.status or 0, probe.body))

    async def _scrape_safely(self, backend: str) -> None:
        try:
            await self._scrape(backend)
        except Exception as exc:
            # A reading that broke halfway is no reading: the last one must not stand as if fresh.
            self._signal_down(self.servers[backend], f"reading /metrics failed: {type(exc).__name__}: {exc}"[:300])
            raise

    async def _scrape(self, backend: str) -> None:
        """Read the engine's load and acceptance. Scraped under every load signal: the dashboard
        and /routing show the engine's view too."""
        srv = self.servers[backend]
        h = srv.health
        self._on_scrape(backend)
        probe = await self._upstream.get(backend, "/metrics", self._settings.health_timeout_s)
        now = self._clock()
        stale_s = self._settings.engine_stale_s
        if probe.error is not None:
            found: readings.Found | str = f"/metrics: {probe.error}"
        else:
            found = readings.read(h, probe.status, probe.body, now, self._engine, stale_s, self._own(backend))
        if isinstance(found, str):
            timed_out = probe.error is not None and probe.error.kind == "timeout"
            fresh = h.reading_at is not None and now - h.reading_at < stale_s
            if not (timed_out and fresh):  # a busy server's slow scrape: its last reading stands a while
                self._signal_down(srv, found)
            return
        h.engine = found.engine.name
        h.engine_load, h.reading_at = found.load, now
        self._on_reading(backend, found.load)
        h.spec_accept_length = found.accept_length
        h.engine_tokens, h.engine_kv_usage = found.kv_tokens, found.kv_usage
        h.engine_kv_capacity = found.kv_capacity
        h.engine_cache_hit_rate = found.cache_hit_rate
        if h.engine_signal_up is not True:
            h.engine_signal_up, h.engine_signal_error = True, None
            log.info("engine load of %s readable (%s)", backend, found.engine.name)
        self._metrics.publish_reading(srv, self._roles[srv.role])

    def _signal_down(self, srv: Server, error: str) -> None:
        h = srv.health
        h.engine_load, h.reading_at, h.activity, h.spec_accept_length = None, None, None, None
        h.engine_tokens, h.engine_kv_usage, h.engine_cache_hit_rate = None, None, None
        h.engine_kv_capacity = None
        was_up = h.engine_signal_up
        h.engine_signal_up, h.engine_signal_error = False, error
        self._metrics.publish_reading(srv, self._roles[srv.role])
        if was_up is not False:  # once per outage
            level = logging.WARNING if self._settings.load_signal != "local" else logging.DEBUG
            log.log(
                level,
                "engine load of %s unreadable, so SPECGATE_LOAD_SIGNAL=%s counts it by this proxy's "
                "in-flight requests: %s",
                srv.name,
                self._settings.load_signal,
                error,
            )
