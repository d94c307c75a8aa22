"""Pure per-class summaries of request results: latency percentiles, throughput, goodput under SLOs,
prefix-cache hit rate and prompt length, one `ClassSummary` per traffic class (workload.py).

Windows as in stats.py (measures.py): latencies and shares of the requests that started inside [t0, t1],
throughput (tokens, goodput) of what happened inside it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .client import RequestResult
from .measures import mean, percentile, ratio, tokens_in_window


@dataclass(frozen=True)
class Slo:
    """Service-level objectives a request meets to count as goodput; None: not given."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None

    @property
    def given(self) -> bool:
        return self.ttft_ms is not None or self.tpot_ms is not None

    def met(self, r: RequestResult) -> bool:
        """A good request within every SLO given. A TPOT SLO holds for a request of one output
        token (it has no TPOT): nothing was decoded slowly."""
        if not r.ok:
            return False
        if self.ttft_ms is not None and (r.ttft is None or r.ttft * 1000 > self.ttft_ms):
            return False
        tpot = r.tpot
        return self.tpot_ms is None or tpot is None or tpot * 1000 <= self.tpot_ms

    def describe(self) -> str:
        parts = []
        if self.ttft_ms is not None:
            parts.append(f"TTFT <= {self.ttft_ms:g} ms")
        if self.tpot_ms is not None:
            parts.append(f"TPOT <= {self.tpot_ms:g} ms")
        return " and ".join(parts)


@dataclass(frozen=True)
class ClassSummary:
    name: str
    # Requests started inside the window: good ones, the server's failures, distinct sessions.
    completed: int
    errors: int
    sessions: int
    p50_ttft_ms: float
    p99_ttft_ms: float
    p50_tpot_ms: float
    p99_tpot_ms: float
    # Output tokens produced inside the window, per second of it.
    output_tok_s: float
    # Requests that finished inside the window within the SLOs, per second; and the share of the
    # requests started inside it (good or the server's failures) that met them. None: no SLO given.
    goodput_req_s: float | None
    goodput_share: float | None
    # Sum of usage's cached_tokens over the sum of prompt tokens, over the good requests whose usage
    # carried cached_tokens (`cache_reported` of them); None when none did.
    prefix_cache_hit_rate: float | None
    cache_reported: int
    mean_prompt_tokens: float
    # The good requests' output tokens and content events (the stream's events that carried text),
    # each request's first event (from prefill) and its token set aside, as specgate counts them: on
    # a speculative server that sends one event a decode step, their ratio is the class's acceptance.
    decode_tokens: int = 0
    decode_events: int = 0


def summarise_by_class(
    results: Sequence[RequestResult], t0: float, t1: float, slo: Slo | None = None
) -> dict[str, ClassSummary]:
    """One summary per traffic class among `results`, by class name."""
    names = sorted({r.traffic_class for r in results})
    return {name: summarise_class(name, [r for r in results if r.traffic_class == name], t0, t1, slo or Slo())
            for name in names}  # fmt: skip


def summarise_class(name: str, results: Sequence[RequestResult], t0: float, t1: float, slo: Slo) -> ClassSummary:
    window = max(t1 - t0, 1e-9)
    measured = [r for r in results if t0 <= r.started < t1 and not r.client_error]
    ok = [r for r in measured if r.ok]
    ttfts = [r.ttft * 1000 for r in ok if r.ttft is not None]
    tpots = [t * 1000 for r in ok if (t := r.tpot) is not None]
    reported = [r for r in ok if r.cached_tokens is not None]
    cached = sum(r.cached_tokens or 0 for r in reported)
    good_finished = sum(1 for r in results if t0 <= r.finished <= t1 and slo.met(r))
    stepped = [r for r in ok if len(r.chunk_times) >= 2 and r.output_tokens >= len(r.chunk_times)]
    return ClassSummary(
        name=name,
        completed=len(ok),
        errors=len(measured) - len(ok),
        sessions=len({r.session for r in measured}),
        p50_ttft_ms=percentile(ttfts, 50),
        p99_ttft_ms=percentile(ttfts, 99),
        p50_tpot_ms=percentile(tpots, 50),
        p99_tpot_ms=percentile(tpots, 99),
        output_tok_s=sum(tokens_in_window(r, t0, t1) for r in results) / window,
        goodput_req_s=good_finished / window if slo.given else None,
        goodput_share=ratio(sum(1 for r in measured if slo.met(r)), len(measured)) if slo.given else None,
        prefix_cache_hit_rate=ratio(cached, sum(r.prompt_tokens for r in reported)) if reported else None,
        cache_reported=len(reported),
        mean_prompt_tokens=mean([r.prompt_tokens for r in ok]),
        decode_tokens=sum(r.output_tokens - 1 for r in stepped),
        decode_events=sum(len(r.chunk_times) - 1 for r in stepped),
    )
