"""The client's switch (proxy/routing/switch.py says how a request asks): right after the mode, so
that no later step moves what a client asked for.

    off:  backend = baseline      if it is up                                   (reason client_off)
    on:   backend = speculative   if it is up and S < C                          (reason client_on)
    else, and for a batch request, the decision as the steps make it without the switch

S the speculative role's load and C the streams its KV pool holds (capacity.py; unknown: no cap):
a request sent to a full pool waits for memory however fast its steps are, and a batch request
never takes speculation's room (priority.py). Where `on` cannot be honoured the decision's own
reason (heavy_load, only_healthy, ...) says why, in x-specgate-reason. In a pair the switch splits
one GPU's batch between its two servers, which costs both (steps/classes.py); the client chose that.
"""

from __future__ import annotations

from typing import Final

from ...policy.base import BASELINE, SPECULATIVE, Decision, Reason, backend_load
from .base import Ask, Here


class ClientSwitch:
    name: Final = "switch"
    reasons: Final[tuple[Reason, ...]] = ("client_on", "client_off")

    def place(self, ask: Ask, here: Here, decision: Decision | None) -> Decision | None:
        asked = ask.speculation
        if asked is None or decision is None or decision.reason == "batch":
            return None
        healthy = here.snapshot.healthy
        if asked == "off":
            if not healthy.get(BASELINE, False):
                return None
            return Decision(BASELINE, "client_off", decision.state, decision.load)
        if not healthy.get(SPECULATIVE, False):
            return None
        capacity = here.cfg.capacity if here.cfg.capacity is not None else here.group.kv_streams()
        if capacity is not None and backend_load(here.snapshot, SPECULATIVE, here.cfg.load_signal) >= capacity:
            return None
        return Decision(SPECULATIVE, "client_on", decision.state, decision.load)
