"""Where speculation stops paying, and the watermarks that follow from it. Pure functions."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

Verdict = Literal["crosses", "never_pays", "always_pays", "no_data"]


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
    """The first level where speculation no longer beats the baseline, interpolated linearly."""
    points = [
        (c, s, b) for c, s, b in zip(levels, speculative, baseline, strict=True) if not (math.isnan(s) or math.isnan(b))
    ]
    if not points:
        return Crossover(metric, "no_data")
    sign = 1.0 if higher_is_better else -1.0
    adv = [(c, sign * (s - b)) for c, s, b in points]
    if adv[0][1] <= 0:
        return Crossover(metric, "never_pays")
    for (c0, a0), (c1, a1) in itertools.pairwise(adv):
        if a1 <= 0:
            return Crossover(metric, "crosses", c0 + (c1 - c0) * a0 / (a0 - a1))
    return Crossover(metric, "always_pays")


@dataclass(frozen=True)
class Recommendation:
    high: int
    low: int
    verdict: Verdict
    explanation: str

    def env_lines(self) -> str:
        return f"SPECGATE_POLICY=threshold\nSPECGATE_HIGH_WATERMARK={self.high}\nSPECGATE_LOW_WATERMARK={self.low}\n"


def hysteresis_low(high: int) -> int:
    """A band of a quarter of the high watermark (at least one request) keeps the mode from flapping."""
    return max(0, high - max(1, math.ceil(high / 4)))


def recommend(throughput: Crossover, latency: Crossover, max_level: int) -> Recommendation:
    """Speculate only where it pays on both counts: below the earlier of the two crossovers."""
    verdicts = {throughput.verdict, latency.verdict}
    if "no_data" in verdicts:
        return Recommendation(16, 8, "no_data", "Not enough successful requests to compare the servers.")
    if "never_pays" in verdicts:
        which = "throughput" if throughput.verdict == "never_pays" else "per-request latency (TPOT)"
        return Recommendation(
            0,
            0,
            "never_pays",
            f"Speculation never paid: the baseline was ahead on {which} from the lowest level measured. "
            "Send everything to the baseline (a high watermark of 0 does that).",
        )
    crossings = [c.at for c in (throughput, latency) if c.verdict == "crosses" and c.at is not None]
    if not crossings:
        return Recommendation(
            max_level,
            hysteresis_low(max_level),
            "always_pays",
            f"Speculation paid at every level measured, up to {max_level} concurrent streams. Measure higher "
            "levels before raising the high watermark further.",
        )
    at = min(crossings)
    high = max(1, math.floor(at))
    return Recommendation(
        high,
        hysteresis_low(high),
        "crosses",
        f"Speculation stops paying at about {at:.1f} concurrent streams; new requests go to the baseline "
        f"from {high} in flight and return to speculation at {hysteresis_low(high)}.",
    )
