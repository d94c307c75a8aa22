"""scaleout's settings: the plan of a run, its configurations, servers and the replicas' environment."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from proxy.policy.calibration import CalibrationError
from proxy.policy.calibration import load as load_calibration

from ..kit.settings import MIN_SCRAPE_INTERVAL_S, specgate_env
from ..procs import pair_args
from ..stats import DEFAULT_MIN_REQUESTS

Topology = Literal["paired", "pooled"]
Role = Literal["speculative", "baseline"]
Spread = Literal["request", "worker"]
ROLES: tuple[Role, ...] = ("speculative", "baseline")
CONFIGS = ("specgate", "all-speculative", "all-baseline")
FIXED: tuple[tuple[str, Role], ...] = (("all-speculative", "speculative"), ("all-baseline", "baseline"))
ALL_SPECULATIVE = 100_000  # both watermarks: a load no level reaches

RATIO_TARGET = 0.95  # specgate's output over the better fixed configuration's
SPLIT_TOLERANCE = 0.15  # every group's share within this (relative) of 1/G
MAX_SWITCHES = 1  # per replica, group and level step
IMBALANCE_TARGET = 1.3  # pooled: the busiest server's mean in-flight over its role's mean
BUSY_MIN = 0.5  # a role whose servers held fewer in flight on average is idle at that level
MIN_SAMPLES = 10  # periodic samples a level's scored part needs for an in-flight figure
SAMPLE_S = 0.5  # /metrics sampling period, at time scale 1
MIN_SAMPLE_S = 0.2  # ... but never faster than this in wall seconds (each sample reads every server)
CPU_BUSY_WARN = 0.85  # a level's mean machine CPU past which its figures are suspect
FIDELITY_WARN = 0.90  # all-baseline below this share of its profile's throughput: CPU-starved
CALIBRATE_LEVELS = (5, 10, 20, 30, 40)
CALIBRATE_DURATION_S = 12.0  # per level, at time scale 1

NO_GROUP_SWITCHES = "specgate exports no specgate_group_mode_switches_total"


@dataclass(frozen=True)
class ScaleoutPlan:
    topology: Topology = "paired"
    groups: int = 2  # paired
    replicas: int = 3
    speculative_servers: int = 2  # pooled
    baseline_servers: int = 2  # pooled
    profile: str = "crossover"
    levels: tuple[int, ...] = (2, 5, 10, 20, 40, 80)
    level_s: float = 45.0
    settle_s: float = 15.0
    time_scale: float = 1.0
    spread: Spread = "request"
    sequential: bool = False
    max_tokens: int = 128
    seed: int = 0
    min_requests: int = DEFAULT_MIN_REQUESTS
    # specgate's SPECGATE_SCRAPE_INTERVAL_S at time scale 1; None: its default (where it has one).
    scrape_interval_s: float | None = None
    # specgate's SPECGATE_LOW_WATERMARK_HOLD_S at time scale 1 (docs: 2 with several replicas);
    # None: its default.
    low_hold_s: float | None = 2.0
    # The simulators refresh their gauges on every scrape instead of SGLang's cadence (every prefill
    # and every 40 decode steps): what routing would do with fresh engine counts.
    live_gauges: bool = False

    def simulator_flags(self) -> list[str]:
        flags = ["--profile", self.profile, "--time-scale", f"{self.time_scale:g}"]
        return [*flags, "--live-gauges"] if self.live_gauges else flags

    def pair_args(self, spec_port: int, base_port: int) -> list[str]:
        return pair_args(spec_port, base_port, *self.simulator_flags())

    def __post_init__(self) -> None:
        if not self.levels or any(b <= a for a, b in itertools.pairwise(self.levels)) or self.levels[0] < 1:
            raise ValueError(f"levels must rise, from at least 1 stream: {self.levels}")

    @property
    def sample_s(self) -> float:
        return max(SAMPLE_S / self.time_scale, MIN_SAMPLE_S)

    @property
    def duration_s(self) -> float:
        return len(self.levels) * self.level_s

    def group_names(self) -> list[str]:
        return [f"group-{i}" for i in range(self.groups)] if self.topology == "paired" else ["pool"]

    def role_counts(self) -> dict[str, int]:
        if self.topology == "paired":
            return {"speculative": self.groups, "baseline": self.groups}
        return {"speculative": self.speculative_servers, "baseline": self.baseline_servers}

    def watermark_scale(self) -> int:
        """What a pair's watermarks are multiplied by: the mode follows a group's load, or the pool's."""
        return 1 if self.topology == "paired" else self.speculative_servers


@dataclass(frozen=True)
class Watermarks:
    high: int
    low: int
    source: str  # where they came from, for the report


def config_watermarks(config: str, wm: Watermarks) -> tuple[int, int]:
    if config == "all-speculative":
        return ALL_SPECULATIVE, ALL_SPECULATIVE
    if config == "all-baseline":
        return 0, 0
    return wm.high, wm.low


@dataclass(frozen=True)
class Server:
    name: str  # specgate's default name: speculative-0, baseline-1, ...
    role: str
    group: str  # group-i (paired) or pool
    url: str


def gate_env(plan: ScaleoutPlan, servers: Sequence[Server], port: int, high: int, low: int) -> dict[str, str]:
    """A replica's environment, its time settings scaled to the simulators' clock."""
    t = plan.time_scale
    env = specgate_env(
        port,
        ",".join(s.url for s in servers if s.role == "speculative"),
        ",".join(s.url for s in servers if s.role == "baseline"),
        t,
        topology=plan.topology,
        policy="threshold",
        high_watermark=high,
        low_watermark=low,
        load_signal="engine",
    )
    # The plan's own figures are in simulated seconds (kit.settings scales the defaults).
    if plan.scrape_interval_s is not None:
        env["SPECGATE_SCRAPE_INTERVAL_S"] = f"{max(MIN_SCRAPE_INTERVAL_S, plan.scrape_interval_s / t):g}"
    if plan.low_hold_s is not None:
        env["SPECGATE_LOW_WATERMARK_HOLD_S"] = f"{plan.low_hold_s / t:g}"
    return env


def watermarks_from(path: Path, plan: ScaleoutPlan) -> Watermarks:
    try:
        cal = load_calibration(str(path))
    except CalibrationError as exc:
        raise ValueError(f"calibration {path}: {exc}") from None
    k = plan.watermark_scale()
    times = f", times {k} speculative servers (the pool's load)" if k != 1 else ""
    return Watermarks(
        cal.high_watermark * k,
        cal.low_watermark * k,
        f"{path}: a pair's high={cal.high_watermark} low={cal.low_watermark} ({cal.verdict}){times}",
    )


def describe(plan: ScaleoutPlan) -> str:
    if plan.topology == "paired":
        servers = f"{plan.groups} groups (simulated pairs on shared GPUs)"
    else:
        servers = f"pooled: {plan.speculative_servers} speculative + {plan.baseline_servers} baseline servers"
    return (
        f"scaleout: {servers}, {plan.replicas} specgate replicas (engine load signal), {plan.profile} profile, "
        f"time scale {plan.time_scale:g}, {plan.max_tokens} tokens a request, requests spread round-robin per "
        f"{plan.spread}, configurations {'one after another' if plan.sequential else 'side by side'}"
        + (", live gauges" if plan.live_gauges else "")
        + (f", scrape interval {plan.scrape_interval_s:g} s" if plan.scrape_interval_s is not None else "")
        + (f", low-watermark hold {plan.low_hold_s:g} s" if plan.low_hold_s is not None else "")
        + (", specgate's default scrape interval and hold" if plan.scrape_interval_s is None else "")
    )
