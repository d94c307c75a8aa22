"""The crossover finder on synthetic curves, and the watermarks it recommends."""

from __future__ import annotations

import math

import pytest

from loadtest.calibrate import Crossover, find_crossover, hysteresis_low, recommend

LEVELS = [1, 2, 5, 10, 30, 70]


def test_crossing_is_interpolated() -> None:
    spec = [180, 330, 700, 1100, 1650, 1750]
    base = [100, 195, 470, 880, 1950, 2500]
    c = find_crossover("tok/s", LEVELS, spec, base)
    assert c.verdict == "crosses"
    # Advantage +220 at 10 and -300 at 30: zero at 10 + 20 * 220 / 520.
    assert c.at == pytest.approx(10 + 20 * 220 / 520)


def test_never_and_always() -> None:
    seed_spec = [77.5, 125.1, 183.2, 239.6, 299.5, 337.7]
    seed_base = [92.6, 159.7, 292.5, 457.2, 711.0, 784.2]
    assert find_crossover("t", LEVELS, seed_spec, seed_base).verdict == "never_pays"
    assert find_crossover("t", LEVELS, seed_base, seed_spec).verdict == "always_pays"


def test_lower_is_better_metrics_and_missing_points() -> None:
    spec_tpot = [5.0, 6.0, 8.0, math.nan, 20.0]
    base_tpot = [9.0, 9.5, 10.0, 11.0, 12.0]
    c = find_crossover("tpot", [1, 2, 5, 10, 30], spec_tpot, base_tpot, higher_is_better=False)
    assert c.verdict == "crosses" and 5 < (c.at or 0) < 30
    assert find_crossover("t", [1], [math.nan], [1.0]).verdict == "no_data"


def test_recommendations() -> None:
    crosses = Crossover("t", "crosses", 18.46)
    r = recommend(crosses, Crossover("l", "crosses", 25.0), max_level=70)
    assert (r.high, r.low, r.verdict) == (18, hysteresis_low(18), "crosses")
    assert r.low < r.high
    assert "SPECGATE_HIGH_WATERMARK=18" in r.env_lines()
    never = recommend(Crossover("t", "never_pays"), crosses, 250)
    assert (never.high, never.low, never.verdict) == (0, 0, "never_pays")
    assert "baseline" in never.explanation
    always = recommend(Crossover("t", "always_pays"), Crossover("l", "always_pays"), 250)
    assert (always.high, always.verdict) == (250, "always_pays")
    assert recommend(Crossover("t", "crosses", 0.4), crosses, 70).high == 1
