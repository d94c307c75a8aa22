"""A group's KV capacity: how many streams the speculative role holds before its pool is full, the
watermarks capped to it, and how full each role's pools are (the KV spill's reading).

the speculative server's memory, under the policies that learn (adaptive, model): its KV pool holds
K tokens (the engine's own figure, SGLang's max_total_num_tokens), the group's requests t tokens
each on average (prompts and output so far, this gateway's), and each conversation comes back g
tokens larger (its new message: Capacity.note_turn), so past K / (t + g) streams its
requests queue for memory and its prefix cache is evicted, however fast its steps are. So

    high' = min(high, floor(K / (t + g)))      low' = min(low, high' - max(1, ceil(high' / 4)))

(K summed over a pool's speculative servers), a class's high_c is capped alike. In a paired group
(SPECGATE_KV_FORECAST_S, F, 10 s by default) the tokens are read F seconds ahead, at their growth
over the last F (proxy/policy/forecast.py: the least-squares slope less half its standard error, never a fall),
while they are under half the pool (Capacity.growth_ahead), so that the cap a climbing load
will reach stops speculation while few conversations are there to prefill again on the baseline:
measured on the simulated H200, 8k-token chats opening over 20 s at 32 sessions, 12 s windows,
seeds 0-7, 0.98-1.02 of all-baseline's goodput against 0.84 reading them as they are (at 8 sessions,
where the pool never fills, 1.00 and 0.99 of all-speculative's). A switch off speculation at the
cap is not held for its re-prefill: staying re-prefills what the full pool evicts at every turn, a
switch once. On a shared GPU the speculative server's pool is the smaller (the draft's weights and
KV take their share): on the simulated H200, 229k tokens against the baseline's 419k, so 8k-token
chats fill it at about 27 streams, where the curves, which measure step times, put the crossover
near 40. Measured there at 32 sessions over 48 s: 2.81 requests a second of goodput with the cap
against 2.46 all-baseline and 1.37 all-speculative (new conversations, still short, go to
speculation until they grow); 0.71-0.94 with the cap's switch priced like any other, whose switches
came late and re-prefilled everything. In 12 s windows from a cold start the switch's one
re-prefill is most of the window (0.15-0.22x). threshold routes by its watermarks as configured.

Where memory, not speed, ends speculation in a paired group, every turn goes where the mode says,
the conversations cached on the speculative server included: they are prefilled again on the
baseline once. Keeping them on speculation until they ended (measured with the benchmark's
calibration at the wrong time scale, when it looked better) time-slices the shared GPU between
the two servers for as long as they last, with the speculative pool over-full: on the simulated
H200, 8k-token chats at 32 sessions, 12 s windows, seeds 0-3, 0.61, 0.44, 0.38 and 0.42 of
all-baseline's goodput against 1.03, 0.91, 0.76 and 0.74 with the switch (48 s windows, seeds 0
and 1: 5.27 and 4.94 requests a second against 5.27 and 5.08).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping

from ..fleet.servers import ServerView
from ..fleet.topology import Group
from ..policy.base import LEARNING, ROLES, SPECULATIVE, PolicyConfig, Role, hysteresis_low
from ..policy.calibration import MAX_WATERMARK
from ..policy.forecast import Trend
from .leases import InflightTracker

# Returning turns a group's turn_growth is the mean of, at most (then a moving average).
GROWTH_TURNS = 64
# The share of the speculative pool under which its footprint is read ahead (growth_ahead).
FORECAST_UNDER = 0.5


class Capacity:
    """One group's KV capacity. `interactive` gives the group's (streams, tokens) now."""

    __slots__ = (
        "_capped", "_clock", "_interactive", "_server_caps", "_servers", "_tracker", "_turns", "footprint", "group",
        "kv_streams", "read_at", "turn_growth",
    )  # fmt: skip

    def __init__(
        self,
        group: Group,
        servers: Mapping[str, ServerView],
        tracker: InflightTracker,
        interactive: Callable[[], tuple[int, int]],
        clock: Callable[[], float],
        forecast_s: float = 0.0,
    ) -> None:
        self.group = group
        self._servers = servers
        self._tracker = tracker
        self._interactive = interactive
        self._clock = clock
        # Streams the speculative role holds before its KV pool is full (capacity(), re-read at
        # most every UPDATE_EVERY_S by the router), and the configuration capped to it.
        self.kv_streams: int | None = None
        self._server_caps: dict[Role, int] = {}
        self._capped: tuple[PolicyConfig, int, PolicyConfig] | None = None
        self.read_at = -math.inf
        # Tokens a conversation's next turn adds to what its last left cached (note_turn): the mean
        # of the last GROWTH_TURNS returning turns, at most.
        self.turn_growth = 0.0
        self._turns = 0
        # The tokens the group's conversations would hold on the speculative pool, sampled with each
        # capacity reading, in a paired group under a learning policy with kv_forecast_s (the cap is
        # read at where their growth takes them kv_forecast_s ahead). None: read as they are.
        self.footprint: Trend | None = Trend(forecast_s) if forecast_s > 0 else None

    def read(self, now: float) -> bool:
        """Read the capacity again (kv_streams); True where it changed."""
        before, self.read_at, self.kv_streams = self.kv_streams, now, self.capacity()
        return self.kv_streams != before

    def note_turn(self, added: int) -> None:
        """A conversation came back with `added` more prompt tokens than its last turn left cached
        (its new message; negative, a conversation cut short, counts as none)."""
        self._turns = min(self._turns + 1, GROWTH_TURNS)
        self.turn_growth += (max(0, added) - self.turn_growth) / self._turns

    def _footprint(self) -> tuple[int, float]:
        """The group's streams, and the tokens they hold, each with room for its next turn
        (turn_growth: a conversation's cache is worth keeping only if the pool holds it when it
        comes back, larger)."""
        streams, tokens = self._interactive()
        return streams, tokens + streams * self.turn_growth

    def _streams_in(self, pool: int, ahead: float = 0.0) -> int | None:
        """Streams a KV pool of `pool` tokens holds at the tokens this gateway's streams in the
        group hold on average, each with room for its next turn (_footprint), and `ahead` more
        tokens over them all (the footprint's forecast growth); None while the group has no
        streams."""
        streams, held = self._footprint()
        tokens = held + ahead
        if not streams or tokens <= 0:
            return None
        return int(pool * streams // tokens)

    def capacity(self) -> int | None:
        """Streams the speculative role holds before its KV pool is full: its servers' pools over
        the tokens this gateway's streams in the group hold on average, each with room for its next
        turn (_streams_in); None while a pool's size or the streams' tokens are unknown."""
        pools = 0
        for s in self.group.of(SPECULATIVE):
            pool = self._servers[s].kv_capacity
            if pool is None:
                return None
            pools += pool
        held = self._streams_in(pools, self.growth_ahead(pools))
        return None if held is None else min(held, MAX_WATERMARK)

    def growth_ahead(self, pool: int) -> float:
        """Tokens the group's footprint (its requests' tokens, each with room for its next turn)
        grows by over the next kv_forecast_s, at its rate over the last (forecast.py); 0 without a
        forecast, or once the footprint is past FORECAST_UNDER of the `pool`: a switch then saves
        at most half the re-prefill one at the cap would cost, and a climb that stops short of the
        cap would have cost a switch and a return for nothing (measured on the simulated H200 pair,
        1k-token chats opening over 20 s at 128 sessions, whose footprint levels off at about 70% of
        the pool: read ahead to the end, a switch at 106 streams and a return in the window took its
        goodput from 46.0 to 29.4). Sampled here, at most every UPDATE_EVERY_S."""
        trend = self.footprint
        if trend is None:
            return 0.0
        _, held = self._footprint()
        trend.add(self._clock(), held)
        if held > pool * FORECAST_UNDER:
            return 0.0
        return trend.ahead(held) - held

    def server_caps(self) -> dict[Role, int]:
        """Streams one server of each role holds before its KV pool is full (the smallest of the
        role's pools, _streams_in), for the adaptive curves (crossover.held_at_capacity); a role
        whose pools are unknown is left out, and while the group has no streams the last reading
        stands."""
        for role in ROLES:
            pools = [p for s in self.group.of(role) if (p := self._servers[s].kv_capacity) is not None]
            if pools and len(pools) == len(self.group.of(role)):
                held = self._streams_in(min(pools))
                if held is not None:
                    self._server_caps[role] = max(1, held)
        return self._server_caps

    def capped(self, cfg: PolicyConfig) -> PolicyConfig:
        """`cfg` as the policy runs with it: under a learning policy, the speculative role's KV
        capacity, and the watermarks capped to it where it is below the high one; else as it is.
        The capacity is told where it is above the high watermark too: no probe goes out above the
        low watermark it allows, and a class's own high watermark is capped to it."""
        cap = self.kv_streams
        if cap is None or cfg.policy not in LEARNING:
            return cfg
        done = self._capped
        if done is not None and done[0] is cfg and done[1] == cap:
            return done[2]
        if cap >= cfg.high_watermark:
            capped = dataclasses.replace(cfg, capacity=cap)
        else:
            low = min(cfg.low_watermark, hysteresis_low(cap))
            capped = dataclasses.replace(cfg, high_watermark=cap, low_watermark=low, capacity=cap)
        self._capped = (cfg, cap, capped)
        return capped

    def kv_used(self, role: Role) -> tuple[float, float] | None:
        """The least and the most full of the role's KV pools, as fractions (steps/spill.py), over
        its servers that are up (a server down takes no request); None where an up server's is
        unknown, or none is up. A baseline pool is its engine's reading. A speculative one is that,
        or this gateway's tokens in flight there over the pool's size where that is more: the
        reading is a scrape old, and a burst spilled since would otherwise all go on it. That count
        takes each request's whole prompt, where the engine keeps a prefix they share once, so it
        errs toward full: on the speculative side toward no spill, and on the baseline's it would
        spill from a pool with room."""
        least, most = math.inf, 0.0
        local = role is SPECULATIVE
        for s in self.group.of(role):
            view = self._servers[s]
            if not view.healthy:
                continue
            used, pool = view.kv_usage, view.kv_capacity
            ours = self._tracker.tokens(s) / pool if local and pool else None
            if used is None or (ours is not None and ours > used):
                used = ours
            if used is None:
                return None
            least, most = min(least, used), max(most, used)
        return None if least == math.inf else (least, most)
