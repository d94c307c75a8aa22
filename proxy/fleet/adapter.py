"""What an engine adapter is (`Engine`): the metric names it reads, how their label sets combine
into one value a name, and the `Reading` they make, every value checked. What each engine's names
mean, and the adapters themselves, are engines.py's.

Readings are checked here, where what a server can report is known: a value no server could
report (not finite, negative, past the bounds below) is a fault or an attack, not a load, and
`Engine.read` refuses the whole reading (`BadReading`): the server's signal is then unreadable, as
when its /metrics cannot be had.

Acceptance length counts the bonus token: 1 + accepted / drafts (>= 1); none without drafts. Where
an engine exports counters rather than a gauge, it is their rate over a window of scrapes
(`AcceptanceRate`).
"""

from __future__ import annotations

import functools
import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from . import promtext

EngineName = Literal["sglang", "vllm", "llamacpp"]

# Running or queued requests on one server. The largest batches run to a few thousand and queues
# to tens of thousands; a million is beyond any real server, and two of them still add up to an
# exact int that every routing sum and JSON encoder takes.
MAX_REQUESTS = 1_000_000
# Mean acceptance length, the bonus token included: at least 1 by definition, and a draft of 64
# tokens all accepted at every step is past any speculative decoder in use (EAGLE's trees and
# n-gram lookups propose ten or so).
MIN_ACCEPT_LENGTH = 1.0
MAX_ACCEPT_LENGTH = 64.0
# Cumulative token and draft counters: past 2**53 a float no longer counts by one, so differences
# of them, and any rate, are noise. A server making a million tokens a second gets there in 285 years.
MAX_COUNTER = float(2**53)
# Tokens in one server's KV cache: an H200 node's eight GPUs hold a few million for an 8B model; a
# billion is beyond any. A fraction (of the pool in use, of prompt tokens found cached) is at most
# 1: the ranks' mean (Engine.averaged), never their sum.
MAX_KV_TOKENS = 1_000_000_000
MAX_FRACTION = 1.0


class BadReading(ValueError):
    """A /metrics value no server could report: the reading is a fault, and unreadable."""


@dataclass(frozen=True)
class Reading:
    """What one scrape says, every value within what a server could report."""

    load: int | None  # running plus queued requests; None when the metrics lack either
    activity: tuple[float, ...]  # the values that move while the server works (`Engine.activity`)
    accept_length: float | None  # from a gauge; None without one or without speculation
    accept_counters: tuple[float, float] | None  # (accepted tokens, drafts) so far
    kv_tokens: int | None = None  # tokens in the KV cache; None when the engine does not say
    kv_usage: float | None = None  # the KV pool's fraction in use (the ranks' mean); None: not said
    kv_capacity: int | None = None  # the KV pool's size in tokens; None: not said
    cache_hit_rate: float | None = None  # from a gauge; None without one
    cache_counters: tuple[float, float] | None = None  # (prompt tokens found cached, looked up) so far


@dataclass(frozen=True)
class Engine:
    name: EngineName
    # Metric name prefixes this engine's own /metrics uses (any of them identifies it).
    prefixes: tuple[str, ...]
    running: str
    queued: str
    # A gauge of mean acceptance length (SGLang), or a pair of counters to take a rate of.
    accept_gauge: str | None = None
    accepted_counter: str | None = None
    drafts_counter: str | None = None
    # The KV cache in use: in tokens, and as the pool's fraction; and the pool's size in tokens.
    kv_tokens: str | None = None
    kv_usage: str | None = None
    kv_capacity: str | None = None
    # The prefix cache's hit rate: counters of hits and queries (or misses: queries = hits + misses)
    # to take a rate of, else a gauge (SGLang's, where the counters are absent).
    cache_hit_gauge: str | None = None
    cache_hits_counter: str | None = None
    cache_queries_counter: str | None = None
    cache_misses_counter: str | None = None
    # The hits counter is written only once it moved (SGLang's realtime_tokens_total modes): absent
    # beside the misses counter, it is 0. Else (llama-server) absent means a build without it.
    cache_hits_once_moved: bool = False
    # Names read as `name{label="value"}`: a series per value of the label, summed apart.
    split: tuple[tuple[str, str], ...] = ()
    # An info gauge read as the product of its labels' numbers (vLLM's cache_config_info: blocks
    # times tokens a block); a series whose labels are not numbers is left out.
    label_product: tuple[str, tuple[str, ...]] | None = None
    # Names whose label sets are not all summed (SGLang's scheduler metrics).
    series: promtext.Series | None = None
    # Each rank's own ratio (its KV pool's fraction in use, its acceptance, its hit rate): the
    # server's is their mean, not their sum (the ranks' pools are alike). A series of a name in
    # `unset_at_zero` that reads 0 has no value yet (SGLang's acceptance before a rank's first
    # speculative batch) and is left out of the mean.
    averaged: tuple[str, ...] = ()
    unset_at_zero: tuple[str, ...] = ()
    # SGLang refreshes its gauges every `gauge_refresh_steps` decode steps (and at prefill), and
    # while idle only every 30 s (running, queued, KV in use): values that stop moving mean an idle
    # server. vLLM's and llama.cpp's gauges are live, so a standing value is real.
    freezes_when_idle: bool = False
    # Decode steps between two refreshes of the gauges (None: live). A request-mode probe session
    # of 160 tokens (SPECGATE_ADAPTIVE_PROBE_TOKENS) is SGLang's 40 steps at acceptance length 4.
    gauge_refresh_steps: int | None = None
    # Seconds the engine's HTTP server keeps an idle kept-alive connection open (None: not recorded).
    keepalive_s: float | None = None
    # One SSE content event per decode step (speculative: per verify step, however many tokens it
    # accepted): tokens / content events measures a stream's acceptance length.
    stream_steps: bool = False
    # Values that move while the server works (only read when `freezes_when_idle`).
    activity: tuple[str, ...] = ()

    @functools.cached_property
    def names(self) -> frozenset[str]:
        """Every metric name this adapter reads, under each of its prefixes."""
        read = (
            self.running,
            self.queued,
            self.accept_gauge,
            self.accepted_counter,
            self.drafts_counter,
            self.kv_tokens,
            self.kv_usage,
            self.kv_capacity,
            self.cache_hit_gauge,
            self.cache_hits_counter,
            self.cache_queries_counter,
            self.cache_misses_counter,
        )
        # A split name's series are found under its metric name.
        return frozenset(
            p + n.split("{", 1)[0] for p in self.prefixes for n in (*read, *self.activity) if n is not None
        )

    def own(self, found: list[promtext.Sample]) -> list[promtext.Sample]:
        """The samples that count, each under the name it is read by (`split`, `label_product`)."""
        if self.series is not None:
            found = self.series.own(found, self.prefixes)
        split = {p + name: label for p in self.prefixes for name, label in self.split}
        product = None
        if self.label_product is not None:
            info, labels = self.label_product
            product = ({p + info for p in self.prefixes}, labels)
        out: list[promtext.Sample] = []
        for s in found:
            label = split.get(s.name)
            if label is not None:
                out.append(promtext.Sample(f'{s.name}{{{label}="{s.labels.get(label, "")}"}}', s.labels, s.value))
            elif product is not None and s.name in product[0]:
                value = promtext.label_product(s.labels, product[1])
                if value is not None:
                    out.append(promtext.Sample(s.name, s.labels, value))
            else:
                out.append(s)
        return out

    @functools.cached_property
    def _averaged_names(self) -> tuple[frozenset[str], frozenset[str]]:
        """`averaged` and `unset_at_zero` under each prefix."""
        return (
            frozenset(p + n for p in self.prefixes for n in self.averaged),
            frozenset(p + n for p in self.prefixes for n in self.unset_at_zero),
        )

    def combined(self, found: list[promtext.Sample]) -> dict[str, float]:
        """Each name's value over the samples that count (`own`): summed, or for `averaged` names
        their mean (NaN left out, as from a sum)."""
        own = self.own(found)
        averaged, unset = self._averaged_names
        out = promtext.summed(s for s in own if s.name not in averaged)
        values: dict[str, list[float]] = {}
        for s in own:
            if s.name in averaged and not math.isnan(s.value):
                kept = values.setdefault(s.name, [])
                if not (s.value == 0.0 and s.name in unset):
                    kept.append(s.value)
        for name, kept in values.items():
            # inf stays inf, for the range checks to refuse; every series unset reads as one would.
            out[name] = sum(kept) / len(kept) if kept else 0.0
        return out

    def read(self, values: Mapping[str, float]) -> Reading:
        """The reading in `values`. Raises BadReading when any value it uses is one no server could
        report: a server that sends one is not to be believed for the rest either."""
        return Reading(
            self._load(values),
            self._activity(values),
            self._gauge(values),
            self._counters(values),
            self._kv_tokens(values),
            self._kv_usage(values),
            self._kv_capacity(values),
            self._hit_gauge(values),
            self._hit_counters(values),
        )

    def load(self, values: Mapping[str, float]) -> int | None:
        """Running plus queued requests, or None when the metrics lack either or hold a value no
        server could report."""
        try:
            return self._load(values)
        except BadReading:
            return None

    def accept_gauge_value(self, values: Mapping[str, float]) -> float | None:
        """The gauge's mean acceptance length; None without a gauge, without speculation, or for a
        value no server could report."""
        try:
            return self._gauge(values)
        except BadReading:
            return None

    def accept_counters(self, values: Mapping[str, float]) -> tuple[float, float] | None:
        """(accepted draft tokens, drafts) so far, or None when the server does not export them
        (or exports values no server could report)."""
        try:
            return self._counters(values)
        except BadReading:
            return None

    def missing(self, values: Mapping[str, float]) -> list[str]:
        """The load metrics this engine should export that are absent (for the operator)."""
        return [self.prefixes[0] + k for k in (self.running, self.queued) if self._get(values, k) is None]

    def owns(self, values: Mapping[str, float]) -> bool:
        return any(name.startswith(self.prefixes) for name in values)

    def named_in(self, text: str) -> bool:
        """Whether a sample line of this Prometheus text has one of this engine's names."""
        return any(text.startswith(p) or f"\n{p}" in text for p in self.prefixes)

    def _load(self, values: Mapping[str, float]) -> int | None:
        running = self._checked(values, self.running, 0.0, MAX_REQUESTS)
        queued = self._checked(values, self.queued, 0.0, MAX_REQUESTS)
        return None if running is None or queued is None else int(running + queued)

    def _activity(self, values: Mapping[str, float]) -> tuple[float, ...]:
        # Only compared with the last scrape's, but NaN never equals itself and inf swallows every
        # change: either would read as a server forever busy, or forever idle.
        out: list[float] = []
        for name in self.activity:
            value = self._get(values, name)
            if value is not None and not math.isfinite(value):
                raise BadReading(self._beyond(name, value, "a finite number"))
            out.append(value or 0.0)
        return tuple(out)

    def _gauge(self, values: Mapping[str, float]) -> float | None:
        if self.accept_gauge is None:
            return None
        value = self._get(values, self.accept_gauge)
        if value is None or value == 0.0:
            return None  # 0: SGLang's value without speculation (it keeps its last one when idle)
        if not MIN_ACCEPT_LENGTH <= value <= MAX_ACCEPT_LENGTH:
            expected = f"0, or {MIN_ACCEPT_LENGTH:g} to {MAX_ACCEPT_LENGTH:g}"
            raise BadReading(self._beyond(self.accept_gauge, value, expected))
        return value

    def _counters(self, values: Mapping[str, float]) -> tuple[float, float] | None:
        return self._counter_pair(values, self.accepted_counter, self.drafts_counter)

    def _counter_pair(
        self, values: Mapping[str, float], first: str | None, second: str | None
    ) -> tuple[float, float] | None:
        """Two cumulative counters to take a rate of, or None when either is not exported."""
        if first is None or second is None:
            return None
        a = self._checked(values, first, 0.0, MAX_COUNTER)
        b = self._checked(values, second, 0.0, MAX_COUNTER)
        return None if a is None or b is None else (a, b)

    def _kv_tokens(self, values: Mapping[str, float]) -> int | None:
        if self.kv_tokens is None:
            return None
        value = self._checked(values, self.kv_tokens, 0.0, MAX_KV_TOKENS)
        return None if value is None else int(value)

    def _kv_capacity(self, values: Mapping[str, float]) -> int | None:
        if self.kv_capacity is None:
            return None
        value = self._checked(values, self.kv_capacity, 0.0, MAX_KV_TOKENS)
        return None if not value else int(value)

    def _kv_usage(self, values: Mapping[str, float]) -> float | None:
        if self.kv_usage is None:
            return None
        return self._checked(values, self.kv_usage, 0.0, MAX_FRACTION)

    def _hit_gauge(self, values: Mapping[str, float]) -> float | None:
        if self.cache_hit_gauge is None:
            return None
        return self._checked(values, self.cache_hit_gauge, 0.0, MAX_FRACTION)

    def _hit_counters(self, values: Mapping[str, float]) -> tuple[float, float] | None:
        if self.cache_misses_counter is None:
            return self._counter_pair(values, self.cache_hits_counter, self.cache_queries_counter)
        if self.cache_hits_counter is None:
            return None
        misses = self._checked(values, self.cache_misses_counter, 0.0, MAX_COUNTER)
        hits = self._checked(values, self.cache_hits_counter, 0.0, MAX_COUNTER)
        if misses is None or (hits is None and not self.cache_hits_once_moved):
            return None
        hits = hits or 0.0
        return hits, hits + misses

    def _get(self, values: Mapping[str, float], name: str) -> float | None:
        for prefix in self.prefixes:
            value = values.get(prefix + name)
            if value is not None:
                return value
        return None

    def _checked(self, values: Mapping[str, float], name: str, low: float, high: float) -> float | None:
        """The value, None when absent; BadReading when outside [low, high], NaN and a sum of
        label sets that overflowed to inf included."""
        value = self._get(values, name)
        if value is not None and not low <= value <= high:
            raise BadReading(self._beyond(name, value, f"{low:g} to {high:g}"))
        return value

    def _beyond(self, name: str, value: float, expected: str) -> str:
        # The value is a float: whatever the server wrote, what is shown is short and plain.
        return f"/metrics says {self.prefixes[0]}{name} = {value:g}, which no server reports (expected {expected})"


class AcceptanceRate:
    """Mean acceptance length from cumulative counters, over a sliding window of scrapes:
    1 + accepted / drafts counted inside the window. Between bursts of traffic the last value
    stands (as SGLang's gauge does); a counter that went backwards (a restart) starts afresh. A
    mean outside [MIN_ACCEPT_LENGTH, MAX_ACCEPT_LENGTH] raises BadReading and starts afresh too."""

    def __init__(self, window_s: float) -> None:
        self._window_s = window_s
        self._points: deque[tuple[float, float, float]] = deque()
        self.value: float | None = None

    def update(self, now: float, accepted: float, drafts: float) -> float | None:
        if self._points and (accepted < self._points[-1][1] or drafts < self._points[-1][2]):
            self._points.clear()
            self.value = None
        if not self._points and drafts > 0:
            self.value = 1.0 + accepted / drafts  # the lifetime mean, until the window has traffic
        self._points.append((now, accepted, drafts))
        # Keep one point at or before the window's start, so the window spans it fully.
        while len(self._points) > 2 and self._points[1][0] <= now - self._window_s:
            self._points.popleft()
        first = self._points[0]
        d_drafts = drafts - first[2]
        if d_drafts > 0:
            self.value = 1.0 + (accepted - first[1]) / d_drafts
        if self.value is not None and not MIN_ACCEPT_LENGTH <= self.value <= MAX_ACCEPT_LENGTH:
            bad, self.value = self.value, None
            self._points.clear()
            raise BadReading(
                f"/metrics' accepted-token and draft counters give an acceptance length of {bad:g}, which no "
                f"server reports (expected {MIN_ACCEPT_LENGTH:g} to {MAX_ACCEPT_LENGTH:g})"
            )
        return self.value
