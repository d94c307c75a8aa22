"""Readings taken beside the load: the machine's CPU, /metrics pages (through `proxy.promtext`, the
gateway's own parser) and JSON pages."""

from __future__ import annotations

import contextlib
import math
import os
import resource
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from proxy.fleet import promtext

from ..procs import Proc
from ..report import fmt

CPU_WARN_MEAN = 0.85  # machine CPU busy share over the run past which the figures are suspect
CPU_WARN_SATURATED = 0.10  # or this share of 1 s samples at >= CPU_SATURATED busy
CPU_SATURATED = 0.97
CPU_SAMPLE_S = 1.0


def proc_stat() -> tuple[float, float]:
    """(busy, total) jiffies of all cores, from /proc/stat; (0, 0) where there is none."""
    try:
        with open("/proc/stat") as f:
            parts = [float(x) for x in f.readline().split()[1:]]
    except OSError:
        return 0.0, 0.0
    idle = parts[3] + (parts[4] if len(parts) > 4 else 0.0)
    total = sum(parts[:8])
    return total - idle, total


def self_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class CpuMeter:
    """The machine's busy share, one sample (t, share) about every second, from `poll`s."""

    def __init__(self, t0: float, samples: list[tuple[float, float]]) -> None:
        self.t0 = t0
        self.samples = samples
        self._busy, self._total = proc_stat()
        self._at = time.monotonic()

    def poll(self, now: float) -> None:
        if now - self._at < CPU_SAMPLE_S:
            return
        busy, total = proc_stat()
        if total > self._total:
            self.samples.append((now - self.t0, (busy - self._busy) / (total - self._total)))
        self._busy, self._total, self._at = busy, total, now


@dataclass(frozen=True)
class CpuUse:
    cores: int
    machine_busy_mean: float  # share of all cores busy over the load, whoever used them
    machine_busy_p95: float  # of 1 s samples
    saturated_share: float  # share of 1 s samples at >= CPU_SATURATED
    by_process_s: dict[str, float]  # CPU seconds over the run: load tester, simulators, specgates
    warning: str | None = None
    timeline: list[tuple[float, float]] = field(default_factory=list)  # (t, busy share over the last ~1 s)

    def line(self, label: str) -> str:
        procs = ", ".join(f"{k} {v:g} s" for k, v in self.by_process_s.items())
        return (
            f"CPU {label}: machine {fmt(self.machine_busy_mean * 100, 0)}% busy on average "
            f"(p95 {fmt(self.machine_busy_p95 * 100, 0)}%, {self.cores} cores); CPU time: {procs}"
        )


def cpu_use(samples: Sequence[tuple[float, float]], procs: Sequence[Proc], tester_cpu_s: float) -> CpuUse:
    """The machine's CPU over a run from its samples, and each process's CPU seconds (the simulators
    added up); a warning where the machine was too busy for the timings to be trusted."""
    shares = sorted(share for _, share in samples)
    mean = sum(shares) / len(shares) if shares else math.nan
    p95 = shares[min(len(shares) - 1, int(0.95 * len(shares)))] if shares else math.nan
    saturated = sum(1 for x in shares if x >= CPU_SATURATED) / len(shares) if shares else math.nan
    by: dict[str, float] = {"load tester": round(tester_cpu_s, 1)}
    for proc in procs:
        group = "simulators" if proc.name.startswith("simulators") else proc.name
        with contextlib.suppress(OSError, RuntimeError, ValueError):
            by[group] = round(by.get(group, 0.0) + proc.cpu_seconds(), 1)
    warning = None
    if shares and (mean > CPU_WARN_MEAN or saturated > CPU_WARN_SATURATED):
        warning = (
            f"the machine's CPU was {mean:.0%} busy on average ({saturated:.0%} of seconds at >= "
            f"{CPU_SATURATED:.0%}): simulators, specgates and the load tester competed for it, so timings "
            "are stretched; compare targets with each other rather than with the profile, or use a lower "
            "--time-scale or fewer levels"
        )
    timeline = [(round(t, 2), round(share, 3)) for t, share in samples]
    return CpuUse(os.cpu_count() or 1, mean, p95, saturated, by, warning, timeline)


async def get_text(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=5)) as resp:
        resp.raise_for_status()
        return await resp.text()


async def get_json(session: aiohttp.ClientSession, url: str) -> Any:
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=5)) as resp:
        return orjson.loads(await resp.read())


def metric_samples(text: str, names: Sequence[str]) -> dict[str, list[tuple[dict[str, str], float]]]:
    """The samples of the named series by name, (labels, value) each; only their lines are parsed."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {n: [] for n in names}
    for s in promtext.samples(text, names):
        out[s.name].append((dict(s.labels), s.value))
    return out
