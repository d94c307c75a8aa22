"""Every metric specgate exports, defined in one place on a per-app registry.

Labels come only from small fixed sets (backend, reason, endpoint, status class, error kind, and
the configured server and group names), and every combination is created up front so dashboards
see zeros instead of missing series.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.registry import Collector

from ..fleet.servers import Server
from ..kinds import ENDPOINTS, ERROR_KINDS, REJECTIONS
from ..policy.base import ALL_ROLES, REASONS, ROLES, Role, other
from ..routing.switch import SOURCES, SWITCHES

# Requests the proxy answered itself (auth, size, no backend) carry backend="none".
CODE_CLASSES = ("2xx", "4xx", "5xx")

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 60, 120, 300)
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 60)
CHUNK_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1, 2.5)


# ok: measured; no_usage: answered without a usage chunk; error: failed or refused.
SHADOW_OUTCOMES = ("ok", "no_usage", "error")
# Why a remembered conversation's turn went elsewhere (affinity.Outcome's breaks, without the prefix).
AFFINITY_BREAKS = ("load", "mode", "down")


def code_class(status: int) -> str:
    return f"{min(max(status // 100, 2), 5)}xx"


class Tally(Collector):
    """A labelled counter for the per-request decision: a plain dict of counts, read when scraped.
    A prometheus_client Counter's child takes a lock and checks its amount on every `inc`, a
    third of a microsecond of a decision's ten (loadtest/decisions.py); the event loop is the only
    writer here, and a scrape copies the counts before reading them. Exported as a Counter is
    (`NAME_total`), without the `_created` series the process turns off for every metric."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str], registry: CollectorRegistry) -> None:
        self.name, self.documentation, self.labelnames = name, documentation, tuple(labelnames)
        self.counts: dict[tuple[str, ...], int] = {}
        registry.register(self)

    def inc(self, *labels: str) -> None:
        counts = self.counts
        counts[labels] = counts.get(labels, 0) + 1

    def prime(self, *labels: str) -> None:
        """A series exported as 0 until counted (the module's rule: zeros, not missing series)."""
        self.counts.setdefault(labels, 0)

    def value(self, *labels: str) -> int:
        return self.counts.get(labels, 0)

    def _family(self) -> CounterMetricFamily:
        return CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def describe(self) -> Iterator[CounterMetricFamily]:
        yield self._family()

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = self._family()
        for labels, count in list(self.counts.items()):
            family.add_metric(labels, count)
        yield family


class Metrics:
    """Every metric, in one registry per app. `servers` and `groups` are the configured names
    (proxy/fleet/topology.py): a bounded set, so labels by them are safe."""

    def __init__(self, servers: Sequence[str], groups: Sequence[str], roles: Sequence[Role] = ROLES) -> None:
        self.servers, self.groups = tuple(servers), tuple(groups)
        # The roles configured, whose series are primed (an adaptive fleet alone has no pair's).
        self.roles = tuple(roles)
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "specgate_requests",
            "Requests answered, by backend, endpoint and status class.",
            ["backend", "endpoint", "code"],
            registry=r,
        )
        self.decisions = Tally(
            "specgate_routing_decisions", "Routing decisions by chosen backend and reason.", ["backend", "reason"], r
        )
        self.inflight = Gauge("specgate_inflight_requests", "Requests in flight.", ["backend"], registry=r)
        self.load = Gauge("specgate_load", "The load the policy compares with the watermarks.", registry=r)
        self.mode = Gauge(
            "specgate_routing_mode", "Routing mode for new requests: 1 speculative, 0 baseline.", registry=r
        )
        self.mode_switches = Counter("specgate_mode_switches", "Routing mode switches.", ["to"], registry=r)
        self.watermark = Gauge(
            "specgate_watermark",
            "Watermarks in effect (live under the adaptive policy) and the spillover limit.",
            ["level"],
            registry=r,
        )
        self.crossover_estimate = Gauge(
            "specgate_crossover_estimate",
            "Adaptive policy: concurrent streams where speculation is believed to stop paying now "
            "(0: it pays at no load; NaN: not known or another policy).",
            registry=r,
        )
        self.backend_up = Gauge(
            "specgate_backend_up", "1 when the backend (any server of the role) is healthy.", ["backend"], registry=r
        )
        # Per server and per group (several servers, proxy/fleet/topology.py).
        self.server_up = Gauge("specgate_server_up", "1 when the server is healthy.", ["server"], registry=r)
        self.server_inflight = Gauge(
            "specgate_server_inflight", "Requests in flight from this gateway on each server.", ["server"], registry=r
        )
        self.server_tokens = Gauge(
            "specgate_server_tokens",
            "Tokens this gateway's requests in flight hold on each server: prompts as estimated from their "
            "bodies (scaled by what servers reported of earlier ones), plus the tokens generated so far.",
            ["server"],
            registry=r,
        )
        self.server_engine_tokens = Gauge(
            "specgate_server_engine_tokens",
            "Tokens in the server's KV cache as its engine last reported them (SGLang's num_used_tokens; "
            "-1: unknown or not reported).",
            ["server"],
            registry=r,
        )
        self.server_kv_usage = Gauge(
            "specgate_server_kv_usage",
            "The server's KV pool in use, as a fraction, as its engine last reported it (SGLang's token_usage, "
            "vLLM's kv_cache_usage_perc; NaN: unknown or not reported).",
            ["server"],
            registry=r,
        )
        self.server_requests = Counter(
            "specgate_server_requests", "Requests sent to each server (retries included).", ["server"], registry=r
        )
        self.server_engine_load = Gauge(
            "specgate_server_engine_load",
            "Running + queued requests as the server's engine last reported them (-1: unknown).",
            ["server"],
            registry=r,
        )
        self.group_mode = Gauge(
            "specgate_group_mode", "Each group's routing mode: 1 speculative, 0 baseline.", ["group"], registry=r
        )
        self.group_mode_switches = Counter(
            "specgate_group_mode_switches", "Each group's routing mode switches.", ["group", "to"], registry=r
        )
        self.group_load = Gauge(
            "specgate_group_load", "The load each group's policy compares with its watermarks.", ["group"], registry=r
        )
        self.group_watermark = Gauge(
            "specgate_group_watermark", "Each group's watermarks in effect.", ["group", "level"], registry=r
        )
        self.group_kv_streams = Gauge(
            "specgate_group_kv_capacity_streams",
            "Learning policies: the streams each group's speculative KV pool holds at the tokens a stream "
            "holds now (a paired group's read SPECGATE_KV_FORECAST_S ahead), which caps its watermarks "
            "(NaN: unknown).",
            ["group"],
            registry=r,
        )
        self.group_crossover = Gauge(
            "specgate_group_crossover_estimate",
            "Adaptive policy: each group's crossover estimate (see specgate_crossover_estimate).",
            ["group"],
            registry=r,
        )
        self.engine_load = Gauge(
            "specgate_engine_load",
            "Running plus queued requests the server reports (-1: unknown or stale).",
            ["backend"],
            registry=r,
        )
        self.engine_signal_up = Gauge(
            "specgate_engine_signal_up",
            "1 when the server's engine load could be read from its /metrics (0: the policy counts it locally).",
            ["backend"],
            registry=r,
        )
        self.accept_length = Gauge(
            "specgate_accept_length",
            "Live mean speculative acceptance length the server reports (bonus token included; NaN: none).",
            ["backend"],
            registry=r,
        )
        self.shadow_probes = Counter(
            "specgate_shadow_probes",
            "Shadow probes (capped copies of requests) sent to the speculative server, by outcome.",
            ["outcome"],
            registry=r,
        )
        self.stored_responses = Gauge(
            "specgate_stored_responses",
            "Stored Responses API responses whose server specgate remembers (SPECGATE_RESPONSES_ENTRIES caps them).",
            registry=r,
        )
        self.affinity_hits = Counter(
            "specgate_affinity_hits",
            "Turns of a remembered conversation sent to the server that holds its prefix cache.",
            registry=r,
        )
        self.affinity_misses = Counter(
            "specgate_affinity_misses", "Turns of a conversation with no server remembered.", registry=r
        )
        self.affinity_breaks = Counter(
            "specgate_affinity_breaks",
            "Turns of a remembered conversation sent elsewhere, by reason: load (its server held more than "
            "the re-prefill saved was worth), mode (the policy chose the other role), down (its server was).",
            ["reason"],
            registry=r,
        )
        self.affinity_entries = Gauge(
            "specgate_affinity_entries",
            "Conversations whose server specgate remembers (SPECGATE_AFFINITY_ENTRIES caps them).",
            registry=r,
        )
        self.server_cache_hit_rate = Gauge(
            "specgate_server_cache_hit_rate",
            "The share of prompt tokens the server's engine found in its prefix cache, as it last reported it "
            "(its counters of cached and looked-up prompt tokens between scrapes; SGLang's cache_hit_rate gauge "
            "where it has no such counter; NaN: unknown).",
            ["server"],
            registry=r,
        )
        # Per traffic class: labels only of the tracked classes (SPECGATE_MAX_CLASSES, and those the
        # calibration file names) and `other`;
        # a forgotten class's series go with it.
        self.class_requests = Counter(
            "specgate_class_requests",
            "Requests by traffic class (SPECGATE_CLASS_KEY) and the backend they went to.",
            ["class", "backend"],
            registry=r,
        )
        self.class_accept_length = Gauge(
            "specgate_class_accept_length",
            "Acceptance length learnt for each tracked traffic class from its speculative responses (NaN: not yet).",
            ["class"],
            registry=r,
        )
        # A client's speculation switch (routing/switch.py): by what it asked, where that came from
        # (header, body, class), and whether the request went where it asked.
        self.speculation_switch = Tally(
            "specgate_speculation_switch",
            "Requests that asked for speculation on or off, by where that came from and whether it was honoured.",
            ["switch", "source", "honoured"],
            r,
        )
        self.failovers = Counter(
            "specgate_failovers", "Requests retried on the other backend.", ["from", "to"], registry=r
        )
        self.upstream_errors = Counter(
            "specgate_upstream_errors", "Failures talking to a backend, by kind.", ["backend", "kind"], registry=r
        )
        self.server_upstream_errors = Counter(
            "specgate_server_upstream_errors",
            "Failures talking to each server, by kind (which server of a role failed).",
            ["server", "kind"],
            registry=r,
        )
        self.client_disconnects = Counter(
            "specgate_client_disconnects", "Clients that left before their response ended.", ["backend"], registry=r
        )
        self.client_connections = Gauge(
            "specgate_client_connections",
            "Client connections open (SPECGATE_MAX_CLIENT_CONNECTIONS caps them).",
            registry=r,
        )
        self.client_rejections = Counter(
            "specgate_client_rejections",
            "Client connections refused past the cap (limit) or closed before a request head arrived "
            "(header_timeout), because it grew too large (head_too_large), or because the request asked to "
            "upgrade the connection and had a body (upgrade).",
            ["reason"],
            registry=r,
        )
        self.output_tokens = Counter("specgate_output_tokens", "Output tokens relayed.", ["backend"], registry=r)
        self.prompt_tokens = Counter("specgate_prompt_tokens", "Prompt tokens sent.", ["backend"], registry=r)
        self.duration = Histogram(
            "specgate_request_duration_seconds",
            "Time from request to the end of its response.",
            ["backend", "endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "specgate_time_to_first_token_seconds",
            "Time from request to the first content chunk of a stream.",
            ["backend"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.inter_chunk = Histogram(
            "specgate_inter_chunk_latency_seconds",
            "Time between two chunks of a stream relayed to the client.",
            ["backend"],
            buckets=CHUNK_BUCKETS,
            registry=r,
        )
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        self._prime()

    def child(self, metric: MetricWrapperBase, *labels: str) -> Any:
        """`metric.labels(*labels)`, cached: the per-request and per-chunk paths call this."""
        key = (id(metric), labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found

    def _prime(self) -> None:
        for b in self.roles:
            self.inflight.labels(b).set(0)
            self.backend_up.labels(b).set(0)
            self.engine_load.labels(b).set(-1)
            self.engine_signal_up.labels(b).set(0)
            self.accept_length.labels(b).set(math.nan)
            self.failovers.labels(b, other(b))
            self.client_disconnects.labels(b)
            self.output_tokens.labels(b)
            self.prompt_tokens.labels(b)
            self.ttft.labels(b)
            self.inter_chunk.labels(b)
            self.mode_switches.labels(b)
            for reason in REASONS:
                if reason != "no_healthy_backend":
                    self.decisions.prime(b, reason)
            for kind in ERROR_KINDS:
                self.upstream_errors.labels(b, kind)
            for ep in ENDPOINTS:
                self.duration.labels(b, ep)
        self.decisions.prime("none", "no_healthy_backend")
        for asked in SWITCHES:
            for source in SOURCES:
                for honoured in ("true", "false"):
                    self.speculation_switch.prime(asked, source, honoured)
        for why in REJECTIONS:
            self.client_rejections.labels(why)
        for label in (*self.roles, "none"):
            for ep in ENDPOINTS:
                for code in CODE_CLASSES:
                    self.requests.labels(label, ep, code)
        for server in self.servers:
            for kind in ERROR_KINDS:
                self.server_upstream_errors.labels(server, kind)
            self.server_up.labels(server).set(0)
            self.server_inflight.labels(server).set(0)
            self.server_requests.labels(server)
            self.server_engine_load.labels(server).set(-1)
            self.server_tokens.labels(server).set(0)
            self.server_engine_tokens.labels(server).set(-1)
            self.server_kv_usage.labels(server).set(math.nan)
            self.server_cache_hit_rate.labels(server).set(math.nan)
        for group in self.groups:
            self.group_mode.labels(group).set(1)
            self.group_load.labels(group).set(0)
            for mode in ROLES:
                self.group_mode_switches.labels(group, mode)
        for outcome in SHADOW_OUTCOMES:
            self.shadow_probes.labels(outcome)
        for cause in AFFINITY_BREAKS:
            self.affinity_breaks.labels(cause)
        self.mode.set(1)
        self.crossover_estimate.set(math.nan)

    def publish_class_accepts(self, accepts: Mapping[str, float | None]) -> None:
        """Each tracked class's acceptance as it stands (NaN: unknown, or faded), read at a scrape:
        a stream's end sets it too, but a class whose evidence faded would keep its last value."""
        for name, accept in accepts.items():
            self.child(self.class_accept_length, name).set(math.nan if accept is None else accept)

    def forget_class(self, name: str) -> None:
        """A traffic class no longer tracked: its series go (the label set stays bounded)."""
        for role in (*ALL_ROLES, "none"):
            key = (id(self.class_requests), (name, role))
            if self._children.pop(key, None) is not None:
                self.class_requests.remove(name, role)
        if self._children.pop((id(self.class_accept_length), (name,)), None) is not None:
            self.class_accept_length.remove(name)

    def publish_reading(self, server: Server, peers: Sequence[Server]) -> None:
        """A server's engine gauges, and its role's over `peers` (the role's servers): load summed
        (-1 while any is unknown), acceptance averaged over the servers that report one, signal up
        while every server's is."""
        self.server_engine_load.labels(server.name).set(-1 if server.engine_load is None else server.engine_load)
        h = server.health
        self.server_engine_tokens.labels(server.name).set(-1 if h.engine_tokens is None else h.engine_tokens)
        self.server_kv_usage.labels(server.name).set(math.nan if h.engine_kv_usage is None else h.engine_kv_usage)
        hit_rate = h.engine_cache_hit_rate
        self.server_cache_hit_rate.labels(server.name).set(math.nan if hit_rate is None else hit_rate)
        loads = [p.engine_load for p in peers]
        self.engine_load.labels(server.role).set(-1 if None in loads else sum(v or 0 for v in loads))
        accepts = [p.spec_accept_length for p in peers if p.spec_accept_length is not None]
        self.accept_length.labels(server.role).set(sum(accepts) / len(accepts) if accepts else math.nan)
        self.engine_signal_up.labels(server.role).set(1 if all(p.health.engine_signal_up for p in peers) else 0)
