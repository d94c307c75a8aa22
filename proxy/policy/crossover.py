"""Where speculation stops paying: the two curves as believed now, their crossover, and the
watermarks they call for. Pure arithmetic; the clock is passed in.

The model. Each server has a curve of total output tok/s against concurrent streams on it; its
per-stream decode speed at c streams is tok_s(c) / c. The speculative server's curve is kept
per unit of acceptance: at a fixed number of draft steps a speculative decode step costs about
the same whatever is accepted, so its speed is proportional to the acceptance length A (bonus
token included). So

    speculative_tok_s(c) = c * v_spec(c) * A_live       v_spec: per-stream speed per unit of A
    baseline_tok_s(c)    = c * v_base(c)

where the v's start from the calibration file (v_spec = tok_s / c / A_calibrated at each level;
between levels, tok_s interpolated over c)
and are corrected by the per-stream decode speeds specgate measures on relayed streams, at the
loads traffic actually visits (levelspeeds.py). The crossover is the first level where the speculative curve no
longer beats the baseline (and, as `loadtest calibrate` does, where its TPOT no longer beats the
baseline's, when the file has TPOT curves); the high watermark is its floor, the low one a band
of a quarter below (calibrate's rule). At the calibrated acceptance and with no observations this
gives exactly the calibration's recommendation.

Without a calibration file the crossover is known only where both servers were seen at
neighbouring levels (levelspeeds.py); until then the static watermarks stay.

Memory. A server decodes at most the streams its KV pool holds, its cap (the router's server_caps:
pool over the tokens a stream holds with room for its next turn); from the cap up the curve is its
value at the cap, and a calibrated level whose throughput falls below a lower one's ran the pool dry
and is left out (held_at_capacity).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from .base import BASELINE, SPECULATIVE, Role, hysteresis_low, interpolate
from .levelspeeds import SpeedModel

Verdict = Literal["crosses", "never_pays", "always_pays", "no_data"]


@dataclass(frozen=True)
class Crossing:
    verdict: Verdict
    at: float | None = None


def crossing(
    levels: Sequence[float], spec: Sequence[float], base: Sequence[float], higher_is_better: bool = True
) -> Crossing:
    """The first level where speculation no longer beats the baseline, interpolated linearly."""
    points = [(c, s, b) for c, s, b in zip(levels, spec, base, strict=True) if not (math.isnan(s) or math.isnan(b))]
    if not points:
        return Crossing("no_data")
    sign = 1.0 if higher_is_better else -1.0
    adv = [(c, sign * (s - b)) for c, s, b in points]
    if adv[0][1] <= 0:
        return Crossing("never_pays", adv[0][0])
    for (c0, a0), (c1, a1) in itertools.pairwise(adv):
        if a1 <= 0:
            return Crossing("crosses", c0 + (c1 - c0) * a0 / (a0 - a1))
    return Crossing("always_pays", adv[-1][0])


def high_for(c: Crossing, levels: Sequence[int] = ()) -> int | None:
    """The high watermark a crossing calls for; None when nothing can be concluded.

    With `levels` (learning without a calibration, where a crossing's ends are only the lowest and
    highest levels both servers were seen at), a loss at the lowest seen level c0 says nothing
    below it: the watermark goes to the level under c0, not to 0. A win at the highest seen level
    lets it go one level further, so that the baseline gets seen higher up."""
    if c.verdict == "no_data" or c.at is None:
        return None
    if c.verdict == "never_pays":
        if levels and c.at > levels[0]:
            return max(lv for lv in levels if lv < c.at)
        return 0
    if c.verdict == "always_pays":
        if levels:
            return min((lv for lv in levels if lv > c.at), default=int(c.at))
        return int(c.at)
    return max(1, math.floor(c.at + 1e-9))  # 1e-9: curves rebuilt from per-stream speeds round off


@dataclass(frozen=True)
class Estimate:
    levels: tuple[int, ...]
    speculative_tok_s: tuple[float, ...]
    baseline_tok_s: tuple[float, ...]
    accept_live: float | None
    throughput: Crossing
    latency: Crossing
    crossover: float | None  # streams; None when nothing can be concluded
    high: int | None  # the watermarks the estimate calls for (None: nothing concluded)
    low: int | None
    why: str
    # TPOT (ms) the curves imply at each level (NaN: not measured).
    speculative_tpot: tuple[float, ...] = ()
    baseline_tpot: tuple[float, ...] = ()


def _watermarks_with_margin(
    levels: Sequence[int],
    curves: tuple[Sequence[float], Sequence[float], Sequence[float], Sequence[float]],
    margin: float,
    open_ends: Sequence[int],
) -> tuple[int | None, int | None]:
    """(high, low): leave speculation where the baseline is ahead by `margin` (throughput or TPOT),
    come back where speculation is ahead by it. Between the two the mode holds, so two servers
    within `margin` of each other do not pull traffic back and forth."""
    spec, base, tpot_spec, tpot_base = curves
    up = 1.0 + margin
    leave = (
        crossing(levels, [v * up for v in spec], base),
        crossing(levels, [t / up for t in tpot_spec], tpot_base, higher_is_better=False),
    )
    back = (
        crossing(levels, spec, [v * up for v in base]),
        crossing(levels, [t * up for t in tpot_spec], tpot_base, higher_is_better=False),
    )
    highs = [h for c in leave if (h := high_for(c, open_ends)) is not None]
    lows = [h for c in back if (h := high_for(c, open_ends)) is not None]
    if not highs:
        return None, None
    high = min(highs)
    return high, min(min(lows, default=high), hysteresis_low(high))


def held_at_capacity(
    levels: Sequence[int], tok_s: Sequence[float], tpot: Sequence[float], cap: int | None, grid: Sequence[int]
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """One server's calibrated throughput and TPOT on `grid`, where it holds at most `cap` streams
    (its KV pool over the context a stream holds now; None: unknown).

    With room in its pool a server's throughput never falls as streams are added (a step costs
    a + b*c, speedmodel.py); where a calibrated level's falls below a lower level's, the sweep ran
    the pool dry there (streams waited, or were retracted and prefilled again), and that level says
    nothing about the loads below it: it is left out. From the cap up the server does what it does
    at the cap, the rest of the streams waiting. Between the highest level kept (c1) and the cap,
    the step time (c / tok_s) runs on in a line through the two highest kept (c0, c1), never
    falling; with one level kept, throughput stays flat past it; without a cap, flat past the
    highest kept level. Below the lowest level, per-stream speed is the lowest level's. TPOT
    follows the step time."""
    keep: list[int] = []
    for i, x in enumerate(tok_s):
        if not keep or x >= tok_s[keep[-1]]:  # the last kept is the highest so far
            keep.append(i)
    ks = [levels[i] for i in keep]
    xs = [tok_s[i] for i in keep]
    ts = [tpot[i] for i in keep]

    def at(c: float) -> tuple[float, float]:
        if c < ks[0]:
            return xs[0] * c / ks[0], ts[0]
        if c <= ks[-1] or cap is None:
            return interpolate(ks, xs, c), interpolate(ks, ts, c)
        s1 = ks[-1] / xs[-1]
        slope = max(0.0, (s1 - ks[-2] / xs[-2]) / (ks[-1] - ks[-2])) if len(ks) >= 2 else s1 / ks[-1]
        s = s1 + slope * (c - ks[-1])
        return c / s, ts[-1] * s / s1

    points = [at(g if cap is None else min(g, cap)) for g in grid]
    return tuple(x for x, _ in points), tuple(t for _, t in points)


def estimate(
    model: SpeedModel,
    accept_live: float | None,
    now: float,
    margin: float = 0.0,
    source: str = "live",
    caps: Mapping[Role, int] | None = None,
) -> Estimate:
    """The two curves as believed now, their crossover, and the watermarks they call for. `source`
    says where the live acceptance was read, for `why`; `caps` the streams each role's server holds
    before its KV pool is full (held_at_capacity; calibrated curves only)."""
    prior = model.prior
    levels = model.levels
    if accept_live is not None:
        accept: list[float] = [accept_live] * len(levels)
    elif prior is not None:
        accept = list(prior.accept)  # no live reading: as calibrated
    else:
        accept = [1.0] * len(levels)
    spec = tuple(c * model.v(SPECULATIVE, i, now) * accept[i] for i, c in enumerate(levels))
    base = tuple(c * model.v(BASELINE, i, now) for i, c in enumerate(levels))
    tpot_spec = tpot_base = (math.nan,) * len(levels)
    if prior is not None:
        # TPOT scales inversely with speed: by the same acceptance and corrections as the curves.
        tpot_spec = tuple(
            t * prior.v_spec[i] * prior.accept[i] / (spec[i] / levels[i]) for i, t in enumerate(prior.tpot_spec)
        )
        tpot_base = tuple(t * prior.v_base[i] / (base[i] / levels[i]) for i, t in enumerate(prior.tpot_base))
        # Each cap is a level of its own: the curves bend there.
        caps = {r: c for r, c in (caps or {}).items() if c >= 1}
        grid = tuple(sorted({*levels, *(c for c in caps.values() if c < levels[-1])}))
        spec, tpot_spec = held_at_capacity(levels, spec, tpot_spec, caps.get(SPECULATIVE), grid)
        base, tpot_base = held_at_capacity(levels, base, tpot_base, caps.get(BASELINE), grid)
        levels = grid
    tp = crossing(levels, spec, base)
    lat = crossing(levels, tpot_spec, tpot_base, higher_is_better=False)
    open_ends = () if prior is not None else levels
    crossings = [
        c.at if c.verdict == "crosses" else float(h)
        for c in (tp, lat)
        if c.at is not None and (h := high_for(c, open_ends)) is not None
    ]
    crossover = min(crossings) if crossings else None
    high, low = _watermarks_with_margin(levels, (spec, base, tpot_spec, tpot_base), margin, open_ends)
    a = f"acceptance {accept_live:.2f} {source}" if accept_live is not None else "no live acceptance"
    if prior is not None and prior.accept:
        a += f" (calibrated {sum(prior.accept) / len(prior.accept):.2f})"
    if high is None or crossover is None:
        why = f"not enough observations of both servers at neighbouring loads yet; static watermarks ({a})"
    elif crossover == 0:
        why = f"speculation pays at no load measured ({a})"
    elif tp.verdict == "always_pays" and lat.verdict in ("always_pays", "no_data"):
        why = f"speculation pays up to the highest level known, {high} streams ({a})"
    else:
        why = f"speculation stops paying at about {crossover:.1f} streams ({a})"
    if high is not None and margin > 0:
        why += f"; {margin:.0%} margin: leave at {high}, come back at {low}"
    return Estimate(levels, spec, base, accept_live, tp, lat, crossover, high, low, why, tpot_spec, tpot_base)
