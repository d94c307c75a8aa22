"""Drift between replicas: each replica's view of a group's load against the others' and the truth."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from ..measures import percentile
from .measures import group_loads, nearest
from .plan import Server
from .run import GateSample, ServerSample


def spread(values: Sequence[float]) -> float | None:
    """How far apart the replicas' views of one load are: max - min; None with fewer than two."""
    return max(values) - min(values) if len(values) >= 2 else None


@dataclass(frozen=True)
class Round:
    """One round of periodic samples: each group's requests in flight as its servers report them, and
    what each replica believed then."""

    t: float
    truth: dict[str, float]  # by group: the servers' running + queued (trusted_inflight)
    views: list[dict[str, float] | None]  # by replica: each group's load as its policy saw it; None: no sample
    own: list[dict[str, float] | None]  # by replica: its own requests in flight on each group's servers

    def gateways(self) -> dict[str, float] | None:
        """Each group's requests in flight from all the replicas together (exact, but for the few ms
        between their scrapes); None unless every replica's count was read."""
        if not self.own or any(o is None for o in self.own):
            return None
        return {g: math.fsum(o.get(g, 0.0) for o in self.own if o is not None) for g in self.truth}


def replica_rounds(
    servers: Sequence[Server],
    server_samples: Mapping[str, Sequence[ServerSample]],
    replicas: Sequence[Sequence[GateSample]],
    tolerance: float,
) -> list[Round]:
    """At each round of the servers' periodic samples (group_loads: trusted and aligned), each
    replica's periodic sample nearest in time, if within `tolerance` seconds and it exported group
    loads; its own in-flight added up by group."""
    group_of = {s.name: s.group for s in servers}
    ticks = [[x for x in replica if x.tick] for replica in replicas]
    out = []
    for t, truth in group_loads(servers, server_samples):
        views: list[dict[str, float] | None] = []
        own: list[dict[str, float] | None] = []
        for replica in ticks:
            x = nearest(replica, t)
            if x is None or abs(x.t - t) > tolerance or not x.loads:
                views.append(None)
                own.append(None)
                continue
            views.append(dict(x.loads))
            if x.own is None:
                own.append(None)
                continue
            mine = dict.fromkeys(truth, 0.0)
            for name, v in x.own.items():
                if name in group_of:
                    mine[group_of[name]] = mine.get(group_of[name], 0.0) + v
            own.append(mine)
        out.append(Round(t, truth, views, own))
    return out


def group_spreads(rounds: Sequence[Round], a: float, b: float) -> dict[str, list[float]]:
    """Each group's spread of the replicas' loads (max - min), at every round inside [a, b] at which
    every replica's view was read (with one replica, none)."""
    out: dict[str, list[float]] = {}
    for r in rounds:
        if not a <= r.t <= b or any(v is None for v in r.views):
            continue
        for g in r.truth:
            d = spread([v[g] for v in r.views if v is not None and g in v])
            if d is not None:
                out.setdefault(g, []).append(d)
    return out


def view_errors(
    rounds: Sequence[Round], a: float, b: float, reference: Callable[[Round], Mapping[str, float] | None]
) -> list[float]:
    """Every replica's load of every group minus `reference`'s (the truth) at each round inside [a, b]."""
    out: list[float] = []
    for r in rounds:
        ref = reference(r) if a <= r.t <= b else None
        if ref is None:
            continue
        for view in r.views:
            if view is not None:
                out.extend(view[g] - ref[g] for g in ref if g in view)
    return out


def error_summary(errors: Sequence[float]) -> tuple[float, float]:
    """(mean absolute error, mean signed error: the bias); NaN when empty."""
    if not errors:
        return math.nan, math.nan
    return math.fsum(abs(e) for e in errors) / len(errors), math.fsum(errors) / len(errors)


@dataclass(frozen=True)
class Drift:
    """How the replicas' views of each group's load compared, over one level."""

    rounds: int  # rounds in the scored part with every replica's view
    spread_mean: dict[str, float]  # by group, over the scored part: max - min of the replicas' loads
    spread_p95: dict[str, float]
    spread_max: dict[str, float]
    worst_mean: float  # the largest of the groups'
    worst_p95: float
    level_max: float  # the largest spread of any group over the whole level, its step included
    # A replica's group load minus the group's servers' running + queued (SGLang's gauges: refreshed at
    # prefill and every 40 decode steps, so themselves a little old): mean |error|, mean (bias).
    error_abs: float
    error_bias: float
    error_samples: int
    # The same against the replicas' own requests in flight added up (no engine lag): the others' part's error.
    gateway_error_abs: float
    gateway_error_bias: float


def drift_of(rounds: Sequence[Round], start: float, a: float, b: float) -> Drift | None:
    """The drift figures over [a, b] (the scored part; `start`: the level's start). None without a
    round at which two or more replicas' views were read."""
    spreads = group_spreads(rounds, a, b)
    whole = group_spreads(rounds, start, b)
    if not spreads:
        return None
    errors = view_errors(rounds, a, b, lambda r: r.truth)
    gateway = view_errors(rounds, a, b, Round.gateways)
    mean = {g: math.fsum(x) / len(x) for g, x in sorted(spreads.items())}
    p95 = {g: percentile(x, 95) for g, x in sorted(spreads.items())}
    return Drift(
        rounds=max(len(x) for x in spreads.values()),
        spread_mean=mean,
        spread_p95=p95,
        spread_max={g: max(x) for g, x in sorted(spreads.items())},
        worst_mean=max(mean.values()),
        worst_p95=max(p95.values()),
        level_max=max(max(x) for x in whole.values()),
        error_abs=error_summary(errors)[0],
        error_bias=error_summary(errors)[1],
        error_samples=len(errors),
        gateway_error_abs=error_summary(gateway)[0],
        gateway_error_bias=error_summary(gateway)[1],
    )
