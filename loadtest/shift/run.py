"""shift's run: four targets side by side at one level, each in front of a simulated pair of its own,
the prompt mix switched at the same instants for all; /routing, the specgates' counters and the
machine's CPU read beside the load."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from proxy.fleet import promtext

from ..client import RequestResult, Target
from ..kit.command import say
from ..kit.driving import chat_target, drain, sleep_until, stream, ticks
from ..kit.processes import Fleet, calibrate_fresh_pair, calibrate_options
from ..kit.sampling import CpuMeter, get_json, get_text
from ..prompts import Prompt, source
from ..sweep import make_session
from .plan import CALIBRATE_DURATION_S, CALIBRATE_LEVELS, POLICIES, SERVERS, SPECGATES, TARGETS, ShiftPlan, specgate_env

COUNTERS = ("specgate_mode_switches_total", "specgate_routing_decisions_total", "specgate_shadow_probes_total")


def start_targets(plan: ShiftPlan, calibration: str, fleet: Fleet) -> dict[str, str]:
    """A fresh pair per target, then a specgate in front of two of them; each target's URL."""
    pairs: dict[str, tuple[str, str]] = {}
    for name in TARGETS:
        pairs[name] = fleet.start_pair(f"simulators-{name}", plan.pair_args)
    fleet.ready()
    urls = {name: pairs[name][SERVERS.index(name)] for name in SERVERS}
    for name in SPECGATES:
        env = functools.partial(specgate_env, POLICIES[name], *pairs[name], calibration=calibration, plan=plan)
        urls[name] = fleet.start_specgate(f"specgate-{name}", env)
    fleet.ready()
    return {name: urls[name] for name in TARGETS}


def calibrate_first(plan: ShiftPlan, out_dir: Path, quiet: bool) -> Path:
    """Calibrate a fresh simulated pair with diverse prompts; the file specgate will load."""
    levels = sorted({*CALIBRATE_LEVELS, *plan.levels})
    duration_s = CALIBRATE_DURATION_S / plan.time_scale
    return calibrate_fresh_pair(
        plan.pair_args,
        levels,
        calibrate_options(plan.seed, plan.max_tokens, plan.min_requests),
        duration_s,
        out_dir,
        quiet,
    )


@dataclass(frozen=True)
class RoutingSample:
    t: float  # seconds since the load began
    load: int
    mode: str
    high: int
    low: int
    crossover: float | None = None
    accept_live: float | None = None
    inflight_speculative: int = 0
    inflight_baseline: int = 0
    why: str | None = None


@dataclass
class Capture:
    """What one level's run recorded, all times relative to `t0` (time.monotonic())."""

    t0: float
    results: dict[str, list[RequestResult]]
    routing: dict[str, list[RoutingSample]]
    # Specgate counters at each phase boundary (and the end): name -> value.
    counters: dict[str, list[dict[str, float]]]
    cpu_samples: list[tuple[float, float]]  # (t, busy share since the last sample)


def routing_sample(data: Mapping[str, Any], t: float) -> RoutingSample:
    adaptive = data.get("adaptive") or {}
    backends = data.get("backends") or {}
    return RoutingSample(
        t=t,
        load=int(data["load"]),
        mode=str(data["mode"]),
        high=int(data["watermarks"]["high"]),
        low=int(data["watermarks"]["low"]),
        crossover=adaptive.get("crossover_estimate"),
        accept_live=adaptive.get("accept_length_live"),
        inflight_speculative=int((backends.get("speculative") or {}).get("inflight", 0)),
        inflight_baseline=int((backends.get("baseline") or {}).get("inflight", 0)),
        why=adaptive.get("why"),
    )


def counters(text: str) -> dict[str, float]:
    """Mode switches, routing decisions by reason and shadow probes, from specgate's /metrics."""
    out: dict[str, float] = {"switches": 0.0}
    for s in promtext.samples(text, COUNTERS):
        if s.name == "specgate_mode_switches_total":
            key = "switches"
        elif s.name == "specgate_routing_decisions_total":
            key = f"{s.labels.get('reason')}:{s.labels.get('backend')}"
        else:  # shadow probes too: copies, not requests
            key = f"probe:shadow-{s.labels.get('outcome')}"
        out[key] = out.get(key, 0.0) + s.value
    return out


async def _counters(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    return counters(await get_text(session, url + "/metrics"))


async def _sample_routing(
    session: aiohttp.ClientSession, plan: ShiftPlan, urls: Mapping[str, str], cap: Capture
) -> None:
    """/routing of each specgate every sample period, the machine's CPU every second."""
    cpu = CpuMeter(cap.t0, cap.cpu_samples)
    async for now in ticks(cap.t0, plan.sample_s, cap.t0 + plan.duration_s):
        for g in SPECGATES:
            with contextlib.suppress(aiohttp.ClientError, TimeoutError, KeyError, ValueError, TypeError):
                data = await get_json(session, urls[g] + "/routing")
                cap.routing[g].append(routing_sample(data, time.monotonic() - cap.t0))
        cpu.poll(now)


async def _boundaries(
    session: aiohttp.ClientSession, plan: ShiftPlan, c: int, urls: Mapping[str, str], cap: Capture, quiet: bool
) -> None:
    """The specgates' counters at each phase's end; a reading that fails is left empty."""
    n = len(plan.phases)
    for i in range(1, n + 1):
        await sleep_until(cap.t0 + i * plan.phase_s)
        for g in SPECGATES:
            try:
                cap.counters[g].append(await _counters(session, urls[g]))
            except (aiohttp.ClientError, TimeoutError, ValueError):
                cap.counters[g].append({})
        if i < n:
            say(f"  c={c}: phase {i + 1}/{n} ({plan.phases[i]})", quiet)


async def run_load(plan: ShiftPlan, c: int, urls: Mapping[str, str], quiet: bool) -> Capture:
    """All four targets at once, closed-loop at `c` streams each, phases switched at shared instants."""
    n = len(plan.phases)
    async with make_session() as session:
        targets = {name: await chat_target(url, plan.max_tokens) for name, url in urls.items()}
        # The same prompts in the same order for every target (each its own iterators).
        prompts: dict[str, list[Iterator[Prompt]]] = {
            name: [source(src, plan.seed + i) for i, src in enumerate(plan.phases)] for name in targets
        }
        cap = Capture(0.0, {name: [] for name in targets}, {g: [] for g in SPECGATES}, {g: [] for g in SPECGATES}, [])
        for g in SPECGATES:  # before any load: the counters' zero
            cap.counters[g].append(await _counters(session, urls[g]))
        t0 = cap.t0 = time.monotonic()

        def next_request(name: str) -> tuple[Target, Prompt]:
            phase = min(int((time.monotonic() - t0) / plan.phase_s), n - 1)
            return targets[name], next(prompts[name][phase])

        say(f"  c={c}: phase 1/{n} ({plan.phases[0]})", quiet)
        end = t0 + plan.duration_s
        streams = [
            asyncio.create_task(stream(session, end, functools.partial(next_request, name), cap.results[name]))
            for name in targets
            for _ in range(c)
        ]
        await asyncio.gather(_sample_routing(session, plan, urls, cap), _boundaries(session, plan, c, urls, cap, quiet))
        await drain(streams, plan.time_scale)
    return cap
