"""The default-policy benchmark's protocol and scoring, fixed before any run (pure).

The plan: per pair, the arms' order at each level of each round; the scoring: each uncalibrated
arm's throughput over calibrated threshold's at the same level in the same round, a level's
figure the median of its rounds, unknown where any round of it was inconclusive, and the
target (the candidate at least TARGET of calibrated threshold at every level of every pair).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

CALIBRATED = "calibrated"  # SPECGATE_POLICY=threshold, SPECGATE_CALIBRATION=the pair's file
ADAPTIVE = "adaptive"  # SPECGATE_POLICY=adaptive, no calibration file, every other setting default
THRESHOLD = "threshold"  # SPECGATE_POLICY=threshold, no calibration file: watermarks 16/8
ARMS = (CALIBRATED, ADAPTIVE, THRESHOLD)
UNCALIBRATED = (ADAPTIVE, THRESHOLD)
CANDIDATE = ADAPTIVE
TARGET = 0.95
# "even": two uncalibrated arms within this of each other (in ratio to calibrated threshold).
EVEN = 0.02
# A level whose arm lost more than this share of its requests to the client is inconclusive.
CLIENT_ERROR_SHARE = 0.05
PASS, MISS, UNKNOWN = "pass", "miss", "unknown"


@dataclass(frozen=True)
class PairSpec:
    """One simulated pair on a shared GPU: its profile, the simulators' extra flags, the time scale
    of the whole run on it (calibration and measurement alike), and its sweep grid."""

    name: str
    profile: str
    time_scale: float
    levels: tuple[int, ...]
    flags: tuple[str, ...] = ()
    why: str = ""

    def simulator_flags(self) -> list[str]:
        return ["--profile", self.profile, "--time-scale", f"{self.time_scale:g}", *self.flags]


# calibrate's default grid (kit.sweeps.DEFAULT_LEVELS).
LEVELS = (1, 2, 5, 10, 30, 70, 100, 250)
# No prefix cache on the simulators: every arm sends the same prompts at a level, and a cache would
# hand the later arms the earlier one's prefills (seen in the smoke run: two arms both on the
# baseline at 30 streams, 2,438 and 3,068 tok/s, the second finding the first's prompts cached).
NO_CACHE = ("--disable-radix-cache",)
PAIRS = (
    PairSpec(
        "crossover",
        "crossover",
        1.0,
        LEVELS,
        NO_CACHE,
        why="the synthetic curves: speculation 1.8x at 1 stream, even at 20, the baseline 1.7x at 250",
    ),
    PairSpec(
        "h200-llama8b",
        "h200-llama8b",
        0.5,
        LEVELS,
        ("--spec-steps", "3", *NO_CACHE),
        why="step times measured on an H200 (Llama-3.1-8B, EAGLE-3 at 3 draft steps, acceptance 2.5), "
        "slowed to 0.5 so that 250 streams stay within what two cores relay",
    ),
)
PAIR_NAMES = tuple(p.name for p in PAIRS)


@dataclass(frozen=True)
class Protocol:
    """The whole run. Times are simulated seconds (a wall second is T of them at time scale T)."""

    pairs: tuple[PairSpec, ...] = PAIRS
    rounds: int = 2
    seed: int = 1207
    max_tokens: int = 64
    warmup_s: float = 3.0  # least warm-up a level (and until every stream finished one request)
    window_s: float = 4.0
    max_window_s: float = 30.0  # a window extends until it has min_requests from half the streams
    min_requests: int = 10
    calibrate_window_s: float = 4.0  # calibrate's --duration-s, per level and server
    target: float = TARGET

    def __post_init__(self) -> None:
        if self.rounds < 1:
            raise ValueError("--rounds must be at least 1")
        if not 0 < self.window_s <= self.max_window_s:
            raise ValueError("--window-s must be positive and at most the longest window")

    def wall(self, pair: PairSpec, simulated_s: float) -> float:
        return simulated_s / pair.time_scale


def round_levels(levels: Sequence[int], round_no: int) -> tuple[int, ...]:
    """Round 0 climbs the grid, round 1 comes down it, and so on: one gateway per arm goes through
    every round, as a user's does while the load rises and falls."""
    up = tuple(sorted(levels))
    return up if round_no % 2 == 0 else tuple(reversed(up))


def arm_order(step: int, arms: Sequence[str] = ARMS) -> tuple[str, ...]:
    """The arms one after another at the plan's `step`-th level (counted over the rounds), rotated
    by one a level, so that no arm always goes first after a change of load or last before one."""
    k = step % len(arms)
    return tuple(arms[k:]) + tuple(arms[:k])


def plan(protocol: Protocol, pair: PairSpec) -> list[tuple[int, int, tuple[str, ...]]]:
    """(round, level, arms in order) for a pair, in the order they run."""
    levels = [(r, level) for r in range(protocol.rounds) for level in round_levels(pair.levels, r)]
    return [(r, level, arm_order(step)) for step, (r, level) in enumerate(levels)]


@dataclass(frozen=True)
class ArmLevel:
    """One arm at one level in one round: what scoring reads of its LevelStats."""

    output_tok_s: float  # simulated (wall over the time scale)
    mean_tpot_ms: float  # simulated
    completed: int
    errors: int
    client_errors: int
    conclusive: bool  # the sweep's own rule: enough good requests, from at least half the streams
    speculative_share: float = float("nan")  # of its requests, the share the speculative server served
    high: int | None = None  # the gateway's watermarks after the level (/routing)
    low: int | None = None

    @property
    def good(self) -> bool:
        sent = self.completed + self.errors + self.client_errors
        lost = self.client_errors / sent if sent else 1.0
        return self.conclusive and self.completed > 0 and lost <= CLIENT_ERROR_SHARE


@dataclass
class PairRun:
    """A pair's measured levels: round -> level -> arm -> figures; and the calibration's watermarks."""

    pair: str
    calibrated: tuple[int, int] | None = None
    rounds: dict[int, dict[int, dict[str, ArmLevel]]] = field(default_factory=dict)
    cpu_busy: dict[int, dict[int, float]] = field(default_factory=dict)  # round -> level -> machine share


def ratio(arm: ArmLevel | None, reference: ArmLevel | None, key: str = "output_tok_s") -> float | None:
    """arm's figure over the reference's at one level and round; None where either is not good."""
    if arm is None or reference is None or not (arm.good and reference.good):
        return None
    den = float(getattr(reference, key))
    return float(getattr(arm, key)) / den if den > 0 else None


def level_ratios(run: PairRun, level: int, arm: str, key: str = "output_tok_s") -> list[float | None]:
    """The arm's ratio to calibrated threshold at `level` in each round that measured it."""
    return [ratio(arms.get(arm), arms.get(CALIBRATED), key) for arms in _at_level(run, level)]


def _at_level(run: PairRun, level: int) -> list[Mapping[str, ArmLevel]]:
    return [levels[level] for _, levels in sorted(run.rounds.items()) if level in levels]


def level_figure(ratios: Sequence[float | None]) -> float | None:
    """A level's figure: the median of its rounds' ratios; unknown where any round is."""
    if not ratios or any(r is None for r in ratios):
        return None
    return statistics.median(r for r in ratios if r is not None)


def verdict(figure: float | None, target: float = TARGET) -> str:
    if figure is None:
        return UNKNOWN
    return PASS if figure >= target else MISS


def overall(verdicts: Sequence[str]) -> str:
    """The target over levels (and pairs): a miss anywhere misses it; else unknown where any level
    is unknown (not shown); else it holds."""
    if MISS in verdicts:
        return MISS
    return UNKNOWN if UNKNOWN in verdicts or not verdicts else PASS


def better(adaptive: float | None, threshold: float | None) -> str:
    """Which uncalibrated arm did better at a level: by their figures, even within EVEN."""
    if adaptive is None or threshold is None:
        return UNKNOWN
    if abs(adaptive - threshold) <= EVEN:
        return "even"
    return ADAPTIVE if adaptive > threshold else THRESHOLD


@dataclass(frozen=True)
class LevelScore:
    pair: str
    level: int
    tok_s: dict[str, float | None]  # each uncalibrated arm's figure (ratio of throughputs)
    tpot: dict[str, float | None]  # the same on mean TPOT (lower is better; not scored)
    spread: dict[str, float | None]  # max - min of the rounds' throughput ratios (not scored)
    verdicts: dict[str, str]  # each uncalibrated arm against the target
    better: str


def score_pair(run: PairRun, levels: Sequence[int], target: float = TARGET) -> list[LevelScore]:
    out = []
    for level in sorted(levels):
        tok: dict[str, float | None] = {}
        tpot: dict[str, float | None] = {}
        spread: dict[str, float | None] = {}
        for arm in UNCALIBRATED:
            rs = level_ratios(run, level, arm)
            tok[arm] = level_figure(rs)
            tpot[arm] = level_figure(level_ratios(run, level, arm, "mean_tpot_ms"))
            known = [r for r in rs if r is not None]
            spread[arm] = max(known) - min(known) if known and len(known) == len(rs) else None
        verdicts = {arm: verdict(tok[arm], target) for arm in UNCALIBRATED}
        out.append(LevelScore(run.pair, level, tok, tpot, spread, verdicts, better(tok[ADAPTIVE], tok[THRESHOLD])))
    return out


def target_verdict(scores: Sequence[LevelScore], arm: str = CANDIDATE) -> str:
    return overall([s.verdicts[arm] for s in scores])
