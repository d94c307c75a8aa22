"""Multi-turn cells on a simulated H200: the sessions' sizes that give a cell its mean context, the
contexts' flag, each cell's default time scale, and the cell's `WorkloadSpec` (headtohead's, and the
experiments' on the same sessions)."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from ..simulator.wire import CHAT_TEMPLATE_TOKENS_PER_MESSAGE, TOKENS
from ..workload import MIN_TOKENS, TrafficClass, WorkloadSpec

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
# A fresh pair's calibration: its levels (in-flight requests).
CALIBRATE_LEVELS = (4, 16, 64, 256)
# The warm-up (until every session finished a turn) and the drain each wait at most this long, in
# simulated seconds: long contexts at many sessions queue for the KV pool that long.
MAX_WAIT_S = 90.0
# The most a stream's first session may wait (--stagger-s): well inside the warm-up's bound.
MAX_STAGGER_S = MAX_WAIT_S / 2


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


def multiturn_spec(
    sizes: Sizes,
    seed: int,
    sessions: int,
    time_scale: float,
    think_time_s: float,
    stagger_s: float,
    classes: tuple[TrafficClass, ...] = (),
) -> WorkloadSpec:
    """A cell's sessions; think time and stagger given in simulated seconds, returned in wall ones.
    The seed differs by level, so one level's conversations are not in another's prefix cache.
    `classes`: stream i's sessions all of class i mod their count (classes_by_stream)."""
    return WorkloadSpec(
        "multiturn",
        classes=classes,
        classes_by_stream=bool(classes),
        seed=seed * 1000 + sessions,
        system_tokens=sizes.system_tokens,
        turns=sizes.turns,
        user_tokens=sizes.user_tokens,
        think_time_s=think_time_s / time_scale,
        stagger_s=stagger_s / time_scale,
    )


def calibration_flags(sizes: Sizes, classes: tuple[TrafficClass, ...] = ()) -> list[str]:
    """`loadtest calibrate` arguments that send a cell's sessions without think time or warm-up, so
    that a level's streams are its requests in flight (what specgate's watermarks count)."""
    return [
        "--workload", "multiturn", "--system-tokens", str(sizes.system_tokens), "--turns", str(sizes.turns),
        "--user-tokens", str(sizes.user_tokens), "--think-time-s", "0", "--warmup-s", "0",
        *(a for c in classes for a in ("--class", f"{c.name}:{c.share:g}:{c.kind}")),
    ]  # fmt: skip
