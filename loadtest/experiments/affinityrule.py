"""`python -m loadtest headtohead-affinity`: cache affinity's rule among a role's servers, side by side
(issue 28): a conversation's next turn stays on the server holding its cache unless that server's
cost exceeds the best alternative's by more than the re-prefill staying saves.

    python -m loadtest headtohead-affinity [--contexts 8k] [--sessions 16,48] [--baseline-servers 2]
                                           [--repeats 8] [--out-dir DIR]

Every target is specgate as headtohead-classes' `features` (SPECGATE_POLICY=model, or --policy
adaptive, from a calibration; SPECGATE_TOPOLOGY=pooled, classes from x-specgate-class, sessions by
x-session-id) in front of a pool of its own: one speculative server and --baseline-servers baseline ones, each a
simulated H200 (`--profile h200-llama8b`) with a GPU of its own, and the same two classes of
multi-turn traffic as headtohead-classes (accepting about 1.3 and 3.0 tokens a step):

  priced       the rule priced in stream-seconds, at the fitted step times and
               SPECGATE_PREFILL_TOK_S (its default, 20,000) (SPECGATE_AFFINITY_RULE=priced);
  both         a turn moves only where the priced rule and the rule by requests in flight would
               each move it (SPECGATE_AFFINITY_RULE=both);
  in-flight    requests in flight stand for the cost, a thousand cached tokens for one request
               (SPECGATE_AFFINITY_RULE=in_flight: the rule before it was priced);
  no-affinity  SPECGATE_AFFINITY_ENTRIES=0: every turn to the least loaded server of its role.

The calibration is headtohead-classes' for a pooled 1+1, with the speed model's fit (a sweep at
1,000-token prompts beside the traffic's own; `--calibrations DIR` reuses one, which the model
policy needs with a fit), read by each specgate for its role's servers. Under --policy adaptive
the rule is never priced (the curves are not), and `priced` runs as `in-flight` does.

Scored per cell, in simulated time: each target's goodput (requests finishing in the window within
--slo-ttft-ms and --slo-tpot-ms), its prefix-cache hit rate and the oracle's (every turn back on
the server of its last turn, nothing evicted), and the turns each specgate moved off their server
for load (specgate_affinity_breaks_total{reason="load"}, over
the whole run). Over --repeats runs (sessions drawn from seeds --seed, --seed + 1, ...), `priced`
over each other target, and `both` over `in-flight`, pooled (the goodputs summed over the runs),
with the 90% bootstrap interval of that ratio over runs: better or worse where the interval clears
1, else no difference measured.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from proxy.fleet.promtext import by_label, totals

from ..args import count, level_tuple, names, positive
from ..classes import summarise_class
from ..kit.cells import Servers, run_stacks, say_goodput
from ..kit.command import add_command, add_run_options, check_max_tokens, conclude, say
from ..kit.figures import NO_GOODPUT, TargetCell, target_cell
from ..kit.multiturn import context_label, context_list, default_time_scale, sizes_for
from ..kit.processes import Fleet
from ..kit.sampling import get_text
from ..kit.settings import settings_env, specgate_env
from ..sweep import make_session
from .twoclass.plan import ClassPlan
from .twoclass.pooled import POOLED_MAX_UNKNOWN, bootstrap_interval
from .twoclass.run import run_cells
from .twoclass.score import oracle_hit_rate

TARGETS = ("priced", "both", "in-flight", "no-affinity")
POLICIES = ("model", "adaptive")
# The speed model's sweep beside the traffic's own: a context far from 8k's, so that the fit's
# KV term is known.
FIT_PROMPT_TOKENS = "1000"
PRICED = "priced"
# The pairs the summary compares, each (target, other).
COMPARED = (*((PRICED, other) for other in TARGETS[1:]), ("both", "in-flight"))
# Stacks whose servers a time scale of headtohead's is made for: three, of two servers each.
REFERENCE_SERVERS = 6


# Prompt tokens a second a server prefills, under the priced rules (SPECGATE_PREFILL_TOK_S's
# default until 2026-12-07).
PRICED_PREFILL_TOK_S = 20_000.0


def target_settings(target: str, policy: str = "model") -> dict[str, object]:
    """specgate's settings (Settings' fields) for a target under `policy`."""
    features: dict[str, object] = {"policy": policy, "class_key": "header", "topology": "pooled"}
    if target == "priced":
        return {**features, "affinity_rule": "priced"}
    if target == "both":
        return {**features, "affinity_rule": "both"}
    if target == "in-flight":
        return {**features, "affinity_rule": "in_flight"}
    if target == "no-affinity":
        return {**features, "affinity_entries": 0}
    raise ValueError(f"{target!r} is not a target")


@dataclass(frozen=True)
class AffinityPlan(ClassPlan):
    """headtohead-classes' plan on a pool (its traffic, windows and calibration), with
    `baselines` baseline servers a target."""

    topology: str = "pooled"
    baselines: int = 2
    policy: str = "model"
    # The rules run side by side (--targets): fewer stacks, a faster time scale on a small machine.
    rules: tuple[str, ...] = TARGETS

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 1 <= self.baselines <= 8:
            raise ValueError("--baseline-servers must be 1 to 8")
        if len(self.rules) < 2 or len(set(self.rules)) < len(self.rules) or not set(self.rules) <= set(TARGETS):
            raise ValueError(f"--targets: two or more of {', '.join(TARGETS)}")
        if self.policy not in POLICIES:
            raise ValueError(f"--policy: one of {', '.join(POLICIES)}")

    def time_scale(self, sessions: int, context: int) -> float:
        """headtohead's, times this run's simulated servers over its three stacks of two."""
        servers = len(self.rules) * (1 + self.baselines)
        return round(default_time_scale(sessions, context) * servers / REFERENCE_SERVERS, 4)

    def baseline_args(self, time_scale: float, port: int) -> list[str]:
        """One more baseline server, a GPU of its own, as the pair's (ClassPlan.pair)."""
        return ["-m", "loadtest.simulator", "--role", "baseline", "--port", str(port), "--log-level", "warning",
                "--profile", self.profile, "--enable-cache-report", "--time-scale", f"{time_scale:g}"]  # fmt: skip


@dataclass
class AffinityCell:
    context: int
    sessions: int
    time_scale: float
    targets: dict[str, TargetCell]
    oracle_hit: dict[str, float | None] = field(default_factory=dict)
    # Turns each specgate moved off the server holding their cache for its load, and kept there.
    breaks: dict[str, float | None] = field(default_factory=dict)
    hits: dict[str, float | None] = field(default_factory=dict)
    cpu_busy: float | None = None
    # Where the machine was too busy for its timings to be trusted (kit.sampling.cpu_use), why.
    cpu_warning: str | None = None
    seed: int = 0


async def _scrape(urls: Mapping[str, str]) -> dict[str, tuple[float | None, float | None]]:
    """Each specgate's (affinity breaks for load, affinity hits) from its /metrics; None where unread."""
    out: dict[str, tuple[float | None, float | None]] = {}
    async with make_session() as session:
        for target, url in urls.items():
            try:
                text = await get_text(session, url + "/metrics")
            except (aiohttp.ClientError, TimeoutError):
                out[target] = (None, None)
                continue
            breaks = by_label(text, "specgate_affinity_breaks_total", "reason").get("load")
            out[target] = breaks, totals(text, ("specgate_affinity_hits_total",)).get("specgate_affinity_hits_total")
    return out


def stack_env(
    target: str, port: int, servers: dict[str, str], time_scale: float, calibration: Path, policy: str = "model"
) -> dict[str, str]:
    """SPECGATE_* for a target's specgate in front of `servers` (speculative, then b0, b1, ...)."""
    baselines = ",".join(f"{name}={url}" for name, url in servers.items() if name != "speculative")
    settings = {**target_settings(target, policy), "calibration": calibration}
    if target in ("priced", "both"):
        # The priced rules price with a prefill rate, off by default since the mechanism benchmark:
        # the rate these runs always had, scaled to the simulators' clock.
        settings["prefill_tok_s"] = f"{PRICED_PREFILL_TOK_S * time_scale:g}"
    return specgate_env(port, servers["speculative"], baselines, time_scale) | settings_env(settings)


def start_stacks(plan: AffinityPlan, sessions: int, context: int, calibration: Path) -> Servers:
    t = plan.time_scale(sessions, context)
    urls: dict[str, str] = {}
    servers: dict[str, dict[str, str]] = {}
    with (fleet := Fleet()).stopped_on_error():
        for target in plan.rules:
            pair, more = functools.partial(plan.pair, t), functools.partial(plan.baseline_args, t)
            servers[target] = fleet.start_pool(f"pool-{target}", pair, more, plan.baselines)
        fleet.ready()
        for target in plan.rules:
            urls[target] = fleet.start_specgate(
                f"specgate-{target}",
                functools.partial(stack_env, target, servers=servers[target], time_scale=t, calibration=calibration,
                                  policy=plan.policy),
            )  # fmt: skip
        fleet.ready()
    return Servers(urls=urls, servers=servers, fleet=fleet)


def run_cell(plan: AffinityPlan, context: int, sessions: int, calibration: Path, quiet: bool) -> AffinityCell:
    t = plan.time_scale(sessions, context)
    say(f"  {sessions} sessions (time scale {t:g}): {len(plan.rules)} pools of 1+{plan.baselines}...", quiet)
    scraped: dict[str, tuple[float | None, float | None]] = {}
    stacks = start_stacks(plan, sessions, context, calibration)
    cap, cpu = run_stacks(plan, context, sessions, stacks, True, lambda s: scraped.update(asyncio.run(_scrape(s.urls))))
    slo = plan.wall_slo(sessions, context)
    system = sizes_for(context, plan.turns, plan.max_tokens).system_tokens
    cell = AffinityCell(
        context, sessions, t, {}, cpu_busy=cpu.machine_busy_mean, seed=plan.seed, cpu_warning=cpu.warning
    )
    for name in plan.rules:
        run = cap.runs[name]
        everything = summarise_class("all", run.results, run.t0, run.t1, slo)
        stats = run.stats(slo, plan.min_requests)
        cell.targets[name] = target_cell(name, stats, everything, t, cap.mean_queued(name))
        cell.oracle_hit[name] = oracle_hit_rate(run.results, run.t0, run.t1, system)
        cell.breaks[name], cell.hits[name] = scraped[name]
    say_goodput(cell.targets, cpu, quiet)
    return cell


# ---------------------------------------------------------------------------------------------
# Scoring: pure


def pairs(runs: Sequence[AffinityCell], target: str, other: str) -> list[tuple[float, float]]:
    """(target's goodput, other's) of each run where both are conclusive."""
    out = []
    for c in runs:
        a, b = c.targets[target], c.targets[other]
        if a.conclusive and b.conclusive:
            out.append((a.goodput_req_s, b.goodput_req_s))
    return out


def comparison(runs: Sequence[AffinityCell], target: str, other: str) -> str:
    """target over other, pooled over the runs, with its interval and what it says."""
    known = pairs(runs, target, other)
    below = sum(b for _, b in known)
    if not known or below < NO_GOODPUT:
        return f"{target} / {other}: unknown (no conclusive run with goodput)"
    ratio = sum(a for a, _ in known) / below
    interval = bootstrap_interval(known)
    if interval is None:
        return f"{target} / {other}: {ratio:.2f}x over {len(known)} runs (too few for an interval)"
    lo, hi = interval
    verdict = "better" if lo > 1 else "worse" if hi < 1 else "no difference measured"
    dropped = len(runs) - len(known)
    if dropped > POOLED_MAX_UNKNOWN * len(runs):
        # The runs left out are those a stack was too slow in to finish enough requests: pooling the
        # rest would judge without its worst.
        verdict = f"unknown ({dropped} of {len(runs)} runs inconclusive)"
    return f"{target} / {other}: {ratio:.2f}x over {len(known)} runs (90% interval {lo:.2f}x-{hi:.2f}x): {verdict}"


def _mean(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def summary_lines(cells: Sequence[AffinityCell]) -> list[str]:
    by_cell: dict[tuple[int, int], list[AffinityCell]] = {}
    for c in cells:
        by_cell.setdefault((c.context, c.sessions), []).append(c)
    lines = []
    for (context, sessions), runs in by_cell.items():
        lines.append(f"{context_label(context)}/{sessions} ({len(runs)} runs):")
        present = [n for n in TARGETS if all(n in c.targets for c in runs)]
        for name in present:
            # Every figure over the same runs: those in which this target was conclusive.
            ok = [c for c in runs if c.targets[name].conclusive]
            good = _mean([c.targets[name].goodput_req_s for c in ok])
            hit = _mean([c.targets[name].prefix_cache_hit_rate for c in ok])
            oracle = _mean([c.oracle_hit[name] for c in ok])
            breaks = _mean([c.breaks.get(name) for c in ok])
            some = "" if len(ok) == len(runs) else f" ({len(ok)} of {len(runs)} runs conclusive)"
            lines.append(
                f"  {name:<12} goodput {'-' if good is None else f'{good:.2f}'} req/s, hit {_pct(hit)} "
                f"(oracle {_pct(oracle)}), load breaks {'-' if breaks is None else f'{breaks:.0f}'} a run{some}"
            )
        warned = sum(1 for c in runs if c.cpu_warning)
        if warned:
            lines.append(
                f"  warning: the machine's CPU was saturated in {warned} of {len(runs)} runs: timings stretched"
            )
        for target, other in COMPARED:
            if target in present and other in present:
                lines.append("  " + comparison(runs, target, other))
    return lines


# ---------------------------------------------------------------------------------------------
# Command


def has_fit(path: Path) -> bool:
    """Whether a calibration file holds the speed model's fit."""
    try:
        return bool(json.loads(path.read_text()).get("model"))
    except (OSError, ValueError, AttributeError):
        return False


def run(plan: AffinityPlan, out_dir: Path, reuse: Path | None, quiet: bool) -> dict[str, Any]:
    def check(path: Path) -> None:
        if plan.policy == "model" and not has_fit(path):
            raise ValueError(f"--policy model: {path} has no speed model fit; calibrate afresh or --policy adaptive")

    cells = run_cells(plan, out_dir, reuse, quiet, run_cell, "headtohead-affinity", FIT_PROMPT_TOKENS, check)
    return {"settings": vars(plan), "cells": cells, "summary": summary_lines(cells)}


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = add_command(
        sub,
        "headtohead-affinity",
        "cache affinity's rule among a role's servers: priced, by requests in flight, and none (issue 28)",
        __doc__,
    )
    p.add_argument("--contexts", type=context_list, default=(8000,), help="comma list (default 8k)")
    p.add_argument("--sessions", type=level_tuple, default=(16, 48), help="comma list (default 16,48)")
    p.add_argument("--baseline-servers", type=int, default=2, help="baseline servers in each pool (default 2)")
    p.add_argument("--policy", choices=POLICIES, default="model",
                   help="the specgates' policy (default model, the one whose affinity rule is priced)")  # fmt: skip
    p.add_argument("--turns", type=count, default=4)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--window-s", type=positive, default=12.0, help="simulated seconds (default 12)")
    p.add_argument("--repeats", type=count, default=1, help="runs of each cell, seeds --seed, --seed + 1, ...")
    p.add_argument("--targets", type=names, default=TARGETS,
                   help=f"comma list of the rules side by side (default {','.join(TARGETS)})")  # fmt: skip
    p.add_argument("--calibrations", default=None, metavar="DIR",
                   help="reuse a pooled headtohead-classes (or this command's) run's calibrations")  # fmt: skip
    add_run_options(p, "a cell needs per target", "headtohead-affinity-results")


def cmd_headtohead_affinity(args: argparse.Namespace) -> int:
    check_max_tokens(args.max_tokens)
    plan = AffinityPlan(
        contexts=args.contexts, sessions=args.sessions, turns=args.turns, max_tokens=args.max_tokens,
        window_s=args.window_s, max_window_s=max(60.0, args.window_s), seed=args.seed,
        min_requests=args.min_requests, repeats=args.repeats, baselines=args.baseline_servers, policy=args.policy,
        rules=args.targets,
    )  # fmt: skip
    out_dir = Path(args.out_dir)
    started = time.monotonic()
    report = run(plan, out_dir, Path(args.calibrations) if args.calibrations else None, args.quiet)
    report["wall_s"] = round(time.monotonic() - started, 1)
    conclude(out_dir, "headtohead-affinity", report, report["summary"], started, wall_s=report["wall_s"])
    return 0
