"""shift's scoring: pure functions of what a level's run recorded (see the command's description)."""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..client import RequestResult
from ..kit.sampling import CpuUse
from ..measures import ratio
from ..stats import LevelStats, summarize
from .plan import RATIO_TARGET, SPECGATES, TIE, ShiftPlan
from .run import Capture, RoutingSample


class Tokens:
    """A target's output tokens over time: each request's tokens spread over its text chunks."""

    def __init__(self, results: Sequence[RequestResult], t0: float) -> None:
        points = sorted(
            (t - t0, r.output_tokens / len(r.chunk_times))
            for r in results
            if r.ok and r.chunk_times
            for t in r.chunk_times
        )
        self.times = [t for t, _ in points]
        self.cum = [0.0, *itertools.accumulate(w for _, w in points)]

    def between(self, a: float, b: float) -> float:
        """Tokens produced in [a, b] (as stats.tokens_in_window counts them)."""
        return self.cum[bisect.bisect_right(self.times, b)] - self.cum[bisect.bisect_left(self.times, a)]

    def rate(self, a: float, b: float) -> float:
        return self.between(a, b) / (b - a) if b > a else math.nan


@dataclass(frozen=True)
class PhaseReport:
    index: int
    source: str
    start_s: float
    end_s: float
    scored_from_s: float
    stats: dict[str, LevelStats]
    better: str | None  # the better of the two servers alone over the scored part
    tie: bool  # the two servers within TIE of each other: either meets the target
    vs_better: dict[str, float]  # each specgate's throughput over the better server's
    adaptive_vs_static: float
    conclusive: bool
    settle_s: dict[str, float | None]  # per specgate, from the phase's start; None: not settled
    # Per specgate: from the phase's start until its mode stayed the better server's to the end
    # (the routing decision alone, whatever the throughput); None: never, or the servers tie.
    mode_settle_s: dict[str, float | None]
    switches: dict[str, int | None]  # per specgate, mode switches inside the phase (None: unread)
    probes: int | None  # adaptive's probes inside the phase
    dwell_holds: int | None
    mode_at_end: dict[str, str | None]
    baseline_fidelity: float  # the baseline alone over its profile's throughput (time-scaled)


@dataclass(frozen=True)
class LevelReport:
    concurrency: int
    phases: list[PhaseReport]
    routing: dict[str, list[RoutingSample]]
    rolling: dict[str, list[tuple[float, float]]]  # per target: (t, tok/s over the ROLLING_S before t)
    cpu: CpuUse
    errors: dict[str, int]
    client_errors: dict[str, int]


def settle_time(
    start: float,
    end: float,
    gate: Tokens,
    spec: Tokens,
    base: Tokens,
    modes: Sequence[RoutingSample],
    better: str | None,
    tie: bool,
    window: float,
    step: float,
) -> float | None:
    """Seconds from `start` until the specgate settled (see the command's description), or None."""
    last = end - window
    if last < start:
        return None
    n = int((last - start) / step + 1e-9)
    starts = [start + k * step for k in range(n + 1)]
    earliest = start
    if not tie:
        if better is None:
            return None
        wrong = [s.t for s in modes if start <= s.t < end and s.mode != better]
        if wrong:
            later = [s.t for s in modes if max(wrong) < s.t < end]
            if not later:
                return None
            earliest = min(later)
    settled: float | None = None
    for s in reversed(starts):
        best = max(spec.between(s, s + window), base.between(s, s + window))
        if gate.between(s, s + window) < RATIO_TARGET * best:
            break
        settled = s
    if settled is None:
        return None
    t = max(settled, earliest)
    return None if t > last else t - start


def mode_settle_time(start: float, end: float, modes: Sequence[RoutingSample], better: str) -> float | None:
    """Seconds from `start` to the first /routing sample from which the mode is `better` to the end."""
    inside = [s for s in modes if start <= s.t < end]
    settled: float | None = None
    for s in reversed(inside):
        if s.mode != better:
            break
        settled = s.t - start
    return settled


def _delta(counters: Sequence[Mapping[str, float]], i: int, pick: str) -> int | None:
    """A counter's increase across phase i (boundaries i and i + 1); `pick` a key or a key suffix."""
    if i + 1 >= len(counters) or not counters[i] or not counters[i + 1]:
        return None

    def total(c: Mapping[str, float]) -> float:
        return sum(v for k, v in c.items() if k == pick or k.startswith(pick + ":"))

    return round(total(counters[i + 1]) - total(counters[i]))


def _better(stats: Mapping[str, LevelStats]) -> tuple[str | None, bool]:
    """The better server over a phase's scored part (None: unknown), and whether the two tie."""
    s, b = stats["speculative"].output_tok_s, stats["baseline"].output_tok_s
    servers_ok = stats["speculative"].conclusive and stats["baseline"].conclusive
    better = None if not servers_ok or (s <= 0 and b <= 0) else ("speculative" if s >= b else "baseline")
    best = max(s, b)
    return better, servers_ok and best > 0 and abs(s - b) / best <= TIE


def _settle(
    plan: ShiftPlan,
    cap: Capture,
    tokens: Mapping[str, Tokens],
    g: str,
    phase: tuple[float, float],
    better: str | None,
    tie: bool,
) -> float | None:
    spec, base = tokens["speculative"], tokens["baseline"]
    start, end = phase
    return settle_time(start, end, tokens[g], spec, base, cap.routing[g], better, tie, plan.rolling_s, plan.sample_s)


def score_phase(plan: ShiftPlan, c: int, cap: Capture, tokens: Mapping[str, Tokens], i: int) -> PhaseReport:
    from ..simulator.profile import load_profile

    start, end = i * plan.phase_s, (i + 1) * plan.phase_s
    w0 = start + plan.settle_s
    stats = {name: summarize(c, rs, cap.t0 + w0, cap.t0 + end, plan.min_requests) for name, rs in cap.results.items()}
    better, tie = _better(stats)
    best = max(stats["speculative"].output_tok_s, stats["baseline"].output_tok_s)
    expected_base = load_profile(plan.profile).throughput("baseline", c) * plan.time_scale
    inside = {g: [smp for smp in cap.routing[g] if start <= smp.t < end] for g in SPECGATES}
    return PhaseReport(
        index=i,
        source=plan.phases[i],
        start_s=start,
        end_s=end,
        scored_from_s=w0,
        stats=stats,
        better=better,
        tie=tie,
        vs_better={g: ratio(stats[g].output_tok_s, best) for g in SPECGATES},
        adaptive_vs_static=ratio(stats["adaptive"].output_tok_s, stats["static"].output_tok_s),
        conclusive=all(st.conclusive for st in stats.values()),
        settle_s={g: _settle(plan, cap, tokens, g, (start, end), better, tie) for g in SPECGATES},
        mode_settle_s={
            g: None if better is None or tie else mode_settle_time(start, end, cap.routing[g], better)
            for g in SPECGATES
        },
        switches={g: _delta(cap.counters[g], i, "switches") for g in SPECGATES},
        probes=_delta(cap.counters["adaptive"], i, "probe"),
        dwell_holds=_delta(cap.counters["adaptive"], i, "dwell_hold"),
        mode_at_end={g: inside[g][-1].mode if inside[g] else None for g in SPECGATES},
        baseline_fidelity=ratio(stats["baseline"].output_tok_s, expected_base),
    )


def score_level(plan: ShiftPlan, c: int, cap: Capture) -> list[PhaseReport]:
    tokens = {name: Tokens(rs, cap.t0) for name, rs in cap.results.items()}
    return [score_phase(plan, c, cap, tokens, i) for i in range(len(plan.phases))]


def rolling_series(cap: Capture, plan: ShiftPlan) -> dict[str, list[tuple[float, float]]]:
    total = plan.duration_s
    step = max(plan.sample_s, total / 600)
    out: dict[str, list[tuple[float, float]]] = {}
    for name, rs in cap.results.items():
        tok = Tokens(rs, cap.t0)
        points = []
        t = plan.rolling_s
        while t <= total + 1e-9:
            points.append((round(t, 3), round(tok.rate(t - plan.rolling_s, t), 1)))
            t += step
        out[name] = points
    return out
