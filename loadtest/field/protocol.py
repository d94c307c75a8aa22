"""The field benchmark's protocol, fixed before any run (pure): the configurations and the servers
each puts behind its router, the cells, the seeds, the windows, each cell's time scale, and the
targets (cli.py's docstring states them for people)."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from ..classes import Slo
from ..experiments.twoclass.plan import CLASSES
from ..kit.multiturn import (
    CONTEXT_EXPONENT,
    CONTEXT_REF,
    MAX_TIME_SCALE,
    PER_STREAM_TOK_S,
    PROFILE,
    SATURATION,
    check_stagger,
    context_label,
    multiturn_spec,
    sizes_for,
)
from ..kit.settings import DURATIONS, RATES, on_clock
from ..stats import DEFAULT_MIN_REQUESTS
from ..workload import TrafficClass, WorkloadSpec

SMG_ADAPTIVE = "smg-adaptive"
SMG_BASELINE = "smg-baseline"
POOL = "specgate-pool"
ADAPTIVE = "specgate-adaptive"
BALANCED = "specgate-adaptive-balanced"
MIXED = "specgate-mixed"
CONFIGS = (SMG_ADAPTIVE, SMG_BASELINE, POOL, ADAPTIVE, BALANCED, MIXED)
SMG = (SMG_ADAPTIVE, SMG_BASELINE)
# The field's setup: every ratio's denominator.
REFERENCE = SMG_ADAPTIVE
# The configurations that need specgate's SPECGATE_ADAPTIVE_URL (Settings.adaptive_url).
NEEDS_ADAPTIVE_URL = (ADAPTIVE, BALANCED, MIXED)
# SPECGATE_ADAPTIVE_PLACEMENT of the two all-adaptive configurations.
PLACEMENT = {ADAPTIVE: "homogeneous", BALANCED: "least_loaded"}

# The targets, for specgate-pool against smg-adaptive.
TWO_CLASS_GAIN = 1.10
ONE_CLASS_FLOOR = 0.97
CLASS_FLOOR = 0.90

# Traffics by name: both classes half each (twoclass's A, prose ~1.3 accepted a step, and B, quoted
# code ~3.0), or class A alone.
TRAFFICS: dict[str, tuple[TrafficClass, ...]] = {
    "AB": CLASSES,
    "A": (TrafficClass("A", 1.0, CLASSES[0].kind),),
}
LOADS = {"light": 16, "heavy": 64}  # sessions per GPU

# The machine's output tokens a wall second over every stack of a cell together, by kit.multiturn's
# estimate of a GPU's output: each cell's time scale holds the stacks' expected output near it.
# Tokens relayed, not the time scale, set a run's CPU, so a cell's wall time is its simulated
# seconds' tokens over this. The estimate is 2.4x what a GPU gave at 1k and 64 sessions, so this
# relays ~6,700 a second: 50-70% of two cores with three configurations (9,000 gave 41%).
MACHINE_TOK_S = 16000.0


@dataclass(frozen=True)
class Cell:
    """One cell: N GPUs (a server alone on each), a traffic (TRAFFICS), a mean context, sessions a GPU."""

    gpus: int
    traffic: str
    context: int
    per_gpu: int

    @property
    def sessions(self) -> int:
        return self.gpus * self.per_gpu

    @property
    def label(self) -> str:
        return f"N={self.gpus} {self.traffic} {context_label(self.context)} {self.per_gpu}/GPU"


def default_cells() -> tuple[Cell, ...]:
    """The protocol's cells (cli.py: why these): at both N, two classes at both contexts and one
    class at 1k, each under the heavy load, and two classes at 1k under the light one."""
    heavy, light = LOADS["heavy"], LOADS["light"]
    return tuple(
        Cell(n, traffic, context, load)
        for n in (2, 4)
        for traffic, context, load in (
            ("AB", 1000, heavy),
            ("AB", 8000, heavy),
            ("A", 1000, heavy),
            ("AB", 1000, light),
        )
    )


def roles(config: str, gpus: int) -> tuple[str, ...]:
    """The simulators' roles behind a configuration's router on `gpus` GPUs, one server a GPU."""
    if gpus < 2 or gpus % 2:
        raise ValueError(f"{gpus} GPUs: an even count, at least 2 (specgate-pool splits them in halves)")
    if config in (SMG_ADAPTIVE, ADAPTIVE, BALANCED):
        return ("adaptive",) * gpus
    if config == SMG_BASELINE:
        return ("baseline",) * gpus
    if config == POOL:
        return ("speculative",) * (gpus // 2) + ("baseline",) * (gpus // 2)
    if config == MIXED:
        # Every kind of server once, and adaptive ones on the rest: the fleet a user grows from
        # today's pool (a pool needs both its roles, so there is none on two GPUs: fits).
        if gpus < 4:
            raise ValueError(f"{MIXED} needs 4 GPUs or more: a pool's two roles and adaptive servers")
        return ("speculative", "baseline") + ("adaptive",) * (gpus - 2)
    raise ValueError(f"{config!r} is not a configuration ({', '.join(CONFIGS)})")


def fits(config: str, gpus: int) -> bool:
    """Whether the configuration has a fleet on `gpus` GPUs (roles)."""
    return config != MIXED or gpus >= 4


def gate_settings(config: str) -> dict[str, object]:
    """specgate's settings (Settings' fields) for a specgate configuration, apart from its servers'
    URLs, calibration and SLOs (FieldPlan.slo_settings)."""
    if config not in CONFIGS or config in SMG:
        raise ValueError(f"{config!r} is not a specgate configuration")
    # Classes from x-specgate-class; cache affinity is on by default (SPECGATE_AFFINITY_ENTRIES).
    out: dict[str, object] = {"class_key": "header"}
    if config in (POOL, MIXED):
        out |= {"policy": "adaptive", "topology": "pooled"}
    if config in PLACEMENT:
        out["adaptive_placement"] = PLACEMENT[config]
    return out


def calibrated(config: str) -> bool:
    """Whether the configuration reads the context's calibration file (its policy is adaptive)."""
    return config in (POOL, MIXED)


def runnable(configs: Sequence[str], fields: Collection[str]) -> tuple[tuple[str, ...], dict[str, str]]:
    """The configurations the installed specgate can run, and for each left out, why."""
    skipped = {
        c: "the installed specgate's Settings has no adaptive_url (SPECGATE_ADAPTIVE_URL): not run"
        for c in configs
        if c in NEEDS_ADAPTIVE_URL and "adaptive_url" not in fields
    }
    return tuple(c for c in configs if c not in skipped), skipped


def has_slo_settings(fields: Collection[str]) -> bool:
    return {"slo_ttft_ms", "slo_tpot_ms"} <= set(fields)


@dataclass(frozen=True)
class FieldPlan:
    """The whole run. Times are simulated (a wall second is T of them at a cell's time scale T)."""

    cells: tuple[Cell, ...] = field(default_factory=default_cells)
    configs: tuple[str, ...] = CONFIGS
    seeds: int = 5
    seed: int = 0  # seeds seed, seed + 1, ..., seed + seeds - 1
    turns: int = 4
    max_tokens: int = 128
    think_time_s: float = 0.5
    stagger_s: float = 2.0
    window_s: float = 2.0
    max_window_s: float = 20.0
    slo_ttft_ms: float = 1000.0
    slo_tpot_ms: float = 50.0
    spec_steps: int = 3
    max_accept_length: float = 3.2
    min_requests: int = DEFAULT_MIN_REQUESTS
    profile: str = PROFILE
    machine_tok_s: float = MACHINE_TOK_S
    # Settings for every specgate configuration beyond the protocol's (--set NAME=VALUE, Settings'
    # field names), time settings on the simulated clock: a one-off's, never the protocol's.
    extra: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if not self.cells:
            raise ValueError("no cells")
        # Without the reference every ratio is unknown: a run to see a configuration work, not a result.
        if not self.configs or not set(self.configs) <= set(CONFIGS):
            raise ValueError(f"--configs: some of {', '.join(CONFIGS)}")
        if self.seeds < 1:
            raise ValueError("--seeds must be at least 1")
        if not 0 < self.window_s <= self.max_window_s:
            raise ValueError("--window-s must be positive and at most --max-window-s")
        check_stagger(self.stagger_s)
        for c in self.cells:
            if c.traffic not in TRAFFICS:
                raise ValueError(f"traffic {c.traffic!r}: one of {', '.join(TRAFFICS)}")
            if c.per_gpu < 1:
                raise ValueError("sessions a GPU must be at least 1")
            for config in self.configs:
                if fits(config, c.gpus):
                    roles(config, c.gpus)
            sizes_for(c.context, self.turns, self.max_tokens)

    @property
    def contexts(self) -> tuple[int, ...]:
        return tuple(dict.fromkeys(c.context for c in self.cells))

    def seed_list(self) -> tuple[int, ...]:
        return tuple(range(self.seed, self.seed + self.seeds))

    def time_scale(self, cell: Cell, stacks: int) -> float:
        """The cell's T: `stacks` routers' expected output held near machine_tok_s together (kit.multiturn's
        estimate, a GPU's output times the GPUs), at most MAX_TIME_SCALE."""
        slower = (max(cell.context, CONTEXT_REF) / CONTEXT_REF) ** CONTEXT_EXPONENT
        expected = PER_STREAM_TOK_S * min(cell.per_gpu, SATURATION) / slower * cell.gpus * stacks
        scale: float = round(min(MAX_TIME_SCALE, self.machine_tok_s / expected), 4)
        return scale

    def wall_slo(self, time_scale: float) -> Slo:
        return Slo(ttft_ms=self.slo_ttft_ms / time_scale, tpot_ms=self.slo_tpot_ms / time_scale)

    def slo_settings(self, time_scale: float, fields: Collection[str]) -> dict[str, object]:
        """SPECGATE_SLO_* where the installed Settings has them (`fields`), in wall ms: specgate
        does not know the simulators' clock, and a simulated ms lasts 1/T wall ms."""
        if not has_slo_settings(fields):
            return {}
        slo = self.wall_slo(time_scale)
        return {"slo_ttft_ms": f"{slo.ttft_ms:g}", "slo_tpot_ms": f"{slo.tpot_ms:g}"}

    def extra_settings(self, time_scale: float) -> dict[str, object]:
        """--set's settings, durations and rates moved from the simulated clock to the wall's."""
        return {
            name: f"{on_clock(name, float(value), time_scale):g}" if name in (*DURATIONS, *RATES) else value
            for name, value in self.extra
        }

    def simulator_flags(self, time_scale: float) -> list[str]:
        """Every simulator's: one alone on its GPU (no --shared-gpu), acceptance from the prompt."""
        return [
            "--profile", self.profile, "--enable-cache-report", "--accept-from-prompt",
            "--max-accept-length", f"{self.max_accept_length:g}", "--spec-steps", str(self.spec_steps),
            "--time-scale", f"{time_scale:g}",
        ]  # fmt: skip


@dataclass(frozen=True)
class CellRun:
    """One cell at one seed as kit.cells measures it (its CellPlan): the cell's sessions drawn from
    the seed, think times and windows on the cell's clock."""

    plan: FieldPlan
    cell: Cell
    seed: int
    scale: float

    @property
    def window_s(self) -> float:
        return self.plan.window_s

    @property
    def max_window_s(self) -> float:
        return self.plan.max_window_s

    @property
    def min_requests(self) -> int:
        return self.plan.min_requests

    @property
    def max_tokens(self) -> int:
        return self.plan.max_tokens

    def time_scale(self, sessions: int, context: int) -> float:
        return self.scale

    def workload(self, context: int, sessions: int) -> WorkloadSpec:
        p = self.plan
        s = sizes_for(context, p.turns, p.max_tokens)
        return multiturn_spec(
            s, self.seed, sessions, self.scale, p.think_time_s, p.stagger_s, TRAFFICS[self.cell.traffic]
        )
