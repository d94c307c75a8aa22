"""Where speculation stops paying, and the watermarks that follow from it. Pure functions.

Only conclusive levels count: one where either server had too few good requests (see
stats.min_ok_requests) is left out as if it had not been measured, and the recommendation names it.
`calibration_file` makes what `calibrate --save` writes (format: proxy/calibration.py).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from proxy.adaptive import Verdict, crossing, hysteresis_low
from proxy.calibration import Calibration, Curve

from .stats import LevelStats


@dataclass(frozen=True)
class Crossover:
    metric: str
    verdict: Verdict
    # Interpolated concurrency where the speculative advantage reaches zero ("crosses" only).
    at: float | None = None


def find_crossover(
    metric: str,
    levels: Sequence[int],
    speculative: Sequence[float],
    baseline: Sequence[float],
    higher_is_better: bool = True,
) -> Crossover:
    """The first level where speculation no longer beats the baseline, interpolated linearly
    (the arithmetic specgate's adaptive policy uses too)."""
    c = crossing(levels, speculative, baseline, higher_is_better)
    return Crossover(metric, c.verdict, c.at if c.verdict == "crosses" else None)


@dataclass(frozen=True)
class Recommendation:
    high: int
    low: int
    verdict: Verdict
    explanation: str
    # Levels left out because a server had too few good requests there.
    inconclusive_levels: tuple[int, ...] = ()

    def env_lines(self) -> str:
        return f"SPECGATE_POLICY=threshold\nSPECGATE_HIGH_WATERMARK={self.high}\nSPECGATE_LOW_WATERMARK={self.low}\n"


def _levels_text(levels: Sequence[int]) -> str:
    return ", ".join(str(c) for c in levels)


def recommend(
    throughput: Crossover, latency: Crossover, max_level: int, inconclusive: Sequence[int] = ()
) -> Recommendation:
    """Speculate only where it pays on both counts: below the earlier of the two crossovers.

    `max_level` is the highest level the crossovers were found from; `inconclusive` the levels
    they were not, for want of good requests.
    """
    left_out = tuple(inconclusive)
    note = (
        f" Left out for too few good requests: {_levels_text(left_out)} concurrent streams; measure them again "
        "(a longer --duration-s, or see their errors) before trusting the watermarks near them."
        if left_out
        else ""
    )
    verdicts = {throughput.verdict, latency.verdict}
    if "no_data" in verdicts:
        if left_out:
            why = (
                f"No level had enough good requests on both servers to conclude anything (too few at "
                f"{_levels_text(left_out)} concurrent streams). Measure again with a longer --duration-s, or "
                "look at the errors; specgate's default watermarks stay until then."
            )
        else:
            why = "Not enough successful requests to compare the servers."
        return Recommendation(16, 8, "no_data", why, left_out)
    if "never_pays" in verdicts:
        which = "throughput" if throughput.verdict == "never_pays" else "per-request latency (TPOT)"
        return Recommendation(
            0,
            0,
            "never_pays",
            f"Speculation never paid: the baseline was ahead on {which} from the lowest level measured. "
            "Send everything to the baseline (a high watermark of 0 does that)." + note,
            left_out,
        )
    crossings = [c.at for c in (throughput, latency) if c.verdict == "crosses" and c.at is not None]
    if not crossings:
        return Recommendation(
            max_level,
            hysteresis_low(max_level),
            "always_pays",
            f"Speculation paid at every level measured, up to {max_level} concurrent streams. Measure higher "
            "levels before raising the high watermark further." + note,
            left_out,
        )
    at = min(crossings)
    high = max(1, math.floor(at))
    return Recommendation(
        high,
        hysteresis_low(high),
        "crosses",
        f"Speculation stops paying at about {at:.1f} concurrent streams; new requests go to the baseline "
        f"from {high} in flight and return to speculation at {hysteresis_low(high)}." + note,
        left_out,
    )


def inconclusive_levels(*sweeps: Sequence[LevelStats]) -> tuple[int, ...]:
    """Levels at which any of the sweeps (aligned level by level) had too few good requests."""
    return tuple(rows[0].concurrency for rows in zip(*sweeps, strict=True) if not all(r.conclusive for r in rows))


def crossovers(speculative: Sequence[LevelStats], baseline: Sequence[LevelStats]) -> tuple[Crossover, Crossover]:
    """Throughput and TPOT crossovers from the levels both servers measured conclusively."""
    levels = [s.concurrency for s in speculative]
    keep = [s.conclusive and b.conclusive for s, b in zip(speculative, baseline, strict=True)]

    def values(rows: Sequence[LevelStats], name: str) -> list[float]:
        # NaN is find_crossover's "not measured".
        return [float(getattr(r, name)) if k else math.nan for r, k in zip(rows, keep, strict=True)]

    tp = find_crossover("output_tok_s", levels, values(speculative, "output_tok_s"), values(baseline, "output_tok_s"))
    lat = find_crossover(
        "mean_tpot_ms",
        levels,
        values(speculative, "mean_tpot_ms"),
        values(baseline, "mean_tpot_ms"),
        higher_is_better=False,
    )
    return tp, lat


def calibrate(
    speculative: Sequence[LevelStats], baseline: Sequence[LevelStats]
) -> tuple[Crossover, Crossover, Recommendation]:
    """The crossovers and the watermarks, from conclusive levels only."""
    tp, lat = crossovers(speculative, baseline)
    left_out = inconclusive_levels(speculative, baseline)
    measured = [s.concurrency for s in speculative if s.concurrency not in left_out]
    return tp, lat, recommend(tp, lat, max(measured, default=0), left_out)


def calibration_file(
    speculative: Sequence[LevelStats],
    baseline: Sequence[LevelStats],
    rec: Recommendation,
    accept_by_level: Mapping[int, float | None],
    settings: Mapping[str, Any],
    created: str,
) -> Calibration:
    """The reusable calibration: both servers' curves over the levels both measured conclusively (a
    level without a positive throughput on either is left out too), the speculative server's
    acceptance at each (NaN where it reported none) and their mean, and the recommendation as made.
    Raises ValueError when no level is left: there are no curves to write."""

    def usable(r: LevelStats) -> bool:
        return r.conclusive and math.isfinite(r.output_tok_s) and round(r.output_tok_s, 2) > 0

    keep = [(s, b) for s, b in zip(speculative, baseline, strict=True) if usable(s) and usable(b)]
    if not keep:
        raise ValueError("no level was conclusive on both servers: no curves to save")
    levels = tuple(s.concurrency for s, _ in keep)

    # Rounded well below what a level can measure, so the file reads easily.
    def curve(rows: Sequence[LevelStats], accept: tuple[float, ...] = ()) -> Curve:
        tok_s = tuple(round(r.output_tok_s, 2) for r in rows)
        tpot = tuple(round(r.mean_tpot_ms, 4) if math.isfinite(r.mean_tpot_ms) else math.nan for r in rows)
        return Curve(tok_s, tuple(t if t > 0 else math.nan for t in tpot), accept)

    raw = [accept_by_level.get(c) for c in levels]
    accept = tuple(math.nan if a is None else round(a, 3) for a in raw)
    measured = [a for a in accept if not math.isnan(a)]
    return Calibration(
        levels=levels,
        speculative=curve([s for s, _ in keep], accept),
        baseline=curve([b for _, b in keep]),
        accept_length=round(math.fsum(measured) / len(measured), 3) if measured else None,
        high_watermark=rec.high,
        low_watermark=rec.low,
        verdict=rec.verdict,
        explanation=rec.explanation,
        inconclusive_levels=tuple(s.concurrency for s in speculative if s.concurrency not in levels),
        settings=dict(settings),
        created=created,
    )
