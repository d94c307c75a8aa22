"""What a scenario command's progress, argument checks and ending share."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from ..report import write_json
from ..stats import DEFAULT_MIN_REQUESTS


def say(text: str, quiet: bool) -> None:
    """A progress line on stderr (stdout is the report's)."""
    if not quiet:
        print(text, file=sys.stderr, flush=True)


def check_profile(name: str) -> None:
    """A simulator profile that loads, or ValueError naming the flag."""
    from ..simulator.profile import ProfileError, load_profile

    try:
        load_profile(name)
    except ProfileError as exc:
        raise ValueError(f"--profile: {exc}") from None


def check_settle(settle_s: float, window_s: float, window_flag: str) -> None:
    """The unscored start of a window must leave some of it to score."""
    if not 0 <= settle_s < window_s:
        raise ValueError(f"--settle-s {settle_s:g} must be in [0, {window_flag} {window_s:g})")


def check_max_tokens(max_tokens: int) -> None:
    if max_tokens < 2:
        raise ValueError("--max-tokens must be at least 2")


def add_command(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], name: str, summary: str, protocol: str | None
) -> argparse.ArgumentParser:
    """A scenario's subcommand: `summary` in the commands' list, its --help its `protocol` (the
    module's docstring) as written."""
    return sub.add_parser(
        name, help=summary, description=protocol, formatter_class=argparse.RawDescriptionHelpFormatter
    )


def add_run_options(p: argparse.ArgumentParser, needs: str, out_dir: str) -> None:
    """The options a side-by-side scenario ends with; `needs`: what --min-requests counts for."""
    p.add_argument(
        "--min-requests",
        type=int,
        default=DEFAULT_MIN_REQUESTS,
        help=f"good requests {needs} (default {DEFAULT_MIN_REQUESTS})",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts")
    p.add_argument("--out-dir", default=out_dir)
    p.add_argument("--quiet", action="store_true", help="no progress lines")


def add_protocol_run_options(p: argparse.ArgumentParser, out_dir: str) -> None:
    """The options a fixed-protocol benchmark ends with: none of them changes what it measures."""
    p.add_argument("--calibrations", default=None, metavar="DIR", help="reuse an earlier run's calibrations")
    p.add_argument("--dry-run", action="store_true", help="print the plan and start nothing")
    p.add_argument("--out-dir", default=out_dir)
    p.add_argument("--quiet", action="store_true", help="no progress lines")


def conclude(
    out_dir: Path,
    name: str,
    report: Mapping[str, Any],
    lines: Iterable[str],
    started: float,
    draw: Callable[[Path], None] | None = None,
    wall_s: float | None = None,
) -> None:
    """A scenario's tail: its report's lines printed (table, verdicts, warnings), its plot drawn to
    OUT_DIR/NAME.png (`draw`, where it has one), the report written to OUT_DIR/NAME.json, and where
    they are and how long the run took (`wall_s`, else the time since `started`, time.monotonic())."""
    for line in lines:
        print(line)
    plot = out_dir / f"{name}.png"
    if draw is not None:
        draw(plot)
    data = out_dir / f"{name}.json"
    write_json(data, report)
    seconds = time.monotonic() - started if wall_s is None else wall_s
    print(f"\n{f'plot: {plot}   ' if draw is not None else ''}data: {data}   ({seconds:.0f} s)")
