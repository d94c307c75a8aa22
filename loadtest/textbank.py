"""Text of any length from pieces computed once: diverse text that does not repeat itself and
repetitive text that does, scoring below 0.2 and above 0.8 on `prompts.repetitiveness` at any
length from 16 tokens up (the contract prompts.py states for its prompts).

Thirty-thousand-token conversations at hundreds of sessions must not make the load tester the
bottleneck, so nothing is drawn word by word per request: diverse text is a slice of one pool of
seeded random words built once per bank, repetitive text one short piece multiplied.
"""

from __future__ import annotations

import math
import random

from .prompts import material, vocabulary

# Text per token: the simulator's wire counts four bytes a token, about what real tokenizers get
# from English text.
CHARS_PER_TOKEN = 4
# The diverse pool (1 MiB, ~260k tokens): a diverse text longer than this repeats itself.
POOL_CHARS = 1 << 20
# Copies of its piece in a repetitive text: a text quoted k times scores about 1 - 1/k.
MIN_COPIES, MAX_COPIES = 12, 20
# Pieces of a few characters, for repetitive texts too short to quote a list or a function.
_SMALL_PIECES = ("ok\n", "go\n", "a=b\n", "nop\n", "i++;\n", "x += 1\n", "y = f(y)\n", "if a: b()\n")


def tokens_to_chars(tokens: int) -> int:
    return tokens * CHARS_PER_TOKEN


class TextBank:
    """The pieces, built once from `seed` (~0.1 s): the same seed gives the same texts for the same draws."""

    def __init__(self, seed: int = 0) -> None:
        rng = random.Random(f"textbank-{seed}")
        words = vocabulary()
        sentences: list[str] = []
        size = 0
        while size < POOL_CHARS:
            # Random words from ~700: a word 4-gram recurs about once in 10^11, so a slice of any
            # length scores ~0; sentences only so that the text looks like text.
            sentence = " ".join(rng.choices(words, k=rng.randint(6, 18))).capitalize() + ". "
            sentences.append(sentence)
            size += len(sentence)
        self.pool = "".join(sentences)

    def diverse(self, rng: random.Random, chars: int) -> str:
        """About `chars` characters of varied text from a random place in the pool."""
        pool = self.pool
        start = pool.find(" ", rng.randrange(len(pool))) + 1  # from a word's start
        out = pool[start : start + chars]
        while len(out) < chars:  # past the pool's end, on from its start
            out += pool[: chars - len(out)]
        return out.strip()

    def piece(self, rng: random.Random, chars: int) -> str:
        """A piece of at most about `chars` characters to quote: lists, code and log lines, or a
        short line when `chars` is too small for those."""
        small = [p for p in _SMALL_PIECES if len(p) <= chars]
        if chars < 40:
            return rng.choice(small) if small else _SMALL_PIECES[0]
        parts: list[str] = []
        size = 0
        while size < chars:
            parts.append(material(rng))
            size += len(parts[-1]) + 2
        return ("\n\n".join(parts) + "\n\n")[:chars]

    def repetitive(self, rng: random.Random, chars: int) -> str:
        """About `chars` characters that quote one piece 12 to 20 times (repetitiveness ~0.9)."""
        return repeat(self.piece(rng, chars // rng.randint(MIN_COPIES, MAX_COPIES)), chars)


def repeat(piece: str, chars: int) -> str:
    """`piece` over and over, cut at `chars` characters."""
    return (piece * math.ceil(chars / max(len(piece), 1)))[:chars].strip()
