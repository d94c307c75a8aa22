"""calibrate's bisect search as a pure function: where it measures next, and when it is done."""

from __future__ import annotations

import argparse
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loadtest.calibrate import calibrate
from loadtest.calibrate.measure import estimate
from loadtest.calibrate.search import MAX_TRIES, Measured, Status, Step, most_left, next_level, plan_levels, status_of
from loadtest.kit.sweeps import MAX_DURATION_REQUESTS, doubled
from loadtest.stats import LevelStats
from loadtest.sweep import LevelPlan

GRID = [1, 2, 5, 10, 30, 70, 100, 250]


def run(grid: list[int], first_behind: int, unknown: dict[int, int] | None = None) -> tuple[list[Measured], Step]:
    """The search on monotone data: behind from grid index `first_behind` (len(grid): never);
    `unknown` maps a level to how many of its measurements come back inconclusive."""
    left = dict(unknown or {})
    measured: list[Measured] = []
    for _ in range(len(grid) * MAX_TRIES + 1):
        step = next_level(grid, measured)
        if step.level is None:
            return measured, step
        status: Status = "behind" if grid.index(step.level) >= first_behind else "ahead"
        if left.get(step.level, 0) > 0:
            left[step.level] -= 1
            status = "inconclusive"
        measured.append(Measured(step.level, status))
    raise AssertionError("the search did not end")


def test_it_starts_in_the_middle_and_brackets_a_crossover_at_20() -> None:
    measured, step = run(GRID, first_behind=GRID.index(30))
    assert [m.level for m in measured] == [10, 30]
    assert step.decided and "ahead at 10 and behind at 30" in step.why


def test_it_gallops_up_then_bisects() -> None:
    measured, step = run(GRID, first_behind=GRID.index(70))
    assert [m.level for m in measured] == [10, 30, 100, 70]
    assert step.decided and "ahead at 30 and behind at 70" in step.why


def test_never_and_always_need_the_grid_ends() -> None:
    measured, step = run(GRID, first_behind=0)
    assert measured[-1] == Measured(1, "behind") and step.decided and "lowest level" in step.why
    measured, step = run(GRID, first_behind=len(GRID))
    assert measured[-1] == Measured(250, "ahead") and step.decided and "highest level" in step.why


def test_an_inconclusive_level_in_the_bracket_is_measured_again_with_its_window_doubled() -> None:
    # Crossover between 10 and 30; 30 inconclusive once: 70 is measured (behind), then 30 again.
    measured, step = run(GRID, first_behind=GRID.index(30), unknown={30: 1})
    assert [m.level for m in measured] == [10, 30, 70, 30]
    assert step.decided and "behind at 30" in step.why
    assert next_level(GRID, measured[:3]).tries == 1
    assert "30 not measured conclusively: widening round it first" in next_level(GRID, measured[:2]).why


def test_a_bracket_across_a_level_inconclusive_every_time_is_no_bracket() -> None:
    measured, step = run(GRID, first_behind=GRID.index(30), unknown={30: MAX_TRIES})
    assert step.level is None and not step.decided
    assert "between 10 and 70 streams" in step.why and "30 stayed inconclusive" in step.why
    assert sum(m.level == 30 for m in measured) == MAX_TRIES


def test_nothing_conclusive_ends_with_no_bracket() -> None:
    _, step = run([1, 2], first_behind=1, unknown={1: 9, 2: 9})
    assert not step.decided and "no level was measured conclusively" in step.why


def test_the_most_left_counts_down_to_none() -> None:
    assert most_left(GRID, []) == plan_levels(GRID, "bisect")[1] == 4
    measured, _ = run(GRID, first_behind=GRID.index(70))
    assert [most_left(GRID, measured[:k]) for k in range(len(measured) + 1)] == [4, 3, 2, 1, 0]


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="increasing"):
        next_level([5, 2], [])
    with pytest.raises(ValueError, match="not a level of the grid"):
        next_level(GRID, [Measured(3, "ahead")])


@settings(max_examples=300, deadline=None)
@given(
    grid=st.lists(st.integers(1, 500), min_size=1, max_size=12, unique=True).map(sorted),
    where=st.floats(0, 1),
    flaky=st.dictionaries(st.integers(0, 11), st.integers(0, MAX_TRIES + 1), max_size=4),
)
def test_it_ends_never_concludes_from_an_inconclusive_level_and_lands_within_one_level(
    grid: list[int], where: float, flaky: dict[int, int]
) -> None:
    first_behind = round(where * len(grid))
    unknown = {grid[i]: k for i, k in flaky.items() if i < len(grid)}
    measured, step = run(grid, first_behind, unknown)  # raises if it does not end
    latest = {m.level: m.status for m in measured}
    if step.decided:
        # The bracket rests on two conclusive levels, adjacent in the grid, either side of the truth.
        b = min((grid.index(c) for c, s in latest.items() if s == "behind"), default=len(grid))
        assert b == first_behind
        if b > 0:
            assert latest[grid[b - 1]] == "ahead"
        if b < len(grid):
            assert latest[grid[b]] == "behind"
    if all(k < MAX_TRIES for k in unknown.values()):
        assert step.decided  # every level concludes within its tries: the search always brackets
    if not unknown:
        assert len(measured) <= plan_levels(grid, "bisect")[1] <= 2 * math.ceil(math.log2(len(grid) + 1)) + 1


def level(c: int, tok_s: float, tpot_ms: float, conclusive: bool = True) -> LevelStats:
    nan = math.nan
    return LevelStats(concurrency=c, duration_s=30.0, completed=100, errors=0, output_tok_s=tok_s,
                      request_per_s=1.0, mean_ttft_ms=nan, median_ttft_ms=nan, p99_ttft_ms=nan, mean_itl_ms=nan,
                      median_itl_ms=nan, p95_itl_ms=nan, p99_itl_ms=nan, mean_tpot_ms=tpot_ms, mean_e2e_ms=nan,
                      median_e2e_ms=nan, min_ok=10, conclusive=conclusive)  # fmt: skip


def test_a_level_is_ahead_only_on_both_counts() -> None:
    assert status_of(level(10, 200.0, 5.0), level(10, 100.0, 8.0)) == "ahead"
    assert status_of(level(10, 200.0, 9.0), level(10, 100.0, 8.0)) == "behind"  # TPOT behind
    assert status_of(level(10, 90.0, 5.0), level(10, 100.0, 8.0)) == "behind"
    assert status_of(level(10, 200.0, 5.0, conclusive=False), level(10, 100.0, 8.0)) == "inconclusive"
    assert status_of(level(10, 200.0, math.nan), level(10, 100.0, 8.0)) == "inconclusive"


@settings(max_examples=100, deadline=None)
@given(cross=st.floats(1.5, 240), spec_gain=st.floats(1.1, 3), tpot_later=st.floats(1, 2))
def test_where_the_search_is_decided_calibrate_recommends_from_the_levels_measured(
    cross: float, spec_gain: float, tpot_later: float
) -> None:
    """The search's verdict and calibrate's agree: a decided search gives a recommendation within
    one level of the grid, from the measured levels alone (not the grid)."""

    def pair(c: int) -> tuple[LevelStats, LevelStats]:
        # Speculation's edge falls linearly in log load, crossing at `cross` on throughput and later on TPOT.
        edge = 1 + (spec_gain - 1) * (1 - math.log(c) / math.log(cross))
        tpot_edge = 1 + (spec_gain - 1) * (1 - math.log(c) / math.log(cross * tpot_later))
        base = level(c, 100.0 * c, 10.0)
        return level(c, 100.0 * c * edge, 10.0 / tpot_edge), base

    measured: list[Measured] = []
    rows: dict[int, tuple[LevelStats, LevelStats]] = {}
    while (step := next_level(GRID, measured)).level is not None:
        rows[step.level] = pair(step.level)
        measured.append(Measured(step.level, status_of(*rows[step.level])))
    assert step.decided
    levels = sorted(rows)
    _, _, rec = calibrate([rows[c][0] for c in levels], [rows[c][1] for c in levels])
    assert rec.made and rec.high is not None
    below = max((c for c in GRID if c <= cross), default=0)
    above = min((c for c in GRID if c > cross), default=GRID[-1])
    assert below - 1 <= rec.high <= above, (cross, rec)


def test_the_estimate_is_a_range_from_the_plan() -> None:
    args = argparse.Namespace(search="bisect", concurrency=GRID, save=None, prompt_tokens=[4096], requests=None,
                              duration_s=30.0, max_duration_s=None, warmup_s=0.0)  # fmt: skip
    text = estimate(args)
    assert "2-4 of the grid's 8 levels" in text and "windows of 2.0 min in all at 30 s each" in text
    assert "up to 40.0 min where every window runs on to 300 s" in text
    args.search, args.save = "full", "cal.json"
    text = estimate(args)
    assert "8 of the grid's 8 levels" in text and "x 2 sweeps" in text and "windows of 16.0 min in all" in text


def test_a_window_runs_on_to_three_times_the_warm_ups_longest_request_where_longer() -> None:
    # At 8k-token prompts and 250 streams a request queued for the KV pool can outlast 10 windows.
    plan = LevelPlan(duration_s=30.0, max_duration_s=300.0, max_duration_per_request=MAX_DURATION_REQUESTS)
    assert plan.extends and plan.window_bound(50.0) == 300.0 and plan.window_bound(200.0) == 600.0
    # An explicit --max-duration-s is a hard bound: no run-on by requests.
    fixed = LevelPlan(duration_s=30.0, max_duration_s=30.0)
    assert not fixed.extends and fixed.window_bound(200.0) == 30.0
    # A level measured again: its window and bound doubled, its run-on rule kept.
    again = doubled(plan, 1)
    assert (again.duration_s, again.max_duration_s, again.max_duration_per_request) == (60.0, 600.0, 3.0)
    assert doubled(plan, 0) is plan
