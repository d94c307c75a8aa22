"""The measures every summary of request results is made of (stats.py for a level's, classes.py for
a traffic class's): percentiles, ratios and means that say NaN for nothing, and the tokens a
request produced inside a window. Pure."""

from __future__ import annotations

import math
from collections.abc import Sequence

from .client import RequestResult


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), q in [0, 100]; NaN when empty."""
    if not values:
        return math.nan
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def ratio(a: float, b: float) -> float:
    """a / b; NaN where b is not positive or a unknown."""
    return a / b if b > 0 and not math.isnan(a) else math.nan


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def tokens_in_window(r: RequestResult, t0: float, t1: float) -> float:
    """The request's output tokens produced inside [t0, t1], spread evenly over its text chunks."""
    if not r.ok or not r.chunk_times:
        return 0.0
    inside = sum(1 for t in r.chunk_times if t0 <= t <= t1)
    return r.output_tokens * inside / len(r.chunk_times)
