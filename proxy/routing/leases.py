"""In-flight accounting: each admitted request holds a lease, released exactly once on every path.
A lease holds the request's tokens too (its prompt as estimated, then what was generated so far:
tokens.py, observe.py), so each server's tokens in flight are as exact as its count; and its
prompt's tokens the server has not cached until its first byte comes back: each server's prefill
ahead of the next request.

Counts are per server. With the engine load signal, a server's load is what its engine last
reported minus this gateway's own requests then (the others': other replicas', other clients'),
plus this gateway's own requests now: its own part is always current, and only the others' is as
old as the last scrape. A stale scrape then does not send a burst to one server, and requests that
ended since it do not count twice. The others' part is also smoothed: over about a second for
the mode (which takes the larger of the reading and that: loads.GroupLoads.server_load), over several
for placement, because every replica reads the same stale figure at once, and placing requests by
it moved them all to the same group together, then all away (see BALANCE_TAU_S).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping

from ..fleet.servers import Load, Server
from ..policy.base import Role


class Lease:
    """One request's slot on one server. `release()` is idempotent, so every exit path may call it."""

    __slots__ = ("_released", "_tracker", "batch", "prefill", "role", "server", "tokens")

    def __init__(
        self, tracker: InflightTracker, server: str, role: Role, tokens: int = 0, batch: bool = False, prefill: int = 0
    ) -> None:
        self._tracker = tracker
        self.server = server
        self.role = role  # the server's
        self.tokens = tokens
        # A batch request (x-specgate-priority: batch): left out of the load the mode compares.
        self.batch = batch
        # Its prompt's tokens the server has to prefill, until its first output.
        self.prefill = prefill
        self._released = False

    @property
    def released(self) -> bool:
        return self._released

    def add(self, tokens: int) -> None:
        """More tokens held (generated) by this request on its server."""
        if tokens > 0 and not self._released:
            self.tokens += tokens
            self._tracker._add_tokens(self.server, tokens, self.batch)

    def prefilled(self) -> None:
        """Its prompt's prefill is behind it (its first body byte came: relay.py)."""
        if self.prefill:
            self._tracker._prefilled(self.server, self.prefill)
            self.prefill = 0

    def release(self) -> None:
        if not self._released:
            self.prefilled()
            self._released = True
            self._tracker._release(self.server, self.tokens, self.batch)

    def __del__(self) -> None:
        # Last resort: a lease dropped without release (a bug elsewhere) must not leak the count.
        if not self._released:
            self.release()


# The others' requests are smoothed with this time constant for the mode: over a few scrapes at
# 0.2 s, hardly at all at the 2 s default (one gateway: the others are rarely anything).
OTHERS_TAU_S = 1.0
# ...and with this one for placement. Every replica reads the same engine figure, up to a second
# old (SGLang refreshes its gauges at prefill and every 40 decode steps), and a request lasts about
# as long: placing by it with a short time constant is feedback with a delay as long as the thing
# it controls, and the replicas' requests sloshed between groups together, 3/17 then 19/1 every
# two seconds. Each replica's own requests, known exactly and at once, keep its share even; the
# others' part only needs to catch what persists (another client, a replica that routes
# differently), so it may be slow. Five seconds brought the measured sloshing down; see docs/many-nodes.md.
BALANCE_TAU_S = 5.0


class InflightTracker:
    """Per-server counts, kept in each Server's `load`. `on_change(server, count)` runs after every
    change (metrics, mode)."""

    def __init__(
        self,
        servers: Mapping[str, Server],
        on_change: Callable[[str, int], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._clock = clock
        self._servers = servers
        self.on_change = on_change

    def role(self, server: str) -> Role:
        return self._servers[server].role

    def acquire(self, server: str, tokens: int = 0, batch: bool = False, prefill: int = 0) -> Lease:
        """A lease of `tokens` (the prompt's, as estimated), `prefill` of them not cached there."""
        s = self._servers[server]
        s.load.count += 1
        s.load.batch += batch
        s.load.tokens += max(0, tokens)
        prefill = min(max(0, prefill), max(0, tokens))
        s.load.prefill += prefill
        if batch:
            s.load.batch_tokens += max(0, tokens)
        if self.on_change is not None:
            self.on_change(server, s.load.count)
        return Lease(self, server, s.role, max(0, tokens), batch, prefill)

    def _prefilled(self, server: str, tokens: int) -> None:
        self._servers[server].load.prefill -= tokens

    def _add_tokens(self, server: str, tokens: int, batch: bool) -> None:
        load = self._servers[server].load
        load.tokens += tokens
        if batch:
            load.batch_tokens += tokens

    def _release(self, server: str, tokens: int, batch: bool) -> None:
        load = self._servers[server].load
        load.count -= 1
        load.batch -= batch
        load.tokens -= tokens
        if batch:
            load.batch_tokens -= tokens
        if self.on_change is not None:
            self.on_change(server, load.count)

    def scraping(self, server: str) -> None:
        """The server's /metrics is being read: its reading will include this many of ours."""
        load = self._servers[server].load
        load.at_scrape = load.count

    def scraped(self, server: str, reading: int) -> None:
        """The engine reported `reading` running + queued requests."""
        load = self._servers[server].load
        others = max(0, reading - load.at_scrape)
        now, last = self._clock(), load.read_at
        gap = math.inf if last is None else max(0.0, now - last)
        load.read_at = now
        load.others = others
        load.others_smooth += _weight(gap, OTHERS_TAU_S) * (others - load.others_smooth)
        load.others_balance += _weight(gap, BALANCE_TAU_S) * (others - load.others_balance)

    def count(self, server: str) -> int:
        return self._servers[server].load.count

    def load_of(self, server: str) -> Load:
        """The server's counters themselves, to read (for the per-request snapshot: one lookup)."""
        return self._servers[server].load

    def batch(self, server: str) -> int:
        """Of `count`, the batch requests (x-specgate-priority: batch)."""
        return self._servers[server].load.batch

    def tokens(self, server: str) -> int:
        """Tokens this gateway's requests hold on the server: prompts as estimated, plus what they
        generated so far."""
        return self._servers[server].load.tokens

    def prefill(self, server: str) -> int:
        """Prompt tokens of this gateway's requests on the server still to prefill (not cached
        there, no output yet)."""
        return self._servers[server].load.prefill

    def was_read(self, server: str) -> bool:
        """Whether the server's engine load was ever read."""
        return self._servers[server].load.read_at is not None

    def others(self, server: str) -> int:
        """Requests on the server that are not this gateway's, as last read."""
        return self._servers[server].load.others

    def others_smooth(self, server: str) -> float:
        """The others' requests smoothed over about a second: what the mode reads as they fall."""
        return self._servers[server].load.others_smooth

    def others_balance(self, server: str) -> float:
        """The others' requests smoothed over several seconds: what placement adds to ours."""
        return self._servers[server].load.others_balance

    @property
    def total(self) -> int:
        return sum(s.load.count for s in self._servers.values())


def _weight(gap: float, tau: float) -> float:
    """An exponential moving average's step for a reading `gap` seconds after the last one."""
    return 1.0 - math.exp(-gap / tau)
