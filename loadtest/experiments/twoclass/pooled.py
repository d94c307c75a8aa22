"""headtohead-classes' verdicts over a cell's repeated runs: theirs where they all agree, else their
pooled ratio's, by a bootstrap interval over the runs."""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence

from ...kit.figures import NO_GOODPUT, TIE
from .plan import CONTROL, FIXED, NOISE_OF, SPLIT
from .score import FLOOR, ON_TOK_S, SPLIT_GAIN, ClassCell, Verdict, goodput_verdict

# Where a cell's runs disagree, at least this many runs let their pooled ratio decide: met where
# the lower end of its CONFIDENCE interval (resampling the runs, RESAMPLES times) clears the
# target, missed where the upper end is short of it.
POOLED_MIN_RUNS = 8
# ...and only where at most this share of them is inconclusive for the target or a fixed one: a
# stack too slow to finish enough requests is the likeliest to have missed, and pooling the rest
# would leave it out.
POOLED_MAX_UNKNOWN = 0.10
CONFIDENCE = 0.90
RESAMPLES = 2000


def repeated(cells: Sequence[ClassCell]) -> dict[tuple[int, int], list[ClassCell]]:
    """The runs of each cell (context, sessions), in the order run."""
    out: dict[tuple[int, int], list[ClassCell]] = {}
    for c in cells:
        out.setdefault((c.context, c.sessions), []).append(c)
    return out


def runs_verdict(runs: Sequence[ClassCell], target: str, verdict: Callable[[ClassCell, str], Verdict]) -> Verdict:
    """A cell's verdict over its runs: theirs where they all agree, else unknown (a target met on
    one draw of the sessions and missed on another was not measured to be either)."""
    found = {verdict(c, target) for c in runs}
    return found.pop() if len(found) == 1 else "unknown"


def pooled_ratio(runs: Sequence[ClassCell], target: str) -> float | None:
    """The target's goodput summed over the runs where its ratio is known, over the better fixed
    target's summed alike (None: none known); `features`' with its control's where both are known
    (_pooled_pairs)."""
    known = _pooled_pairs(runs, target)
    return sum(t for t, _ in known) / sum(b for _, b in known) if known else None


def _pooled_pairs(runs: Sequence[ClassCell], target: str) -> list[tuple[float, float]]:
    """(the target's goodput, with its copy's (with_copy), the better fixed target's) in each run
    where its ratio is known."""
    return [(with_copy(c, target, c.ratio), c.best_fixed() or 0.0) for c in runs if c.ratio(target) is not None]


def with_copy(c: ClassCell, target: str, known: Callable[[str], float | None]) -> float:
    """The target's goodput; for NOISE_OF, the mean of it and its control's where `known` gives the
    control a figure: the control is the same policy in the same run, a second sample of it (set on
    2026-12-06, evening, after 80 runs of the pair at 8k/32 showed the two copies' spread to be the
    ratio's, and judged on fresh seeds since)."""
    goodput = c.targets[target].goodput_req_s
    if target == NOISE_OF and CONTROL in c.targets and known(CONTROL) is not None:
        goodput = (goodput + c.targets[CONTROL].goodput_req_s) / 2
    return goodput


def pooled_interval(runs: Sequence[ClassCell], target: str) -> tuple[float, float] | None:
    """The CONFIDENCE interval of the target's pooled ratio (pooled_ratio) by a percentile
    bootstrap: the runs where its ratio is known drawn with replacement, RESAMPLES times, from a
    fixed seed (the same runs give the same interval); None with fewer than POOLED_MIN_RUNS, or
    more than POOLED_MAX_UNKNOWN of the runs inconclusive (unknown_runs)."""
    if unknown_runs(runs, target) > POOLED_MAX_UNKNOWN * len(runs):
        return None
    return bootstrap_interval(_pooled_pairs(runs, target))


def unknown_runs(runs: Sequence[ClassCell], target: str) -> int:
    """The runs in which the target or a fixed target was inconclusive."""
    return sum(1 for c in runs if not all(c.targets[n].conclusive for n in (target, *FIXED) if n in c.targets))


def bootstrap_interval(
    known: Sequence[tuple[float, float]], min_runs: int = POOLED_MIN_RUNS
) -> tuple[float, float] | None:
    """pooled_interval's bootstrap of sum(a) / sum(b) over (a, b) pairs, b >= 0 (a draw of b's
    that sum to 0 is an infinite ratio); None with fewer than `min_runs` pairs (the field benchmark
    fixes its own count of seeds)."""
    if len(known) < min_runs:
        return None
    rng, n = random.Random(0), len(known)
    draws = []
    for _ in range(RESAMPLES):
        picks = [known[rng.randrange(n)] for _ in range(n)]
        below = sum(b for _, b in picks)
        draws.append(sum(t for t, _ in picks) / below if below > 0 else math.inf)
    draws.sort()
    tail = (1 - CONFIDENCE) / 2
    return draws[int(tail * RESAMPLES)], draws[min(RESAMPLES - 1, int((1 - tail) * RESAMPLES))]


def pooled_split(runs: Sequence[ClassCell]) -> bool | None:
    """ClassCell.split on the runs pooled: each class's goodput summed over the runs on each fixed
    target, and the measured split's pooled ratio to the better fixed target, beyond TIE at the
    lower end of its interval (pooled_interval: no split where the upper end is within TIE; None
    between, or where a figure it needs is missing)."""
    known = [c for c in runs if (best := c.best_fixed()) is not None and best >= NO_GOODPUT]
    if len(known) < POOLED_MIN_RUNS or sum(c.best_fixed() is None for c in runs) > POOLED_MAX_UNKNOWN * len(runs):
        return None
    if not all(k in c.class_goodput[n] for c in known for n in FIXED for k in "AB"):
        return False  # one class: nothing to split
    spec, base = ({k: sum(c.class_goodput[n][k] for c in known) for k in "AB"} for n in FIXED)
    if not (spec["B"] > base["B"] * (1 + TIE) and base["A"] > spec["A"] * (1 + TIE)):
        return False
    measured = [(m, c.best_fixed() or 0.0) for c in known if (m := c.targets.get(SPLIT)) is not None]
    if not measured:
        return True  # from before the split was measured: on the classes alone, as ClassCell.split
    if len(measured) < len(known) or not all(m.conclusive for m, _ in measured):
        return None
    interval = bootstrap_interval([(m.goodput_req_s, best) for m, best in measured])
    if interval is None:
        return None
    if interval[0] > 1 + TIE:
        return True
    return False if interval[1] <= 1 + TIE else None


def pooled_verdict(runs: Sequence[ClassCell], target: str) -> Verdict:
    """met where the pooled ratio's interval (pooled_interval) clears the cell's goal, missed where
    it falls short of it, else unknown: SPLIT_GAIN where the classes should split on the runs pooled
    (pooled_split), FLOOR where they should not, and where that is unknown, met only by clearing
    both, missed only by falling short of both."""
    interval = pooled_interval(runs, target)
    if interval is None:
        return "unknown"
    split = pooled_split(runs)
    goals = (SPLIT_GAIN,) if split else (FLOOR,) if split is False else (FLOOR, SPLIT_GAIN)
    if interval[0] >= max(goals):
        return "met"
    return "missed" if interval[1] < min(goals) else "unknown"


def cell_verdict(runs: Sequence[ClassCell], target: str) -> Verdict:
    """A cell's goodput verdict: its runs' where they all agree on one (runs_verdict), else their
    pooled ratio's (pooled_verdict). A run of a closed loop of conversations moves by more than
    its control says between runs, as timing bunches or spreads the turns (at 8k/32 on the pair,
    from 0.55x to 1.83x of all-base over 40 seeds): one disagreeing run of many is no reason to
    know nothing."""
    found = {goodput_verdict(c, target) for c in runs}
    if found == {"unknown" + ON_TOK_S}:
        return found.pop()  # no ratio to pool where the fixed targets served none
    plain = {v.removesuffix(ON_TOK_S) for v in found}
    if len(plain) == 1 and plain != {"unknown"}:
        # Runs judged some on goodput, some on throughput (served, fixed 0 in one, none in another)
        # agree where both say the same; tagged as judged on throughput where any was.
        tag = ON_TOK_S if found != plain else ""
        return plain.pop() + tag
    return pooled_verdict(runs, target)
