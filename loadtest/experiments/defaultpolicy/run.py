"""The default-policy benchmark's runs: per pair, `loadtest calibrate --save` on a fresh pair, then
one more fresh pair with the three arms' specgates in front of it, driven one arm at a time at
each level of the plan, and each gateway's watermarks read after every level."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import math
from collections.abc import Callable, Mapping
from pathlib import Path

import aiohttp

from proxy.policy.calibration import load

from ...kit.command import say
from ...kit.processes import Fleet, calibrate_fresh_pair, calibrate_options, fresh_start
from ...kit.sampling import get_json, proc_stat
from ...kit.settings import specgate_env
from ...kit.sweeps import add_load_options, sweep_targets
from ...procs import pair_args
from ...stats import LevelStats
from ...sweep import make_session
from .protocol import ADAPTIVE, ARMS, CALIBRATED, THRESHOLD, ArmLevel, PairRun, PairSpec, Protocol, plan

POLICY = {CALIBRATED: "threshold", ADAPTIVE: "adaptive", THRESHOLD: "threshold"}


def sweep_args(protocol: Protocol, pair: PairSpec) -> argparse.Namespace:
    """calibrate's own load options (diverse one-turn prompts, chat), the windows on the pair's clock."""
    p = argparse.ArgumentParser()
    add_load_options(p)
    args = p.parse_args([])
    args.prompts = "diverse"
    args.seed = protocol.seed
    args.max_tokens = protocol.max_tokens
    args.min_requests = protocol.min_requests
    args.warmup_s = protocol.wall(pair, protocol.warmup_s)
    args.duration_s = protocol.wall(pair, protocol.window_s)
    args.max_duration_s = protocol.wall(pair, protocol.max_window_s)
    args.quiet = True  # no progress bar; the harness says a line a level
    return args


def calibrate_pair(protocol: Protocol, pair: PairSpec, where: Path, quiet: bool) -> Path:
    """calibrate --save on a fresh pair at the pair's levels (the full sweep) and time scale."""
    extra = calibrate_options(protocol.seed, protocol.max_tokens, protocol.min_requests)
    args = functools.partial(_pair_args, pair)
    window = protocol.wall(pair, protocol.calibrate_window_s)
    return calibrate_fresh_pair(args, pair.levels, extra, window, where, quiet)


def _pair_args(pair: PairSpec, spec_port: int, base_port: int) -> list[str]:
    return pair_args(spec_port, base_port, *pair.simulator_flags())


def arm_env(arm: str, pair: PairSpec, calibration: Path, port: int, spec: str, base: str) -> dict[str, str]:
    """An arm's specgate: its policy named (whatever the default), the calibration only for
    calibrated threshold, every time setting at its default on the simulators' clock."""
    if arm == CALIBRATED:
        return specgate_env(port, spec, base, pair.time_scale, policy=POLICY[arm], calibration=str(calibration))
    return specgate_env(port, spec, base, pair.time_scale, policy=POLICY[arm])


def start_arms(pair: PairSpec, calibration: Path) -> tuple[Fleet, dict[str, str]]:
    with (fleet := Fleet()).stopped_on_error():
        spec, base = fleet.start_pair("simulators", functools.partial(_pair_args, pair))
        fleet.ready()
        urls = {
            arm: fleet.start_specgate(
                f"specgate-{arm}", functools.partial(arm_env, arm, pair, calibration, spec=spec, base=base)
            )
            for arm in ARMS
        }
        fleet.ready()
    return fleet, urls


def arm_level(stats: LevelStats, time_scale: float, watermarks: tuple[int, int] | None) -> ArmLevel:
    """A sweep's level in simulated units (tok/s over the time scale, TPOT times it)."""
    high, low = watermarks if watermarks is not None else (None, None)
    return ArmLevel(
        output_tok_s=stats.output_tok_s / time_scale,
        mean_tpot_ms=stats.mean_tpot_ms * time_scale,
        completed=stats.completed,
        errors=stats.errors,
        client_errors=stats.client_errors,
        conclusive=stats.conclusive,
        speculative_share=stats.backend_share.get("speculative", 0.0) if stats.backend_share else math.nan,
        high=high,
        low=low,
    )


async def _watermarks(session: aiohttp.ClientSession, url: str) -> tuple[int, int] | None:
    with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError):
        w = (await get_json(session, url + "/routing"))["watermarks"]
        return int(w["high"]), int(w["low"])
    return None


async def measure(
    protocol: Protocol,
    pair: PairSpec,
    urls: Mapping[str, str],
    run: PairRun,
    quiet: bool,
    after_each: Callable[[PairRun], None] | None = None,
) -> None:
    """Every (round, level) of the plan, the arms one after another in the plan's order."""
    args = sweep_args(protocol, pair)
    async with make_session() as session:
        for r, level, order in plan(protocol, pair):
            args.concurrency = [level]
            busy0, total0 = proc_stat()
            swept = await sweep_targets({arm: urls[arm] for arm in order}, args)
            busy1, total1 = proc_stat()
            figures = {
                arm: arm_level(swept[arm][0], pair.time_scale, await _watermarks(session, urls[arm])) for arm in ARMS
            }
            run.rounds.setdefault(r, {})[level] = figures
            share = (busy1 - busy0) / (total1 - total0) if total1 > total0 else math.nan
            run.cpu_busy.setdefault(r, {})[level] = round(share, 3)
            shown = ", ".join(f"{a} {f.output_tok_s:,.0f}{'' if f.good else '*'}" for a, f in figures.items())
            say(f"  {pair.name} round {r} c={level}: tok/s {shown}; CPU {share:.0%}", quiet)
            if after_each is not None:
                after_each(run)


def run_pair(
    protocol: Protocol,
    pair: PairSpec,
    out_dir: Path,
    quiet: bool,
    reuse: Path | None = None,
    after_each: Callable[[PairRun], None] | None = None,
) -> PairRun:
    """A pair's calibration (or `reuse`'s file for it), then its plan measured on a fresh pair."""
    where = out_dir / pair.name
    where.mkdir(parents=True, exist_ok=True)
    if reuse is not None:
        calibration = reuse / pair.name / "calibration.json"
        if not calibration.is_file():
            raise ValueError(f"--calibrations: no {calibration}")
    else:
        calibration = calibrate_pair(protocol, pair, where, quiet)
    cal = load(str(calibration))
    run = PairRun(pair.name, (cal.high_watermark, cal.low_watermark))
    say(f"{pair.name}: calibrated watermarks {cal.high_watermark}/{cal.low_watermark}; measuring...", quiet)
    fleet, urls = fresh_start(functools.partial(start_arms, pair, calibration), quiet)
    try:
        asyncio.run(measure(protocol, pair, urls, run, quiet, after_each))
    finally:
        fleet.stop()
    return run
