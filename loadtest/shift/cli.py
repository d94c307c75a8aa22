"""`python -m loadtest shift`: the prompt mix changes mid-run at a fixed concurrency (issue #13).

    python -m loadtest shift [--profile crossover] [--concurrency 10,30]
                             [--phases repetitive,diverse,repetitive] [--phase-s 60] [--settle-s 30]
                             [--time-scale 1] [--calibration FILE] [--out-dir shift-results]

At each concurrency level four targets run side by side, at the same time, each in front of a
fresh simulated pair of its own (`--shared-gpu --accept-from-prompt`, so a request's acceptance
follows how repetitive its prompt is): the speculative server alone, the baseline alone, specgate
with the static watermarks (SPECGATE_POLICY=threshold with the calibration's recommendation) and
specgate adaptive (SPECGATE_POLICY=adaptive with the calibration's curves). Load is closed-loop:
each of a target's `c` workers sends its next request when its last one ended, with prompts from
the current phase's source; phases switch at the same instants for all targets.

Without --calibration, a fresh simulated pair is calibrated first with diverse prompts
(`python -m loadtest calibrate --save OUT_DIR/calibration.json`).

Scoring. Each phase's first --settle-s seconds (after a shift, or the start) are not scored; over
the rest, each target's output tok/s counts the tokens produced inside that window
(stats.tokens_in_window), and a figure is inconclusive under the same rule as a sweep's level
(stats.min_ok_requests; client errors are never the server's), and is neither a miss nor a pass of
any target (report.target_verdict). Each specgate is compared with the better of the two servers
alone in that phase, and adaptive with static.

Settle time (after a shift, and from the start for the first phase): the earliest time t after the
phase began such that (a) every ROLLING_S (10 s at time scale 1) window starting at or after t and
ending by the phase's end has the specgate's tokens >= RATIO_TARGET (95%) of the better server's
tokens over the same window (the better of the two servers alone in that window), and (b) every
/routing sample from t to the phase's end shows the mode of the phase's better server. (b) is
waived when the two servers are within TIE (5%) of each other over the phase's scored part: then
either server meets the target, and hysteresis may rightly keep the one in use. None when no such
t leaves a full window before the phase ends ("not settled"). The mode settle time is (b) alone:
when the routing decision settled, whatever the throughput (probes, say, may still cost some).

The four targets run at once rather than one after another, so that they share the machine's
conditions (on shared CPUs those drift over minutes); the report gives the machine's CPU use and
warns when it was saturated, and the baseline alone against its profile (below 90%: the
simulators could not keep time).

Time: everything is in wall-clock seconds. With --time-scale T the simulators run T times faster,
so specgate's time settings are divided by T (its rates multiplied by T): specgate does not know
the time scale. The issue's targets (settled within 30 s at time scale 1) scale by 1/T likewise.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import math
import time
from pathlib import Path
from typing import Any

from proxy.policy.calibration import CalibrationError
from proxy.policy.calibration import load as load_calibration

from ..args import level_tuple, positive
from ..kit.command import add_command, add_run_options, check_max_tokens, check_profile, check_settle, conclude, say
from ..kit.processes import Fleet, fresh_start
from ..kit.sampling import cpu_use, self_cpu_s
from ..prompts import source
from ..report import fmt
from .plan import ADAPTIVE_SETTINGS, POLICIES, RATIO_TARGET, TIE, ShiftPlan, adaptive_settings, specgate_env
from .plot import plot_shift
from .report import cpu_lines, level_table, verdicts, warnings
from .run import calibrate_first, run_load, start_targets
from .score import LevelReport, rolling_series, score_level


def run_level(plan: ShiftPlan, c: int, calibration: str, quiet: bool) -> LevelReport:
    say(f"c={c}: starting four simulated pairs and two specgates...", quiet)
    fleet = Fleet()
    try:
        urls = start_targets(plan, calibration, fleet)
        cpu0 = self_cpu_s()
        cap = asyncio.run(run_load(plan, c, urls, quiet))
        cpu = cpu_use(cap.cpu_samples, fleet.procs, self_cpu_s() - cpu0)
    finally:
        fleet.stop()
    return LevelReport(
        concurrency=c,
        phases=score_level(plan, c, cap),
        routing=cap.routing,
        rolling=rolling_series(cap, plan),
        cpu=cpu,
        errors={n: sum(1 for r in rs if not r.ok and not r.client_error) for n, rs in cap.results.items()},
        client_errors={n: sum(1 for r in rs if r.client_error) for n, rs in cap.results.items()},
    )


def run_shift(plan: ShiftPlan, out_dir: Path, calibration: str | None, quiet: bool) -> dict[str, Any]:
    out_dir.mkdir(parents=True, exist_ok=True)
    cal = Path(calibration) if calibration else calibrate_first(plan, out_dir, quiet)
    try:
        cal_data = load_calibration(str(cal))
    except CalibrationError as exc:
        raise ValueError(f"--calibration: {exc}") from None
    say(
        f"calibration {cal}: static watermarks high={cal_data.high_watermark} low={cal_data.low_watermark} "
        f"({cal_data.verdict}); acceptance {fmt(cal_data.accept_length or math.nan, 2)}",
        quiet,
    )
    levels = [fresh_start(functools.partial(run_level, plan, c, str(cal), quiet), quiet) for c in plan.levels]
    settings = {
        **{k: v for k, v in vars(plan).items() if k != "adaptive"},
        "adaptive_settings_at_time_scale_1": adaptive_settings(plan),
        "specgate_env": {
            g: {k: v for k, v in specgate_env(p, "URL", "URL", 0, str(cal), plan).items() if "URL" not in v}
            for g, p in POLICIES.items()
        },
        "rolling_s": plan.rolling_s,
        "sample_s": plan.sample_s,
        "settle_target_s": plan.settle_target_s,
        "ratio_target": RATIO_TARGET,
        "tie": TIE,
    }
    return {
        "settings": settings,
        "calibration": {
            "path": str(cal),
            "high_watermark": cal_data.high_watermark,
            "low_watermark": cal_data.low_watermark,
            "verdict": cal_data.verdict,
            "accept_length": cal_data.accept_length,
        },
        "levels": levels,
        "verdicts": verdicts(plan, levels),
        "warnings": warnings(levels),
    }


def _phases(raw: str) -> tuple[str, ...]:
    phases = tuple(x.strip() for x in raw.split(",") if x.strip())
    if not phases:
        raise argparse.ArgumentTypeError("name at least one prompt source")
    for p in phases:
        try:
            next(source(p, 0))
        except (ValueError, OSError) as exc:
            raise argparse.ArgumentTypeError(f"{p!r}: {exc}") from None
    return phases


def _setting(raw: str) -> tuple[str, float]:
    name, sep, value = raw.partition("=")
    name = name.strip().lower().removeprefix("specgate_adaptive_").removeprefix("adaptive_")
    if not sep or name not in ADAPTIVE_SETTINGS:
        raise argparse.ArgumentTypeError(f"{raw!r}: expected NAME=VALUE, NAME one of {', '.join(ADAPTIVE_SETTINGS)}")
    try:
        return name, float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{raw!r}: {value!r} is not a number") from None


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = add_command(
        sub, "shift", "the prompt mix changes mid-run: both servers, specgate static and adaptive side by side", __doc__
    )
    p.add_argument("--profile", default="crossover", help="simulator profile (default crossover)")
    p.add_argument("--concurrency", type=level_tuple, default=(10, 30), help="comma list of levels (default 10,30)")
    p.add_argument(
        "--phases",
        type=_phases,
        default=("repetitive", "diverse", "repetitive"),
        help="comma list of prompt sources, one a phase (default repetitive,diverse,repetitive; one source: "
        "steady traffic, adaptive against static)",
    )
    p.add_argument("--phase-s", type=positive, default=60.0, help="seconds a phase (default 60)")
    p.add_argument(
        "--settle-s",
        type=float,
        default=30.0,
        help="seconds at the start of each phase that are not scored (default 30)",
    )
    p.add_argument("--time-scale", type=positive, default=1.0, help="simulators' time scale (default 1)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument(
        "--calibration",
        default=None,
        metavar="FILE",
        help="calibration specgate loads (default: calibrate a fresh simulated pair with diverse prompts first, "
        "saved to OUT_DIR/calibration.json)",
    )
    p.add_argument(
        "--adaptive-setting",
        type=_setting,
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help=f"an adaptive setting at time scale 1 (scaled like the defaults), e.g. probe_max_s=20; NAME one "
        f"of {', '.join(ADAPTIVE_SETTINGS)} (repeatable)",
    )
    add_run_options(p, "a phase's scored part needs per target", "shift-results")


def plan_of(args: argparse.Namespace) -> ShiftPlan:
    check_settle(args.settle_s, args.phase_s, "--phase-s")
    check_max_tokens(args.max_tokens)
    return ShiftPlan(
        profile=args.profile,
        levels=args.concurrency,
        phases=args.phases,
        phase_s=args.phase_s,
        settle_s=args.settle_s,
        time_scale=args.time_scale,
        max_tokens=args.max_tokens,
        seed=args.seed,
        min_requests=args.min_requests,
        adaptive=dict(args.adaptive_setting),
    )


def cmd_shift(args: argparse.Namespace) -> int:
    plan = plan_of(args)
    check_profile(plan.profile)
    out_dir = Path(args.out_dir)
    started = time.monotonic()
    report = run_shift(plan, out_dir, args.calibration, args.quiet)
    levels: list[LevelReport] = report["levels"]
    print(
        f"shift: {plan.profile} profile, prompts {' -> '.join(plan.phases)}, {plan.phase_s:g} s a phase, "
        f"time scale {plan.time_scale:g}, {plan.max_tokens} tokens a request"
    )
    lines = [level_table(plan, levels), "", *report["verdicts"], *cpu_lines(levels), *report["warnings"]]
    conclude(out_dir, "shift", report, lines, started, lambda path: plot_shift(path, plan, levels))
    return 0
