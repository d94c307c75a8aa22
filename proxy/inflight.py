"""In-flight accounting: each admitted request holds a lease, released exactly once on every path.

Counts are per server. Beside the count, each server keeps how many of its leases were taken
since its engine metrics were last scraped and are still open: the engine's reading cannot
include them yet, so the engine signal adds them (several specgate replicas each see the engines'
view plus their own latest requests, and a stale scrape does not send a burst to one server).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from .policy import Backend

# One server of each role, named by its role: the simple case.
SOLO: dict[str, Backend] = {"speculative": "speculative", "baseline": "baseline"}


class Lease:
    """One request's slot on one server. `release()` is idempotent, so every exit path may call it."""

    __slots__ = ("_epoch", "_released", "_tracker", "backend", "server")

    def __init__(self, tracker: InflightTracker, server: str, backend: Backend, epoch: int) -> None:
        self._tracker = tracker
        self.server = server
        self.backend = backend  # the server's role
        self._epoch = epoch
        self._released = False

    @property
    def released(self) -> bool:
        return self._released

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._tracker._release(self.server, self._epoch)

    def __del__(self) -> None:
        # Last resort: a lease dropped without release (a bug elsewhere) must not leak the count.
        if not self._released:
            self.release()


class InflightTracker:
    """Per-server counts. `on_change(server, count)` runs after every change (metrics, mode)."""

    def __init__(
        self, servers: Mapping[str, Backend] = SOLO, on_change: Callable[[str, int], None] | None = None
    ) -> None:
        self.roles: dict[str, Backend] = dict(servers)
        self._counts: dict[str, int] = dict.fromkeys(servers, 0)
        self._fresh: dict[str, int] = dict.fromkeys(servers, 0)
        self._epoch: dict[str, int] = dict.fromkeys(servers, 0)
        self.on_change = on_change

    def acquire(self, server: str) -> Lease:
        self._counts[server] += 1
        self._fresh[server] += 1
        if self.on_change is not None:
            self.on_change(server, self._counts[server])
        return Lease(self, server, self.roles[server], self._epoch[server])

    def _release(self, server: str, epoch: int) -> None:
        self._counts[server] -= 1
        if epoch == self._epoch[server]:
            self._fresh[server] -= 1
        if self.on_change is not None:
            self.on_change(server, self._counts[server])

    def scraped(self, server: str) -> None:
        """The server's engine metrics were just read: they include every request sent so far."""
        self._epoch[server] += 1
        self._fresh[server] = 0

    def count(self, server: str) -> int:
        return self._counts[server]

    def fresh(self, server: str) -> int:
        """Leases taken since the server's last scrape and still open."""
        return self._fresh[server]

    def snapshot(self) -> dict[str, int]:
        return dict(self._counts)

    @property
    def total(self) -> int:
        return sum(self._counts.values())
