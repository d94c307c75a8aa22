"""What each inference engine reports about itself: one small adapter per engine.

specgate relays the OpenAI API, which SGLang, vLLM and llama.cpp's llama-server all serve alike.
They differ in what specgate reads beside it: the names of the metrics that count running and
queued requests, how speculative acceptance is reported, and what `/health` means. Everything
engine-specific lives in an `Engine` value here; the rest of the proxy asks these, never a name.

- SGLang: `sglang:num_running_reqs` + `sglang:num_queue_reqs`; acceptance: the gauge
  `sglang:spec_accept_length`.
- vLLM: `vllm:num_requests_running` + `vllm:num_requests_waiting`; acceptance: a rate of the
  counters `vllm:spec_decode_num_accepted_tokens_total` and `vllm:spec_decode_num_drafts_total`.
- llama.cpp: `llamacpp:requests_processing` + `llamacpp:requests_deferred`; acceptance: the same
  counters with the `llamacpp:` prefix.

KV cache in use, the engine's own count of the work it holds in tokens: SGLang's
`sglang:num_used_tokens` (tokens) and `sglang:token_usage` (the pool's fraction in use); vLLM's
`vllm:kv_cache_usage_perc` (a fraction, despite its name; no token count); llama-server exports none
now (its `kv_cache_tokens` and `kv_cache_usage_ratio` were removed upstream in 2025). The pool's
size in tokens: SGLang's `sglang:max_total_num_tokens`; vLLM's `vllm:cache_config_info`, an info
gauge (value 1) whose labels are CacheConfig's fields: `num_gpu_blocks` * `block_size`, one series
per engine (data-parallel rank); `num_gpu_blocks` reads "None" until the engine profiled memory.

Prefix cache hit rate, the share of prompt tokens found cached, from counters taken between scrapes:
SGLang's `sglang:realtime_tokens_total{mode="prefill_cache"}` over it plus `{mode="prefill_compute"}`
(added per prefill batch; a mode's series appears once it moved); vLLM's `vllm:prefix_cache_hits_total`
over `vllm:prefix_cache_queries_total`; llama-server's `llamacpp:prompt_tokens_cached_total` over it
plus `llamacpp:prompt_tokens_total` (which excludes cached tokens). SGLang's gauge `sglang:cache_hit_rate`
is read only where its counter is absent (older servers): it holds the last prefill batch's rate and
decode-stats logging (every 40 decode steps) sets it to 0, so under decode load it mostly reads 0.

Label sets: each name's series are summed (data-parallel ranks, vLLM's engines), except SGLang's
scheduler metrics (`SGLANG_SERIES`): with `--enable-metrics-for-all-schedulers` every tensor-parallel
rank writes the same values, and with priority scheduling a gauge's total sits under priority=""
beside each priority's share. Of those, only the total's series of the lowest tp_rank of each
dp_rank count (with DP attention a dp_rank's first tp_rank is not 0). A rank's ratio (`averaged`:
the KV pool's fraction in use, the acceptance length, the hit rate gauge) is averaged over the
ranks, not summed: two ranks each a third full are a server a third full.

Counters that move only when a request finishes: llama-server's `spec_decode_*` and
`tokens_predicted_total` (a running request's drafts appear at its end), as SGLang's tokenizer
counters (`prompt_tokens_total`, `cached_tokens_total`); SGLang's `realtime_tokens_total` moves
per prefill batch and decode step.

Streams: SGLang (with its default `--stream-interval 1`) and vLLM send one SSE content event per
decode step, so a single stream's tokens over its content events is its acceptance length, with no
wait for a gauge's refresh (`stream_steps`); llama-server sends one event per token. Asked for
usage, llama-server moves its `timings` from the finish chunk into the usage chunk; the SSE module
(sse.py) puts any such field back when it drops a usage chunk specgate asked for. SGLang writes its
end of body right after `data: [DONE]`, but in a write of its own (`DONE_GRACE_S`).

SGLang's native API: `POST /generate` (`GENERATE_PATH`), whose responses and stream events carry
their token counts in `meta_info` where the OpenAI API has `usage` (`USAGE_FIELDS`).

Per request, a response's own acceptance (`reported_steps`, a traffic class's evidence where its
stream does not count steps): llama-server's `timings` (`draft_n`, `draft_n_accepted`, on the finish
or usage chunk and on a whole body, for chat and completions alike) and SGLang's native
`meta_info.spec_verify_ct`; SGLang's OpenAI endpoints and vLLM write none.

Connections: SGLang's uvicorn closes a kept-alive connection after `keepalive_s` idle; a request
written into a connection it is closing is lost, so the pool closes its own sooner
(`POOL_KEEPALIVE_S`).

SGLang's own names use `sglang:`; `sglang_` is what SGLang's router re-exports them as, so both are
read. Acceptance length counts the bonus token: 1 + accepted / drafts (>= 1); none without drafts.

Readings are checked here, where what a server can report is known: a value no server could
report (not finite, negative, past the bounds below) is a fault or an attack, not a load, and
`Engine.read` refuses the whole reading (`BadReading`): the server's signal is then unreadable, as
when its /metrics cannot be had. Only the lines of the names an adapter reads are parsed, so a big
/metrics (most of a real one is histogram buckets) costs one scan of its text, not a parse of it.

`/health`: 200 means serving for all three. SGLang answers 503 while warming up (and runs a
one-token generation for every check, so it is slow under load); vLLM refuses connections until
its engine is up and answers 503 once it died; llama-server answers 503 "Loading model".
"""

from __future__ import annotations

import functools
import math
from collections import deque
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import orjson

from . import promtext

EngineName = Literal["sglang", "vllm", "llamacpp"]
EngineSetting = Literal["auto", "sglang", "vllm", "llamacpp"]

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
# Lines of the names the adapters read, per /metrics: each label set is one (a rank, vLLM's engine
# index), so a real server has a few hundred at most. More is a flood, refused before the parser
# sees it: that parser takes ~12 us a line.
MAX_READ_SAMPLES = 4096


# SGLang's native generation endpoint, which specgate relays beside the OpenAI ones.
GENERATE_PATH = "/generate"
# Where a response or stream event holds its token counts: OpenAI's `usage`, else SGLang's native
# `meta_info`; the first present one counts.
USAGE_FIELDS = ("usage", "meta_info")
# How long the relay holds a stream's `data: [DONE]` for the server's end of body to go with it, so
# that a client that stops reading at `[DONE]` finds the response complete. SGLang's end follows at
# once; a server that keeps its body open after `[DONE]` has its last bytes delayed this long, no
# more. The relay does not know a server's engine, so this holds for every server, as before.
DONE_GRACE_S = 0.01


def reported_steps(obj: Any) -> tuple[int, int] | None:
    """(output tokens, decode steps) that a response body reports of its own speculation, where an
    engine writes them per request: llama-server's `timings` (`predicted_n` tokens, `draft_n` drafted
    and `draft_n_accepted` of them accepted: each step makes one token of its own besides the drafts
    it accepted, so predicted_n - draft_n_accepted steps, the prefill's first token among them; only
    where it drafted), and SGLang's native `meta_info` (`completion_tokens` in `spec_verify_ct` verify
    steps, only with speculation on, and the prefill's step, which it does not count). The steps are
    counted as a stream's content events are: the first is the prefill's. vLLM's responses say
    nothing of it. None elsewhere, or where the figures are not a server's: a step makes at least
    one token and at most MAX_ACCEPT_LENGTH."""
    if not isinstance(obj, dict):
        return None
    timings = obj.get("timings")
    if isinstance(timings, dict):
        tokens, drafted, accepted = (_count(timings.get(k)) for k in ("predicted_n", "draft_n", "draft_n_accepted"))
        if tokens is None or drafted is None or accepted is None or drafted == 0 or accepted > drafted:
            return None
        return _steps(tokens, tokens - accepted)
    meta = obj.get("meta_info")
    if isinstance(meta, dict):
        tokens, steps = _count(meta.get("completion_tokens")), _count(meta.get("spec_verify_ct"))
        if tokens is not None and steps:  # 0: it verified nothing (it made one token, or none)
            return _steps(tokens, steps + 1)
    return None


def _count(value: Any) -> int | None:
    """The value, where it is a count a server could write (a bool is an int to Python, not to JSON)."""
    ok = isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_COUNTER
    return value if ok else None


def _steps(tokens: int, steps: int) -> tuple[int, int] | None:
    """A step makes at least one token and at most MAX_ACCEPT_LENGTH."""
    return (tokens, steps) if 0 < steps <= tokens <= steps * MAX_ACCEPT_LENGTH else None


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


# SGLang's scheduler writes these, per scheduler process (labels tp_rank, dp_rank, ...); its
# tokenizer's counters (prompt_tokens_total, ...) are one process's, and carry a request's priority.
SGLANG_SERIES = promtext.Series(
    names=(
        "num_running_reqs",
        "num_queue_reqs",
        "num_used_tokens",
        "token_usage",
        "max_total_num_tokens",
        "gen_throughput",
        "spec_accept_length",
        "cache_hit_rate",
        "realtime_tokens_total",
    ),
    total=("priority", ""),
    rank="tp_rank",
    group="dp_rank",
)
SGLANG = Engine(
    "sglang",
    ("sglang:", "sglang_"),
    running="num_running_reqs",
    queued="num_queue_reqs",
    accept_gauge="spec_accept_length",
    kv_tokens="num_used_tokens",
    kv_usage="token_usage",
    kv_capacity="max_total_num_tokens",
    cache_hit_gauge="cache_hit_rate",
    cache_hits_counter='realtime_tokens_total{mode="prefill_cache"}',
    cache_misses_counter='realtime_tokens_total{mode="prefill_compute"}',
    cache_hits_once_moved=True,
    split=(("realtime_tokens_total", "mode"),),
    series=SGLANG_SERIES,
    averaged=("token_usage", "spec_accept_length", "cache_hit_rate"),
    unset_at_zero=("spec_accept_length",),
    freezes_when_idle=True,
    gauge_refresh_steps=40,
    keepalive_s=5.0,  # uvicorn's default
    stream_steps=True,
    activity=(
        "num_running_reqs",
        "num_queue_reqs",
        "gen_throughput",
        "generation_tokens_total",
        "prompt_tokens_total",
        "num_requests_total",
    ),
)
VLLM = Engine(
    "vllm",
    ("vllm:",),
    running="num_requests_running",
    queued="num_requests_waiting",
    accepted_counter="spec_decode_num_accepted_tokens_total",
    drafts_counter="spec_decode_num_drafts_total",
    kv_usage="kv_cache_usage_perc",
    kv_capacity="cache_config_info",
    label_product=("cache_config_info", ("num_gpu_blocks", "block_size")),
    averaged=("kv_cache_usage_perc",),
    cache_hits_counter="prefix_cache_hits_total",
    cache_queries_counter="prefix_cache_queries_total",
    stream_steps=True,
)
LLAMACPP = Engine(
    "llamacpp",
    ("llamacpp:",),
    running="requests_processing",
    queued="requests_deferred",
    accepted_counter="spec_decode_num_accepted_tokens_total",
    drafts_counter="spec_decode_num_drafts_total",
    # Both written from the first scrape (0 before any prompt); builds without the cached one read
    # no hit rate.
    cache_hits_counter="prompt_tokens_cached_total",
    cache_misses_counter="prompt_tokens_total",
)
ENGINES: dict[EngineName, Engine] = {e.name: e for e in (SGLANG, VLLM, LLAMACPP)}
# Idle pooled connections older than this are closed rather than reused: a second inside SGLang's
# window. The pool does not know which engine a server runs (`auto` learns it later, from /metrics),
# so every server gets this, as before.
POOL_KEEPALIVE_S = 4.0


def _engine_in(text: str) -> Engine | None:
    """The first engine whose metric names a /metrics text has."""
    return next((e for e in ENGINES.values() if e.named_in(text)), None)


def parse_metrics(text: str, wanted: Collection[str] | None = None, engine: Engine | None = None) -> dict[str, float]:
    """Each wanted name's value over the label sets its engine counts (`Engine.combined`; `engine`,
    else the first whose names the text has). Raises ValueError on text that is not the Prometheus
    format, BadReading on more than MAX_READ_SAMPLES wanted samples."""
    try:
        found = promtext.samples(text, wanted, MAX_READ_SAMPLES if wanted is not None else None)
    except promtext.TooManySamples:
        raise BadReading(f"/metrics holds more than {MAX_READ_SAMPLES} series of the names specgate reads") from None
    if engine is None:
        engine = _engine_in(text)
    return promtext.summed(found) if engine is None else engine.combined(found)


def read_metrics(text: str, engine: Engine | None = None) -> tuple[Engine | None, dict[str, float]]:
    """The engine whose /metrics `text` is (`engine` when given, else the first whose names begin a
    sample line), and the values of the names it reads: only their lines are parsed. (None, {})
    when no engine's names are there."""
    if engine is None:
        engine = _engine_in(text)
        if engine is None:
            return None, {}
    return engine, parse_metrics(text, engine.names, engine)


def detect(values: Mapping[str, float]) -> Engine | None:
    """The engine whose metric names these are, or None."""
    for engine in ENGINES.values():
        if engine.owns(values):
            return engine
    return None


def describe_health(status: int, body: bytes) -> str:
    """Why a server's `/health` is not 200, in the operator's words."""
    message = ""
    try:
        obj = orjson.loads(body) if body else None
    except orjson.JSONDecodeError:
        obj = None
    if isinstance(obj, dict):
        err = obj.get("error")
        found = err.get("message") if isinstance(err, dict) else obj.get("message", err)
        if isinstance(found, str):
            message = found[:120]
    return f"/health answered {status}" + (f": {message}" if message else "")


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
