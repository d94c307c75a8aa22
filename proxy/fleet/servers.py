"""One object per upstream server: what it is (name, role, URL, group) and what is known of it now
(its health and engine reading, this gateway's requests on it and the others'), as SGLang's
gateway keeps one `Worker` per server.

Each part has one writer: `health.HealthMonitor` the health and the engine's reading,
`inflight.InflightTracker` the counts. Routing reads servers through `ServerView`, which has no
setters, so the policy's side cannot change what it is told. The connection pool is the
transport's (upstream.py), found by the same name: routing never reaches the network.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from ..policy.base import Role
from .adapter import AcceptanceRate, EngineName
from .topology import Topology

# Acceptance from counters is averaged over this long: a few scrapes, enough drafts to mean something.
ACCEPT_WINDOW_S = 10.0


# A KV pool's size is read from its use only past this fraction: below it the gauge's rounding and
# refresh lag make the quotient noise.
MIN_USAGE_TO_SIZE = 0.05


@dataclass
class Health:
    """What the health loops know of one server (written by HealthMonitor only)."""

    healthy: bool = False
    last_error: str | None = None
    consecutive_timeouts: int = 0
    # When a proxied request last got bytes from this server (the health clock).
    last_alive: float | None = None
    # The engine whose metrics the server exports (detected, or as configured).
    engine: EngineName | None = None
    engine_load: int | None = None
    # The engine's KV cache in use, in tokens and as the pool's fraction (None: not reported).
    engine_tokens: int | None = None
    engine_kv_usage: float | None = None
    # The engine's KV pool in tokens (None: not reported).
    engine_kv_capacity: int | None = None
    # The engine's prefix cache hit rate (None: not reported), and its counters as last read.
    engine_cache_hit_rate: float | None = None
    cache_counters: tuple[float, float] | None = field(default=None, repr=False)
    # None until the first scrape; then whether the engine load could be read, and if not, why.
    engine_signal_up: bool | None = None
    engine_signal_error: str | None = "not scraped yet"
    # Live mean acceptance length (>= 1, bonus token included); None without speculation.
    spec_accept_length: float | None = None
    reading_at: float | None = field(default=None, repr=False)
    # SGLang's frozen-gauge heuristic (health.py): the values that move while it works, since when
    # they stand, and how often they usually move.
    activity: tuple[float, ...] | None = field(default=None, repr=False)
    activity_since: float = field(default=0.0, repr=False)
    moves_every_s: float = field(default=0.0, repr=False)
    acceptance: AcceptanceRate = field(default_factory=lambda: AcceptanceRate(ACCEPT_WINDOW_S), repr=False)


@dataclass
class Load:
    """This gateway's requests on one server and the others' as the engine reported them (written
    by InflightTracker only; see routing/leases.py for the smoothing)."""

    count: int = 0
    # Of those, batch requests (x-specgate-priority: batch), which the mode's load leaves out.
    batch: int = 0
    # The tokens those requests hold (their leases'): prompts as estimated, plus generated so far.
    tokens: int = 0
    # Of those, the batch requests' (left out of what the mode reckons with, as their count is).
    batch_tokens: int = 0
    # Of the prompts' tokens, those not cached there whose request has no output yet: the prefill
    # ahead of a request sent now (the TTFT SLO's prediction, routing/steps/classes.py).
    prefill: int = 0
    at_scrape: int = 0
    others: int = 0
    others_smooth: float = 0.0
    others_balance: float = 0.0
    read_at: float | None = None


@dataclass(eq=False)
class Server:
    name: str
    role: Role
    url: str
    group: str
    health: Health = field(default_factory=Health)
    load: Load = field(default_factory=Load)

    @property
    def healthy(self) -> bool:
        return self.health.healthy

    @property
    def engine(self) -> EngineName | None:
        return self.health.engine

    @property
    def engine_load(self) -> int | None:
        return self.health.engine_load

    @property
    def spec_accept_length(self) -> float | None:
        return self.health.spec_accept_length

    @property
    def kv_capacity(self) -> int | None:
        """The engine's KV pool in tokens: as it reports it, else its tokens in use over the pool's
        fraction in use (once that says enough); None: unknown."""
        h = self.health
        if h.engine_kv_capacity is not None:
            return h.engine_kv_capacity
        if h.engine_tokens and h.engine_kv_usage is not None and h.engine_kv_usage >= MIN_USAGE_TO_SIZE:
            return round(h.engine_tokens / h.engine_kv_usage)
        return None

    @property
    def kv_usage(self) -> float | None:
        """The engine's KV pool in use, as the pool's fraction (None: not reported)."""
        return self.health.engine_kv_usage


class ServerView(Protocol):
    """What routing reads of a server."""

    @property
    def name(self) -> str: ...
    @property
    def role(self) -> Role: ...
    @property
    def healthy(self) -> bool: ...
    @property
    def engine(self) -> EngineName | None: ...
    @property
    def engine_load(self) -> int | None: ...
    @property
    def spec_accept_length(self) -> float | None: ...
    @property
    def kv_capacity(self) -> int | None: ...
    @property
    def kv_usage(self) -> float | None: ...


def servers_of(topology: Topology) -> dict[str, Server]:
    """One Server for each of the topology's, by name, in the topology's order."""
    group_of = {name: g.name for g in topology.groups for names in g.servers.values() for name in names}
    return {s.name: Server(s.name, s.role, s.url, group_of[s.name]) for s in topology.servers}


def of_role(servers: Mapping[str, Server], role: Role) -> list[Server]:
    return [s for s in servers.values() if s.role == role]
