"""scaleout's report: the table, the verdicts on the issue's targets, drift, profile and CPU lines."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from ..kit.sampling import CpuUse
from ..measures import ratio
from ..report import fmt, target_verdict
from .drift import Drift
from .plan import (
    CONFIGS,
    CPU_BUSY_WARN,
    FIDELITY_WARN,
    FIXED,
    IMBALANCE_TARGET,
    MAX_SWITCHES,
    MIN_SAMPLES,
    NO_GROUP_SWITCHES,
    RATIO_TARGET,
    SPLIT_TOLERANCE,
    ScaleoutPlan,
)
from .score import LevelReport


def _switch_text(switches: Sequence[dict[str, int] | None], groups: Sequence[str]) -> str:
    if any(s is None for s in switches):
        return "n/a"
    return " | ".join(",".join(str(s.get(g, 0)) for s in switches if s is not None) for g in groups)


def _mode_text(modes: Sequence[Mapping[str, str]], groups: Sequence[str]) -> str:
    return " | ".join("".join((m.get(g) or "?")[0] for m in modes) for g in groups)


def _imb(x: float | None) -> str:
    return "idle" if x is None else fmt(x, 2)


def _signed(x: float) -> str:
    return "-" if math.isnan(x) else f"{round(x, 1) + 0.0:+.1f}"  # + 0.0: no "-0.0"


def _drift_text(d: Drift | None) -> tuple[str, str]:
    """(drift mean/p95, error |mean|/bias) for the table."""
    if d is None:
        return "-", "-"
    return f"{fmt(d.worst_mean)}/{fmt(d.worst_p95)}", f"{fmt(d.error_abs)}/{_signed(d.error_bias)}"


def level_table(plan: ScaleoutPlan, levels: Sequence[LevelReport]) -> str:
    groups = plan.group_names()
    paired = plan.topology == "paired"
    middle = (
        f"{'group shares (sg)':>17} {'dev sg/spec/base':>16} {'inst dev':>8}"
        if paired
        else (f"{'spec max/mean sg|all':>20} {'base max/mean sg|all':>20}")
    )
    head = (
        f"{'streams':>7} {'specgate':>9} {'all-spec':>9} {'all-base':>9} {'sg/better':>9} {middle} "
        f"{'switches per replica':>20} {'modes at end':>14} {'drift m/p95':>11} {'err |m|/bias':>12} {'CPU':>4}"
    )
    lines = [head, "-" * len(head)]
    for lv in levels:
        star = "" if lv.conclusive else "*"
        sg = lv.configs["specgate"]

        def tput(name: str, lv: LevelReport = lv) -> str:
            cl = lv.configs[name]
            return fmt(cl.tok_s, 0) + ("" if cl.conclusive else "*")

        if paired:
            shares = "/".join(f"{v:.0%}" if not math.isnan(v) else "-" for v in sg.group_shares.values())
            devs = "/".join(fmt(lv.configs[n].split_deviation, 2) for n in CONFIGS)
            mid = f"{shares:>17} {devs:>16} {fmt(sg.inflight_deviation, 2):>8}"
        else:
            spec = f"{_imb(sg.role_imbalance.get('speculative'))}|" + _imb(
                lv.configs["all-speculative"].role_imbalance.get("speculative")
            )
            base = f"{_imb(sg.role_imbalance.get('baseline'))}|" + _imb(
                lv.configs["all-baseline"].role_imbalance.get("baseline")
            )
            mid = f"{spec:>20} {base:>20}"
        drift, err = _drift_text(sg.drift)
        lines.append(
            f"{lv.concurrency:>7} {tput('specgate'):>9} {tput('all-speculative'):>9} {tput('all-baseline'):>9} "
            f"{fmt(lv.vs_better, 3) + star:>9} {mid} {_switch_text(sg.switches, groups):>20} "
            f"{_mode_text(sg.modes_at_end, groups):>14} {drift:>11} {err:>12} {fmt(sg.cpu_busy * 100, 0) + '%':>4}"
        )
    where = "group" if paired else "pool"
    lines.append(
        f"(output tok/s: the servers' generation counters over each level's scored part, after its first "
        f"{plan.settle_s:g} s; * inconclusive: too few good requests; sg/better: specgate over the better of "
        "all-speculative and all-baseline; "
        + (
            "group shares: each group's share of specgate's output tokens; dev: max |share x groups - 1| of "
            "specgate, all-speculative and all-baseline; inst dev: the same of specgate's requests in flight, "
            "sample by sample, averaged (load sloshing between groups that an even total hides); "
            if paired
            else "max/mean: a role's busiest server's mean in-flight over the role's mean, specgate | the fixed "
            "configuration of that role (idle: under 0.5 in flight); "
        )
        + f"switches per replica: specgate's mode switches from the level's start to the next's, each {where} "
        f"(| between {where}s); modes at end: s speculative, b baseline, one letter a replica; "
        f"drift m/p95: at each round of samples, the spread (max - min) of specgate's replicas' load of a {where} "
        f"(what each one's policy compares with the watermarks), mean/p95 over the scored part, the worst {where}'s; "
        f"err |m|/bias: each replica's load of a {where} minus its servers' running + queued at the same round "
        "(SGLang's gauges refresh at prefill and every 40 decode steps: the truth is itself a little old), mean "
        "|error|/mean; in requests; CPU: the machine's, all cores)"
    )
    return "\n".join(lines)


def drift_lines(levels: Sequence[LevelReport], high: int, low: int) -> list[str]:
    """The largest drift between replicas, in requests and as a share of the watermarks' band (the docs
    advise keeping the band wider than the drift), and the error against the replicas' own counts."""
    band = high - low
    drifts = [(lv.concurrency, d) for lv in levels if (d := lv.configs["specgate"].drift) is not None]
    label = "drift between specgate's replicas (reported, no target; docs: keep high - low wider than it)"
    if not drifts:
        return [f"{label}: n/a (one replica, or no samples)"]

    def of_band(x: float, named: bool = False) -> str:
        if band <= 0:
            return f"no band: high = low = {high}"
        return f"{x / band:.0%} of the band" + (f" high - low = {high} - {low} = {band}" if named else "")

    c_p95, p95 = max(((c, d.worst_p95) for c, d in drifts), key=lambda x: x[1])
    c_max, top = max(((c, d.level_max) for c, d in drifts), key=lambda x: x[1])
    gateway = ", ".join(f"c={c} {fmt(d.gateway_error_abs)}/{_signed(d.gateway_error_bias)}" for c, d in drifts)
    return [
        f"{label}: largest p95 {fmt(p95)} requests at c={c_p95} ({of_band(p95, named=True)}); largest single "
        f"spread {fmt(top, 0)} at c={c_max}, its level step included ({of_band(top)})",
        "error of each replica's group load against the replicas' own requests in flight added up (exact but "
        f"for the ms between their scrapes, no engine lag: the others' part's error), |mean|/bias: {gateway}",
    ]


def verdicts(plan: ScaleoutPlan, levels: Sequence[LevelReport]) -> list[str]:
    """The issue's targets, each with the figures that decide it."""
    lines = [_ratio_verdict(levels)]
    if plan.topology == "paired":
        lines.append(_split_verdict(plan, levels))
    lines.append(_switch_verdict(plan, levels))
    if plan.topology == "pooled":
        lines.append(_imbalance_verdict(levels))
    return lines


def _ratio_verdict(levels: Sequence[LevelReport]) -> str:
    low = [
        f"c={lv.concurrency}: {fmt(lv.vs_better, 3)}"
        for lv in levels
        if lv.conclusive and not lv.vs_better >= RATIO_TARGET
    ]
    incon = [f"c={lv.concurrency}" for lv in levels if not lv.conclusive]
    return target_verdict(
        f"specgate >= {RATIO_TARGET}x the better of all-speculative and all-baseline at every level",
        low,
        incon,
        sum(1 for lv in levels if lv.conclusive),
    )


def _split_verdict(plan: ScaleoutPlan, levels: Sequence[LevelReport]) -> str:
    label = (
        f"load split between groups within {SPLIT_TOLERANCE:.0%} of even (every group's share s of the output "
        f"tokens with |s x {plan.groups} - 1| <= {SPLIT_TOLERANCE}), every configuration and level"
    )
    if plan.groups < 2:
        return f"{label}: n/a: one group"
    misses, incon, scored = [], [], 0
    for lv in levels:
        for name, cl in lv.configs.items():
            if not cl.conclusive or cl.split_deviation is None:
                incon.append(f"c={lv.concurrency} {name}")
                continue
            scored += 1
            if not cl.split_deviation <= SPLIT_TOLERANCE:
                shares = "/".join(f"{v:.0%}" for v in cl.group_shares.values())
                misses.append(f"c={lv.concurrency} {name}: {shares} (dev {fmt(cl.split_deviation, 2)})")
    return target_verdict(label, misses, incon, scored)


def _switch_verdict(plan: ScaleoutPlan, levels: Sequence[LevelReport]) -> str:
    unit = "group" if plan.topology == "paired" else "pool"
    label = f"at most {MAX_SWITCHES} mode switch per replica and {unit} per level step (specgate)"
    sw = [(lv, lv.configs["specgate"].switches) for lv in levels]
    if any(s is None for _, per in sw for s in per):
        return f"{label}: n/a: {NO_GROUP_SWITCHES}"
    many = [
        f"c={lv.concurrency} replica {i} {g}: {n}"
        for lv, per in sw
        for i, s in enumerate(per)
        if s is not None
        for g, n in s.items()
        if n > MAX_SWITCHES
    ]
    return target_verdict(label, many, [], len(sw))


def _imbalance_verdict(levels: Sequence[LevelReport]) -> str:
    label = (
        f"each role's busiest server within {IMBALANCE_TARGET}x the role's mean in-flight (levels where the "
        "role was busy, every configuration)"
    )
    misses, incon, scored = [], [], 0
    for lv in levels:
        for name, cl in lv.configs.items():
            for role, x in cl.role_imbalance.items():
                if x is None:
                    continue
                if cl.inflight_samples < MIN_SAMPLES:
                    incon.append(f"c={lv.concurrency} {name} {role} ({cl.inflight_samples} samples)")
                    continue
                scored += 1
                if not x <= IMBALANCE_TARGET:
                    misses.append(f"c={lv.concurrency} {name} {role}: {fmt(x, 2)}")
    return target_verdict(label, misses, incon, scored)


def warnings(plan: ScaleoutPlan, levels: Sequence[LevelReport], cpu: Mapping[str, CpuUse]) -> list[str]:
    out = [f"warning: {batch}: {u.warning}" for batch, u in cpu.items() if u.warning]
    for lv in levels:
        busy = max((cl.cpu_busy for cl in lv.configs.values() if not math.isnan(cl.cpu_busy)), default=math.nan)
        if busy > CPU_BUSY_WARN:
            out.append(f"warning: c={lv.concurrency}: the machine's CPU was {busy:.0%} busy: timings are stretched")
        if lv.baseline_fidelity < FIDELITY_WARN:
            out.append(
                f"warning: c={lv.concurrency}: all-baseline reached only {lv.baseline_fidelity:.0%} of its profile's "
                "throughput at the loads its servers held: the simulators could not keep time (CPU)"
            )
        for name, cl in lv.configs.items():
            if cl.stats.errors:
                out.append(
                    f"warning: c={lv.concurrency} {name}: {cl.stats.errors} server errors: {cl.stats.error_samples}"
                )
            if cl.stats.client_errors:
                out.append(
                    f"note: c={lv.concurrency} {name}: {cl.stats.client_errors} client errors (not the servers')"
                )
            off = ratio(cl.client_tok_s, cl.tok_s)
            if cl.conclusive and not abs(off - 1.0) <= 0.05:
                out.append(
                    f"note: c={lv.concurrency} {name}: the load generator counted {fmt(off, 3)}x the servers' tokens "
                    "(its own receipt times, under CPU contention, or tokens lost on the way)"
                )
    return out


def profile_lines(plan: ScaleoutPlan, levels: Sequence[LevelReport]) -> list[str]:
    fidelity = ", ".join(f"c={lv.concurrency} {fmt(lv.baseline_fidelity, 2)}" for lv in levels)
    among = "groups" if plan.topology == "paired" else "the servers of a role"
    split = ", ".join(
        f"c={lv.concurrency} " + "/".join(fmt(lv.split_efficiency.get(name, math.nan), 2) for name, _ in FIXED)
        for lv in levels
    )
    return [
        f"all-baseline over its profile at the loads its servers held: {fidelity}",
        f"the profile at the loads held over the profile at an even split among {among}, all-speculative/"
        f"all-baseline (below 1: what uneven load moment by moment costs): {split}",
    ]


def cpu_lines(cpu: Mapping[str, CpuUse]) -> list[str]:
    return [u.line(f"({batch})") for batch, u in cpu.items()]
