"""The crossover finder on synthetic curves, and the watermarks it recommends."""

from __future__ import annotations

import math

import pytest

from loadtest.calibrate import Crossover, calibrate, find_crossover, inconclusive_levels, recommend
from loadtest.report import calibration_text
from loadtest.stats import LevelStats
from proxy.adaptive import hysteresis_low

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


def level(concurrency: int, tok_s: float, tpot_ms: float, conclusive: bool = True) -> LevelStats:
    nan = math.nan
    return LevelStats(concurrency=concurrency, duration_s=30.0, completed=100 if conclusive else 3, errors=0,
                      output_tok_s=tok_s, request_per_s=1.0, mean_ttft_ms=nan, median_ttft_ms=nan, p99_ttft_ms=nan,
                      mean_itl_ms=nan, median_itl_ms=nan, p95_itl_ms=nan, p99_itl_ms=nan, mean_tpot_ms=tpot_ms,
                      mean_e2e_ms=nan, median_e2e_ms=nan, min_ok=10, conclusive=conclusive)  # fmt: skip


def test_a_level_with_too_few_good_requests_is_left_out() -> None:
    # At 1 stream the speculative server had 3 good requests among failures: its throughput there
    # says "never pays", the levels measured properly say it crosses between 4 and 40.
    def spec(one_conclusive: bool) -> list[LevelStats]:
        return [level(1, 20.0, 2.0, one_conclusive), level(4, 1600.0, 2.5), level(40, 2000.0, 20.0)]

    base = [level(1, 125.0, 8.0), level(4, 500.0, 8.0), level(40, 5000.0, 8.0)]
    tp, lat, rec = calibrate(spec(False), base)
    assert tp.verdict == "crosses" and tp.at == pytest.approx(4 + 36 * 1100 / (1100 + 3000))
    assert lat.verdict == "crosses"
    assert rec.verdict == "crosses" and rec.inconclusive_levels == (1,)
    assert "too few good requests: 1 concurrent streams" in rec.explanation
    # The same figures taken at their word: the verdict the left-out level would have forced.
    assert calibrate(spec(True), base)[2].verdict == "never_pays"


def test_left_out_levels_neither_cap_nor_extend_always_pays() -> None:
    spec = [level(1, 200.0, 2.0), level(10, 1500.0, 3.0), level(70, 900.0, 30.0, conclusive=False)]
    base = [level(1, 100.0, 8.0), level(10, 900.0, 8.0), level(70, 5000.0, 8.0)]
    _, _, rec = calibrate(spec, base)
    assert (rec.verdict, rec.high, rec.inconclusive_levels) == ("always_pays", 10, (70,))
    assert "up to 10 concurrent streams" in rec.explanation


def test_a_level_inconclusive_on_either_server_is_left_out() -> None:
    spec = [level(1, 200.0, 2.0), level(10, 1500.0, 3.0)]
    base = [level(1, 100.0, 8.0, conclusive=False), level(10, 900.0, 8.0)]
    assert inconclusive_levels(spec, base) == (1,)
    assert inconclusive_levels(spec, base, [level(1, 1.0, 1.0), level(10, 1.0, 1.0, conclusive=False)]) == (1, 10)


def test_no_conclusive_level_recommends_nothing() -> None:
    spec = [level(1, 200.0, 2.0, conclusive=False), level(10, 1500.0, 3.0, conclusive=False)]
    base = [level(1, 100.0, 8.0), level(10, 900.0, 8.0)]
    tp, lat, rec = calibrate(spec, base)
    assert tp.verdict == lat.verdict == rec.verdict == "no_data"
    assert rec.inconclusive_levels == (1, 10)
    assert "No level had enough good requests" in rec.explanation and "1, 10" in rec.explanation
    text = calibration_text(tp, lat, rec)
    assert "SPECGATE_HIGH_WATERMARK" not in text and "Nothing to paste" in text
