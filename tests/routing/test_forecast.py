"""The footprint's trend (proxy/policy/forecast.py): its slope, the scatter it discounts, its bounds."""

from __future__ import annotations

import math
import random

import pytest

from proxy.policy.forecast import MAX_SAMPLES, MIN_SAMPLES, Trend, Z, slope


def test_the_slope_of_a_straight_line_is_exact_with_no_error() -> None:
    b, se = slope([(t, 5.0 + 3.0 * t) for t in (0.0, 0.5, 1.0, 2.0, 4.0)])
    assert b == pytest.approx(3.0)
    assert se == pytest.approx(0.0, abs=1e-9)


def test_too_few_samples_or_one_instant_give_no_slope() -> None:
    assert slope([(float(t), float(t)) for t in range(MIN_SAMPLES - 1)]) == (0.0, math.inf)
    assert slope([(1.0, float(v)) for v in range(10)]) == (0.0, math.inf)


def test_the_rate_is_the_slope_less_its_scatter() -> None:
    rng = random.Random(0)
    trend = Trend(10.0)
    for i in range(40):
        t = i * 0.25
        trend.add(t, 1000.0 * t + rng.uniform(-2000.0, 2000.0))
    b, se = slope(trend.samples)
    assert se > 0 and trend.rate() == pytest.approx(b - Z * se)
    assert trend.rate() < b


def test_jumps_that_tilt_the_fit_are_discounted_by_their_scatter() -> None:
    # A light load's footprint as requests come and go: level on the whole, its fit tilted up by
    # where the jumps fell. The plain slope would forecast 13,000 more tokens over the span.
    trend = Trend(10.0)
    for t, v in zip((0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75), (20, 28, 20, 24, 20, 28, 24, 24), strict=True):
        trend.add(t, v * 1000.0)
    b, se = slope(trend.samples)
    assert b * trend.span_s > 13_000
    growth = trend.ahead(24_000.0) - 24_000.0
    assert growth == pytest.approx((b - Z * se) * trend.span_s)
    assert 0 <= growth < 0.2 * b * trend.span_s


def test_a_steady_climb_is_extrapolated_a_span_ahead() -> None:
    trend = Trend(10.0)
    for i in range(41):
        trend.add(i * 0.25, 2000.0 * i * 0.25)
    assert trend.rate() == pytest.approx(2000.0)
    assert trend.ahead(20_000.0) == pytest.approx(40_000.0)


def test_a_fall_is_never_extrapolated() -> None:
    trend = Trend(10.0)
    for i in range(20):
        trend.add(float(i), 100_000.0 - 1000.0 * i)
    assert trend.rate() < 0 and trend.ahead(81_000.0) == 81_000.0


def test_samples_older_than_the_span_are_dropped_and_bounded() -> None:
    trend = Trend(5.0)
    # A climb long ago, level since: only the last 5 s count.
    for i in range(20):
        trend.add(float(i), 1000.0 * i)
    for i in range(20, 30):
        trend.add(float(i), 20_000.0)
    assert all(t >= 24.0 for t, _ in trend.samples)
    assert trend.rate() == pytest.approx(0.0)
    dense = Trend(1000.0)
    for i in range(10 * MAX_SAMPLES):
        dense.add(i * 0.001, float(i))
    assert len(dense.samples) == MAX_SAMPLES


def test_a_trend_needs_a_span() -> None:
    with pytest.raises(ValueError, match="positive span"):
        Trend(0.0)
