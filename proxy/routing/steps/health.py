"""Health: a role that is down takes no new request. The mode's choice (or a batch request's) goes
to the other role where that one is up (reason only_healthy), to none where neither is
(no_healthy_backend). A request that failed before its first byte is retried once on the group's
other role (reason failover: Router.failover, at run time). The steps after this one never choose
a role that is down: each passes instead.
"""

from __future__ import annotations

from typing import Final

from ...policy.base import Decision, Reason, other
from .base import Ask, Here


class Health:
    name: Final = "health"
    reasons: Final[tuple[Reason, ...]] = ("only_healthy", "no_healthy_backend", "failover")

    def place(self, ask: Ask, here: Here, decision: Decision | None) -> Decision | None:
        if decision is None or decision.backend is None:
            return None
        healthy = here.snapshot.healthy
        if healthy.get(decision.backend, False):
            return None
        if healthy.get(other(decision.backend), False):
            return decision._replace(backend=other(decision.backend), reason="only_healthy")
        return decision._replace(backend=None, reason="no_healthy_backend")
