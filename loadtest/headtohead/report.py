"""headtohead's report: the table with the three targets side by side per cell, the verdict from the
measured cells only, CPU lines and warnings."""

from __future__ import annotations

import math
from collections.abc import Sequence

from ..kit.figures import TIE, TargetCell
from ..kit.multiturn import context_label
from ..report import fmt
from .plan import HeadPlan
from .score import Cell, best_target, outcomes

SHORT = {"baseline": "base", "adaptive": "adapt", "specgate": "gate"}


def _figure(t: TargetCell, value: float, digits: int) -> str:
    return fmt(value, digits) + ("" if t.conclusive else "*")


def _hit(t: TargetCell) -> str:
    return "n/a" if t.prefix_cache_hit_rate is None else f"{t.prefix_cache_hit_rate:.0%}"


def _best(c: Cell) -> str:
    return best_target(c) or ("none" if c.conclusive else "unknown")


def cell_table(plan: HeadPlan, cells: Sequence[Cell]) -> str:
    names = ["baseline", "adaptive", "specgate"]
    head = (
        f"{'accept':>6} {'ctx':>4} {'prompt':>6} {'sess':>4} {'scale':>5}  "
        + " ".join(f"{'goodput ' + SHORT[n]:>13}" for n in names)
        + "  "
        + " ".join(f"{'tok/s ' + SHORT[n]:>11}" for n in names)
        + "  "
        + " ".join(f"{'hit ' + SHORT[n]:>10}" for n in names)
        + f"  {'gate->spec':>10}  best"
    )
    lines = [head, "-" * len(head)]
    for c in cells:
        ts = [c.targets[n] for n in names]
        gate = c.targets["specgate"].speculative_share
        lines.append(
            f"{c.accept:>6g} {context_label(c.context):>4} {fmt(c.measured_prompt_tokens, 0):>6} {c.sessions:>4} "
            f"{c.time_scale:>5g}  "
            + " ".join(f"{_figure(t, t.goodput_req_s, 2):>13}" for t in ts)
            + "  "
            + " ".join(f"{_figure(t, t.output_tok_s, 0):>11}" for t in ts)
            + "  "
            + " ".join(f"{_hit(t):>10}" for t in ts)
            + f"  {'-' if gate is None else f'{gate:.0%}':>10}  {_best(c)}"
        )
    lines.append(
        f"(simulated time: goodput = requests a second finishing within TTFT <= {plan.slo_ttft_ms:g} ms and TPOT <= "
        f"{plan.slo_tpot_ms:g} ms; tok/s = output tokens a second; hit = prefix-cache hit rate (cached_tokens over "
        f"prompt tokens); prompt = measured mean prompt tokens; scale = the level's --time-scale; gate->spec = "
        f"specgate's requests sent to the speculative server; * inconclusive: too few good requests or too many "
        f"client errors, not counted as a win or a loss; best: most goodput, '=' within {TIE:.0%})"
    )
    return "\n".join(lines)


def _where(items: Sequence[tuple[Cell, float]], with_ratio: bool = True) -> str:
    parts = []
    for cell, r in items:
        rtxt = "" if not with_ratio or math.isnan(r) else f" ({'inf' if math.isinf(r) else f'{r:.2f}'}x)"
        parts.append(cell.label + rtxt)
    return "; ".join(parts)


def _versus(cells: Sequence[Cell], other: str) -> list[str]:
    o = outcomes(cells, "specgate", other)
    lines = []
    for key, verb in (("loses", "loses to"), ("wins", "beats"), ("ties", f"ties (within {TIE:.0%}) with")):
        if o[key]:
            lines.append(f"- specgate + pair {verb} the {other} on goodput at: {_where(o[key])}")
    if o["neither"]:
        lines.append(f"- neither specgate + pair nor the {other} met the SLOs at: {_where(o['neither'], False)}")
    if o["unknown"]:
        lines.append(f"- unknown (a figure inconclusive) against the {other} at: {_where(o['unknown'], False)}")
    if not any(o[k] for k in ("loses", "wins", "ties", "neither")):
        lines.append(f"- against the {other}: nothing measured conclusively")
    return lines


def _queues(cells: Sequence[Cell]) -> list[str]:
    """Where the pair loses, what its servers queued against the adaptive server's (measured gauges)."""
    o = outcomes(cells, "specgate", "adaptive")
    out = []
    for cell, _ in o["loses"]:
        g, a = cell.targets["specgate"].mean_queued, cell.targets["adaptive"].mean_queued
        if g is not None and a is not None:
            out.append(f"{cell.label}: pair {g:.1f} queued on average, adaptive {a:.1f}")
    return out


def _pools(cells: Sequence[Cell]) -> str | None:
    pools: dict[str, float] = {}
    for c in cells:
        pools.update(c.pools)
    if not pools:
        return None
    return "KV pools (sglang:max_total_num_tokens): " + ", ".join(f"{k} {v:,.0f}" for k, v in sorted(pools.items()))


def verdicts(plan: HeadPlan, cells: Sequence[Cell]) -> list[str]:
    """Where the pair behind specgate wins and loses, from the conclusive cells only: a cell with an
    inconclusive figure is listed as unknown, never as a win or a loss."""
    measured = [c for c in cells if c.conclusive]
    lines = [
        f"Verdict ({len(measured)} of {len(cells)} cells conclusive on all three targets; goodput under "
        f"TTFT <= {plan.slo_ttft_ms:g} ms and TPOT <= {plan.slo_tpot_ms:g} ms, simulated):"
    ]
    if pools := _pools(cells):
        lines.append(f"- {pools}")
    lines += _versus(cells, "adaptive")
    lines += _versus(cells, "baseline")
    queues = _queues(cells)
    if queues:
        lines.append("- where the pair loses to the adaptive server, requests queued (sglang:num_queue_reqs, "
                     "mean over the cell's samples): " + "; ".join(queues))  # fmt: skip
    return lines


def cpu_lines(cells: Sequence[Cell]) -> list[str]:
    return [c.cpu.line(c.label) for c in cells if c.cpu is not None]


def warnings(cells: Sequence[Cell]) -> list[str]:
    out = []
    for c in cells:
        if c.cpu is not None and c.cpu.warning:
            out.append(f"warning: {c.label}: {c.cpu.warning}")
        errs = {n: t.errors for n, t in c.targets.items() if t.errors}
        if errs:
            out.append(f"warning: {c.label}: server errors {errs}")
        client = {n: t.client_errors for n, t in c.targets.items() if t.client_errors}
        if client:
            out.append(f"note: {c.label}: client errors (the load tester's, not the servers') {client}")
    return out
