"""Cache affinity, the role: a pooled group keeps a conversation's turn on the role whose server
holds its cache, between the watermarks. Which group and which of the role's servers a turn goes
to is the fleet's part of the same rule (proxy/routing/fleet.py, priced in
proxy/routing/affinity.py).

a turn of a conversation whose cache one server holds (affinity.py), whatever the policy but spillover,
in a pooled topology (the roles on disjoint GPUs):

    backend = the held server's role   if low < L < high and that role is up      (reason affinity)

since between the watermarks either role pays, and moving costs the conversation's re-prefill. Not
in a paired group: there the held role is the one the mode left, and a turn sent back to it
time-slices the shared GPU for as long as it decodes, every step of the other server's batch waiting
for one of its own. That costs far more than the re-prefill it saves (measured on the simulated
H200, 1k-token chats at 128 sessions: one turn held on the speculative server while 127 decoded on
the baseline took the window's goodput from 41.3 to 36.3 requests a second), so in a pair the
mode decides every turn's role, as it does every class's; affinity still picks the group.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from ...policy.base import MODE_REASONS, Decision, PolicyConfig, Reason, Role
from .base import Ask, Here


class Affinity:
    name: Final = "affinity"
    reasons: Final[tuple[Reason, ...]] = ("affinity",)

    def place(self, ask: Ask, here: Here, decision: Decision | None) -> Decision | None:
        if ask.held is None or decision is None or decision.reason in ("class", "affinity"):
            return None
        found = affinity_choice(decision, ask.held, here.cfg, here.snapshot.healthy, here.pooled)
        return None if found is decision else found


def affinity_choice(
    decision: Decision, held: Role, cfg: PolicyConfig, healthy: Mapping[Role, bool], pooled: bool = True
) -> Decision:
    """The decision for a turn whose cache a server of role `held` holds (the module's rule);
    `pooled`: the roles are on disjoint GPUs (a pair's are not, and there the mode decides)."""
    if not pooled or decision.backend is None or decision.backend == held or decision.reason not in MODE_REASONS:
        return decision
    if cfg.policy == "spillover" or not healthy.get(held, False):
        return decision
    if cfg.low_watermark < decision.load < cfg.high_watermark:
        return Decision(held, "affinity", decision.state, decision.load)
    return decision
