"""Which adaptive server a request goes to (SPECGATE_ADAPTIVE_URL: servers that draft adaptively in
the engine, SGLang's --speculative-adaptive). Pure.

Such an engine chooses how far to draft for a whole batch, from the mean acceptance of what the
batch accepted lately: a batch that mixes a class accepting 3 tokens a step with one accepting 1.3
drafts too little for the first and too much for the second (SGLang's RFC #30263 names
"homogeneous-batch scheduling" the right long-term answer, inside the engine). Across servers
specgate can make batches homogeneous, by SPECGATE_ADAPTIVE_PLACEMENT:

- `least_loaded`: the least loaded healthy server (at random among near-ties), as any gateway;
- `homogeneous`: the classes that gain most from speculation (classes.py's ranking) take the first
  half of the adaptive servers as configured, the rest the second half (an odd one out to the
  first), each its half's least loaded healthy server, unless that one holds more than
  SLACK_REQUESTS + SLACK_SHARE x the least loaded server's load; then, and for a request of no
  ranked class, the least loaded. So each server's batch is of one kind of acceptance while the
  two kinds' load allows, and neither half queues while the other idles.

A conversation's next turn stays on the server holding its cache as for any role (affinity.py),
and the halves keep a class's conversations on its own servers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from ..policy.base import least_loaded

AdaptivePlacement = Literal["homogeneous", "least_loaded"]
PLACEMENTS: tuple[AdaptivePlacement, ...] = ("homogeneous", "least_loaded")
# A half's best server is passed over once it holds this many requests more than the least loaded
# server, plus this share of that server's load.
SLACK_REQUESTS = 2.0
SLACK_SHARE = 0.25


def half_of(gains: bool, servers: Sequence[str]) -> Sequence[str]:
    """The configured adaptive servers a class ranked `gains` prefers."""
    cut = (len(servers) + 1) // 2
    return servers[:cut] if gains else servers[cut:]


def homogeneous_choice(
    servers: Sequence[str], loads: Sequence[tuple[str, float]], gains: bool | None, pick: float
) -> str | None:
    """The adaptive server for a request of a class ranked `gains` (None: no rank), of the
    configured `servers`, given the healthy ones' placement loads (the module's rule)."""
    least = least_loaded(loads, pick)
    if least is None or gains is None or len(servers) < 2:
        return least
    own = set(half_of(gains, servers))
    mine = [(s, load) for s, load in loads if s in own]
    best = least_loaded(mine, pick)
    if best is None:
        return least
    load_of = dict(loads)
    floor = load_of[least]
    return best if load_of[best] <= floor + SLACK_REQUESTS + SLACK_SHARE * floor else least
