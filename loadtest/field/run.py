"""The field benchmark's run: per context a fresh pair calibrated with both classes (twoclass's
calibration, a GPU each), then per cell and seed every configuration a fresh fleet of simulators of
its own behind its router (smg or specgate), measured side by side (kit.cells)."""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable, Collection, Mapping
from pathlib import Path

from ..experiments.twoclass.plan import ClassPlan, smg_argv
from ..experiments.twoclass.run import calibration_scale_of, context_calibration, target_figures
from ..kit.cells import Servers, run_stacks, say_goodput
from ..kit.command import say
from ..kit.figures import TargetCell
from ..kit.multiturn import context_label
from ..kit.processes import Fleet, at_time_scale, fresh_start
from ..kit.settings import settings_env, specgate_env
from ..procs import free_port, simulator_args
from ..report import write_json
from .protocol import SMG, TRAFFICS, Cell, CellRun, FieldPlan, calibrated, fits, gate_settings, roles
from .score import FieldRun


def calibration_plan(plan: FieldPlan) -> ClassPlan:
    """twoclass's plan for a context's calibration: both classes (one-class cells read class A's
    acceptance from the same file), a GPU each, levels up to the heaviest load a server sees."""
    return ClassPlan(
        contexts=plan.contexts, sessions=(max(c.per_gpu for c in plan.cells),), turns=plan.turns,
        max_tokens=plan.max_tokens, seed=plan.seed, min_requests=plan.min_requests, topology="pooled",
        spec_steps=plan.spec_steps, max_accept_length=plan.max_accept_length, profile=plan.profile,
    )  # fmt: skip


def calibrations(plan: FieldPlan, out_dir: Path, reuse: Path | None, quiet: bool) -> dict[int, Path]:
    """Each context's calibration file (twoclass.run.context_calibration: `reuse`'s, else fresh)."""
    cal = calibration_plan(plan)
    return {c: context_calibration(cal, c, out_dir, reuse, quiet) for c in plan.contexts}


def at_cell_scale(plan: FieldPlan, path: Path, cell: Cell, scale: float, out_dir: Path) -> Path:
    """The context's calibration in the cell's wall seconds (kit.processes.at_time_scale)."""
    where = out_dir / f"calibration-{context_label(cell.context)}" / f"at-{scale:g}.json"
    where.parent.mkdir(parents=True, exist_ok=True)  # absent where --calibrations gave the file
    measured = calibration_scale_of(calibration_plan(plan), path, cell.context)
    return at_time_scale(path, measured, scale, where)


def start_fleets(
    plan: FieldPlan,
    cell: Cell,
    configs: tuple[str, ...],
    scale: float,
    calibration: Path,
    smg: str,
    fields: Collection[str],
) -> Servers:
    """Each configuration's simulators (a process each, alone on its GPU) and its router."""
    urls: dict[str, str] = {}
    servers: dict[str, dict[str, str]] = {}
    flags = plan.simulator_flags(scale)
    with (fleet := Fleet()).stopped_on_error():
        for config in configs:
            servers[config] = {}
            for i, role in enumerate(roles(config, cell.gpus)):
                port = free_port()
                url = servers[config][f"{role}-{i}"] = f"http://127.0.0.1:{port}"
                fleet.start(f"{config}-{role}-{i}", simulator_args(role, port, *flags), [url + "/health"])
        fleet.ready()
        for config in configs:
            if config in SMG:
                port = free_port()
                urls[config] = f"http://127.0.0.1:{port}"
                argv = smg_argv(smg, port, free_port(), list(servers[config].values()))
                fleet.start(config, argv, [urls[config] + "/readiness"])
                continue
            settings = gate_settings(config) | plan.slo_settings(scale, fields) | plan.extra_settings(scale)
            if calibrated(config):
                settings["calibration"] = calibration
            env = functools.partial(gate_env, backends=servers[config], time_scale=scale, settings=settings)
            urls[config] = fleet.start_specgate(config, env)
        fleet.ready()
    return Servers(urls=urls, servers=servers, fleet=fleet)


def gate_env(
    port: int, backends: Mapping[str, str], time_scale: float, settings: Mapping[str, object]
) -> dict[str, str]:
    """SPECGATE_* for a specgate in front of `backends` (by `role-i`): each role's comma list, an
    empty one where it has none; SPECGATE_ADAPTIVE_URL only where there are adaptive servers."""
    by_role = {r: ",".join(u for k, u in backends.items() if k.rsplit("-", 1)[0] == r)
               for r in ("speculative", "baseline", "adaptive")}  # fmt: skip
    env = specgate_env(port, by_role["speculative"], by_role["baseline"], time_scale) | settings_env(settings)
    if by_role["adaptive"]:
        env["SPECGATE_ADAPTIVE_URL"] = by_role["adaptive"]
    return env


def run_cell(
    plan: FieldPlan,
    cell: Cell,
    seed: int,
    configs: tuple[str, ...],
    calibration: Path,
    smg: str,
    fields: Collection[str],
    quiet: bool,
) -> FieldRun:
    """One cell at one seed: every configuration fresh, side by side, scored in simulated time."""
    scale = plan.time_scale(cell, len(configs))
    say(f"  {cell.label} seed {seed} (time scale {scale:g}): {len(configs)} fleets and their routers...", quiet)
    servers = start_fleets(plan, cell, configs, scale, calibration, smg, fields)
    view = CellRun(plan, cell, seed, scale)
    cap, cpu = run_stacks(view, cell.context, cell.sessions, servers, tag_requests=True)
    slo = plan.wall_slo(scale)
    targets, per_class = {}, {}
    for name in configs:
        figures, per_class[name] = target_figures(
            name, cap.runs[name], slo, scale, plan.min_requests, TRAFFICS[cell.traffic]
        )
        targets[name] = dataclasses.replace(figures, mean_queued=cap.mean_queued(name))
    say_goodput(targets, cpu, quiet)
    return FieldRun(cell, seed, scale, targets, per_class, cpu.machine_busy_mean, cpu.warning)


RunOne = Callable[[FieldPlan, Cell, int, tuple[str, ...], Path, str, Collection[str], bool], FieldRun]


def run_all(
    plan: FieldPlan,
    configs: tuple[str, ...],
    smg: str,
    fields: Collection[str],
    out_dir: Path,
    reuse: Path | None,
    quiet: bool,
    run_one: RunOne = run_cell,
) -> list[FieldRun]:
    """Every cell at every seed, in the plan's order (each cell's seeds together), each started
    afresh where a process did not start; the runs so far written to OUT_DIR/field.json after each."""
    out_dir.mkdir(parents=True, exist_ok=True)
    cals = calibrations(plan, out_dir, reuse, quiet)
    runs: list[FieldRun] = []
    for cell in plan.cells:
        here = tuple(c for c in configs if fits(c, cell.gpus))
        scaled = at_cell_scale(plan, cals[cell.context], cell, plan.time_scale(cell, len(here)), out_dir)
        for seed in plan.seed_list():
            one = functools.partial(run_one, plan, cell, seed, here, scaled, smg, fields, quiet)
            runs.append(fresh_start(one, quiet))
            write_json(out_dir / "field.json", {"settings": plan, "runs": runs})
    return runs


def runs_from(path: Path) -> tuple[FieldPlan, list[FieldRun]]:
    """A run's plan and runs as its field.json holds them (written after each run), to report
    again without running (--report-from)."""
    data = json.loads(path.read_text())
    settings = dict(data["settings"])
    settings["cells"] = tuple(Cell(**c) for c in settings["cells"])
    settings["configs"] = tuple(settings["configs"])
    plan = FieldPlan(**settings)
    runs = [
        FieldRun(
            cell=Cell(**r["cell"]),
            seed=r["seed"],
            time_scale=r["time_scale"],
            targets={name: TargetCell(**t) for name, t in r["targets"].items()},
            class_goodput=r.get("class_goodput", {}),
            cpu_busy=r.get("cpu_busy"),
            cpu_warning=r.get("cpu_warning"),
        )
        for r in data["runs"]
    ]
    return plan, runs
