"""Load-test statistics on known inputs."""

from __future__ import annotations

import math

import pytest

from loadtest.client import RequestResult
from loadtest.stats import percentile, summarize, tokens_in_window


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
