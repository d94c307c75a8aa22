"""headtohead's settings: the plan of a run, the multi-turn sizes that give a cell its mean context,
the time scale of each level and the SLOs converted to wall-clock time."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from ..classes import Slo
from ..procs import pair_args, simulator_args
from ..simulator.wire import CHAT_TEMPLATE_TOKENS_PER_MESSAGE, TOKENS
from ..stats import DEFAULT_MIN_REQUESTS
from ..workload import MIN_TOKENS, WorkloadSpec

TARGETS = ("baseline", "adaptive", "specgate")
PROFILE = "h200-llama8b"
# The system prompt every session shares: this share of the mean context.
SYSTEM_SHARE = 0.125
# A reply resent as part of the next prompt: n output tokens come back as n * this many prompt tokens,
# from the simulator's own output words and its four bytes of text a token (1 since they match).
REPLY_PROMPT_TOKENS = sum(len(t) for t in TOKENS) / len(TOKENS) / 4
# Default time scale of a cell: each target's output held near TOK_S_BUDGET tokens per wall second.
# Output grows ~150 tok/s a stream (the 8B alone: 6.2 ms a step) up to SATURATION streams, where the
# GPU's throughput stops growing much, and falls faster than the context grows beyond CONTEXT_REF
# (CONTEXT_EXPONENT): a step reads the whole KV cache, and every turn prefills its new tokens and,
# under pool pressure, evicted ones (measured: 8k-token conversations on the pair gave ~500 output
# tok/s at 64-256 sessions, against ~3,800 at 1k). Slow motion (< 1) keeps the physics and lowers
# the event rate the load tester and simulators must sustain; faster (up to MAX_TIME_SCALE) spares
# wall time where events are few.
TOK_S_BUDGET = 3000.0
PER_STREAM_TOK_S = 150.0
SATURATION = 80
CONTEXT_REF = 1000
CONTEXT_EXPONENT = 1.5
MAX_TIME_SCALE = 4.0
# Calibration: levels (in-flight requests) and their window, in simulated seconds. It drives one
# server at a time, not three: its time scale is CALIBRATION_SPEEDUP times the cells' at its top level.
CALIBRATE_LEVELS = (4, 16, 64, 256)
CALIBRATE_WINDOW_S = 2.0
# The warm-up (until every session finished a turn) and the drain each wait at most this long, in
# simulated seconds: long contexts at many sessions queue for the KV pool that long.
MAX_WAIT_S = 90.0
# The most a stream's first session may wait (--stagger-s): well inside the warm-up's bound.
MAX_STAGGER_S = MAX_WAIT_S / 2
CALIBRATION_SPEEDUP = 2.0


def default_time_scale(sessions: int, context: int = CONTEXT_REF) -> float:
    slower: float = (max(context, CONTEXT_REF) / CONTEXT_REF) ** CONTEXT_EXPONENT
    expected = PER_STREAM_TOK_S * min(sessions, SATURATION) / slower
    return min(MAX_TIME_SCALE, TOK_S_BUDGET / expected)


@dataclass(frozen=True)
class Sizes:
    """One context's multi-turn sessions, in tokens as the simulator counts them."""

    context: int  # the mean prompt asked for
    system_tokens: int
    user_tokens: int
    turns: int
    max_tokens: int

    @property
    def predicted_mean_prompt(self) -> float:
        return mean_prompt(self.system_tokens, self.user_tokens, self.turns, self.max_tokens)


def mean_prompt(system: int, user: int, turns: int, max_tokens: int) -> float:
    """A session's mean prompt over its turns: turn k resends the system prompt, k user messages and
    k - 1 replies, each message with the chat template's tokens."""
    per_msg = CHAT_TEMPLATE_TOKENS_PER_MESSAGE
    total = 0.0
    for k in range(1, turns + 1):
        messages = 2 * k - 1 + (1 if system else 0)
        total += system + k * user + (k - 1) * max_tokens * REPLY_PROMPT_TOKENS + messages * per_msg
    return total / turns


def sizes_for(context: int, turns: int, max_tokens: int) -> Sizes:
    """System and user sizes whose sessions' mean prompt is `context` tokens (ValueError when the
    replies alone exceed it)."""
    system = round(context * SYSTEM_SHARE)
    rest = context - mean_prompt(system, 0, turns, max_tokens)
    user = math.floor(rest / ((turns + 1) / 2))
    if user < MIN_TOKENS:
        raise ValueError(
            f"a mean context of {context} tokens leaves no room for user messages with {turns} turns of "
            f"{max_tokens} output tokens: fewer --turns or --max-tokens"
        )
    return Sizes(context, system, user, turns, max_tokens)


def parse_context(raw: str) -> int:
    """'1k' -> 1000, '8k' -> 8000, '1500' -> 1500."""
    text = raw.strip().lower()
    scale = 1000 if text.endswith("k") else 1
    try:
        value = float(text.removesuffix("k")) * scale
    except ValueError:
        raise ValueError(f"{raw!r} is not a token count such as 1k or 1500") from None
    if value < 100:
        raise ValueError(f"{raw!r}: a mean context of at least 100 tokens")
    return int(value)


def context_list(raw: str) -> tuple[int, ...]:
    """`--contexts`: a comma list of parse_context's counts (an argparse type)."""
    try:
        values = tuple(parse_context(x) for x in raw.split(",") if x.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not values:
        raise argparse.ArgumentTypeError("name at least one context")
    return values


def context_label(tokens: int) -> str:
    return f"{tokens / 1000:g}k" if tokens % 100 == 0 and tokens >= 1000 else str(tokens)


def check_stagger(stagger_s: float) -> None:
    """--stagger-s within [0, MAX_STAGGER_S]: the warm-up waits for every stream's first reply and
    gives up after MAX_WAIT_S."""
    if not 0 <= stagger_s <= MAX_STAGGER_S:
        raise ValueError(f"--stagger-s must be in [0, {MAX_STAGGER_S:g}]")


@dataclass(frozen=True)
class HeadPlan:
    accept_lengths: tuple[float, ...] = (1.5, 2.5)
    contexts: tuple[int, ...] = (1000, 8000)
    sessions: tuple[int, ...] = (1, 4, 16, 64, 256)
    # One for every cell, or one per level; empty: default_time_scale of each cell.
    time_scales: tuple[float, ...] = ()
    turns: int = 4
    max_tokens: int = 128
    think_time_s: float = 0.5  # simulated seconds
    # Each stream's first session starts this far in at most (0: all at once, as in the results of
    # docs/benchmarks/2026-12-04-headtohead.md).
    stagger_s: float = 0.0  # simulated seconds
    window_s: float = 6.0  # simulated seconds
    max_window_s: float = 60.0  # simulated seconds
    slo_ttft_ms: float = 2000.0  # simulated
    slo_tpot_ms: float = 100.0  # simulated
    spec_steps: int = 3
    # None: CALIBRATION_SPEEDUP times the cells' default at the top calibration level.
    calibration_time_scale: float | None = None
    seed: int = 0
    min_requests: int = DEFAULT_MIN_REQUESTS
    profile: str = PROFILE

    def __post_init__(self) -> None:
        if self.time_scales and len(self.time_scales) not in (1, len(self.sessions)):
            raise ValueError("--time-scale: one value, or one per --sessions level")
        if any(t <= 0 for t in self.time_scales) or (self.calibration_time_scale or 1.0) <= 0:
            raise ValueError("time scales must be positive")
        if not 0 < self.window_s <= self.max_window_s:
            raise ValueError("--window-s must be positive and at most --max-window-s")
        check_stagger(self.stagger_s)
        for c in self.contexts:
            self.sizes(c)  # raises where a context cannot be built

    def sizes(self, context: int) -> Sizes:
        return sizes_for(context, self.turns, self.max_tokens)

    @property
    def calibration_levels(self) -> tuple[int, ...]:
        top = max(self.sessions)
        return tuple(x for x in CALIBRATE_LEVELS if x <= top) or tuple(sorted(set(self.sessions)))

    def time_scale(self, sessions: int, context: int) -> float:
        """A cell's time scale: --time-scale's (one, or the level's), else default_time_scale."""
        if not self.time_scales:
            return round(default_time_scale(sessions, context), 4)
        if len(self.time_scales) == 1:
            return self.time_scales[0]
        return self.time_scales[self.sessions.index(sessions)]

    def calibration_scale(self, context: int) -> float:
        if self.calibration_time_scale is not None:
            return self.calibration_time_scale
        top = max(self.calibration_levels)
        return round(min(MAX_TIME_SCALE, CALIBRATION_SPEEDUP * default_time_scale(top, context)), 4)

    def wall_slo(self, sessions: int, context: int) -> Slo:
        """The SLOs in wall-clock ms at the cell's time scale (a simulated ms lasts 1/T of them)."""
        t = self.time_scale(sessions, context)
        return Slo(ttft_ms=self.slo_ttft_ms / t, tpot_ms=self.slo_tpot_ms / t)

    def workload(self, context: int, sessions: int) -> WorkloadSpec:
        """The cell's sessions; think times in wall seconds. The seed differs by level, so one
        level's conversations are not in another's prefix cache."""
        s = self.sizes(context)
        return WorkloadSpec(
            "multiturn",
            seed=self.seed * 1000 + sessions,
            system_tokens=s.system_tokens,
            turns=s.turns,
            user_tokens=s.user_tokens,
            think_time_s=self.think_time_s / self.time_scale(sessions, context),
            stagger_s=self.stagger_s / self.time_scale(sessions, context),
        )

    def common_flags(self, accept: float, time_scale: float) -> list[str]:
        return [
            "--profile", self.profile, "--enable-cache-report", "--accept-length", f"{accept:g}",
            "--spec-steps", str(self.spec_steps), "--time-scale", f"{time_scale:g}",
        ]  # fmt: skip

    def server_args(self, role: str, port: int, accept: float, time_scale: float) -> list[str]:
        """One server alone on its own simulated GPU (the whole GPU's KV pool)."""
        return simulator_args(role, port, *self.common_flags(accept, time_scale))

    def pair_args(self, accept: float, time_scale: float, spec_port: int, base_port: int) -> list[str]:
        """The pair on one simulated GPU, each with its share of the memory and compute."""
        return pair_args(spec_port, base_port, *self.common_flags(accept, time_scale))
