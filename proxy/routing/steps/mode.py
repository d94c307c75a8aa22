"""The mode: the group's policy (threshold, spillover, adaptive, model) chooses the role for every
request no step before it placed."""

from __future__ import annotations

from typing import Final

from ...policy.base import Decision, Policy, Reason, mode_decision
from .base import Ask, Here

# Every reason a policy gives.
MODE_REASONS_GIVEN: tuple[Reason, ...] = (
    "light_load", "heavy_load", "hysteresis_hold", "return_hold", "spillover", "dwell_hold", "switch_cost",
)  # fmt: skip


class Mode:
    name: Final = "mode"

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.reasons: tuple[Reason, ...] = MODE_REASONS_GIVEN

    def place(self, ask: Ask, here: Here, decision: Decision | None) -> Decision | None:
        return None if decision is not None else mode_decision(self.policy, here.snapshot, here.state, here.cfg)
