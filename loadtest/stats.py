"""Pure summaries of request results, under the names SGLang's bench_serving prints."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from .client import RequestResult


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), q in [0, 100]; NaN when empty."""
    if not values:
        return math.nan
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def tokens_in_window(r: RequestResult, t0: float, t1: float) -> float:
    """The request's output tokens produced inside [t0, t1], spread evenly over its text chunks."""
    if not r.ok or not r.chunk_times:
        return 0.0
    inside = sum(1 for t in r.chunk_times if t0 <= t <= t1)
    return r.output_tokens * inside / len(r.chunk_times)


@dataclass(frozen=True)
class LevelStats:
    concurrency: int
    duration_s: float
    completed: int
    errors: int
    output_tok_s: float
    request_per_s: float
    mean_ttft_ms: float
    median_ttft_ms: float
    p99_ttft_ms: float
    mean_itl_ms: float
    median_itl_ms: float
    p95_itl_ms: float
    p99_itl_ms: float
    mean_tpot_ms: float
    mean_e2e_ms: float
    median_e2e_ms: float
    backend_share: dict[str, float] = field(default_factory=dict)
    error_samples: tuple[str, ...] = ()


def summarize(concurrency: int, results: Sequence[RequestResult], t0: float, t1: float) -> LevelStats:
    """Throughput over the window [t0, t1]; latencies of the requests that started inside it."""
    window = max(t1 - t0, 1e-9)
    measured = [r for r in results if t0 <= r.started < t1]
    ok = [r for r in measured if r.ok]
    errors = [r for r in measured if not r.ok]
    tokens = sum(tokens_in_window(r, t0, t1) for r in results)
    finished_inside = sum(1 for r in results if r.ok and t0 <= r.finished <= t1)
    ttfts = [r.ttft * 1000 for r in ok if r.ttft is not None]
    itls = [x * 1000 for r in ok for x in r.itls]
    tpots = [t * 1000 for r in ok if (t := r.tpot) is not None]
    e2e = [r.latency * 1000 for r in ok]
    backends = Counter(r.backend for r in measured if r.backend)
    share = {b: n / sum(backends.values()) for b, n in sorted(backends.items())}
    return LevelStats(
        concurrency=concurrency,
        duration_s=window,
        completed=len(ok),
        errors=len(errors),
        output_tok_s=tokens / window,
        request_per_s=finished_inside / window,
        mean_ttft_ms=mean(ttfts),
        median_ttft_ms=percentile(ttfts, 50),
        p99_ttft_ms=percentile(ttfts, 99),
        mean_itl_ms=mean(itls),
        median_itl_ms=percentile(itls, 50),
        p95_itl_ms=percentile(itls, 95),
        p99_itl_ms=percentile(itls, 99),
        mean_tpot_ms=mean(tpots),
        mean_e2e_ms=mean(e2e),
        median_e2e_ms=percentile(e2e, 50),
        backend_share=share,
        error_samples=tuple(sorted({e.error or "?" for e in errors}))[:5],
    )
