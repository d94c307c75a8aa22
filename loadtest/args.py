"""argparse types shared by the load tester's subcommands."""

from __future__ import annotations

import argparse


def levels(raw: str) -> list[int]:
    """A comma list of concurrency levels: sorted, unique, positive."""
    try:
        found = sorted({int(x) for x in raw.split(",") if x.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"{raw!r} is not a comma list of integers") from None
    if not found or found[0] < 1:
        raise argparse.ArgumentTypeError("concurrency levels must be positive integers")
    return found


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
