"""headtohead-classes' run: per context a fresh pair calibrated with both classes, then per cell
every target a fresh stack of its own (a pair, and its specgate, pinned gates or smg), measured
side by side (kit.cells) and scored (score.py)."""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

from ...classes import Slo, summarise_class
from ...client import RequestResult
from ...kit.cells import Servers, run_stacks, say_goodput
from ...kit.command import say
from ...kit.figures import TargetCell, target_cell
from ...kit.multiturn import calibration_flags, context_label, sizes_for
from ...kit.processes import Fleet, at_time_scale, calibrate_fresh_pair, calibrate_options, fresh_start
from ...kit.settings import settings_env, specgate_env
from ...procs import free_port
from ...production import WorkloadRun
from ...report import write_json
from ...workload import TrafficClass
from .plan import (
    CONTROL,
    DIRECT,
    GATES,
    ORACLE,
    PINNED,
    ROLES,
    SCALE_FILE,
    SPLIT,
    SPLIT_ROLES,
    ClassPlan,
    gate_settings,
    pinned_settings,
    smg_argv,
)
from .score import ClassCell, oracle_hit_rate, returned_share

P = TypeVar("P", bound=ClassPlan)
C = TypeVar("C")


def calibrate(plan: ClassPlan, context: int, out_dir: Path, quiet: bool, prompt_tokens: str = "none") -> Path:
    """A fresh pair calibrated with the plan's traffic (`prompt_tokens`: the speed model's sweeps,
    calibrate's --prompt-tokens; none: no fit)."""
    where = out_dir / f"calibration-{context_label(context)}"
    where.mkdir(parents=True, exist_ok=True)
    s = sizes_for(context, plan.turns, plan.max_tokens)
    t = plan.calibration_scale(context)
    extra = [*calibrate_options(plan.seed, plan.max_tokens, plan.min_requests), *calibration_flags(s, plan.traffic())]
    say(f"{context_label(context)} context: calibrating at time scale {t:g}", quiet)
    path = calibrate_fresh_pair(
        lambda sp, bp: plan.pair(t, sp, bp),
        plan.calibration_levels(),
        extra,
        2.0 / t,
        where,
        quiet,
        prompts=None,
        prompt_tokens=prompt_tokens,
    )
    write_json(where / SCALE_FILE, {"time_scale": t})
    return path


def calibration_scale_of(plan: ClassPlan, path: Path, context: int) -> float:
    """The time scale a calibration ran at: its SCALE_FILE's, else (files from before it was kept)
    the one this plan would calibrate at."""
    try:
        return float(json.loads((path.parent / SCALE_FILE).read_text())["time_scale"])
    except (OSError, ValueError, KeyError, TypeError):
        return plan.calibration_scale(context)


def start_servers(plan: ClassPlan, sessions: int, context: int, calibration: Path) -> Servers:
    t = plan.time_scale(sessions, context)
    urls: dict[str, str] = {}
    servers: dict[str, dict[str, str]] = {}
    class_urls: dict[str, dict[str, str]] = {}
    stream_urls: dict[str, tuple[str, ...]] = {}
    pairs: dict[str, dict[str, str]] = {}
    with (fleet := Fleet()).stopped_on_error():
        for target in plan.targets:
            spec, base = fleet.start_pair(f"pair-{target}", functools.partial(plan.pair, t))
            servers[target] = pairs[target] = {"speculative": spec, "baseline": base}
            if target == "all-spec":
                urls[target], servers[target] = spec, {"speculative": spec}
            elif target in ("all-base", DIRECT):
                urls[target], servers[target] = base, {"baseline": base}
            elif target == SPLIT:
                urls[target] = spec
                class_urls[target] = {c: servers[target][role] for c, role in SPLIT_ROLES.items()}
            elif target == ORACLE:
                urls[target], stream_urls[target] = spec, oracle_urls(plan, spec, base)
        fleet.ready()
        if plan.gated_fixed:
            start_pinned_gates(plan, t, fleet, pairs, urls, class_urls)
        if plan.smg:
            port = free_port()
            urls["smg"] = f"http://127.0.0.1:{port}"
            argv = smg_argv(plan.smg, port, free_port(), list(servers["smg"].values()))
            fleet.start("smg", argv, [urls["smg"] + "/readiness"])
        for target in [t for t in plan.targets if t in (*GATES, CONTROL)]:
            back = servers[target]
            settings = {**gate_settings(target), "calibration": calibration, "topology": plan.topology}
            env = functools.partial(gate_env, backends=back, time_scale=t, settings=settings)
            urls[target] = fleet.start_specgate(f"specgate-{target}", env)
        fleet.ready()
    return Servers(urls=urls, servers=servers, fleet=fleet, class_urls=class_urls, stream_urls=stream_urls)


def gate_env(
    port: int, backends: Mapping[str, str], time_scale: float, settings: Mapping[str, object]
) -> dict[str, str]:
    """SPECGATE_* for a specgate in front of a pair's `backends`, with `settings` as given."""
    return specgate_env(port, backends["speculative"], backends["baseline"], time_scale) | settings_env(settings)


def oracle_urls(plan: ClassPlan, spec: str, base: str) -> tuple[str, ...]:
    """The oracle's client.Target.stream_urls: stream i is of class i mod the classes
    (classes_by_stream), where the two URLs in turn would send each class to one server. Each class
    alternates between them instead, starting on the other server from one round of the classes to
    the next (two classes: spec, base, base, spec), so that each server holds as many streams of
    each class as the count allows, and as many in all within one."""
    n = len(plan.traffic())
    return tuple((spec, base)[(i // n + i % n) % 2] for i in range(2 * n))


def start_pinned_gates(
    plan: ClassPlan,
    time_scale: float,
    fleet: Fleet,
    pairs: dict[str, dict[str, str]],
    urls: dict[str, str],
    class_urls: dict[str, dict[str, str]],
) -> None:
    """--fixed-through specgate: a gate pinned to each fixed target's server and one to each of
    the split's (pinned_backends); `urls` and `class_urls` then lead through them (through_gates)."""
    via: dict[tuple[str, str], str] = {}
    for (target, role), backends in pinned_backends(plan, pairs, f"http://127.0.0.1:{free_port()}").items():
        settings = {**pinned_settings(role), "topology": plan.topology}
        env = functools.partial(gate_env, backends=backends, time_scale=time_scale, settings=settings)
        via[target, role] = fleet.start_specgate(f"specgate-pinned-{target}-{role}", env)
    fleet.ready()
    gated, gated_classes = through_gates(via)
    urls |= gated
    class_urls |= gated_classes


def pinned_backends(
    plan: ClassPlan, pairs: dict[str, dict[str, str]], closed: str
) -> dict[tuple[str, str], dict[str, str]]:
    """(target, role) -> the servers of the gate pinned to that role in front of the target's pair:
    its role's server, and for the other role `closed`, a port nothing listens on. A request the
    gate cannot serve on its role (that server down, a failed attempt, a batch request) then fails
    as it would sent straight, and never reaches the other server."""
    wanted = [(t, r) for t, r in PINNED if t in plan.targets]
    if SPLIT in plan.targets:
        wanted += [(SPLIT, r) for r in sorted(set(SPLIT_ROLES.values()))]
    return {(t, r): {role: pairs[t][r] if role == r else closed for role in ROLES} for t, r in wanted}


def through_gates(via: dict[tuple[str, str], str]) -> tuple[dict[str, str], dict[str, dict[str, str]]]:
    """The targets' URLs and the split's per class, given each pinned gate's URL by (target, role)."""
    urls = {t: url for (t, _), url in via.items() if t != SPLIT}
    if not any(t == SPLIT for t, _ in via):
        return urls, {}
    urls[SPLIT] = via[SPLIT, SPLIT_ROLES["B"]]
    return urls, {SPLIT: {c: via[SPLIT, r] for c, r in SPLIT_ROLES.items()}}


def misrouted(target: str, results: Sequence[RequestResult]) -> int:
    """With --fixed-through specgate: the target's requests a gate says it sent to the role it was
    not pinned to (pinned_backends makes that fail; this checks it did)."""
    want = dict(PINNED).get(target)
    count = 0
    for r in results:
        role = want if target != SPLIT else SPLIT_ROLES.get(r.traffic_class)
        count += r.backend is not None and role is not None and r.backend != role
    return count


def run_cell(plan: ClassPlan, context: int, sessions: int, calibration: Path, quiet: bool) -> ClassCell:
    t = plan.time_scale(sessions, context)
    say(f"  {sessions} sessions (time scale {t:g}): {len(plan.targets)} pairs and their routers...", quiet)
    cap, cpu = run_stacks(plan, context, sessions, start_servers(plan, sessions, context, calibration), True)
    slo = plan.wall_slo(sessions, context)
    system = sizes_for(context, plan.turns, plan.max_tokens).system_tokens
    targets: dict[str, TargetCell] = {}
    per_class: dict[str, dict[str, float]] = {}
    oracle: dict[str, float | None] = {}
    returned: dict[str, float | None] = {}
    for name in plan.targets:
        run = cap.runs[name]
        targets[name], per_class[name] = target_figures(name, run, slo, t, plan.min_requests, plan.traffic())
        targets[name] = dataclasses.replace(targets[name], mean_queued=cap.mean_queued(name))
        wrong = misrouted(name, run.results) if plan.gated_fixed else 0
        if wrong:
            # Not the fixed choice it stands for: nothing is concluded from it.
            targets[name] = dataclasses.replace(targets[name], conclusive=False)
            say(f"    warning: {wrong} of {name}'s requests reached the role its gate is not pinned to", quiet)
        oracle[name] = oracle_hit_rate(run.results, run.t0, run.t1, system)
        returned[name] = returned_share(run.results, run.t0, run.t1)
    cell = ClassCell(
        context, sessions, t, targets, per_class, oracle, cpu.machine_busy_mean, plan.seed, cpu.warning, returned
    )
    say_goodput(targets, cpu, quiet)
    return cell


def target_figures(
    name: str, run: WorkloadRun, slo: Slo, time_scale: float, min_requests: int, classes: Sequence[TrafficClass]
) -> tuple[TargetCell, dict[str, float]]:
    """A target's figures in simulated time (kit.figures.target_cell, no queue gauge) and each
    class's goodput in requests a simulated second (0 for a class with none in the window)."""
    stats = run.stats(slo, min_requests)
    everything = summarise_class("all", run.results, run.t0, run.t1, slo)
    per_class = {c.name: (s.goodput_req_s or 0.0) / time_scale if (s := stats.classes.get(c.name)) else 0.0
                 for c in classes}  # fmt: skip
    return target_cell(name, stats, everything, time_scale), per_class


def context_calibration(
    plan: ClassPlan, context: int, out_dir: Path, reuse: Path | None, quiet: bool, prompt_tokens: str = "none"
) -> Path:
    """The context's calibration file: `reuse`'s, else a fresh one (calibrate)."""
    if reuse is None:
        return calibrate(plan, context, out_dir, quiet, prompt_tokens)
    path = reuse / f"calibration-{context_label(context)}" / "calibration.json"
    if not path.exists():
        raise ValueError(f"--calibrations: no {path}")
    return path


def at_sessions(plan: ClassPlan, context: int, sessions: int, path: Path, out_dir: Path) -> Path:
    """The calibration in the cell's wall seconds, as a user's would read it on the GPU it was made on."""
    where = out_dir / f"calibration-{context_label(context)}" / f"at-{sessions}-sessions.json"
    where.parent.mkdir(parents=True, exist_ok=True)
    measured = calibration_scale_of(plan, path, context)
    return at_time_scale(path, measured, plan.time_scale(sessions, context), where)


def run_cells(
    plan: P,
    out_dir: Path,
    reuse: Path | None,
    quiet: bool,
    run_cell: Callable[[P, int, int, Path, bool], C],
    name: str,
    prompt_tokens: str = "none",
    check: Callable[[Path], None] | None = None,
) -> list[C]:
    """Every run of every cell, `run_cell` on the plan at each run's seed (--repeats: seed, seed + 1,
    ...) and started afresh where a process did not start; each context's calibration made first
    (context_calibration, `prompt_tokens` its fit's sweeps) and checked (`check`), and read at each
    cell's time scale (at_sessions); the cells so far written to OUT_DIR/NAME.json after each."""
    out_dir.mkdir(parents=True, exist_ok=True)
    cells: list[C] = []
    for context in plan.contexts:
        path = context_calibration(plan, context, out_dir, reuse, quiet, prompt_tokens)
        if check is not None:
            check(path)
        for s in plan.sessions:
            scaled = at_sessions(plan, context, s, path, out_dir)
            for i in range(plan.repeats):
                one = dataclasses.replace(plan, seed=plan.seed + i)
                cells.append(fresh_start(functools.partial(run_cell, one, context, s, scaled, quiet), quiet))
                write_json(out_dir / f"{name}.json", {"settings": vars(plan), "cells": cells})
    return cells
