"""Load-test statistics on known inputs."""

from __future__ import annotations

import math

import pytest

from loadtest.client import RequestResult
from loadtest.measures import percentile, tokens_in_window
from loadtest.stats import DEFAULT_MIN_REQUESTS, min_ok_requests, summarize


def result(started: float, chunk_times: list[float], tokens: int, backend: str = "speculative",
           ok: bool = True) -> RequestResult:  # fmt: skip
    return RequestResult(started=started, finished=chunk_times[-1] if chunk_times else started, ok=ok,
                         error=None if ok else "HTTP 500", ttft=(chunk_times[0] - started) if chunk_times else None,
                         chunk_times=chunk_times, prompt_tokens=5, output_tokens=tokens, backend=backend)  # fmt: skip


def test_percentile_matches_linear_interpolation() -> None:
    values = [1.0, 2.0, 3.0, 4.0, 10.0]
    assert percentile(values, 50) == 3.0
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 10.0
    assert percentile(values, 90) == pytest.approx(7.6)
    assert percentile([5.0], 99) == 5.0
    assert math.isnan(percentile([], 50))


def test_tokens_in_window_spreads_usage_over_chunks() -> None:
    r = result(0.0, [1.0, 2.0, 3.0, 4.0], tokens=12)  # 3 tokens a chunk (speculative)
    assert tokens_in_window(r, 0.0, 10.0) == 12
    assert tokens_in_window(r, 1.5, 3.5) == 6
    assert tokens_in_window(result(0.0, [1.0], 5, ok=False), 0, 10) == 0


def test_summarize_known_results() -> None:
    rs = [
        result(0.0, [0.5, 1.0, 1.5], tokens=3),  # started before the window: counts tokens, not latency
        result(1.0, [1.2, 1.4, 1.6, 1.8, 2.0], tokens=5, backend="baseline"),
        result(2.0, [2.1, 2.3, 2.5], tokens=6),
        result(2.5, [], tokens=0, backend="baseline", ok=False),
    ]
    s = summarize(2, rs, t0=1.0, t1=3.0)
    assert s.duration_s == 2.0
    assert s.output_tok_s == pytest.approx((2 + 5 + 6) / 2)  # two of the first request's chunks are inside
    assert s.completed == 2 and s.errors == 1
    assert s.request_per_s == pytest.approx(3 / 2)  # three finished inside the window
    assert s.mean_ttft_ms == pytest.approx((200 + 100) / 2)
    assert s.median_itl_ms == pytest.approx(200)
    assert s.mean_tpot_ms == pytest.approx(((1.0 - 0.2) / 4 + (0.5 - 0.1) / 5) / 2 * 1000)
    assert s.backend_share == {"baseline": pytest.approx(2 / 3), "speculative": pytest.approx(1 / 3)}
    assert s.error_samples == ("HTTP 500",)


def test_client_errors_are_counted_apart_from_the_servers() -> None:
    resent = result(1.1, [1.2, 1.3], tokens=2)
    resent.attempts = 2
    refused = RequestResult(started=1.5, finished=1.5, error="ClientOSError: reset (3 tries)", client_error=True,
                            attempts=3)  # fmt: skip
    rs = [result(1.0, [1.1, 1.2], tokens=2), resent, result(1.4, [], tokens=0, ok=False), refused]
    s = summarize(1, rs, t0=1.0, t1=3.0, min_requests=1)
    assert (s.completed, s.errors, s.client_errors) == (2, 1, 1)
    assert s.error_samples == ("HTTP 500",)
    assert s.client_error_samples == ("ClientOSError: reset (3 tries)",)
    assert s.retried == 1  # answered after a resend; the refused one never was
    assert not s.conclusive  # one request in four failed on the client's side


def test_min_ok_requests_asks_for_half_the_streams_and_at_least_min_requests() -> None:
    assert min_ok_requests(1) == DEFAULT_MIN_REQUESTS == 10
    assert min_ok_requests(30) == 15 and min_ok_requests(31) == 16 and min_ok_requests(250) == 125
    assert min_ok_requests(1, min_requests=3) == 3 and min_ok_requests(30, min_requests=3) == 15
    assert min_ok_requests(250, min_requests=0) == 0  # the check turned off


def test_a_level_with_too_few_good_requests_is_inconclusive() -> None:
    good = [result(1.0 + i / 10, [1.05 + i / 10], tokens=1) for i in range(9)]
    refused = [RequestResult(started=2.0, finished=2.0, error="reset", client_error=True) for _ in range(50)]
    s = summarize(2, good + refused, t0=1.0, t1=3.0)
    assert (s.completed, s.min_ok, s.conclusive) == (9, 10, False)  # client errors are no good requests
    ten = summarize(2, [*good, result(1.95, [1.99], tokens=1)], t0=1.0, t1=3.0)
    assert (ten.completed, ten.conclusive) == (10, True)
    assert summarize(2, good, t0=1.0, t1=3.0, min_requests=0).conclusive


def test_a_level_with_many_client_errors_is_inconclusive_whatever_its_good_requests() -> None:
    # Streams that failed on the client's side sat idle: the server carried less than the level's load.
    good = [result(1.0 + i / 100, [1.5 + i / 100], tokens=1) for i in range(40)]

    def refused(n: int) -> list[RequestResult]:
        return [RequestResult(started=2.0, finished=2.0, error="reset", client_error=True) for _ in range(n)]

    assert summarize(4, good + refused(2), t0=1.0, t1=3.0).conclusive  # 2 of 42: under CLIENT_ERROR_SHARE
    three = summarize(4, good + refused(3), t0=1.0, t1=3.0)
    assert (three.completed, three.min_ok, three.conclusive) == (40, 10, False)  # 3 of 43
    # Server errors are a finding about the server, not a reason to doubt the measurement.
    failed = [result(2.0, [], tokens=0, ok=False) for _ in range(30)]
    assert summarize(4, good + failed, t0=1.0, t1=3.0).conclusive
