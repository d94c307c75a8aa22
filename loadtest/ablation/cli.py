"""`python -m loadtest ablation`: each routing mechanism against the same stack with it off, side by
side, on a protocol fixed before any run (issue 54, item 3).

    python -m loadtest ablation [--out-dir DIR]          # the protocol, once (about an hour on 2 cores)
    python -m loadtest ablation --dry-run                # the plan, nothing started

Protocol (fixed 2026-12-07, before the first run; the defaults are the protocol, and a run with
other --cells, --seeds or --window-s is a smoke test, not the protocol):

- Traffic and hardware: headtohead-classes' cells. Simulated H200s with Llama-3.1-8B step times
  (`--profile h200-llama8b`); multi-turn chat, 4 turns of 128 output tokens, think times of 0.5 s,
  each stream's first session opening within 20 s; two classes, half the sessions each, accepting
  about 1.3 (A, varied prose) and 3.0 (B, repeated code) tokens a step; every request names its
  class (x-specgate-class) and session (x-session-id). SLOs TTFT <= 1 s and TPOT <= 50 ms
  (simulated). A pair: one speculative and one baseline server time-slicing one GPU (`pair
  --shared-gpu`); a pool: a GPU a server.
- Stacks: in each run, side by side with the same sessions in one window, each a fresh GPU (or
  pool) and a fresh specgate: `full` (every mechanism on: the cell's policy, classes by header,
  every other setting at its default), `full-copy` (the same again) and `no-<mechanism>` for each
  mechanism measured in the cell (the full stack with that one switch turned). Time settings are
  scaled to the simulators' clock (kit.settings); the gates read a calibration made per topology
  and context on the same traffic (headtohead-classes', a pool's with the speed model's fit).
- Cells, seeds, window: the cells below; seeds 900, 901 and 902 (fresh: no mechanism was tuned on
  them), run seed by seed, each seed through every cell, so that a drift of the machine falls on
  every cell alike; a 12 s window (simulated), extended to at most 60 s until each stack has enough
  good requests; the time scale headtohead's default for the cell times 3 over the run's stacks.
- Scoring (score.py): gain = full's goodput over no-<mechanism>'s in the same run (requests a
  simulated second finishing in the window within the SLOs; where neither met the SLOs for any
  request, output tokens a second, marked; where only full did, infinite). Noise = the largest
  |full-copy / full - 1| over the cell's seeds. A cell: pays where every seed's gain > 1 + noise,
  costs where every seed's gain < 1 - noise, else inside noise; unknown where a stack was
  inconclusive in any seed (fewer good requests than max(10, half the sessions) in the window, more
  than 5% of its requests failed on the client's side, or a load-tester stream died), or fewer than
  3 seeds. Shown: median gain and min-max over the seeds. A mechanism: pays where it pays in some
  cell and costs in none, costs the other way round, "pays and costs" where both, inside noise where
  every known cell is. The counters of full and of the stack with the mechanism off (decisions by
  reason, shadow probes, affinity breaks; score.EVIDENCE) show what it did; they are not scored.
- Not measured: the speculative pool's capacity cap (no switch turns it off) and the policies
  themselves (threshold against adaptive): one stack's mechanisms, not a choice among stacks.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..args import names
from ..kit.command import add_protocol_run_options, say
from ..report import to_jsonable, write_json
from .protocol import (
    CELL_NAMES,
    MAX_WINDOW_S,
    MECHANISMS,
    SEEDS,
    WINDOW_S,
    Protocol,
    coverage,
    describe,
    select_cells,
)
from .report import cell_table, run_lines, summary_table
from .run import run_protocol
from .score import Run, score, summarise

DATA = "ablation.json"


def seed_list(raw: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in names(raw))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{raw!r} is not a comma list of integers") from None


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "ablation",
        help="each routing mechanism against the same stack with it off, on a fixed protocol (issue 54)",
        description=__doc__ + "\n" + describe(Protocol()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--cells", type=names, default=CELL_NAMES, metavar="LIST",
                   help=f"smoke tests only: some of {', '.join(CELL_NAMES)} (default all: the protocol)")  # fmt: skip
    p.add_argument("--seeds", type=seed_list, default=SEEDS, metavar="LIST",
                   help=f"smoke tests only (default {','.join(map(str, SEEDS))}: the protocol)")  # fmt: skip
    p.add_argument("--window-s", type=float, default=WINDOW_S,
                   help=f"smoke tests only: simulated seconds (default {WINDOW_S:g}: the protocol)")  # fmt: skip
    add_protocol_run_options(p, "ablation-results")


def protocol_of(args: argparse.Namespace) -> Protocol:
    return Protocol(
        cells=select_cells(args.cells),
        seeds=args.seeds,
        window_s=args.window_s,
        max_window_s=max(MAX_WINDOW_S, args.window_s),
    )


def is_protocol(protocol: Protocol) -> bool:
    """Whether this is the protocol as fixed, not a smoke test."""
    return protocol == Protocol()


def report(protocol: Protocol, runs: Sequence[Run]) -> dict[str, Any]:
    """The scores, tables and runs of a run of the command (pure)."""
    measured = {c.name: c.mechanisms for c in protocol.cells}
    scores = score(runs, measured)
    rows = summarise(scores)
    return {
        "protocol": {
            "as_fixed": is_protocol(protocol),
            "cells": [
                {**vars(c), "stacks": c.stacks, "label": c.label, "time_scale": c.time_scale()} for c in protocol.cells
            ],
            "seeds": protocol.seeds,
            "window_s": protocol.window_s,
            "max_window_s": protocol.max_window_s,
            "mechanisms": [{**vars(m), "switch": m.switch} for m in MECHANISMS],
            "coverage": coverage(protocol.cells),
        },
        "summary_table": summary_table(rows),
        "cell_table": cell_table(scores),
        "scores": [{**to_jsonable(s), "median": s.median, "low": s.low, "high": s.high} for s in scores],
        "verdicts": {r.mechanism: r.verdict for r in rows},
        "runs": runs,
    }


def finite(obj: Any) -> Any:
    """JSON without Infinity: an infinite ratio (full served where off served none) as "inf"."""
    if isinstance(obj, float) and math.isinf(obj):
        return "inf" if obj > 0 else "-inf"
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [finite(v) for v in obj]
    return obj


def save(path: Path, payload: dict[str, Any]) -> None:
    write_json(path, finite(to_jsonable(payload)))


def cmd_ablation(args: argparse.Namespace) -> int:
    protocol = protocol_of(args)
    print(describe(protocol))
    if not is_protocol(protocol):
        print("(not the protocol as fixed: a smoke test; its verdicts count for nothing)")
    if args.dry_run:
        return 0
    out_dir = Path(args.out_dir)
    started = time.monotonic()

    def partial(runs: list[Run]) -> None:
        save(out_dir / DATA, {**report(protocol, runs), "wall_s": round(time.monotonic() - started, 1)})

    runs = run_protocol(protocol, out_dir, Path(args.calibrations) if args.calibrations else None, args.quiet, partial)
    result = {**report(protocol, runs), "wall_s": round(time.monotonic() - started, 1)}
    save(out_dir / DATA, result)
    print("\n" + result["summary_table"] + "\n\n" + result["cell_table"] + "\n")
    for line in run_lines(runs):
        print(line)
    say(f"data: {out_dir / DATA}", args.quiet)
    print(f"\n({result['wall_s']:.0f} s)")
    return 0
