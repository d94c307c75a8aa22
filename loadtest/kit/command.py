"""What a scenario command's progress and argument checks share."""

from __future__ import annotations

import argparse
import sys

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
