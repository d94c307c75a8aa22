"""Where speculation stops paying, re-estimated from what specgate sees live. Pure arithmetic; the
clock is passed in.

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
loads traffic actually visits. The crossover is the first level where the speculative curve no
longer beats the baseline (and, as `loadtest calibrate` does, where its TPOT no longer beats the
baseline's, when the file has TPOT curves); the high watermark is its floor, the low one a band
of a quarter below (calibrate's rule). At the calibrated acceptance and with no observations this
gives exactly the calibration's recommendation.

Observations are robust and forgetful: each is a log ratio to the current estimate at the
nearest level, clipped (a few outliers move it little), averaged with weights that halve every
`half_life_s` (old traffic fades), shrunk toward the calibration by a prior of PRIOR_WEIGHT
observations, and the resulting correction is bounded to [1/MAX_CORRECTION, MAX_CORRECTION]. A
level's correction also draws on what the same server showed at the other levels, each of their
observations counting sqrt(c_low / c_high) of one (half at four times the load, an eighth at 64
times):

    log k(c) = sum_l s(c, l) W_l m_l / (sum_l s(c, l) W_l + PRIOR_WEIGHT)      s(c, l) = sqrt(min/max)

W_l and m_l the decayed weight and mean log ratio seen at level l. A server slower than its
calibration at one load (a busier host, another model revision) is slower at its neighbours too, and
a server is seen only at the loads its mode gives it: the baseline of a pair at the high ones. With
each level on its own, the levels it was never seen at kept the calibration's speed; measured on the
simulated H200 (1k-token chats at 128 sessions, both servers running at half their calibrated
speed: the benchmark had handed over a calibration made at another simulated time scale), the
baseline seen at 64 streams only and the speculative server at 16 and 64, the curves crossed at 9
streams, where with this rule they cross at 104 (the calibration's own crossing is near 100). A
server never seen at any load keeps its calibration.
Without a calibration file there is no prior: levels are fixed buckets, estimates are what was
observed, and the crossover is known only where both servers were seen at neighbouring levels;
until then the static watermarks stay.

Memory. A server decodes at most the streams its KV pool holds, its cap (the router's server_caps:
pool over the tokens a stream holds with room for its next turn); from the cap up the curve is its
value at the cap, and a calibrated level whose throughput falls below a lower one's ran the pool dry
and is left out (held_at_capacity).

The watermark then moves toward the estimate at a bounded rate and stays in a clamped range.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from .base import BASELINE, ROLES, SPECULATIVE, Curves, Role, hysteresis_low, interpolate
from .calibration import Calibration

# Without a calibration, observations go to the nearest of these levels (streams on one server).
BUCKETS: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 64, 80, 96, 128, 160, 192, 256)
PRIOR_WEIGHT = 3.0  # the calibration counts as this many observations
MAX_CORRECTION = 2.0  # observed speed vs calibration, bounded to [1/2, 2]
CLIP_LOG = 0.35  # one observation moves a level's estimate by at most ~40% of the way
MIN_WEIGHT_NO_PRIOR = 3.0  # without a calibration, a level counts after this many observations
MIN_STREAM_EVENTS = 4  # a stream's acceptance is read from at least this many content events


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
class Prior:
    """The calibration as the model uses it: per-stream speeds per level (speculative per unit of
    acceptance), and TPOT in ms (NaN where not measured)."""

    levels: tuple[int, ...]
    v_spec: tuple[float, ...]
    v_base: tuple[float, ...]
    tpot_spec: tuple[float, ...]
    tpot_base: tuple[float, ...]
    accept: tuple[float, ...]  # acceptance at each level (1.0 where the file has none)

    @functools.cached_property
    def tok_s_spec(self) -> tuple[float, ...]:
        """Throughput per unit of acceptance at each level."""
        return tuple(v * c for v, c in zip(self.v_spec, self.levels, strict=True))

    @functools.cached_property
    def tok_s_base(self) -> tuple[float, ...]:
        return tuple(v * c for v, c in zip(self.v_base, self.levels, strict=True))

    @classmethod
    def of(cls, cal: Calibration) -> Prior:
        accept = tuple(cal.accept_at(i) or 1.0 for i in range(len(cal.levels)))
        return cls(
            levels=cal.levels,
            v_spec=tuple(s / c / a for s, c, a in zip(cal.speculative.output_tok_s, cal.levels, accept, strict=True)),
            v_base=tuple(b / c for b, c in zip(cal.baseline.output_tok_s, cal.levels, strict=True)),
            tpot_spec=cal.speculative.mean_tpot_ms,
            tpot_base=cal.baseline.mean_tpot_ms,
            accept=accept,
        )


@dataclass
class _Cell:
    """Observations at one level of one server: a decayed weighted mean of log values."""

    mean: float = 0.0
    weight: float = 0.0
    at: float = 0.0

    def decayed(self, now: float, half_life_s: float) -> float:
        return self.weight * math.exp(-math.log(2.0) * max(0.0, now - self.at) / half_life_s)


@dataclass
class SpeedModel:
    """Per-stream decode speeds learnt from relayed streams, on top of an optional prior."""

    prior: Prior | None
    half_life_s: float = 60.0
    cells: dict[Role, dict[int, _Cell]] = field(default_factory=dict)
    observations: int = 0

    def __post_init__(self) -> None:
        self.cells = {b: {} for b in ROLES}

    @property
    def levels(self) -> tuple[int, ...]:
        return self.prior.levels if self.prior is not None else BUCKETS

    def prior_v(self, backend: Role, c: float) -> float | None:
        p = self.prior
        if p is None:
            return None
        v = p.v_spec if backend == SPECULATIVE else p.v_base
        if c <= p.levels[0]:
            return v[0]
        # Between levels the throughput is what runs straight, not the per-stream speed: where
        # throughput flattens, per-stream speed falls as 1/c, and a line between two levels' speeds
        # expects 35-40% too much halfway from 64 to 256 streams. Past the last level, flat.
        tok_s = p.tok_s_spec if backend == SPECULATIVE else p.tok_s_base
        return interpolate(p.levels, tok_s, c) / c

    def _nearest(self, c: float) -> int:
        # On a log scale: speed changes with the ratio of loads, not their difference.
        return min(self.levels, key=lambda lv: abs(math.log(lv) - math.log(max(c, 1.0))))

    def observe(self, backend: Role, load: float, tok_s: float, accept: float | None, now: float) -> None:
        """One stream's decode speed (tokens/s after its first) while `load` streams ran on the
        server; `accept` the speculative server's acceptance then (None: unknown)."""
        if not (tok_s > 0 and math.isfinite(tok_s) and load >= 1):
            return
        v = tok_s / (accept or 1.0) if backend == SPECULATIVE else tok_s
        prior = self.prior_v(backend, load)
        x = math.log(v / prior) if prior is not None else math.log(v)
        level = self._nearest(load)
        cell = self.cells[backend].setdefault(level, _Cell(at=now))
        w = cell.decayed(now, self.half_life_s)
        if w >= 1.0 or prior is not None:
            centre = cell.mean if w > 0 else 0.0
            x = min(max(x, centre - CLIP_LOG), centre + CLIP_LOG)
        cell.mean = (cell.mean * w + x) / (w + 1.0)
        cell.weight, cell.at = w + 1.0, now
        self.observations += 1

    def correction(self, backend: Role, level: int, now: float) -> tuple[float, float]:
        """(log correction vs the prior, the decayed weight behind it) at a level: its own
        observations' and, at sqrt(c_low / c_high) of theirs, every other level's (the module's
        rule); (0, 0) when the server was seen nowhere."""
        total = weighted = 0.0
        for at, cell in self.cells[backend].items():
            w = cell.decayed(now, self.half_life_s)
            if at != level:
                w *= math.sqrt(min(at, level) / max(at, level))
            total += w
            weighted += w * cell.mean
        if total <= 0.0:
            return 0.0, 0.0
        shrunk = weighted / (total + PRIOR_WEIGHT)
        bound = math.log(MAX_CORRECTION)
        return min(max(shrunk, -bound), bound), total

    def v(self, backend: Role, i: int, now: float) -> float:
        """Per-stream speed at the i-th level (speculative: per unit of acceptance); NaN if unknown."""
        level = self.levels[i]
        if self.prior is not None:
            base = self.prior.v_spec[i] if backend == SPECULATIVE else self.prior.v_base[i]
            return base * math.exp(self.correction(backend, level, now)[0])
        cell = self.cells[backend].get(level)
        if cell is None or cell.decayed(now, self.half_life_s) < MIN_WEIGHT_NO_PRIOR:
            return math.nan
        return math.exp(cell.mean)

    def describe(self, now: float) -> dict[str, dict[str, dict[str, float]]]:
        out: dict[str, dict[str, dict[str, float]]] = {}
        for b in ROLES:
            out[b] = {}
            for level, cell in sorted(self.cells[b].items()):
                w = cell.decayed(now, self.half_life_s)
                if w < 0.05:
                    continue
                if self.prior is not None:
                    ratio = math.exp(self.correction(b, level, now)[0])
                    out[b][str(level)] = {"speed_ratio": round(ratio, 4), "weight": round(w, 2)}
                else:
                    out[b][str(level)] = {"tok_s_per_stream": round(math.exp(cell.mean), 3), "weight": round(w, 2)}
        return out


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


def stream_accept(tokens: int, events: int) -> float | None:
    """Acceptance length of one stream from its output tokens and content events, for engines that
    send one event per decode step; None below MIN_STREAM_EVENTS events. The first and last events
    are short of a full step (SGLang's first token comes from prefill; the last step is cut by
    max_tokens or a stop), so one event and one token are set aside: exact at acceptance 1, and
    within about 10% on a 16-token shadow probe either way."""
    if events < MIN_STREAM_EVENTS or tokens < events:
        return None
    return (tokens - 1) / (events - 1)


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


@dataclass(frozen=True)
class WatermarkState:
    """The live watermarks as real numbers (moved at a bounded rate) and when they last moved."""

    high: float
    low: float
    at: float


def step_watermark(
    state: WatermarkState, target: tuple[int, int], now: float, max_step_per_s: float, lo: int, hi: int
) -> WatermarkState:
    """Move toward `target` (high, low) by at most max_step_per_s per second since the last step,
    within [lo, hi]."""
    room = max_step_per_s * max(0.0, now - state.at)

    def move(value: float, to: int) -> float:
        moved = value + min(max(to - value, -room), room)
        return min(max(moved, float(lo)), float(hi))

    return WatermarkState(move(state.high, target[0]), move(state.low, target[1]), now)


def watermarks(state: WatermarkState) -> tuple[int, int]:
    high = round(state.high)
    return high, min(round(state.low), hysteresis_low(high))


# The adaptive estimate is recomputed at most this often (health polls and finished streams ask).
UPDATE_EVERY_S = 0.25
# A reading of acceptance this much (relative) off the last one restarts the probes' back-off.
ACCEPT_CHANGE = 0.1


@dataclass(frozen=True, kw_only=True)
class AdaptiveConfig:
    """The adaptive policy's parameters, built by `Settings.adaptive_config` (which owns every
    default)."""

    min_watermark: int
    max_watermark: int
    max_step_per_s: float
    half_life_s: float
    # A probe session lasts until this many output tokens came back from the speculative server.
    probe_tokens: int
    # Leave speculation where the baseline is ahead by this share, come back where speculation
    # is: two servers this close do not pull traffic back and forth.
    margin: float
    # Prompt tokens a second a server prefills: what a paired group's switch costs (adaptive.py).
    prefill_tok_s: float
    # Seconds ahead a paired group's cap on speculation is read, at the footprint's growth over as
    # many past ones (routing/capacity.py); 0: the footprint as it is.
    kv_forecast_s: float


class Adaptive:
    """What the adaptive policy believes, and the live watermarks that follow from it."""

    def __init__(
        self, cfg: AdaptiveConfig, calibration: Calibration | None, static: tuple[int, int], now: float
    ) -> None:
        self.cfg = cfg
        self.model = SpeedModel(Prior.of(calibration) if calibration else None, cfg.half_life_s)
        self.static_high, self.static_low = static
        self.estimate: Estimate = estimate(self.model, None, now, cfg.margin)
        self.accept_source = "live"
        # Streams each role's server holds before its KV pool is full, as the router last read them.
        self.caps: dict[Role, int] = {}
        high, low = self._target()
        self.wm = WatermarkState(self._clamp(high), self._clamp(low), now)
        self.updated_at = now

    def _target(self) -> tuple[int, int]:
        e = self.estimate
        if e.high is None or e.low is None:
            return self.static_high, self.static_low
        return e.high, e.low

    def _clamp(self, high: int) -> float:
        return float(min(max(high, self.cfg.min_watermark), self.cfg.max_watermark))

    def watermarks(self) -> tuple[int, int]:
        """(high, low) in effect."""
        return watermarks(self.wm)

    def curves(self) -> Curves | None:
        """The estimate's curves at the levels where both are known (None: at none)."""
        e = self.estimate
        if e.high is None or e.crossover is None:
            return None  # the curves conclude nothing yet: no switch is priced on them
        points = [
            (c, s, b, ts, tb)
            for c, s, b, ts, tb in zip(
                e.levels, e.speculative_tok_s, e.baseline_tok_s, e.speculative_tpot, e.baseline_tpot, strict=True
            )
            if math.isfinite(s) and math.isfinite(b)
        ]
        if not points:
            return None
        levels, spec, base, t_spec, t_base = zip(*points, strict=True)
        if not all(math.isfinite(t) for t in (*t_spec, *t_base)):
            t_spec = t_base = ()  # TPOT unmeasured at some level: throughput alone
        return Curves(tuple(map(float, levels)), spec, base, t_spec, t_base)

    def watermarks_at(self, accept: float, now: float) -> tuple[int, int] | None:
        """(high, low) the curves as believed now call for at acceptance `accept` (a traffic
        class's), in the live watermarks' range; None where they conclude nothing. The estimate's
        target, not moved at a bounded rate: a class's acceptance is a slow decayed mean already."""
        e = estimate(self.model, accept, now, self.cfg.margin, caps=self.caps)
        if e.high is None or e.low is None:
            return None
        high = int(self._clamp(e.high))
        return high, min(max(e.low, 0), hysteresis_low(high))

    def update(
        self, accept_live: float | None, now: float, source: str = "live", caps: Mapping[Role, int] | None = None
    ) -> bool:
        """Re-estimate and move the watermark; True when the watermarks in effect changed. `caps`:
        each role's streams per server before its KV pool is full, where known (kept until the
        next)."""
        before = self.watermarks()
        if caps is not None:
            self.caps = dict(caps)
        self.estimate = estimate(self.model, accept_live, now, self.cfg.margin, source, self.caps)
        self.accept_source = source
        self.wm = step_watermark(
            self.wm, self._target(), now, self.cfg.max_step_per_s, self.cfg.min_watermark, self.cfg.max_watermark
        )
        self.updated_at = now
        return self.watermarks() != before

    def describe(self, now: float) -> dict[str, Any]:
        e = self.estimate

        def rounded(values: tuple[float, ...]) -> list[float | None]:
            return [None if math.isnan(v) else round(v, 2) for v in values]

        prior = self.model.prior
        high, low = self.watermarks()
        return {
            "calibrated": prior is not None,
            "accept_length_live": e.accept_live,
            # "live": the engine's metrics; "from probe streams": tokens per decode step of probes.
            "accept_length_source": self.accept_source,
            "accept_length_calibrated": list(prior.accept) if prior is not None else None,
            "crossover_estimate": e.crossover,
            "throughput_verdict": e.throughput.verdict,
            "latency_verdict": e.latency.verdict,
            "target_watermarks": dict(zip(("high", "low"), self._target(), strict=True)),
            "watermarks_exact": {"high": round(self.wm.high, 3), "low": round(self.wm.low, 3)},
            "watermarks": {"high": high, "low": low},
            "why": e.why,
            "curves": {
                "levels": list(e.levels),
                "speculative_tok_s": rounded(e.speculative_tok_s),
                "baseline_tok_s": rounded(e.baseline_tok_s),
            },
            "kv_capacity_streams": {str(r): c for r, c in self.caps.items()},
            "observations": self.model.observations,
            "observed": self.model.describe(now),
            "settings": dataclasses.asdict(self.cfg),
        }
