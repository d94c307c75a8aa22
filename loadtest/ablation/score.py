"""The ablation's scoring, fixed before any run (pure).

gain (per seed)   full's goodput over no-<mechanism>'s, in the same run (requests a simulated
                  second finishing in the window within the SLOs). Where the stack with the
                  mechanism off met the SLOs for no request and full for some: infinite (full served
                  where off served none); the other way round: 0. Where neither met them for any: their
                  output tokens a second instead, and the figure is marked "on tok/s". Unknown where
                  either stack was inconclusive (too few good requests, or the client failed: more
                  than 5% of its requests failed before the server answered, or a stream died).
spread (per seed) |full-copy / full - 1| (the same rule as gain): how far one stack moved from a copy
                  of itself in that run.
noise (per cell)  the largest spread over the cell's seeds; unknown where any is.
verdict (cell)    pays: every seed's gain > 1 + noise; costs: every seed's gain < 1 - noise; else
                  inside noise. Unknown with fewer than MIN_SEEDS known gains, or the noise unknown.
verdict (overall) pays where it pays in some cell and costs in none; costs the other way round;
                  "pays and costs" where both; inside noise where every known cell is; unknown where
                  no cell is known.
Shown per cell: the median of the per-seed gains and their min-max.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from ..kit.figures import NO_GOODPUT, TargetCell
from .protocol import COPY, FULL, MECHANISMS, MIN_SEEDS, off_stack

PAYS, COSTS, NOISE, UNKNOWN = "pays", "costs", "inside noise", "unknown"
BOTH = "pays and costs"


class Ratio(NamedTuple):
    value: float
    on_tok_s: bool = False


@dataclass(frozen=True)
class Run:
    """One cell's run on one seed: each stack's figures in simulated time, what each specgate's
    /metrics counted (decisions by reason and the like, over the whole run), the machine's CPU."""

    cell: str
    seed: int
    time_scale: float
    stacks: dict[str, TargetCell]
    counters: dict[str, dict[str, float]] = field(default_factory=dict)
    cpu_busy: float | None = None
    cpu_warning: str | None = None
    wall_s: float = 0.0


def ratio(a: TargetCell, b: TargetCell) -> Ratio | None:
    """a's goodput over b's (the module's gain rule); None where either is inconclusive."""
    if not (a.conclusive and b.conclusive):
        return None
    if b.goodput_req_s >= NO_GOODPUT:
        return Ratio(a.goodput_req_s / b.goodput_req_s)
    if a.goodput_req_s >= NO_GOODPUT:
        return Ratio(math.inf)
    if b.output_tok_s > 0:
        return Ratio(a.output_tok_s / b.output_tok_s, on_tok_s=True)
    return None


def gain(run: Run, mechanism: str) -> Ratio | None:
    """full over the stack with `mechanism` off, in this run (None: unknown or not run)."""
    off = run.stacks.get(off_stack(mechanism))
    full = run.stacks.get(FULL)
    return None if off is None or full is None else ratio(full, off)


def spread(run: Run) -> float | None:
    """|full-copy / full - 1| in this run; None where unknown."""
    full, copy = run.stacks.get(FULL), run.stacks.get(COPY)
    r = None if full is None or copy is None else ratio(copy, full)
    return None if r is None else abs(r.value - 1.0)


def cell_noise(runs: Sequence[Run]) -> float | None:
    """The largest spread over the runs; None where any is unknown, or there are none."""
    spreads = [spread(r) for r in runs]
    if not spreads or any(s is None for s in spreads):
        return None
    return max(s for s in spreads if s is not None)


def verdict(gains: Sequence[float | None], noise: float | None, min_seeds: int = MIN_SEEDS) -> str:
    """A cell's verdict from its per-seed gains and its noise (the module's rule)."""
    known = [g for g in gains if g is not None]
    if noise is None or len(known) < min_seeds or len(known) < len(gains):
        return UNKNOWN
    if all(g > 1.0 + noise for g in known):
        return PAYS
    if all(g < 1.0 - noise for g in known):
        return COSTS
    return NOISE


@dataclass(frozen=True)
class CellScore:
    cell: str
    mechanism: str
    seeds: tuple[int, ...]
    gains: tuple[float | None, ...]
    on_tok_s: bool  # some seed's gain was read on output tokens a second
    noise: float | None
    verdict: str
    # What the full stack's counters say the mechanism did, summed over the seeds (None: no counter),
    # and the same counters of the stack with it off (0 but where both stacks count the same thing).
    acted: float | None = None
    acted_off: float | None = None

    @property
    def median(self) -> float | None:
        known = [g for g in self.gains if g is not None]
        return statistics.median(known) if known else None

    @property
    def low(self) -> float | None:
        known = [g for g in self.gains if g is not None]
        return min(known) if known else None

    @property
    def high(self) -> float | None:
        known = [g for g in self.gains if g is not None]
        return max(known) if known else None


# The full stack's counters that show a mechanism at work (a decision reason, `reason:<name>`, or a
# metric's total); a mechanism with none shows nothing.
EVIDENCE: dict[str, tuple[str, ...]] = {
    "classes": ("reason:class",),
    "affinity": ("reason:affinity",),
    "affinity-rule": ("affinity_breaks:load",),
    "kv-spill": ("reason:kv_spill",),
    "kv-forecast": (),
    "switch-cost": ("reason:switch_cost",),
    "return-hold": ("reason:return_hold",),
    "dwell": ("reason:dwell_hold",),
    "probes": ("reason:probe", "shadow_probes"),
    "shadow-probes": ("shadow_probes",),
}


def acted(runs: Sequence[Run], mechanism: str, stack: str = FULL) -> float | None:
    """A stack's evidence counters for `mechanism`, summed over the runs (None: none kept)."""
    keys = EVIDENCE.get(mechanism, ())
    if not keys:
        return None
    return sum(run.counters.get(stack, {}).get(k, 0.0) for run in runs for k in keys)


def score_cell(runs: Sequence[Run], mechanism: str) -> CellScore:
    """One mechanism in one cell over its runs (one a seed)."""
    ratios = [gain(r, mechanism) for r in runs]
    gains = tuple(None if g is None else g.value for g in ratios)
    noise = cell_noise(runs)
    return CellScore(
        cell=runs[0].cell if runs else "",
        mechanism=mechanism,
        seeds=tuple(r.seed for r in runs),
        gains=gains,
        on_tok_s=any(g is not None and g.on_tok_s for g in ratios),
        noise=noise,
        verdict=verdict(gains, noise),
        acted=acted(runs, mechanism),
        acted_off=acted(runs, mechanism, off_stack(mechanism)),
    )


def by_cell(runs: Sequence[Run]) -> dict[str, list[Run]]:
    """The runs of each cell, in the order made."""
    out: dict[str, list[Run]] = {}
    for r in runs:
        out.setdefault(r.cell, []).append(r)
    return out


def score(runs: Sequence[Run], mechanisms: Mapping[str, Sequence[str]]) -> list[CellScore]:
    """Every (cell, mechanism) measured: `mechanisms` maps a cell to the mechanisms measured there."""
    return [score_cell(cell_runs, m) for cell, cell_runs in by_cell(runs).items() for m in mechanisms.get(cell, ())]


@dataclass(frozen=True)
class MechanismRow:
    mechanism: str
    pays: tuple[CellScore, ...]
    costs: tuple[CellScore, ...]
    inside: tuple[CellScore, ...]
    unknown: tuple[CellScore, ...]

    @property
    def verdict(self) -> str:
        if self.pays and self.costs:
            return BOTH
        if self.pays:
            return PAYS
        if self.costs:
            return COSTS
        if self.inside:
            return NOISE
        return UNKNOWN


def summarise(scores: Sequence[CellScore]) -> list[MechanismRow]:
    """One row per mechanism measured, in MECHANISMS' order."""
    rows = []
    for m in MECHANISMS:
        mine = [s for s in scores if s.mechanism == m.name]
        if not mine:
            continue
        rows.append(
            MechanismRow(
                m.name,
                tuple(s for s in mine if s.verdict == PAYS),
                tuple(s for s in mine if s.verdict == COSTS),
                tuple(s for s in mine if s.verdict == NOISE),
                tuple(s for s in mine if s.verdict == UNKNOWN),
            )
        )
    return rows
