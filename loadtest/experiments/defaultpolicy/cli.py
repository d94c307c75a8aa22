"""`python -m loadtest defaultpolicy`: which policy does best without a calibration file, and is it
good enough to be the default? Uncalibrated `adaptive` and uncalibrated `threshold` (16/8, the
default until now) against calibrated `threshold`, level by level, on simulated pairs.

    python -m loadtest defaultpolicy [--out-dir DIR]     # the protocol, once (about 25 min on 2 cores)
    python -m loadtest defaultpolicy --dry-run           # the plan, nothing started

Protocol (fixed 2026-12-07, before the first run; the defaults are the protocol, and a run with
other --pairs, --levels, --rounds or --window-s is a smoke test, not the protocol):

- Pairs: two simulated speculative/baseline pairs, each on one shared GPU (`simulator pair
  --shared-gpu`): `crossover` (the synthetic curves, time scale 1) and `h200-llama8b` (H200 step
  times, EAGLE-3 at 3 draft steps, acceptance 2.5; time scale 0.5, so 250 streams stay within
  what two cores relay). One time scale a pair for its whole run; every specgate's time settings
  at their defaults on the simulators' clock (kit.settings). No prefix cache on the simulators
  (--disable-radix-cache): every arm sends the same prompts, and a cache would hand the later arms
  the earlier one's prefills.
- Traffic: calibrate's: one-turn chat requests of the diverse prompts, 64 output tokens, seed
  1207, closed loop at each level (streams in flight): 1, 2, 5, 10, 30, 70, 100, 250.
- Calibration: `loadtest calibrate --save` (the full sweep at those levels, 4 s simulated a level
  and server) on a fresh pair of its own; calibrated threshold reads its watermarks.
- Arms: three specgates in front of one more fresh pair, each with its policy named:
  `calibrated` (SPECGATE_POLICY=threshold, SPECGATE_CALIBRATION=the file), `adaptive`
  (SPECGATE_POLICY=adaptive, no file) and `threshold` (SPECGATE_POLICY=threshold, no file:
  16/8). Every other setting at its default.
- One gateway an arm through the whole run, as a user's runs while the load rises and falls: it
  keeps what it learned. Round 0 climbs the levels, round 1 comes down them (2 rounds). At each
  level the arms run one after another on the same simulators (never at once), in an order
  rotated by one every level, so machine noise and the previous load fall on all alike.
- A level, per arm: warm-up at least 3 s simulated (and until every stream finished a request),
  then a 4 s window extended up to 30 s until it holds 10 good requests from at least half the
  streams. Output tok/s and mean TPOT over the window, in simulated units.
- Scoring (protocol.py): per level and round, each uncalibrated arm's output tok/s over
  calibrated threshold's. A level's figure: the median over its rounds. Unknown where any round
  of either arm is inconclusive (too few good requests, or more than 5% of requests failed on the
  client's side): neither pass nor miss. Target: the candidate (`adaptive`) at least 0.95 of
  calibrated threshold at every level of both pairs: missed where any level misses; not shown
  where none misses but a level is unknown; held otherwise. TPOT ratios, the rounds' spread,
  each gateway's watermarks after the level and the machine's CPU are reported, not scored.
  Which uncalibrated arm did better at a level: the higher figure; even within 0.02.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from ...args import level_tuple, names, positive
from ...kit.command import add_command, add_protocol_run_options, say
from ...report import to_jsonable, write_json
from .protocol import (
    ADAPTIVE,
    ARMS,
    CALIBRATED,
    CANDIDATE,
    PAIR_NAMES,
    PAIRS,
    THRESHOLD,
    UNCALIBRATED,
    LevelScore,
    PairRun,
    Protocol,
    overall,
    plan,
    score_pair,
    target_verdict,
)
from .run import run_pair

NAME = "defaultpolicy"


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = add_command(sub, NAME, "the default policy measured: uncalibrated adaptive and threshold against calibrated "
                    "threshold, level by level", __doc__)  # fmt: skip
    p.add_argument("--pairs", type=names, default=PAIR_NAMES, metavar="LIST",
                   help=f"smoke tests only: some of {', '.join(PAIR_NAMES)} (default both: the protocol)")  # fmt: skip
    p.add_argument("--levels", type=level_tuple, default=None, metavar="LIST",
                   help="smoke tests only: a subset of the grid (default the whole grid: the protocol)")  # fmt: skip
    p.add_argument("--rounds", type=int, default=Protocol.rounds,
                   help=f"smoke tests only (default {Protocol.rounds}: the protocol)")  # fmt: skip
    p.add_argument("--window-s", type=positive, default=Protocol.window_s,
                   help=f"smoke tests only: simulated (default {Protocol.window_s:g}: the protocol)")  # fmt: skip
    add_protocol_run_options(p, "defaultpolicy-results")


def protocol_of(args: argparse.Namespace) -> Protocol:
    unknown = [n for n in args.pairs if n not in PAIR_NAMES]
    if unknown:
        raise ValueError(f"--pairs: unknown {', '.join(unknown)} (known: {', '.join(PAIR_NAMES)})")
    pairs = tuple(p for p in PAIRS if p.name in args.pairs)
    if args.levels is not None:
        off = [x for x in args.levels if any(x not in p.levels for p in pairs)]
        if off:
            raise ValueError(f"--levels: {', '.join(map(str, off))} not in the grid")
        pairs = tuple(replace(p, levels=tuple(sorted(args.levels))) for p in pairs)
    return Protocol(pairs=pairs, rounds=args.rounds, window_s=args.window_s)


def is_protocol(protocol: Protocol) -> bool:
    return protocol == Protocol()


def describe(protocol: Protocol) -> str:
    lines = []
    for pair in protocol.pairs:
        steps = plan(protocol, pair)
        lines.append(f"{pair.name} (time scale {pair.time_scale:g}; {pair.why}): {len(steps)} levels x 3 arms")
        for r, level, order in steps:
            lines.append(f"  round {r} c={level}: {', '.join(order)}")
    return "\n".join(lines)


def _fmt(x: float | None, digits: int = 3) -> str:
    return "?" if x is None or math.isnan(x) else f"{x:.{digits}f}"


def pair_table(run: PairRun, scores: Sequence[LevelScore]) -> str:
    """Markdown: per level, calibrated threshold's throughput, each uncalibrated arm's ratios and verdict."""
    head = (
        "| streams | calibrated tok/s | adaptive / cal | threshold / cal | TPOT adaptive / cal | "
        "TPOT threshold / cal | spread a / t | adaptive >= 0.95 | better | adaptive's watermarks |"
    )
    rows = [head, "|" + "---|" * 10]
    for s in scores:
        cal = [arms[s.level][CALIBRATED].output_tok_s for _, arms in sorted(run.rounds.items()) if s.level in arms]
        marks = [arms[s.level][ADAPTIVE] for _, arms in sorted(run.rounds.items()) if s.level in arms]
        wm = ", ".join(f"{m.high}/{m.low}" for m in marks)
        rows.append(
            f"| {s.level} | {' / '.join(f'{x:,.0f}' for x in cal)} | {_fmt(s.tok_s[ADAPTIVE])} | "
            f"{_fmt(s.tok_s[THRESHOLD])} | {_fmt(s.tpot[ADAPTIVE])} | {_fmt(s.tpot[THRESHOLD])} | "
            f"{_fmt(s.spread[ADAPTIVE], 2)} / {_fmt(s.spread[THRESHOLD], 2)} | {s.verdicts[ADAPTIVE]} | "
            f"{s.better} | {wm} |"
        )
    return "\n".join(rows)


def report(protocol: Protocol, runs: Sequence[PairRun]) -> dict[str, Any]:
    """Scores, tables and verdicts of the runs so far (pure)."""
    levels = {p.name: p.levels for p in protocol.pairs}
    scores = {run.pair: score_pair(run, levels[run.pair], protocol.target) for run in runs}
    verdicts = {arm: {name: target_verdict(s, arm) for name, s in scores.items()} for arm in UNCALIBRATED}
    complete = len(runs) == len(protocol.pairs)
    return {
        "protocol": {**to_jsonable(protocol), "as_fixed": is_protocol(protocol), "arms": ARMS},
        "tables": {run.pair: pair_table(run, scores[run.pair]) for run in runs},
        "scores": {name: to_jsonable(s) for name, s in scores.items()},
        "target": {
            arm: {
                "by_pair": verdicts[arm],
                "overall": overall(list(verdicts[arm].values())) if complete else "unknown (run incomplete)",
            }
            for arm in UNCALIBRATED
        },
        "candidate": CANDIDATE,
        "calibrated_watermarks": {run.pair: run.calibrated for run in runs},
        "runs": runs,
    }


def save(path: Path, payload: dict[str, Any]) -> None:
    write_json(path, to_jsonable(payload))  # NaN (not measured) as null


def cmd_defaultpolicy(args: argparse.Namespace) -> int:
    protocol = protocol_of(args)
    print(describe(protocol))
    if not is_protocol(protocol):
        print("(not the protocol as fixed: a smoke test; its verdicts count for nothing)")
    if args.dry_run:
        return 0
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    data = out_dir / f"{NAME}.json"
    started = time.monotonic()
    runs: list[PairRun] = []

    def partial(current: PairRun) -> None:
        save(data, {**report(protocol, [*runs, current]), "wall_s": round(time.monotonic() - started, 1)})

    reuse = Path(args.calibrations) if args.calibrations else None
    for pair in protocol.pairs:
        runs.append(run_pair(protocol, pair, out_dir, args.quiet, reuse, partial))
    result = {**report(protocol, runs), "wall_s": round(time.monotonic() - started, 1)}
    save(data, result)
    for name, table in result["tables"].items():
        print(f"\n{name} (calibrated watermarks {result['calibrated_watermarks'][name]}):\n{table}")
    for arm, found in result["target"].items():
        print(f"\n{arm} at >= {protocol.target:g} of calibrated threshold at every level: {found}")
    say(f"data: {data}", args.quiet)
    print(f"\n({result['wall_s']:.0f} s)")
    return 0
