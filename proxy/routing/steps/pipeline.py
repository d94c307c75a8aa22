"""The steps in order. A request continuing a stored response is pinned first (stored.py, at the
fleet, which also picks the group: by cache affinity for a conversation's turn, else the least
loaded). Then, in its group:

    priority   batch            a batch request to the baseline
    mode       light_load ...   the policy's role for the rest
    switch     client_on/off    what the client asked of speculation
    probe      probe            a probe of the idle speculative server, or a shadow copy
    health     only_healthy     never a role that is down
    class      class            a pool's classes by what each gains
    affinity   affinity         a pooled turn stays on its cache's role between the watermarks
    kv_spill   kv_spill         a full baseline spills to speculation's room

(the group of adaptive servers has one step, engine.py's), and, at the fleet, the server of the
role: the one holding the conversation's cache unless it is loaded past what the cache is worth
(proxy/routing/affinity.py), else the least loaded (an adaptive server: homogeneous.py).
"""

from __future__ import annotations

from collections.abc import Sequence

from ...policy.base import Decision, LoadSnapshot, Policy, PolicyConfig, PolicyState, PoolGains, Role
from ...policy.factory import policy_for
from . import stored
from .affinity import Affinity
from .base import Ask, Here, Step
from .classes import TrafficClass
from .engine import InEngine
from .health import Health
from .mode import Mode
from .priority import Priority
from .probe import Probe
from .spill import KvSpill
from .switch import ClientSwitch


def steps_for(policy: Policy, pooled: bool = True, adaptive: bool = False) -> tuple[Step, ...]:
    """A group's steps, in order: only those that can act in it (a probe and the spill under a
    learning policy, a class and a turn's role only where the roles are on disjoint GPUs; in the
    group of adaptive servers, one). The decision runs for every request, and a step that always
    passes costs each of them its call."""
    if adaptive:
        return (InEngine(),)
    acts = {"probe": policy.learns, "kv_spill": policy.learns, "class": pooled, "affinity": pooled}
    every = (Priority(), Mode(policy), ClientSwitch(), Probe(), Health(), TrafficClass(), Affinity(), KvSpill())
    return tuple(s for s in every if acts.get(s.name, True))


def run(steps: Sequence[Step], ask: Ask, here: Here) -> Decision:
    decision: Decision | None = None
    for step in steps:
        found = step.place(ask, here, decision)
        if found is not None:
            decision = found
    assert decision is not None  # the mode places every request
    return decision


def describe(steps: Sequence[Step]) -> list[dict[str, object]]:
    """The fleet's first step and a group's, in order, with the reasons each gives, as /routing
    shows them."""
    found: list[dict[str, object]] = [{"step": "stored_response", "reasons": [stored.REASON]}]
    found.extend({"step": s.name, "reasons": list(s.reasons)} for s in steps)
    return found


class _Unread:
    """A group with nothing to read: its pools' use and gains unknown (the steps then pass)."""

    def kv_used(self, role: Role) -> tuple[float, float] | None:
        return None

    def pool_gains(self, accept: float, loads: tuple[int, int] | None = None) -> PoolGains | None:
        return None

    def kv_streams(self) -> int | None:
        return None

    def prefill_ahead(self, role: Role) -> int:
        return 0


def decide(
    snapshot: LoadSnapshot, state: PolicyState, cfg: PolicyConfig, ask: Ask | None = None, pooled: bool = False
) -> Decision:
    """A group's decision from its snapshot alone (the steps' rules without the router: tests and
    the decision benchmark)."""
    return run(steps_for(policy_for(cfg.policy), pooled), ask or Ask(), Here(snapshot, cfg, state, pooled, _Unread()))
