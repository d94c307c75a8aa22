"""In engine: the group of adaptive servers (SPECGATE_ADAPTIVE_URL) has one role, whose engines
choose how far to draft batch by batch; every request goes to it while one of its servers is up
(reason in_engine), to none where none is (no_healthy_backend). Which of its servers is
proxy/routing/homogeneous.py's rule. A batch request goes there too (no baseline to take it); a
client's switch has no server to choose here (a fleet with a pair or pool beside sends a request
that asks to one of those: proxy/routing/fleet.py).
"""

from __future__ import annotations

from typing import Final

from ...policy.base import ADAPTIVE, Decision, Reason
from .base import Ask, Here


class InEngine:
    name: Final = "in_engine"
    reasons: Final[tuple[Reason, ...]] = ("in_engine", "no_healthy_backend")

    def place(self, ask: Ask, here: Here, decision: Decision | None) -> Decision | None:
        load = here.snapshot.inflight.get(ADAPTIVE, 0)
        if here.snapshot.healthy.get(ADAPTIVE, False):
            return Decision(ADAPTIVE, "in_engine", here.state, load)
        return Decision(None, "no_healthy_backend", here.state, load)
