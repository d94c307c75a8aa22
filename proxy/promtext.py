"""Prometheus text, parsed in one place: the gateway's engine readings (engines.py) and every tool
that reads a /metrics page (the load tester, the tests).

Only the lines of the wanted names are handed to the parser (prometheus_client's, ~12 us a line):
a big /metrics, most of it histogram buckets, then costs one scan of its text, not a parse of it.
"""

from __future__ import annotations

import functools
import itertools
import math
import re
from collections.abc import Collection, Mapping
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
    out: dict[str, float] = {}
    for s in samples(text, wanted, limit):
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
