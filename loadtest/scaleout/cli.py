"""`python -m loadtest scaleout`: several groups of servers behind several specgate replicas (issue #16).

    python -m loadtest scaleout [--topology paired|pooled] [--groups 2] [--replicas 3]
                                [--speculative-servers 2] [--baseline-servers 2]
                                [--concurrency 2,5,10,20,40,80] [--level-s 45] [--settle-s 15]
                                [--high H --low L | --calibration FILE] [--spread request|worker]
                                [--time-scale 1] [--sequential] [--out-dir scaleout-results]

Three configurations run with the same servers and replicas, each in front of fresh simulators of
its own: "specgate" (SPECGATE_POLICY=threshold with the watermarks), "all-speculative" (both
watermarks 100000: no group ever leaves speculation) and "all-baseline" (SPECGATE_HIGH_WATERMARK=0).
Every replica has SPECGATE_LOAD_SIGNAL=engine: it routes on the engines' own running and queued
counts, which all replicas read alike, rather than on the requests it sent itself.

Topologies. paired (default): G simulated pairs (`python -m loadtest.simulator pair --shared-gpu`),
the i-th speculative and baseline server sharing one compute budget and forming specgate's group-i
(SPECGATE_TOPOLOGY=paired); the watermarks are a group's. pooled: S speculative and B baseline
servers, each a simulator process of its own (disjoint budgets), SPECGATE_TOPOLOGY=pooled; the mode
follows the total load, so the per-pair watermarks are multiplied by S (pass --high/--low when S and
B differ: the pools then cross elsewhere). Without --high/--low or --calibration, one fresh pair is
calibrated first (`python -m loadtest calibrate --save OUT_DIR/calibration.json`, diverse prompts).

Load. Closed-loop, one continuous run per configuration, the levels (total streams over all
replicas) in rising order: at each level's start, workers are added up to the level, so a level
step is a step in load that the running replicas see as such. Requests go to the replicas
round-robin per request (--spread request, the default: what an L7 balancer in front of the
replicas does, and every replica sees traffic even at 2 streams), or per worker (--spread worker:
each client pinned to one replica, as a kept-alive connection through an L4 balancer; at fewer
streams than replicas some replicas then see none).

Measured at the servers, from their own /metrics (scraped at each level's boundaries, and every 0.5 s
at time scale 1, at most every 0.2 s of wall time):

- output tok/s: the servers' generation-token counters over each level's scored part (after its
  first --settle-s seconds), summed over the configuration's servers; the load generator's own count
  is reported beside it. specgate / better: specgate's over the higher of all-speculative's and
  all-baseline's (target >= 0.95). A level is inconclusive where any configuration had too few good
  requests (stats.min_ok_requests; client errors are never the servers'). An inconclusive figure is
  neither a miss nor a pass: a target met at every conclusive level reads "unknown" while any is
  inconclusive (report.target_verdict).
- group split (paired): each group's share of the output tokens over the scored part; "within 15% of
  even" means every group's share s satisfies |s * G - 1| <= 0.15 (the deviation printed).
- in-flight split (paired, reported, no target): the same deviation of the requests in flight in
  each group (the servers' running + queued, below), sample by sample, averaged over the scored part:
  load that sloshes from group to group evens out over a window but not here.
- mode switches (paired and pooled): per replica and group, specgate_group_mode_switches_total's
  increase from a level's start to the next level's start (the step and what follows it; target at
  most one). With one group and a specgate that exports no group metrics, specgate_mode_switches_total
  stands in; otherwise "n/a".
- drift between replicas (specgate, reported, no target): each replica's /metrics is read at every
  round of samples too: specgate_group_load (specgate_load with one group), the load its policy
  compares with the watermarks, and specgate_server_inflight, its own requests. Per group and round,
  the spread (max - min) of the replicas' loads: mean and p95 over the scored part (the worst
  group's), and the largest over the whole level, step included, in requests and as a share of the
  band high - low (docs: keep the band wider than the drift). Against the truth: each replica's
  load minus the group's servers' running + queued at the same round (trusted and aligned as for the
  in-flight split; SGLang's gauges refresh at prefill and every 40 decode steps, so this truth lags
  too), mean |error| and mean (bias); and minus the replicas' own in-flight added up (exact but for
  the ms between their scrapes): the error of the others' part alone.
- in-flight imbalance (pooled): each server's running + queued requests (sglang:num_running_reqs +
  num_queue_reqs), averaged over the scored part's periodic samples; per role, the busiest server's
  mean over the role's mean per server (target <= 1.3). SGLang's gauges freeze when a server goes idle,
  so a sample whose server generated no token since the previous sample counts 0 in flight. A role
  whose servers held under 0.5 on average is idle at that level and not scored; fewer than 10 samples
  make it inconclusive.

- the profile at the loads held (all-speculative, all-baseline): at each round of samples, the
  profile's throughput of each server at its in-flight (scaled to add up to the level), summed and
  averaged; over the same at an even split it is what uneven load moment by moment costs (the
  profile is concave), and all-baseline's measured throughput over it is how well the simulators
  kept time (below 90%: they could not, for CPU).

The configurations run side by side, at the same time (or one after another with --sequential),
and the report gives the machine's CPU use and warns when it was saturated. Times are
wall-clock seconds; with --time-scale T the simulators run T times faster and specgate's time
settings (health and scrape intervals, the staleness of engine gauges) are divided by T.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import time
from pathlib import Path
from typing import Any

from ..args import count, level_tuple, non_negative, positive
from ..kit.command import add_command, add_run_options, check_max_tokens, check_profile, check_settle, conclude, say
from ..kit.processes import fresh_start
from ..kit.sampling import CpuUse
from .plan import (
    BUSY_MIN,
    CONFIGS,
    IMBALANCE_TARGET,
    MAX_SWITCHES,
    MIN_SAMPLES,
    RATIO_TARGET,
    SPLIT_TOLERANCE,
    ScaleoutPlan,
    Watermarks,
    config_watermarks,
    describe,
    gate_env,
    watermarks_from,
)
from .plot import plot_scaleout
from .report import cpu_lines, drift_lines, level_table, profile_lines, verdicts, warnings
from .run import ConfigRun, calibrate_pair, run_batch, samples_of
from .score import LevelReport, score


def run_scaleout(
    plan: ScaleoutPlan, out_dir: Path, wm: Watermarks | None, quiet: bool
) -> tuple[dict[str, Any], dict[str, ConfigRun]]:
    out_dir.mkdir(parents=True, exist_ok=True)
    if wm is None:
        wm = watermarks_from(calibrate_pair(plan, out_dir, quiet), plan)
    say(f"watermarks high={wm.high} low={wm.low} ({wm.source})", quiet)
    batches = [[name] for name in CONFIGS] if plan.sequential else [list(CONFIGS)]
    runs: dict[str, ConfigRun] = {}
    cpu: dict[str, CpuUse] = {}
    for names in batches:
        done, use = fresh_start(functools.partial(run_batch, plan, names, wm, quiet), quiet)
        label = " + ".join(names) if len(names) > 1 else names[0]
        cpu[label] = use
        runs.update({run.name: run for run in done})
    levels = score(plan, runs)
    settings = {
        **vars(plan),
        "watermarks": {"high": wm.high, "low": wm.low, "source": wm.source},
        "specgate_env": {
            name: {
                k: v
                for k, v in gate_env(plan, [], 0, *config_watermarks(name, wm)).items()
                if k not in ("SPECGATE_PORT", "SPECGATE_SPECULATIVE_URL", "SPECGATE_BASELINE_URL")
            }
            for name in CONFIGS
        },
        "servers": {name: [dataclasses.asdict(s) for s in run.servers] for name, run in runs.items()},
        "sample_s": plan.sample_s,
        "targets": {
            "ratio": RATIO_TARGET,
            "split_tolerance": SPLIT_TOLERANCE,
            "max_switches": MAX_SWITCHES,
            "imbalance": IMBALANCE_TARGET,
            "busy_min": BUSY_MIN,
            "min_samples": MIN_SAMPLES,
        },
    }
    return {
        "settings": settings,
        "levels": levels,
        "cpu": cpu,
        "verdicts": verdicts(plan, levels),
        "drift": drift_lines(levels, *config_watermarks("specgate", wm)),
        "warnings": warnings(plan, levels, cpu),
        "samples": {name: samples_of(run) for name, run in runs.items()},
    }, runs


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = add_command(
        sub,
        "scaleout",
        "several groups (or pools) of servers behind several specgate replicas, against all-speculative "
        "and all-baseline",
        __doc__,
    )
    p.add_argument("--topology", choices=("paired", "pooled"), default="paired")
    p.add_argument("--groups", type=count, default=2, help="paired: simulated pairs, one group each (default 2)")
    p.add_argument("--replicas", type=count, default=3, help="specgate replicas (default 3)")
    p.add_argument("--speculative-servers", type=count, default=2, help="pooled: speculative servers (default 2)")
    p.add_argument("--baseline-servers", type=count, default=2, help="pooled: baseline servers (default 2)")
    p.add_argument("--profile", default="crossover", help="simulator profile (default crossover)")
    p.add_argument(
        "--concurrency",
        type=level_tuple,
        default=(2, 5, 10, 20, 40, 80),
        help="comma list of levels, total streams over all replicas, run in rising order (default 2,5,10,20,40,80)",
    )
    p.add_argument("--level-s", type=positive, default=45.0, help="seconds a level (default 45)")
    p.add_argument("--settle-s", type=float, default=15.0, help="seconds at each level's start not scored (default 15)")
    p.add_argument("--time-scale", type=positive, default=1.0, help="simulators' time scale (default 1)")
    p.add_argument("--high", type=int, default=None, help="high watermark of a group (pooled: of the pool)")
    p.add_argument("--low", type=int, default=None, help="low watermark, with --high")
    p.add_argument(
        "--calibration",
        default=None,
        metavar="FILE",
        help="take the watermarks from a `calibrate --save` file of one pair (default, without --high/--low: "
        "calibrate a fresh pair first, saved to OUT_DIR/calibration.json)",
    )
    p.add_argument(
        "--spread",
        choices=("request", "worker"),
        default="request",
        help="round-robin over the replicas per request (default; an L7 balancer) or per worker (a client pinned "
        "to a replica)",
    )
    p.add_argument("--sequential", action="store_true", help="the three configurations one after another")
    p.add_argument(
        "--scrape-interval-s",
        type=positive,
        default=0.2,
        help="specgate's SPECGATE_SCRAPE_INTERVAL_S at time scale 1 (divided by the time scale; default 0.2, what "
        "the docs recommend for several replicas)",
    )
    p.add_argument(
        "--low-hold-s",
        type=non_negative,
        default=2.0,
        help="specgate's SPECGATE_LOW_WATERMARK_HOLD_S at time scale 1 (divided by the time scale; default 2, what "
        "the docs recommend for several replicas; 0: speculation returns at the first low reading)",
    )
    p.add_argument(
        "--defaults",
        action="store_true",
        help="specgate's own defaults for the scrape interval and the low-watermark hold, as a new user has them "
        "(instead of --scrape-interval-s and --low-hold-s)",
    )
    p.add_argument(
        "--live-gauges",
        action="store_true",
        help="the simulators' gauges fresh at every scrape, not SGLang's cadence (every prefill and 40 decode steps)",
    )
    p.add_argument("--max-tokens", type=int, default=128)
    add_run_options(p, "a level's scored part needs per configuration", "scaleout-results")


def plan_of(args: argparse.Namespace) -> tuple[ScaleoutPlan, Watermarks | None]:
    check_settle(args.settle_s, args.level_s, "--level-s")
    check_max_tokens(args.max_tokens)
    if (args.high is None) != (args.low is None):
        raise ValueError("--high and --low go together")
    if args.high is not None and args.calibration:
        raise ValueError("--calibration or --high/--low, not both")
    if args.high is not None and not 0 <= args.low <= args.high:
        raise ValueError(f"watermarks need 0 <= --low ({args.low}) <= --high ({args.high})")
    plan = ScaleoutPlan(
        topology=args.topology,
        groups=args.groups if args.topology == "paired" else 1,
        replicas=args.replicas,
        speculative_servers=args.speculative_servers,
        baseline_servers=args.baseline_servers,
        profile=args.profile,
        levels=args.concurrency,
        level_s=args.level_s,
        settle_s=args.settle_s,
        time_scale=args.time_scale,
        spread=args.spread,
        sequential=args.sequential,
        max_tokens=args.max_tokens,
        seed=args.seed,
        min_requests=args.min_requests,
        scrape_interval_s=None if args.defaults else args.scrape_interval_s,
        low_hold_s=None if args.defaults else args.low_hold_s,
        live_gauges=args.live_gauges,
    )
    if args.high is not None:
        return plan, Watermarks(args.high, args.low, "--high/--low")
    if args.calibration:
        return plan, watermarks_from(Path(args.calibration), plan)
    return plan, None


def cmd_scaleout(args: argparse.Namespace) -> int:
    plan, wm = plan_of(args)
    check_profile(plan.profile)
    out_dir = Path(args.out_dir)
    started = time.monotonic()
    report, runs = run_scaleout(plan, out_dir, wm, args.quiet)
    levels: list[LevelReport] = report["levels"]
    wm_set = report["settings"]["watermarks"]
    print(describe(plan))
    print(f"watermarks high={wm_set['high']} low={wm_set['low']} ({wm_set['source']})")
    lines = [
        level_table(plan, levels), "", *report["verdicts"], *report["drift"], *profile_lines(plan, levels),
        *cpu_lines(report["cpu"]), *report["warnings"],
    ]  # fmt: skip
    conclude(out_dir, "scaleout", report, lines, started, lambda path: plot_scaleout(path, plan, levels, runs))
    return 0
