"""`python -m loadtest headtohead-classes`: two traffic classes on one simulated H200 shared by a pair
(issue 28's targets), every target a fresh stack of its own on the same simulated hardware.

    python -m loadtest headtohead-classes [--contexts 1k,8k] [--sessions 8,32,128] [--out-dir DIR]

Traffic: multi-turn sessions (headtohead's sizes: plan.sizes_for), half of them of class A, whose
user messages are varied prose quoting a seventh of itself (`mixed`: about 1.3 tokens accepted a
step), half of class B, whose messages quote one piece of code over and over (`repetitive`: about
3.0). Stream i's sessions are all of class A (i even) or B (i odd). Every request carries
`x-specgate-class` and `x-session-id`. The servers are `pair --shared-gpu` simulators
(`--profile h200-llama8b --enable-cache-report --accept-from-prompt --max-accept-length 3.2`),
one pair per target:

  all-spec   every request straight to the pair's speculative server;
  all-base   every request straight to the pair's baseline server;
  threshold  specgate SPECGATE_POLICY=threshold, with classes and cache affinity off
             (SPECGATE_CLASS_KEY=none, SPECGATE_AFFINITY_ENTRIES=0): specgate before issue 28;
  adaptive   the same with SPECGATE_POLICY=adaptive;
  features   SPECGATE_POLICY=adaptive with classes (x-specgate-class) and cache affinity on;
  split      with both classes: class B straight to the speculative server, class A to the baseline
             (the static split by class, measured rather than assumed);
  smg        with --smg BINARY: SGLang's gateway (`smg launch --policy cache_aware`) in front of the
             pair, both servers as plain workers (its hit rate beside specgate's).
  oracle     with --oracle: the issue's oracle, every session on one server of its pair for all its
             turns (each server given as many sessions of each class), straight: its hit rate
             measured, evictions and all.

With --fixed-through specgate, all-spec, all-base and each class of the split reach their server
through a specgate pinned to it (the other role a closed port), paying the hop the specgates pay,
and base-direct, the baseline server straight, runs beside them: all-base / base-direct is the hop.

specgate's watermarks and curves come from a fresh pair calibrated per context with the same two
classes (`loadtest calibrate --save`, no think time) at 4, 16, 64 and 256 streams, up to the first
that reaches the top --sessions, so that the crossover is bracketed; so does each class's
acceptance (the file's `classes`). Scoring per cell, in simulated time: goodput
(requests finishing in the window within --slo-ttft-ms 1000 and --slo-tpot-ms 50), each specgate
variant's over the better of all-spec and all-base, each class's goodput, the prefix-cache hit rate
(cached_tokens) and the oracle's (`oracle_hit_rate`: every turn back on the server of its last turn,
nothing evicted; where neither fixed target met the SLOs, the pools overflow and that cannot hold,
so there the target is judged against the best oracle routing measured, with --oracle: all-spec,
all-base and oracle, each held to its own estimate; without --oracle the hit verdict is unknown).
Targets (issue 28): >= 1.10x where the classes should be split (class B has more
goodput on all-spec and class A on all-base, each beyond 5%, and the measured split has more goodput
than the better of all-spec and all-base, beyond 5%), >= 0.97x in every cell, hit rate within 5
points of the oracle. An inconclusive figure is unknown, never a pass or a fail. With --repeats N
each cell runs N times on sessions drawn from N seeds, and its verdict is the runs' where they all
agree; else, with 8 runs or more, their pooled ratio's (met where its 90% bootstrap interval
clears the target, missed where it falls short, whether to split judged on the runs pooled), else
unknown. --gates features leaves the other specgates out, for many repeats.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from ...args import count, level_tuple, names, non_negative, positive
from ...kit.command import add_command, add_run_options, check_max_tokens, conclude
from ...kit.multiturn import context_list
from .plan import DIRECT, FIXED_THROUGH, GATES, NOISE_OF, ORACLE, ClassPlan, check_gates
from .report import summary_lines, table
from .run import run_cell, run_cells


def run(plan: ClassPlan, out_dir: Path, reuse: Path | None, quiet: bool) -> dict[str, Any]:
    cells = run_cells(plan, out_dir, reuse, quiet, run_cell, "headtohead-classes")
    return {"settings": vars(plan), "cells": cells, "summary": summary_lines(cells)}


def gate_list(text: str) -> tuple[str, ...]:
    """--gates' comma list (check_gates)."""
    gates = names(text)
    try:
        check_gates(gates)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return gates


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = add_command(
        sub,
        "headtohead-classes",
        "two traffic classes on a pair: all-spec, all-base and three specgates (issue 28)",
        __doc__,
    )
    p.add_argument("--contexts", type=context_list, default=(1000, 8000), help="comma list (default 1k,8k)")
    p.add_argument("--sessions", type=level_tuple, default=(8, 32, 128), help="comma list (default 8,32,128)")
    p.add_argument("--turns", type=count, default=4)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--think-time-s", type=non_negative, default=0.5, help="simulated seconds (default 0.5)")
    p.add_argument("--stagger-s", type=non_negative, default=ClassPlan.stagger_s,
                   help="each stream's first session starts a draw uniform in [0, this) simulated seconds in, so the "
                   f"conversations do not run in step (default {ClassPlan.stagger_s:g}; 0: all at once)")  # fmt: skip
    p.add_argument("--window-s", type=positive, default=6.0, help="simulated seconds (default 6)")
    p.add_argument("--max-window-s", type=positive, default=60.0, help="simulated seconds (default 60)")
    p.add_argument("--slo-ttft-ms", type=positive, default=1000.0, help="simulated ms (default 1000)")
    p.add_argument("--slo-tpot-ms", type=positive, default=50.0, help="simulated ms (default 50)")
    p.add_argument("--calibrations", default=None, metavar="DIR", help="reuse an earlier run's calibrations")
    p.add_argument(
        "--classes",
        choices=("AB", "A", "B"),
        default="AB",
        help="the sessions' classes: both (default), or one alone (single-class traffic)",
    )
    p.add_argument("--topology", choices=("paired", "pooled"), default="paired",
                   help="paired: one GPU shared by both servers (default); pooled: a GPU each (1+1)")  # fmt: skip
    p.add_argument("--repeats", type=count, default=1,
                   help="run each cell this many times, drawing the sessions from seeds --seed, --seed + 1, ...; "
                   "a cell's verdict is its runs' where they all agree, else unknown (default 1)")  # fmt: skip
    p.add_argument("--control", action="store_true",
                   help="add a second features (control): a run's ratio then counts as met or missed only where it "
                   "clears its target by more than |control / features - 1|, else unknown")  # fmt: skip
    p.add_argument("--gates", type=gate_list, default=GATES, metavar="LIST",
                   help=f"the specgate targets, a comma list of {', '.join(GATES)} with {NOISE_OF} among them "
                   "(default all): fewer stacks run at a faster time scale, for many --repeats")  # fmt: skip
    p.add_argument("--fixed-through", choices=FIXED_THROUGH, default="direct",
                   help="direct: all-spec, all-base and the split's classes go straight to their server (default); "
                   "specgate: each through a specgate pinned to it, so they pay the hop the specgates pay, with "
                   f"{DIRECT} (the baseline server straight) beside them for what the hop costs")  # fmt: skip
    p.add_argument("--smg", default=None, metavar="BINARY",
                   help="add smg --policy cache_aware in front of a pair (e.g. .venv-peers/bin/smg)")  # fmt: skip
    p.add_argument("--oracle", action="store_true",
                   help=f"add the oracle ({ORACLE}): every session kept on one server of a pair of its own for all "
                   "its turns, each server given as many sessions of each class; where neither fixed target meets "
                   "the SLOs and the pools evict, the hit target is judged against the best of it, all-spec and "
                   "all-base (else unknown)")  # fmt: skip
    add_run_options(p, "a cell needs per target", "headtohead-classes-results")


def cmd_headtohead_classes(args: argparse.Namespace) -> int:
    check_max_tokens(args.max_tokens)
    plan = ClassPlan(
        contexts=args.contexts, sessions=args.sessions, turns=args.turns, max_tokens=args.max_tokens,
        think_time_s=args.think_time_s, stagger_s=args.stagger_s, window_s=args.window_s,
        max_window_s=max(args.max_window_s, args.window_s),
        slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms, seed=args.seed, min_requests=args.min_requests,
        smg=args.smg, topology=args.topology, classes=args.classes, repeats=args.repeats, control=args.control,
        gates=args.gates, fixed_through=args.fixed_through, oracle=args.oracle,
    )  # fmt: skip
    out_dir = Path(args.out_dir)
    started = time.monotonic()
    report = run(plan, out_dir, Path(args.calibrations) if args.calibrations else None, args.quiet)
    report["wall_s"] = round(time.monotonic() - started, 1)
    lines = [table(plan, report["cells"]), *report["summary"]]
    conclude(out_dir, "headtohead-classes", report, lines, started, wall_s=report["wall_s"])
    return 0
