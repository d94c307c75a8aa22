"""`python -m loadtest scaleout`: several groups of servers behind several specgate replicas (issue #16).

    python -m loadtest scaleout [--topology paired|pooled] [--groups 2] [--replicas 3]
                                [--speculative-servers 2] [--baseline-servers 2]
                                [--concurrency 2,5,10,20,40,80] [--level-s 45] [--settle-s 15]
                                [--high H --low L | --calibration FILE] [--spread request|worker]
                                [--time-scale 1] [--sequential] [--out-dir scaleout-results]

Three configurations run with the same servers and replicas, each in front of fresh simulators of
its own: "specgate" (SPECGATE_POLICY=threshold with the watermarks), "all-speculative" (both
watermarks 100000: no group ever leaves speculation) and "all-baseline" (SPECGATE_HIGH_WATERMARK=0).
Every replica has SPECGATE_LOAD_SIGNAL=engine: it routes on the engines' own running and queued
counts, which all replicas read alike, rather than on the requests it sent itself.

Topologies. paired (default): G simulated pairs (`python -m loadtest.simulator pair --shared-gpu`),
the i-th speculative and baseline server sharing one compute budget and forming specgate's group-i
(SPECGATE_TOPOLOGY=paired); the watermarks are a group's. pooled: S speculative and B baseline
servers, each a simulator process of its own (disjoint budgets), SPECGATE_TOPOLOGY=pooled; the mode
follows the total load, so the per-pair watermarks are multiplied by S (pass --high/--low when S and
B differ: the pools then cross elsewhere). Without --high/--low or --calibration, one fresh pair is
calibrated first (`python -m loadtest calibrate --save OUT_DIR/calibration.json`, diverse prompts).

Load. Closed-loop, one continuous run per configuration, the levels (total streams over all
replicas) in rising order: at each level's start, workers are added up to the level, so a level
step is a step in load that the running replicas see as such. Requests go to the replicas
round-robin per request (--spread request, the default: what an L7 balancer in front of the
replicas does, and every replica sees traffic even at 2 streams), or per worker (--spread worker:
each client pinned to one replica, as a kept-alive connection through an L4 balancer; at fewer
streams than replicas some replicas then see none).

Measured at the servers, from their own /metrics (scraped at each level's boundaries, and every 0.5 s
at time scale 1, at most every 0.2 s of wall time):

- output tok/s: the servers' generation-token counters over each level's scored part (after its
  first --settle-s seconds), summed over the configuration's servers; the load generator's own count
  is reported beside it. specgate / better: specgate's over the higher of all-speculative's and
  all-baseline's (target >= 0.95). A level is inconclusive where any configuration had too few good
  requests (stats.min_ok_requests; client errors are never the servers'). An inconclusive figure is
  neither a miss nor a pass: a target met at every conclusive level reads "unknown" while any is
  inconclusive (report.target_verdict).
- group split (paired): each group's share of the output tokens over the scored part; "within 15% of
  even" means every group's share s satisfies |s * G - 1| <= 0.15 (the deviation printed).
- in-flight split (paired, reported, no target): the same deviation of the requests in flight in
  each group (the servers' running + queued, below), sample by sample, averaged over the scored part:
  load that sloshes from group to group evens out over a window but not here.
- mode switches (paired and pooled): per replica and group, specgate_group_mode_switches_total's
  increase from a level's start to the next level's start (the step and what follows it; target at
  most one). With one group and a specgate that exports no group metrics, specgate_mode_switches_total
  stands in; otherwise "n/a".
- drift between replicas (specgate, reported, no target): each replica's /metrics is read at every
  round of samples too: specgate_group_load (specgate_load with one group), the load its policy
  compares with the watermarks, and specgate_server_inflight, its own requests. Per group and round,
  the spread (max - min) of the replicas' loads: mean and p95 over the scored part (the worst
  group's), and the largest over the whole level, step included, in requests and as a share of the
  band high - low (README: keep the band wider than the drift). Against the truth: each replica's
  load minus the group's servers' running + queued at the same round (trusted and aligned as for the
  in-flight split; SGLang's gauges refresh at prefill and every 40 decode steps, so this truth lags
  too), mean |error| and mean (bias); and minus the replicas' own in-flight added up (exact but for
  the ms between their scrapes): the error of the others' part alone.
- in-flight imbalance (pooled): each server's running + queued requests (sglang:num_running_reqs +
  num_queue_reqs), averaged over the scored part's periodic samples; per role, the busiest server's
  mean over the role's mean per server (target <= 1.3). SGLang's gauges freeze when a server goes idle,
  so a sample whose server generated no token since the previous sample counts 0 in flight. A role
  whose servers held under 0.5 on average is idle at that level and not scored; fewer than 10 samples
  make it inconclusive.

- the profile at the loads held (all-speculative, all-baseline): at each round of samples, the
  profile's throughput of each server at its in-flight (scaled to add up to the level), summed and
  averaged; over the same at an even split it is what uneven load moment by moment costs (the
  profile is concave), and all-baseline's measured throughput over it is how well the simulators
  kept time (below 90%: they could not, for CPU).

The configurations run side by side, at the same time (or one after another with --sequential),
and the report gives the machine's CPU use and warns when it was saturated. Times are
wall-clock seconds; with --time-scale T the simulators run T times faster and specgate's time
settings (health and scrape intervals, the staleness of engine gauges) are divided by T.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import dataclasses
import itertools
import math
import sys
import textwrap
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

import aiohttp

from proxy import promtext
from proxy.calibration import CalibrationError
from proxy.calibration import load as load_calibration
from proxy.config import Settings

from .args import levels, non_negative, positive
from .client import RequestResult, Target, stream_request
from .procs import Proc, free_port, simulator_args, start
from .prompts import Prompt, source
from .report import fmt, target_verdict, write_json
from .shift import (
    Capture,
    CpuUse,
    calibrate_fresh_pair,
    cpu_use,
    proc_stat,
    ratio,
    say,
    self_cpu_s,
    wait_ready,
)
from .stats import DEFAULT_MIN_REQUESTS, LevelStats, percentile, summarize
from .sweep import ERROR_BACKOFF_S, first_model, make_session

Topology = Literal["paired", "pooled"]
Role = Literal["speculative", "baseline"]
Spread = Literal["request", "worker"]
ROLES: tuple[Role, ...] = ("speculative", "baseline")
CONFIGS = ("specgate", "all-speculative", "all-baseline")
FIXED: tuple[tuple[str, Role], ...] = (("all-speculative", "speculative"), ("all-baseline", "baseline"))
ALL_SPECULATIVE = 100_000  # both watermarks: a load no level reaches

RATIO_TARGET = 0.95  # specgate's output over the better fixed configuration's
SPLIT_TOLERANCE = 0.15  # every group's share within this (relative) of 1/G
MAX_SWITCHES = 1  # per replica, group and level step
IMBALANCE_TARGET = 1.3  # pooled: the busiest server's mean in-flight over its role's mean
BUSY_MIN = 0.5  # a role whose servers held fewer in flight on average is idle at that level
MIN_SAMPLES = 10  # periodic samples a level's scored part needs for an in-flight figure
SAMPLE_S = 0.5  # /metrics sampling period, at time scale 1
MIN_SAMPLE_S = 0.2  # ... but never faster than this in wall seconds (each sample reads every server)
CPU_BUSY_WARN = 0.85  # a level's mean machine CPU past which its figures are suspect
FIDELITY_WARN = 0.90  # all-baseline below this share of its profile's throughput: CPU-starved
CALIBRATE_LEVELS = (5, 10, 20, 30, 40)
CALIBRATE_DURATION_S = 12.0  # per level, at time scale 1
DRAIN_S = 120.0  # at time scale 1: how long the requests in flight at the end may take
MIN_SCRAPE_INTERVAL_S = 0.1  # specgate's floor for SPECGATE_SCRAPE_INTERVAL_S

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
NO_GROUP_SWITCHES = "specgate exports no specgate_group_mode_switches_total"


def supports_groups() -> bool:
    """Whether this checkout's specgate takes lists of servers (SPECGATE_TOPOLOGY, issue #16)."""
    return "topology" in Settings.model_fields


# ---------------------------------------------------------------------------------------------
# Settings


@dataclass(frozen=True)
class ScaleoutPlan:
    topology: Topology = "paired"
    groups: int = 2  # paired
    replicas: int = 3
    speculative_servers: int = 2  # pooled
    baseline_servers: int = 2  # pooled
    profile: str = "crossover"
    levels: tuple[int, ...] = (2, 5, 10, 20, 40, 80)
    level_s: float = 45.0
    settle_s: float = 15.0
    time_scale: float = 1.0
    spread: Spread = "request"
    sequential: bool = False
    max_tokens: int = 128
    seed: int = 0
    min_requests: int = DEFAULT_MIN_REQUESTS
    # specgate's SPECGATE_SCRAPE_INTERVAL_S at time scale 1; None: its default (where it has one).
    scrape_interval_s: float | None = None
    # specgate's SPECGATE_LOW_WATERMARK_HOLD_S at time scale 1 (README: 2 with several replicas).
    low_hold_s: float = 2.0
    # The simulators refresh their gauges on every scrape instead of SGLang's cadence (every prefill
    # and every 40 decode steps): what routing would do with fresh engine counts.
    live_gauges: bool = False

    def simulator_flags(self) -> list[str]:
        flags = ["--profile", self.profile, "--time-scale", f"{self.time_scale:g}", "--log-level", "warning"]
        return [*flags, "--live-gauges"] if self.live_gauges else flags

    def __post_init__(self) -> None:
        if not self.levels or any(b <= a for a, b in itertools.pairwise(self.levels)) or self.levels[0] < 1:
            raise ValueError(f"levels must rise, from at least 1 stream: {self.levels}")

    @property
    def sample_s(self) -> float:
        return max(SAMPLE_S / self.time_scale, MIN_SAMPLE_S)

    @property
    def duration_s(self) -> float:
        return len(self.levels) * self.level_s

    def group_names(self) -> list[str]:
        return [f"group-{i}" for i in range(self.groups)] if self.topology == "paired" else ["pool"]

    def role_counts(self) -> dict[str, int]:
        if self.topology == "paired":
            return {"speculative": self.groups, "baseline": self.groups}
        return {"speculative": self.speculative_servers, "baseline": self.baseline_servers}

    def watermark_scale(self) -> int:
        """What a pair's watermarks are multiplied by: the mode follows a group's load, or the pool's."""
        return 1 if self.topology == "paired" else self.speculative_servers


@dataclass(frozen=True)
class Watermarks:
    high: int
    low: int
    source: str  # where they came from, for the report


def config_watermarks(config: str, wm: Watermarks) -> tuple[int, int]:
    if config == "all-speculative":
        return ALL_SPECULATIVE, ALL_SPECULATIVE
    if config == "all-baseline":
        return 0, 0
    return wm.high, wm.low


@dataclass(frozen=True)
class Server:
    name: str  # specgate's default name: speculative-0, baseline-1, ...
    role: str
    group: str  # group-i (paired) or pool
    url: str


def gate_env(plan: ScaleoutPlan, servers: Sequence[Server], port: int, high: int, low: int) -> dict[str, str]:
    """A replica's environment, its time settings scaled to the simulators' clock."""
    fields = Settings.model_fields
    t = plan.time_scale
    env = {
        "SPECGATE_HOST": "127.0.0.1",
        "SPECGATE_PORT": str(port),
        "SPECGATE_SPECULATIVE_URL": ",".join(s.url for s in servers if s.role == "speculative"),
        "SPECGATE_BASELINE_URL": ",".join(s.url for s in servers if s.role == "baseline"),
        "SPECGATE_TOPOLOGY": plan.topology,
        "SPECGATE_POLICY": "threshold",
        "SPECGATE_HIGH_WATERMARK": str(high),
        "SPECGATE_LOW_WATERMARK": str(low),
        "SPECGATE_LOAD_SIGNAL": "engine",
        "SPECGATE_LOG_LEVEL": "warning",
        "SPECGATE_HEALTH_INTERVAL_S": f"{fields['health_interval_s'].default / t:g}",
        "SPECGATE_ENGINE_STALE_S": f"{fields['engine_stale_s'].default / t:g}",
    }
    if "scrape_interval_s" in fields:
        # Its default may be None: the health interval, scaled above.
        every = plan.scrape_interval_s if plan.scrape_interval_s is not None else fields["scrape_interval_s"].default
        if every is not None:
            env["SPECGATE_SCRAPE_INTERVAL_S"] = f"{max(MIN_SCRAPE_INTERVAL_S, float(every) / t):g}"
    if "low_watermark_hold_s" in fields:
        env["SPECGATE_LOW_WATERMARK_HOLD_S"] = f"{plan.low_hold_s / t:g}"
    return env


# ---------------------------------------------------------------------------------------------
# Processes


def _pair_args(plan: ScaleoutPlan, spec_port: int, base_port: int) -> list[str]:
    ports = ["--speculative-port", str(spec_port), "--baseline-port", str(base_port)]
    return ["-m", "loadtest.simulator", "pair", "--shared-gpu", *ports, *plan.simulator_flags()]


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
    procs: list[Proc] = field(default_factory=list)
    t0: float = 0.0
    results: list[RequestResult] = field(default_factory=list)
    server_samples: dict[str, list[ServerSample]] = field(default_factory=dict)
    gate_samples: list[list[GateSample]] = field(default_factory=list)  # per replica
    cpu_samples: list[tuple[float, float]] = field(default_factory=list)  # of the batch it ran in
    batch: str = ""  # the configurations that ran at the same time

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()


def start_configs(plan: ScaleoutPlan, names: Sequence[str], wm: Watermarks) -> list[ConfigRun]:
    """Fresh simulators for each configuration, then its replicas in front of all of them; the
    processes of a kind start together, so starting costs the slowest, not the sum."""
    runs = [ConfigRun(name, *config_watermarks(name, wm)) for name in names]
    try:
        waits: list[tuple[Proc, str]] = []
        for run in runs:
            waits += _start_servers(plan, run)
        wait_ready(waits)
        waits = []
        for run in runs:
            for i in range(plan.replicas):
                port = free_port()
                env = gate_env(plan, run.servers, port, run.high, run.low)
                proc = start(f"specgate-{run.name}-{i}", ["-m", "proxy"], env=env)
                run.procs.append(proc)
                run.replicas.append(f"http://127.0.0.1:{port}")
                waits.append((proc, run.replicas[-1] + "/ready"))
            run.server_samples = {s.name: [] for s in run.servers}
            run.gate_samples = [[] for _ in run.replicas]
        wait_ready(waits)
    except BaseException:
        for run in runs:
            run.stop()
        raise
    return runs


def _start_servers(plan: ScaleoutPlan, run: ConfigRun) -> list[tuple[Proc, str]]:
    """Start a configuration's simulators (not waiting); the URLs that answer once they are ready."""
    waits: list[tuple[Proc, str]] = []
    if plan.topology == "paired":
        for i in range(plan.groups):
            spec_port, base_port = free_port(), free_port()
            proc = start(f"simulators-{run.name}-{i}", _pair_args(plan, spec_port, base_port))
            run.procs.append(proc)
            for role, port in (("speculative", spec_port), ("baseline", base_port)):
                run.servers.append(Server(f"{role}-{i}", role, f"group-{i}", f"http://127.0.0.1:{port}"))
                waits.append((proc, run.servers[-1].url + "/health"))
        return waits
    for role, n in plan.role_counts().items():
        for i in range(n):
            port = free_port()
            proc = start(f"simulators-{run.name}-{role}-{i}", simulator_args(role, port, *plan.simulator_flags()))
            run.procs.append(proc)
            run.servers.append(Server(f"{role}-{i}", role, "pool", f"http://127.0.0.1:{port}"))
            waits.append((proc, run.servers[-1].url + "/health"))
    return waits


def calibrate_pair(plan: ScaleoutPlan, out_dir: Path, quiet: bool) -> Path:
    """Calibrate one fresh simulated pair with diverse prompts; the watermarks come from its file."""
    return calibrate_fresh_pair(
        lambda spec_port, base_port: _pair_args(plan, spec_port, base_port),
        CALIBRATE_LEVELS,
        ["--seed", str(plan.seed), "--max-tokens", str(plan.max_tokens), "--min-requests", str(plan.min_requests)],
        CALIBRATE_DURATION_S / plan.time_scale,
        out_dir,
        quiet,
    )


def watermarks_from(path: Path, plan: ScaleoutPlan) -> Watermarks:
    try:
        cal = load_calibration(str(path))
    except CalibrationError as exc:
        raise ValueError(f"calibration {path}: {exc}") from None
    k = plan.watermark_scale()
    times = f", times {k} speculative servers (the pool's load)" if k != 1 else ""
    return Watermarks(
        cal.high_watermark * k,
        cal.low_watermark * k,
        f"{path}: a pair's high={cal.high_watermark} low={cal.low_watermark} ({cal.verdict}){times}",
    )


# ---------------------------------------------------------------------------------------------
# Measuring


def metric_samples(text: str, names: Sequence[str]) -> dict[str, list[tuple[dict[str, str], float]]]:
    """The samples of the named series only (the rest of the text is not parsed)."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {n: [] for n in names}
    for s in promtext.samples(text, names):
        out[s.name].append((dict(s.labels), s.value))
    return out


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


async def _text(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=5)) as resp:
        resp.raise_for_status()
        return await resp.text()


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
            text = await _text(session, s.url + "/metrics")
            run.server_samples[s.name].append(server_sample(text, time.monotonic() - run.t0, tick))

    async def one_gate(run: ConfigRun, i: int) -> None:
        with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
            text = await _text(session, run.replicas[i] + "/metrics")
            run.gate_samples[i].append(gate_sample(text, groups, time.monotonic() - run.t0, tick))

    jobs = [one_server(run, s) for run in runs for s in run.servers]
    jobs += [one_gate(run, i) for run in gates for i in range(len(run.replicas))]
    await asyncio.gather(*jobs)


async def run_load(plan: ScaleoutPlan, runs: Sequence[ConfigRun], quiet: bool) -> None:
    """The configurations in `runs` at once, closed-loop, the levels stepped at shared instants."""
    groups = plan.group_names()
    watched = [run for run in runs if run.name == "specgate"]  # its modes sampled for the plot
    async with make_session() as session:
        targets: dict[str, list[Target]] = {}
        for run in runs:
            model = await first_model(run.replicas[0], None)
            targets[run.name] = [Target(url, model, chat=True, max_tokens=plan.max_tokens) for url in run.replicas]
        # The same prompts in the same order for every configuration (each its own iterator).
        prompts: dict[str, Iterator[Prompt]] = {run.name: source("diverse", plan.seed) for run in runs}
        rotation: dict[str, Iterator[int]] = {run.name: itertools.cycle(range(plan.replicas)) for run in runs}
        cpu: list[tuple[float, float]] = []
        t0 = time.monotonic()
        for run in runs:
            run.t0, run.cpu_samples = t0, cpu
        await scrape(session, runs, groups, tick=False, gates=runs)  # the counters' zero, before any load
        end = t0 + plan.duration_s

        def replica_of(run: ConfigRun, worker_index: int) -> int:
            return next(rotation[run.name]) if plan.spread == "request" else worker_index % plan.replicas

        async def worker(run: ConfigRun, index: int) -> None:
            while time.monotonic() < end:
                target = targets[run.name][replica_of(run, index)]
                r = await stream_request(session, target, next(prompts[run.name]))
                run.results.append(r)
                if not r.ok:
                    await asyncio.sleep(ERROR_BACKOFF_S)

        workers: list[asyncio.Task[None]] = []

        async def stepper() -> None:
            running = 0
            for k, c in enumerate(plan.levels):
                await asyncio.sleep(max(0.0, t0 + k * plan.level_s - time.monotonic()))
                if k:
                    await scrape(session, runs, groups, tick=False, gates=runs)  # the level's start
                say(f"  level {k + 1}/{len(plan.levels)}: {c} streams", quiet)
                # Levels rise: the workers of the last level go on, new ones join.
                workers.extend(asyncio.create_task(worker(run, i)) for run in runs for i in range(running, c))
                running = max(running, c)
                await asyncio.sleep(max(0.0, t0 + k * plan.level_s + plan.settle_s - time.monotonic()))
                await scrape(session, runs, groups, tick=False)  # the scored part's start
            await asyncio.sleep(max(0.0, end - time.monotonic()))
            await scrape(session, runs, groups, tick=False, gates=runs)  # the end

        async def sampler() -> None:
            busy0, total0 = proc_stat()
            cpu_at = time.monotonic()
            tick = 0
            while (now := time.monotonic()) < end:
                await scrape(session, runs, groups, tick=True, gates=watched)
                if now - cpu_at >= 1.0:
                    busy, total = proc_stat()
                    if total > total0:
                        cpu.append((now - t0, (busy - busy0) / (total - total0)))
                    busy0, total0, cpu_at = busy, total, now
                tick += 1
                await asyncio.sleep(max(0.0, t0 + tick * plan.sample_s - time.monotonic()))

        await asyncio.gather(stepper(), sampler())
        # The requests in flight at the end finish, so each one's usage (its tokens) is known.
        _, pending = await asyncio.wait(workers, timeout=DRAIN_S / plan.time_scale + 10.0)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)


# ---------------------------------------------------------------------------------------------
# Scoring: pure functions of what was recorded

S = TypeVar("S", ServerSample, GateSample)


def nearest(samples: Sequence[S], t: float) -> S | None:
    """The sample taken closest to `t` (the samples in time order)."""
    if not samples:
        return None
    times = [s.t for s in samples]
    i = bisect.bisect_left(times, t)
    near = [j for j in (i - 1, i) if 0 <= j < len(samples)]
    return samples[min(near, key=lambda j: abs(times[j] - t))]


def increase(samples: Sequence[ServerSample], a: float, b: float, pick: Callable[[ServerSample], float]) -> float:
    """A counter's increase per second between the samples nearest `a` and `b`; NaN without two."""
    sa, sb = nearest(samples, a), nearest(samples, b)
    if sa is None or sb is None or sb.t <= sa.t:
        return math.nan
    return (pick(sb) - pick(sa)) / (sb.t - sa.t)


def group_shares(by_server: Mapping[str, float], group_of: Mapping[str, str]) -> dict[str, float]:
    """Each group's share of the servers' total (NaN when nothing was counted)."""
    groups: dict[str, float] = {}
    for name, value in by_server.items():
        groups[group_of[name]] = groups.get(group_of[name], 0.0) + value
    total = math.fsum(groups.values())
    return {g: v / total if total > 0 else math.nan for g, v in sorted(groups.items())}


def split_deviation(shares: Mapping[str, float]) -> float | None:
    """How far the most uneven group is from an even split, relative to it: max |share * G - 1|.
    0 is even; 0.15 means a group got 15% more or less than its even share. None with one group."""
    n = len(shares)
    if n < 2:
        return None
    return max(abs(s * n - 1.0) for s in shares.values())


def switches_between(samples: Sequence[GateSample], a: float, b: float) -> dict[str, int] | None:
    """Each group's mode switches between the samples nearest `a` and `b`; None where the replica
    exports no switch counts (or did not answer)."""
    sa, sb = nearest(samples, a), nearest(samples, b)
    if sa is None or sb is None or sa.switches is None or sb.switches is None:
        return None
    return {g: round(sb.switches.get(g, 0.0) - v) for g, v in sorted(sa.switches.items())}


def trusted_inflight(samples: Sequence[ServerSample]) -> list[tuple[float, float]]:
    """(t, running + queued) at each periodic sample after the first; 0 where the server generated
    nothing since the previous periodic sample: SGLang's gauges keep their last value when a server
    goes idle, so a frozen reading is no load."""
    ticks = [s for s in samples if s.tick]
    return [(cur.t, cur.inflight if cur.generated > prev.generated else 0.0) for prev, cur in itertools.pairwise(ticks)]


def mean_inflight(samples: Sequence[ServerSample], a: float, b: float) -> tuple[float, int]:
    """(mean in flight, samples) over the periodic samples inside [a, b] (see trusted_inflight)."""
    values = [v for t, v in trusted_inflight(samples) if a <= t <= b]
    return (math.fsum(values) / len(values) if values else math.nan), len(values)


def aligned_inflight(
    servers: Sequence[Server], samples: Mapping[str, Sequence[ServerSample]]
) -> list[tuple[float, dict[str, float]]]:
    """(t, in flight by server) at each periodic sample (trusted_inflight), the servers' readings
    taken at the same round of scrapes (the nearest in time to the first server's)."""
    series = {s.name: trusted_inflight(samples[s.name]) for s in servers}
    if not servers or any(not x for x in series.values()):
        return []
    times = {name: [t for t, _ in x] for name, x in series.items()}
    out = []
    for t, _ in series[servers[0].name]:
        loads: dict[str, float] = {}
        for name, x in series.items():
            ts = times[name]
            i = bisect.bisect_left(ts, t)
            j = min((k for k in (i - 1, i) if 0 <= k < len(x)), key=lambda k: abs(ts[k] - t))
            loads[name] = x[j][1]
        out.append((t, loads))
    return out


def group_loads(
    servers: Sequence[Server], samples: Mapping[str, Sequence[ServerSample]]
) -> list[tuple[float, dict[str, float]]]:
    """(t, in flight by group) at each round of periodic samples (aligned_inflight)."""
    group_of = {s.name: s.group for s in servers}
    out = []
    for t, by_server in aligned_inflight(servers, samples):
        loads: dict[str, float] = {}
        for name, v in by_server.items():
            loads[group_of[name]] = loads.get(group_of[name], 0.0) + v
        out.append((t, loads))
    return out


def instant_deviation(loads: Sequence[tuple[float, Mapping[str, float]]], a: float, b: float) -> float | None:
    """The split of the requests in flight moment by moment: the mean over the samples inside [a, b]
    of max |group's share x groups - 1| (samples with nothing in flight left out). A split even over a
    window (split_deviation) can hide load sloshing from group to group; this does not. None with
    one group or no sample."""
    values = []
    for t, by_group in loads:
        total = math.fsum(by_group.values())
        if a <= t <= b and total >= 1 and len(by_group) > 1:
            values.append(split_deviation({g: v / total for g, v in by_group.items()}) or 0.0)
    return math.fsum(values) / len(values) if values else None


def imbalance(means: Sequence[float], busy_min: float = BUSY_MIN) -> float | None:
    """The busiest server's mean in-flight over its role's mean per server; None when the role was
    idle (its servers held under `busy_min` on average) or a mean is missing."""
    if not means or any(math.isnan(m) for m in means):
        return None
    role = math.fsum(means) / len(means)
    return max(means) / role if role >= busy_min else None


def vs_better(gate: float, all_speculative: float, all_baseline: float) -> float:
    """specgate's throughput over the better of the two fixed configurations' (NaN if unknown)."""
    best = max(all_speculative, all_baseline)
    return ratio(gate, best) if not math.isnan(best) else math.nan


# Drift between replicas: each replica's estimate of a group's load against the others' and the truth.


def spread(values: Sequence[float]) -> float | None:
    """How far apart the replicas' views of one load are: max - min; None with fewer than two."""
    return max(values) - min(values) if len(values) >= 2 else None


@dataclass(frozen=True)
class Round:
    """One round of periodic samples: each group's requests in flight as its servers report them, and
    what each replica believed then."""

    t: float
    truth: dict[str, float]  # by group: the servers' running + queued (trusted_inflight)
    views: list[dict[str, float] | None]  # by replica: each group's load as its policy saw it; None: no sample
    own: list[dict[str, float] | None]  # by replica: its own requests in flight on each group's servers

    def gateways(self) -> dict[str, float] | None:
        """Each group's requests in flight from all the replicas together (exact, but for the few ms
        between their scrapes); None unless every replica's count was read."""
        if not self.own or any(o is None for o in self.own):
            return None
        return {g: math.fsum(o.get(g, 0.0) for o in self.own if o is not None) for g in self.truth}


def replica_rounds(
    servers: Sequence[Server],
    server_samples: Mapping[str, Sequence[ServerSample]],
    replicas: Sequence[Sequence[GateSample]],
    tolerance: float,
) -> list[Round]:
    """At each round of the servers' periodic samples (group_loads: trusted and aligned), each
    replica's periodic sample nearest in time, if within `tolerance` seconds and it exported group
    loads; its own in-flight added up by group."""
    group_of = {s.name: s.group for s in servers}
    ticks = [[x for x in replica if x.tick] for replica in replicas]
    out = []
    for t, truth in group_loads(servers, server_samples):
        views: list[dict[str, float] | None] = []
        own: list[dict[str, float] | None] = []
        for replica in ticks:
            x = nearest(replica, t)
            if x is None or abs(x.t - t) > tolerance or not x.loads:
                views.append(None)
                own.append(None)
                continue
            views.append(dict(x.loads))
            if x.own is None:
                own.append(None)
                continue
            mine = dict.fromkeys(truth, 0.0)
            for name, v in x.own.items():
                if name in group_of:
                    mine[group_of[name]] = mine.get(group_of[name], 0.0) + v
            own.append(mine)
        out.append(Round(t, truth, views, own))
    return out


def group_spreads(rounds: Sequence[Round], a: float, b: float) -> dict[str, list[float]]:
    """Each group's spread of the replicas' loads (max - min), at every round inside [a, b] at which
    every replica's view was read (with one replica, none)."""
    out: dict[str, list[float]] = {}
    for r in rounds:
        if not a <= r.t <= b or any(v is None for v in r.views):
            continue
        for g in r.truth:
            d = spread([v[g] for v in r.views if v is not None and g in v])
            if d is not None:
                out.setdefault(g, []).append(d)
    return out


def view_errors(
    rounds: Sequence[Round], a: float, b: float, reference: Callable[[Round], Mapping[str, float] | None]
) -> list[float]:
    """Every replica's load of every group minus `reference`'s (the truth) at each round inside [a, b]."""
    out: list[float] = []
    for r in rounds:
        ref = reference(r) if a <= r.t <= b else None
        if ref is None:
            continue
        for view in r.views:
            if view is not None:
                out.extend(view[g] - ref[g] for g in ref if g in view)
    return out


def error_summary(errors: Sequence[float]) -> tuple[float, float]:
    """(mean absolute error, mean signed error: the bias); NaN when empty."""
    if not errors:
        return math.nan, math.nan
    return math.fsum(abs(e) for e in errors) / len(errors), math.fsum(errors) / len(errors)


@dataclass(frozen=True)
class Drift:
    """How the replicas' views of each group's load compared, over one level."""

    rounds: int  # rounds in the scored part with every replica's view
    spread_mean: dict[str, float]  # by group, over the scored part: max - min of the replicas' loads
    spread_p95: dict[str, float]
    spread_max: dict[str, float]
    worst_mean: float  # the largest of the groups'
    worst_p95: float
    level_max: float  # the largest spread of any group over the whole level, its step included
    # A replica's group load minus the group's servers' running + queued (SGLang's gauges: refreshed at
    # prefill and every 40 decode steps, so themselves a little old): mean |error|, mean (bias).
    error_abs: float
    error_bias: float
    error_samples: int
    # The same against the replicas' own requests in flight added up (no engine lag): the others' part's error.
    gateway_error_abs: float
    gateway_error_bias: float


def drift_of(rounds: Sequence[Round], start: float, a: float, b: float) -> Drift | None:
    """The drift figures over [a, b] (the scored part; `start`: the level's start). None without a
    round at which two or more replicas' views were read."""
    spreads = group_spreads(rounds, a, b)
    whole = group_spreads(rounds, start, b)
    if not spreads:
        return None
    errors = view_errors(rounds, a, b, lambda r: r.truth)
    gateway = view_errors(rounds, a, b, Round.gateways)
    mean = {g: math.fsum(x) / len(x) for g, x in sorted(spreads.items())}
    p95 = {g: percentile(x, 95) for g, x in sorted(spreads.items())}
    return Drift(
        rounds=max(len(x) for x in spreads.values()),
        spread_mean=mean,
        spread_p95=p95,
        spread_max={g: max(x) for g, x in sorted(spreads.items())},
        worst_mean=max(mean.values()),
        worst_p95=max(p95.values()),
        level_max=max(max(x) for x in whole.values()),
        error_abs=error_summary(errors)[0],
        error_bias=error_summary(errors)[1],
        error_samples=len(errors),
        gateway_error_abs=error_summary(gateway)[0],
        gateway_error_bias=error_summary(gateway)[1],
    )


# ---------------------------------------------------------------------------------------------
# Scoring a run


@dataclass(frozen=True)
class ConfigLevel:
    tok_s: float  # the servers' generation tokens a second over the scored part, summed
    client_tok_s: float  # the load generator's count over the same window
    stats: LevelStats
    tok_s_by_server: dict[str, float]
    requests_by_server: dict[str, float]  # requests finished a second, by server
    group_shares: dict[str, float]  # of output tokens
    split_deviation: float | None
    # Of the requests in flight, sample by sample (instant_deviation); None with one group.
    inflight_deviation: float | None
    inflight: dict[str, float]  # mean running + queued by server over the scored part
    inflight_samples: int  # the fewest periodic samples any server had there
    role_imbalance: dict[str, float | None]  # by role: busiest server's mean over the role's mean
    switches: list[dict[str, int] | None]  # by replica: each group's switches from this level's start to the next's
    modes_at_end: list[dict[str, str]]  # by replica: each group's mode at the level's end
    cpu_busy: float  # the machine's mean CPU use (all cores) over the level, shared by the batch
    # specgate: how its replicas' views of each group's load compared with each other and the servers
    # (None: another configuration, one replica, or no samples).
    drift: Drift | None = None

    @property
    def conclusive(self) -> bool:
        return self.stats.conclusive and not math.isnan(self.tok_s)


@dataclass(frozen=True)
class LevelReport:
    concurrency: int
    start_s: float
    scored_from_s: float
    end_s: float
    configs: dict[str, ConfigLevel]
    vs_better: float
    better: str | None  # the better fixed configuration
    conclusive: bool
    baseline_fidelity: float  # all-baseline over its profile's throughput at the loads its servers held
    # all-speculative and all-baseline: the profile's throughput at the loads their servers held over
    # the same at an even split (1: even; below: what uneven load, moment by moment, costs).
    split_efficiency: dict[str, float] = field(default_factory=dict)


def even_throughput(plan: ScaleoutPlan, role: Role, c: int) -> float:
    """What the profile says the role's servers produce with `c` streams split evenly among them."""
    from .simulator.profile import load_profile

    n = plan.role_counts()[role]
    return n * load_profile(plan.profile).throughput(role, c / n) * plan.time_scale


def profile_throughput(plan: ScaleoutPlan, run: ConfigRun, role: Role, c: int, a: float, b: float) -> float:
    """What the profile says the role's servers produce at the loads they held in [a, b]: at each
    round of periodic samples, the servers' in-flight scaled to add up to the level's `c` streams
    (SGLang's gauges lag, and over-count a finished request until their next refresh), each
    server's T(load) summed; the mean over the rounds, time-scaled. With the split measured rather
    than assumed even (load sloshing between servers lowers what a concave profile gives), a
    shortfall is the simulators not keeping time."""
    from .simulator.profile import load_profile

    profile = load_profile(plan.profile)
    mine = {s.name for s in run.servers if s.role == role}
    values = []
    for t, loads in aligned_inflight(run.servers, run.server_samples):
        total = math.fsum(loads.values())
        if a <= t <= b and total > 0:
            values.append(
                math.fsum(profile.throughput(role, v * c / total) for n, v in loads.items() if n in mine and v > 0)
            )
    return plan.time_scale * math.fsum(values) / len(values) if values else math.nan


def _cpu_busy(samples: Sequence[tuple[float, float]], a: float, b: float) -> float:
    inside = [share for t, share in samples if a <= t <= b]
    return math.fsum(inside) / len(inside) if inside else math.nan


def score_config(plan: ScaleoutPlan, run: ConfigRun, k: int) -> ConfigLevel:
    c = plan.levels[k]
    start, end = k * plan.level_s, (k + 1) * plan.level_s
    w0 = start + plan.settle_s
    stats = summarize(c, run.results, run.t0 + w0, run.t0 + end, plan.min_requests)
    samples = run.server_samples
    tok = {s.name: increase(samples[s.name], w0, end, lambda x: x.generated) for s in run.servers}
    req = {s.name: increase(samples[s.name], w0, end, lambda x: x.requests) for s in run.servers}
    shares = group_shares(tok, {s.name: s.group for s in run.servers})
    inflight: dict[str, float] = {}
    counts: list[int] = []
    for s in run.servers:
        inflight[s.name], n = mean_inflight(samples[s.name], w0, end)
        counts.append(n)
    role_imbalance: dict[str, float | None] = {
        role: imbalance([inflight[s.name] for s in run.servers if s.role == role])
        for role in ROLES
        if any(s.role == role for s in run.servers)
    }
    modes = []
    for replica in run.gate_samples:
        last = nearest(replica, end)
        modes.append(dict(last.modes) if last is not None else {})
    return ConfigLevel(
        tok_s=math.fsum(tok.values()),
        client_tok_s=stats.output_tok_s,
        stats=stats,
        tok_s_by_server=tok,
        requests_by_server=req,
        group_shares=shares,
        split_deviation=split_deviation(shares),
        inflight_deviation=instant_deviation(group_loads(run.servers, samples), w0, end) if plan.groups > 1 else None,
        inflight=inflight,
        inflight_samples=min(counts, default=0),
        role_imbalance=role_imbalance,
        switches=[switches_between(replica, start, end) for replica in run.gate_samples],
        modes_at_end=modes,
        cpu_busy=_cpu_busy(run.cpu_samples, start, end),
        drift=drift_of(replica_rounds(run.servers, samples, run.gate_samples, plan.sample_s / 2), start, w0, end)
        if run.name == "specgate"
        else None,
    )


def score(plan: ScaleoutPlan, runs: Mapping[str, ConfigRun]) -> list[LevelReport]:
    out = []
    for k, c in enumerate(plan.levels):
        configs = {name: score_config(plan, run, k) for name, run in runs.items()}
        spec, base = configs["all-speculative"].tok_s, configs["all-baseline"].tok_s
        better = None if math.isnan(spec) or math.isnan(base) else "all-speculative" if spec >= base else "all-baseline"
        w0, end = k * plan.level_s + plan.settle_s, (k + 1) * plan.level_s
        held = {name: profile_throughput(plan, runs[name], role, c, w0, end) for name, role in FIXED}
        out.append(
            LevelReport(
                concurrency=c,
                start_s=k * plan.level_s,
                scored_from_s=w0,
                end_s=end,
                configs=configs,
                vs_better=vs_better(configs["specgate"].tok_s, spec, base),
                better=better,
                conclusive=all(cl.conclusive for cl in configs.values()),
                baseline_fidelity=ratio(base, held["all-baseline"]),
                split_efficiency={name: ratio(held[name], even_throughput(plan, role, c)) for name, role in FIXED},
            )
        )
    return out


# ---------------------------------------------------------------------------------------------
# Report


def _switch_text(switches: Sequence[dict[str, int] | None], groups: Sequence[str]) -> str:
    if any(s is None for s in switches):
        return "n/a"
    return " | ".join(",".join(str(s.get(g, 0)) for s in switches if s is not None) for g in groups)


def _mode_text(modes: Sequence[Mapping[str, str]], groups: Sequence[str]) -> str:
    return " | ".join("".join((m.get(g) or "?")[0] for m in modes) for g in groups)


def _imb(x: float | None) -> str:
    return "idle" if x is None else fmt(x, 2)


def _signed(x: float) -> str:
    return "-" if math.isnan(x) else f"{round(x, 1) + 0.0:+.1f}"  # + 0.0: no "-0.0"


def _drift_text(d: Drift | None) -> tuple[str, str]:
    """(drift mean/p95, error |mean|/bias) for the table."""
    if d is None:
        return "-", "-"
    return f"{fmt(d.worst_mean)}/{fmt(d.worst_p95)}", f"{fmt(d.error_abs)}/{_signed(d.error_bias)}"


def level_table(plan: ScaleoutPlan, levels: Sequence[LevelReport]) -> str:
    groups = plan.group_names()
    paired = plan.topology == "paired"
    middle = (
        f"{'group shares (sg)':>17} {'dev sg/spec/base':>16} {'inst dev':>8}"
        if paired
        else (f"{'spec max/mean sg|all':>20} {'base max/mean sg|all':>20}")
    )
    head = (
        f"{'streams':>7} {'specgate':>9} {'all-spec':>9} {'all-base':>9} {'sg/better':>9} {middle} "
        f"{'switches per replica':>20} {'modes at end':>14} {'drift m/p95':>11} {'err |m|/bias':>12} {'CPU':>4}"
    )
    lines = [head, "-" * len(head)]
    for lv in levels:
        star = "" if lv.conclusive else "*"
        sg = lv.configs["specgate"]

        def tput(name: str, lv: LevelReport = lv) -> str:
            cl = lv.configs[name]
            return fmt(cl.tok_s, 0) + ("" if cl.conclusive else "*")

        if paired:
            shares = "/".join(f"{v:.0%}" if not math.isnan(v) else "-" for v in sg.group_shares.values())
            devs = "/".join(fmt(lv.configs[n].split_deviation, 2) for n in CONFIGS)
            mid = f"{shares:>17} {devs:>16} {fmt(sg.inflight_deviation, 2):>8}"
        else:
            spec = f"{_imb(sg.role_imbalance.get('speculative'))}|" + _imb(
                lv.configs["all-speculative"].role_imbalance.get("speculative")
            )
            base = f"{_imb(sg.role_imbalance.get('baseline'))}|" + _imb(
                lv.configs["all-baseline"].role_imbalance.get("baseline")
            )
            mid = f"{spec:>20} {base:>20}"
        drift, err = _drift_text(sg.drift)
        lines.append(
            f"{lv.concurrency:>7} {tput('specgate'):>9} {tput('all-speculative'):>9} {tput('all-baseline'):>9} "
            f"{fmt(lv.vs_better, 3) + star:>9} {mid} {_switch_text(sg.switches, groups):>20} "
            f"{_mode_text(sg.modes_at_end, groups):>14} {drift:>11} {err:>12} {fmt(sg.cpu_busy * 100, 0) + '%':>4}"
        )
    where = "group" if paired else "pool"
    lines.append(
        f"(output tok/s: the servers' generation counters over each level's scored part, after its first "
        f"{plan.settle_s:g} s; * inconclusive: too few good requests; sg/better: specgate over the better of "
        "all-speculative and all-baseline; "
        + (
            "group shares: each group's share of specgate's output tokens; dev: max |share x groups - 1| of "
            "specgate, all-speculative and all-baseline; inst dev: the same of specgate's requests in flight, "
            "sample by sample, averaged (load sloshing between groups that an even total hides); "
            if paired
            else "max/mean: a role's busiest server's mean in-flight over the role's mean, specgate | the fixed "
            "configuration of that role (idle: under 0.5 in flight); "
        )
        + f"switches per replica: specgate's mode switches from the level's start to the next's, each {where} "
        f"(| between {where}s); modes at end: s speculative, b baseline, one letter a replica; "
        f"drift m/p95: at each round of samples, the spread (max - min) of specgate's replicas' load of a {where} "
        f"(what each one's policy compares with the watermarks), mean/p95 over the scored part, the worst {where}'s; "
        f"err |m|/bias: each replica's load of a {where} minus its servers' running + queued at the same round "
        "(SGLang's gauges refresh at prefill and every 40 decode steps: the truth is itself a little old), mean "
        "|error|/mean; in requests; CPU: the machine's, all cores)"
    )
    return "\n".join(lines)


def drift_lines(levels: Sequence[LevelReport], high: int, low: int) -> list[str]:
    """The largest drift between replicas, in requests and as a share of the watermarks' band (README
    advises keeping the band wider than the drift), and the error against the replicas' own counts."""
    band = high - low
    drifts = [(lv.concurrency, d) for lv in levels if (d := lv.configs["specgate"].drift) is not None]
    label = "drift between specgate's replicas (reported, no target; README: keep high - low wider than it)"
    if not drifts:
        return [f"{label}: n/a (one replica, or no samples)"]

    def of_band(x: float, named: bool = False) -> str:
        if band <= 0:
            return f"no band: high = low = {high}"
        return f"{x / band:.0%} of the band" + (f" high - low = {high} - {low} = {band}" if named else "")

    c_p95, p95 = max(((c, d.worst_p95) for c, d in drifts), key=lambda x: x[1])
    c_max, top = max(((c, d.level_max) for c, d in drifts), key=lambda x: x[1])
    gateway = ", ".join(f"c={c} {fmt(d.gateway_error_abs)}/{_signed(d.gateway_error_bias)}" for c, d in drifts)
    return [
        f"{label}: largest p95 {fmt(p95)} requests at c={c_p95} ({of_band(p95, named=True)}); largest single "
        f"spread {fmt(top, 0)} at c={c_max}, its level step included ({of_band(top)})",
        "error of each replica's group load against the replicas' own requests in flight added up (exact but "
        f"for the ms between their scrapes, no engine lag: the others' part's error), |mean|/bias: {gateway}",
    ]


def verdicts(plan: ScaleoutPlan, levels: Sequence[LevelReport]) -> list[str]:
    """The issue's targets, each with the figures that decide it."""
    lines = []
    low = [
        f"c={lv.concurrency}: {fmt(lv.vs_better, 3)}"
        for lv in levels
        if lv.conclusive and not lv.vs_better >= RATIO_TARGET
    ]
    incon = [f"c={lv.concurrency}" for lv in levels if not lv.conclusive]
    lines.append(
        target_verdict(
            f"specgate >= {RATIO_TARGET}x the better of all-speculative and all-baseline at every level",
            low,
            incon,
            sum(1 for lv in levels if lv.conclusive),
        )
    )
    if plan.topology == "paired":
        label = (
            f"load split between groups within {SPLIT_TOLERANCE:.0%} of even (every group's share s of the output "
            f"tokens with |s x {plan.groups} - 1| <= {SPLIT_TOLERANCE}), every configuration and level"
        )
        if plan.groups < 2:
            lines.append(f"{label}: n/a: one group")
        else:
            misses, incon, scored = [], [], 0
            for lv in levels:
                for name, cl in lv.configs.items():
                    if not cl.conclusive or cl.split_deviation is None:
                        incon.append(f"c={lv.concurrency} {name}")
                        continue
                    scored += 1
                    if not cl.split_deviation <= SPLIT_TOLERANCE:
                        shares = "/".join(f"{v:.0%}" for v in cl.group_shares.values())
                        misses.append(f"c={lv.concurrency} {name}: {shares} (dev {fmt(cl.split_deviation, 2)})")
            lines.append(target_verdict(label, misses, incon, scored))
    unit = "group" if plan.topology == "paired" else "pool"
    label = f"at most {MAX_SWITCHES} mode switch per replica and {unit} per level step (specgate)"
    sw = [(lv, lv.configs["specgate"].switches) for lv in levels]
    if any(s is None for _, per in sw for s in per):
        lines.append(f"{label}: n/a: {NO_GROUP_SWITCHES}")
    else:
        many = [
            f"c={lv.concurrency} replica {i} {g}: {n}"
            for lv, per in sw
            for i, s in enumerate(per)
            if s is not None
            for g, n in s.items()
            if n > MAX_SWITCHES
        ]
        lines.append(target_verdict(label, many, [], len(sw)))
    if plan.topology == "pooled":
        label = (
            f"each role's busiest server within {IMBALANCE_TARGET}x the role's mean in-flight (levels where the "
            "role was busy, every configuration)"
        )
        misses, incon, scored = [], [], 0
        for lv in levels:
            for name, cl in lv.configs.items():
                for role, x in cl.role_imbalance.items():
                    if x is None:
                        continue
                    if cl.inflight_samples < MIN_SAMPLES:
                        incon.append(f"c={lv.concurrency} {name} {role} ({cl.inflight_samples} samples)")
                        continue
                    scored += 1
                    if not x <= IMBALANCE_TARGET:
                        misses.append(f"c={lv.concurrency} {name} {role}: {fmt(x, 2)}")
        lines.append(target_verdict(label, misses, incon, scored))
    return lines


def warnings(plan: ScaleoutPlan, levels: Sequence[LevelReport], cpu: Mapping[str, CpuUse]) -> list[str]:
    out = [f"warning: {batch}: {u.warning}" for batch, u in cpu.items() if u.warning]
    for lv in levels:
        busy = max((cl.cpu_busy for cl in lv.configs.values() if not math.isnan(cl.cpu_busy)), default=math.nan)
        if busy > CPU_BUSY_WARN:
            out.append(f"warning: c={lv.concurrency}: the machine's CPU was {busy:.0%} busy: timings are stretched")
        if lv.baseline_fidelity < FIDELITY_WARN:
            out.append(
                f"warning: c={lv.concurrency}: all-baseline reached only {lv.baseline_fidelity:.0%} of its profile's "
                "throughput at the loads its servers held: the simulators could not keep time (CPU)"
            )
        for name, cl in lv.configs.items():
            if cl.stats.errors:
                out.append(
                    f"warning: c={lv.concurrency} {name}: {cl.stats.errors} server errors: {cl.stats.error_samples}"
                )
            if cl.stats.client_errors:
                out.append(
                    f"note: c={lv.concurrency} {name}: {cl.stats.client_errors} client errors (not the servers')"
                )
            off = ratio(cl.client_tok_s, cl.tok_s)
            if cl.conclusive and not abs(off - 1.0) <= 0.05:
                out.append(
                    f"note: c={lv.concurrency} {name}: the load generator counted {fmt(off, 3)}x the servers' tokens "
                    "(its own receipt times, under CPU contention, or tokens lost on the way)"
                )
    return out


def profile_lines(plan: ScaleoutPlan, levels: Sequence[LevelReport]) -> list[str]:
    fidelity = ", ".join(f"c={lv.concurrency} {fmt(lv.baseline_fidelity, 2)}" for lv in levels)
    among = "groups" if plan.topology == "paired" else "the servers of a role"
    split = ", ".join(
        f"c={lv.concurrency} " + "/".join(fmt(lv.split_efficiency.get(name, math.nan), 2) for name, _ in FIXED)
        for lv in levels
    )
    return [
        f"all-baseline over its profile at the loads its servers held: {fidelity}",
        f"the profile at the loads held over the profile at an even split among {among}, all-speculative/"
        f"all-baseline (below 1: what uneven load moment by moment costs): {split}",
    ]


def cpu_lines(cpu: Mapping[str, CpuUse]) -> list[str]:
    out = []
    for batch, u in cpu.items():
        procs = ", ".join(f"{k} {v:g} s" for k, v in u.by_process_s.items())
        out.append(
            f"CPU ({batch}): machine {fmt(u.machine_busy_mean * 100, 0)}% busy on average "
            f"(p95 {fmt(u.machine_busy_p95 * 100, 0)}%, {u.cores} cores); CPU time: {procs}"
        )
    return out


def plot_scaleout(
    path: str | Path, plan: ScaleoutPlan, levels: Sequence[LevelReport], runs: Mapping[str, ConfigRun]
) -> None:
    """Throughput by level; evenness by level; specgate's load by group (or server) over time, with modes."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - a dependency of the loadtest extra
        raise SystemExit("plotting needs matplotlib: pip install 'specgate[loadtest]'") from exc
    fig = plt.figure(figsize=(16, 10), constrained_layout=True)
    grid = fig.add_gridspec(2, 2)
    tput, even, timeline = fig.add_subplot(grid[0, 0]), fig.add_subplot(grid[0, 1]), fig.add_subplot(grid[1, :])
    style = {"specgate": ("tab:green", "-", 2.4), "all-speculative": ("tab:orange", "--", 1.4),
             "all-baseline": ("tab:blue", "--", 1.4)}  # fmt: skip
    cs = [lv.concurrency for lv in levels]
    for name in CONFIGS:
        colour, ls, lw = style[name]
        tput.plot(cs, [lv.configs[name].tok_s for lv in levels], ls, marker="o", color=colour, lw=lw, label=name)
    shaky = [lv for lv in levels if not lv.conclusive]
    if shaky:
        tput.plot([lv.concurrency for lv in shaky], [lv.configs["specgate"].tok_s for lv in shaky], "o",
                  markersize=12, markerfacecolor="none", color="tab:red", label="inconclusive level")  # fmt: skip
    right = tput.twinx()
    right.plot(cs, [lv.vs_better for lv in levels], ":", marker="s", color="k", lw=1.0, label="specgate / better")
    right.axhline(RATIO_TARGET, color="tab:red", lw=0.8, ls=":")
    right.set_ylim(0, 1.2)
    right.set_ylabel("specgate / better")
    tput.set_ylabel("output tok/s (servers' counters)")
    tput.set_title("throughput of the three configurations")
    tput.legend(loc="upper left", fontsize=8)
    right.legend(loc="lower right", fontsize=8)
    if plan.topology == "paired":
        for name in CONFIGS:
            colour, ls, lw = style[name]
            even.plot(cs, [lv.configs[name].split_deviation or math.nan for lv in levels], ls, marker="o",
                      color=colour, lw=lw, label=name)  # fmt: skip
        even.axhline(SPLIT_TOLERANCE, color="tab:red", ls=":", lw=1.0, label="target")
        even.set_ylabel("max |group share x groups - 1|")
        even.set_title("load split between groups (0: even)")
    else:
        for name in CONFIGS:
            colour, _, lw = style[name]
            for role, marker, ls in (("speculative", "o", "-"), ("baseline", "^", "--")):
                ys = [lv.configs[name].role_imbalance.get(role) for lv in levels]
                even.plot(cs, [math.nan if y is None else y for y in ys], ls, marker=marker, color=colour, lw=lw,
                          label=f"{name}: {role}")  # fmt: skip
        even.axhline(IMBALANCE_TARGET, color="tab:red", ls=":", lw=1.0, label="target")
        even.set_ylabel("busiest server's mean in-flight / role's mean")
        even.set_title("in-flight balance within each role (1: even)")
    for ax in (tput, even):
        ax.set_xscale("log")
        ax.set_xticks(cs, [str(c) for c in cs])
        ax.minorticks_off()
        ax.set_xlabel("total streams")
        ax.grid(True, which="both", alpha=0.3)
    even.legend(fontsize=7)
    run = runs["specgate"]
    groups = plan.group_names()
    lines: dict[str, list[str]] = (
        {g: [s.name for s in run.servers if s.group == g] for g in groups}
        if plan.topology == "paired"
        else {s.name: [s.name] for s in run.servers}
    )
    for label, names in lines.items():
        series = [trusted_inflight(run.server_samples[n]) for n in names]
        length = min(len(x) for x in series)
        ts = [series[0][i][0] for i in range(length)]
        timeline.plot(ts, [sum(x[i][1] for x in series) for i in range(length)], lw=1.0, label=label)
    mode_colour = {"speculative": "tab:orange", "baseline": "tab:blue"}
    strips = [(i, g) for g in groups for i in range(len(run.gate_samples))]
    height = 0.12 / max(1, len(strips))
    for row, (i, g) in enumerate(strips):
        y0 = 0.86 + row * height
        timeline.text(1.002, y0, f"{g} r{i}", transform=timeline.transAxes, fontsize=6, va="bottom")
        smp = [x for x in run.gate_samples[i] if g in x.modes]
        for a, b in itertools.pairwise([*smp, None]):
            if a is None:
                continue
            t1 = b.t if b is not None else a.t + plan.sample_s
            timeline.axvspan(a.t, t1, ymin=y0, ymax=y0 + height * 0.9, color=mode_colour.get(a.modes[g], "k"), lw=0)
    for lv in levels:
        timeline.axvline(lv.start_s, color="k", lw=0.8)
        timeline.axvspan(lv.start_s, lv.scored_from_s, color="0.92", zorder=0)
        x = lv.start_s + 0.01 * plan.level_s
        timeline.text(x, 0.8, f"{lv.concurrency}", transform=timeline.get_xaxis_transform(), fontsize=9)
    timeline.set_xlim(0, plan.duration_s)
    timeline.set_ylim(bottom=0, top=timeline.get_ylim()[1] * 1.3)
    timeline.set_xlabel("seconds" + (f" (time scale {plan.time_scale:g})" if plan.time_scale != 1 else ""))
    timeline.set_ylabel("running + queued (servers' gauges)")
    what = "group" if plan.topology == "paired" else "server"
    timeline.set_title(
        f"specgate configuration: in flight by {what}; strips at the top: each replica's mode per "
        f"{'group' if plan.topology == 'paired' else 'pool'} (orange speculative, blue baseline); grey: not scored"
    )
    timeline.grid(True, alpha=0.3)
    timeline.legend(fontsize=8, loc="upper left")
    fig.suptitle(textwrap.fill(describe(plan), 150))
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# Command


def describe(plan: ScaleoutPlan) -> str:
    if plan.topology == "paired":
        servers = f"{plan.groups} groups (simulated pairs on shared GPUs)"
    else:
        servers = f"pooled: {plan.speculative_servers} speculative + {plan.baseline_servers} baseline servers"
    return (
        f"scaleout: {servers}, {plan.replicas} specgate replicas (engine load signal), {plan.profile} profile, "
        f"time scale {plan.time_scale:g}, {plan.max_tokens} tokens a request, requests spread round-robin per "
        f"{plan.spread}, configurations {'one after another' if plan.sequential else 'side by side'}"
        + (", live gauges" if plan.live_gauges else "")
        + (f", scrape interval {plan.scrape_interval_s:g} s" if plan.scrape_interval_s is not None else "")
        + (f", low-watermark hold {plan.low_hold_s:g} s" if "low_watermark_hold_s" in Settings.model_fields else "")
    )


def _regroup(cpu: CpuUse) -> CpuUse:
    """CPU seconds with the replicas added up."""
    by: dict[str, float] = {}
    for name, s in cpu.by_process_s.items():
        key = "specgate replicas" if name.startswith("specgate-") else name
        by[key] = round(by.get(key, 0.0) + s, 1)
    return dataclasses.replace(cpu, by_process_s=by)


def run_batch(plan: ScaleoutPlan, names: Sequence[str], wm: Watermarks, quiet: bool) -> tuple[list[ConfigRun], CpuUse]:
    say(f"{' + '.join(names)}: starting simulators and {plan.replicas} replicas each...", quiet)
    runs = start_configs(plan, names, wm)
    try:
        cpu0 = self_cpu_s()
        asyncio.run(run_load(plan, runs, quiet))
        procs = [p for run in runs for p in run.procs]
        cap = Capture(runs[0].t0, {}, {}, {}, runs[0].cpu_samples)
        cpu = _regroup(cpu_use(cap, procs, self_cpu_s() - cpu0))
    finally:
        for run in runs:
            run.stop()
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


def run_scaleout(
    plan: ScaleoutPlan, out_dir: Path, wm: Watermarks | None, quiet: bool
) -> tuple[dict[str, Any], dict[str, ConfigRun]]:
    out_dir.mkdir(parents=True, exist_ok=True)
    if wm is None:
        wm = watermarks_from(calibrate_pair(plan, out_dir, quiet), plan)
    say(f"watermarks high={wm.high} low={wm.low} ({wm.source})", quiet)
    batches = [[name] for name in CONFIGS] if plan.sequential else [list(CONFIGS)]
    runs: dict[str, ConfigRun] = {}
    cpu: dict[str, CpuUse] = {}
    for names in batches:
        done, use = run_batch(plan, names, wm, quiet)
        label = " + ".join(names) if len(names) > 1 else names[0]
        cpu[label] = use
        runs.update({run.name: run for run in done})
    levels = score(plan, runs)
    settings = {
        **vars(plan),
        "watermarks": {"high": wm.high, "low": wm.low, "source": wm.source},
        "specgate_env": {
            name: {
                k: v
                for k, v in gate_env(plan, [], 0, *config_watermarks(name, wm)).items()
                if k not in ("SPECGATE_PORT", "SPECGATE_SPECULATIVE_URL", "SPECGATE_BASELINE_URL")
            }
            for name in CONFIGS
        },
        "servers": {name: [dataclasses.asdict(s) for s in run.servers] for name, run in runs.items()},
        "sample_s": plan.sample_s,
        "targets": {
            "ratio": RATIO_TARGET,
            "split_tolerance": SPLIT_TOLERANCE,
            "max_switches": MAX_SWITCHES,
            "imbalance": IMBALANCE_TARGET,
            "busy_min": BUSY_MIN,
            "min_samples": MIN_SAMPLES,
        },
        "groups_supported_by_specgate": supports_groups(),
    }
    return {
        "settings": settings,
        "levels": levels,
        "cpu": cpu,
        "verdicts": verdicts(plan, levels),
        "drift": drift_lines(levels, *config_watermarks("specgate", wm)),
        "warnings": warnings(plan, levels, cpu),
        "samples": {name: samples_of(run) for name, run in runs.items()},
    }, runs


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "scaleout",
        help="several groups (or pools) of servers behind several specgate replicas, against all-speculative "
        "and all-baseline",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--topology", choices=("paired", "pooled"), default="paired")
    p.add_argument("--groups", type=_count, default=2, help="paired: simulated pairs, one group each (default 2)")
    p.add_argument("--replicas", type=_count, default=3, help="specgate replicas (default 3)")
    p.add_argument("--speculative-servers", type=_count, default=2, help="pooled: speculative servers (default 2)")
    p.add_argument("--baseline-servers", type=_count, default=2, help="pooled: baseline servers (default 2)")
    p.add_argument("--profile", default="crossover", help="simulator profile (default crossover)")
    p.add_argument(
        "--concurrency",
        type=_levels,
        default=(2, 5, 10, 20, 40, 80),
        help="comma list of levels, total streams over all replicas, run in rising order (default 2,5,10,20,40,80)",
    )
    p.add_argument("--level-s", type=positive, default=45.0, help="seconds a level (default 45)")
    p.add_argument("--settle-s", type=float, default=15.0, help="seconds at each level's start not scored (default 15)")
    p.add_argument("--time-scale", type=positive, default=1.0, help="simulators' time scale (default 1)")
    p.add_argument("--high", type=int, default=None, help="high watermark of a group (pooled: of the pool)")
    p.add_argument("--low", type=int, default=None, help="low watermark, with --high")
    p.add_argument(
        "--calibration",
        default=None,
        metavar="FILE",
        help="take the watermarks from a `calibrate --save` file of one pair (default, without --high/--low: "
        "calibrate a fresh pair first, saved to OUT_DIR/calibration.json)",
    )
    p.add_argument(
        "--spread",
        choices=("request", "worker"),
        default="request",
        help="round-robin over the replicas per request (default; an L7 balancer) or per worker (a client pinned "
        "to a replica)",
    )
    p.add_argument("--sequential", action="store_true", help="the three configurations one after another")
    p.add_argument(
        "--scrape-interval-s",
        type=positive,
        default=0.2,
        help="specgate's SPECGATE_SCRAPE_INTERVAL_S at time scale 1 (divided by the time scale; default 0.2, what "
        "README recommends for several replicas)",
    )
    p.add_argument(
        "--low-hold-s",
        type=non_negative,
        default=2.0,
        help="specgate's SPECGATE_LOW_WATERMARK_HOLD_S at time scale 1 (divided by the time scale; default 2, what "
        "README recommends for several replicas; 0: speculation returns at the first low reading)",
    )
    p.add_argument(
        "--live-gauges",
        action="store_true",
        help="the simulators' gauges fresh at every scrape, not SGLang's cadence (every prefill and 40 decode steps)",
    )
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument(
        "--min-requests",
        type=int,
        default=DEFAULT_MIN_REQUESTS,
        help=f"good requests a level's scored part needs per configuration (default {DEFAULT_MIN_REQUESTS})",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts")
    p.add_argument("--out-dir", default="scaleout-results")
    p.add_argument("--quiet", action="store_true", help="no progress lines")


def _levels(raw: str) -> tuple[int, ...]:
    return tuple(levels(raw))


def _count(raw: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{raw!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{raw} must be at least 1")
    return value


def plan_of(args: argparse.Namespace) -> tuple[ScaleoutPlan, Watermarks | None]:
    if not 0 <= args.settle_s < args.level_s:
        raise ValueError(f"--settle-s {args.settle_s:g} must be in [0, --level-s {args.level_s:g})")
    if args.max_tokens < 2:
        raise ValueError("--max-tokens must be at least 2")
    if (args.high is None) != (args.low is None):
        raise ValueError("--high and --low go together")
    if args.high is not None and args.calibration:
        raise ValueError("--calibration or --high/--low, not both")
    if args.high is not None and not 0 <= args.low <= args.high:
        raise ValueError(f"watermarks need 0 <= --low ({args.low}) <= --high ({args.high})")
    several = args.topology == "pooled" or args.groups > 1
    if several and not supports_groups():
        raise ValueError(
            "this specgate routes to one server per role (proxy.config.Settings has no 'topology': lists of "
            "servers, SPECGATE_TOPOLOGY, are not there yet); --topology paired --groups 1 is what it can run"
        )
    plan = ScaleoutPlan(
        topology=args.topology,
        groups=args.groups if args.topology == "paired" else 1,
        replicas=args.replicas,
        speculative_servers=args.speculative_servers,
        baseline_servers=args.baseline_servers,
        profile=args.profile,
        levels=args.concurrency,
        level_s=args.level_s,
        settle_s=args.settle_s,
        time_scale=args.time_scale,
        spread=args.spread,
        sequential=args.sequential,
        max_tokens=args.max_tokens,
        seed=args.seed,
        min_requests=args.min_requests,
        scrape_interval_s=args.scrape_interval_s,
        low_hold_s=args.low_hold_s,
        live_gauges=args.live_gauges,
    )
    if args.high is not None:
        return plan, Watermarks(args.high, args.low, "--high/--low")
    if args.calibration:
        return plan, watermarks_from(Path(args.calibration), plan)
    return plan, None


def cmd_scaleout(args: argparse.Namespace) -> int:
    try:
        plan, wm = plan_of(args)
        from .simulator.profile import ProfileError, load_profile

        try:
            load_profile(plan.profile)
        except ProfileError as exc:
            raise ValueError(f"--profile: {exc}") from None
        out_dir = Path(args.out_dir)
        started = time.monotonic()
        report, runs = run_scaleout(plan, out_dir, wm, args.quiet)
    except ValueError as exc:
        print(f"loadtest: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    levels: list[LevelReport] = report["levels"]
    wm_set = report["settings"]["watermarks"]
    print(describe(plan))
    print(f"watermarks high={wm_set['high']} low={wm_set['low']} ({wm_set['source']})")
    print(level_table(plan, levels))
    print()
    for line in report["verdicts"]:
        print(line)
    for line in report["drift"]:
        print(line)
    for line in profile_lines(plan, levels):
        print(line)
    for line in cpu_lines(report["cpu"]):
        print(line)
    for line in report["warnings"]:
        print(line)
    plot = out_dir / "scaleout.png"
    plot_scaleout(plot, plan, levels, runs)
    write_json(out_dir / "scaleout.json", report)
    print(f"\nplot: {plot}   data: {out_dir / 'scaleout.json'}   ({time.monotonic() - started:.0f} s)")
    return 0
