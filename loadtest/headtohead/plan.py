"""headtohead's settings: the plan of a run, the time scale of each level and the SLOs converted to
wall-clock time (the multi-turn sizes that give a cell its mean context: kit.multiturn)."""

from __future__ import annotations

from dataclasses import dataclass

from ..classes import Slo
from ..kit.multiturn import (
    CALIBRATE_LEVELS,
    MAX_TIME_SCALE,
    PROFILE,
    Sizes,
    check_stagger,
    default_time_scale,
    multiturn_spec,
    sizes_for,
)
from ..procs import pair_args, simulator_args
from ..stats import DEFAULT_MIN_REQUESTS
from ..workload import WorkloadSpec

TARGETS = ("baseline", "adaptive", "specgate")
# A calibration's window, in simulated seconds. It drives one server at a time, not three: its time
# scale is CALIBRATION_SPEEDUP times the cells' at its top level (CALIBRATE_LEVELS).
CALIBRATE_WINDOW_S = 2.0
CALIBRATION_SPEEDUP = 2.0


@dataclass(frozen=True)
class HeadPlan:
    accept_lengths: tuple[float, ...] = (1.5, 2.5)
    contexts: tuple[int, ...] = (1000, 8000)
    sessions: tuple[int, ...] = (1, 4, 16, 64, 256)
    # One for every cell, or one per level; empty: default_time_scale of each cell.
    time_scales: tuple[float, ...] = ()
    turns: int = 4
    max_tokens: int = 128
    think_time_s: float = 0.5  # simulated seconds
    # Each stream's first session starts this far in at most (0: all at once, as in the results of
    # docs/benchmarks/2026-12-04-headtohead.md).
    stagger_s: float = 0.0  # simulated seconds
    window_s: float = 6.0  # simulated seconds
    max_window_s: float = 60.0  # simulated seconds
    slo_ttft_ms: float = 2000.0  # simulated
    slo_tpot_ms: float = 100.0  # simulated
    spec_steps: int = 3
    # None: CALIBRATION_SPEEDUP times the cells' default at the top calibration level.
    calibration_time_scale: float | None = None
    seed: int = 0
    min_requests: int = DEFAULT_MIN_REQUESTS
    profile: str = PROFILE

    def __post_init__(self) -> None:
        if self.time_scales and len(self.time_scales) not in (1, len(self.sessions)):
            raise ValueError("--time-scale: one value, or one per --sessions level")
        if any(t <= 0 for t in self.time_scales) or (self.calibration_time_scale or 1.0) <= 0:
            raise ValueError("time scales must be positive")
        if not 0 < self.window_s <= self.max_window_s:
            raise ValueError("--window-s must be positive and at most --max-window-s")
        check_stagger(self.stagger_s)
        for c in self.contexts:
            self.sizes(c)  # raises where a context cannot be built

    def sizes(self, context: int) -> Sizes:
        return sizes_for(context, self.turns, self.max_tokens)

    @property
    def calibration_levels(self) -> tuple[int, ...]:
        top = max(self.sessions)
        return tuple(x for x in CALIBRATE_LEVELS if x <= top) or tuple(sorted(set(self.sessions)))

    def time_scale(self, sessions: int, context: int) -> float:
        """A cell's time scale: --time-scale's (one, or the level's), else default_time_scale."""
        if not self.time_scales:
            return round(default_time_scale(sessions, context), 4)
        if len(self.time_scales) == 1:
            return self.time_scales[0]
        return self.time_scales[self.sessions.index(sessions)]

    def calibration_scale(self, context: int) -> float:
        if self.calibration_time_scale is not None:
            return self.calibration_time_scale
        top = max(self.calibration_levels)
        return round(min(MAX_TIME_SCALE, CALIBRATION_SPEEDUP * default_time_scale(top, context)), 4)

    def wall_slo(self, sessions: int, context: int) -> Slo:
        """The SLOs in wall-clock ms at the cell's time scale (a simulated ms lasts 1/T of them)."""
        t = self.time_scale(sessions, context)
        return Slo(ttft_ms=self.slo_ttft_ms / t, tpot_ms=self.slo_tpot_ms / t)

    def workload(self, context: int, sessions: int) -> WorkloadSpec:
        """The cell's sessions (kit.multiturn.multiturn_spec), think times in wall seconds."""
        t = self.time_scale(sessions, context)
        return multiturn_spec(self.sizes(context), self.seed, sessions, t, self.think_time_s, self.stagger_s)

    def common_flags(self, accept: float, time_scale: float) -> list[str]:
        return [
            "--profile", self.profile, "--enable-cache-report", "--accept-length", f"{accept:g}",
            "--spec-steps", str(self.spec_steps), "--time-scale", f"{time_scale:g}",
        ]  # fmt: skip

    def server_args(self, role: str, port: int, accept: float, time_scale: float) -> list[str]:
        """One server alone on its own simulated GPU (the whole GPU's KV pool)."""
        return simulator_args(role, port, *self.common_flags(accept, time_scale))

    def pair_args(self, accept: float, time_scale: float, spec_port: int, base_port: int) -> list[str]:
        """The pair on one simulated GPU, each with its share of the memory and compute."""
        return pair_args(spec_port, base_port, *self.common_flags(accept, time_scale))
