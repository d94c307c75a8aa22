"""The ablation's protocol, fixed before any run: the mechanisms and the switch that turns each off,
the cells each is measured in, the seeds and the window; and the plan built from them (pure).

A cell's run starts one stack per name in `CellSpec.stacks`: `full` (every mechanism on, as a
user gets it with the policy named), `full-copy` (the same settings again: its distance from
`full` is the run's noise) and `no-<mechanism>` for each mechanism measured there (the full
stack's settings with that one switch turned). Every stack is a fresh simulated GPU (or pool) and
a fresh specgate, driven side by side with the same sessions in one window.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ..kit.multiturn import context_label, default_time_scale

FULL = "full"
COPY = "full-copy"
OFF = "no-"
# The time scale of a run: headtohead's default for the cell, times REFERENCE_STACKS over the run's
# stacks (headtohead-classes' rule: the event rate of three stacks, whatever their number).
REFERENCE_STACKS = 3
SEEDS = (900, 901, 902)
MIN_SEEDS = 3
WINDOW_S = 12.0  # simulated
MAX_WINDOW_S = 60.0  # simulated: a window extends until each stack has enough good requests


@dataclass(frozen=True)
class Mechanism:
    """One mechanism: its name, the Settings' fields that turn it off, what it does, where it can
    act, and what else its switch turns off (read from proxy/; "" where nothing)."""

    name: str
    off: Mapping[str, object]
    does: str
    acts: str
    also: str = ""

    @property
    def switch(self) -> str:
        return ", ".join(f"SPECGATE_{k.upper()}={v}" for k, v in self.off.items())


MECHANISMS: tuple[Mechanism, ...] = (
    Mechanism(
        "classes",
        {"class_key": "none"},
        "traffic classes: each class's acceptance learnt; in a pool a request goes to the role its class "
        "gains most on; in a pair the classes' mix is the traffic's acceptance the watermarks are solved at",
        "pair (acceptance mix) and pool (class choice)",
    ),
    Mechanism(
        "affinity",
        {"affinity_entries": 0},
        "cache affinity: a conversation's next turn to the server holding its prefix",
        "pool (the held role between the watermarks, and the class rule's held role); in a pair only "
        "through the side effects named in `also`",
        "the affinity table is also what feeds Router.note_turn (each turn's growth, counted in the "
        "speculative pool's capacity K / (t + g)) and the held role that KV spill reads (a "
        "conversation cached on the baseline never spills): off, g reads 0 and every request may spill",
    ),
    Mechanism(
        "affinity-rule",
        {"affinity_rule": "in_flight"},
        "the priced affinity rule among a role's servers (default `both`: a turn moves only where the "
        "priced rule and the rule by requests in flight would each move it) against `in_flight` alone",
        "a pool with more than one server of a role, under the model policy with a fit",
    ),
    Mechanism(
        "kv-spill",
        {"kv_spill_at": 0},
        "KV spill: once every baseline pool is full, requests for the baseline go to the speculative "
        "role while its pools have room",
        "where the baseline's KV pool fills: the pair at 8k/128 (128 x 8k tokens > 0.9 x 419k)",
    ),
    Mechanism(
        "kv-forecast",
        {"kv_forecast_s": 0},
        "KV forecast: the speculative pool's cap read at the footprint 10 s ahead",
        "paired groups under a learning policy",
    ),
    Mechanism(
        "switch-cost",
        {"prefill_tok_s": 0},
        "switch cost: a paired group's switch waits until its gain pays the re-prefill",
        "paired groups under a learning policy",
        "under the model policy with a fit, SPECGATE_PREFILL_TOK_S=0 also turns the priced affinity rule off "
        "(Router.priced); under adaptive, as measured here, nothing else",
    ),
    Mechanism(
        "return-hold",
        {"low_watermark_hold_s": 0},
        "return hold: the load must stay at the low watermark 2 s before speculation returns",
        "pair and pool (threshold and learning policies)",
    ),
    Mechanism(
        "dwell",
        {"adaptive_min_dwell_s": 0},
        "dwell: a mode lasts at least 10 s before the next switch",
        "pair and pool (learning policies)",
    ),
    Mechanism(
        "probes",
        {"adaptive_probe_s": 0},
        "probes: while everything goes to the baseline, a probe to the idle speculative server re-measures "
        "its acceptance",
        "pair and pool (learning policies)",
        "with probes off, a return to speculation is no longer held for a fresh acceptance reading "
        "(policy.dwell_mode): part of the same mechanism",
    ),
    Mechanism(
        "shadow-probes",
        {"adaptive_probe_mode": "request"},
        "shadow probes (a capped copy of a request) against request probes (the request itself)",
        "wherever probes act",
    ),
)
BY_NAME = {m.name: m for m in MECHANISMS}

PAIR_MECHANISMS = (
    "classes",
    "affinity",
    "kv-forecast",
    "switch-cost",
    "return-hold",
    "dwell",
    "probes",
    "shadow-probes",
)
POOL_MECHANISMS = ("classes", "affinity", "return-hold", "dwell", "probes", "shadow-probes")


@dataclass(frozen=True)
class CellSpec:
    """One cell: a topology of simulated H200s under the two-class traffic of headtohead-classes,
    the full stack's policy, and the mechanisms measured in it."""

    name: str
    topology: str  # paired: one GPU shared by the pair; pooled: a GPU per server
    context: int
    sessions: int
    mechanisms: tuple[str, ...]
    policy: str = "adaptive"
    baselines: int = 1  # baseline servers (pooled only)
    why: str = ""

    def __post_init__(self) -> None:
        unknown = [m for m in self.mechanisms if m not in BY_NAME]
        if unknown:
            raise ValueError(f"{self.name}: no mechanism {unknown}")
        if self.topology not in ("paired", "pooled"):
            raise ValueError(f"{self.name}: topology paired or pooled")
        if self.baselines != 1 and self.topology != "pooled":
            raise ValueError(f"{self.name}: more than one baseline server only in a pool")

    @property
    def stacks(self) -> tuple[str, ...]:
        return (FULL, COPY, *(OFF + m for m in self.mechanisms))

    @property
    def label(self) -> str:
        servers = "pair" if self.topology == "paired" else f"pool 1+{self.baselines}"
        return f"{servers} {context_label(self.context)}/{self.sessions}"

    def time_scale(self) -> float:
        return round(default_time_scale(self.sessions, self.context) * REFERENCE_STACKS / len(self.stacks), 4)


CELLS: tuple[CellSpec, ...] = (
    CellSpec("pair-1k-8", "paired", 1000, 8, PAIR_MECHANISMS, why="speculation pays throughout"),
    CellSpec("pair-1k-32", "paired", 1000, 32, PAIR_MECHANISMS, why="near the crossover"),
    CellSpec("pair-1k-128", "paired", 1000, 128, PAIR_MECHANISMS, why="past it; the forecast's 70% climb"),
    CellSpec("pair-8k-32", "paired", 8000, 32, PAIR_MECHANISMS, why="the speculative pool fills (cap, forecast)"),
    CellSpec(
        "pair-8k-128",
        "paired",
        8000,
        128,
        ("kv-spill",),
        why="the baseline pool fills: the one cell where KV spill acts; nobody meets the SLOs there but "
        "through the spill, so only the spill is measured (budget)",
    ),
    CellSpec("pool-8k-32", "pooled", 8000, 32, POOL_MECHANISMS, why="classes split across GPUs"),
    CellSpec(
        "pool2-8k-48",
        "pooled",
        8000,
        48,
        ("affinity-rule",),
        policy="model",
        baselines=2,
        why="headtohead-affinity's cell: a role of two servers, the model policy's fit",
    ),
)
CELL_NAMES = tuple(c.name for c in CELLS)


def full_settings(cell: CellSpec) -> dict[str, object]:
    """The full stack's settings (Settings' fields): the policy, classes from x-specgate-class, the
    topology, the mechanisms made opt-in since (ON); every other setting at its default (time
    settings scaled to the simulators' clock: run.stack_env)."""
    return {"policy": cell.policy, "class_key": "header", "topology": cell.topology, **ON}


# The mechanisms made opt-in after the protocol's one run, their gain inside its noise in every cell
# (docs/benchmarks/2026-12-07-ablation.md): the full stack turns each on as it was then, at what were
# its defaults, so that the protocol measures the same stacks as it did.
ON: dict[str, object] = {
    "adaptive_min_dwell_s": 10.0,
    "prefill_tok_s": 20_000.0,
    "kv_forecast_s": 10.0,
    "affinity_rule": "both",
}


def stack_settings(cell: CellSpec, stack: str) -> dict[str, object]:
    """A stack's settings: the full stack's, with the stack's one mechanism off."""
    if stack in (FULL, COPY):
        return full_settings(cell)
    name = stack.removeprefix(OFF)
    if not stack.startswith(OFF) or name not in cell.mechanisms:
        raise ValueError(f"{stack!r} is not a stack of {cell.name}")
    return {**full_settings(cell), **BY_NAME[name].off}


def off_stack(mechanism: str) -> str:
    return OFF + mechanism


@dataclass(frozen=True)
class Protocol:
    """What one run of the command measures: cells, seeds, window (simulated seconds)."""

    cells: tuple[CellSpec, ...] = CELLS
    seeds: tuple[int, ...] = SEEDS
    window_s: float = WINDOW_S
    max_window_s: float = MAX_WINDOW_S
    notes: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if not self.cells or not self.seeds:
            raise ValueError("a protocol needs cells and seeds")
        if len(set(self.seeds)) < len(self.seeds):
            raise ValueError("--seeds: each seed once")
        if not 0 < self.window_s <= self.max_window_s:
            raise ValueError("--window-s must be positive and at most the maximum window")

    @property
    def complete(self) -> bool:
        """Whether verdicts can be reached: at least MIN_SEEDS seeds a cell."""
        return len(self.seeds) >= MIN_SEEDS

    def order(self) -> list[tuple[CellSpec, int]]:
        """The runs in the order made: seed by seed, each seed through every cell, so that a drift of
        the machine over the hour falls on every cell's seeds alike rather than on one cell."""
        return [(cell, seed) for seed in self.seeds for cell in self.cells]

    def calibrations(self) -> dict[tuple[str, int], tuple[int, ...]]:
        """(topology, context) -> the sessions of its cells: one calibration each."""
        out: dict[tuple[str, int], list[int]] = {}
        for c in self.cells:
            out.setdefault((c.topology, c.context), []).append(c.sessions)
        return {k: tuple(sorted(set(v))) for k, v in out.items()}


def select_cells(names: Sequence[str]) -> tuple[CellSpec, ...]:
    """The protocol's cells named (ValueError for a name it has not)."""
    unknown = [n for n in names if n not in CELL_NAMES]
    if unknown:
        raise ValueError(f"--cells: no cell {', '.join(unknown)} (the protocol's: {', '.join(CELL_NAMES)})")
    return tuple(c for c in CELLS if c.name in names)


def coverage(cells: Sequence[CellSpec]) -> dict[str, tuple[str, ...]]:
    """Each mechanism's cells among `cells`."""
    return {m.name: tuple(c.name for c in cells if m.name in c.mechanisms) for m in MECHANISMS}


def describe(protocol: Protocol) -> str:
    """The protocol's cells and mechanisms as lines for --help and the report."""
    lines = ["cells (stacks side by side in one run; time scale):"]
    for c in protocol.cells:
        lines.append(
            f"  {c.name:<12} {c.label}, {c.policy}, {len(c.stacks)} stacks, T={c.time_scale():g}: "
            f"{', '.join(c.mechanisms)} ({c.why})"
        )
    lines.append("mechanisms (switch off; what else the switch turns off):")
    for m in MECHANISMS:
        extra = f"; also: {m.also}" if m.also else ""
        lines.append(f"  {m.name:<14} {m.switch}{extra}")
    return "\n".join(lines)
