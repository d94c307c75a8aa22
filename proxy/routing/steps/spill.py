"""KV spill: once every baseline KV pool is full, a request the mode or its class sends there goes
to the speculative role, where its pool has room.

the baseline's memory, under the policies that learn: once every baseline server's KV pool is full,
a new request waits there for memory however fast its steps would be, while the speculative
servers' pools may stand half empty (on a shared GPU each server has a pool of its own). So a
request the mode or its class sends to the baseline goes to the speculative role instead when

    min_b u_b >= F   and   max_s u_s < (F if its conversation's cache is on the speculative role, else R)
    and its conversation's cache is not on the baseline, and the speculative role is up
                                                                                (reason kv_spill)

u a server's KV pool in use, over the servers that are up: its engine's reading (SGLang
token_usage, vLLM kv_cache_usage_perc), and for a speculative server the larger of that and this
gateway's tokens in flight there over the pool's size (the reading is a scrape old, and what was
spilled since is in the second; capacity.Capacity.kv_used; where its engine says nothing, the
second alone), unknown (no spill) where neither is known; F
SPECGATE_KV_SPILL_AT (0: off), R SPECGATE_KV_SPILL_ROOM. In a fleet of groups, the group chosen
(by load) is the one whose pools are read. New conversations spill only while
the speculative pools are under R, leaving room for those there to grow; a conversation whose cache
is on the speculative role (the affinity table's: one spilled already) keeps it while they are
under F. A conversation whose cache is on the baseline waits
there: a move would prefill it again into the pool that has room, which costs more than waiting
for memory where it is cached. Probes, batch requests, failovers and stored responses never spill.
Measured on the simulated H200 pair, 8k-token chats at 128 sessions (the baseline's 419k tokens
full, the speculative server's 229k all but empty under the mode), 12 s windows, seeds 0-2: with
F 0.9 and R 0.6, 28-32% of requests spilled, 0.08-0.32 requests a second met the SLOs where
neither fixed choice served one, and 1.16-1.23x the better fixed choice's output tokens a second
(R 0.8, with the baseline read as the larger of its gauge and this gateway's count: 22-36%,
0.07-0.22, 0.98-1.19x); at 32 sessions, whose conversations fit, none spilled, and
on a pool at 128 sessions the goodput was the same with it and without (1.83 requests a second,
the mean of two seeds and two copies, each way).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from ...policy.base import BASELINE, LEARNING, MODE_REASONS, SPECULATIVE, Decision, PolicyConfig, Reason, Role
from .base import Ask, Here
from .probe import shadow_unsent

# The decisions a full baseline may send to speculation: the mode's and a class's.
_SPILLABLE = MODE_REASONS | {"class"}


class KvSpill:
    name: Final = "kv_spill"
    reasons: Final[tuple[Reason, ...]] = ("kv_spill",)

    def place(self, ask: Ask, here: Here, decision: Decision | None) -> Decision | None:
        cfg = here.cfg
        if decision is None or decision.backend is not BASELINE or not spills(decision, ask.held, cfg):
            return None
        # The speculative role's pools are read only where the baseline's are full (the decision is
        # made for every request, and mostly they are not).
        pools = here.group.kv_used(BASELINE)
        if pools is None or pools[0] < cfg.kv_spill_at:
            return None
        room = here.group.kv_used(SPECULATIVE)
        found = kv_spill(decision, ask.held, cfg, here.snapshot.healthy, pools[0], None if room is None else room[1])
        return None if found is decision else found


def spill_on(cfg: PolicyConfig) -> bool:
    """Whether a full baseline spills at all: a learning policy, with SPECGATE_KV_SPILL_AT above 0."""
    return cfg.kv_spill_at > 0 and cfg.policy in LEARNING


def spills(decision: Decision, held: Role | None, cfg: PolicyConfig) -> bool:
    """Whether the baseline's full KV pools may send `decision` to speculation (the module's rule),
    before any pool is read: a mode's or a class's choice of the baseline, with the spill on, for a
    request whose conversation's cache (`held`) is not on the baseline."""
    return decision.backend == BASELINE and held != BASELINE and decision.reason in _SPILLABLE and spill_on(cfg)


def kv_spill(
    decision: Decision,
    held: Role | None,
    cfg: PolicyConfig,
    healthy: Mapping[Role, bool],
    baseline_used: float | None,
    speculative_used: float | None,
) -> Decision:
    """The decision once the KV pools are read (the module's rule): `baseline_used` the least full
    of the baseline's pools, `speculative_used` the most full of the speculative role's (fractions;
    None: unknown, no spill)."""
    if not spills(decision, held, cfg) or not healthy.get(SPECULATIVE, False):
        return decision
    if baseline_used is None or speculative_used is None or baseline_used < cfg.kv_spill_at:
        return decision
    room = cfg.kv_spill_at if held == SPECULATIVE else cfg.kv_spill_room
    if speculative_used >= room:
        return decision
    # The request itself measures the speculative server now: a shadow due goes unsent, uncounted.
    state = shadow_unsent(decision.state) if decision.shadow else decision.state
    return Decision(SPECULATIVE, "kv_spill", state, decision.load)
