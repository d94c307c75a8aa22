"""What a scenario command's progress and argument checks share."""

from __future__ import annotations

import sys


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
