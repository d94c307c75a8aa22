"""argparse types shared by the load tester's subcommands."""

from __future__ import annotations

import argparse


def sorted_ints(raw: str, least: int, too_small: str, listing: str = "a comma list of integers") -> list[int]:
    """A comma list of integers: sorted, unique, at least `least` (`too_small` says so otherwise)."""
    try:
        found = sorted({int(x) for x in raw.split(",") if x.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"{raw!r} is not {listing}") from None
    if not found or found[0] < least:
        raise argparse.ArgumentTypeError(too_small)
    return found


def levels(raw: str) -> list[int]:
    """A comma list of concurrency levels: sorted, unique, positive."""
    return sorted_ints(raw, 1, "concurrency levels must be positive integers")


def level_tuple(raw: str) -> tuple[int, ...]:
    """levels() as a tuple, for a plan's frozen field."""
    return tuple(levels(raw))


def names(raw: str) -> tuple[str, ...]:
    """A comma list of names, each stripped, empty ones left out (their plan checks them)."""
    return tuple(n.strip() for n in raw.split(",") if n.strip())


def count(raw: str) -> int:
    """An integer >= 1."""
    return _integer(raw, 1)


def non_negative_int(raw: str) -> int:
    """An integer >= 0."""
    return _integer(raw, 0)


def _integer(raw: str, least: int) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{raw!r} is not an integer") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"{raw} must be at least {least}")
    return value


def positive(raw: str) -> float:
    """A number > 0."""
    value = float(raw)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{raw} must be > 0")
    return value


def non_negative(raw: str) -> float:
    """A number >= 0."""
    value = float(raw)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{raw} must be >= 0")
    return value
