"""`python -m loadtest quickcal`: calibrate's bisect search against the full sweep, on the same
simulated pairs, for the recommendation each makes and the wall time each takes.

    python -m loadtest quickcal [--cells NAME,...] [--out-dir DIR]

Protocol (fixed before the first run; the report says where a run departs from it):

- Cells, a simulated pair each, each server on a simulated GPU of its own (calibrate measures one
  server at a time), at time scale T:
    crossover      the `crossover` profile (synthetic curves; even at 20 streams), T 1
    8b-a2-short    h200-llama8b, --accept-length 2, diverse prompts (a few hundred tokens), T 0.25
    8b-a3.5-short  h200-llama8b, --accept-length 3.5, diverse prompts, T 0.25
    8b-a2-8k       h200-llama8b, --accept-length 2, one-turn prompts of exactly 8,192 tokens
                   (--workload longctx), T 4
    8b-a3.5-8k     h200-llama8b, --accept-length 3.5, 8,192-token prompts, T 4
  T is kit.multiturn.default_time_scale at the grid's top (250 streams) and the cell's context: the
  output near 3,000 tokens a wall second at 250 streams (1 for the synthetic profile, 3,100 tok/s).
- In each cell, on the same two simulators, one after the other: `calibrate --search full`, then
  `calibrate --search bisect`, each a process of its own; both with the default grid
  (1,2,5,10,30,70,100,250), --max-tokens 64, --seed 0, windows of 2 simulated seconds
  (--duration-s 2/T), every other flag at calibrate's default (--max-duration-s: 10 x the window,
  or 3 x the level's longest warm-up request where longer; --min-requests 10; no --save).
- Scoring per cell: each run's recommendation (verdict, high and low watermark); "within one
  level": both made, and their high watermarks in the same or adjacent cells of the grid (cell k:
  the number of grid levels at or below the watermark, so 0 for 0, 8 for 250); each run's wall
  time and the ratio bisect / full. Target: within one level in every cell, and bisect in at most
  a third of the full sweep's time, in every cell and over all cells together.
- One run per cell, seed 0; no repeats (the machine: 2 cores shared with other work).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import orjson

from ..args import names
from ..kit.command import add_command, conclude, say
from ..kit.multiturn import default_time_scale
from ..kit.processes import Fleet
from ..kit.sweeps import DEFAULT_LEVELS
from ..procs import free_port, simulator_args

GRID = tuple(int(c) for c in DEFAULT_LEVELS.split(","))
WINDOW_SIM_S = 2.0
MAX_TOKENS = 64
SEED = 0
LONG_PROMPT = 8192
SEARCHES = ("full", "bisect")
# Each calibrate run's bound: a run past it is cut and scored as no recommendation.
RUN_TIMEOUT_S = 1800.0


@dataclass(frozen=True)
class Cell:
    name: str
    profile: str
    accept: float | None  # --accept-length of the speculative server (None: the profile's)
    prompt_tokens: int | None  # None: diverse prompts; else longctx prompts of exactly this many

    def time_scale(self) -> float:
        if self.profile == "crossover":
            return 1.0
        return default_time_scale(GRID[-1], self.prompt_tokens or 1000)

    def sim_args(self) -> list[str]:
        extra = ["--profile", self.profile, "--time-scale", f"{self.time_scale():g}"]
        return extra + (["--accept-length", f"{self.accept:g}"] if self.accept is not None else [])

    def load_args(self) -> list[str]:
        if self.prompt_tokens is None:
            return ["--prompts", "diverse"]
        n = str(self.prompt_tokens)
        return ["--workload", "longctx", "--prompt-tokens-mean", n, "--prompt-tokens-spread", "0",
                "--prompt-tokens-max", n]  # fmt: skip


CELLS = (
    Cell("crossover", "crossover", None, None),
    Cell("8b-a2-short", "h200-llama8b", 2.0, None),
    Cell("8b-a3.5-short", "h200-llama8b", 3.5, None),
    Cell("8b-a2-8k", "h200-llama8b", 2.0, LONG_PROMPT),
    Cell("8b-a3.5-8k", "h200-llama8b", 3.5, LONG_PROMPT),
)


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = add_command(sub, "quickcal", "calibrate's bisect search against the full sweep, side by side", __doc__)
    p.add_argument(
        "--cells",
        type=names,
        default=tuple(c.name for c in CELLS),
        help=f"comma list of {', '.join(c.name for c in CELLS)} (default: all)",
    )
    p.add_argument("--out-dir", default="quickcal")
    p.add_argument("--quiet", action="store_true", help="no progress lines")


def grid_cell(high: int) -> int:
    """The grid levels at or below a high watermark: adjacent watermarks differ by at most one."""
    return sum(1 for c in GRID if c <= high)


@dataclass(frozen=True)
class Run:
    search: str
    wall_s: float
    exit: int
    verdict: str | None
    high: int | None
    low: int | None
    levels: tuple[int, ...]


def _calibrate(cell: Cell, search: str, spec: str, base: str, out_dir: Path) -> Run:
    out = out_dir / f"{cell.name}-{search}.json"
    t = cell.time_scale()
    cmd = [sys.executable, "-m", "loadtest", "calibrate", "--speculative", spec, "--baseline", base,
           "--search", search, "--max-tokens", str(MAX_TOKENS), "--seed", str(SEED),
           "--duration-s", f"{WINDOW_SIM_S / t:g}", *cell.load_args(), "--quiet", "--out", str(out)]  # fmt: skip
    started = time.monotonic()
    with (out_dir / f"{cell.name}-{search}.log").open("w") as log:
        try:
            code = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=RUN_TIMEOUT_S).returncode
        except subprocess.TimeoutExpired:
            code = -1
    wall = time.monotonic() - started
    if not out.exists():
        return Run(search, wall, code, None, None, None, ())
    data = orjson.loads(out.read_bytes())
    rec = data["recommendation"]
    levels = tuple(r["concurrency"] for r in data["sweeps"]["speculative"])
    return Run(search, round(wall, 1), code, rec["verdict"], rec["high"], rec["low"], levels)


def run_cell(cell: Cell, out_dir: Path, quiet: bool) -> dict[str, Any]:
    fleet = Fleet()
    try:
        urls = {}
        for role in ("speculative", "baseline"):
            port = free_port()
            urls[role] = f"http://127.0.0.1:{port}"
            fleet.start(f"{cell.name}-{role}", simulator_args(role, port, *cell.sim_args()), [urls[role] + "/health"])
        fleet.ready()
        runs = {}
        for search in SEARCHES:
            say(f"{cell.name}: calibrate --search {search} (T={cell.time_scale():g})", quiet)
            runs[search] = r = _calibrate(cell, search, urls["speculative"], urls["baseline"], out_dir)
            say(f"    {r.wall_s:.0f} s, exit {r.exit}, {r.verdict} high={r.high}, levels {r.levels}", quiet)
    finally:
        fleet.stop()
    return score(cell, runs["full"], runs["bisect"])


def score(cell: Cell, full: Run, bisect: Run) -> dict[str, Any]:
    within = (
        full.high is not None and bisect.high is not None and abs(grid_cell(full.high) - grid_cell(bisect.high)) <= 1
    )
    ratio = bisect.wall_s / full.wall_s if full.wall_s > 0 else None
    return {
        "cell": cell.name,
        "time_scale": cell.time_scale(),
        "cell_spec": asdict(cell),
        "full": asdict(full),
        "bisect": asdict(bisect),
        "within_one_level": within,
        "time_ratio": None if ratio is None else round(ratio, 3),
        "target_met": within and ratio is not None and ratio <= 1 / 3,
    }


def _marks(run: dict[str, Any]) -> str:
    return "-" if run["high"] is None else f"{run['high']}/{run['low']}"


def lines(runs: Sequence[dict[str, Any]]) -> list[str]:
    out = [f"{'cell':<14} {'full':>8} {'bisect':>8} {'within':>6} {'full s':>7} {'bisect s':>8} {'ratio':>6}  levels"]
    for r in runs:
        f, b = r["full"], r["bisect"]
        ratio = "-" if r["time_ratio"] is None else f"{r['time_ratio']:.2f}"
        out.append(
            f"{r['cell']:<14} {_marks(f):>8} {_marks(b):>8} {'yes' if r['within_one_level'] else 'no':>6} "
            f"{f['wall_s']:>7.0f} {b['wall_s']:>8.0f} {ratio:>6}  {','.join(map(str, b['levels']))}"
        )
    total_f = sum(r["full"]["wall_s"] for r in runs)
    total_b = sum(r["bisect"]["wall_s"] for r in runs)
    if total_f > 0:
        met = all(r["target_met"] for r in runs) and total_b / total_f <= 1 / 3
        out.append(f"all cells: bisect {total_b:.0f} s, full {total_f:.0f} s, ratio {total_b / total_f:.2f}; "
                   f"target {'met' if met else 'missed'}")  # fmt: skip
    return out


def cmd_quickcal(args: argparse.Namespace) -> int:
    started = time.monotonic()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    unknown = sorted(set(args.cells) - {c.name for c in CELLS})
    if unknown or not args.cells:
        raise ValueError(
            f"--cells: {', '.join(unknown) or 'none given'}: choose among {', '.join(c.name for c in CELLS)}"
        )
    cells = [c for c in CELLS if c.name in args.cells]
    runs = [run_cell(c, out_dir, args.quiet) for c in cells]
    report = {"protocol": __doc__, "grid": GRID, "runs": runs}
    conclude(out_dir, "quickcal", report, lines(runs), started)
    return 0
