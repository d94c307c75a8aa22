"""Which level `calibrate` measures next, and when it is done. Pure functions.

The grid is the levels planned (--concurrency; default 1,2,5,10,30,70,100,250). "Within one
level" means bracketed by two ADJACENT levels of that grid: speculation ahead at one, behind at the
next, both measured conclusively; that is exactly what the full sweep of the grid concludes from.

A level is "ahead" where speculation beats the baseline on throughput and on TPOT, "behind" where
the baseline is at least as good on either (the recommendation speculates only where speculation
pays on both counts), and "inconclusive" where either server had too few good requests there or a
figure is missing: unknown, never evidence.

Search "bisect" starts at the grid's middle level (index (n-1)//2: 10 streams on the default
grid). While speculation is ahead at every conclusive level it steps up the grid 1, 2, 4, ...
levels at a time, and while it is behind at every one it steps down likewise (a gallop, capped at
the grid's ends); once ahead at one level and behind at a higher one, it measures the grid level
midway between the highest level ahead (A) and the lowest behind (B), until they are adjacent. A
level measured above B, where speculation is ahead again, is ignored as the verdicts ignore it.

It ends when
- A and B are adjacent in the grid: bracketed (the crossover lies between them);
- speculation is behind at the grid's lowest level: never pays;
- speculation is ahead at the grid's highest level: always pays;
- no level between A and B is left to try: not bracketed (calibrate then recommends nothing).

An inconclusive level between A and B is tried elsewhere first (the nearest levels not measured
yet, on either side: widening), then measured once more with its window doubled (`tries`); one
still inconclusive after `max_tries` is left unknown, and a bracket across it is no bracket.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from ..stats import LevelStats

Status = Literal["ahead", "behind", "inconclusive"]
Search = Literal["bisect", "full"]
SEARCHES: tuple[Search, ...] = ("bisect", "full")
# Measurements of one level at most: the first, and one more with its window doubled.
MAX_TRIES = 2


@dataclass(frozen=True)
class Measured:
    level: int
    status: Status


@dataclass(frozen=True)
class Step:
    """The next level to measure (None: done), and why, in words for the user."""

    level: int | None
    why: str
    # How many times this level was measured before (its window is doubled this many times).
    tries: int = 0
    # Done, and the levels measured decide where speculation stops paying.
    decided: bool = False


def status_of(speculative: LevelStats, baseline: LevelStats) -> Status:
    """One level's verdict on both counts (module docstring)."""
    figures = (speculative.output_tok_s, baseline.output_tok_s, speculative.mean_tpot_ms, baseline.mean_tpot_ms)
    if not (speculative.conclusive and baseline.conclusive) or not all(math.isfinite(f) for f in figures):
        return "inconclusive"
    ahead = speculative.output_tok_s > baseline.output_tok_s and speculative.mean_tpot_ms < baseline.mean_tpot_ms
    return "ahead" if ahead else "behind"


def start_index(n: int) -> int:
    return (n - 1) // 2


def next_level(grid: Sequence[int], measured: Sequence[Measured], max_tries: int = MAX_TRIES) -> Step:
    """The bisect search's next step, from the levels measured so far in order (module docstring)."""
    if not grid or list(grid) != sorted(set(grid)):
        raise ValueError("the grid must be increasing levels")
    index = {c: i for i, c in enumerate(grid)}
    latest: dict[int, Status] = {}
    tries: dict[int, int] = {}
    for m in measured:
        if m.level not in index:
            raise ValueError(f"{m.level} streams is not a level of the grid")
        i = index[m.level]
        latest[i], tries[i] = m.status, tries.get(i, 0) + 1
    n = len(grid)
    b = min((i for i, s in latest.items() if s == "behind"), default=n)
    a = max((i for i, s in latest.items() if s == "ahead" and i < b), default=-1)
    if b == a + 1:
        return Step(None, _decided(grid, a, b), decided=True)
    candidates = [i for i in range(a + 1, b) if tries.get(i, 0) < max_tries]
    if not candidates:
        return Step(None, _not_bracketed(grid, a, b, max_tries))
    s = start_index(n)
    if a == -1 and b == n:
        target: float = s
    elif b == n:  # ahead so far: gallop up
        target = min(n - 1, a + max(1, a - s + 1))
    elif a == -1:  # behind so far: gallop down
        target = max(0, b - max(1, s - b + 1))
    else:
        target = (a + b) / 2
    # Levels not measured yet first (widening round an inconclusive one), nearest the target, the
    # lower on a tie; then the inconclusive ones again.
    i = min(candidates, key=lambda j: (tries.get(j, 0), abs(j - target), j))
    done = tries.get(i, 0)
    if done:
        why = f"{grid[i]} streams again, its window doubled: it was not measured conclusively and the bracket needs it"
    else:
        why = _why(grid, a, b)
        unknown = [grid[j] for j in range(a + 1, b) if latest.get(j) == "inconclusive"]
        if unknown:
            # Say so: the honesty rule makes these no evidence, and the search goes round them.
            why += f"; {', '.join(map(str, unknown))} not measured conclusively: widening round it first"
    return Step(grid[i], why, tries=done)


def _why(grid: Sequence[int], a: int, b: int) -> str:
    n = len(grid)
    if a == -1 and b == n:
        return "no conclusive level yet"
    if b == n:
        return f"speculation ahead up to {grid[a]} streams: stepping up"
    if a == -1:
        return f"speculation behind from {grid[b]} streams: stepping down"
    return f"the crossover lies between {grid[a]} and {grid[b]} streams: bisecting"


def _decided(grid: Sequence[int], a: int, b: int) -> str:
    if b == 0:
        return f"speculation behind at the lowest level, {grid[0]} streams"
    if a == len(grid) - 1:
        return f"speculation ahead at the highest level, {grid[-1]} streams"
    return f"bracketed: speculation ahead at {grid[a]} and behind at {grid[b]} streams, adjacent levels"


def _not_bracketed(grid: Sequence[int], a: int, b: int, max_tries: int) -> str:
    n = len(grid)
    if a >= 0 and b < n:
        where = f"between {grid[a]} and {grid[b]} streams"
    elif b < n:
        where = f"at or below {grid[b]} streams"
    elif a >= 0:
        where = f"above {grid[a]} streams"
    else:
        where = "anywhere: no level was measured conclusively"
    left = ", ".join(str(grid[i]) for i in range(a + 1, b))
    return (
        f"not bracketed: the crossover lies {where}, and {left} stayed inconclusive after {max_tries} tries "
        "(an inconclusive level is no evidence)"
    )


def plan_levels(grid: Sequence[int], search: Search) -> tuple[int, int]:
    """How many levels the search measures if every level is conclusive: (fewest, most), over
    every place the crossover could be (monotone data). For the estimate printed before a run."""
    if search == "full":
        return len(grid), len(grid)
    counts = [len(_simulate(grid, first_behind)) for first_behind in range(len(grid) + 1)]
    return min(counts), max(counts)


def most_left(grid: Sequence[int], measured: Sequence[Measured]) -> int:
    """The most levels the search may still measure after `measured`, if each is conclusive."""
    return max(len(_simulate(grid, f, measured)) - len(measured) for f in range(len(grid) + 1))


def _simulate(grid: Sequence[int], first_behind: int, start: Sequence[Measured] = ()) -> list[Measured]:
    measured = list(start)
    while (step := next_level(grid, measured)).level is not None:
        status: Status = "behind" if grid.index(step.level) >= first_behind else "ahead"
        measured.append(Measured(step.level, status))
    return measured


def statuses(by_level: Mapping[int, tuple[LevelStats, LevelStats]]) -> dict[int, Status]:
    """Each measured level's verdict, from its latest (speculative, baseline) measurement."""
    return {c: status_of(s, b) for c, (s, b) in by_level.items()}
