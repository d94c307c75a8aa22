"""`python -m loadtest shift`: the prompt mix changes mid-run at a fixed concurrency (issue #13).

    python -m loadtest shift [--profile crossover] [--concurrency 10,30]
                             [--phases repetitive,diverse,repetitive] [--phase-s 60] [--settle-s 30]
                             [--time-scale 1] [--calibration FILE] [--out-dir shift-results]

At each concurrency level four targets run side by side, at the same time, each in front of a
fresh simulated pair of its own (`--shared-gpu --accept-from-prompt`, so a request's acceptance
follows how repetitive its prompt is): the speculative server alone, the baseline alone, specgate
with the static watermarks (SPECGATE_POLICY=threshold with the calibration's recommendation) and
specgate adaptive (SPECGATE_POLICY=adaptive with the calibration's curves). Load is closed-loop:
each of a target's `c` workers sends its next request when its last one ended, with prompts from
the current phase's source; phases switch at the same instants for all targets.

Without --calibration, a fresh simulated pair is calibrated first with diverse prompts
(`python -m loadtest calibrate --save OUT_DIR/calibration.json`).

Scoring. Each phase's first --settle-s seconds (after a shift, or the start) are not scored; over
the rest, each target's output tok/s counts the tokens produced inside that window
(stats.tokens_in_window), and a figure is inconclusive under the same rule as a sweep's level
(stats.min_ok_requests; client errors are never the server's), and is neither a miss nor a pass of
any target (report.target_verdict). Each specgate is compared with the better of the two servers
alone in that phase, and adaptive with static.

Settle time (after a shift, and from the start for the first phase): the earliest time t after the
phase began such that (a) every ROLLING_S (10 s at time scale 1) window starting at or after t and
ending by the phase's end has the specgate's tokens >= RATIO_TARGET (95%) of the better server's
tokens over the same window (the better of the two servers alone in that window), and (b) every
/routing sample from t to the phase's end shows the mode of the phase's better server. (b) is
waived when the two servers are within TIE (5%) of each other over the phase's scored part: then
either server meets the target, and hysteresis may rightly keep the one in use. None when no such
t leaves a full window before the phase ends ("not settled"). The mode settle time is (b) alone:
when the routing decision settled, whatever the throughput (probes, say, may still cost some).

The four targets run at once rather than one after another, so that they share the machine's
conditions (on shared CPUs those drift over minutes); the report gives the machine's CPU use and
warns when it was saturated, and the baseline alone against its profile (below 90%: the
simulators could not keep time).

Time: everything is in wall-clock seconds. With --time-scale T the simulators run T times faster,
so specgate's time settings are divided by T (its rates multiplied by T): specgate does not know
the time scale. The issue's targets (settled within 30 s at time scale 1) scale by 1/T likewise.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import itertools
import math
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from proxy import promtext
from proxy.calibration import CalibrationError
from proxy.calibration import load as load_calibration
from proxy.config import Settings

from .args import levels, positive
from .calibrate import EXIT_NO_RECOMMENDATION
from .client import RequestResult, Target, stream_request
from .procs import Proc, free_port, http_status, start
from .prompts import Prompt, source
from .report import fmt, target_verdict, write_json
from .stats import DEFAULT_MIN_REQUESTS, LevelStats, summarize
from .sweep import ERROR_BACKOFF_S, first_model, make_session

TARGETS = ("speculative", "baseline", "static", "adaptive")
SPECGATES = ("static", "adaptive")
SERVERS = ("speculative", "baseline")

RATIO_TARGET = 0.95  # a specgate's share of the better server's throughput, once settled
TIE = 0.05  # servers closer than this: either meets the target, so no mode is "the" right one
STEADY_TOLERANCE = 0.02  # without a shift: adaptive at most this far below static
SETTLE_TARGET_S = 30.0  # at time scale 1
ROLLING_S = 10.0  # window of the rolling throughput and of the settle test, at time scale 1
SAMPLE_S = 0.5  # /routing sampling period, at time scale 1
MIN_SAMPLE_S = 0.05  # ... but never faster than this in wall seconds
CPU_WARN_MEAN = 0.85  # machine CPU busy share over the run past which the figures are suspect
CPU_WARN_SATURATED = 0.10  # or this share of 1 s samples at >= CPU_SATURATED busy
CPU_SATURATED = 0.97
FIDELITY_WARN = 0.90  # the baseline alone below this share of its profile's throughput: CPU-starved
CALIBRATE_LEVELS = (1, 2, 5, 10, 20, 30, 50, 70)
CALIBRATE_DURATION_S = 30.0  # per level, at time scale 1
DRAIN_S = 120.0  # at time scale 1: how long the requests in flight at the end may take
# Specgate's time settings (seconds at time scale 1, divided by the time scale) and rates
# (multiplied by it); watermarks and probe tokens are counts and stay. Defaults: proxy/config.py.
SCALED_DOWN = ("min_dwell_s", "half_life_s", "probe_s", "probe_max_s")
SCALED_UP = ("max_step_per_s",)
UNSCALED = ("min_watermark", "max_watermark", "probe_tokens", "shadow_tokens")  # counts
ADAPTIVE_SETTINGS = SCALED_DOWN + SCALED_UP + UNSCALED
COUNTERS = ("specgate_mode_switches_total", "specgate_routing_decisions_total", "specgate_shadow_probes_total")


# ---------------------------------------------------------------------------------------------
# Settings


@dataclass(frozen=True)
class ShiftPlan:
    profile: str = "crossover"
    levels: tuple[int, ...] = (10, 30)
    phases: tuple[str, ...] = ("repetitive", "diverse", "repetitive")
    phase_s: float = 60.0
    settle_s: float = 30.0
    time_scale: float = 1.0
    max_tokens: int = 128
    seed: int = 0
    min_requests: int = DEFAULT_MIN_REQUESTS
    # Adaptive settings at time scale 1 that replace proxy/config.py's defaults (see ADAPTIVE_SETTINGS).
    adaptive: Mapping[str, float] = field(default_factory=dict)

    @property
    def rolling_s(self) -> float:
        return ROLLING_S / self.time_scale

    @property
    def sample_s(self) -> float:
        return max(SAMPLE_S / self.time_scale, MIN_SAMPLE_S)

    @property
    def settle_target_s(self) -> float:
        return SETTLE_TARGET_S / self.time_scale

    @property
    def shifting(self) -> bool:
        return len(set(self.phases)) > 1


def adaptive_settings(plan: ShiftPlan) -> dict[str, float]:
    """The adaptive settings at time scale 1: specgate's defaults, with the plan's overrides."""
    out: dict[str, float] = {}
    for name in ADAPTIVE_SETTINGS:
        default = Settings.model_fields[f"adaptive_{name}"].default
        out[name] = float(plan.adaptive.get(name, default))
    return out


def specgate_env(
    policy: str, spec_url: str, base_url: str, port: int, calibration: str, plan: ShiftPlan
) -> dict[str, str]:
    """Specgate's environment for one target, its time settings scaled to the simulators' clock."""
    fields = Settings.model_fields
    t = plan.time_scale
    env = {
        "SPECGATE_HOST": "127.0.0.1",
        "SPECGATE_PORT": str(port),
        "SPECGATE_SPECULATIVE_URL": spec_url,
        "SPECGATE_BASELINE_URL": base_url,
        "SPECGATE_POLICY": policy,
        "SPECGATE_CALIBRATION": calibration,
        "SPECGATE_LOG_LEVEL": "warning",
        # How often it reads acceptance and load, and when a frozen gauge means an idle server.
        "SPECGATE_HEALTH_INTERVAL_S": f"{fields['health_interval_s'].default / t:g}",
        "SPECGATE_ENGINE_STALE_S": f"{fields['engine_stale_s'].default / t:g}",
    }
    if policy == "adaptive":
        for name, value in adaptive_settings(plan).items():
            scaled = value / t if name in SCALED_DOWN else value * t if name in SCALED_UP else value
            env[f"SPECGATE_ADAPTIVE_{name.upper()}"] = f"{int(scaled)}" if name in UNSCALED else f"{scaled:g}"
    return env


# ---------------------------------------------------------------------------------------------
# Processes


def _pair_args(plan: ShiftPlan, spec_port: int, base_port: int) -> list[str]:
    return [
        "-m", "loadtest.simulator", "pair", "--profile", plan.profile, "--shared-gpu", "--accept-from-prompt",
        "--time-scale", f"{plan.time_scale:g}", "--speculative-port", str(spec_port),
        "--baseline-port", str(base_port), "--log-level", "warning",
    ]  # fmt: skip


def _wait_ready(pending: Sequence[tuple[Proc, str]], timeout_s: float = 60.0) -> None:
    """Wait until each URL answers 200; the processes start in parallel, so this costs the slowest."""
    deadline = time.monotonic() + timeout_s
    left = list(pending)
    while left:
        for proc, url in list(left):
            if not proc.alive():
                raise RuntimeError(f"{proc.name} exited with code {proc.popen.returncode} before it was ready")
            if http_status(url, timeout_s=1.0) == 200:
                left.remove((proc, url))
        if left and time.monotonic() > deadline:
            raise RuntimeError(f"{', '.join(p.name for p, _ in left)} not ready within {timeout_s:g} s")
        time.sleep(0.05)


@dataclass
class Running:
    """The processes of one level: a pair per target, a specgate in front of two of them."""

    urls: dict[str, str]
    pairs: dict[str, tuple[str, str]]
    procs: list[Proc] = field(default_factory=list)

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()


def start_targets(plan: ShiftPlan, calibration: str) -> Running:
    run = Running({}, {})
    try:
        waits: list[tuple[Proc, str]] = []
        for name in TARGETS:
            spec_port, base_port = free_port(), free_port()
            proc = start(f"simulators-{name}", _pair_args(plan, spec_port, base_port))
            run.procs.append(proc)
            spec, base = f"http://127.0.0.1:{spec_port}", f"http://127.0.0.1:{base_port}"
            run.pairs[name] = (spec, base)
            waits += [(proc, spec + "/health"), (proc, base + "/health")]
        _wait_ready(waits)
        waits = []
        for name in TARGETS:
            spec, base = run.pairs[name]
            if name in SERVERS:
                run.urls[name] = spec if name == "speculative" else base
                continue
            port = free_port()
            policy = "threshold" if name == "static" else "adaptive"
            env = specgate_env(policy, spec, base, port, calibration, plan)
            proc = start(f"specgate-{name}", ["-m", "proxy"], env=env)
            run.procs.append(proc)
            run.urls[name] = f"http://127.0.0.1:{port}"
            waits.append((proc, run.urls[name] + "/ready"))
        _wait_ready(waits)
    except BaseException:
        run.stop()
        raise
    return run


def calibrate_first(plan: ShiftPlan, out_dir: Path, quiet: bool) -> Path:
    """Calibrate a fresh simulated pair with diverse prompts; the file specgate will load."""
    levels = sorted({*CALIBRATE_LEVELS, *plan.levels})
    return calibrate_fresh_pair(
        lambda spec_port, base_port: _pair_args(plan, spec_port, base_port),
        levels,
        ["--seed", str(plan.seed), "--max-tokens", str(plan.max_tokens), "--min-requests", str(plan.min_requests)],
        CALIBRATE_DURATION_S / plan.time_scale,
        out_dir,
        quiet,
    )


def calibrate_fresh_pair(
    pair_args: Callable[[int, int], list[str]],
    levels: Sequence[int],
    extra: Sequence[str],
    duration_s: float,
    out_dir: Path,
    quiet: bool,
) -> Path:
    """Start a simulated pair (`pair_args(speculative_port, baseline_port)`), run `loadtest calibrate
    --save` on it with diverse prompts at `levels`, stop it; the calibration file's path. `extra`:
    more calibrate arguments (seed, tokens, minimum requests). Its output goes to calibration.txt."""
    spec_port, base_port = free_port(), free_port()
    spec, base = f"http://127.0.0.1:{spec_port}", f"http://127.0.0.1:{base_port}"
    pair = start("simulators-calibration", pair_args(spec_port, base_port))
    path = out_dir / "calibration.json"
    try:
        _wait_ready([(pair, spec + "/health"), (pair, base + "/health")])
        args = [
            sys.executable, "-m", "loadtest", "calibrate", "--speculative", spec, "--baseline", base,
            "--prompts", "diverse", "--concurrency", ",".join(map(str, levels)), "--duration-s", f"{duration_s:g}",
            *extra, "--save", str(path), "--out", str(out_dir / "calibration-sweep.json"), "--quiet",
        ]  # fmt: skip
        _say(f"calibrating a fresh pair with diverse prompts at {', '.join(map(str, levels))} streams...", quiet)
        done = subprocess.run(args, capture_output=True, text=True, check=False)
        (out_dir / "calibration.txt").write_text(done.stdout + done.stderr)
        if done.returncode == EXIT_NO_RECOMMENDATION:
            # Inconclusive levels left the crossover unknown: a scenario run on made-up watermarks
            # would measure nothing worth reporting.
            raise RuntimeError(
                f"calibrate could not bracket the crossover with conclusive levels, so there are no watermarks to "
                f"run with; see {out_dir / 'calibration.txt'}"
            )
        if done.returncode != 0 or not path.exists():
            raise RuntimeError(f"calibrate failed (exit {done.returncode}); see {out_dir / 'calibration.txt'}")
    finally:
        pair.stop()
    return path


# ---------------------------------------------------------------------------------------------
# Measuring


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


@dataclass(frozen=True)
class CpuUse:
    cores: int
    machine_busy_mean: float  # share of all cores busy over the load, whoever used them
    machine_busy_p95: float  # of 1 s samples
    saturated_share: float  # share of 1 s samples at >= CPU_SATURATED
    by_process_s: dict[str, float]  # CPU seconds over the level: load tester, simulators, specgates
    warning: str | None = None
    timeline: list[tuple[float, float]] = field(default_factory=list)  # (t, busy share over the last ~1 s)


def _proc_stat() -> tuple[float, float]:
    """(busy, total) jiffies of all cores, from /proc/stat; (0, 0) where there is none."""
    try:
        with open("/proc/stat") as f:
            parts = [float(x) for x in f.readline().split()[1:]]
    except OSError:
        return 0.0, 0.0
    idle = parts[3] + (parts[4] if len(parts) > 4 else 0.0)
    total = sum(parts[:8])
    return total - idle, total


def _self_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


@dataclass
class Capture:
    """What one level's run recorded, all times relative to `t0` (time.monotonic())."""

    t0: float
    results: dict[str, list[RequestResult]]
    routing: dict[str, list[RoutingSample]]
    # Specgate counters at each phase boundary (and the end): name -> value.
    counters: dict[str, list[dict[str, float]]]
    cpu_samples: list[tuple[float, float]]  # (t, busy share since the last sample)


async def _get_json(session: aiohttp.ClientSession, url: str) -> Any:
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=5)) as resp:
        return orjson.loads(await resp.read())


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


async def _counters(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """Mode switches, routing decisions by reason and shadow probes, from specgate's /metrics."""
    async with session.get(url + "/metrics", timeout=aiohttp.ClientTimeout(total=5)) as resp:
        text = await resp.text()
    out: dict[str, float] = {"switches": 0.0}
    for s in promtext.samples(text, COUNTERS):
        if s.name == "specgate_mode_switches_total":
            out["switches"] += s.value
        elif s.name == "specgate_routing_decisions_total":
            key = f"{s.labels.get('reason')}:{s.labels.get('backend')}"
            out[key] = out.get(key, 0.0) + s.value
        else:  # shadow probes too: copies, not requests
            key = f"probe:shadow-{s.labels.get('outcome')}"
            out[key] = out.get(key, 0.0) + s.value
    return out


async def run_load(plan: ShiftPlan, c: int, urls: Mapping[str, str], quiet: bool) -> Capture:
    """All four targets at once, closed-loop at `c` streams each, phases switched at shared instants."""
    n = len(plan.phases)
    async with make_session() as session:
        models = {name: await first_model(url, None) for name, url in urls.items()}
        targets = {name: Target(url, models[name], chat=True, max_tokens=plan.max_tokens) for name, url in urls.items()}
        # The same prompts in the same order for every target (each its own iterators).
        prompts: dict[str, list[Iterator[Prompt]]] = {
            name: [source(src, plan.seed + i) for i, src in enumerate(plan.phases)] for name in targets
        }
        cap = Capture(0.0, {name: [] for name in targets}, {g: [] for g in SPECGATES}, {g: [] for g in SPECGATES}, [])
        for g in SPECGATES:  # before any load: the counters' zero
            cap.counters[g].append(await _counters(session, urls[g]))
        t0 = cap.t0 = time.monotonic()
        end = t0 + n * plan.phase_s

        async def worker(name: str) -> None:
            while (now := time.monotonic()) < end:
                phase = min(int((now - t0) / plan.phase_s), n - 1)
                r = await stream_request(session, targets[name], next(prompts[name][phase]))
                cap.results[name].append(r)
                if not r.ok:
                    await asyncio.sleep(ERROR_BACKOFF_S)

        async def sampler() -> None:
            busy0, total0 = _proc_stat()
            cpu_at = time.monotonic()
            tick = 0
            while (now := time.monotonic()) < end:
                for g in SPECGATES:
                    with contextlib.suppress(aiohttp.ClientError, TimeoutError, KeyError, ValueError, TypeError):
                        data = await _get_json(session, urls[g] + "/routing")
                        cap.routing[g].append(routing_sample(data, time.monotonic() - t0))
                if now - cpu_at >= 1.0:
                    busy, total = _proc_stat()
                    if total > total0:
                        cap.cpu_samples.append((now - t0, (busy - busy0) / (total - total0)))
                    busy0, total0, cpu_at = busy, total, now
                tick += 1
                await asyncio.sleep(max(0.0, t0 + tick * plan.sample_s - time.monotonic()))

        async def boundaries() -> None:
            for i in range(1, n + 1):
                await asyncio.sleep(max(0.0, t0 + i * plan.phase_s - time.monotonic()))
                for g in SPECGATES:
                    try:
                        cap.counters[g].append(await _counters(session, urls[g]))
                    except (aiohttp.ClientError, TimeoutError, ValueError):
                        cap.counters[g].append({})
                if i < n:
                    _say(f"  c={c}: phase {i + 1}/{n} ({plan.phases[i]})", quiet)

        _say(f"  c={c}: phase 1/{n} ({plan.phases[0]})", quiet)
        workers = [asyncio.create_task(worker(name)) for name in targets for _ in range(c)]
        side = [asyncio.create_task(sampler()), asyncio.create_task(boundaries())]
        await asyncio.gather(*side)
        # The requests in flight at the end finish, so each one's usage (its tokens) is known.
        _, pending = await asyncio.wait(workers, timeout=DRAIN_S / plan.time_scale + 10.0)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    return cap


# ---------------------------------------------------------------------------------------------
# Scoring


class Tokens:
    """A target's output tokens over time: each request's tokens spread over its text chunks."""

    def __init__(self, results: Sequence[RequestResult], t0: float) -> None:
        points = sorted(
            (t - t0, r.output_tokens / len(r.chunk_times))
            for r in results
            if r.ok and r.chunk_times
            for t in r.chunk_times
        )
        self.times = [t for t, _ in points]
        self.cum = [0.0, *itertools.accumulate(w for _, w in points)]

    def between(self, a: float, b: float) -> float:
        """Tokens produced in [a, b] (as stats.tokens_in_window counts them)."""
        return self.cum[bisect.bisect_right(self.times, b)] - self.cum[bisect.bisect_left(self.times, a)]

    def rate(self, a: float, b: float) -> float:
        return self.between(a, b) / (b - a) if b > a else math.nan


@dataclass(frozen=True)
class PhaseReport:
    index: int
    source: str
    start_s: float
    end_s: float
    scored_from_s: float
    stats: dict[str, LevelStats]
    better: str | None  # the better of the two servers alone over the scored part
    tie: bool  # the two servers within TIE of each other: either meets the target
    vs_better: dict[str, float]  # each specgate's throughput over the better server's
    adaptive_vs_static: float
    conclusive: bool
    settle_s: dict[str, float | None]  # per specgate, from the phase's start; None: not settled
    # Per specgate: from the phase's start until its mode stayed the better server's to the end
    # (the routing decision alone, whatever the throughput); None: never, or the servers tie.
    mode_settle_s: dict[str, float | None]
    switches: dict[str, int | None]  # per specgate, mode switches inside the phase (None: unread)
    probes: int | None  # adaptive's probes inside the phase
    dwell_holds: int | None
    mode_at_end: dict[str, str | None]
    baseline_fidelity: float  # the baseline alone over its profile's throughput (time-scaled)


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 and not math.isnan(a) else math.nan


def settle_time(
    start: float,
    end: float,
    gate: Tokens,
    spec: Tokens,
    base: Tokens,
    modes: Sequence[RoutingSample],
    better: str | None,
    tie: bool,
    window: float,
    step: float,
) -> float | None:
    """Seconds from `start` until the specgate settled (see the module docstring), or None."""
    last = end - window
    if last < start:
        return None
    n = int((last - start) / step + 1e-9)
    starts = [start + k * step for k in range(n + 1)]
    earliest = start
    if not tie:
        if better is None:
            return None
        wrong = [s.t for s in modes if start <= s.t < end and s.mode != better]
        if wrong:
            later = [s.t for s in modes if max(wrong) < s.t < end]
            if not later:
                return None
            earliest = min(later)
    settled: float | None = None
    for s in reversed(starts):
        best = max(spec.between(s, s + window), base.between(s, s + window))
        if gate.between(s, s + window) < RATIO_TARGET * best:
            break
        settled = s
    if settled is None:
        return None
    t = max(settled, earliest)
    return None if t > last else t - start


def mode_settle_time(start: float, end: float, modes: Sequence[RoutingSample], better: str) -> float | None:
    """Seconds from `start` to the first /routing sample from which the mode is `better` to the end."""
    inside = [s for s in modes if start <= s.t < end]
    settled: float | None = None
    for s in reversed(inside):
        if s.mode != better:
            break
        settled = s.t - start
    return settled


def _delta(counters: Sequence[Mapping[str, float]], i: int, pick: str) -> int | None:
    """A counter's increase across phase i (boundaries i and i + 1); `pick` a key or a key suffix."""
    if i + 1 >= len(counters) or not counters[i] or not counters[i + 1]:
        return None

    def total(c: Mapping[str, float]) -> float:
        return sum(v for k, v in c.items() if k == pick or k.startswith(pick + ":"))

    return round(total(counters[i + 1]) - total(counters[i]))


def score_level(plan: ShiftPlan, c: int, cap: Capture) -> list[PhaseReport]:
    from .simulator.profile import load_profile

    profile = load_profile(plan.profile)
    expected_base = profile.throughput("baseline", c) * plan.time_scale
    tokens = {name: Tokens(rs, cap.t0) for name, rs in cap.results.items()}
    out: list[PhaseReport] = []
    for i, src in enumerate(plan.phases):
        start, end = i * plan.phase_s, (i + 1) * plan.phase_s
        w0 = start + plan.settle_s
        stats = {
            name: summarize(c, rs, cap.t0 + w0, cap.t0 + end, plan.min_requests) for name, rs in cap.results.items()
        }
        s, b = stats["speculative"].output_tok_s, stats["baseline"].output_tok_s
        servers_ok = stats["speculative"].conclusive and stats["baseline"].conclusive
        better = None if not servers_ok or (s <= 0 and b <= 0) else ("speculative" if s >= b else "baseline")
        best = max(s, b)
        tie = servers_ok and best > 0 and abs(s - b) / best <= TIE
        vs_better = {g: _ratio(stats[g].output_tok_s, best) for g in SPECGATES}
        settle = {
            g: settle_time(start, end, tokens[g], tokens["speculative"], tokens["baseline"], cap.routing[g],
                           better, tie, plan.rolling_s, plan.sample_s)
            for g in SPECGATES
        }  # fmt: skip
        mode_at_end: dict[str, str | None] = {}
        for g in SPECGATES:
            inside = [smp for smp in cap.routing[g] if start <= smp.t < end]
            mode_at_end[g] = inside[-1].mode if inside else None
        out.append(
            PhaseReport(
                index=i,
                source=src,
                start_s=start,
                end_s=end,
                scored_from_s=w0,
                stats=stats,
                better=better,
                tie=tie,
                vs_better=vs_better,
                adaptive_vs_static=_ratio(stats["adaptive"].output_tok_s, stats["static"].output_tok_s),
                conclusive=all(st.conclusive for st in stats.values()),
                settle_s=settle,
                mode_settle_s={
                    g: None if better is None or tie else mode_settle_time(start, end, cap.routing[g], better)
                    for g in SPECGATES
                },
                switches={g: _delta(cap.counters[g], i, "switches") for g in SPECGATES},
                probes=_delta(cap.counters["adaptive"], i, "probe"),
                dwell_holds=_delta(cap.counters["adaptive"], i, "dwell_hold"),
                mode_at_end=mode_at_end,
                baseline_fidelity=_ratio(b, expected_base),
            )
        )
    return out


def cpu_use(cap: Capture, procs: Sequence[Proc], self_cpu_s: float) -> CpuUse:
    shares = sorted(share for _, share in cap.cpu_samples)
    mean = sum(shares) / len(shares) if shares else math.nan
    p95 = shares[min(len(shares) - 1, int(0.95 * len(shares)))] if shares else math.nan
    saturated = sum(1 for x in shares if x >= CPU_SATURATED) / len(shares) if shares else math.nan
    by: dict[str, float] = {"load tester": round(self_cpu_s, 1)}
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
    timeline = [(round(t, 2), round(share, 3)) for t, share in cap.cpu_samples]
    return CpuUse(os.cpu_count() or 1, mean, p95, saturated, by, warning, timeline)


@dataclass(frozen=True)
class LevelReport:
    concurrency: int
    phases: list[PhaseReport]
    routing: dict[str, list[RoutingSample]]
    rolling: dict[str, list[tuple[float, float]]]  # per target: (t, tok/s over the ROLLING_S before t)
    cpu: CpuUse
    errors: dict[str, int]
    client_errors: dict[str, int]


def rolling_series(cap: Capture, plan: ShiftPlan) -> dict[str, list[tuple[float, float]]]:
    total = len(plan.phases) * plan.phase_s
    step = max(plan.sample_s, total / 600)
    out: dict[str, list[tuple[float, float]]] = {}
    for name, rs in cap.results.items():
        tok = Tokens(rs, cap.t0)
        points = []
        t = plan.rolling_s
        while t <= total + 1e-9:
            points.append((round(t, 3), round(tok.rate(t - plan.rolling_s, t), 1)))
            t += step
        out[name] = points
    return out


# ---------------------------------------------------------------------------------------------
# Report


def level_table(plan: ShiftPlan, levels: Sequence[LevelReport]) -> str:
    head = (
        f"{'c':>4} {'phase':<14} {'spec':>8} {'base':>8} {'static':>8} {'adaptive':>8} "
        f"{'static/better':>13} {'adapt/better':>12} {'adapt/static':>12} {'settle s':>8} {'mode s':>6} "
        f"{'switch a/s':>10} {'probes':>6} {'mode at end a/s':>22}"
    )
    lines = [head, "-" * len(head)]
    for lv in levels:
        for p in lv.phases:
            star = "" if p.conclusive else "*"

            def tput(name: str, p: PhaseReport = p) -> str:
                st = p.stats[name]
                return fmt(st.output_tok_s, 0) + ("" if st.conclusive else "*")

            settle = p.settle_s["adaptive"]
            settle_txt = "never" if settle is None else fmt(settle)
            mode_s = p.mode_settle_s["adaptive"]
            mode_txt = "-" if p.tie or p.better is None else "never" if mode_s is None else fmt(mode_s)
            sw = "/".join("-" if p.switches[g] is None else str(p.switches[g]) for g in ("adaptive", "static"))
            modes = "/".join(p.mode_at_end[g] or "-" for g in ("adaptive", "static"))
            better = {"speculative": "s", "baseline": "b"}.get(p.better or "", "?") + ("~" if p.tie else "")
            lines.append(
                f"{lv.concurrency:>4} {f'{p.index + 1} {p.source}':<14} {tput('speculative'):>8} "
                f"{tput('baseline'):>8} {tput('static'):>8} {tput('adaptive'):>8} "
                f"{fmt(p.vs_better['static'], 3) + star:>13} {fmt(p.vs_better['adaptive'], 3) + star:>12} "
                f"{fmt(p.adaptive_vs_static, 3) + star:>12} {settle_txt:>8} {mode_txt:>6} {sw:>10} "
                f"{'-' if p.probes is None else p.probes:>6} {modes:>22}  better: {better}"
            )
    lines.append(
        f"(output tok/s over each phase's scored part, after its first {plan.settle_s:g} s; * inconclusive: too "
        "few good requests; better: s speculative, b baseline, ~ within 5% of each other; settle s: adaptive's, "
        f"from the phase's start (the first phase: the run's), until every later {plan.rolling_s:g} s window has "
        f">= {RATIO_TARGET:.0%} of the better server's tokens and the mode stays the better server's (not "
        "checked when they tie); mode s: until the mode stays the better server's, whatever the throughput; "
        "switch a/s: mode switches of adaptive and static in the phase; probes: adaptive's, requests and shadow copies)"
    )
    return "\n".join(lines)


def _within(x: float | None, limit: float) -> bool:
    return x is not None and x <= limit


def _settle_text(x: float | None) -> str:
    return "never" if x is None else f"{x:.1f} s"


def verdicts(plan: ShiftPlan, levels: Sequence[LevelReport]) -> list[str]:
    """The issue's targets, each with the figures that decide it. A throughput figure from a phase
    with too few good requests is no evidence: such a phase is neither a miss nor a pass."""
    phases = [(lv.concurrency, p) for lv in levels for p in lv.phases]
    shifts = [(c, p) for c, p in phases if p.index > 0]
    measured = [(c, p) for c, p in phases if p.conclusive]

    def where(c: int, p: PhaseReport) -> str:
        return f"c={c} phase {p.index + 1} ({p.source})"

    incon = [where(c, p) for c, p in phases if not p.conclusive]
    low = [
        f"{where(c, p)}: {fmt(p.vs_better['adaptive'], 3)}"
        for c, p in measured
        if not p.vs_better["adaptive"] >= RATIO_TARGET
    ]
    lines = [
        target_verdict(
            f"adaptive >= {RATIO_TARGET}x the better server in every phase once settled", low, incon, len(measured)
        )
    ]
    if plan.shifting:
        target = plan.settle_target_s
        # Which server was better, and so when the adaptive settled, is unknown in an inconclusive phase.
        scored = [(c, p) for c, p in shifts if p.conclusive]
        late = [
            f"{where(c, p)}: {_settle_text(p.settle_s['adaptive'])}"
            for c, p in scored
            if not _within(p.settle_s["adaptive"], target)
        ]
        scale = f", here {plan.time_scale:g}" if plan.time_scale != 1 else ""
        label = f"adaptive settled within {target:g} s of every shift ({SETTLE_TARGET_S:g} s at time scale 1{scale})"
        unsettled = [where(c, p) for c, p in shifts if not p.conclusive]
        lines.append(target_verdict(label, late, unsettled, len(scored)))
        many = [f"{where(c, p)}: {p.switches['adaptive']}" for c, p in shifts if (p.switches["adaptive"] or 0) > 1]
        lines.append(target_verdict("adaptive at most one mode switch per shift", many, [], len(shifts)))
        cold = [
            f"c={c}: settled {_settle_text(p.settle_s['adaptive'])} from the start, {p.switches['adaptive']} switches"
            for c, p in phases
            if p.index == 0
        ]
        lines.append("(first phase, a cold start rather than a shift: " + "; ".join(cold) + ")")
    else:
        # Traffic that does not shift: adaptive should cost nothing against the static watermarks.
        # Above static is no miss: static's watermarks may have been measured on other prompts.
        off = [
            f"{where(c, p)}: {fmt(p.adaptive_vs_static, 3)}"
            for c, p in measured
            if not p.adaptive_vs_static >= 1.0 - STEADY_TOLERANCE
        ]
        label = f"adaptive within {STEADY_TOLERANCE:.0%} of static (or above it) on traffic that does not shift"
        lines.append(target_verdict(label, off, incon, len(measured)))
    if incon:
        lines.append("* inconclusive (too few good requests on some target): " + "; ".join(incon))
    return lines


def warnings(levels: Sequence[LevelReport]) -> list[str]:
    out = []
    for lv in levels:
        if lv.cpu.warning:
            out.append(f"warning: c={lv.concurrency}: {lv.cpu.warning}")
        slow = [p for p in lv.phases if p.baseline_fidelity < FIDELITY_WARN]
        if slow:
            worst = min(p.baseline_fidelity for p in slow)
            out.append(
                f"warning: c={lv.concurrency}: the baseline alone reached only {worst:.0%} of its profile's "
                "throughput: the simulators could not keep time (CPU)"
            )
        if any(lv.errors.values()):
            out.append(f"warning: c={lv.concurrency}: server errors {lv.errors}")
        if any(lv.client_errors.values()):
            out.append(f"note: c={lv.concurrency}: client errors (not the servers') {lv.client_errors}")
    return out


def cpu_lines(levels: Sequence[LevelReport]) -> list[str]:
    out = []
    for lv in levels:
        u = lv.cpu
        procs = ", ".join(f"{k} {v:g} s" for k, v in u.by_process_s.items())
        out.append(
            f"CPU c={lv.concurrency}: machine {fmt(u.machine_busy_mean * 100, 0)}% busy on average "
            f"(p95 {fmt(u.machine_busy_p95 * 100, 0)}%, {u.cores} cores); CPU time: {procs}"
        )
    return out


def plot_shift(path: str | Path, plan: ShiftPlan, levels: Sequence[LevelReport]) -> None:
    """Per level: load, watermarks, crossover estimate and mode of both specgates; rolling throughput."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - a dependency of the loadtest extra
        raise SystemExit("plotting needs matplotlib: pip install 'specgate[loadtest]'") from exc
    rows = len(levels)
    fig, axes = plt.subplots(rows, 2, figsize=(17, 4.8 * rows), squeeze=False, constrained_layout=True)
    style = {
        "speculative": ("tab:orange", "--", 1.4),
        "baseline": ("tab:blue", "--", 1.4),
        "static": ("tab:gray", "-", 1.8),
        "adaptive": ("tab:green", "-", 2.4),
    }
    mode_colour = {"speculative": "tab:orange", "baseline": "tab:blue"}
    for row, lv in zip(axes, levels, strict=True):
        left, right = row
        for g, colour in (("static", "tab:gray"), ("adaptive", "tab:green")):
            smp = lv.routing[g]
            ts = [s.t for s in smp]
            left.step(ts, [s.load for s in smp], where="post", color=colour, lw=1.0, alpha=0.7, label=f"{g} load")
            left.step(ts, [s.high for s in smp], where="post", color=colour, ls="--", lw=1.8, label=f"{g} high")
            left.step(ts, [s.low for s in smp], where="post", color=colour, ls=":", lw=1.8, label=f"{g} low")
            # The mode as a strip along the top: orange speculative, blue baseline.
            y0 = 0.955 if g == "adaptive" else 0.915
            for a, b in itertools.pairwise([*smp, None]):
                if a is None:
                    continue
                t1 = b.t if b is not None else a.t + plan.sample_s
                left.axvspan(a.t, t1, ymin=y0, ymax=y0 + 0.035, color=mode_colour.get(a.mode, "k"), lw=0)
            left.text(0.002, y0 + 0.005, f"{g} mode", transform=left.transAxes, fontsize=7, va="bottom")
        smp = lv.routing["adaptive"]
        cross = [(s.t, s.crossover) for s in smp if s.crossover is not None]
        if cross:
            left.plot([t for t, _ in cross], [x for _, x in cross], color="tab:red", ls="-.", lw=1.2,
                      label="adaptive crossover estimate")  # fmt: skip
        left.set_ylabel("streams")
        left.set_title(f"c={lv.concurrency}: load, watermarks and mode (strips: orange speculative, blue baseline)")
        for name, points in lv.rolling.items():
            colour, ls, lw = style[name]
            right.plot([t for t, _ in points], [v for _, v in points], ls, color=colour, lw=lw, label=name)
        for p in lv.phases:
            settle = p.settle_s["adaptive"]
            if settle is not None:
                right.axvline(p.start_s + settle, color="tab:green", ls=":", lw=1.0)
        right.set_ylabel(f"output tok/s (trailing {plan.rolling_s:g} s)")
        right.set_title(f"c={lv.concurrency}: throughput of the four targets (dotted green: adaptive settled)")
        for ax in row:
            for p in lv.phases:
                ax.axvline(p.start_s, color="k", lw=0.8)
                ax.axvspan(p.start_s, p.scored_from_s, color="0.92", zorder=0)
                ax.text(p.start_s + 0.01 * plan.phase_s, 0.86, p.source, transform=ax.get_xaxis_transform(),
                        fontsize=9)  # fmt: skip
            ax.set_xlabel("seconds" + (f" (time scale {plan.time_scale:g})" if plan.time_scale != 1 else ""))
            ax.set_xlim(0, len(plan.phases) * plan.phase_s)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7, loc="lower right")
            ax.set_ylim(bottom=0, top=ax.get_ylim()[1] * 1.15)
    fig.suptitle(
        f"shift: {plan.profile} profile, prompts {' -> '.join(plan.phases)}, {plan.phase_s:g} s a phase "
        f"(grey: not scored)"
    )
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# Command


def _say(text: str, quiet: bool) -> None:
    if not quiet:
        print(text, file=sys.stderr, flush=True)


def run_level(plan: ShiftPlan, c: int, calibration: str, quiet: bool) -> LevelReport:
    _say(f"c={c}: starting four simulated pairs and two specgates...", quiet)
    running = start_targets(plan, calibration)
    try:
        cpu0 = _self_cpu_s()
        cap = asyncio.run(run_load(plan, c, running.urls, quiet))
        cpu = cpu_use(cap, running.procs, _self_cpu_s() - cpu0)
    finally:
        running.stop()
    return LevelReport(
        concurrency=c,
        phases=score_level(plan, c, cap),
        routing=cap.routing,
        rolling=rolling_series(cap, plan),
        cpu=cpu,
        errors={n: sum(1 for r in rs if not r.ok and not r.client_error) for n, rs in cap.results.items()},
        client_errors={n: sum(1 for r in rs if r.client_error) for n, rs in cap.results.items()},
    )


def run_shift(plan: ShiftPlan, out_dir: Path, calibration: str | None, quiet: bool) -> dict[str, Any]:
    out_dir.mkdir(parents=True, exist_ok=True)
    cal = Path(calibration) if calibration else calibrate_first(plan, out_dir, quiet)
    try:
        cal_data = load_calibration(str(cal))
    except CalibrationError as exc:
        raise ValueError(f"--calibration: {exc}") from None
    _say(
        f"calibration {cal}: static watermarks high={cal_data.high_watermark} low={cal_data.low_watermark} "
        f"({cal_data.verdict}); acceptance {fmt(cal_data.accept_length or math.nan, 2)}",
        quiet,
    )
    levels = [run_level(plan, c, str(cal), quiet) for c in plan.levels]
    settings = {
        **{k: v for k, v in vars(plan).items() if k != "adaptive"},
        "adaptive_settings_at_time_scale_1": adaptive_settings(plan),
        "specgate_env": {
            g: {k: v for k, v in specgate_env(p, "URL", "URL", 0, str(cal), plan).items() if "URL" not in v}
            for g, p in (("static", "threshold"), ("adaptive", "adaptive"))
        },
        "rolling_s": plan.rolling_s,
        "sample_s": plan.sample_s,
        "settle_target_s": plan.settle_target_s,
        "ratio_target": RATIO_TARGET,
        "tie": TIE,
    }
    return {
        "settings": settings,
        "calibration": {
            "path": str(cal),
            "high_watermark": cal_data.high_watermark,
            "low_watermark": cal_data.low_watermark,
            "verdict": cal_data.verdict,
            "accept_length": cal_data.accept_length,
        },
        "levels": levels,
        "verdicts": verdicts(plan, levels),
        "warnings": warnings(levels),
    }


def _levels(raw: str) -> tuple[int, ...]:
    return tuple(levels(raw))


def _phases(raw: str) -> tuple[str, ...]:
    phases = tuple(x.strip() for x in raw.split(",") if x.strip())
    if not phases:
        raise argparse.ArgumentTypeError("name at least one prompt source")
    for p in phases:
        try:
            next(source(p, 0))
        except (ValueError, OSError) as exc:
            raise argparse.ArgumentTypeError(f"{p!r}: {exc}") from None
    return phases


def _setting(raw: str) -> tuple[str, float]:
    name, sep, value = raw.partition("=")
    name = name.strip().lower().removeprefix("specgate_adaptive_").removeprefix("adaptive_")
    if not sep or name not in ADAPTIVE_SETTINGS:
        raise argparse.ArgumentTypeError(f"{raw!r}: expected NAME=VALUE, NAME one of {', '.join(ADAPTIVE_SETTINGS)}")
    try:
        return name, float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{raw!r}: {value!r} is not a number") from None


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "shift",
        help="the prompt mix changes mid-run: both servers, specgate static and adaptive side by side",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--profile", default="crossover", help="simulator profile (default crossover)")
    p.add_argument("--concurrency", type=_levels, default=(10, 30), help="comma list of levels (default 10,30)")
    p.add_argument(
        "--phases",
        type=_phases,
        default=("repetitive", "diverse", "repetitive"),
        help="comma list of prompt sources, one a phase (default repetitive,diverse,repetitive; one source: "
        "steady traffic, adaptive against static)",
    )
    p.add_argument("--phase-s", type=positive, default=60.0, help="seconds a phase (default 60)")
    p.add_argument(
        "--settle-s",
        type=float,
        default=30.0,
        help="seconds at the start of each phase that are not scored (default 30)",
    )
    p.add_argument("--time-scale", type=positive, default=1.0, help="simulators' time scale (default 1)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument(
        "--calibration",
        default=None,
        metavar="FILE",
        help="calibration specgate loads (default: calibrate a fresh simulated pair with diverse prompts first, "
        "saved to OUT_DIR/calibration.json)",
    )
    p.add_argument(
        "--adaptive-setting",
        type=_setting,
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help=f"an adaptive setting at time scale 1 (scaled like the defaults), e.g. probe_max_s=20; NAME one "
        f"of {', '.join(ADAPTIVE_SETTINGS)} (repeatable)",
    )
    p.add_argument(
        "--min-requests",
        type=int,
        default=DEFAULT_MIN_REQUESTS,
        help=f"good requests a phase's scored part needs per target (default {DEFAULT_MIN_REQUESTS})",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts")
    p.add_argument("--out-dir", default="shift-results")
    p.add_argument("--quiet", action="store_true", help="no progress lines")


def plan_of(args: argparse.Namespace) -> ShiftPlan:
    if not 0 <= args.settle_s < args.phase_s:
        raise ValueError(f"--settle-s {args.settle_s:g} must be in [0, --phase-s {args.phase_s:g})")
    if args.max_tokens < 2:
        raise ValueError("--max-tokens must be at least 2")
    return ShiftPlan(
        profile=args.profile,
        levels=args.concurrency,
        phases=args.phases,
        phase_s=args.phase_s,
        settle_s=args.settle_s,
        time_scale=args.time_scale,
        max_tokens=args.max_tokens,
        seed=args.seed,
        min_requests=args.min_requests,
        adaptive=dict(args.adaptive_setting),
    )


def cmd_shift(args: argparse.Namespace) -> int:
    try:
        plan = plan_of(args)
        from .simulator.profile import ProfileError, load_profile

        try:
            load_profile(plan.profile)
        except ProfileError as exc:
            raise ValueError(f"--profile: {exc}") from None
        out_dir = Path(args.out_dir)
        started = time.monotonic()
        report = run_shift(plan, out_dir, args.calibration, args.quiet)
    except ValueError as exc:
        print(f"loadtest: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    levels: list[LevelReport] = report["levels"]
    print(
        f"shift: {plan.profile} profile, prompts {' -> '.join(plan.phases)}, {plan.phase_s:g} s a phase, "
        f"time scale {plan.time_scale:g}, {plan.max_tokens} tokens a request"
    )
    print(level_table(plan, levels))
    print()
    for line in report["verdicts"]:
        print(line)
    for line in cpu_lines(levels):
        print(line)
    for line in report["warnings"]:
        print(line)
    plot = out_dir / "shift.png"
    plot_shift(plot, plan, levels)
    write_json(out_dir / "shift.json", report)
    print(f"\nplot: {plot}   data: {out_dir / 'shift.json'}   ({time.monotonic() - started:.0f} s)")
    return 0


# Public names of the helpers that other scenarios starting processes side by side use too (scaleout.py).
wait_ready = _wait_ready
proc_stat = _proc_stat
self_cpu_s = _self_cpu_s
say = _say
ratio = _ratio
