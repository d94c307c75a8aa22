"""The field benchmark's report: a table of every cell's configurations pooled over its seeds, the
verdicts against the targets, and the markdown body of a dated report (a `## Protocol` section)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ..experiments.twoclass.pooled import CONFIDENCE
from .protocol import CLASS_FLOOR, ONE_CLASS_FLOOR, POOL, REFERENCE, SMG, TWO_CLASS_GAIN, FieldPlan
from .score import (
    MIN_SEEDS,
    FieldRun,
    Pooled,
    by_cell,
    class_verdict,
    goodput_verdict,
    overall,
    pooled,
    pooled_class,
)


def present(runs: Sequence[FieldRun], configs: Sequence[str]) -> list[str]:
    """Of `configs`, those every run of a cell measured."""
    return [c for c in configs if all(c in r.targets for r in runs)]


def _ratio(p: Pooled) -> str:
    if p.ratio is None:
        return "served, ref 0" if p.reference == 0 and p.mine > 0 else "unknown"
    span = "" if p.interval is None else f" ({p.interval[0]:.2f}-{p.interval[1]:.2f})"
    return f"{p.ratio:.2f}x{span}"


def _mean_goodput(runs: Sequence[FieldRun], config: str) -> str:
    values = [r.targets[config].goodput_req_s for r in runs]
    star = "" if all(r.conclusive(config) for r in runs) else "*"
    return f"{sum(values) / len(values):.2f}{star}"


def table(runs: Sequence[FieldRun], configs: Sequence[str]) -> list[str]:
    """A markdown table: per cell and configuration, the mean goodput over the seeds, the pooled
    ratio to smg-adaptive, each class's, and the verdicts (the targets: specgate-pool's)."""
    lines = [
        "| cell | seeds | config | goodput | / smg-adaptive | class A / ref | class B / ref | goodput target "
        "| classes >= 0.9x |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for cell, cell_runs in by_cell(runs).items():
        for config in present(cell_runs, configs):
            mine = config not in SMG
            classes = [
                _ratio(pooled_class(cell_runs, config, c)) if c in cell.traffic else "-" for c in "AB"
            ]  # fmt: skip
            lines.append(
                f"| {cell.label} | {len(cell_runs)} | {config} | {_mean_goodput(cell_runs, config)} | "
                f"{'1' if config == REFERENCE else _ratio(pooled(cell_runs, config))} | {' | '.join(classes)} | "
                f"{goodput_verdict(cell_runs, config) if mine else '-'} | "
                f"{class_verdict(cell_runs, config) if mine else '-'} |"
            )
    lines.append(
        f"\n(simulated time; goodput: requests a second finishing in the window within both SLOs, the mean over the "
        f"cell's seeds, * where a seed was inconclusive; X / smg-adaptive: X's goodput summed over the seeds over "
        f"smg-adaptive's, with its {CONFIDENCE:.0%} bootstrap interval over the seeds; goodput target: >= "
        f"{TWO_CLASS_GAIN:g}x with two classes, >= {ONE_CLASS_FLOOR:g}x with one, met/missed only where the whole "
        f"interval is on one side, n/a where no configuration met the SLOs; classes: every class's ratio >= "
        f"{CLASS_FLOOR:g}x)"
    )
    return lines


def verdicts(runs: Sequence[FieldRun], configs: Sequence[str]) -> dict[str, dict[str, str]]:
    """Each specgate configuration's verdict over every cell, per target."""
    out: dict[str, dict[str, str]] = {}
    for config in (c for c in configs if c not in SMG):
        # The cells it ran in (specgate-mixed has no fleet on two GPUs: protocol.fits).
        cells = {cell: r for cell, r in by_cell(runs).items() if config in present(r, configs)}
        two = [goodput_verdict(r, config) for cell, r in cells.items() if len(cell.traffic) > 1]
        one = [goodput_verdict(r, config) for cell, r in cells.items() if len(cell.traffic) == 1]
        out[config] = {
            f">= {TWO_CLASS_GAIN:g}x in two-class cells": overall(two),
            f">= {ONE_CLASS_FLOOR:g}x in one-class cells": overall(one),
            f"no class below {CLASS_FLOOR:g}x": overall([class_verdict(r, config) for r in cells.values()]),
        }
    return out


def summary_lines(runs: Sequence[FieldRun], configs: Sequence[str], skipped: Mapping[str, str]) -> list[str]:
    """The verdicts (specgate-pool's are the targets; the others' for information), the skipped
    configurations and the machine's warnings."""
    lines = [""]
    for config, found in verdicts(runs, configs).items():
        what = "the targets" if config == POOL else "for information"
        said = "; ".join(f"{k}: {v}" for k, v in found.items())
        lines.append(f"- **{config}** ({what}): {said}")
    lines += [f"- {config}: {why}" for config, why in skipped.items()]
    warned = [r for r in runs if r.cpu_warning]
    if warned:
        lines.append(
            f"- warning: the machine was too busy in {len(warned)} of {len(runs)} runs ({warned[0].cpu_warning})"
        )
    return lines


def _extra(plan: FieldPlan) -> str:
    return ", ".join(f"{name}={value}" for name, value in plan.extra)


def protocol_lines(plan: FieldPlan, command: str, wall_s: float | None) -> list[str]:
    """The report's `## Protocol` section."""
    cells = ", ".join(c.label for c in plan.cells)
    return [
        "## Protocol",
        "",
        f"- Command: `{command}`" + ("" if wall_s is None else f", {wall_s:,.0f} s of wall time"),
        f"- Cells ({len(plan.cells)}): {cells}; seeds {plan.seed}-{plan.seed + plan.seeds - 1} each.",
        f"- Configurations: {', '.join(plan.configs)}; each fleet a simulator a GPU (`--profile {plan.profile} "
        f"--enable-cache-report --accept-from-prompt --max-accept-length {plan.max_accept_length:g}`), "
        "all side by side on the same sessions.",
        f"- Sessions: {plan.turns} turns of {plan.max_tokens} tokens, {plan.think_time_s:g} s think time, first "
        f"sessions staggered over {plan.stagger_s:g} s; window {plan.window_s:g} s (up to {plan.max_window_s:g} s "
        f"until {plan.min_requests} good requests), simulated.",
        f"- SLOs: TTFT <= {plan.slo_ttft_ms:g} ms, TPOT <= {plan.slo_tpot_ms:g} ms (simulated).",
        *([f"- Not the protocol's: every specgate with {_extra(plan)} (simulated clock)."] if plan.extra else []),
        f"- Pooling, fixed before the run: the ratio of goodput summed over a cell's seeds, its "
        f"{CONFIDENCE:.0%} bootstrap interval over the seeds; unknown with a seed inconclusive or fewer than "
        f"{MIN_SEEDS}.",
        f"- Targets (specgate-pool over smg-adaptive): >= {TWO_CLASS_GAIN:g}x in every two-class cell where anyone "
        f"meets the SLOs, >= {ONE_CLASS_FLOOR:g}x in one-class cells, no class below {CLASS_FLOOR:g}x of its "
        "goodput under smg-adaptive; an inconclusive figure is unknown, never a pass.",
    ]


def markdown(
    plan: FieldPlan,
    runs: Sequence[FieldRun],
    configs: Sequence[str],
    skipped: Mapping[str, str],
    command: str,
    wall_s: float | None,
) -> str:
    """A dated report's body (docs/benchmarks/): title, protocol, results, verdicts."""
    body = [
        "# The field's setup beside specgate on N simulated H200s",
        "",
        *protocol_lines(plan, command, wall_s),
        "",
        "## Results",
        "",
        *table(runs, configs),
        "",
        "## Verdicts",
        *summary_lines(runs, configs, skipped),
    ]
    return "\n".join(body) + "\n"
