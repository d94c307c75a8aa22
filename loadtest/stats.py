"""Pure summaries of request results, under the names SGLang's bench_serving prints.

`errors` are the server's failures; `client_errors` the requests that failed before the server
answered (see client.py), which say nothing about the server. A level with fewer good requests
than `min_ok`, or with more client errors than CLIENT_ERROR_SHARE of its requests, is
inconclusive: its figures are printed, marked, and concluded from by no one.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from .classes import ClassSummary
from .client import RequestResult
from .measures import mean, percentile, tokens_in_window

# Good requests a level needs, unless --min-requests says otherwise.
DEFAULT_MIN_REQUESTS = 10
# Past this share of a level's requests failing on the client's side, the server was not under
# the load the level names (the failed streams sat idle), so its throughput is not the server's.
CLIENT_ERROR_SHARE = 0.05


def min_ok_requests(concurrency: int, min_requests: int = DEFAULT_MIN_REQUESTS) -> int:
    """Good requests a level needs before anything is concluded from it; 0 when min_requests <= 0.

    `min_requests`, and at least half the streams: fewer good requests started inside the window
    than that means the window was shorter than most streams' requests (or most failed), so the
    latencies come from the few streams that happened to start one, and say little of the rest.
    Half rather than all, so that a level whose requests take about the window's length, or that
    lost a few to errors, still counts.
    """
    if min_requests <= 0:
        return 0
    return max(min_requests, math.ceil(concurrency / 2))


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
    # Failures before the server answered, after retries on new connections: not in `errors`.
    client_errors: int = 0
    client_error_samples: tuple[str, ...] = ()
    # Requests measured that the server answered only when resent on a new connection: the first
    # try got no answer, as when the target closes connections the client had pooled.
    retried: int = 0
    # The good requests this level needed (min_ok_requests); fewer, or too many client errors
    # (CLIENT_ERROR_SHARE), make it inconclusive. 0: the check was off.
    min_ok: int = 0
    conclusive: bool = True
    # How long the window ran on past its planned length to collect enough good requests (0: it
    # did not; sweep.LevelPlan.max_duration_s).
    extended_s: float = 0.0
    # Per traffic class (classes.py; one class, "all", without --class).
    classes: dict[str, ClassSummary] = field(default_factory=dict)
    # The good requests' mean prompt tokens, as their usage reported (NaN: none reported): the
    # context calibrate's speed model is fitted at.
    mean_prompt_tokens: float = math.nan


def summarize(
    concurrency: int,
    results: Sequence[RequestResult],
    t0: float,
    t1: float,
    min_requests: int = DEFAULT_MIN_REQUESTS,
) -> LevelStats:
    """Throughput over the window [t0, t1]; latencies of the requests that started inside it."""
    window = max(t1 - t0, 1e-9)
    measured = [r for r in results if t0 <= r.started < t1]
    ok = [r for r in measured if r.ok]
    errors = [r for r in measured if not r.ok and not r.client_error]
    client_errors = [r for r in measured if not r.ok and r.client_error]
    min_ok = min_ok_requests(concurrency, min_requests)
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
        error_samples=_samples(errors),
        client_errors=len(client_errors),
        client_error_samples=_samples(client_errors),
        retried=sum(1 for r in measured if r.attempts > 1 and not r.client_error),
        min_ok=min_ok,
        conclusive=len(ok) >= min_ok and not (min_ok and len(client_errors) > CLIENT_ERROR_SHARE * len(measured)),
        mean_prompt_tokens=mean([float(r.prompt_tokens) for r in ok if r.prompt_tokens > 0]),
    )


def _samples(failed: Sequence[RequestResult]) -> tuple[str, ...]:
    return tuple(sorted({r.error or "?" for r in failed}))[:5]
