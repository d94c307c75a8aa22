"""From a server's answer to `GET /metrics` to what is believed of it: its engine, its load and its
acceptance, or why there is none. Pure: the health loop (health.py) fetches, this reads, and the
server's `Health` record keeps what a reading needs of the last ones.

SGLang refreshes its load gauges only at prefill, every 40 decode steps, and every 30 s while idle,
so a server that went quiet can report running requests for up to 30 s
(`Engine.freezes_when_idle`). Its values that have not moved for `engine_stale_s` are
read as an idle server: engine load 0; and sooner, when this gateway has nothing in flight there
and they have stood still several times longer than they usually do while the server works (a
server whose batch emptied between two refreshes: with several replicas, each balancing its own
requests, none of ours there means few of anyone's).

The engine is the configured one, else the first whose names begin a sample line. Only the lines
of the names its adapter reads are parsed, so a big /metrics (most of a real one is histogram
buckets) costs one scan of its text, not a parse of it.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from . import promtext
from .adapter import BadReading, Engine
from .engines import ENGINES
from .servers import Health

# Engine gauges frozen this long (at least), and IDLE_HINT_GAPS times longer than they usually
# stay put while the server works, on a server with none of this gateway's requests: read as idle.
IDLE_HINT_S = 2.0
IDLE_HINT_GAPS = 4.0
# Weight of each new gap between moves in the usual one.
ACTIVITY_SMOOTHING = 0.2
# The largest /metrics read. A real server's is tens to hundreds of KiB (mostly histogram buckets);
# past this it is a fault or a flood, refused unread: even scanning it costs the event loop about
# 2 ms a MiB, at every scrape.
METRICS_MAX_BYTES = 4 * 1024 * 1024
# Lines of the names the adapters read, per /metrics: each label set is one (a rank, vLLM's engine
# index), so a real server has a few hundred at most. More is a flood, refused before the parser
# sees it: that parser takes ~12 us a line.
MAX_READ_SAMPLES = 4096


@dataclass(frozen=True)
class Found:
    engine: Engine
    load: int
    accept_length: float | None
    kv_tokens: int | None = None
    kv_usage: float | None = None
    cache_hit_rate: float | None = None
    kv_capacity: int | None = None


def read(
    h: Health, status: int | None, body: bytes, now: float, engine: Engine | None, stale_s: float, ours: int
) -> Found | str:
    """The reading in an answer (`engine`: the configured one, None to detect it), or why there is
    none. `ours`: this gateway's requests in flight on the server. Updates what `h` keeps of the
    readings (the acceptance counters' window, the frozen-gauge clock)."""
    if status != 200:
        return f"/metrics answered {status} (SGLang needs --enable-metrics, llama-server --metrics)"
    if len(body) > METRICS_MAX_BYTES:
        mib = 2**20
        return f"/metrics is {len(body) / mib:.1f} MiB, over the {METRICS_MAX_BYTES // mib} MiB specgate reads"
    try:
        found, values = read_metrics(body.decode("utf-8", "replace"), engine)
        if found is None:
            return "/metrics holds no SGLang, vLLM or llama.cpp metrics"
        reading = found.read(values)
        if reading.load is None:
            return f"/metrics lacks {', '.join(found.missing(values))} (is this a {found.name} server?)"
        accept = reading.accept_length
        if accept is None and reading.accept_counters is not None:
            accept = h.acceptance.update(now, *reading.accept_counters)
        # Counters first: SGLang's gauge is one prefill batch's rate, zeroed by decode logging.
        if reading.cache_counters is not None:
            hit_rate = _hit_rate(h, reading.cache_counters)
        else:
            hit_rate = reading.cache_hit_rate
    except BadReading as bad:
        return str(bad)
    except ValueError:
        return "/metrics is not in Prometheus' text format"
    load, kv_tokens, kv_usage = reading.load, reading.kv_tokens, reading.kv_usage
    if found.freezes_when_idle and _reads_idle(h, reading.activity, now, stale_s, ours):
        # Its KV gauges froze with the rest: no request holds a token of it now.
        load = 0
        kv_tokens = None if kv_tokens is None else 0
        kv_usage = None if kv_usage is None else 0.0
    return Found(found, load, accept, kv_tokens, kv_usage, hit_rate, reading.kv_capacity)


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


def _hit_rate(h: Health, counters: tuple[float, float]) -> float | None:
    """Hits over queries since the last scrape; the last value stands while no prompt came (as a
    gauge's does), and a counter that went back (a restart) starts afresh."""
    last, h.cache_counters = h.cache_counters, counters
    if last is None or counters[0] < last[0] or counters[1] < last[1]:
        return h.engine_cache_hit_rate
    queries = counters[1] - last[1]
    if queries <= 0:
        return h.engine_cache_hit_rate
    return min(1.0, (counters[0] - last[0]) / queries)


def _reads_idle(h: Health, activity: tuple[float, ...], now: float, stale_s: float, ours: int) -> bool:
    """Whether a server whose gauges freeze when idle is idle, though they say otherwise."""
    if activity != h.activity:
        if h.activity is not None:
            # How often this server's values move while it works (SGLang: every 40 decode steps,
            # and at each prefill and finish).
            gap = min(now - h.activity_since, stale_s)
            h.moves_every_s += ACTIVITY_SMOOTHING * (gap - h.moves_every_s)
        h.activity, h.activity_since = activity, now
    frozen_s = now - h.activity_since
    # Frozen several times longer than its values usually stay put, with nothing of ours on it: a
    # server whose batch emptied between two refreshes (its last gauges can say 20 running for as
    # long as it stays idle). Ours there would keep them moving.
    hint_s = min(stale_s, max(IDLE_HINT_S, IDLE_HINT_GAPS * h.moves_every_s))
    return frozen_s >= stale_s or (frozen_s >= hint_s and ours == 0)
