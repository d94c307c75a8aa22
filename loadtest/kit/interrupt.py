"""Ctrl-C (or SIGTERM) on a sweeping command: the levels it completed, printed before it exits.

A sweep keeps each level as it completes in the `Measured` its command hands it (on the command's
arguments, `args.measured`, so a command whose sweeps run deep in its own code needs one line to
take part: `with reported_if_interrupted(args, table):` around its `asyncio.run`). The interrupt
itself unwinds as before: asyncio cancels the measurement, every `finally` stops what it started,
and `loadtest/__main__.py` turns it into exit status 130 (143 for SIGTERM)."""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from ..report import compare_table, level_table
from ..stats import LevelStats

Sweep = dict[str, list[LevelStats]]
# What a command prints of one sweep's levels: its normal table.
Table = Callable[[Mapping[str, Sequence[LevelStats]]], str]


@dataclass
class Measured:
    """Every sweep a command ran, in order, each target's levels appended as each completes."""

    sweeps: list[Sweep] = field(default_factory=list)

    def begin(self, names: Iterable[str]) -> Sweep:
        """A new sweep of these targets, empty, kept here: the caller appends its levels to it."""
        sweep: Sweep = {name: [] for name in names}
        self.sweeps.append(sweep)
        return sweep


def measured_of(args: argparse.Namespace) -> Measured | None:
    """The record a command asked its sweeps to keep (reported_if_interrupted), if it did."""
    found = getattr(args, "measured", None)
    return found if isinstance(found, Measured) else None


@contextlib.contextmanager
def reported_if_interrupted(args: argparse.Namespace, table: Table) -> Iterator[Measured]:
    """Keep what the command's sweeps measure; on Ctrl-C or SIGTERM print it with `table`, say the
    run was interrupted, and let the interrupt go on to set the exit status."""
    measured = Measured()
    args.measured = measured
    try:
        yield measured
    except KeyboardInterrupt:
        print(interrupted_text(measured, table), flush=True)
        raise


def interrupted_text(measured: Measured, table: Table) -> str:
    """What an interrupted command prints: a line saying so, and each sweep's completed levels."""
    done = [sweep for sweep in measured.sweeps if any(sweep.values())]
    if not done:
        return "\ninterrupted before any level completed: nothing was measured"
    head = (
        "\ninterrupted: the levels completed before the interrupt follow; nothing is concluded from a partial "
        "sweep (no crossover, recommendation, plot or --out file)"
    )
    parts = [head]
    for i, sweep in enumerate(done, 1):
        parts.append((f"sweep {i} of {len(done)}:\n" if len(done) > 1 else "") + table(sweep))
    return "\n\n".join(parts)


def common_levels(sweep: Mapping[str, Sequence[LevelStats]]) -> dict[str, list[LevelStats]]:
    """Each target's levels cut to those every target completed: levels run outer and targets
    inner, so an interrupted level holds some targets and not others."""
    n = min((len(rows) for rows in sweep.values()), default=0)
    return {name: list(rows[:n]) for name, rows in sweep.items()}


def comparison(sweep: Mapping[str, Sequence[LevelStats]]) -> str:
    """The comparison table of the levels both servers (and every other target) completed; a sweep
    without both servers (the demo's sweep of specgate alone), each target's level table."""
    common = common_levels(sweep)
    if {"speculative", "baseline"} <= common.keys() and common["speculative"]:
        return compare_table(common)
    return "\n\n".join(level_table(name, rows) for name, rows in sweep.items() if rows)


def tables_and_comparison(sweep: Mapping[str, Sequence[LevelStats]]) -> str:
    """`compare`'s tables: each target's level table, then the comparison (comparison)."""
    tables = [level_table(name, rows) for name, rows in sweep.items() if rows]
    common = common_levels(sweep)
    if {"speculative", "baseline"} <= common.keys() and common["speculative"]:
        tables.append(compare_table(common))
    return "\n\n".join(tables)
