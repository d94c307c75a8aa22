"""The adaptive policy: the threshold rule with watermarks that move with the live workload
(beliefs.py estimates them), a dwell, probes of the idle speculative server, and, in a paired
group, a price on every switch.

adaptive (threshold whose watermarks move with the live workload, see beliefs.py): the
threshold rule with the live watermarks, plus

    a switch waits until the mode has lasted min_dwell_s      (reason dwell_hold)
    but a switch off speculation whose KV pool is full (below)
    in baseline mode, a probe session goes to an idle speculative server after probe_s, the wait
    doubling per session up to probe_max_s until the mode changes: requests one at a time until
    enough tokens came back to refresh its acceptance reading  (reason probe)
    or, with probe_shadow, the request goes where the mode says and a copy of it, capped to a
    few tokens and never shown to the client, goes to the idle speculative server (Decision.shadow)
    no return to speculation on an acceptance reading older than accept_fresh_s: a probe
    session first                                              (reason dwell_hold, then probe)
    no probe while the load is above max(low, hysteresis_low(C)), C the speculative pool's capacity
    in streams (below): speculation returns only at the low watermark, which no acceptance lifts
    past the band under a high watermark capped to C, and on a shared GPU each probe's prefill
    of a whole prompt takes the GPU from the baseline's batch

so that the speculative server's acceptance on today's traffic stays known while it gets none. And in
a paired group (the two servers on one GPU), where a switch moves every conversation to the other
server, which must prefill it again:

    a switch to role r waits while  G_r(L)  <  R / (P * H)                        (reason switch_cost)

G_r(L) what r gives at L over the mode now, less 1, by the better of the curves' throughput and
TPOT (crossover.py), as the watermarks follow the earlier of their crossings; R the tokens the group's requests hold
now (prompts and what they generated: each one's next turn resends them), P the prefill rate
(SPECGATE_PREFILL_TOK_S; 0: switches are not priced), H the curves' half-life
(SPECGATE_ADAPTIVE_HALF_LIFE_S): the span the estimate that calls for the switch weighs, taken as
how long the load it saw will last. The gain over H must pay for the GPU time the re-prefill takes.
Where the two servers tie, that holds the mode: measured on the simulated
H200 with 8k-token chats at 32 sessions, a switch half-way through a 12 s window re-prefilled
about 256k tokens (some 8 s of the GPU) and took the window's goodput to 0.58-0.79x of either fixed
choice. With short contexts R / P is a fraction of a second, and the rule changes little.

The probes themselves are a step of the pipeline (proxy/routing/steps/probe.py); this module holds
the mode's rule.
"""

from __future__ import annotations

import dataclasses
from typing import Final

from .base import BASELINE, SPECULATIVE, PolicyConfig, PolicyName, PolicyState, Reason, Role
from .threshold import mode_reason, next_mode


def leaves_full_pool(to: Role, load: int, cfg: PolicyConfig) -> bool:
    """Whether a switch to `to` leaves a speculative KV pool that `load` fills (cfg.capacity)."""
    return to == BASELINE and cfg.capacity is not None and load >= cfg.capacity


def switch_pays(to: Role, load: int, cfg: PolicyConfig, margin: float) -> bool:
    """Whether a switch to `to` gains at least `margin` (LoadSnapshot.switch_margin) at `load`; a
    switch off speculation whose KV pool is full always does."""
    if margin <= 0 or cfg.curves is None or leaves_full_pool(to, load, cfg):
        return True
    return cfg.curves.gain(to, load) >= margin


def dwell_mode(
    load: int, state: PolicyState, cfg: PolicyConfig, now: float, fresh: bool = True, switch_margin: float = 0.0
) -> tuple[PolicyState, Reason | None]:
    """The adaptive policy's hysteresis: next_mode, but no switch before the mode is min_dwell_s
    old, none that would not win back its re-prefill (`switch_margin`, switch_pays), and no return
    to speculation on a stale acceptance reading (`fresh` False: the speculative server has had no
    traffic for accept_fresh_s, so what the watermarks say of it may be minutes old; a probe
    session re-measures it first, unless probes are off). A switch off a full speculative pool
    (load at or past cfg.capacity) waits for neither the dwell nor the price: the dwell keeps a
    load wandering about a watermark from switching back and forth, and past the pool's capacity
    the load is not wandering, speculation's requests queue for memory and its cache is evicted at
    every turn. Returns the state and why a switch was held back (None: none was)."""
    nxt = next_mode(load, state, cfg, now)
    if nxt.mode == state.mode:
        return nxt, None
    if now - state.since < cfg.min_dwell_s and not leaves_full_pool(nxt.mode, load, cfg):
        return state, "dwell_hold"
    if not switch_pays(nxt.mode, load, cfg, switch_margin):
        return state, "switch_cost"
    if nxt.mode == SPECULATIVE and not fresh and cfg.probe_s > 0:
        return dataclasses.replace(state, probing=True), "dwell_hold"
    return PolicyState(nxt.mode, since=now), None


class AdaptivePolicy:
    """SPECGATE_POLICY=adaptive: the threshold rule at the live watermarks, with its dwell and the
    switch's price (the probes are a step of their own)."""

    name: PolicyName = "adaptive"
    learns: Final = True
    solves: bool = False

    def settle(
        self, load: int, spec_load: int, state: PolicyState, cfg: PolicyConfig, now: float, fresh: bool, margin: float
    ) -> tuple[PolicyState, Reason | None]:
        return dwell_mode(load, state, cfg, now, fresh, margin)

    def reason(self, mode: Role, load: int, state: PolicyState, cfg: PolicyConfig) -> Reason:
        return mode_reason(mode, load, state, cfg)
