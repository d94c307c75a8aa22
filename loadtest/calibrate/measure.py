"""calibrate's levels measured: the whole grid (--search full) or the levels the bisect search
picks (search.py), both servers back to back at each; and the run's estimated duration."""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable, Mapping, Sequence

from ..kit.sweeps import MAX_DURATION_REQUESTS, LevelSampler, level_runner, max_duration, sweep_targets
from ..stats import LevelStats
from .search import Measured, Search, most_left, next_level, plan_levels, status_of


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


async def measure_levels(
    urls: Mapping[str, str],
    args: argparse.Namespace,
    samplers: Mapping[str, LevelSampler] | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> dict[str, list[LevelStats]]:
    """Both servers' levels, in increasing order of level; with --search bisect only those the
    search measured, each level's latest measurement (a level measured again replaces its first)."""
    if args.search == "full":
        return await sweep_targets(urls, args, samplers)
    grid = list(args.concurrency)
    by_level: dict[int, dict[str, LevelStats]] = {}
    measured: list[Measured] = []
    started = clock()
    async with level_runner(urls, args, samplers) as measure:
        while (step := next_level(grid, measured)).level is not None:
            _say(f"search: {step.level} streams: {step.why}")
            rows = await measure(step.level, step.tries)
            by_level[step.level] = rows
            measured.append(Measured(step.level, status_of(rows["speculative"], rows["baseline"])))
            _say(_progress(grid, measured, clock() - started))
    levels = sorted(by_level)
    _say(
        f"search done: {step.why} ({len(measured)} measurements of {len(levels)} of the grid's {len(grid)} levels: "
        f"{', '.join(map(str, levels))})"
    )
    return {name: [by_level[c][name] for c in levels] for name in urls}


def _progress(grid: Sequence[int], measured: Sequence[Measured], elapsed_s: float) -> str:
    """After a level: what it was, the time so far, and the most left at this pace."""
    last = measured[-1]
    left = most_left(grid, measured)
    line = f"search: {last.level} streams {last.status}; {len(measured)} measured in {_minutes(elapsed_s)}"
    if left:
        pace = elapsed_s / len(measured)
        line += f", at most {left} more if each is conclusive (about {_minutes(left * pace)} at this pace)"
    return line


def _minutes(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "unbounded"
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def estimate(args: argparse.Namespace, targets: int = 2) -> str:
    """The run's duration from its plan, before it starts: the levels the search measures if each is
    conclusive (fewest, most), each target's window at each (--duration-s at least, --max-duration-s
    at most) and least warm-up, and with --save the speed-model sweeps over the same levels."""
    search: Search = args.search
    grid: Sequence[int] = args.concurrency
    fewest, most = plan_levels(grid, search)
    sweeps = 1 + (len(args.prompt_tokens) if args.save else 0)
    levels = f"{fewest}" if fewest == most else f"{fewest}-{most}"
    head = f"estimate: {levels} of the grid's {len(grid)} levels (--search {search}, each level conclusive)"
    head += f" x {targets} servers"
    if sweeps > 1:
        head += f" x {sweeps} sweeps (the speed model's at {', '.join(map(str, args.prompt_tokens))} prompt tokens)"
    if args.requests:
        return head + f": {args.requests} requests a window, so no time can be told before the run"
    longest = max_duration(args) or args.duration_s
    lo = fewest * targets * sweeps * (args.duration_s + args.warmup_s)
    hi = most * targets * sweeps * (longest + args.warmup_s)
    # By default a window may also run on to a multiple of its warm-up's longest request: unknown before the run.
    by_request = (
        ""
        if args.max_duration_s is not None
        else f" (or {MAX_DURATION_REQUESTS:g} x a level's longest request, where longer)"
    )
    return (
        f"{head}: windows of {_minutes(lo)} in all at {args.duration_s:g} s each, up to {_minutes(hi)} where every "
        f"window runs on to {longest:g} s{by_request}, plus each level's warm-up and drain (about two requests' time "
        "each); a level measured again doubles its window"
    )
