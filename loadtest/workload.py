"""What each closed-loop stream sends: the workload (single-turn prompts, multi-turn sessions or long
contexts) and the traffic classes its sessions are drawn into.

A stream runs a script: a generator that yields the next `Turn` (the prompt, its class, session and
turn, and the think time before it is sent) and is sent back the reply text as received (None when
the request failed). Everything is drawn from seeded generators: per stream for the generated
workloads, so a stream's sessions do not depend on how the streams interleave.

- `single`: today's prompt sources (`--prompts`) unchanged; with classes, each request is drawn into
  a class and takes the next prompt of that class's kind (prompts.diverse or prompts.repetitive).
- `multiturn`: each stream runs sessions one after another. A session is drawn into a class (or, with
  `classes_by_stream`, stream i's sessions are all of class i mod n: an even split), starts
  from the system prompt every session shares, and sends `turns` requests: each appends a new user
  message to the whole conversation so far (system, every earlier user message and every reply as
  received). A failed request ends its session, as a user would start over.
- `longctx`: single-turn requests of lengths drawn from a lognormal distribution.
"""

from __future__ import annotations

import argparse
import math
import random
import re
from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from .prompts import Prompt, source
from .textbank import TextBank, repeat, tokens_to_chars

WorkloadKind = Literal["single", "multiturn", "longctx"]
WORKLOADS: tuple[WorkloadKind, ...] = ("single", "multiturn", "longctx")
# diverse: varied prose; repetitive: a piece quoted over and over (code edits); mixed: varied prose
# whose opening MIXED_QUOTE share is quoted again at its end (a question quoting a little of its
# context), so about that share of its word 4-grams repeat. Mixed is for generated workloads only.
ClassKind = Literal["diverse", "repetitive", "mixed"]
CLASS_KINDS: tuple[ClassKind, ...] = ("diverse", "repetitive", "mixed")
MIXED_QUOTE = 0.14
DEFAULT_CLASS = "all"
# Shortest generated prompt or user message: the repetitiveness contract holds from here up.
MIN_TOKENS = 16
# Spread (coefficient of variation) of the user messages' lengths around --user-tokens.
USER_TOKENS_CV = 0.3
# Think times are exponential, cut at this many times their mean so one draw cannot idle a stream.
THINK_MAX_FACTOR = 5.0
# Shares must sum to 1 within this.
SHARE_TOLERANCE = 1e-6


@dataclass(frozen=True)
class TrafficClass:
    name: str
    share: float
    kind: ClassKind


def parse_class(raw: str) -> TrafficClass:
    """argparse type of --class NAME:SHARE:KIND, e.g. chat:0.7:diverse."""
    parts = raw.split(":")
    if len(parts) != 3:
        raise argparse.ArgumentTypeError(f"{raw!r} is not NAME:SHARE:KIND (e.g. chat:0.7:diverse)")
    name, share_raw, kind = parts
    if not re.fullmatch(r"[A-Za-z0-9_-]+", name):
        raise argparse.ArgumentTypeError(f"{raw!r}: NAME must be letters, digits, _ and -")
    try:
        share = float(share_raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{raw!r}: SHARE {share_raw!r} is not a number") from None
    if not 0 < share <= 1:
        raise argparse.ArgumentTypeError(f"{raw!r}: SHARE must be in (0, 1]")
    if kind not in CLASS_KINDS:
        raise argparse.ArgumentTypeError(f"{raw!r}: KIND must be one of {', '.join(CLASS_KINDS)}")
    return TrafficClass(name, share, kind)


def check_classes(classes: Sequence[TrafficClass]) -> tuple[TrafficClass, ...]:
    """The classes as given, or ValueError: names unique, shares summing to 1."""
    names = [c.name for c in classes]
    if len(set(names)) != len(names):
        raise ValueError(f"--class: a name is given twice ({', '.join(names)})")
    total = sum(c.share for c in classes)
    if classes and abs(total - 1.0) > SHARE_TOLERANCE:
        raise ValueError(f"--class: the shares sum to {total:g}, not 1")
    return tuple(classes)


@dataclass(frozen=True)
class WorkloadSpec:
    """A workload's settings; lengths in tokens, times in seconds as the streams wait them."""

    kind: WorkloadKind = "single"
    # No classes: one class, "all", of today's prompts (single) or diverse text (the others).
    classes: tuple[TrafficClass, ...] = ()
    seed: int = 0
    # single without classes: the --prompts source.
    prompts: str = "diverse"
    # multiturn
    system_tokens: int = 1000
    turns: int = 4
    user_tokens: int = 200
    think_time_s: float = 1.0
    # longctx
    prompt_tokens_mean: int = 8000
    prompt_tokens_spread: float = 0.5
    prompt_tokens_max: int = 100_000
    # multiturn and longctx: stream i's sessions all of class i mod len(classes), whatever the shares.
    classes_by_stream: bool = False
    # multiturn and longctx: each stream's first request waits a draw uniform in [0, stagger_s), so
    # the streams do not open their conversations in step (0: all at once).
    stagger_s: float = 0.0

    def __post_init__(self) -> None:
        check_classes(self.classes)
        if self.kind == "single" and any(c.kind == "mixed" for c in self.classes):
            raise ValueError("a mixed class is for --workload multiturn or longctx (single uses --prompts' sources)")
        if self.kind not in WORKLOADS:
            raise ValueError(f"--workload must be one of {', '.join(WORKLOADS)}")
        if self.system_tokens < 0 or self.turns < 1 or self.user_tokens < 1 or self.think_time_s < 0:
            raise ValueError("--system-tokens >= 0, --turns >= 1, --user-tokens >= 1 and --think-time-s >= 0")
        if not 0 <= self.stagger_s < math.inf:
            raise ValueError("--stagger-s must be a finite number >= 0")
        if self.stagger_s and self.kind == "single":
            raise ValueError("--stagger-s applies to --workload multiturn and longctx")
        if self.prompt_tokens_spread < 0:
            raise ValueError("--prompt-tokens-spread must be >= 0")
        if not MIN_TOKENS <= self.prompt_tokens_mean <= self.prompt_tokens_max:
            raise ValueError(
                f"--prompt-tokens-mean {self.prompt_tokens_mean} must be in [{MIN_TOKENS}, --prompt-tokens-max "
                f"{self.prompt_tokens_max}]"
            )

    @property
    def class_list(self) -> tuple[TrafficClass, ...]:
        return self.classes or (TrafficClass(DEFAULT_CLASS, 1.0, "diverse"),)


@dataclass(frozen=True)
class Turn:
    """One request a stream sends."""

    prompt: Prompt
    traffic_class: str
    session: str
    turn: int = 1
    # Seconds the stream waits before sending it (a user reading and typing).
    think_s: float = 0.0
    # Whether the script wants the reply's text back (to append it to the conversation).
    keep_reply: bool = False


# Sent the reply's text after each turn (""; or as received with keep_reply), None when it failed.
Script = Generator[Turn, str | None, None]


def draw_tokens(rng: random.Random, mean: float, cv: float, lo: int, hi: int) -> int:
    """A length from a lognormal distribution of this mean and coefficient of variation, in [lo, hi]."""
    if cv <= 0:
        return max(lo, min(hi, round(mean)))
    sigma2 = math.log1p(cv * cv)
    value = rng.lognormvariate(math.log(mean) - sigma2 / 2, math.sqrt(sigma2))
    return max(lo, min(hi, round(value)))


def draw_think(rng: random.Random, mean_s: float) -> float:
    """A think time: exponential of this mean, at most THINK_MAX_FACTOR times it."""
    if mean_s <= 0:
        return 0.0
    return min(rng.expovariate(1.0 / mean_s), THINK_MAX_FACTOR * mean_s)


def draw_class(rng: random.Random, classes: Sequence[TrafficClass]) -> TrafficClass:
    return rng.choices(classes, weights=[c.share for c in classes])[0]


def _user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def chat_prompt(messages: Sequence[dict[str, Any]]) -> Prompt:
    """A chat prompt; its completions text is the transcript with a role label per message."""
    text = "\n\n".join(f"{m['role'].capitalize()}: {m['content']}" for m in messages)
    return Prompt(tuple(messages), text if len(messages) > 1 else str(messages[0]["content"]))


class Workload:
    """One level's streams: `stream(i)` is stream i's script. Build one per level, so every level
    and every target starts the same sequences."""

    def __init__(self, spec: WorkloadSpec, bank: TextBank | None = None) -> None:
        self.spec = spec
        self._bank = bank
        if spec.kind == "single":
            # Shared by every stream, as the prompts of a sweep always were.
            self._rng = random.Random(f"single-{spec.seed}")
            self._sources = {c.name: source(c.kind, _class_seed(spec.seed, c.name)) for c in spec.classes} or {
                DEFAULT_CLASS: source(spec.prompts, spec.seed)
            }
        self._system = ""
        if spec.kind == "multiturn" and spec.system_tokens:
            rng = random.Random(f"system-{spec.seed}")
            self._system = self.bank.diverse(rng, tokens_to_chars(spec.system_tokens))

    @property
    def bank(self) -> TextBank:
        if self._bank is None:
            self._bank = TextBank(self.spec.seed)
        return self._bank

    @property
    def system_prompt(self) -> str:
        """The system prompt every multiturn session starts from ("" for the other workloads)."""
        return self._system

    def stream(self, index: int) -> Script:
        if self.spec.kind == "multiturn":
            return self._multiturn(index)
        if self.spec.kind == "longctx":
            return self._longctx(index)
        return self._single(index)

    def _single(self, index: int) -> Script:
        classes = self.spec.classes
        for n in _count():
            name = draw_class(self._rng, classes).name if classes else DEFAULT_CLASS
            yield Turn(next(self._sources[name]), name, f"{index}.{n}")

    def _longctx(self, index: int) -> Script:
        spec = self.spec
        rng = random.Random(f"longctx-{spec.seed}-{index}")
        for n in _count():
            cls = self.session_class(rng, index)
            tokens = draw_tokens(rng, spec.prompt_tokens_mean, spec.prompt_tokens_spread, MIN_TOKENS,
                                 spec.prompt_tokens_max)  # fmt: skip
            text = self.text(rng, cls.kind, tokens_to_chars(tokens))
            yield Turn(chat_prompt([_user(text)]), cls.name, f"{index}.{n}", think_s=self._stagger(index, n))

    def _stagger(self, index: int, session: int) -> float:
        """The wait before stream `index`'s `session` (counted from 1): only the first waits, a draw
        from a generator of its own, so a stagger leaves every stream's prompts as they were."""
        if session > 1 or not self.spec.stagger_s:
            return 0.0
        return random.Random(f"stagger-{self.spec.seed}-{index}").uniform(0.0, self.spec.stagger_s)

    def text(self, rng: random.Random, kind: ClassKind, chars: int) -> str:
        if kind == "repetitive":
            return self.bank.repetitive(rng, chars)
        if kind == "mixed":
            return mixed_text(self.bank.diverse(rng, chars - round(chars * MIXED_QUOTE)), chars)
        return self.bank.diverse(rng, chars)

    def session_class(self, rng: random.Random, index: int) -> TrafficClass:
        """The class of stream `index`'s next session: drawn, or by stream (classes_by_stream)."""
        classes = self.spec.class_list
        if self.spec.classes_by_stream:
            return classes[index % len(classes)]
        return draw_class(rng, classes)

    def _multiturn(self, index: int) -> Script:
        spec = self.spec
        rng = random.Random(f"multiturn-{spec.seed}-{index}")
        for n in _count():
            cls = self.session_class(rng, index)
            session = f"{index}.{n}"
            messages: list[dict[str, Any]] = [{"role": "system", "content": self._system}] if self._system else []
            # A code-editing session resends the same code every turn: one piece per session.
            piece = self.bank.piece(rng, tokens_to_chars(spec.user_tokens) // 16) if cls.kind == "repetitive" else ""
            for k in range(1, spec.turns + 1):
                # Not below half the mean, so a repetitive message still holds 8 copies of its piece.
                lo = max(MIN_TOKENS, spec.user_tokens // 2)
                tokens = draw_tokens(rng, spec.user_tokens, USER_TOKENS_CV, lo, max(lo, 4 * spec.user_tokens))
                chars = tokens_to_chars(tokens)
                text = repeat(piece, chars) if piece else self.text(rng, cls.kind, chars)
                messages.append(_user(text))
                think = draw_think(rng, spec.think_time_s) if k > 1 else self._stagger(index, n)
                reply = yield Turn(chat_prompt(messages), cls.name, session, k, think, keep_reply=True)
                if reply is None:
                    break
                messages.append({"role": "assistant", "content": reply})


def mixed_text(head: str, chars: int) -> str:
    """`head` followed by as much of its own opening as brings it to `chars` characters."""
    quote = max(0, chars - len(head) - 1)
    return f"{head} {head[:quote]}" if quote else head


def _count() -> Iterator[int]:
    n = 0
    while True:
        n += 1
        yield n


def _class_seed(seed: int, name: str) -> int:
    """A class's own seed, so two classes of one kind do not send the same prompts."""
    return random.Random(f"class-{seed}-{name}").getrandbits(32)
