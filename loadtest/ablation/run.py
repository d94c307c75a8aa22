"""The ablation's runs: a calibration per topology and context (headtohead-classes'), then per cell
and seed every stack started fresh and driven side by side (headtohead's measure_cell), and each
specgate's counters read before it stops. The only module here that imports the experiment
harnesses it reuses (headtohead-classes' plan and calibration, headtohead-affinity's fit check)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from proxy.fleet.promtext import by_label, totals

from ..classes import summarise_class
from ..experiments.affinityrule import FIT_PROMPT_TOKENS, has_fit
from ..experiments.twoclass.plan import ClassPlan
from ..experiments.twoclass.run import at_sessions, context_calibration
from ..kit.cells import Servers, measure_cell
from ..kit.command import say
from ..kit.figures import TargetCell, target_cell
from ..kit.processes import Fleet, fresh_start
from ..kit.sampling import cpu_use, get_text, self_cpu_s
from ..kit.settings import on_clock, specgate_env
from ..procs import simulator_args
from ..sweep import make_session
from .protocol import CellSpec, Protocol, stack_settings
from .score import Run


@dataclass(frozen=True)
class AblationPlan(ClassPlan):
    """headtohead-classes' plan (its traffic, sizes, SLOs, pairs and calibration) for one cell of
    the protocol: its stacks instead of headtohead-classes' targets, and its time scale."""

    stacks: tuple[str, ...] = ()
    scale: float = 1.0
    baselines: int = 1

    @property
    def targets(self) -> tuple[str, ...]:
        return self.stacks

    def time_scale(self, sessions: int, context: int) -> float:
        return self.scale

    def baseline_args(self, time_scale: float, port: int) -> list[str]:
        """One more baseline server of a pool, a GPU of its own (headtohead-affinity's)."""
        flags = ("--profile", self.profile, "--enable-cache-report", "--time-scale", f"{time_scale:g}")
        return simulator_args("baseline", port, *flags)


def cell_plan(protocol: Protocol, cell: CellSpec, seed: int) -> AblationPlan:
    return AblationPlan(
        contexts=(cell.context,),
        sessions=(cell.sessions,),
        window_s=protocol.window_s,
        max_window_s=protocol.max_window_s,
        seed=seed,
        topology=cell.topology,
        stacks=cell.stacks,
        scale=cell.time_scale(),
        baselines=cell.baselines,
    )


def calibration_plan(protocol: Protocol, topology: str, context: int, sessions: tuple[int, ...]) -> ClassPlan:
    """The plan a (topology, context)'s calibration is made with: its cells' sessions bound the levels;
    the protocol's first seed draws the calibration's sessions."""
    return ClassPlan(
        contexts=(context,), sessions=sessions, topology=topology, seed=protocol.seeds[0], window_s=protocol.window_s
    )


def calibrations(protocol: Protocol, out_dir: Path, reuse: Path | None, quiet: bool) -> dict[tuple[str, int], Path]:
    """Each (topology, context)'s calibration file: a pool's with the speed model's fit (the model
    policy's cell needs it; the adaptive policy reads the same curves)."""
    out: dict[tuple[str, int], Path] = {}
    for (topology, context), sessions in protocol.calibrations().items():
        plan = calibration_plan(protocol, topology, context, sessions)
        where = out_dir / topology
        fit = FIT_PROMPT_TOKENS if topology == "pooled" else "none"
        path = context_calibration(plan, context, where, None if reuse is None else reuse / topology, quiet, fit)
        needs_fit = any(c.policy == "model" and c.topology == topology and c.context == context for c in protocol.cells)
        if needs_fit and not has_fit(path):
            raise ValueError(f"the model policy's cell needs a calibration with a fit; {path} has none")
        out[topology, context] = path
    return out


def stack_env(
    cell: CellSpec, stack: str, port: int, servers: Mapping[str, str], time_scale: float, calibration: Path
) -> dict[str, str]:
    """SPECGATE_* for a stack's specgate on `port` in front of `servers` (speculative, then b0,
    b1, ...: one baseline as its plain URL, several by name) with its settings (stack_settings)."""
    baselines = [(name, url) for name, url in servers.items() if name != "speculative"]
    baseline = baselines[0][1] if len(baselines) == 1 else ",".join(f"{n}={u}" for n, u in baselines)
    env = specgate_env(port, servers["speculative"], baseline, time_scale)
    settings = {**stack_settings(cell, stack), "calibration": calibration}
    return env | {f"SPECGATE_{k.upper()}": _scaled(k, v, time_scale) for k, v in settings.items()}


def _scaled(name: str, value: object, time_scale: float) -> str:
    """A setting's value on the simulators' clock (the ON mechanisms' values are meant in simulated
    time, as kit.settings scales the defaults)."""
    return f"{on_clock(name, value, time_scale):g}" if isinstance(value, float) else str(value)


def start_stacks(plan: AblationPlan, cell: CellSpec, calibration: Path) -> Servers:
    t = plan.scale
    urls: dict[str, str] = {}
    servers: dict[str, dict[str, str]] = {}
    with (fleet := Fleet()).stopped_on_error():
        for stack in plan.stacks:
            pair, more = functools.partial(plan.pair, t), functools.partial(plan.baseline_args, t)
            servers[stack] = fleet.start_pool(f"simulators-{stack}", pair, more, plan.baselines)
        fleet.ready()
        for stack in plan.stacks:
            env = functools.partial(
                stack_env, cell, stack, servers=servers[stack], time_scale=t, calibration=calibration
            )
            urls[stack] = fleet.start_specgate(f"specgate-{stack}", env)
        fleet.ready()
    return Servers(urls=urls, servers=servers, fleet=fleet)


def counters(text: str) -> dict[str, float]:
    """What a specgate's /metrics page says it did: decisions by reason (`reason:<name>`), mode
    switches, shadow probes, affinity hits and breaks by reason (`affinity_breaks:<reason>`)."""
    out = {f"reason:{k}": v for k, v in by_label(text, "specgate_routing_decisions_total", "reason").items()}
    out |= {f"affinity_breaks:{k}": v for k, v in by_label(text, "specgate_affinity_breaks_total", "reason").items()}
    names = ("specgate_mode_switches_total", "specgate_shadow_probes_total", "specgate_affinity_hits_total")
    found = totals(text, names)
    for name in names:
        out[name.removeprefix("specgate_").removesuffix("_total")] = found.get(name, 0.0)
    return out


async def _scrape(urls: Mapping[str, str]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    async with make_session() as session:
        for stack, url in urls.items():
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                out[stack] = counters(await get_text(session, url + "/metrics"))
    return out


def run_cell(protocol: Protocol, cell: CellSpec, seed: int, calibration: Path, out_dir: Path, quiet: bool) -> Run:
    plan = cell_plan(protocol, cell, seed)
    t = plan.scale
    scaled = at_sessions(plan, cell.context, cell.sessions, calibration, out_dir / cell.topology)
    say(f"{cell.name} seed {seed} (time scale {t:g}): {len(plan.stacks)} stacks...", quiet)
    started = time.monotonic()
    stacks = start_stacks(plan, cell, scaled)
    try:
        cpu0 = self_cpu_s()
        cap = asyncio.run(measure_cell(plan, cell.context, cell.sessions, stacks, tag_requests=True))
        cpu = cpu_use(cap.cpu_samples, stacks.fleet.procs, self_cpu_s() - cpu0)
        seen = asyncio.run(_scrape(stacks.urls))
    finally:
        stacks.fleet.stop()
    slo = plan.wall_slo(cell.sessions, cell.context)
    figures: dict[str, TargetCell] = {}
    for name in plan.stacks:
        run = cap.runs[name]
        everything = summarise_class("all", run.results, run.t0, run.t1, slo)
        figures[name] = target_cell(name, run.stats(slo, plan.min_requests), everything, t, cap.mean_queued(name))
    wall = round(time.monotonic() - started, 1)
    shown = ", ".join(f"{n} {c.goodput_req_s:.2f}{'' if c.conclusive else '*'}" for n, c in figures.items())
    say(f"  goodput {shown}; CPU {cpu.machine_busy_mean:.0%}; {wall:.0f} s", quiet)
    if cpu.warning:
        say(f"  warning: {cpu.warning}", quiet)
    return Run(cell.name, seed, t, figures, seen, cpu.machine_busy_mean, cpu.warning, wall)


def run_protocol(
    protocol: Protocol,
    out_dir: Path,
    reuse: Path | None,
    quiet: bool,
    after_each: Callable[[list[Run]], None] | None = None,
) -> list[Run]:
    """Calibrations, then every run in the protocol's order; `after_each(runs)` after each run (the
    data file written as it grows)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = calibrations(protocol, out_dir, reuse, quiet)
    runs: list[Run] = []
    for cell, seed in protocol.order():
        path = paths[cell.topology, cell.context]
        one = functools.partial(run_cell, protocol, cell, seed, path, out_dir, quiet)
        runs.append(fresh_start(one, quiet))
        if after_each is not None:
            after_each(runs)
    return runs
