"""headtohead-classes' scoring of one run of a cell: pure functions of what it recorded, in
simulated time (the goodput ratios, whether the classes should be split, the oracle's hit rate and
the verdicts against issue 28's targets)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ...client import RequestResult
from ...kit.figures import NO_GOODPUT, TIE, TargetCell
from .plan import CONTROL, FIXED, NOISE_OF, ORACLE, SPLIT, STICKY

# The targets.
SPLIT_GAIN = 1.10
FLOOR = 0.97
HIT_POINTS = 0.05
# goodput_verdict's verdicts where neither fixed target met the SLOs, judged on output tokens a second: counted
# apart from the goodput target's own.
ON_TOK_S = " on tok/s"
# The simulator's prefix cache keeps whole pages of this many tokens (radix.py's default).
PAGE_TOKENS = 16


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
