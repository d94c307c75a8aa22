"""The ablation's tables: the summary (one row a mechanism), each cell's scores, each run's goodputs
(pure: strings from scores and runs)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from .protocol import BY_NAME, CELLS
from .score import CellScore, MechanismRow, Run

LABELS = {c.name: c.label for c in CELLS}


def times(value: float | None) -> str:
    if value is None:
        return "unknown"
    if math.isinf(value):
        return "inf"
    return f"{value:.2f}x"


def spread_of(s: CellScore) -> str:
    """The median gain and the per-seed min-max."""
    tok = " on tok/s" if s.on_tok_s else ""
    return f"{times(s.median)} ({times(s.low)}-{times(s.high)}){tok}"


def where(scores: Sequence[CellScore]) -> str:
    if not scores:
        return "-"
    return "; ".join(f"{LABELS.get(s.cell, s.cell)}: {spread_of(s)}, noise {_pct(s.noise)}" for s in scores)


def _pct(value: float | None) -> str:
    if value is None:
        return "unknown"
    return "inf" if math.isinf(value) else f"{value:.0%}"


def summary_table(rows: Sequence[MechanismRow]) -> str:
    """mechanism | where it pays (cell, gain, spread) | where it costs | verdict."""
    lines = [
        "| mechanism (switch off) | where it pays (cell: median gain (min-max over seeds), noise) | where it costs "
        "| verdict |",
        "|---|---|---|---|",
    ]
    for r in rows:
        m = BY_NAME[r.mechanism]
        inside = [LABELS.get(s.cell, s.cell) for s in r.inside]
        unknown = [LABELS.get(s.cell, s.cell) for s in r.unknown]
        verdict = r.verdict
        if inside and r.verdict != "inside noise":
            verdict += f"; inside noise at {', '.join(inside)}"
        if unknown:
            verdict += f"; unknown at {', '.join(unknown)}"
        lines.append(f"| {m.name} (`{m.switch}`) | {where(r.pays)} | {where(r.costs)} | {verdict} |")
    return "\n".join(lines)


def cell_table(scores: Sequence[CellScore]) -> str:
    """Every (cell, mechanism): the per-seed gains, median and spread, the cell's noise, the verdict,
    and what the counters of the full stack and of the one with it off say the mechanism did (summed
    over the seeds: score.EVIDENCE)."""
    lines = [
        "| cell | mechanism | full / off, per seed | median (min-max) | noise | verdict | acted, full / off |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in scores:
        per_seed = ", ".join(times(g) for g in s.gains)
        acted = "-" if s.acted is None else f"{s.acted:.0f} / {s.acted_off or 0:.0f}"
        lines.append(
            f"| {LABELS.get(s.cell, s.cell)} | {s.mechanism} | {per_seed} | {spread_of(s)} | {_pct(s.noise)} | "
            f"{s.verdict} | {acted} |"
        )
    return "\n".join(lines)


def run_lines(runs: Sequence[Run]) -> list[str]:
    """Per run: each stack's goodput (requests a simulated second within the SLOs; * inconclusive),
    the machine's CPU and the wall time."""
    out = []
    for r in runs:
        figures = ", ".join(f"{n} {c.goodput_req_s:.2f}{'' if c.conclusive else '*'}" for n, c in r.stacks.items())
        cpu = "-" if r.cpu_busy is None or math.isnan(r.cpu_busy) else f"{r.cpu_busy:.0%}"
        warn = " (CPU saturated)" if r.cpu_warning else ""
        out.append(f"{r.cell} seed {r.seed} T={r.time_scale:g} CPU {cpu}{warn}, {r.wall_s:.0f} s: {figures}")
    return out
