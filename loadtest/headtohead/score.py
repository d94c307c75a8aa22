"""headtohead's scoring: pure functions of what a cell recorded, in simulated time.

A cell is one accept length x context x sessions level, all three targets measured side by side;
each target's figures (kit.figures.TargetCell) are converted from wall-clock to simulated time with
the level's time scale T (a simulated second lasts 1/T wall seconds): rates are divided by T,
latencies multiplied by it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..kit.figures import NO_GOODPUT, TIE, TargetCell
from ..kit.multiturn import context_label
from ..kit.sampling import CpuUse
from ..measures import ratio


@dataclass(frozen=True)
class Cell:
    accept: float
    context: int  # the mean context asked for
    sessions: int
    time_scale: float
    targets: dict[str, TargetCell]
    cpu: CpuUse | None = None
    # KV pools in tokens as the servers report them (sglang:max_total_num_tokens), by server.
    pools: dict[str, float] = field(default_factory=dict)

    @property
    def conclusive(self) -> bool:
        return all(t.conclusive for t in self.targets.values())

    @property
    def label(self) -> str:
        return f"accept {self.accept:g}, {context_label(self.context)} ctx, {self.sessions} sessions"

    @property
    def measured_prompt_tokens(self) -> float:
        """The mean prompt over every target's good requests (the same sessions were sent to each)."""
        values = [t.mean_prompt_tokens for t in self.targets.values() if not math.isnan(t.mean_prompt_tokens)]
        return sum(values) / len(values) if values else math.nan


Outcome = str  # "wins", "loses", "ties", "neither", "unknown"


def compare(a: TargetCell, b: TargetCell) -> tuple[Outcome, float]:
    """a against b on goodput: wins/loses beyond TIE, ties within it, neither when both met the SLOs
    on nothing, unknown when either figure is inconclusive; and a's goodput over b's."""
    if not (a.conclusive and b.conclusive):
        return "unknown", math.nan
    if a.goodput_req_s < NO_GOODPUT and b.goodput_req_s < NO_GOODPUT:
        return "neither", math.nan
    r = ratio(a.goodput_req_s, b.goodput_req_s)
    if b.goodput_req_s < NO_GOODPUT:
        return "wins", math.inf
    if r > 1 + TIE:
        return "wins", r
    if r < 1 - TIE:
        return "loses", r
    return "ties", r


def outcomes(cells: Sequence[Cell], a: str, b: str) -> dict[Outcome, list[tuple[Cell, float]]]:
    """Every cell sorted by how target `a` fared against `b`."""
    out: dict[Outcome, list[tuple[Cell, float]]] = {k: [] for k in ("wins", "loses", "ties", "neither", "unknown")}
    for cell in cells:
        outcome, r = compare(cell.targets[a], cell.targets[b])
        out[outcome].append((cell, r))
    return out


def best_target(cell: Cell) -> str | None:
    """The target with the most goodput in a cell, or None when any figure is inconclusive or
    nothing met the SLOs; several within TIE of the best are joined with '='."""
    if not cell.conclusive:
        return None
    top = max(t.goodput_req_s for t in cell.targets.values())
    if top < NO_GOODPUT:
        return None
    near = [n for n, t in cell.targets.items() if t.goodput_req_s >= top * (1 - TIE)]
    return "=".join(near)
