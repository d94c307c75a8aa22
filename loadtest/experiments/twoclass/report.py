"""headtohead-classes' report: the table of every run of every cell, and the summary lines (the
verdicts' counts, the noise, the hop, the runs pooled, the hit rates against smg's and the oracle's)."""

from __future__ import annotations

import functools
from collections.abc import Sequence

from ...kit.figures import TIE, TargetCell
from ...kit.multiturn import context_label
from ...report import fmt
from .plan import CONTROL, DIRECT, GATES, NOISE_OF, ORACLE, SPLIT, ClassPlan
from .pooled import (
    CONFIDENCE,
    POOLED_MAX_UNKNOWN,
    POOLED_MIN_RUNS,
    bootstrap_interval,
    cell_verdict,
    pooled_interval,
    pooled_ratio,
    repeated,
    runs_verdict,
    unknown_runs,
    with_copy,
)
from .score import (
    FLOOR,
    HIT_POINTS,
    ON_TOK_S,
    SPLIT_GAIN,
    ClassCell,
    fixed_served_none,
    goodput_verdict,
    hit_verdict,
    measured_oracle_gap,
    oracle_gap,
)


def _hit(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0%}"


def _goodput(t: TargetCell | None) -> str:
    return "-" if t is None else fmt(t.goodput_req_s, 2) + ("" if t.conclusive else "*")


def _pair(by_class: dict[str, float]) -> str:
    return "/".join("-" if c not in by_class else f"{by_class[c]:.2f}" for c in "AB")


def _ratio(value: float | None) -> str:
    return "unknown" if value is None else f"{value:.2f}x"


def _vs_best(c: ClassCell, target: str) -> str:
    """The target's ratio to the better fixed target, or that it served alone (ClassCell.served_alone),
    or where neither fixed target served any, its throughput's (goodput_verdict)."""
    if c.served_alone(target):
        return "served, fixed 0"
    if fixed_served_none(c):
        return f"fixed served none, tok/s {_ratio(c.throughput_ratio(target))}"  # the verdict says " on tok/s"
    return _ratio(c.ratio(target))


def table(plan: ClassPlan, cells: Sequence[ClassCell]) -> str:
    """A markdown table: goodput per target, the gates' ratios, split, hit rates."""
    gates = [n for n in GATES if n in plan.targets]
    head = (
        "| ctx | sessions | seed | scale | "
        + " | ".join(f"goodput {n}" for n in plan.targets)
        + " | A/B spec | A/B base | split? | free split | "
        + ("split / best | " if SPLIT in plan.targets else "")
        + (f"{CONTROL} / {NOISE_OF} | " if CONTROL in plan.targets else "")
        + (f"all-base / {DIRECT} | " if DIRECT in plan.targets else "")
        + " | ".join(f"{n} / best" for n in gates)
        + " | features / adaptive | hit "
        + " / ".join(plan.targets)
        + " | oracle (features) | features to spec | features back on its role |"
        + (" short of own oracle, features / smg |" if "smg" in plan.targets else "")
        + (f" features short of {ORACLE} |" if ORACLE in plan.targets else "")  # measured_oracle_gap
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for c in cells:
        split = c.split()
        gp = [_goodput(c.targets.get(n)) for n in plan.targets]
        cg = c.class_goodput
        share = c.targets["features"].speculative_share
        lines.append(
            f"| {context_label(c.context)} | {c.sessions} | {c.seed} | {c.time_scale:g} | "
            + " | ".join(gp)
            + f" | {_pair(cg['all-spec'])} | {_pair(cg['all-base'])} | "
            f"{'unknown' if split is None else 'yes' if split else 'no'} | {_ratio(c.split_bound())} | "
            + ((f"{_ratio(c.ratio(SPLIT))} | " if SPLIT in c.targets else "- | ") if SPLIT in plan.targets else "")
            + (f"{_ratio(c.versus(CONTROL, NOISE_OF))} | " if CONTROL in plan.targets else "")
            + (f"{_ratio(c.versus('all-base', DIRECT))} | " if DIRECT in plan.targets else "")
            + " | ".join(f"{_vs_best(c, n)} ({goodput_verdict(c, n)})" for n in gates)
            + f" | {_ratio(c.versus('features', 'adaptive')) if 'adaptive' in c.targets else '-'} | "
            + " / ".join(_hit(c.targets[n].prefix_cache_hit_rate) if n in c.targets else "-" for n in plan.targets)
            + f" | {_hit(c.oracle_hit.get('features'))} | {'-' if share is None else f'{share:.0%}'} | "
            + f"{_hit(c.returned.get('features'))} |"
            + (
                f" {_points(oracle_gap(c, 'features'))} / {_points(oracle_gap(c, 'smg'))} |"
                if "smg" in plan.targets
                else ""
            )
            + (f" {_points(measured_oracle_gap(c, 'features'))} |" if ORACLE in plan.targets else "")
        )
    lines.append(
        f"\n(simulated time; goodput: requests a second finishing within TTFT <= {plan.slo_ttft_ms:g} ms and TPOT "
        f"<= {plan.slo_tpot_ms:g} ms; A/B: each class's goodput; split?: B gains on all-spec and A on all-base, "
        f"each beyond {TIE:.0%}, and the measured split (B to the speculative server, A to the baseline) beats "
        f"the better fixed target beyond {TIE:.0%}; free split: each class on its better fixed target, summed, "
        f"over the better fixed target (a split that left each class as well off as it was there); X / best: "
        f"X's goodput over the better of all-spec and all-base, (met/missed) >= {SPLIT_GAIN:g}x where split, "
        f"else >= {FLOOR:g}x; where neither fixed target met the SLOs, X's output tokens a second over the "
        f"better fixed target's, >= {FLOOR:g}x; back on its role: later turns on the role of their session's "
        "turn before (1: the oracle's routing, its hit rate met)"
        + (f", by more than |{CONTROL} / {NOISE_OF} - 1|, else unknown" if CONTROL in plan.targets else "")
        + (
            f"; all-spec, all-base and the split through a specgate pinned to their server, {DIRECT} the "
            f"baseline server straight: all-base / {DIRECT} is what the hop costs"
            if plan.gated_fixed
            else ""
        )
        + (
            f"; {ORACLE}: every session kept on one server of its own pair, each server given as many sessions of "
            f"each class; features short of {ORACLE}: how much further features' hit rate fell short of its own "
            "estimate than the best of all-spec's, all-base's and the oracle's fell short of theirs (what judges the "
            "hit target where neither fixed target met the SLOs)"
            if ORACLE in plan.targets
            else ""
        )
        + "; * inconclusive)"
    )
    return "\n".join(lines)


def _points(gap: float | None) -> str:
    return "unknown" if gap is None else f"{gap * 100:+.1f}"


def _pooled(runs: Sequence[ClassCell], target: str) -> str:
    interval = pooled_interval(runs, target)
    extra = "" if interval is None else f" ({CONFIDENCE:.0%} interval {interval[0]:.2f}x-{interval[1]:.2f}x)"
    unknown = unknown_runs(runs, target)
    if unknown:
        extra += f", {unknown} of {len(runs)} runs inconclusive"
    return _ratio(pooled_ratio(runs, target)) + extra


def hop_line(runs: Sequence[ClassCell]) -> str | None:
    """all-base through its pinned specgate over the baseline server straight (DIRECT), pooled over
    the runs where both are known, with its interval where there are enough (None: not run)."""
    known = [
        (c.targets["all-base"].goodput_req_s, c.targets[DIRECT].goodput_req_s)
        for c in runs
        if DIRECT in c.targets and c.versus("all-base", DIRECT) is not None
    ]
    if not any(DIRECT in c.targets for c in runs):
        return None
    if not known:
        return f"all-base / {DIRECT} unknown"
    return f"all-base / {DIRECT} " + _pooled_over(known, sum(1 for c in runs if DIRECT in c.targets), len(runs))


def direct_line(runs: Sequence[ClassCell]) -> str:
    """NOISE_OF's goodput (with its control's, with_copy) over DIRECT's, pooled over the runs
    where both are known: against the baseline server straight, where that is the better fixed
    choice (the earlier sets' reference, all-spec straight aside)."""
    known = [
        (with_copy(c, NOISE_OF, functools.partial(c.versus, other=DIRECT)), c.targets[DIRECT].goodput_req_s)
        for c in runs
        if DIRECT in c.targets and c.versus(NOISE_OF, DIRECT) is not None
    ]
    return _pooled_over(known, len(runs), len(runs)) if known else "unknown"


def _pooled_over(known: Sequence[tuple[float, float]], ran: int, runs: int) -> str:
    """sum(a) / sum(b) over the (a, b) pairs known, with its interval (bootstrap_interval) where at most
    POOLED_MAX_UNKNOWN of the `ran` runs that could know one did not; `runs` in all."""
    pooled = sum(a for a, _ in known) / sum(b for _, b in known)
    interval = bootstrap_interval(known) if ran - len(known) <= POOLED_MAX_UNKNOWN * ran else None
    extra = "" if interval is None else f" ({CONFIDENCE:.0%} interval {interval[0]:.2f}x-{interval[1]:.2f}x)"
    return f"pooled {pooled:.2f}x{extra} over {len(known)} of {runs} runs"


def summary_lines(cells: Sequence[ClassCell]) -> list[str]:
    out = []
    by_cell = repeated(cells)
    several = any(len(runs) > 1 for runs in by_cell.values())
    for n in (g for g in GATES if any(g in c.targets for c in cells)):
        gv = [cell_verdict(runs, n) for runs in by_cell.values()]
        hv = [runs_verdict(runs, n, hit_verdict) for runs in by_cell.values()]
        tok_s = [v for v in gv if v.endswith(ON_TOK_S)]
        out.append(
            f"{n}: goodput target met in {gv.count('met')}, missed in {gv.count('missed')}, unknown in "
            f"{len(gv) - gv.count('met') - gv.count('missed')} of {len(by_cell)} cells"
            + (
                " (where neither fixed target met the SLOs, on output tokens a second: "
                f"met in {tok_s.count('met' + ON_TOK_S)}, missed in {tok_s.count('missed' + ON_TOK_S)}, "
                f"unknown in {tok_s.count('unknown' + ON_TOK_S)})"
                if tok_s
                else ""
            )
            + f"; hit rate within {HIT_POINTS:.0%} of the oracle in "
            f"{hv.count('met')}, missed in {hv.count('missed')}, unknown in {hv.count('unknown')}"
            + (
                f" (a cell's verdict: its runs', where they all agree; else, over {POOLED_MIN_RUNS} runs or more, "
                f"by their pooled ratio's {CONFIDENCE:.0%} interval)"
                if several
                else ""
            )
        )
    if any(CONTROL in c.targets for c in cells):
        for (context, sessions), runs in by_cell.items():
            spread = ", ".join(_ratio(c.versus(CONTROL, NOISE_OF)) for c in runs)
            out.append(f"{CONTROL} / {NOISE_OF} at {context_label(context)}/{sessions} (the noise): {spread}")
    for (context, sessions), runs in by_cell.items():
        hop = hop_line(runs)
        if hop:
            out.append(f"the hop at {context_label(context)}/{sessions}: {hop}")
            out.append(f"{NOISE_OF} at {context_label(context)}/{sessions} over {DIRECT}: {direct_line(runs)}")
    if several:
        for (context, sessions), runs in by_cell.items():
            ratios = ", ".join(_vs_best(c, "features") for c in runs)
            plural = "s" if len(runs) > 1 else ""
            out.append(
                f"features at {context_label(context)}/{sessions} over {len(runs)} run{plural} (seeds "
                f"{', '.join(str(c.seed) for c in runs)}): {ratios}; pooled {_pooled(runs, 'features')}: "
                f"{cell_verdict(runs, 'features')}"
            )
    known = raw = closer = 0
    for c in cells:
        f, s = oracle_gap(c, "features"), oracle_gap(c, "smg")
        if f is None or s is None:
            continue
        hit_f, hit_s = c.targets["features"].prefix_cache_hit_rate, c.targets["smg"].prefix_cache_hit_rate
        known, closer = known + 1, closer + (f <= s)
        raw += hit_f is not None and hit_s is not None and hit_f >= hit_s
    if known:
        out.append(
            f"features against smg: hit rate at least smg's in {raw} of {known} {'runs' if several else 'cells'} "
            "where both are known; "
            f"no further from its own oracle than smg from its own in {closer}"
        )
    measured = [(c, g) for c in cells if ORACLE in c.targets and (g := measured_oracle_gap(c, "features")) is not None]
    if measured:
        out.append(
            f"features against the best oracle routing measured beside it (all-spec, all-base, {ORACLE}; each "
            f"against its own estimate): within {HIT_POINTS:.0%} of it or above in "
            f"{sum(1 for _, g in measured if g <= HIT_POINTS)} of {len(measured)} {'runs' if several else 'cells'} "
            "where all are known (points short: "
            + ", ".join(f"{context_label(c.context)}/{c.sessions} {_points(g)}" for c, g in measured)
            + ")"
        )
    warned = sum(1 for c in cells if c.cpu_warning)
    if warned:
        out.append(
            f"warning: the machine's CPU was saturated in {warned} of {len(cells)} runs: their timings stretched"
        )
    return out
