"""The crossover finder on synthetic curves, and the watermarks it recommends."""

from __future__ import annotations

import math

import pytest

from loadtest.calibrate import (
    Crossover,
    calibrate,
    calibration_file,
    class_env_lines,
    find_crossover,
    inconclusive_levels,
    recommend,
)
from loadtest.report import calibration_text
from loadtest.stats import LevelStats
from proxy.policy.base import hysteresis_low

LEVELS = [1, 2, 5, 10, 30, 70]
nan = math.nan


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
    spec_tpot = [5.0, 6.0, 8.0, 10.5, 20.0]
    base_tpot = [9.0, 9.5, 10.0, 11.0, 12.0]
    c = find_crossover("tpot", [1, 2, 5, 10, 30], spec_tpot, base_tpot, higher_is_better=False)
    assert c.verdict == "crosses" and 10 < (c.at or 0) < 30
    # A level not measured between the last ahead and the first behind: where it crosses is unknown.
    gap = find_crossover("tpot", [1, 2, 5, 10, 30], [5.0, 6.0, 8.0, nan, 20.0], base_tpot, higher_is_better=False)
    assert (gap.verdict, gap.at, gap.above, gap.below) == ("unknown", None, 5, 30)
    assert "10 was not measured conclusively" in gap.why
    assert find_crossover("t", [1], [math.nan], [1.0]).verdict == "no_data"


def test_recommendations() -> None:
    crosses = Crossover("t", "crosses", 18.46)
    r = recommend(crosses, Crossover("l", "crosses", 25.0), max_level=70)
    assert (r.high, r.low, r.verdict) == (18, hysteresis_low(18), "crosses")
    assert r.low is not None and r.high is not None and r.low < r.high
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
    assert "Not measured conclusively: 1 concurrent streams" in rec.explanation
    # The same figures taken at their word: behind at 1 stream, ahead at 4. The levels disagree, and
    # nothing is recommended (not "never pays", which would switch speculation off).
    taken = calibrate(spec(True), base)[2]
    assert (taken.verdict, taken.high, taken.made) == ("unknown", None, False)
    assert "the levels disagree" in taken.explanation


def test_an_inconclusive_top_level_leaves_always_pays_unknown() -> None:
    # Ahead at 1 and 10; 70 unknown: speculation may stop paying anywhere from 10 to 70.
    spec = [level(1, 200.0, 2.0), level(10, 1500.0, 3.0), level(70, 900.0, 30.0, conclusive=False)]
    base = [level(1, 100.0, 8.0), level(10, 900.0, 8.0), level(70, 5000.0, 8.0)]
    tp, _, rec = calibrate(spec, base)
    assert (tp.verdict, tp.above, tp.below) == ("unknown", 10, None)
    assert (rec.verdict, rec.high, rec.low, rec.inconclusive_levels) == ("unknown", None, None, (70,))
    assert "ahead at every conclusive level up to 10 streams, and 70 was not measured" in rec.explanation


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


# ----- known tables, inconclusive levels at the bottom, in the middle and at the top -----

# A pair that crosses at 7 streams (issue: speculation ahead 1.6x at 1-4 streams).
X7 = [1, 2, 4, 7, 12, 24]
X7_SPEC = [142.0, 258.0, 451.0, 600.0, 700.0, 760.0]
X7_BASE = [88.0, 172.0, 334.0, 610.0, 950.0, 1500.0]


def table(conclusive: set[int]) -> tuple[list[LevelStats], list[LevelStats]]:
    """The X7 pair, conclusive only at the given levels; TPOT follows the per-stream speed."""

    def rows(tok_s: list[float]) -> list[LevelStats]:
        return [level(c, t, 1000.0 * c / t, c in conclusive) for c, t in zip(X7, tok_s, strict=True)]

    return rows(X7_SPEC), rows(X7_BASE)


@pytest.mark.parametrize(
    ("conclusive", "high"),
    [
        (set(X7), 6),  # every level: the crossover at ~6.9
        ({4, 7, 12, 24}, 6),  # bottom unknown: ahead at 4, so at 1 and 2 too; the bracket 4-7 holds
        ({1, 2, 4, 7, 24}, 6),  # the middle unknown, but above the bracket
        ({1, 2, 4, 7}, 6),  # top unknown: above the bracket, nothing there could move it
        ({2, 4, 7, 12}, 6),  # both ends unknown
    ],
)
def test_a_bracket_of_neighbouring_conclusive_levels_gives_the_watermark(conclusive: set[int], high: int) -> None:
    tp, lat, rec = calibrate(*table(conclusive))
    assert tp.verdict == "crosses" and 4 < (tp.at or 0) < 7
    assert (rec.verdict, rec.high, rec.low) == ("crosses", high, hysteresis_low(high))
    assert rec.inconclusive_levels == tuple(c for c in X7 if c not in conclusive)
    assert "SPECGATE_HIGH_WATERMARK=6" in calibration_text(tp, lat, rec)


@pytest.mark.parametrize(
    ("conclusive", "says"),
    [
        # The run: only 12 conclusive, the baseline ahead there. Not "never pays".
        ({12}, "the baseline was ahead from 12 streams, the lowest conclusive level, and 1, 2, 4, 7 were not"),
        ({7, 12, 24}, "the baseline was ahead from 7 streams, the lowest conclusive level, and 1, 2, 4 were not"),
        ({1, 2, 4, 12, 24}, "speculation was ahead at 4 and behind at 12 streams, and 7 was not"),  # the middle
        # The top: speculation may stop paying anywhere above 2.
        ({1, 2}, "speculation was ahead at every conclusive level up to 2 streams, and 4, 7, 12, 24 were not"),
    ],
)
def test_an_unbracketed_crossover_is_refused(conclusive: set[int], says: str) -> None:
    tp, lat, rec = calibrate(*table(conclusive))
    assert tp.verdict == "unknown" and says in tp.why
    assert (rec.verdict, rec.high, rec.low, rec.made) == ("unknown", None, None, False)
    assert rec.explanation.startswith("The crossover is not bracketed by conclusive levels: on throughput, " + says)
    assert "No watermarks are recommended" in rec.explanation and "\n" not in rec.explanation  # one line
    text = calibration_text(tp, lat, rec)
    assert "SPECGATE_" not in text and "Nothing to paste" in text
    assert rec.env_lines() == ""


def test_never_pays_needs_the_lowest_level_and_no_level_ahead() -> None:
    spec = [s * 0.5 for s in X7_BASE]  # behind everywhere
    levels = [level(c, s, 1.0) for c, s in zip(X7, spec, strict=True)]
    bases = [level(c, b, 1.0) for c, b in zip(X7, X7_BASE, strict=True)]
    assert calibrate(levels, bases)[2].high == 0
    # The lowest level unknown: speculation may pay there.
    levels[0] = level(1, 44.0, 1.0, conclusive=False)
    _, _, rec = calibrate(levels, bases)
    assert rec.verdict == "unknown" and rec.high is None


def test_the_earlier_crossover_decides_when_the_other_cannot_move_it() -> None:
    # Throughput crosses between 4 and 7 (watermark 6); TPOT is unknown between 7 and 24 (12 not
    # measured): whatever 12 holds, TPOT's watermark is at least 7, so the recommendation is 6.
    tp = Crossover("output_tok_s", "crosses", 6.5)
    lat = Crossover("mean_tpot_ms", "unknown", above=7, below=24, why="speculation was ahead at 7 ...")
    assert (recommend(tp, lat, 24).high, recommend(lat, tp, 24).high) == (6, 6)
    # TPOT unknown lower down (between 2 and 7): it may cross before 6, so nothing is recommended.
    low = Crossover("mean_tpot_ms", "unknown", above=2, below=7, why="speculation was ahead at 2 ...")
    rec = recommend(tp, low, 24)
    assert (rec.verdict, rec.high) == ("unknown", None) and "on TPOT, speculation was ahead at 2" in rec.explanation
    # Never pays on one count decides, whatever the other.
    assert recommend(Crossover("output_tok_s", "never_pays"), low, 24).high == 0


def test_a_refused_recommendation_is_never_saved() -> None:
    spec, base = table({12})
    _, _, rec = calibrate(spec, base)
    with pytest.raises(ValueError, match="no recommendation"):
        calibration_file(spec, base, rec, {}, {}, "2026-12-04T00:00:00Z")


def test_with_classes_the_lines_to_paste_name_a_policy_that_prices_them() -> None:
    rec = recommend(Crossover("t", "crosses", 18.46), Crossover("l", "crosses", 25.0), max_level=70)
    saved = class_env_lines(rec, "calibration.json")
    assert "SPECGATE_POLICY=adaptive\nSPECGATE_CALIBRATION=calibration.json\nSPECGATE_CLASS_KEY=header\n" in saved
    assert "threshold would ignore the classes" in saved and "SPECGATE_HIGH_WATERMARK" not in saved
    # Without a file: adaptive starts from the recommended watermarks and learns the classes live.
    live = class_env_lines(rec, None)
    assert "SPECGATE_HIGH_WATERMARK=18\nSPECGATE_LOW_WATERMARK=" in live and "SPECGATE_CALIBRATION" not in live
    assert "first streams end" in live
    unknown = recommend(Crossover("t", "unknown", above=10), Crossover("l", "crosses", 25.0), max_level=70)
    assert class_env_lines(unknown, "calibration.json") == ""
