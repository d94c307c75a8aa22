"""`python -m loadtest headtohead-classes`: two traffic classes on one simulated H200 shared by a pair
(issue 28's targets), every target a fresh stack of its own on the same simulated hardware.

    python -m loadtest headtohead-classes [--contexts 1k,8k] [--sessions 8,32,128] [--out-dir DIR]

Traffic: multi-turn sessions (headtohead's sizes: plan.sizes_for), half of them of class A, whose
user messages are varied prose quoting a seventh of itself (`mixed`: about 1.3 tokens accepted a
step), half of class B, whose messages quote one piece of code over and over (`repetitive`: about
3.0). Stream i's sessions are all of class A (i even) or B (i odd). Every request carries
`x-specgate-class` and `x-session-id`. The servers are `pair --shared-gpu` simulators
(`--profile h200-llama8b --enable-cache-report --accept-from-prompt --max-accept-length 3.2`),
one pair per target:

  all-spec   every request straight to the pair's speculative server;
  all-base   every request straight to the pair's baseline server;
  threshold  specgate SPECGATE_POLICY=threshold, with classes and cache affinity off
             (SPECGATE_CLASS_KEY=none, SPECGATE_AFFINITY_ENTRIES=0): specgate before issue 28;
  adaptive   the same with SPECGATE_POLICY=adaptive;
  features   SPECGATE_POLICY=adaptive with classes (x-specgate-class) and cache affinity on;
  split      with both classes: class B straight to the speculative server, class A to the baseline
             (the static split by class, measured rather than assumed);
  smg        with --smg BINARY: SGLang's gateway (`smg launch --policy cache_aware`) in front of the
             pair, both servers as plain workers (its hit rate beside specgate's).
  oracle     with --oracle: the issue's oracle, every session on one server of its pair for all its
             turns (each server given as many sessions of each class), straight: its hit rate
             measured, evictions and all.

With --fixed-through specgate, all-spec, all-base and each class of the split reach their server
through a specgate pinned to it (the other role a closed port), paying the hop the specgates pay,
and base-direct, the baseline server straight, runs beside them: all-base / base-direct is the hop.

specgate's watermarks and curves come from a fresh pair calibrated per context with the same two
classes (`loadtest calibrate --save`, no think time) at 4, 16, 64 and 256 streams, up to the first
that reaches the top --sessions, so that the crossover is bracketed; so does each class's
acceptance (the file's `classes`). Scoring per cell, in simulated time: goodput
(requests finishing in the window within --slo-ttft-ms 1000 and --slo-tpot-ms 50), each specgate
variant's over the better of all-spec and all-base, each class's goodput, the prefix-cache hit rate
(cached_tokens) and the oracle's (`oracle_hit_rate`: every turn back on the server of its last turn,
nothing evicted; where neither fixed target met the SLOs, the pools overflow and that cannot hold,
so there the target is judged against the best oracle routing measured, with --oracle: all-spec,
all-base and oracle, each held to its own estimate; without --oracle the hit verdict is unknown).
Targets (issue 28): >= 1.10x where the classes should be split (class B has more
goodput on all-spec and class A on all-base, each beyond 5%, and the measured split has more goodput
than the better of all-spec and all-base, beyond 5%), >= 0.97x in every cell, hit rate within 5
points of the oracle. An inconclusive figure is unknown, never a pass or a fail. With --repeats N
each cell runs N times on sessions drawn from N seeds, and its verdict is the runs' where they all
agree; else, with 8 runs or more, their pooled ratio's (met where its 90% bootstrap interval
clears the target, missed where it falls short, whether to split judged on the runs pooled), else
unknown. --gates features leaves the other specgates out, for many repeats.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import json
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..args import count, level_tuple, names, non_negative, positive
from ..classes import Slo, summarise_class
from ..client import RequestResult
from ..kit.command import add_run_options, check_max_tokens, say
from ..kit.processes import Fleet, at_time_scale, calibrate_fresh_pair, calibrate_options, fresh_start
from ..kit.sampling import cpu_use, self_cpu_s
from ..kit.settings import specgate_env
from ..procs import free_port, pair_args
from ..report import fmt, write_json
from ..stats import DEFAULT_MIN_REQUESTS
from ..workload import TrafficClass, WorkloadSpec
from .plan import (
    CALIBRATE_LEVELS,
    MAX_TIME_SCALE,
    PROFILE,
    check_stagger,
    context_label,
    context_list,
    default_time_scale,
    sizes_for,
)
from .run import Servers, measure_cell
from .score import NO_GOODPUT, TIE, TargetCell, target_cell

# Beside calibration.json: the time scale its simulators ran at.
SCALE_FILE = "time-scale.json"
GATES = ("threshold", "adaptive", "features")
FIXED = ("all-spec", "all-base")
# The static split: each class straight to the server its acceptance suits.
SPLIT = "split"
# With --control: a second `features`. Its goodput over features' is what that target moves from a
# copy of itself in the same run: the run's noise, which a ratio must clear its target by. A copy
# of a fixed target moves less (2-3% at 8k/32 on the pair, where two runs of one specgate moved
# 0.78-1.06x): a switch sends every conversation elsewhere at a moment timing decides.
CONTROL = "control"
NOISE_OF = "features"
SPLIT_ROLES = {"A": "baseline", "B": "speculative"}
# With --oracle: the oracle run beside the others, every session kept on one server of a pair
# of its own for all its turns (each server given as many sessions of each class), straight. Its hit
# rate is what an oracle finds where the pools overflow and evict, which oracle_hit_rate's (nothing
# evicted) cannot show: hit_verdict's measure there.
ORACLE = "oracle"
# The targets that send every turn back to the server of its session's turn before, each from first
# placements of its own: the oracle's routing (all-spec and all-base have one server each).
STICKY = (*FIXED, ORACLE)
ROLES = ("speculative", "baseline")
# With --fixed-through specgate: the role each fixed target's gate is pinned to.
PINNED = (("all-spec", "speculative"), ("all-base", "baseline"))
# --fixed-through specgate: each fixed target (and each class of the split) reaches its server through
# a specgate pinned to that server's role, so that the fixed choices pay the same hop as the
# specgates they are compared with; and this target, the pair's baseline server straight, beside
# them: how much the hop itself costs (gated all-base over it).
DIRECT = "base-direct"
FIXED_THROUGH = ("direct", "specgate")
# Both watermarks of a gate pinned to the speculative server: a load no cell reaches.
PINNED_SPECULATIVE = 100_000
CLASSES = (TrafficClass("A", 0.5, "mixed"), TrafficClass("B", 0.5, "repetitive"))
# The targets.
SPLIT_GAIN = 1.10
FLOOR = 0.97
HIT_POINTS = 0.05
# goodput_verdict's verdicts where neither fixed target met the SLOs, judged on output tokens a second: counted
# apart from the goodput target's own.
ON_TOK_S = " on tok/s"
# Where a cell's runs disagree, at least this many runs let their pooled ratio decide: met where
# the lower end of its CONFIDENCE interval (resampling the runs, RESAMPLES times) clears the
# target, missed where the upper end is short of it.
POOLED_MIN_RUNS = 8
# ...and only where at most this share of them is inconclusive for the target or a fixed one: a
# stack too slow to finish enough requests is the likeliest to have missed, and pooling the rest
# would leave it out.
POOLED_MAX_UNKNOWN = 0.10
CONFIDENCE = 0.90
RESAMPLES = 2000
# The simulator's prefix cache keeps whole pages of this many tokens (radix.py's default).
PAGE_TOKENS = 16
# smg's metrics would default to port 29000; a worker's health is checked this often (s).
SMG_CHECK_S = 1


@dataclass(frozen=True)
class ClassPlan:
    contexts: tuple[int, ...] = (1000, 8000)
    sessions: tuple[int, ...] = (8, 32, 128)
    turns: int = 4
    max_tokens: int = 128
    think_time_s: float = 0.5  # simulated
    # Each stream's first session starts this far in at most (a uniform draw), so the window sees
    # conversations at every turn, not 32 opened at once and turning in step.
    stagger_s: float = 20.0  # simulated
    window_s: float = 6.0  # simulated
    max_window_s: float = 60.0  # simulated
    slo_ttft_ms: float = 1000.0  # simulated
    slo_tpot_ms: float = 50.0  # simulated
    spec_steps: int = 3
    max_accept_length: float = 3.2
    seed: int = 0
    min_requests: int = DEFAULT_MIN_REQUESTS
    profile: str = PROFILE
    # smg's binary (scripts/install-peers puts it in .venv-peers/bin/smg); None: no smg target.
    smg: str | None = None
    # paired: the two servers share one GPU; pooled: a GPU each, specgate SPECGATE_TOPOLOGY=pooled.
    topology: str = "paired"
    # Which of CLASSES the sessions are: both (half each), or one alone (single-class traffic).
    classes: str = "AB"
    # Each cell run this many times, with sessions drawn from seeds seed, seed + 1, ...
    repeats: int = 1
    # A second `features` beside the others (CONTROL), whose distance from it is the run's noise.
    control: bool = False
    # The specgate targets run (features always among them): fewer stacks, a faster time scale,
    # for runs repeated many times.
    gates: tuple[str, ...] = GATES
    # How the fixed targets reach their servers (FIXED_THROUGH): straight, or through a pinned
    # specgate (DIRECT then runs beside them).
    fixed_through: str = "direct"
    # The oracle measured (ORACLE) beside the others.
    oracle: bool = False

    def __post_init__(self) -> None:
        if not 0 < self.window_s <= self.max_window_s:
            raise ValueError("--window-s must be positive and at most --max-window-s")
        if self.repeats < 1:
            raise ValueError("--repeats must be at least 1")
        check_gates(self.gates)
        if self.fixed_through not in FIXED_THROUGH:
            raise ValueError(f"--fixed-through: one of {', '.join(FIXED_THROUGH)}")
        check_stagger(self.stagger_s)
        for c in self.contexts:
            sizes_for(c, self.turns, self.max_tokens)

    def traffic(self) -> tuple[TrafficClass, ...]:
        """The classes the sessions are of, their shares summing to 1."""
        chosen = [c for c in CLASSES if c.name in self.classes]
        return tuple(TrafficClass(c.name, 1.0 / len(chosen), c.kind) for c in chosen)

    @property
    def targets(self) -> tuple[str, ...]:
        split = (SPLIT,) if len(self.traffic()) > 1 else ()
        gates = tuple(g for g in GATES if g in self.gates)
        direct = (DIRECT,) if self.gated_fixed else ()
        return (
            *FIXED, *gates, *split, *((CONTROL,) if self.control else ()), *direct, *(("smg",) if self.smg else ()),
            *((ORACLE,) if self.oracle else ()),
        )  # fmt: skip

    @property
    def gated_fixed(self) -> bool:
        return self.fixed_through == "specgate"

    def time_scale(self, sessions: int, context: int) -> float:
        """headtohead's, times three stacks over this run's."""
        return round(default_time_scale(sessions, context) * 3 / len(self.targets), 4)

    def calibration_levels(self) -> tuple[int, ...]:
        """CALIBRATE_LEVELS up to the first that reaches the top --sessions (all when none does)."""
        top = max(self.sessions)
        reach = [x for x in CALIBRATE_LEVELS if x >= top]
        return tuple(x for x in CALIBRATE_LEVELS if x <= (reach[0] if reach else CALIBRATE_LEVELS[-1]))

    def calibration_scale(self, context: int) -> float:
        return round(min(MAX_TIME_SCALE, 2 * default_time_scale(max(self.calibration_levels()), context)), 4)

    def wall_slo(self, sessions: int, context: int) -> Slo:
        t = self.time_scale(sessions, context)
        return Slo(ttft_ms=self.slo_ttft_ms / t, tpot_ms=self.slo_tpot_ms / t)

    def workload(self, context: int, sessions: int) -> WorkloadSpec:
        s = sizes_for(context, self.turns, self.max_tokens)
        return WorkloadSpec(
            "multiturn",
            classes=self.traffic(),
            classes_by_stream=True,
            seed=self.seed * 1000 + sessions,
            system_tokens=s.system_tokens,
            turns=s.turns,
            user_tokens=s.user_tokens,
            think_time_s=self.think_time_s / self.time_scale(sessions, context),
            stagger_s=self.stagger_s / self.time_scale(sessions, context),
        )

    def pair(self, time_scale: float, spec_port: int, base_port: int) -> list[str]:
        return pair_args(
            spec_port, base_port, "--profile", self.profile, "--enable-cache-report", "--accept-from-prompt",
            "--max-accept-length", f"{self.max_accept_length:g}", "--spec-steps", str(self.spec_steps),
            "--time-scale", f"{time_scale:g}", shared=self.topology == "paired",
        )  # fmt: skip


def smg_argv(binary: str, port: int, metrics_port: int, workers: Sequence[str]) -> list[str]:
    """`python` arguments that exec smg with the cache_aware policy in front of `workers`."""
    exe = "import os, sys; os.execv(sys.argv[1], sys.argv[1:])"
    return ["-c", exe, binary, "launch", "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *workers,
            "--policy", "cache_aware", "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
            "--disable-tokenizer-autoload", "--worker-startup-check-interval", str(SMG_CHECK_S)]  # fmt: skip


def gate_settings(target: str) -> dict[str, object]:
    """specgate's settings (Settings' fields) for a specgate target."""
    if target == "features":
        return {"policy": "adaptive", "class_key": "header"}
    if target == CONTROL:
        return gate_settings(NOISE_OF)
    if target in ("threshold", "adaptive"):
        return {"policy": target, "class_key": "none", "affinity_entries": 0}
    raise ValueError(f"{target!r} is not a specgate target")


def pinned_settings(role: str) -> dict[str, object]:
    """specgate's settings (Settings' fields) for a gate that sends every request to the server of
    `role` (--fixed-through specgate): today's threshold rule with watermarks no load crosses (all
    speculative) or at 0 (all baseline), no classes, no affinity, no probes (threshold sends none)."""
    if role not in ROLES:
        raise ValueError(f"{role!r} is not a role")
    mark = PINNED_SPECULATIVE if role == "speculative" else 0
    return {"policy": "threshold", "class_key": "none", "affinity_entries": 0, "high_watermark": mark,
            "low_watermark": mark}  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Scoring: pure


def good_turns(results: Sequence[RequestResult]) -> dict[str, dict[int, RequestResult]]:
    """Each session's good requests by turn (every one, the window's and the turns before it)."""
    by_session: dict[str, dict[int, RequestResult]] = {}
    for r in results:
        if r.ok:
            by_session.setdefault(r.session, {})[r.turn] = r
    return by_session


def oracle_hit_rate(results: Sequence[RequestResult], t0: float, t1: float, system_tokens: int) -> float | None:
    """The prefix-cache hit rate of an oracle that sends every turn back to the server of its
    session's last turn, where nothing is evicted, over the good requests started in [t0, t1] that
    reported cached tokens (as the measured rate): a first turn finds the shared system prompt
    cached, a later one the previous turn's prompt and reply; whole pages only."""
    by_session = good_turns(results)
    cached = prompts = 0
    for r in results:
        if not (r.ok and t0 <= r.started < t1 and r.cached_tokens is not None):
            continue
        prev = by_session[r.session].get(r.turn - 1)
        held = system_tokens if r.turn == 1 else (prev.prompt_tokens + prev.output_tokens if prev else 0)
        cached += min(r.prompt_tokens, held) // PAGE_TOKENS * PAGE_TOKENS
        prompts += r.prompt_tokens
    return cached / prompts if prompts else None


@dataclass(frozen=True)
class ClassCell:
    context: int
    sessions: int
    time_scale: float
    targets: dict[str, TargetCell]
    # Goodput (requests a simulated second) per target and class.
    class_goodput: dict[str, dict[str, float]] = field(default_factory=dict)
    oracle_hit: dict[str, float | None] = field(default_factory=dict)
    cpu_busy: float | None = None
    # The seed its sessions were drawn from (ClassPlan.repeats).
    seed: int = 0
    # Where the machine was too busy for its timings to be trusted (kit.sampling.cpu_use), why.
    cpu_warning: str | None = None
    # Per target: the share of its later turns served by the role that served the session's turn
    # before (returned_share), a diagnostic; None where no response named its role (straight to a
    # server).
    returned: dict[str, float | None] = field(default_factory=dict)

    def best_fixed(self) -> float | None:
        """The better of all-spec's and all-base's goodput, None when either is inconclusive."""
        fixed = [self.targets[n] for n in FIXED]
        if not all(t.conclusive for t in fixed):
            return None
        return max(t.goodput_req_s for t in fixed)

    def ratio(self, target: str) -> float | None:
        best = self.best_fixed()
        t = self.targets[target]
        if best is None or not t.conclusive or best < NO_GOODPUT:
            return None
        return t.goodput_req_s / best

    def throughput_ratio(self, target: str) -> float | None:
        """The target's output tokens a second over the better fixed target's (None: a figure
        inconclusive or none): what counts where neither fixed target met the SLOs (goodput_verdict)."""
        fixed = [self.targets[n] for n in FIXED]
        t = self.targets[target]
        best = max(f.output_tok_s for f in fixed)
        if not (t.conclusive and all(f.conclusive for f in fixed)) or best <= 0:
            return None
        return t.output_tok_s / best

    def throughput_noise(self) -> float | None:
        """noise() in output tokens a second."""
        if CONTROL not in self.targets:
            return 0.0
        t, c = self.targets[NOISE_OF], self.targets[CONTROL]
        if not (t.conclusive and c.conclusive) or t.output_tok_s <= 0:
            return None
        return abs(c.output_tok_s / t.output_tok_s - 1.0)

    def served_alone(self, target: str) -> bool:
        """Whether the target met the SLOs for some requests where neither fixed target met them for
        any, every figure conclusive: any goodput is then at least any multiple of the better fixed
        target's."""
        best, t = self.best_fixed(), self.targets[target]
        return best is not None and best < NO_GOODPUT and t.conclusive and t.goodput_req_s >= NO_GOODPUT

    def versus(self, target: str, other: str) -> float | None:
        """target's goodput over other's, None when either is inconclusive or has none."""
        t, o = self.targets[target], self.targets[other]
        if not (t.conclusive and o.conclusive) or o.goodput_req_s < NO_GOODPUT:
            return None
        return t.goodput_req_s / o.goodput_req_s

    def noise(self) -> float | None:
        """|control / features - 1|: how far a specgate's goodput moved from a copy of itself in
        this run; 0 without a control (results judged as they are), None where either is
        inconclusive or has none."""
        if CONTROL not in self.targets:
            return 0.0
        r = self.versus(CONTROL, NOISE_OF)
        return None if r is None else abs(r - 1.0)

    def split_bound(self) -> float | None:
        """Each class's goodput on the fixed target it does best on, summed, over the better fixed
        target's (None when either is inconclusive or has none): a split that left each class as
        well off as it was there. A split beats it only where each class does better beside the
        other than it did on either fixed target: on GPUs of their own (a pool), not where the two
        servers time-slice one."""
        best = self.best_fixed()
        if best is None or best < NO_GOODPUT:
            return None
        spec, base = self.class_goodput["all-spec"], self.class_goodput["all-base"]
        return sum(max(spec.get(c, 0.0), base.get(c, 0.0)) for c in spec.keys() | base.keys()) / best

    def split(self) -> bool | None:
        """Whether the classes should be split: class B has more goodput on all-spec and class A on
        all-base, each beyond TIE, and the split measured (SPLIT) has more goodput than the better
        fixed target, beyond TIE; None when a figure it needs is inconclusive. Each class doing
        better on its own server does not make a split pay where the two servers time-slice one
        GPU: every step of one waits for the other's. Results from before SPLIT was measured are
        judged on the classes alone."""
        best = self.best_fixed()
        if best is None:
            return None
        spec, base = self.class_goodput["all-spec"], self.class_goodput["all-base"]
        if not all(c in spec and c in base for c in "AB"):
            return False  # one class: nothing to split
        classes = spec["B"] > base["B"] * (1 + TIE) and base["A"] > spec["A"] * (1 + TIE)
        measured = self.targets.get(SPLIT)
        if not classes or measured is None:
            return classes
        if not measured.conclusive:
            return None
        return measured.goodput_req_s > best * (1 + TIE)


Verdict = str  # "met", "missed", "unknown"


def goodput_verdict(cell: ClassCell, target: str) -> Verdict:
    """met/missed the issue's goodput target in this cell (>= SPLIT_GAIN where the classes should be
    split, else >= FLOOR) by more than the run's noise (ClassCell.noise; 0 without a control),
    unknown when a figure is inconclusive or the ratio is within the noise of its target. Met too
    where it met the SLOs for some requests and neither fixed target for any (served_alone), and so
    did the control, where there is one: what no fixed choice served is not noise. Elsewhere where
    neither fixed target met the SLOs for any request (fixed_served_none: the load is past what
    either serves within them), a ratio to their goodput of 0 tells nothing: the target's output
    tokens a second over the better fixed target's must then clear FLOOR (by more than the same
    noise in them)."""
    if cell.served_alone(target) and (CONTROL not in cell.targets or cell.served_alone(CONTROL)):
        return "met"
    if fixed_served_none(cell):
        return _floor(cell.throughput_ratio(target), cell.throughput_noise()) + ON_TOK_S
    r, split, noise = cell.ratio(target), cell.split(), cell.noise()
    if r is None or split is None or noise is None:
        return "unknown"
    goal = SPLIT_GAIN if split else FLOOR
    if r - noise >= goal:
        return "met"
    return "missed" if r + noise < goal else "unknown"


def _floor(ratio: float | None, noise: float | None) -> Verdict:
    """met/missed FLOOR by more than the noise, else unknown."""
    if ratio is None or noise is None:
        return "unknown"  # ON_TOK_S added to it: still not a verdict anyone counts as known
    if ratio - noise >= FLOOR:
        return "met"
    return "missed" if ratio + noise < FLOOR else "unknown"


def hit_verdict(cell: ClassCell, target: str) -> Verdict:
    """met/missed: the target's hit rate within HIT_POINTS of the oracle's on its own requests
    (oracle_gap). Where neither fixed target met the SLOs (fixed_served_none) the pools overflow,
    and no routing comes near an oracle that evicts nothing: there the target is judged against the
    best oracle routing measured beside it (measured_oracle_gap, --oracle), and is unknown without
    one. (A target that sent every later turn back to its session's server, returned_share 1,
    routed as that oracle does from wherever it placed the first turns, but not as one that placed
    them better: spread over both servers' memory, smg's conversations found more cached at 8k/128
    once. So that share is shown, not counted.)"""
    gap = measured_oracle_gap(cell, target) if fixed_served_none(cell) else oracle_gap(cell, target)
    if gap is None:
        return "unknown"
    return "met" if gap <= HIT_POINTS else "missed"


def returned_share(results: Sequence[RequestResult], t0: float, t1: float) -> float | None:
    """The share of the good later turns started in [t0, t1] whose response named the role that
    served the session's turn before (x-specgate-backend); None where none can be told (no
    response named its role, or no later turn with a named turn before it)."""
    by_session = good_turns(results)
    same = known = 0
    for r in results:
        if not (r.ok and t0 <= r.started < t1 and r.turn > 1 and r.backend is not None):
            continue
        prev = by_session[r.session].get(r.turn - 1)
        if prev is None or prev.backend is None:
            continue
        known += 1
        same += prev.backend == r.backend
    return same / known if known else None


def fixed_served_none(cell: ClassCell) -> bool:
    """Whether neither fixed target had a request within the SLOs in this cell, both conclusive:
    its load is past what either serves within them, and its pools overflow. (Until 2026-12-07,
    late, whether no target had one: a specgate that served some, or only its control copy, then
    made the cell's runs judged apart from those where it served none.)"""
    best = cell.best_fixed()
    return best is not None and best < NO_GOODPUT


def measured_oracle_gap(cell: ClassCell, target: str) -> float | None:
    """How much further the target's hit rate falls short of its own no-eviction estimate
    (oracle_gap) than the best measured sticky target's (STICKY: the oracle run beside it, and
    all-spec and all-base, which return every turn to their one server too) falls short of its own:
    what the target lost to eviction and placement beyond what the best oracle routing measured
    lost, each on its own requests (raw hit rates differ by the share of first turns too). Negative:
    it lost less. None where any is unknown, or no oracle ran."""
    if ORACLE not in cell.targets:
        return None
    own = oracle_gap(cell, target)
    sticky = [g for name in STICKY if (g := oracle_gap(cell, name)) is not None]
    if own is None or len(sticky) < len(STICKY):
        return None
    return own - min(sticky)


def oracle_gap(cell: ClassCell, target: str) -> float | None:
    """How far the target's hit rate falls short of the oracle's on its own requests (negative: above
    it, the oracle counting whole pages only); None: unknown. Two targets' raw hit rates differ by
    their requests too (a faster one has more first turns in the window, which find only the system
    prompt); their gaps to their own oracles differ only by where they sent them."""
    t = cell.targets.get(target)
    oracle = cell.oracle_hit.get(target)
    if t is None or not t.conclusive or t.prefix_cache_hit_rate is None or oracle is None:
        return None
    return oracle - t.prefix_cache_hit_rate


# ---------------------------------------------------------------------------------------------
# Running


def calibrate(plan: ClassPlan, context: int, out_dir: Path, quiet: bool, prompt_tokens: str = "none") -> Path:
    """A fresh pair calibrated with the plan's traffic (`prompt_tokens`: the speed model's sweeps,
    calibrate's --prompt-tokens; none: no fit)."""
    where = out_dir / f"calibration-{context_label(context)}"
    where.mkdir(parents=True, exist_ok=True)
    s = sizes_for(context, plan.turns, plan.max_tokens)
    t = plan.calibration_scale(context)
    extra = [
        *calibrate_options(plan.seed, plan.max_tokens, plan.min_requests),
        "--workload", "multiturn", "--system-tokens", str(s.system_tokens), "--turns", str(s.turns),
        "--user-tokens", str(s.user_tokens), "--think-time-s", "0", "--warmup-s", "0",
        *(a for c in plan.traffic() for a in ("--class", f"{c.name}:{c.share:g}:{c.kind}")),
    ]  # fmt: skip
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
    fleet = Fleet()
    urls: dict[str, str] = {}
    servers: dict[str, dict[str, str]] = {}
    class_urls: dict[str, dict[str, str]] = {}
    stream_urls: dict[str, tuple[str, ...]] = {}
    pairs: dict[str, dict[str, str]] = {}
    try:
        for target in plan.targets:
            sp, bp = free_port(), free_port()
            spec, base = f"http://127.0.0.1:{sp}", f"http://127.0.0.1:{bp}"
            fleet.start(f"pair-{target}", plan.pair(t, sp, bp), [spec + "/health", base + "/health"])
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
            port = free_port()
            urls[target] = f"http://127.0.0.1:{port}"
            back = servers[target]
            settings = {**gate_settings(target), "calibration": calibration, "topology": plan.topology}
            env = specgate_env(port, back["speculative"], back["baseline"], t)
            env |= {f"SPECGATE_{k.upper()}": str(v) for k, v in settings.items()}
            fleet.start(f"specgate-{target}", ["-m", "proxy"], [urls[target] + "/ready"], env)
        fleet.ready()
    except BaseException:
        fleet.stop()
        raise
    return Servers(urls=urls, servers=servers, fleet=fleet, class_urls=class_urls, stream_urls=stream_urls)


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
        port = free_port()
        via[target, role] = f"http://127.0.0.1:{port}"
        env = specgate_env(port, backends["speculative"], backends["baseline"], time_scale)
        settings = {**pinned_settings(role), "topology": plan.topology}
        env |= {f"SPECGATE_{k.upper()}": str(v) for k, v in settings.items()}
        fleet.start(f"specgate-pinned-{target}-{role}", ["-m", "proxy"], [via[target, role] + "/ready"], env)
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
    servers = start_servers(plan, sessions, context, calibration)
    try:
        cpu0 = self_cpu_s()
        cap = asyncio.run(measure_cell(plan, context, sessions, servers, tag_requests=True))
        cpu = cpu_use(cap.cpu_samples, servers.fleet.procs, self_cpu_s() - cpu0)
    finally:
        servers.fleet.stop()
    slo = plan.wall_slo(sessions, context)
    system = sizes_for(context, plan.turns, plan.max_tokens).system_tokens
    targets: dict[str, TargetCell] = {}
    per_class: dict[str, dict[str, float]] = {}
    oracle: dict[str, float | None] = {}
    returned: dict[str, float | None] = {}
    for name in plan.targets:
        run = cap.runs[name]
        stats = run.stats(slo, plan.min_requests)
        everything = summarise_class("all", run.results, run.t0, run.t1, slo)
        targets[name] = target_cell(name, stats, everything, t, cap.mean_queued(name))
        wrong = misrouted(name, run.results) if plan.gated_fixed else 0
        if wrong:
            # Not the fixed choice it stands for: nothing is concluded from it.
            targets[name] = dataclasses.replace(targets[name], conclusive=False)
            say(f"    warning: {wrong} of {name}'s requests reached the role its gate is not pinned to", quiet)
        per_class[name] = {c.name: (s.goodput_req_s or 0.0) / t for c in plan.traffic()
                           if (s := stats.classes.get(c.name)) is not None}  # fmt: skip
        for c in plan.traffic():
            per_class[name].setdefault(c.name, 0.0)
        oracle[name] = oracle_hit_rate(run.results, run.t0, run.t1, system)
        returned[name] = returned_share(run.results, run.t0, run.t1)
    cell = ClassCell(
        context, sessions, t, targets, per_class, oracle, cpu.machine_busy_mean, plan.seed, cpu.warning, returned
    )
    figures = ", ".join(f"{n} {c.goodput_req_s:.2f}{'' if c.conclusive else '*'}" for n, c in targets.items())
    say(f"    goodput {figures}; CPU {cpu.machine_busy_mean:.0%}", quiet)
    if cpu.warning:
        say(f"    warning: {cpu.warning}", quiet)
    return cell


# ---------------------------------------------------------------------------------------------
# Report


def _hit(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0%}"


def _goodput(t: TargetCell | None) -> str:
    return "-" if t is None else fmt(t.goodput_req_s, 2) + ("" if t.conclusive else "*")


def _pair(by_class: dict[str, float]) -> str:
    return "/".join("-" if c not in by_class else f"{by_class[c]:.2f}" for c in "AB")


def _ratio(value: float | None) -> str:
    return "unknown" if value is None else f"{value:.2f}x"


def _vs_best(c: ClassCell, target: str) -> str:
    """The target's ratio to the better fixed target, or that it served alone (ClassCell.served_alone),
    or where neither fixed target served any, its throughput's (goodput_verdict)."""
    if c.served_alone(target):
        return "served, fixed 0"
    if fixed_served_none(c):
        return f"fixed served none, tok/s {_ratio(c.throughput_ratio(target))}"  # the verdict says " on tok/s"
    return _ratio(c.ratio(target))


def table(plan: ClassPlan, cells: Sequence[ClassCell]) -> str:
    """A markdown table: goodput per target, the gates' ratios, split, hit rates."""
    gates = [n for n in GATES if n in plan.targets]
    head = (
        "| ctx | sessions | seed | scale | "
        + " | ".join(f"goodput {n}" for n in plan.targets)
        + " | A/B spec | A/B base | split? | free split | "
        + ("split / best | " if SPLIT in plan.targets else "")
        + (f"{CONTROL} / {NOISE_OF} | " if CONTROL in plan.targets else "")
        + (f"all-base / {DIRECT} | " if DIRECT in plan.targets else "")
        + " | ".join(f"{n} / best" for n in gates)
        + " | features / adaptive | hit "
        + " / ".join(plan.targets)
        + " | oracle (features) | features to spec | features back on its role |"
        + (" short of own oracle, features / smg |" if "smg" in plan.targets else "")
        + (f" features short of {ORACLE} |" if ORACLE in plan.targets else "")  # measured_oracle_gap
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for c in cells:
        split = c.split()
        gp = [_goodput(c.targets.get(n)) for n in plan.targets]
        cg = c.class_goodput
        share = c.targets["features"].speculative_share
        lines.append(
            f"| {context_label(c.context)} | {c.sessions} | {c.seed} | {c.time_scale:g} | "
            + " | ".join(gp)
            + f" | {_pair(cg['all-spec'])} | {_pair(cg['all-base'])} | "
            f"{'unknown' if split is None else 'yes' if split else 'no'} | {_ratio(c.split_bound())} | "
            + ((f"{_ratio(c.ratio(SPLIT))} | " if SPLIT in c.targets else "- | ") if SPLIT in plan.targets else "")
            + (f"{_ratio(c.versus(CONTROL, NOISE_OF))} | " if CONTROL in plan.targets else "")
            + (f"{_ratio(c.versus('all-base', DIRECT))} | " if DIRECT in plan.targets else "")
            + " | ".join(f"{_vs_best(c, n)} ({goodput_verdict(c, n)})" for n in gates)
            + f" | {_ratio(c.versus('features', 'adaptive')) if 'adaptive' in c.targets else '-'} | "
            + " / ".join(_hit(c.targets[n].prefix_cache_hit_rate) if n in c.targets else "-" for n in plan.targets)
            + f" | {_hit(c.oracle_hit.get('features'))} | {'-' if share is None else f'{share:.0%}'} | "
            + f"{_hit(c.returned.get('features'))} |"
            + (
                f" {_points(oracle_gap(c, 'features'))} / {_points(oracle_gap(c, 'smg'))} |"
                if "smg" in plan.targets
                else ""
            )
            + (f" {_points(measured_oracle_gap(c, 'features'))} |" if ORACLE in plan.targets else "")
        )
    lines.append(
        f"\n(simulated time; goodput: requests a second finishing within TTFT <= {plan.slo_ttft_ms:g} ms and TPOT "
        f"<= {plan.slo_tpot_ms:g} ms; A/B: each class's goodput; split?: B gains on all-spec and A on all-base, "
        f"each beyond {TIE:.0%}, and the measured split (B to the speculative server, A to the baseline) beats "
        f"the better fixed target beyond {TIE:.0%}; free split: each class on its better fixed target, summed, "
        f"over the better fixed target (a split that left each class as well off as it was there); X / best: "
        f"X's goodput over the better of all-spec and all-base, (met/missed) >= {SPLIT_GAIN:g}x where split, "
        f"else >= {FLOOR:g}x; where neither fixed target met the SLOs, X's output tokens a second over the "
        f"better fixed target's, >= {FLOOR:g}x; back on its role: later turns on the role of their session's "
        "turn before (1: the oracle's routing, its hit rate met)"
        + (f", by more than |{CONTROL} / {NOISE_OF} - 1|, else unknown" if CONTROL in plan.targets else "")
        + (
            f"; all-spec, all-base and the split through a specgate pinned to their server, {DIRECT} the "
            f"baseline server straight: all-base / {DIRECT} is what the hop costs"
            if plan.gated_fixed
            else ""
        )
        + (
            f"; {ORACLE}: every session kept on one server of its own pair, each server given as many sessions of "
            f"each class; features short of {ORACLE}: how much further features' hit rate fell short of its own "
            "estimate than the best of all-spec's, all-base's and the oracle's fell short of theirs (what judges the "
            "hit target where neither fixed target met the SLOs)"
            if ORACLE in plan.targets
            else ""
        )
        + "; * inconclusive)"
    )
    return "\n".join(lines)


def _points(gap: float | None) -> str:
    return "unknown" if gap is None else f"{gap * 100:+.1f}"


def repeated(cells: Sequence[ClassCell]) -> dict[tuple[int, int], list[ClassCell]]:
    """The runs of each cell (context, sessions), in the order run."""
    out: dict[tuple[int, int], list[ClassCell]] = {}
    for c in cells:
        out.setdefault((c.context, c.sessions), []).append(c)
    return out


def runs_verdict(runs: Sequence[ClassCell], target: str, verdict: Callable[[ClassCell, str], Verdict]) -> Verdict:
    """A cell's verdict over its runs: theirs where they all agree, else unknown (a target met on
    one draw of the sessions and missed on another was not measured to be either)."""
    found = {verdict(c, target) for c in runs}
    return found.pop() if len(found) == 1 else "unknown"


def pooled_ratio(runs: Sequence[ClassCell], target: str) -> float | None:
    """The target's goodput summed over the runs where its ratio is known, over the better fixed
    target's summed alike (None: none known); `features`' with its control's where both are known
    (_pooled_pairs)."""
    known = _pooled_pairs(runs, target)
    return sum(t for t, _ in known) / sum(b for _, b in known) if known else None


def _pooled_pairs(runs: Sequence[ClassCell], target: str) -> list[tuple[float, float]]:
    """(the target's goodput, with its copy's (_with_copy), the better fixed target's) in each run
    where its ratio is known."""
    return [(_with_copy(c, target, c.ratio), c.best_fixed() or 0.0) for c in runs if c.ratio(target) is not None]


def _with_copy(c: ClassCell, target: str, known: Callable[[str], float | None]) -> float:
    """The target's goodput; for NOISE_OF, the mean of it and its control's where `known` gives the
    control a figure: the control is the same policy in the same run, a second sample of it (set on
    2026-12-06, evening, after 80 runs of the pair at 8k/32 showed the two copies' spread to be the
    ratio's, and judged on fresh seeds since)."""
    goodput = c.targets[target].goodput_req_s
    if target == NOISE_OF and CONTROL in c.targets and known(CONTROL) is not None:
        goodput = (goodput + c.targets[CONTROL].goodput_req_s) / 2
    return goodput


def pooled_interval(runs: Sequence[ClassCell], target: str) -> tuple[float, float] | None:
    """The CONFIDENCE interval of the target's pooled ratio (pooled_ratio) by a percentile
    bootstrap: the runs where its ratio is known drawn with replacement, RESAMPLES times, from a
    fixed seed (the same runs give the same interval); None with fewer than POOLED_MIN_RUNS, or
    more than POOLED_MAX_UNKNOWN of the runs inconclusive (unknown_runs)."""
    if unknown_runs(runs, target) > POOLED_MAX_UNKNOWN * len(runs):
        return None
    return _interval(_pooled_pairs(runs, target))


def unknown_runs(runs: Sequence[ClassCell], target: str) -> int:
    """The runs in which the target or a fixed target was inconclusive."""
    return sum(1 for c in runs if not all(c.targets[n].conclusive for n in (target, *FIXED) if n in c.targets))


def _interval(known: Sequence[tuple[float, float]]) -> tuple[float, float] | None:
    """pooled_interval's bootstrap of sum(a) / sum(b) over (a, b) pairs, b >= 0 (a draw of b's
    that sum to 0 is an infinite ratio)."""
    if len(known) < POOLED_MIN_RUNS:
        return None
    rng, n = random.Random(0), len(known)
    draws = []
    for _ in range(RESAMPLES):
        picks = [known[rng.randrange(n)] for _ in range(n)]
        below = sum(b for _, b in picks)
        draws.append(sum(t for t, _ in picks) / below if below > 0 else math.inf)
    draws.sort()
    tail = (1 - CONFIDENCE) / 2
    return draws[int(tail * RESAMPLES)], draws[min(RESAMPLES - 1, int((1 - tail) * RESAMPLES))]


def pooled_split(runs: Sequence[ClassCell]) -> bool | None:
    """ClassCell.split on the runs pooled: each class's goodput summed over the runs on each fixed
    target, and the measured split's pooled ratio to the better fixed target, beyond TIE at the
    lower end of its interval (pooled_interval: no split where the upper end is within TIE; None
    between, or where a figure it needs is missing)."""
    known = [c for c in runs if (best := c.best_fixed()) is not None and best >= NO_GOODPUT]
    if len(known) < POOLED_MIN_RUNS or sum(c.best_fixed() is None for c in runs) > POOLED_MAX_UNKNOWN * len(runs):
        return None
    if not all(k in c.class_goodput[n] for c in known for n in FIXED for k in "AB"):
        return False  # one class: nothing to split
    spec, base = ({k: sum(c.class_goodput[n][k] for c in known) for k in "AB"} for n in FIXED)
    if not (spec["B"] > base["B"] * (1 + TIE) and base["A"] > spec["A"] * (1 + TIE)):
        return False
    measured = [(m, c.best_fixed() or 0.0) for c in known if (m := c.targets.get(SPLIT)) is not None]
    if not measured:
        return True  # from before the split was measured: on the classes alone, as ClassCell.split
    if len(measured) < len(known) or not all(m.conclusive for m, _ in measured):
        return None
    interval = _interval([(m.goodput_req_s, best) for m, best in measured])
    if interval is None:
        return None
    if interval[0] > 1 + TIE:
        return True
    return False if interval[1] <= 1 + TIE else None


def pooled_verdict(runs: Sequence[ClassCell], target: str) -> Verdict:
    """met where the pooled ratio's interval (pooled_interval) clears the cell's goal, missed where
    it falls short of it, else unknown: SPLIT_GAIN where the classes should split on the runs pooled
    (pooled_split), FLOOR where they should not, and where that is unknown, met only by clearing
    both, missed only by falling short of both."""
    interval = pooled_interval(runs, target)
    if interval is None:
        return "unknown"
    split = pooled_split(runs)
    goals = (SPLIT_GAIN,) if split else (FLOOR,) if split is False else (FLOOR, SPLIT_GAIN)
    if interval[0] >= max(goals):
        return "met"
    return "missed" if interval[1] < min(goals) else "unknown"


def cell_verdict(runs: Sequence[ClassCell], target: str) -> Verdict:
    """A cell's goodput verdict: its runs' where they all agree on one (runs_verdict), else their
    pooled ratio's (pooled_verdict). A run of a closed loop of conversations moves by more than
    its control says between runs, as timing bunches or spreads the turns (at 8k/32 on the pair,
    from 0.55x to 1.83x of all-base over 40 seeds): one disagreeing run of many is no reason to
    know nothing."""
    found = {goodput_verdict(c, target) for c in runs}
    if found == {"unknown" + ON_TOK_S}:
        return found.pop()  # no ratio to pool where the fixed targets served none
    plain = {v.removesuffix(ON_TOK_S) for v in found}
    if len(plain) == 1 and plain != {"unknown"}:
        # Runs judged some on goodput, some on throughput (served, fixed 0 in one, none in another)
        # agree where both say the same; tagged as judged on throughput where any was.
        tag = ON_TOK_S if found != plain else ""
        return plain.pop() + tag
    return pooled_verdict(runs, target)


def _pooled(runs: Sequence[ClassCell], target: str) -> str:
    interval = pooled_interval(runs, target)
    extra = "" if interval is None else f" ({CONFIDENCE:.0%} interval {interval[0]:.2f}x-{interval[1]:.2f}x)"
    unknown = unknown_runs(runs, target)
    if unknown:
        extra += f", {unknown} of {len(runs)} runs inconclusive"
    return _ratio(pooled_ratio(runs, target)) + extra


def hop_line(runs: Sequence[ClassCell]) -> str | None:
    """all-base through its pinned specgate over the baseline server straight (DIRECT), pooled over
    the runs where both are known, with its interval where there are enough (None: not run)."""
    known = [
        (c.targets["all-base"].goodput_req_s, c.targets[DIRECT].goodput_req_s)
        for c in runs
        if DIRECT in c.targets and c.versus("all-base", DIRECT) is not None
    ]
    if not any(DIRECT in c.targets for c in runs):
        return None
    if not known:
        return f"all-base / {DIRECT} unknown"
    return f"all-base / {DIRECT} " + _pooled_over(known, sum(1 for c in runs if DIRECT in c.targets), len(runs))


def direct_line(runs: Sequence[ClassCell]) -> str:
    """NOISE_OF's goodput (with its control's, _with_copy) over DIRECT's, pooled over the runs
    where both are known: against the baseline server straight, where that is the better fixed
    choice (the earlier sets' reference, all-spec straight aside)."""
    known = [
        (_with_copy(c, NOISE_OF, functools.partial(c.versus, other=DIRECT)), c.targets[DIRECT].goodput_req_s)
        for c in runs
        if DIRECT in c.targets and c.versus(NOISE_OF, DIRECT) is not None
    ]
    return _pooled_over(known, len(runs), len(runs)) if known else "unknown"


def _pooled_over(known: Sequence[tuple[float, float]], ran: int, runs: int) -> str:
    """sum(a) / sum(b) over the (a, b) pairs known, with its interval (_interval) where at most
    POOLED_MAX_UNKNOWN of the `ran` runs that could know one did not; `runs` in all."""
    pooled = sum(a for a, _ in known) / sum(b for _, b in known)
    interval = _interval(known) if ran - len(known) <= POOLED_MAX_UNKNOWN * ran else None
    extra = "" if interval is None else f" ({CONFIDENCE:.0%} interval {interval[0]:.2f}x-{interval[1]:.2f}x)"
    return f"pooled {pooled:.2f}x{extra} over {len(known)} of {runs} runs"


def summary_lines(cells: Sequence[ClassCell]) -> list[str]:
    out = []
    by_cell = repeated(cells)
    several = any(len(runs) > 1 for runs in by_cell.values())
    for n in (g for g in GATES if any(g in c.targets for c in cells)):
        gv = [cell_verdict(runs, n) for runs in by_cell.values()]
        hv = [runs_verdict(runs, n, hit_verdict) for runs in by_cell.values()]
        tok_s = [v for v in gv if v.endswith(ON_TOK_S)]
        out.append(
            f"{n}: goodput target met in {gv.count('met')}, missed in {gv.count('missed')}, unknown in "
            f"{len(gv) - gv.count('met') - gv.count('missed')} of {len(by_cell)} cells"
            + (
                " (where neither fixed target met the SLOs, on output tokens a second: "
                f"met in {tok_s.count('met' + ON_TOK_S)}, missed in {tok_s.count('missed' + ON_TOK_S)}, "
                f"unknown in {tok_s.count('unknown' + ON_TOK_S)})"
                if tok_s
                else ""
            )
            + f"; hit rate within {HIT_POINTS:.0%} of the oracle in "
            f"{hv.count('met')}, missed in {hv.count('missed')}, unknown in {hv.count('unknown')}"
            + (
                f" (a cell's verdict: its runs', where they all agree; else, over {POOLED_MIN_RUNS} runs or more, "
                f"by their pooled ratio's {CONFIDENCE:.0%} interval)"
                if several
                else ""
            )
        )
    if any(CONTROL in c.targets for c in cells):
        for (context, sessions), runs in by_cell.items():
            spread = ", ".join(_ratio(c.versus(CONTROL, NOISE_OF)) for c in runs)
            out.append(f"{CONTROL} / {NOISE_OF} at {context_label(context)}/{sessions} (the noise): {spread}")
    for (context, sessions), runs in by_cell.items():
        hop = hop_line(runs)
        if hop:
            out.append(f"the hop at {context_label(context)}/{sessions}: {hop}")
            out.append(f"{NOISE_OF} at {context_label(context)}/{sessions} over {DIRECT}: {direct_line(runs)}")
    if several:
        for (context, sessions), runs in by_cell.items():
            ratios = ", ".join(_vs_best(c, "features") for c in runs)
            plural = "s" if len(runs) > 1 else ""
            out.append(
                f"features at {context_label(context)}/{sessions} over {len(runs)} run{plural} (seeds "
                f"{', '.join(str(c.seed) for c in runs)}): {ratios}; pooled {_pooled(runs, 'features')}: "
                f"{cell_verdict(runs, 'features')}"
            )
    known = raw = closer = 0
    for c in cells:
        f, s = oracle_gap(c, "features"), oracle_gap(c, "smg")
        if f is None or s is None:
            continue
        hit_f, hit_s = c.targets["features"].prefix_cache_hit_rate, c.targets["smg"].prefix_cache_hit_rate
        known, closer = known + 1, closer + (f <= s)
        raw += hit_f is not None and hit_s is not None and hit_f >= hit_s
    if known:
        out.append(
            f"features against smg: hit rate at least smg's in {raw} of {known} {'runs' if several else 'cells'} "
            "where both are known; "
            f"no further from its own oracle than smg from its own in {closer}"
        )
    measured = [(c, g) for c in cells if ORACLE in c.targets and (g := measured_oracle_gap(c, "features")) is not None]
    if measured:
        out.append(
            f"features against the best oracle routing measured beside it (all-spec, all-base, {ORACLE}; each "
            f"against its own estimate): within {HIT_POINTS:.0%} of it or above in "
            f"{sum(1 for _, g in measured if g <= HIT_POINTS)} of {len(measured)} {'runs' if several else 'cells'} "
            "where all are known (points short: "
            + ", ".join(f"{context_label(c.context)}/{c.sessions} {_points(g)}" for c, g in measured)
            + ")"
        )
    warned = sum(1 for c in cells if c.cpu_warning)
    if warned:
        out.append(
            f"warning: the machine's CPU was saturated in {warned} of {len(cells)} runs: their timings stretched"
        )
    return out


# ---------------------------------------------------------------------------------------------
# Command


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


def run(plan: ClassPlan, out_dir: Path, reuse: Path | None, quiet: bool) -> dict[str, Any]:
    out_dir.mkdir(parents=True, exist_ok=True)
    cells: list[ClassCell] = []
    for context in plan.contexts:
        path = context_calibration(plan, context, out_dir, reuse, quiet)
        for s in plan.sessions:
            scaled = at_sessions(plan, context, s, path, out_dir)
            for i in range(plan.repeats):
                one = dataclasses.replace(plan, seed=plan.seed + i)
                cells.append(fresh_start(functools.partial(run_cell, one, context, s, scaled, quiet), quiet))
        write_json(out_dir / "headtohead-classes.json", {"settings": vars(plan), "cells": cells})
    return {"settings": vars(plan), "cells": cells, "summary": summary_lines(cells)}


def check_gates(gates: Sequence[str]) -> None:
    """--gates: some of GATES, NOISE_OF among them (ValueError otherwise)."""
    if NOISE_OF not in gates or not set(gates) <= set(GATES):
        raise ValueError(f"--gates: a comma list of {', '.join(GATES)}, with {NOISE_OF} among them")


def gate_list(text: str) -> tuple[str, ...]:
    """--gates' comma list (check_gates)."""
    gates = names(text)
    try:
        check_gates(gates)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return gates


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "headtohead-classes",
        help="two traffic classes on a pair: all-spec, all-base and three specgates (issue 28)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--contexts", type=context_list, default=(1000, 8000), help="comma list (default 1k,8k)")
    p.add_argument("--sessions", type=level_tuple, default=(8, 32, 128), help="comma list (default 8,32,128)")
    p.add_argument("--turns", type=count, default=4)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--think-time-s", type=non_negative, default=0.5, help="simulated seconds (default 0.5)")
    p.add_argument("--stagger-s", type=non_negative, default=ClassPlan.stagger_s,
                   help="each stream's first session starts a draw uniform in [0, this) simulated seconds in, so the "
                   f"conversations do not run in step (default {ClassPlan.stagger_s:g}; 0: all at once)")  # fmt: skip
    p.add_argument("--window-s", type=positive, default=6.0, help="simulated seconds (default 6)")
    p.add_argument("--max-window-s", type=positive, default=60.0, help="simulated seconds (default 60)")
    p.add_argument("--slo-ttft-ms", type=positive, default=1000.0, help="simulated ms (default 1000)")
    p.add_argument("--slo-tpot-ms", type=positive, default=50.0, help="simulated ms (default 50)")
    p.add_argument("--calibrations", default=None, metavar="DIR", help="reuse an earlier run's calibrations")
    p.add_argument(
        "--classes",
        choices=("AB", "A", "B"),
        default="AB",
        help="the sessions' classes: both (default), or one alone (single-class traffic)",
    )
    p.add_argument("--topology", choices=("paired", "pooled"), default="paired",
                   help="paired: one GPU shared by both servers (default); pooled: a GPU each (1+1)")  # fmt: skip
    p.add_argument("--repeats", type=count, default=1,
                   help="run each cell this many times, drawing the sessions from seeds --seed, --seed + 1, ...; "
                   "a cell's verdict is its runs' where they all agree, else unknown (default 1)")  # fmt: skip
    p.add_argument("--control", action="store_true",
                   help="add a second features (control): a run's ratio then counts as met or missed only where it "
                   "clears its target by more than |control / features - 1|, else unknown")  # fmt: skip
    p.add_argument("--gates", type=gate_list, default=GATES, metavar="LIST",
                   help=f"the specgate targets, a comma list of {', '.join(GATES)} with {NOISE_OF} among them "
                   "(default all): fewer stacks run at a faster time scale, for many --repeats")  # fmt: skip
    p.add_argument("--fixed-through", choices=FIXED_THROUGH, default="direct",
                   help="direct: all-spec, all-base and the split's classes go straight to their server (default); "
                   "specgate: each through a specgate pinned to it, so they pay the hop the specgates pay, with "
                   f"{DIRECT} (the baseline server straight) beside them for what the hop costs")  # fmt: skip
    p.add_argument("--smg", default=None, metavar="BINARY",
                   help="add smg --policy cache_aware in front of a pair (e.g. .venv-peers/bin/smg)")  # fmt: skip
    p.add_argument("--oracle", action="store_true",
                   help=f"add the oracle ({ORACLE}): every session kept on one server of a pair of its own for all "
                   "its turns, each server given as many sessions of each class; where neither fixed target meets "
                   "the SLOs and the pools evict, the hit target is judged against the best of it, all-spec and "
                   "all-base (else unknown)")  # fmt: skip
    add_run_options(p, "a cell needs per target", "headtohead-classes-results")


def cmd_headtohead_classes(args: argparse.Namespace) -> int:
    check_max_tokens(args.max_tokens)
    plan = ClassPlan(
        contexts=args.contexts, sessions=args.sessions, turns=args.turns, max_tokens=args.max_tokens,
        think_time_s=args.think_time_s, stagger_s=args.stagger_s, window_s=args.window_s,
        max_window_s=max(args.max_window_s, args.window_s),
        slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms, seed=args.seed, min_requests=args.min_requests,
        smg=args.smg, topology=args.topology, classes=args.classes, repeats=args.repeats, control=args.control,
        gates=args.gates, fixed_through=args.fixed_through, oracle=args.oracle,
    )  # fmt: skip
    out_dir = Path(args.out_dir)
    started = time.monotonic()
    report = run(plan, out_dir, Path(args.calibrations) if args.calibrations else None, args.quiet)
    report["wall_s"] = round(time.monotonic() - started, 1)
    print(table(plan, report["cells"]))
    for line in report["summary"]:
        print(line)
    write_json(out_dir / "headtohead-classes.json", report)
    print(f"\ndata: {out_dir / 'headtohead-classes.json'}   ({report['wall_s']:.0f} s)")
    return 0
