"""Acceptance measured from streams, pooled by client so that no one client can buy it. Pure; the
clock is passed in.

The adaptive policy reads the speculative server's acceptance from the streams of probes (shadow
copies, or requests in a probe session): tokens over content events, one per decode step. Those
streams are copies of clients' requests, and a client chooses what it sends: prompts that repeat
themselves are accepted at 3-4 tokens a step, varied ones near 1. When the last reading stood for
everyone, one client sending `"the cat sat on the mat "*40` every 0.3 s moved the watermarks and
the mode for all. But the acceptance that decides where speculation pays is that of the traffic
the server would decode: each client's acceptance, weighted by the tokens that client is served.
So readings are kept by client key (an API key's hash, or the address), with each client's output
tokens:

    a = sum_k w_k * a_k / sum_k w_k      w_k = U_k * min(1, M_k / KEY_TOKENS)

a_k is the mean of client k's recent probes' readings (a probe's: tokens over decode steps), each
older probe's weight kept at POOL_KEEP as a new one joins: about its last four. A mean over
requests, not tokens over steps across them: a batch of streams advances each by its own acceptance
every step, so the mix's tokens a step is their plain mean (1.25 and 3.0 make 2.1, not the 1.8 that
pooling their tokens would say). A probe is one request of the client's, a shadow copy of 16 tokens
every 15-20 s (or a probe session's streams, which pool as one): a client whose requests are of
several kinds (a code assistant's and a chat's, accepting 3.0 and 1.25) is the mix of its last few
probes, not whichever kind the last one happened to copy (measured: with the latest probe alone, the
adaptive policy's acceptance on such traffic read 1.15-1.25 where the mix was 2.1, and its
watermarks fell to 0). A client whose traffic changes is read anew within a few probes. U_k is the
output tokens client k was served, through any server, and M_k the tokens its measurements counted,
both decayed with a half-life of MEMORY_S / 4: a client weighs what it asks the servers for (to
weigh more it must send more, and then its acceptance is the traffic's), and a short measurement
counts for less than a full one. Clients without a measurement are not in the mean; `wants_copy`
makes the probes pass over a client already measured in full while others are served, so that a
client sending all the time does not take every copy. The pooled value stands while the newest
measurement is younger than `fresh_s`; then the engine's own reading takes over, as before. At most
MAX_KEYS clients are kept, the stalest forgotten first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Tokens a measurement needs to count in full: one shadow probe (SPECGATE_ADAPTIVE_SHADOW_TOKENS'
# default).
KEY_TOKENS = 16.0
# How long a client's figures are kept since they last moved.
MEMORY_S = 60.0
# What a client's pool of probe streams keeps of itself as a new stream joins: its last few.
POOL_KEEP = 0.75
# Clients kept at once (an entry is a few floats).
MAX_KEYS = 1024
# A stream's acceptance is read from at least this many content events.
MIN_STREAM_EVENTS = 4


def stream_accept(tokens: int, events: int) -> float | None:
    """Acceptance length of one stream from its output tokens and content events, for engines that
    send one event per decode step; None below MIN_STREAM_EVENTS events. The first and last events
    are short of a full step (SGLang's first token comes from prefill; the last step is cut by
    max_tokens or a stop), so one event and one token are set aside: exact at acceptance 1, and
    within about 10% on a 16-token shadow probe either way."""
    if events < MIN_STREAM_EVENTS or tokens < events:
        return None
    return (tokens - 1) / (events - 1)


@dataclass
class _Entry:
    served: float = 0.0  # decayed output tokens served
    measured: float = 0.0  # decayed tokens measured
    accept: float | None = None  # the client's reading: its recent probes' mean
    measured_at: float = -math.inf
    at: float = -math.inf  # when any figure last moved (the decay's reference)
    # The probes before the latest, each older one kept at POOL_KEEP: the sum of their readings
    # and their weight.
    before_sum: float = 0.0
    before_n: float = 0.0
    # The latest probe: its session (None: a shadow), its streams' tokens and decode steps.
    session: int | None = None
    session_tokens: float = 0.0
    session_steps: float = 0.0


class AcceptanceEvidence:
    def __init__(
        self,
        fresh_s: float,
        memory_s: float = MEMORY_S,
        key_tokens: float = KEY_TOKENS,
        max_keys: int = MAX_KEYS,
        pool_keep: float = POOL_KEEP,
    ) -> None:
        self.fresh_s = fresh_s
        self.pool_keep = pool_keep
        self.memory_s = max(memory_s, fresh_s)
        self.key_tokens = key_tokens
        self.max_keys = max_keys
        self._half_life_s = self.memory_s / 4
        self._keys: dict[str, _Entry] = {}

    def __len__(self) -> int:
        return len(self._keys)

    def served(self, key: str, tokens: float, now: float) -> None:
        """Client `key` was served `tokens` output tokens."""
        if tokens > 0 and math.isfinite(tokens):
            self._touch(key, now).served += tokens

    def measured(self, key: str, tokens: float, accept: float, now: float, session: int | None = None) -> None:
        """`tokens` output tokens measured at acceptance length `accept` (>= 1) for client `key`:
        streams of one probe `session` pool by tokens into one probe's reading, and the client's
        reading is its recent probes' mean (the module's rule)."""
        if not (tokens > 0 and math.isfinite(tokens) and math.isfinite(accept) and accept >= 1.0):
            return
        entry = self._touch(key, now)
        entry.measured += tokens
        if session is None or session != entry.session or entry.session_steps <= 0:
            if entry.session_steps > 0:  # the latest probe joins those before it
                latest = entry.session_tokens / entry.session_steps
                entry.before_sum = entry.before_sum * self.pool_keep + latest
                entry.before_n = entry.before_n * self.pool_keep + 1.0
            entry.session, entry.session_tokens, entry.session_steps = session, 0.0, 0.0
        entry.session_tokens += tokens
        entry.session_steps += tokens / accept
        latest = entry.session_tokens / entry.session_steps
        keep = self.pool_keep
        entry.accept = (entry.before_sum * keep + latest) / (entry.before_n * keep + 1.0)
        entry.measured_at = now

    def value(self, now: float) -> float | None:
        """The pooled acceptance length, or None when no measurement is fresh."""
        self._forget(now)
        measured = [e for e in self._keys.values() if e.accept is not None]
        if not any(now - e.measured_at <= self.fresh_s for e in measured):
            return None
        num = den = 0.0
        for e in measured:
            k = self._decay(e, now)
            w = e.served * k * min(1.0, e.measured * k / self.key_tokens)
            num += w * (e.accept or 1.0)
            den += w
        if den <= 0:  # measured, but nothing served (only shadows' clients): by measurement alone
            return sum((e.accept or 1.0) * min(e.measured, self.key_tokens) for e in measured) / sum(
                min(e.measured, self.key_tokens) for e in measured
            )
        return num / den

    def wants_copy(self, key: str, now: float) -> bool:
        """Whether measuring client `key` again would add to the evidence: not while its measurement
        counts in full and other clients are being served (theirs may be unmeasured)."""
        entry = self._keys.get(key)
        if entry is None or entry.measured * self._decay(entry, now) < self.key_tokens:
            return True
        return not any(k != key and now - e.at <= self.fresh_s for k, e in self._keys.items())

    def clear(self) -> None:
        self._keys.clear()

    def _touch(self, key: str, now: float) -> _Entry:
        """The client's entry, its figures decayed to `now`, moved to the fresh end."""
        entry = self._keys.pop(key, None)
        if entry is None:
            entry = _Entry()
        else:
            k = self._decay(entry, now)
            entry.served *= k
            entry.measured *= k
        entry.at = now
        self._keys[key] = entry
        while len(self._keys) > self.max_keys:
            del self._keys[next(iter(self._keys))]
        return entry

    def _decay(self, entry: _Entry, now: float) -> float:
        return math.exp(-math.log(2.0) * max(0.0, now - entry.at) / self._half_life_s)

    def _forget(self, now: float) -> None:
        stale = [key for key, entry in self._keys.items() if now - entry.at > self.memory_s]
        for key in stale:
            del self._keys[key]
