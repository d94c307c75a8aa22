"""scaleout's scoring: each configuration at each level, and specgate against the better fixed one."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ..measures import ratio
from ..stats import LevelStats, summarize
from .drift import Drift, drift_of, replica_rounds
from .measures import (
    aligned_inflight,
    group_loads,
    group_shares,
    imbalance,
    increase,
    instant_deviation,
    mean_inflight,
    nearest,
    split_deviation,
    switches_between,
    vs_better,
)
from .plan import FIXED, ROLES, Role, ScaleoutPlan
from .run import ConfigRun


@dataclass(frozen=True)
class ConfigLevel:
    tok_s: float  # the servers' generation tokens a second over the scored part, summed
    client_tok_s: float  # the load generator's count over the same window
    stats: LevelStats
    tok_s_by_server: dict[str, float]
    requests_by_server: dict[str, float]  # requests finished a second, by server
    group_shares: dict[str, float]  # of output tokens
    split_deviation: float | None
    # Of the requests in flight, sample by sample (instant_deviation); None with one group.
    inflight_deviation: float | None
    inflight: dict[str, float]  # mean running + queued by server over the scored part
    inflight_samples: int  # the fewest periodic samples any server had there
    role_imbalance: dict[str, float | None]  # by role: busiest server's mean over the role's mean
    switches: list[dict[str, int] | None]  # by replica: each group's switches from this level's start to the next's
    modes_at_end: list[dict[str, str]]  # by replica: each group's mode at the level's end
    cpu_busy: float  # the machine's mean CPU use (all cores) over the level, shared by the batch
    # specgate: how its replicas' views of each group's load compared with each other and the servers
    # (None: another configuration, one replica, or no samples).
    drift: Drift | None = None

    @property
    def conclusive(self) -> bool:
        return self.stats.conclusive and not math.isnan(self.tok_s)


@dataclass(frozen=True)
class LevelReport:
    concurrency: int
    start_s: float
    scored_from_s: float
    end_s: float
    configs: dict[str, ConfigLevel]
    vs_better: float
    better: str | None  # the better fixed configuration
    conclusive: bool
    baseline_fidelity: float  # all-baseline over its profile's throughput at the loads its servers held
    # all-speculative and all-baseline: the profile's throughput at the loads their servers held over
    # the same at an even split (1: even; below: what uneven load, moment by moment, costs).
    split_efficiency: dict[str, float] = field(default_factory=dict)


def even_throughput(plan: ScaleoutPlan, role: Role, c: int) -> float:
    """What the profile says the role's servers produce with `c` streams split evenly among them."""
    from ..simulator.profile import load_profile

    n = plan.role_counts()[role]
    return n * load_profile(plan.profile).throughput(role, c / n) * plan.time_scale


def profile_throughput(plan: ScaleoutPlan, run: ConfigRun, role: Role, c: int, a: float, b: float) -> float:
    """What the profile says the role's servers produce at the loads they held in [a, b]: at each
    round of periodic samples, the servers' in-flight scaled to add up to the level's `c` streams
    (SGLang's gauges lag, and over-count a finished request until their next refresh), each
    server's T(load) summed; the mean over the rounds, time-scaled. With the split measured rather
    than assumed even (load sloshing between servers lowers what a concave profile gives), a
    shortfall is the simulators not keeping time."""
    from ..simulator.profile import load_profile

    profile = load_profile(plan.profile)
    mine = {s.name for s in run.servers if s.role == role}
    values = []
    for t, loads in aligned_inflight(run.servers, run.server_samples):
        total = math.fsum(loads.values())
        if a <= t <= b and total > 0:
            values.append(
                math.fsum(profile.throughput(role, v * c / total) for n, v in loads.items() if n in mine and v > 0)
            )
    return plan.time_scale * math.fsum(values) / len(values) if values else math.nan


def _cpu_busy(samples: Sequence[tuple[float, float]], a: float, b: float) -> float:
    inside = [share for t, share in samples if a <= t <= b]
    return math.fsum(inside) / len(inside) if inside else math.nan


def score_config(plan: ScaleoutPlan, run: ConfigRun, k: int) -> ConfigLevel:
    c = plan.levels[k]
    start, end = k * plan.level_s, (k + 1) * plan.level_s
    w0 = start + plan.settle_s
    stats = summarize(c, run.results, run.t0 + w0, run.t0 + end, plan.min_requests)
    samples = run.server_samples
    tok = {s.name: increase(samples[s.name], w0, end, lambda x: x.generated) for s in run.servers}
    req = {s.name: increase(samples[s.name], w0, end, lambda x: x.requests) for s in run.servers}
    shares = group_shares(tok, {s.name: s.group for s in run.servers})
    inflight: dict[str, float] = {}
    counts: list[int] = []
    for s in run.servers:
        inflight[s.name], n = mean_inflight(samples[s.name], w0, end)
        counts.append(n)
    role_imbalance: dict[str, float | None] = {
        role: imbalance([inflight[s.name] for s in run.servers if s.role == role])
        for role in ROLES
        if any(s.role == role for s in run.servers)
    }
    modes = []
    for replica in run.gate_samples:
        last = nearest(replica, end)
        modes.append(dict(last.modes) if last is not None else {})
    return ConfigLevel(
        tok_s=math.fsum(tok.values()),
        client_tok_s=stats.output_tok_s,
        stats=stats,
        tok_s_by_server=tok,
        requests_by_server=req,
        group_shares=shares,
        split_deviation=split_deviation(shares),
        inflight_deviation=instant_deviation(group_loads(run.servers, samples), w0, end) if plan.groups > 1 else None,
        inflight=inflight,
        inflight_samples=min(counts, default=0),
        role_imbalance=role_imbalance,
        switches=[switches_between(replica, start, end) for replica in run.gate_samples],
        modes_at_end=modes,
        cpu_busy=_cpu_busy(run.cpu_samples, start, end),
        drift=drift_of(replica_rounds(run.servers, samples, run.gate_samples, plan.sample_s / 2), start, w0, end)
        if run.name == "specgate"
        else None,
    )


def score(plan: ScaleoutPlan, runs: Mapping[str, ConfigRun]) -> list[LevelReport]:
    out = []
    for k, c in enumerate(plan.levels):
        configs = {name: score_config(plan, run, k) for name, run in runs.items()}
        spec, base = configs["all-speculative"].tok_s, configs["all-baseline"].tok_s
        better = None if math.isnan(spec) or math.isnan(base) else "all-speculative" if spec >= base else "all-baseline"
        w0, end = k * plan.level_s + plan.settle_s, (k + 1) * plan.level_s
        held = {name: profile_throughput(plan, runs[name], role, c, w0, end) for name, role in FIXED}
        out.append(
            LevelReport(
                concurrency=c,
                start_s=k * plan.level_s,
                scored_from_s=w0,
                end_s=end,
                configs=configs,
                vs_better=vs_better(configs["specgate"].tok_s, spec, base),
                better=better,
                conclusive=all(cl.conclusive for cl in configs.values()),
                baseline_fidelity=ratio(base, held["all-baseline"]),
                split_efficiency={name: ratio(held[name], even_throughput(plan, role, c)) for name, role in FIXED},
            )
        )
    return out
