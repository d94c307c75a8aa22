"""scaleout's run: each configuration's simulators and replicas, closed-loop load stepped through the
levels, and every server's and replica's /metrics read beside it."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import itertools
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from ..client import RequestResult, Target
from ..kit.command import say
from ..kit.driving import chat_target, drain, sleep_until, stream, ticks
from ..kit.processes import Fleet, calibrate_fresh_pair, calibrate_options
from ..kit.sampling import CpuMeter, CpuUse, cpu_use, get_text, metric_samples, self_cpu_s
from ..procs import free_port, simulator_args
from ..prompts import Prompt, source
from ..sweep import make_session
from .plan import CALIBRATE_DURATION_S, CALIBRATE_LEVELS, ScaleoutPlan, Server, Watermarks, config_watermarks, gate_env

SERVER_METRICS = (
    "sglang:num_running_reqs",
    "sglang:num_queue_reqs",
    "sglang:generation_tokens_total",
    "sglang:num_requests_total",
)
GATE_METRICS = (
    "specgate_group_mode",
    "specgate_group_mode_switches_total",
    "specgate_routing_mode",
    "specgate_mode_switches_total",
    "specgate_group_load",
    "specgate_load",
    "specgate_server_inflight",
)


@dataclass
class ServerSample:
    t: float  # seconds since the run's load began
    running: float
    queued: float
    generated: float  # sglang:generation_tokens_total
    requests: float  # sglang:num_requests_total (finished)
    tick: bool  # a periodic sample (False: taken at a level boundary)

    @property
    def inflight(self) -> float:
        return self.running + self.queued


@dataclass
class GateSample:
    t: float
    modes: dict[str, str]  # group -> speculative | baseline
    switches: dict[str, float] | None  # group -> switches since start; None: not exported
    tick: bool
    # group -> the load its policy compares with the watermarks (the replica's estimate); empty: not exported
    loads: dict[str, float] = field(default_factory=dict)
    # server -> this replica's own requests in flight there; None: not exported
    own: dict[str, float] | None = None


@dataclass
class ConfigRun:
    """One configuration: its servers, replicas and what its run recorded."""

    name: str
    high: int
    low: int
    servers: list[Server] = field(default_factory=list)
    replicas: list[str] = field(default_factory=list)
    t0: float = 0.0
    results: list[RequestResult] = field(default_factory=list)
    server_samples: dict[str, list[ServerSample]] = field(default_factory=dict)
    gate_samples: list[list[GateSample]] = field(default_factory=list)  # per replica
    cpu_samples: list[tuple[float, float]] = field(default_factory=list)  # of the batch it ran in


def start_configs(plan: ScaleoutPlan, names: Sequence[str], wm: Watermarks, fleet: Fleet) -> list[ConfigRun]:
    """Fresh simulators for each configuration, then its replicas in front of all of them; the
    processes of a kind start together, so starting costs the slowest, not the sum."""
    runs = [ConfigRun(name, *config_watermarks(name, wm)) for name in names]
    for run in runs:
        _start_servers(plan, run, fleet)
    fleet.ready()
    for run in runs:
        for i in range(plan.replicas):
            env = functools.partial(gate_env, plan, run.servers, high=run.high, low=run.low)
            run.replicas.append(fleet.start_specgate(f"specgate-{run.name}-{i}", env))
        run.server_samples = {s.name: [] for s in run.servers}
        run.gate_samples = [[] for _ in run.replicas]
    fleet.ready()
    return runs


def _start_servers(plan: ScaleoutPlan, run: ConfigRun, fleet: Fleet) -> None:
    """Start a configuration's simulators (not waiting for them)."""
    if plan.topology == "paired":
        for i in range(plan.groups):
            spec_port, base_port = free_port(), free_port()
            pair = [Server(f"{role}-{i}", role, f"group-{i}", f"http://127.0.0.1:{port}")
                    for role, port in (("speculative", spec_port), ("baseline", base_port))]  # fmt: skip
            run.servers += pair
            fleet.start(
                f"simulators-{run.name}-{i}", plan.pair_args(spec_port, base_port), [s.url + "/health" for s in pair]
            )
        return
    for role, n in plan.role_counts().items():
        for i in range(n):
            port = free_port()
            run.servers.append(Server(f"{role}-{i}", role, "pool", f"http://127.0.0.1:{port}"))
            args = simulator_args(role, port, *plan.simulator_flags())
            fleet.start(f"simulators-{run.name}-{role}-{i}", args, [run.servers[-1].url + "/health"])


def calibrate_pair(plan: ScaleoutPlan, out_dir: Path, quiet: bool) -> Path:
    """Calibrate one fresh simulated pair with diverse prompts; the watermarks come from its file."""
    options = calibrate_options(plan.seed, plan.max_tokens, plan.min_requests)
    duration_s = CALIBRATE_DURATION_S / plan.time_scale
    return calibrate_fresh_pair(plan.pair_args, CALIBRATE_LEVELS, options, duration_s, out_dir, quiet)


def server_sample(text: str, t: float, tick: bool) -> ServerSample:
    found = metric_samples(text, SERVER_METRICS)

    def total(name: str) -> float:
        return sum(v for _, v in found[name])

    return ServerSample(
        t=t,
        running=total("sglang:num_running_reqs"),
        queued=total("sglang:num_queue_reqs"),
        generated=total("sglang:generation_tokens_total"),
        requests=total("sglang:num_requests_total"),
        tick=tick,
    )


def gate_sample(text: str, groups: Sequence[str], t: float, tick: bool) -> GateSample:
    """Modes and switch counts by group. A specgate without group metrics has one group at most:
    with one group, its ungrouped series stand in; with more, the counts are None (not exported)."""
    found = metric_samples(text, GATE_METRICS)
    modes = {
        labels.get("group", ""): "speculative" if v >= 0.5 else "baseline" for labels, v in found["specgate_group_mode"]
    }
    if not modes and len(groups) == 1 and found["specgate_routing_mode"]:
        modes = {groups[0]: "speculative" if found["specgate_routing_mode"][0][1] >= 0.5 else "baseline"}
    # A labelled counter has no sample before its first increment, only its HELP and TYPE lines.
    switches: dict[str, float] | None = None
    if "specgate_group_mode_switches" in text:
        switches = dict.fromkeys(groups, 0.0)
        for labels, v in found["specgate_group_mode_switches_total"]:
            g = labels.get("group", "")
            switches[g] = switches.get(g, 0.0) + v
    elif len(groups) == 1 and "specgate_mode_switches" in text:
        switches = {groups[0]: sum(v for _, v in found["specgate_mode_switches_total"])}
    # One group (paired with one pair, or the pool) is the gateway's own: specgate_load is its load.
    loads = {labels.get("group", ""): v for labels, v in found["specgate_group_load"]}
    if not loads and len(groups) == 1 and found["specgate_load"]:
        loads = {groups[0]: found["specgate_load"][0][1]}
    # A server this replica has sent nothing yet has no sample: 0 in flight.
    own = None
    if "specgate_server_inflight" in text:
        own = {labels.get("server", ""): v for labels, v in found["specgate_server_inflight"]}
    return GateSample(t, modes, switches, tick, loads, own)


async def scrape(
    session: aiohttp.ClientSession,
    runs: Sequence[ConfigRun],
    groups: Sequence[str],
    tick: bool,
    gates: Sequence[ConfigRun] = (),
) -> None:
    """Every server's /metrics, and those of the replicas of `gates`, each recorded with the time it
    answered; one that does not answer leaves no sample."""

    async def one_server(run: ConfigRun, s: Server) -> None:
        with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
            text = await get_text(session, s.url + "/metrics")
            run.server_samples[s.name].append(server_sample(text, time.monotonic() - run.t0, tick))

    async def one_gate(run: ConfigRun, i: int) -> None:
        with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
            text = await get_text(session, run.replicas[i] + "/metrics")
            run.gate_samples[i].append(gate_sample(text, groups, time.monotonic() - run.t0, tick))

    jobs = [one_server(run, s) for run in runs for s in run.servers]
    jobs += [one_gate(run, i) for run in gates for i in range(len(run.replicas))]
    await asyncio.gather(*jobs)


async def _step_levels(
    session: aiohttp.ClientSession,
    plan: ScaleoutPlan,
    runs: Sequence[ConfigRun],
    start_streams: Callable[[int, int], None],
    quiet: bool,
) -> None:
    """At each level's start, streams added up to it (levels rise: the last level's go on); every
    /metrics read at each level's start, its scored part's start and the end."""
    groups = plan.group_names()
    t0 = runs[0].t0
    running = 0
    for k, c in enumerate(plan.levels):
        await sleep_until(t0 + k * plan.level_s)
        if k:
            await scrape(session, runs, groups, tick=False, gates=runs)  # the level's start
        say(f"  level {k + 1}/{len(plan.levels)}: {c} streams", quiet)
        start_streams(running, c)
        running = max(running, c)
        await sleep_until(t0 + k * plan.level_s + plan.settle_s)
        await scrape(session, runs, groups, tick=False)  # the scored part's start
    await sleep_until(t0 + plan.duration_s)
    await scrape(session, runs, groups, tick=False, gates=runs)  # the end


async def _sample(session: aiohttp.ClientSession, plan: ScaleoutPlan, runs: Sequence[ConfigRun]) -> None:
    """Every server's /metrics and specgate's replicas' (its modes, for the plot) every sample
    period; the machine's CPU every second."""
    watched = [run for run in runs if run.name == "specgate"]
    t0 = runs[0].t0
    cpu = CpuMeter(t0, runs[0].cpu_samples)
    async for now in ticks(t0, plan.sample_s, t0 + plan.duration_s):
        await scrape(session, runs, plan.group_names(), tick=True, gates=watched)
        cpu.poll(now)


async def run_load(plan: ScaleoutPlan, runs: Sequence[ConfigRun], quiet: bool) -> None:
    """The configurations in `runs` at once, closed-loop, the levels stepped at shared instants."""
    async with make_session() as session:
        targets: dict[str, list[Target]] = {}
        for run in runs:
            first = await chat_target(run.replicas[0], plan.max_tokens)
            targets[run.name] = [dataclasses.replace(first, url=url) for url in run.replicas]
        # The same prompts in the same order for every configuration (each its own iterator).
        prompts: dict[str, Iterator[Prompt]] = {run.name: source("diverse", plan.seed) for run in runs}
        rotation: dict[str, Iterator[int]] = {run.name: itertools.cycle(range(plan.replicas)) for run in runs}
        cpu: list[tuple[float, float]] = []
        t0 = time.monotonic()
        for run in runs:
            run.t0, run.cpu_samples = t0, cpu
        await scrape(session, runs, plan.group_names(), tick=False, gates=runs)  # the counters' zero, before any load
        end = t0 + plan.duration_s

        def next_request(run: ConfigRun, index: int) -> tuple[Target, Prompt]:
            replica = next(rotation[run.name]) if plan.spread == "request" else index % plan.replicas
            return targets[run.name][replica], next(prompts[run.name])

        streams: list[asyncio.Task[None]] = []

        def start_streams(have: int, want: int) -> None:
            streams.extend(
                asyncio.create_task(stream(session, end, functools.partial(next_request, run, i), run.results))
                for run in runs
                for i in range(have, want)
            )

        await asyncio.gather(_step_levels(session, plan, runs, start_streams, quiet), _sample(session, plan, runs))
        await drain(streams, plan.time_scale)


def _regroup(cpu: CpuUse) -> CpuUse:
    """CPU seconds with the replicas added up."""
    by: dict[str, float] = {}
    for name, s in cpu.by_process_s.items():
        key = "specgate replicas" if name.startswith("specgate-") else name
        by[key] = round(by.get(key, 0.0) + s, 1)
    return dataclasses.replace(cpu, by_process_s=by)


def run_batch(plan: ScaleoutPlan, names: Sequence[str], wm: Watermarks, quiet: bool) -> tuple[list[ConfigRun], CpuUse]:
    say(f"{' + '.join(names)}: starting simulators and {plan.replicas} replicas each...", quiet)
    fleet = Fleet()
    try:
        runs = start_configs(plan, names, wm, fleet)
        cpu0 = self_cpu_s()
        asyncio.run(run_load(plan, runs, quiet))
        cpu = _regroup(cpu_use(runs[0].cpu_samples, fleet.procs, self_cpu_s() - cpu0))
    finally:
        fleet.stop()
    return runs, cpu


def samples_of(run: ConfigRun) -> dict[str, Any]:
    """What the samplers recorded, compactly: by server [t, running, queued, generated, requests, tick];
    by replica [t, modes, switches, tick, group loads, own in flight by server]."""
    return {
        "servers": {
            name: [[round(x.t, 3), x.running, x.queued, x.generated, x.requests, x.tick] for x in samples]
            for name, samples in run.server_samples.items()
        },
        "replicas": [
            [[round(x.t, 3), x.modes, x.switches, x.tick, x.loads, x.own] for x in samples]
            for samples in run.gate_samples
        ],
    }
