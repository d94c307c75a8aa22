"""shift's settings: the plan of a run, its targets and the specgates' environment."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from proxy.config import DEPRECATED, Settings

from ..kit.settings import specgate_env as base_env
from ..procs import pair_args
from ..stats import DEFAULT_MIN_REQUESTS

TARGETS = ("speculative", "baseline", "static", "adaptive")
SPECGATES = ("static", "adaptive")
SERVERS = ("speculative", "baseline")
POLICIES = {"static": "threshold", "adaptive": "adaptive"}

RATIO_TARGET = 0.95  # a specgate's share of the better server's throughput, once settled
TIE = 0.05  # servers closer than this: either meets the target, so no mode is "the" right one
STEADY_TOLERANCE = 0.02  # without a shift: adaptive at most this far below static
SETTLE_TARGET_S = 30.0  # at time scale 1
ROLLING_S = 10.0  # window of the rolling throughput and of the settle test, at time scale 1
SAMPLE_S = 0.5  # /routing sampling period, at time scale 1
MIN_SAMPLE_S = 0.05  # ... but never faster than this in wall seconds
FIDELITY_WARN = 0.90  # the baseline alone below this share of its profile's throughput: CPU-starved
CALIBRATE_LEVELS = (1, 2, 5, 10, 20, 30, 50, 70)
CALIBRATE_DURATION_S = 30.0  # per level, at time scale 1
# Specgate's time settings (seconds at time scale 1, divided by the time scale) and rates
# (multiplied by it); watermarks and probe tokens are counts and stay. Defaults: proxy/config.py.
SCALED_DOWN = ("min_dwell_s", "half_life_s", "probe_s", "probe_max_s")
SCALED_UP = ("max_step_per_s",)
UNSCALED = ("min_watermark", "max_watermark", "probe_tokens", "shadow_tokens")  # counts
ADAPTIVE_SETTINGS = SCALED_DOWN + SCALED_UP + UNSCALED


@dataclass(frozen=True)
class ShiftPlan:
    profile: str = "crossover"
    levels: tuple[int, ...] = (10, 30)
    phases: tuple[str, ...] = ("repetitive", "diverse", "repetitive")
    phase_s: float = 60.0
    settle_s: float = 30.0
    time_scale: float = 1.0
    max_tokens: int = 128
    seed: int = 0
    min_requests: int = DEFAULT_MIN_REQUESTS
    # Adaptive settings at time scale 1 that replace proxy/config.py's defaults (see ADAPTIVE_SETTINGS).
    adaptive: Mapping[str, float] = field(default_factory=dict)

    @property
    def rolling_s(self) -> float:
        return ROLLING_S / self.time_scale

    @property
    def sample_s(self) -> float:
        return max(SAMPLE_S / self.time_scale, MIN_SAMPLE_S)

    @property
    def settle_target_s(self) -> float:
        return SETTLE_TARGET_S / self.time_scale

    @property
    def shifting(self) -> bool:
        return len(set(self.phases)) > 1

    @property
    def duration_s(self) -> float:
        return len(self.phases) * self.phase_s

    def pair_args(self, spec_port: int, base_port: int) -> list[str]:
        flags = ["--profile", self.profile, "--accept-from-prompt", "--time-scale", f"{self.time_scale:g}"]
        return pair_args(spec_port, base_port, *flags)


def adaptive_settings(plan: ShiftPlan) -> dict[str, float]:
    """The adaptive settings at time scale 1: specgate's defaults, with the plan's overrides."""
    out: dict[str, float] = {}
    for name in ADAPTIVE_SETTINGS:
        default = Settings.model_fields[f"adaptive_{name}"].default
        out[name] = float(plan.adaptive.get(name, default))
    return out


def specgate_env(
    policy: str, spec_url: str, base_url: str, port: int, calibration: str, plan: ShiftPlan
) -> dict[str, str]:
    """Specgate's environment for one target, its time settings scaled to the simulators' clock."""
    t = plan.time_scale
    env = base_env(port, spec_url, base_url, t, policy=policy, calibration=calibration)
    if policy == "adaptive":
        for name, value in adaptive_settings(plan).items():
            if f"adaptive_{name}" in DEPRECATED and name not in plan.adaptive:
                continue  # its default, unsaid: setting it would be warned about
            scaled = value / t if name in SCALED_DOWN else value * t if name in SCALED_UP else value
            env[f"SPECGATE_ADAPTIVE_{name.upper()}"] = f"{int(scaled)}" if name in UNSCALED else f"{scaled:g}"
    return env
