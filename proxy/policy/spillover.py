"""The spillover policy: the speculative server as a bounded first choice.

spillover (the speculative server as a bounded first choice):

    backend = speculative if S < limit else baseline

S is the speculative role's own load. No hysteresis, probes or learning: the limit is the whole rule.
"""

from __future__ import annotations

from typing import Final

from .base import BASELINE, SPECULATIVE, PolicyConfig, PolicyName, PolicyState, Reason, Role


class SpilloverPolicy:
    """SPECGATE_POLICY=spillover: SPECGATE_SPILLOVER_LIMIT requests on speculation, the rest to the baseline."""

    name: Final[PolicyName] = "spillover"
    learns: Final = False
    solves: Final = False

    def settle(
        self, load: int, spec_load: int, state: PolicyState, cfg: PolicyConfig, now: float, fresh: bool, margin: float
    ) -> tuple[PolicyState, Reason | None]:
        return PolicyState(SPECULATIVE if spec_load < cfg.spillover_limit else BASELINE), None

    def reason(self, mode: Role, load: int, state: PolicyState, cfg: PolicyConfig) -> Reason:
        return "light_load" if mode == SPECULATIVE else "spillover"
