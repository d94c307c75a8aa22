"""The field benchmark's scoring (pure), fixed before any run: each configuration's goodput over
smg-adaptive's pooled over a cell's seeds (the ratio of sums), its 90% bootstrap interval over the
seeds (twoclass.pooled.bootstrap_interval), the same per class, and the verdicts against the targets."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ..experiments.twoclass.pooled import bootstrap_interval
from ..kit.figures import NO_GOODPUT, TargetCell
from .protocol import CLASS_FLOOR, ONE_CLASS_FLOOR, REFERENCE, TWO_CLASS_GAIN, Cell

MET, MISSED, UNKNOWN = "met", "missed", "unknown"
# A target that does not apply: a two-class cell where no configuration met the SLOs at all.
NOT_APPLICABLE = "n/a"
# A cell's seeds that a pooled figure needs: fewer (a seed inconclusive for either side) is unknown.
MIN_SEEDS = 5
Verdict = str


@dataclass(frozen=True)
class FieldRun:
    """One cell at one seed: each configuration's figures in simulated time."""

    cell: Cell
    seed: int
    time_scale: float
    targets: dict[str, TargetCell]
    # Goodput (requests a simulated second) per configuration and class.
    class_goodput: dict[str, dict[str, float]] = field(default_factory=dict)
    cpu_busy: float | None = None
    # Where the machine was too busy for its timings to be trusted (kit.sampling.cpu_use), why.
    cpu_warning: str | None = None

    def conclusive(self, config: str) -> bool:
        t = self.targets.get(config)
        return t is not None and t.conclusive


@dataclass(frozen=True)
class Pooled:
    """A configuration's figure over the reference's, pooled over a cell's seeds."""

    ratio: float | None  # sum over the seeds over the reference's sum; None: no seed, or both sums 0
    interval: tuple[float, float] | None  # 90% bootstrap over the seeds; None: too few
    seeds: int  # the seeds where both were conclusive
    inconclusive: int  # the seeds where either was not
    mine: float  # the configuration's figure summed over those seeds
    reference: float


def by_cell(runs: Sequence[FieldRun]) -> dict[Cell, list[FieldRun]]:
    """Each cell's runs, in the order run."""
    out: dict[Cell, list[FieldRun]] = {}
    for r in runs:
        out.setdefault(r.cell, []).append(r)
    return out


def _pool(pairs: list[tuple[float, float]], inconclusive: int) -> Pooled:
    mine, ref = sum(a for a, _ in pairs), sum(b for _, b in pairs)
    ratio = mine / ref if ref >= NO_GOODPUT else None
    interval = bootstrap_interval(pairs, MIN_SEEDS) if ratio is not None else None
    return Pooled(ratio, interval, len(pairs), inconclusive, mine, ref)


def pooled(runs: Sequence[FieldRun], config: str) -> Pooled:
    """The configuration's goodput over smg-adaptive's, over the seeds where both were conclusive."""
    known = [r for r in runs if r.conclusive(config) and r.conclusive(REFERENCE)]
    pairs = [(r.targets[config].goodput_req_s, r.targets[REFERENCE].goodput_req_s) for r in known]
    return _pool(pairs, len(runs) - len(known))


def pooled_class(runs: Sequence[FieldRun], config: str, name: str) -> Pooled:
    """pooled() for one class's goodput."""
    known = [r for r in runs if r.conclusive(config) and r.conclusive(REFERENCE)]
    pairs = [(r.class_goodput[config].get(name, 0.0), r.class_goodput[REFERENCE].get(name, 0.0)) for r in known]
    return _pool(pairs, len(runs) - len(known))


def anyone_served(runs: Sequence[FieldRun]) -> bool:
    """Whether any configuration met the SLOs for any request in any of the cell's runs."""
    return any(t.goodput_req_s >= NO_GOODPUT for r in runs for t in r.targets.values())


def against(p: Pooled, goal: float) -> Verdict:
    """met where the whole interval clears `goal`, missed where it falls short of it, else unknown;
    unknown too where a seed was inconclusive or too few were known. Where the reference met the
    SLOs for nothing and the configuration for some, met: any multiple of nothing is less."""
    if p.inconclusive or p.seeds < MIN_SEEDS:
        return UNKNOWN
    if p.reference < NO_GOODPUT:
        return MET if p.mine >= NO_GOODPUT else UNKNOWN
    if p.interval is None:
        return UNKNOWN
    if p.interval[0] >= goal:
        return MET
    return MISSED if p.interval[1] < goal else UNKNOWN


def goal(cell: Cell) -> float:
    """The goodput target of a cell: TWO_CLASS_GAIN with both classes, ONE_CLASS_FLOOR with one."""
    return TWO_CLASS_GAIN if len(cell.traffic) > 1 else ONE_CLASS_FLOOR


def goodput_verdict(runs: Sequence[FieldRun], config: str) -> Verdict:
    """The configuration's goodput target in a cell (goal); n/a where no configuration met the SLOs."""
    if not anyone_served(runs):
        return NOT_APPLICABLE
    return against(pooled(runs, config), goal(runs[0].cell))


def class_verdict(runs: Sequence[FieldRun], config: str) -> Verdict:
    """No class below CLASS_FLOOR of its goodput under smg-adaptive: missed where any class's interval
    falls short, met where every class's clears it, else unknown."""
    found = {against(pooled_class(runs, config, c), CLASS_FLOOR) for c in runs[0].cell.traffic}
    return MISSED if MISSED in found else UNKNOWN if UNKNOWN in found else MET


def overall(verdicts: Sequence[Verdict]) -> Verdict:
    """A target over cells: missed where any cell missed, met where every applicable one met, else
    unknown (and unknown where none applied: nothing was shown)."""
    applied = [v for v in verdicts if v != NOT_APPLICABLE]
    if MISSED in applied:
        return MISSED
    return MET if applied and all(v == MET for v in applied) else UNKNOWN
