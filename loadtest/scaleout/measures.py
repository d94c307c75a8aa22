"""scaleout's measures: pure functions of the samples a run recorded (split, in-flight, switches)."""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

from ..measures import ratio
from .plan import BUSY_MIN, Server
from .run import GateSample, ServerSample

S = TypeVar("S", ServerSample, GateSample)


def nearest(samples: Sequence[S], t: float) -> S | None:
    """The sample taken closest to `t` (the samples in time order)."""
    if not samples:
        return None
    times = [s.t for s in samples]
    i = bisect.bisect_left(times, t)
    near = [j for j in (i - 1, i) if 0 <= j < len(samples)]
    return samples[min(near, key=lambda j: abs(times[j] - t))]


def increase(samples: Sequence[ServerSample], a: float, b: float, pick: Callable[[ServerSample], float]) -> float:
    """A counter's increase per second between the samples nearest `a` and `b`; NaN without two."""
    sa, sb = nearest(samples, a), nearest(samples, b)
    if sa is None or sb is None or sb.t <= sa.t:
        return math.nan
    return (pick(sb) - pick(sa)) / (sb.t - sa.t)


def group_shares(by_server: Mapping[str, float], group_of: Mapping[str, str]) -> dict[str, float]:
    """Each group's share of the servers' total (NaN when nothing was counted)."""
    groups: dict[str, float] = {}
    for name, value in by_server.items():
        groups[group_of[name]] = groups.get(group_of[name], 0.0) + value
    total = math.fsum(groups.values())
    return {g: v / total if total > 0 else math.nan for g, v in sorted(groups.items())}


def split_deviation(shares: Mapping[str, float]) -> float | None:
    """How far the most uneven group is from an even split, relative to it: max |share * G - 1|.
    0 is even; 0.15 means a group got 15% more or less than its even share. None with one group."""
    n = len(shares)
    if n < 2:
        return None
    return max(abs(s * n - 1.0) for s in shares.values())


def switches_between(samples: Sequence[GateSample], a: float, b: float) -> dict[str, int] | None:
    """Each group's mode switches between the samples nearest `a` and `b`; None where the replica
    exports no switch counts (or did not answer)."""
    sa, sb = nearest(samples, a), nearest(samples, b)
    if sa is None or sb is None or sa.switches is None or sb.switches is None:
        return None
    return {g: round(sb.switches.get(g, 0.0) - v) for g, v in sorted(sa.switches.items())}


def trusted_inflight(samples: Sequence[ServerSample]) -> list[tuple[float, float]]:
    """(t, running + queued) at each periodic sample after the first; 0 where the server generated
    nothing since the previous periodic sample: SGLang's gauges keep their last value when a server
    goes idle, so a frozen reading is no load."""
    ticks = [s for s in samples if s.tick]
    return [(cur.t, cur.inflight if cur.generated > prev.generated else 0.0) for prev, cur in itertools.pairwise(ticks)]


def mean_inflight(samples: Sequence[ServerSample], a: float, b: float) -> tuple[float, int]:
    """(mean in flight, samples) over the periodic samples inside [a, b] (see trusted_inflight)."""
    values = [v for t, v in trusted_inflight(samples) if a <= t <= b]
    return (math.fsum(values) / len(values) if values else math.nan), len(values)


def aligned_inflight(
    servers: Sequence[Server], samples: Mapping[str, Sequence[ServerSample]]
) -> list[tuple[float, dict[str, float]]]:
    """(t, in flight by server) at each periodic sample (trusted_inflight), the servers' readings
    taken at the same round of scrapes (the nearest in time to the first server's)."""
    series = {s.name: trusted_inflight(samples[s.name]) for s in servers}
    if not servers or any(not x for x in series.values()):
        return []
    times = {name: [t for t, _ in x] for name, x in series.items()}
    out = []
    for t, _ in series[servers[0].name]:
        loads: dict[str, float] = {}
        for name, x in series.items():
            ts = times[name]
            i = bisect.bisect_left(ts, t)
            j = min((k for k in (i - 1, i) if 0 <= k < len(x)), key=lambda k: abs(ts[k] - t))
            loads[name] = x[j][1]
        out.append((t, loads))
    return out


def group_loads(
    servers: Sequence[Server], samples: Mapping[str, Sequence[ServerSample]]
) -> list[tuple[float, dict[str, float]]]:
    """(t, in flight by group) at each round of periodic samples (aligned_inflight)."""
    group_of = {s.name: s.group for s in servers}
    out = []
    for t, by_server in aligned_inflight(servers, samples):
        loads: dict[str, float] = {}
        for name, v in by_server.items():
            loads[group_of[name]] = loads.get(group_of[name], 0.0) + v
        out.append((t, loads))
    return out


def instant_deviation(loads: Sequence[tuple[float, Mapping[str, float]]], a: float, b: float) -> float | None:
    """The split of the requests in flight moment by moment: the mean over the samples inside [a, b]
    of max |group's share x groups - 1| (samples with nothing in flight left out). A split even over a
    window (split_deviation) can hide load sloshing from group to group; this does not. None with
    one group or no sample."""
    values = []
    for t, by_group in loads:
        total = math.fsum(by_group.values())
        if a <= t <= b and total >= 1 and len(by_group) > 1:
            values.append(split_deviation({g: v / total for g, v in by_group.items()}) or 0.0)
    return math.fsum(values) / len(values) if values else None


def imbalance(means: Sequence[float], busy_min: float = BUSY_MIN) -> float | None:
    """The busiest server's mean in-flight over its role's mean per server; None when the role was
    idle (its servers held under `busy_min` on average) or a mean is missing."""
    if not means or any(math.isnan(m) for m in means):
        return None
    role = math.fsum(means) / len(means)
    return max(means) / role if role >= busy_min else None


def vs_better(gate: float, all_speculative: float, all_baseline: float) -> float:
    """specgate's throughput over the better of the two fixed configurations' (NaN if unknown)."""
    best = max(all_speculative, all_baseline)
    return ratio(gate, best) if not math.isnan(best) else math.nan


# Drift between replicas: each replica's estimate of a group's load against the others' and the truth.
