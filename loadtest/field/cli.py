"""`python -m loadtest field`: the field's setup beside specgate on N simulated H200s, on the same
sessions and seeds.

    python -m loadtest field [--smg BINARY | --peers-venv DIR] [--out-dir field-results] [--dry-run]

Configurations, each a fleet of its own of N simulators, one alone on each simulated H200
(`--profile h200-llama8b --enable-cache-report --accept-from-prompt --max-accept-length 3.2
--spec-steps 3`, no --shared-gpu), behind its router:

  smg-adaptive   SGLang's gateway (`smg launch --policy cache_aware`) in front of N `--role adaptive`
                 servers (EAGLE-3 drafting adaptively in the engine, SGLang's --speculative-adaptive):
                 the field's setup, every ratio's denominator;
  smg-baseline   the same gateway in front of N `--role baseline` servers;
  specgate-pool  specgate in front of N/2 speculative and N/2 baseline servers, SPECGATE_TOPOLOGY=pooled,
                 SPECGATE_POLICY=adaptive with the context's calibration (`loadtest calibrate --save` on
                 a fresh pair, a GPU each, with both classes, at 4, 16 and 64 streams, as
                 headtohead-classes makes it), SPECGATE_CLASS_KEY=header, cache affinity on: the one
                 configuration specgate's docs recommend for N GPUs today;
  specgate-adaptive, specgate-adaptive-balanced
                 specgate in front of N adaptive servers through SPECGATE_ADAPTIVE_URL (speculative
                 and baseline URLs empty), classes and affinity on, SPECGATE_ADAPTIVE_PLACEMENT=
                 homogeneous and least_loaded;
  specgate-mixed specgate in front of a mixed fleet (N=4: one speculative, one baseline, two
                 adaptive; none at N=2, where a pool's two roles leave no GPU), pooled, calibrated as
                 specgate-pool.

The last three need SPECGATE_ADAPTIVE_URL: where the installed specgate's Settings has no
adaptive_url they are skipped, and the run says so. Every specgate gets SPECGATE_SLO_TTFT_MS and
SPECGATE_SLO_TPOT_MS (the SLOs, in wall ms at the cell's time scale) where its Settings has them.

Traffic: headtohead-classes' multi-turn sessions (4 turns of 128 tokens, 0.5 s think time, each
stream's first session staggered over 2 s), every request with x-specgate-class and x-session-id;
two classes (AB: half class A, prose accepting ~1.3 a step, half class B, quoted code ~3.0), or
class A alone (A).

Cells (N GPUs, traffic, mean context, sessions a GPU), 5 seeds each (0-4), 40 runs:
  N=2 and N=4, each:  AB 1k 64/GPU, AB 8k 64/GPU, A 1k 64/GPU, AB 1k 16/GPU.
Sized on two cores, where relayed tokens set a run's wall time (1k at 64 sessions a GPU relays 22
times what 8k does): with the three configurations runnable before SPECGATE_ADAPTIVE_URL, a run
of N=4 1k took 75 s, N=4 8k 38 s, N=2 1k 41 s, N=2 8k 25 s, a context's calibration 27-50 s; with all six about twice as
long at 1k. So the heavy load (64 a GPU, past the batch where the adaptive engines stop drafting) is measured
in three cells a N, one class only at 1k (where half of specgate-pool's servers draft for a class
that gains little), 8k two-class because there the classes diverge most; and one light cell a N
(16 a GPU, two classes at 1k), where the adaptive engines still draft and batches' mix of
acceptance matters (SPECGATE_ADAPTIVE_PLACEMENT), added before the full run.
Estimated: ~25 minutes with three configurations, ~48 with six. Windows: 2 simulated seconds (on
to 20 until every configuration has --min-requests good requests), one for all configurations of
a run; first sessions staggered over 2 s. Each cell's time scale holds the configurations'
estimated output near 16,000 tokens a wall second together (~6,700 relayed in fact: 50-70% of
two cores with three configurations).

Scoring per cell, in simulated time: goodput (requests a second finishing in the window within
TTFT <= 1000 ms and TPOT <= 50 ms), each configuration's over smg-adaptive's and each class's over
its goodput under smg-adaptive. Pooling, fixed before any run: a cell's ratio is the configuration's
goodput summed over its seeds over smg-adaptive's, its 90% interval a percentile bootstrap over the
seeds (2,000 draws, seed 0); unknown where a seed was inconclusive for either, or fewer than 5.
Targets (specgate-pool over smg-adaptive): >= 1.10x in every two-class cell where anyone meets
the SLOs, at N=2 and N=4; >= 0.97x in one-class cells; no class below 0.9x of its goodput under
smg-adaptive in any cell. Met where the whole interval clears the target, missed where it falls
short, else unknown: an inconclusive figure is unknown, never a pass. The other specgates' verdicts
are reported for information.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from proxy.config import Settings

from ..args import count, names, non_negative, positive
from ..kit.command import add_command, add_protocol_run_options, check_max_tokens, conclude, say
from ..kit.multiturn import parse_context
from ..overhead import default_peers_venv
from .protocol import REFERENCE, SMG, Cell, FieldPlan, default_cells, runnable
from .report import markdown, summary_lines, table
from .run import run_all, runs_from
from .score import FieldRun


def cell_list(text: str) -> tuple[Cell, ...]:
    """--cells: a comma list of N:TRAFFIC:CONTEXT:SESSIONS_A_GPU, e.g. 2:AB:1k:64 (an argparse type)."""
    out = []
    for item in names(text):
        try:
            n, traffic, context, per_gpu = item.split(":")
            out.append(Cell(int(n), traffic, parse_context(context), int(per_gpu)))
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"{item!r}: N:TRAFFIC:CONTEXT:SESSIONS_A_GPU ({exc})") from None
    return tuple(out)


def smg_binary(smg: str | None, peers_venv: str | None) -> str | None:
    """--smg's binary, else --peers-venv's (or the default peers venv's) bin/smg where it exists."""
    if smg:
        return smg
    venv = Path(peers_venv) if peers_venv else default_peers_venv()
    found = venv / "bin" / "smg" if venv else None
    return str(found) if found is not None and found.exists() else None


def setting(text: str) -> tuple[str, str]:
    """--set's NAME=VALUE, NAME one of Settings' fields."""
    name, eq, value = text.partition("=")
    if not eq or name not in Settings.model_fields:
        raise argparse.ArgumentTypeError(f"{text!r}: NAME=VALUE, NAME one of specgate's settings (as prefill_tok_s)")
    return name, value


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = add_command(sub, "field", "the field's setup (smg + adaptive engines) beside specgate on N GPUs", __doc__)
    p.add_argument("--cells", type=cell_list, default=default_cells(), metavar="LIST",
                   help="N:TRAFFIC:CONTEXT:SESSIONS_A_GPU, comma-separated (default: the protocol's)")  # fmt: skip
    p.add_argument("--configs", type=names, default=FieldPlan.configs, metavar="LIST",
                   help=f"some configurations (default all; without {REFERENCE} every ratio is unknown)")  # fmt: skip
    p.add_argument("--seeds", type=count, default=FieldPlan.seeds, help="seeds a cell (default 5)")
    p.add_argument("--seed", type=int, default=FieldPlan.seed, help="the first seed (default 0)")
    p.add_argument("--turns", type=count, default=FieldPlan.turns)
    p.add_argument("--max-tokens", type=int, default=FieldPlan.max_tokens)
    p.add_argument("--think-time-s", type=non_negative, default=FieldPlan.think_time_s, help="simulated")
    p.add_argument("--stagger-s", type=non_negative, default=FieldPlan.stagger_s, help="simulated")
    p.add_argument("--window-s", type=positive, default=FieldPlan.window_s, help="simulated")
    p.add_argument("--max-window-s", type=positive, default=FieldPlan.max_window_s, help="simulated")
    p.add_argument("--min-requests", type=int, default=FieldPlan.min_requests)
    p.add_argument(
        "--machine-tok-s",
        type=positive,
        default=FieldPlan.machine_tok_s,
        help="output tokens a wall second every stack of a cell relays together, which sets each cell's time "
        "scale (lower: a slower simulated clock, less of the machine per simulated second); not the protocol's "
        "where changed",
    )
    p.add_argument(
        "--set",
        type=setting,
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a setting for every specgate configuration (Settings' field name, as prefill_tok_s=20000; "
        "time settings on the simulated clock), for a one-off: not the protocol's; repeatable",
    )
    p.add_argument("--smg", default=None, metavar="BINARY", help="smg's binary (default: the peers venv's)")
    p.add_argument("--peers-venv", default=None, metavar="DIR", help="where scripts/install-peers put smg")
    p.add_argument("--markdown", default=None, metavar="PATH", help="write the report's markdown body here too")
    p.add_argument(
        "--report-from",
        default=None,
        metavar="FIELD_JSON",
        help="run nothing: report again the runs a field.json holds (written after each run) into --out-dir",
    )
    add_protocol_run_options(p, "field-results")


def plan_of(args: argparse.Namespace) -> FieldPlan:
    check_max_tokens(args.max_tokens)
    return FieldPlan(
        cells=args.cells, configs=tuple(args.configs), seeds=args.seeds, seed=args.seed, turns=args.turns,
        max_tokens=args.max_tokens, think_time_s=args.think_time_s, stagger_s=args.stagger_s,
        window_s=args.window_s, max_window_s=max(args.max_window_s, args.window_s), min_requests=args.min_requests,
        machine_tok_s=args.machine_tok_s, extra=tuple(args.set),
    )  # fmt: skip


def dry_run(plan: FieldPlan, configs: tuple[str, ...], skipped: dict[str, str]) -> list[str]:
    """The plan, printed: cells, each one's time scale, seeds and configurations (and the skipped)."""
    lines = [f"configurations: {', '.join(configs)}", *(f"skipped {c}: {why}" for c, why in skipped.items())]
    lines += [f"{c.label}: {c.sessions} sessions, time scale {plan.time_scale(c, len(configs)):g}" for c in plan.cells]
    lines.append(f"seeds {', '.join(map(str, plan.seed_list()))}; {len(plan.cells) * plan.seeds} runs")
    return lines


def cmd_field(args: argparse.Namespace) -> int:
    if args.report_from:
        return _report_again(args)
    plan = plan_of(args)
    configs, skipped = runnable(plan.configs, Settings.model_fields)
    if args.dry_run:
        print("\n".join(dry_run(plan, configs, skipped)))
        return 0
    smg = smg_binary(args.smg, args.peers_venv)
    if smg is None and any(c in SMG for c in configs):
        raise ValueError("smg not found: --smg BINARY or --peers-venv DIR (scripts/install-peers installs it)")
    for config, why in skipped.items():
        say(f"note: {config}: {why}", args.quiet)
    out_dir = Path(args.out_dir)
    started = time.monotonic()
    reuse = Path(args.calibrations) if args.calibrations else None
    runs = run_all(plan, configs, smg or "", Settings.model_fields, out_dir, reuse, args.quiet)
    wall = round(time.monotonic() - started, 1)
    _write(args, plan, runs, configs, skipped, wall, started)
    return 0


def _report_again(args: argparse.Namespace) -> int:
    """--report-from: the report of runs already made, from their field.json."""
    plan, runs = runs_from(Path(args.report_from))
    configs = tuple(c for c in plan.configs if any(c in r.targets for r in runs))
    _write(args, plan, runs, configs, {}, None, time.monotonic())
    return 0


def _write(
    args: argparse.Namespace,
    plan: FieldPlan,
    runs: list[FieldRun],
    configs: tuple[str, ...],
    skipped: dict[str, str],
    wall: float | None,
    started: float,
) -> None:
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "settings": plan, "configs": configs, "skipped": skipped, "runs": runs, "tables": table(runs, configs),
        "summary": summary_lines(runs, configs, skipped), "wall_s": wall,
    }  # fmt: skip
    command = shlex.join(["python", "-m", "loadtest", "field", *sys.argv[2:]])
    body = markdown(plan, runs, configs, skipped, command, wall)
    (out_dir / "field.md").write_text(body)
    if args.markdown:
        Path(args.markdown).write_text(body)
    conclude(out_dir, "field", report, [*report["tables"], *report["summary"]], started, wall_s=wall)
