"""What the adaptive policy believes (`Adaptive`): each server's speeds by load (levelspeeds.py),
the estimate they give of where speculation stops paying (crossover.py), and the live watermarks
that follow. Pure arithmetic; the clock is passed in.

The watermarks move toward the estimate's at a bounded rate and stay in a clamped range.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .base import Curves, Role, hysteresis_low
from .calibration import Calibration
from .crossover import Estimate, estimate
from .levelspeeds import Prior, SpeedModel


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
