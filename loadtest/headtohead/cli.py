"""`python -m loadtest headtohead`: the honest head-to-head on one simulated H200 (Llama-3.1-8B shape).

    python -m loadtest headtohead [--accept-lengths 1.5,2.5] [--contexts 1k,8k] [--sessions 1,4,16,64,256]
                                  [--slo-ttft-ms 2000] [--slo-tpot-ms 50] [--time-scale T[,T...]]
                                  [--window-s 6] [--calibrations DIR] [--out-dir headtohead-results]

Three targets, each on a simulated H200 of its own (`--profile h200-llama8b --enable-cache-report`,
every process at the level's time scale, the same --accept-length and --spec-steps):
  baseline  one server without speculation, the whole GPU's KV pool (`--role baseline`);
  adaptive  one EAGLE-3 server choosing its draft steps per batch as SGLang's --speculative-adaptive,
            the whole GPU's KV pool less the draft's (`--role adaptive`);
  specgate  specgate (SPECGATE_POLICY=threshold) in front of a shared-GPU pair (`pair --shared-gpu`:
            both servers' weights on the one GPU, the rest of its memory split 36/64 between their
            pools, their steps serialised), with the watermarks of a calibration of that pair.

Calibration, as a user would configure specgate: per accept length and context, a fresh pair is
calibrated with the same multi-turn sessions (`loadtest calibrate --save`, kit.calibrate_fresh_pair)
at 4, 16, 64 and 256 streams (up to the top --sessions), sent without think time: specgate's
watermarks count requests in flight, and without think time a level's streams are its requests in
flight. --calibrations DIR reuses an earlier run's (DIR/calibration-a{A}-{CTX}/calibration.json).

Traffic: `--workload multiturn` sessions (turns resending the whole conversation over a system
prompt every session shares, think times between turns), sized so that a request's mean prompt is
the cell's context (plan.sizes_for: an eighth of it the shared system prompt, the rest user messages
and the replies resent). The measured mean prompt is reported beside it. Every target gets the same
sessions, side by side, at the same time: they share the machine's conditions.

Scoring, per cell (accept x context x sessions x target), in simulated time: goodput (requests a
second finishing inside the window within --slo-ttft-ms (2000) and --slo-tpot-ms (100): a chat
user's patience for the first token, and a stream of 10 tokens a second, faster than anyone reads), output tok/s, the
prefix-cache hit rate (cached_tokens), TTFT/TPOT p50/p99. A cell is conclusive for a target when it
had the good requests stats.min_ok_requests asks for and client errors (the load tester's, never
the servers') stayed under 5%: the window runs on (up to --max-window-s) until it has them. An
inconclusive figure is never a win or a loss: the verdict lists it as unknown.

Time: with --time-scale T a simulated second lasts 1/T wall seconds (T < 1: slow motion, same
physics, a lower event rate for the client and simulators). By default each cell's T holds each
target near 3,000 output tokens a wall second by a rough estimate of its output (150 tok/s a
stream up to 80 streams, divided by (context / 1k) ** 1.5), at most 4: at 1k, 4 up to 4 sessions,
1.25 at 16, 0.3125 at 64, 0.25 at 256; at 8k, 4 throughout. Calibrations run at twice the cells'
scale at their top level (one server driven at a time, not three). SLOs, think times and windows
are given in simulated time and converted with T, and every figure is reported in simulated time.
The report prints the machine's CPU per cell and warns when it was saturated.
"""

from __future__ import annotations

import argparse
import functools
import time
from pathlib import Path
from typing import Any

from proxy.policy.calibration import CalibrationError
from proxy.policy.calibration import load as load_calibration

from ..args import count, level_tuple, non_negative, positive
from ..kit.cells import run_stacks, say_goodput
from ..kit.command import add_command, add_run_options, check_max_tokens, conclude, say
from ..kit.figures import target_cell
from ..kit.multiturn import context_label, context_list
from ..kit.processes import fresh_start
from .plan import HeadPlan
from .plot import plot_headtohead
from .report import cell_table, cpu_lines, verdicts, warnings
from .run import calibrate, calibration_dir, start_servers
from .score import Cell


def run_cell(plan: HeadPlan, accept: float, context: int, sessions: int, calibration: Path, quiet: bool) -> Cell:
    t = plan.time_scale(sessions, context)
    say(f"  {sessions} sessions (time scale {t:g}): starting three simulated GPUs and specgate...", quiet)
    cap, cpu = run_stacks(plan, context, sessions, start_servers(plan, accept, sessions, context, calibration))
    slo = plan.wall_slo(sessions, context)
    targets = {}
    for name, run in cap.runs.items():
        stats = run.stats(slo, plan.min_requests)
        prompts = [r.prompt_tokens for r in run.results if r.ok]
        targets[name] = target_cell(
            name,
            stats,
            stats.classes.get("all"),
            t,
            cap.mean_queued(name),
            sum(prompts) / len(prompts) if prompts else None,
        )
    cell = Cell(accept, context, sessions, t, {n: targets[n] for n in ("baseline", "adaptive", "specgate")}, cpu,
                cap.pools)  # fmt: skip
    say_goodput(targets, cpu, quiet, unit=" req/s", warn=False)
    return cell


def _calibration(plan: HeadPlan, accept: float, context: int, out_dir: Path, reuse: Path | None, quiet: bool) -> Path:
    if reuse is None:
        return calibrate(plan, accept, context, out_dir, quiet)
    path = calibration_dir(reuse, accept, context) / "calibration.json"
    if not path.exists():
        raise ValueError(f"--calibrations: no {path}")
    say(f"accept {accept:g}, {context_label(context)} context: calibration {path}", quiet)
    return path


def run_headtohead(plan: HeadPlan, out_dir: Path, reuse: Path | None, quiet: bool) -> dict[str, Any]:
    out_dir.mkdir(parents=True, exist_ok=True)
    cells: list[Cell] = []
    calibrations: dict[str, Any] = {}
    for accept in plan.accept_lengths:
        for context in plan.contexts:
            path = _calibration(plan, accept, context, out_dir, reuse, quiet)
            try:
                cal = load_calibration(str(path))
            except CalibrationError as exc:
                raise ValueError(f"calibration {path}: {exc}") from None
            calibrations[f"{accept:g}/{context_label(context)}"] = {
                "path": str(path),
                "high_watermark": cal.high_watermark,
                "low_watermark": cal.low_watermark,
                "verdict": cal.verdict,
            }
            say(f"  specgate's watermarks: high={cal.high_watermark} low={cal.low_watermark} ({cal.verdict})", quiet)
            cells += [fresh_start(functools.partial(run_cell, plan, accept, context, c, path, quiet), quiet)
                      for c in plan.sessions]  # fmt: skip
    return {
        "settings": {
            **{k: v for k, v in vars(plan).items()},
            "sizes": {context_label(c): plan.sizes(c) for c in plan.contexts},
            "predicted_mean_prompt": {context_label(c): plan.sizes(c).predicted_mean_prompt for c in plan.contexts},
            "time_scales": {context_label(x): {c: plan.time_scale(c, x) for c in plan.sessions} for x in plan.contexts},
            "calibration_time_scales": {context_label(x): plan.calibration_scale(x) for x in plan.contexts},
        },
        "calibrations": calibrations,
        "cells": cells,
        "verdicts": verdicts(plan, cells),
        "warnings": warnings(cells),
    }


def _floats(raw: str) -> tuple[float, ...]:
    try:
        values = tuple(float(x) for x in raw.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{raw!r} is not a comma list of numbers") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"{raw!r}: positive numbers")
    return values


def _accepts(raw: str) -> tuple[float, ...]:
    values = _floats(raw)
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{raw!r}: an accept length is at least 1 (the verified token)")
    return values


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = add_command(
        sub,
        "headtohead",
        "baseline alone vs one adaptive EAGLE-3 server vs specgate + shared-GPU pair, one simulated H200 each",
        __doc__,
    )
    p.add_argument("--accept-lengths", type=_accepts, default=(1.5, 2.5), help="comma list (default 1.5,2.5)")
    p.add_argument("--contexts", type=context_list, default=(1000, 8000),
                   help="mean prompt tokens per request, comma list (default 1k,8k)")  # fmt: skip
    p.add_argument("--sessions", type=level_tuple, default=(1, 4, 16, 64, 256),
                   help="concurrent sessions, comma list (default 1,4,16,64,256)")  # fmt: skip
    p.add_argument("--time-scale", type=_floats, default=(),
                   help="simulators' time scale: one for every cell or one per --sessions level (default: "
                        "each cell's holds a target near 3,000 output tokens a wall second, at most 4)")  # fmt: skip
    p.add_argument("--turns", type=count, default=4, help="turns a session (default 4)")
    p.add_argument("--max-tokens", type=int, default=128, help="output tokens a turn (default 128)")
    p.add_argument("--think-time-s", type=non_negative, default=0.5,
                   help="mean think time between turns, simulated seconds (default 0.5)")  # fmt: skip
    p.add_argument("--stagger-s", type=non_negative, default=0.0,
                   help="each stream's first session starts a draw uniform in [0, this) simulated seconds in, so the "
                        "conversations do not run in step (default 0: all at once)")  # fmt: skip
    p.add_argument("--window-s", type=positive, default=6.0,
                   help="measurement window per cell, simulated seconds (default 6)")  # fmt: skip
    p.add_argument("--max-window-s", type=positive, default=60.0,
                   help="the window runs on until a cell is conclusive, up to this long, simulated s (60)")  # fmt: skip
    p.add_argument("--slo-ttft-ms", type=positive, default=2000.0, help="simulated ms (default 2000)")
    p.add_argument("--slo-tpot-ms", type=positive, default=100.0, help="simulated ms (default 100: 10 tok/s)")
    p.add_argument("--spec-steps", type=count, default=3, help="EAGLE draft steps of the speculative servers (3)")
    p.add_argument("--calibration-time-scale", type=positive, default=None,
                   help="time scale of the calibration pairs (default: twice the cells' default at the top "
                        "calibration level, one server being driven at a time rather than three)")  # fmt: skip
    p.add_argument("--calibrations", default=None, metavar="DIR",
                   help="reuse an earlier run's calibrations (its --out-dir) instead of calibrating")  # fmt: skip
    add_run_options(p, "a cell needs per target", "headtohead-results")


def plan_of(args: argparse.Namespace) -> HeadPlan:
    check_max_tokens(args.max_tokens)
    return HeadPlan(
        accept_lengths=args.accept_lengths,
        contexts=args.contexts,
        sessions=args.sessions,
        time_scales=args.time_scale,
        turns=args.turns,
        max_tokens=args.max_tokens,
        think_time_s=args.think_time_s,
        stagger_s=args.stagger_s,
        window_s=args.window_s,
        max_window_s=max(args.max_window_s, args.window_s),
        slo_ttft_ms=args.slo_ttft_ms,
        slo_tpot_ms=args.slo_tpot_ms,
        spec_steps=args.spec_steps,
        calibration_time_scale=args.calibration_time_scale,
        seed=args.seed,
        min_requests=args.min_requests,
    )


def cmd_headtohead(args: argparse.Namespace) -> int:
    plan = plan_of(args)
    out_dir = Path(args.out_dir)
    started = time.monotonic()
    report = run_headtohead(plan, out_dir, Path(args.calibrations) if args.calibrations else None, args.quiet)
    cells: list[Cell] = report["cells"]
    wall = time.monotonic() - started
    report["wall_s"] = round(wall, 1)
    print(
        f"headtohead: {plan.profile}, accept {', '.join(f'{a:g}' for a in plan.accept_lengths)}, contexts "
        f"{', '.join(context_label(c) for c in plan.contexts)}, {plan.turns} turns of {plan.max_tokens} tokens, "
        f"think {plan.think_time_s:g} s, window {plan.window_s:g} s (simulated)"
    )
    for key, cal in report["calibrations"].items():
        print(f"specgate's watermarks at accept/context {key}: high={cal['high_watermark']} "
              f"low={cal['low_watermark']} ({cal['verdict']})")  # fmt: skip
    lines = [cell_table(plan, cells), "", *report["verdicts"], *cpu_lines(cells), *report["warnings"]]
    conclude(out_dir, "headtohead", report, lines, started, lambda path: plot_headtohead(path, plan, cells), wall)
    return 0
