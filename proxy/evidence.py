"""Acceptance measured from streams, pooled so that no one client can buy it. Pure; the clock is
passed in.

The adaptive policy reads the speculative server's acceptance from the streams of probes (shadow
copies, or requests in a probe session): tokens over content events, one per decode step. Those
streams are copies of clients' requests, and a client chooses what it sends: prompts that repeat
themselves are accepted at 3-4 tokens a step, varied ones near 1. When the last reading stood for
everyone, one client sending `"the cat sat on the mat "*40` every 0.3 s moved the watermarks and
the mode for all. So readings are evidence, kept by client key (an API key's hash, or the address):

    a = sum_k w_k * a_k / sum_k w_k      w_k = min(T_k, KEY_TOKENS)

a_k is client k's latest measurement (one shadow probe's stream, or a probe session's streams
pooled by tokens: tokens over decode steps), so a client whose traffic changes is read anew at
once. T_k is the tokens measured from client k, decayed with a half-life of MEMORY_S / 4: weighted
by tokens, a short reading counts for what it measured; capped, every client with a full reading
counts the same, however much it sends. Probes are rare (one every 15-20 s by default), so readings
of different clients are pooled over MEMORY_S, while the pooled value stands only as long as the
newest reading is fresh (`fresh_s`); then the engine's own reading takes over, as before. At most
MAX_KEYS clients are kept, the stalest forgotten first. `saturated` and `others` let the probes
pass over a client that already counts fully while others are measured, so that one client
sending all the time does not take every copy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Tokens of evidence at which a client counts fully: one shadow probe (SPECGATE_ADAPTIVE_SHADOW_TOKENS'
# default). More, and a client whose requests were copied once would count less than one copied often.
KEY_TOKENS = 16.0
# How long a client's reading is pooled with the others'.
MEMORY_S = 60.0
# Clients kept at once.
MAX_KEYS = 64


@dataclass
class _Entry:
    accept: float  # the latest measurement
    tokens: float  # decayed tokens measured, for the weight
    at: float
    session: int | None  # the probe session the latest measurement pools, if any
    session_tokens: float
    session_steps: float


class AcceptanceEvidence:
    def __init__(
        self, fresh_s: float, memory_s: float = MEMORY_S, key_tokens: float = KEY_TOKENS, max_keys: int = MAX_KEYS
    ) -> None:
        self.fresh_s = fresh_s
        self.memory_s = max(memory_s, fresh_s)
        self.key_tokens = key_tokens
        self.max_keys = max_keys
        self._half_life_s = self.memory_s / 4
        self._keys: dict[str, _Entry] = {}

    def __len__(self) -> int:
        return len(self._keys)

    def add(self, key: str, tokens: float, accept: float, now: float, session: int | None = None) -> None:
        """`tokens` output tokens measured at acceptance length `accept` (>= 1) for client `key`;
        streams of one probe `session` pool into one measurement, by tokens."""
        if not (tokens > 0 and math.isfinite(tokens) and math.isfinite(accept) and accept >= 1.0):
            return
        entry = self._keys.pop(key, None)  # re-inserted last: the dict's order is the staleness order
        if entry is None:
            entry = _Entry(accept, 0.0, now, None, 0.0, 0.0)
        entry.tokens = entry.tokens * self._decay(entry, now) + tokens
        if session is None or session != entry.session:
            entry.session, entry.session_tokens, entry.session_steps = session, 0.0, 0.0
        entry.session_tokens += tokens
        entry.session_steps += tokens / accept
        entry.accept = entry.session_tokens / entry.session_steps
        entry.at = now
        self._keys[key] = entry
        while len(self._keys) > self.max_keys:
            del self._keys[next(iter(self._keys))]

    def value(self, now: float) -> float | None:
        """The pooled acceptance length, or None when no reading is fresh."""
        self._forget(now)
        if not any(now - e.at <= self.fresh_s for e in self._keys.values()):
            return None
        num = den = 0.0
        for entry in self._keys.values():
            w = min(entry.tokens * self._decay(entry, now), self.key_tokens)
            num += w * entry.accept
            den += w
        return num / den if den > 0 else None

    def saturated(self, key: str, now: float) -> bool:
        """Whether client `key` already counts fully: more of its requests would add little."""
        entry = self._keys.get(key)
        return entry is not None and entry.tokens * self._decay(entry, now) >= self.key_tokens

    def others(self, key: str, now: float) -> bool:
        """Whether any client but `key` has a reading pooled now."""
        return any(k != key and now - e.at <= self.memory_s for k, e in self._keys.items())

    def clear(self) -> None:
        self._keys.clear()

    def _decay(self, entry: _Entry, now: float) -> float:
        return math.exp(-math.log(2.0) * max(0.0, now - entry.at) / self._half_life_s)

    def _forget(self, now: float) -> None:
        stale = [key for key, entry in self._keys.items() if now - entry.at > self.memory_s]
        for key in stale:
            del self._keys[key]
