"""A cell of targets measured side by side: their processes and URLs, every target driven at once
with the same multi-turn sessions while the servers' queue gauges and the machine's CPU are sampled,
and the processes stopped at the end (headtohead's cells, and the experiments' on them)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import aiohttp

from ..client import Target
from ..production import WorkloadRun
from ..sweep import LevelPlan, first_model, make_session, measure_together
from ..textbank import TextBank
from ..workload import Workload, WorkloadSpec
from .command import say
from .figures import TargetCell
from .multiturn import MAX_WAIT_S
from .processes import Fleet
from .sampling import CpuMeter, CpuUse, cpu_use, get_text, metric_samples, self_cpu_s

# Gauges are read this often, in wall seconds.
SAMPLE_S = 1.0
QUEUE = "sglang:num_queue_reqs"
POOL = "sglang:max_total_num_tokens"


@dataclass
class Servers:
    """A cell's processes and where to reach them: each target's URL, and the servers behind each
    target whose gauges are read (the pair: both)."""

    urls: dict[str, str]
    servers: dict[str, dict[str, str]]
    fleet: Fleet
    # A target that sends each class to a URL of its own (a static split): target -> class -> URL.
    class_urls: dict[str, dict[str, str]] = field(default_factory=dict)
    # A target that keeps each stream on one of several URLs (client.Target.stream_urls).
    stream_urls: dict[str, tuple[str, ...]] = field(default_factory=dict)


@dataclass
class CellCapture:
    """What one cell's run recorded: each target's requests and window, the servers' queue gauges
    (target -> samples of the sum over its servers), KV pools and the machine's CPU."""

    runs: dict[str, WorkloadRun]
    # (when, queued) samples, by target.
    queued: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    pools: dict[str, float] = field(default_factory=dict)
    cpu_samples: list[tuple[float, float]] = field(default_factory=list)

    def mean_queued(self, target: str) -> float | None:
        """The target's queue gauges' mean over the samples inside its window (None: none)."""
        run = self.runs.get(target)
        if run is None:
            return None
        inside = [q for at, q in self.queued.get(target, ()) if run.t0 <= at <= run.t1]
        return sum(inside) / len(inside) if inside else None


async def _gauges(session: aiohttp.ClientSession, servers: Mapping[str, str]) -> dict[str, tuple[float, float]]:
    """Each server's (queue, KV pool), by server name; a server that does not answer is left out."""
    out: dict[str, tuple[float, float]] = {}
    for name, url in servers.items():
        with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
            found = metric_samples(await get_text(session, url + "/metrics"), (QUEUE, POOL))
            out[name] = (sum(v for _, v in found[QUEUE]), sum(v for _, v in found[POOL]))
    return out


async def _sample(session: aiohttp.ClientSession, servers: Servers, cap: CellCapture, done: asyncio.Event) -> None:
    """Queue gauges and the machine's CPU about every SAMPLE_S until `done`."""
    t0 = time.monotonic()
    cpu = CpuMeter(t0, cap.cpu_samples)
    while not done.is_set():
        for target, backends in servers.servers.items():
            g = await _gauges(session, backends)
            if g:
                cap.queued.setdefault(target, []).append((time.monotonic(), sum(queue for queue, _ in g.values())))
            for name, (_, pool) in g.items():
                cap.pools[f"{target}/{name}"] = pool
        cpu.poll(time.monotonic())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(done.wait(), SAMPLE_S)


class CellPlan(Protocol):
    """What a cell is measured by: headtohead's plan, or the experiments' on its cells."""

    @property
    def window_s(self) -> float: ...
    @property
    def max_window_s(self) -> float: ...
    @property
    def min_requests(self) -> int: ...
    @property
    def max_tokens(self) -> int: ...

    def time_scale(self, sessions: int, context: int) -> float: ...

    def workload(self, context: int, sessions: int) -> WorkloadSpec: ...


async def measure_cell(
    plan: CellPlan, context: int, sessions: int, servers: Servers, tag_requests: bool = False
) -> CellCapture:
    """Every target at once, each `sessions` multi-turn streams of the same sessions; `tag_requests`:
    each request names its class and session (x-specgate-class, x-session-id)."""
    t = plan.time_scale(sessions, context)
    spec = plan.workload(context, sessions)
    level = LevelPlan(duration_s=plan.window_s / t, max_duration_s=plan.max_window_s / t, max_wait_s=MAX_WAIT_S / t)
    bank = TextBank(spec.seed)
    cap = CellCapture(runs={})
    done = asyncio.Event()
    async with make_session() as session:
        targets = {
            name: Target(
                url,
                await first_model(url, None),
                chat=True,
                max_tokens=plan.max_tokens,
                tag_requests=tag_requests,
                class_urls=servers.class_urls.get(name, {}),
                stream_urls=servers.stream_urls.get(name, ()),
            )
            for name, url in servers.urls.items()
        }
        sampler = asyncio.create_task(_sample(session, servers, cap, done))
        try:
            workloads = {name: Workload(spec, bank) for name in targets}
            runs = await measure_together(session, targets, sessions, level, workloads, plan.min_requests)
            for name, run in runs.items():
                cap.runs[name] = WorkloadRun(run.results, run.t0, run.t1, sessions, run.extended_s, run.died)
        finally:
            done.set()
            await sampler
    return cap


def run_stacks(
    plan: CellPlan,
    context: int,
    sessions: int,
    servers: Servers,
    tag_requests: bool = False,
    before_stop: Callable[[Servers], None] | None = None,
) -> tuple[CellCapture, CpuUse]:
    """The cell measured on `servers` (measure_cell) with the machine's CPU over it; `before_stop`
    called while every process still runs (a last scrape); the processes stopped, also where this
    raises."""
    try:
        cpu0 = self_cpu_s()
        cap = asyncio.run(measure_cell(plan, context, sessions, servers, tag_requests))
        cpu = cpu_use(cap.cpu_samples, servers.fleet.procs, self_cpu_s() - cpu0)
        if before_stop is not None:
            before_stop(servers)
    finally:
        servers.fleet.stop()
    return cap, cpu


def say_goodput(targets: Mapping[str, TargetCell], cpu: CpuUse, quiet: bool, unit: str = "", warn: bool = True) -> None:
    """A cell's progress line: each target's goodput (* inconclusive) and the machine's CPU; with
    `warn`, why its timings are not to be trusted where they are not."""
    figures = ", ".join(f"{n} {c.goodput_req_s:.2f}{'' if c.conclusive else '*'}" for n, c in targets.items())
    say(f"    goodput {figures}{unit}; CPU {cpu.machine_busy_mean:.0%}", quiet)
    if warn and cpu.warning:
        say(f"    warning: {cpu.warning}", quiet)
