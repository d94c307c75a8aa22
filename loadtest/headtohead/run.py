"""headtohead's run: per cell, the three targets started fresh on simulated GPUs of their own and
driven side by side with the same multi-turn sessions; per accept length and context, a fresh pair
calibrated first for specgate's watermarks."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import aiohttp

from ..client import Target
from ..kit.command import say
from ..kit.processes import Fleet, calibrate_fresh_pair, calibrate_options
from ..kit.sampling import CpuMeter, get_text, metric_samples
from ..kit.settings import specgate_env
from ..procs import free_port
from ..production import WorkloadRun
from ..sweep import LevelPlan, first_model, make_session, measure_together
from ..textbank import TextBank
from ..workload import Workload, WorkloadSpec
from .plan import CALIBRATE_WINDOW_S, MAX_WAIT_S, HeadPlan, context_label

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


def calibration_dir(out_dir: Path, accept: float, context: int) -> Path:
    return out_dir / f"calibration-a{accept:g}-{context_label(context)}"


def calibrate(plan: HeadPlan, accept: float, context: int, out_dir: Path, quiet: bool) -> Path:
    """Calibrate a fresh shared-GPU pair with this cell group's sessions, sent without think time so
    the levels are requests in flight, which is what specgate's watermarks count."""
    where = calibration_dir(out_dir, accept, context)
    where.mkdir(parents=True, exist_ok=True)
    s = plan.sizes(context)
    t = plan.calibration_scale(context)
    extra = [
        *calibrate_options(plan.seed, plan.max_tokens, plan.min_requests),
        "--workload", "multiturn", "--system-tokens", str(s.system_tokens), "--turns", str(s.turns),
        "--user-tokens", str(s.user_tokens), "--think-time-s", "0", "--warmup-s", "0",
    ]  # fmt: skip

    def pair(spec_port: int, base_port: int) -> list[str]:
        return plan.pair_args(accept, t, spec_port, base_port)

    say(f"accept {accept:g}, {context_label(context)} context (calibration at time scale {t:g}):", quiet)
    levels = plan.calibration_levels
    return calibrate_fresh_pair(pair, levels, extra, CALIBRATE_WINDOW_S / t, where, quiet, prompts=None)


def start_servers(plan: HeadPlan, accept: float, sessions: int, context: int, calibration: Path) -> Servers:
    """Baseline and adaptive alone, each a simulator process of its own (its own GPU), and the
    shared-GPU pair with a specgate in front of it configured from the calibration."""
    t = plan.time_scale(sessions, context)
    fleet = Fleet()
    try:
        ports = {name: free_port() for name in ("baseline", "adaptive", "pair-speculative", "pair-baseline")}
        url = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
        for role in ("baseline", "adaptive"):
            fleet.start(f"simulators-{role}", plan.server_args(role, ports[role], accept, t), [url[role] + "/health"])
        pair = plan.pair_args(accept, t, ports["pair-speculative"], ports["pair-baseline"])
        fleet.start("simulators-pair", pair, [url["pair-speculative"] + "/health", url["pair-baseline"] + "/health"])
        fleet.ready()
        gate = f"http://127.0.0.1:{(gport := free_port())}"
        env = specgate_env(
            gport, url["pair-speculative"], url["pair-baseline"], t, policy="threshold", calibration=str(calibration)
        )
        fleet.start("specgate", ["-m", "proxy"], [gate + "/ready"], env)
        fleet.ready()
    except BaseException:
        fleet.stop()
        raise
    return Servers(
        urls={"baseline": url["baseline"], "adaptive": url["adaptive"], "specgate": gate},
        servers={
            "baseline": {"baseline": url["baseline"]},
            "adaptive": {"adaptive": url["adaptive"]},
            "specgate": {"speculative": url["pair-speculative"], "baseline": url["pair-baseline"]},
        },
        fleet=fleet,
    )


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
    """What a cell is measured by: headtohead's plan, or headtohead-classes' (twoclass.py)."""

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
