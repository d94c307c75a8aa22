"""SGLang's Prometheus metrics, read from the engine at scrape time (nothing on the token path)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector, CollectorRegistry

from .engine import Engine
from .state import Histogram

# SGLang servers export `sglang:` names; SGLang's router re-exports them as `sglang_`.
METRIC_PREFIXES = ("sglang:", "sglang_")


class SGLangCollector(Collector):
    def __init__(self, engine: Engine, model_name: str, prefix: str) -> None:
        self._engine = engine
        self._prefix = prefix
        self._label_names = ["model_name", "engine_type", "tp_rank", "pp_rank"]
        self._labels = [model_name, "unified", "0", "0"]

    def collect(self) -> Iterator[Metric]:
        p, names, labels = self._prefix, self._label_names, self._labels
        g = self._engine.gauges()
        s = self._engine.stats
        gauges = (
            ("num_running_reqs", "The number of running requests.", g.num_running_reqs),
            ("num_queue_reqs", "The number of requests in the waiting queue.", g.num_queue_reqs),
            ("token_usage", "The token usage.", g.token_usage),
            ("num_used_tokens", "The number of used tokens.", g.num_used_tokens),
            ("max_total_num_tokens", "Maximum total number of tokens in the KV cache pool.", self._engine.kv_capacity),
            ("gen_throughput", "The generation throughput (token/s).", g.gen_throughput),
            ("spec_accept_length", "The average acceptance length of speculative decoding.", g.spec_accept_length),
            ("cache_hit_rate", "The prefix cache hit rate.", g.cache_hit_rate),
        )
        counters = (
            ("prompt_tokens", "Number of prefill tokens processed.", s.prompt_tokens_total),
            ("generation_tokens", "Number of generation tokens processed.", s.generation_tokens_total),
            ("num_requests", "Number of requests processed.", s.num_requests_total),
            ("num_aborted_requests", "Number of requests aborted.", s.num_aborted_requests_total),
        )
        families: tuple[tuple[type[GaugeMetricFamily | CounterMetricFamily], tuple[tuple[str, str, float], ...]], ...]
        families = ((GaugeMetricFamily, gauges), (CounterMetricFamily, counters))
        for family, rows in families:
            for name, doc, value in rows:
                fam = family(p + name, doc, labels=names)
                fam.add_metric(labels, float(value))
                yield fam
        # SGLang's tokenizer counts a request's cached prompt tokens as it finishes, and writes a
        # cache_source's series once it moved; the simulator's cache is the device's.
        cached = CounterMetricFamily(
            p + "cached_tokens",
            "Number of cached prompt tokens by source (device/host/storage).",
            labels=[*names, "cache_source"],
        )
        if s.cached_tokens_total:
            cached.add_metric([*labels, "device"], float(s.cached_tokens_total))
        yield cached
        # The scheduler's live token counts (prefill batches and decode steps), a mode's series
        # written once it moved, as SGLang's realtime_tokens_total.
        realtime = CounterMetricFamily(
            p + "realtime_tokens",
            "Total number of tokens processed (updated on each log interval). "
            "mode: prefill_compute, prefill_cache, decode.",
            labels=[*names, "mode"],
        )
        for mode, value in (
            ("prefill_compute", s.prompt_tokens_total - s.cached_tokens_total),
            ("prefill_cache", s.cached_tokens_total),
            ("decode", s.decode_tokens_total),
        ):
            if value:
                realtime.add_metric([*labels, mode], float(value))
        yield realtime
        histograms = (
            ("time_to_first_token_seconds", "Histogram of time to first token in seconds.", s.ttft),
            ("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", s.itl),
            ("e2e_request_latency_seconds", "Histogram of End-to-end request latency in seconds", s.e2e),
            ("queue_time_seconds", "Histogram of queueing time in seconds.", s.queue_time),
        )
        for name, doc, hist in histograms:
            hfam = HistogramMetricFamily(p + name, doc, labels=names)
            hfam.add_metric(labels, list(_cumulative(hist)), hist.total)
            yield hfam


def _cumulative(hist: Histogram) -> Iterable[tuple[str, float]]:
    running = 0
    for bound, count in zip([*map(str, hist.buckets), "+Inf"], hist.counts, strict=True):
        running += count
        yield bound, float(running)


def build_registry(engine: Engine, model_name: str, prefix: str) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SGLangCollector(engine, model_name, prefix))
    return registry
