"""shift's report: the table, the verdicts on the issue's targets, warnings and the CPU lines."""

from __future__ import annotations

from collections.abc import Sequence

from ..report import fmt, target_verdict
from .plan import FIDELITY_WARN, RATIO_TARGET, SETTLE_TARGET_S, STEADY_TOLERANCE, ShiftPlan
from .score import LevelReport, PhaseReport


def level_table(plan: ShiftPlan, levels: Sequence[LevelReport]) -> str:
    head = (
        f"{'c':>4} {'phase':<14} {'spec':>8} {'base':>8} {'static':>8} {'adaptive':>8} "
        f"{'static/better':>13} {'adapt/better':>12} {'adapt/static':>12} {'settle s':>8} {'mode s':>6} "
        f"{'switch a/s':>10} {'probes':>6} {'mode at end a/s':>22}"
    )
    lines = [head, "-" * len(head)]
    for lv in levels:
        for p in lv.phases:
            star = "" if p.conclusive else "*"

            def tput(name: str, p: PhaseReport = p) -> str:
                st = p.stats[name]
                return fmt(st.output_tok_s, 0) + ("" if st.conclusive else "*")

            settle = p.settle_s["adaptive"]
            settle_txt = "never" if settle is None else fmt(settle)
            mode_s = p.mode_settle_s["adaptive"]
            mode_txt = "-" if p.tie or p.better is None else "never" if mode_s is None else fmt(mode_s)
            sw = "/".join("-" if p.switches[g] is None else str(p.switches[g]) for g in ("adaptive", "static"))
            modes = "/".join(p.mode_at_end[g] or "-" for g in ("adaptive", "static"))
            better = {"speculative": "s", "baseline": "b"}.get(p.better or "", "?") + ("~" if p.tie else "")
            lines.append(
                f"{lv.concurrency:>4} {f'{p.index + 1} {p.source}':<14} {tput('speculative'):>8} "
                f"{tput('baseline'):>8} {tput('static'):>8} {tput('adaptive'):>8} "
                f"{fmt(p.vs_better['static'], 3) + star:>13} {fmt(p.vs_better['adaptive'], 3) + star:>12} "
                f"{fmt(p.adaptive_vs_static, 3) + star:>12} {settle_txt:>8} {mode_txt:>6} {sw:>10} "
                f"{'-' if p.probes is None else p.probes:>6} {modes:>22}  better: {better}"
            )
    lines.append(
        f"(output tok/s over each phase's scored part, after its first {plan.settle_s:g} s; * inconclusive: too "
        "few good requests; better: s speculative, b baseline, ~ within 5% of each other; settle s: adaptive's, "
        f"from the phase's start (the first phase: the run's), until every later {plan.rolling_s:g} s window has "
        f">= {RATIO_TARGET:.0%} of the better server's tokens and the mode stays the better server's (not "
        "checked when they tie); mode s: until the mode stays the better server's, whatever the throughput; "
        "switch a/s: mode switches of adaptive and static in the phase; probes: adaptive's, requests and shadow copies)"
    )
    return "\n".join(lines)


def _within(x: float | None, limit: float) -> bool:
    return x is not None and x <= limit


def _settle_text(x: float | None) -> str:
    return "never" if x is None else f"{x:.1f} s"


def verdicts(plan: ShiftPlan, levels: Sequence[LevelReport]) -> list[str]:
    """The issue's targets, each with the figures that decide it. A throughput figure from a phase
    with too few good requests is no evidence: such a phase is neither a miss nor a pass."""
    phases = [(lv.concurrency, p) for lv in levels for p in lv.phases]
    shifts = [(c, p) for c, p in phases if p.index > 0]
    measured = [(c, p) for c, p in phases if p.conclusive]

    def where(c: int, p: PhaseReport) -> str:
        return f"c={c} phase {p.index + 1} ({p.source})"

    incon = [where(c, p) for c, p in phases if not p.conclusive]
    low = [
        f"{where(c, p)}: {fmt(p.vs_better['adaptive'], 3)}"
        for c, p in measured
        if not p.vs_better["adaptive"] >= RATIO_TARGET
    ]
    lines = [
        target_verdict(
            f"adaptive >= {RATIO_TARGET}x the better server in every phase once settled", low, incon, len(measured)
        )
    ]
    if plan.shifting:
        target = plan.settle_target_s
        # Which server was better, and so when the adaptive settled, is unknown in an inconclusive phase.
        scored = [(c, p) for c, p in shifts if p.conclusive]
        late = [
            f"{where(c, p)}: {_settle_text(p.settle_s['adaptive'])}"
            for c, p in scored
            if not _within(p.settle_s["adaptive"], target)
        ]
        scale = f", here {plan.time_scale:g}" if plan.time_scale != 1 else ""
        label = f"adaptive settled within {target:g} s of every shift ({SETTLE_TARGET_S:g} s at time scale 1{scale})"
        unsettled = [where(c, p) for c, p in shifts if not p.conclusive]
        lines.append(target_verdict(label, late, unsettled, len(scored)))
        many = [f"{where(c, p)}: {p.switches['adaptive']}" for c, p in shifts if (p.switches["adaptive"] or 0) > 1]
        lines.append(target_verdict("adaptive at most one mode switch per shift", many, [], len(shifts)))
        cold = [
            f"c={c}: settled {_settle_text(p.settle_s['adaptive'])} from the start, {p.switches['adaptive']} switches"
            for c, p in phases
            if p.index == 0
        ]
        lines.append("(first phase, a cold start rather than a shift: " + "; ".join(cold) + ")")
    else:
        # Traffic that does not shift: adaptive should cost nothing against the static watermarks.
        # Above static is no miss: static's watermarks may have been measured on other prompts.
        off = [
            f"{where(c, p)}: {fmt(p.adaptive_vs_static, 3)}"
            for c, p in measured
            if not p.adaptive_vs_static >= 1.0 - STEADY_TOLERANCE
        ]
        label = f"adaptive within {STEADY_TOLERANCE:.0%} of static (or above it) on traffic that does not shift"
        lines.append(target_verdict(label, off, incon, len(measured)))
    if incon:
        lines.append("* inconclusive (too few good requests on some target): " + "; ".join(incon))
    return lines


def warnings(levels: Sequence[LevelReport]) -> list[str]:
    out = []
    for lv in levels:
        if lv.cpu.warning:
            out.append(f"warning: c={lv.concurrency}: {lv.cpu.warning}")
        slow = [p for p in lv.phases if p.baseline_fidelity < FIDELITY_WARN]
        if slow:
            worst = min(p.baseline_fidelity for p in slow)
            out.append(
                f"warning: c={lv.concurrency}: the baseline alone reached only {worst:.0%} of its profile's "
                "throughput: the simulators could not keep time (CPU)"
            )
        if any(lv.errors.values()):
            out.append(f"warning: c={lv.concurrency}: server errors {lv.errors}")
        if any(lv.client_errors.values()):
            out.append(f"note: c={lv.concurrency}: client errors (not the servers') {lv.client_errors}")
    return out


def cpu_lines(levels: Sequence[LevelReport]) -> list[str]:
    return [lv.cpu.line(f"c={lv.concurrency}") for lv in levels]
