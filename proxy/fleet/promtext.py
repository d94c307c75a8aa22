"""Prometheus text, parsed in one place: the gateway's engine readings (readings.py) and every tool
that reads a /metrics page (the load tester, the tests). Which label sets an engine counts, and
which labels hold a value, are the engine adapters' to say (`Series`, `label_product`).

Only the lines of the wanted names are handed to the parser (prometheus_client's, ~12 us a line):
a big /metrics, most of it histogram buckets, then costs one scan of its text, not a parse of it.
"""

from __future__ import annotations

import functools
import itertools
import math
import re
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families


class TooManySamples(ValueError):
    """More sample lines of the wanted names than the caller's limit."""


@dataclass(frozen=True, slots=True)
class Sample:
    name: str
    labels: Mapping[str, str]
    value: float


def samples(text: str, wanted: Collection[str] | None = None, limit: int | None = None) -> list[Sample]:
    """Every sample of `text` (with `wanted`, only those of these full names), NaN included. Raises
    ValueError on text that is not the Prometheus format, TooManySamples past `limit` wanted lines."""
    if wanted is not None:
        text = _lines_named(text, frozenset(wanted), limit)
    return [Sample(s.name, s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples]


def totals(text: str, wanted: Collection[str] | None = None, limit: int | None = None) -> dict[str, float]:
    """Each sample name's value summed over its label sets (tensor/data-parallel ranks, vLLM's engine
    index); NaN samples are left out. A sum past the float range is inf, as is a value written so."""
    return summed(samples(text, wanted, limit))


def summed(found: Iterable[Sample]) -> dict[str, float]:
    """Each name's samples summed (`totals`), NaN left out."""
    out: dict[str, float] = {}
    for s in found:
        if not math.isnan(s.value):
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def by_label(text: str, name: str, label: str) -> dict[str, float]:
    """One series' values summed by one label's value (an absent label reads "")."""
    out: dict[str, float] = {}
    for s in samples(text, (name,)):
        key = s.labels.get(label, "")
        out[key] = out.get(key, 0.0) + s.value
    return out


@dataclass(frozen=True)
class Series:
    """Which label sets of some names are the server's own count, each once (the others repeat or
    split one of them)."""

    names: tuple[str, ...]  # the names (unprefixed) these rules apply to
    # A label, and its value on the series that holds the total (absent: also the total).
    total: tuple[str, str] | None = None
    # Of the series of one `group` value (absent: one group), only those of the lowest `rank`.
    rank: str | None = None
    group: str | None = None

    def own(self, found: list[Sample], prefixes: tuple[str, ...]) -> list[Sample]:
        names = {p + n for p in prefixes for n in self.names}
        lowest: dict[tuple[str, str], tuple[int, int, str]] = {}
        kept: list[tuple[Sample, tuple[str, str], tuple[int, int, str]]] = []
        for s in found:
            if s.name not in names:
                continue
            if self.total is not None and s.labels.get(self.total[0], self.total[1]) != self.total[1]:
                continue
            key = (s.name, s.labels.get(self.group, "") if self.group else "")
            rank = _rank(s.labels.get(self.rank, "")) if self.rank is not None else (0, 0, "")
            kept.append((s, key, rank))
            lowest[key] = min(lowest.get(key, rank), rank)
        return [s for s in found if s.name not in names] + [s for s, key, rank in kept if rank == lowest[key]]


def _rank(label: str) -> tuple[int, int, str]:
    """A rank label's order: numbers by value (compared as digits: any length), before anything else."""
    if label.isascii() and label.isdigit():
        digits = label.lstrip("0")
        return (0, len(digits), digits)
    return (1, 0, label)


def label_product(labels: Mapping[str, str], names: tuple[str, ...]) -> float | None:
    """The product of these labels' whole numbers; None where one is absent or not one ("None")."""
    out = 1.0
    for name in names:
        text = labels.get(name, "")
        if not (text.isascii() and text.isdigit()):
            return None
        out *= float(text)  # any length: past the float range it is inf, refused as any value is
    return out


@functools.lru_cache(maxsize=32)
def _line_pattern(wanted: frozenset[str]) -> re.Pattern[str]:
    # A newline, then one of the names, then what ends a name: labels or the value. Names that share
    # a literal start ("\nsglang") are found at C speed; comments (HELP, TYPE) are dropped too, and
    # untyped samples parse to the same names and values.
    names = "|".join(re.escape(n) for n in sorted(wanted))
    return re.compile(rf"\n((?:{names})[ \t{{][^\n]*)")


def _lines_named(text: str, wanted: frozenset[str], limit: int | None) -> str:
    if not wanted:
        return ""
    # A newline first, so that the first line is found as all the others are.
    found = _line_pattern(wanted).finditer("\n" + text)
    lines = [m.group(1) for m in (found if limit is None else itertools.islice(found, limit + 1))]
    if limit is not None and len(lines) > limit:
        raise TooManySamples(f"/metrics holds more than {limit} series of the names read")
    return "\n".join(lines) + "\n"
