"""Each server's per-stream decode speed at each level of load (the speculative server's per unit
of acceptance): the calibration's, corrected by what relayed streams show. What the adaptive
curves are built from (crossover.py). Pure arithmetic; the clock is passed in.

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
Without a calibration file there is no prior: levels are fixed buckets (BUCKETS), and estimates
are what was observed.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

from .base import ROLES, SPECULATIVE, Role, interpolate
from .calibration import Calibration

# Without a calibration, observations go to the nearest of these levels (streams on one server).
BUCKETS: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 64, 80, 96, 128, 160, 192, 256)
PRIOR_WEIGHT = 3.0  # the calibration counts as this many observations
MAX_CORRECTION = 2.0  # observed speed vs calibration, bounded to [1/2, 2]
CLIP_LOG = 0.35  # one observation moves a level's estimate by at most ~40% of the way
MIN_WEIGHT_NO_PRIOR = 3.0  # without a calibration, a level counts after this many observations


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
