"""headtohead-classes' plan: its targets, the sessions' two classes, the settings each specgate
target runs with, and smg's command line (cli.py describes the protocol)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ...classes import Slo
from ...kit.multiturn import (
    CALIBRATE_LEVELS,
    MAX_TIME_SCALE,
    PROFILE,
    check_stagger,
    default_time_scale,
    multiturn_spec,
    sizes_for,
)
from ...procs import pair_args
from ...stats import DEFAULT_MIN_REQUESTS
from ...workload import TrafficClass, WorkloadSpec

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
        """The cell's sessions, stream i's all of class i mod the classes (kit.multiturn.multiturn_spec)."""
        s, t = sizes_for(context, self.turns, self.max_tokens), self.time_scale(sessions, context)
        return multiturn_spec(s, self.seed, sessions, t, self.think_time_s, self.stagger_s, self.traffic())

    def pair(self, time_scale: float, spec_port: int, base_port: int) -> list[str]:
        return pair_args(
            spec_port, base_port, "--profile", self.profile, "--enable-cache-report", "--accept-from-prompt",
            "--max-accept-length", f"{self.max_accept_length:g}", "--spec-steps", str(self.spec_steps),
            "--time-scale", f"{time_scale:g}", shared=self.topology == "paired",
        )  # fmt: skip


def check_gates(gates: Sequence[str]) -> None:
    """--gates: some of GATES, NOISE_OF among them (ValueError otherwise)."""
    if NOISE_OF not in gates or not set(gates) <= set(GATES):
        raise ValueError(f"--gates: a comma list of {', '.join(GATES)}, with {NOISE_OF} among them")


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
