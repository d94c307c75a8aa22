"""Probe: while a learning policy keeps everything on the baseline, a request now and then goes to
the idle speculative server (or a capped copy of it, a shadow), so that its acceptance on
today's traffic stays known while it gets none.

In baseline mode, a probe session goes to an idle speculative server after probe_s, the wait
doubling per session up to probe_max_s until the mode changes: requests one at a time until enough
tokens came back to refresh its acceptance reading (reason probe). With probe_shadow the request
goes where the mode says and a copy of it, capped to a few tokens and never shown to the client,
goes to the idle speculative server (Decision.shadow; proxy/relay/shadow.py sends it). No probe
while the load is above max(low, hysteresis_low(C)), C the speculative pool's capacity in streams
(proxy/routing/capacity.py): speculation returns only at the low watermark, and on a shared GPU each
probe's prefill of a whole prompt takes the GPU from the baseline's batch. What probes measure is
pooled by client (proxy/policy/evidence.py).
"""

from __future__ import annotations

import dataclasses
from typing import Final

from ...policy.base import (
    BASELINE,
    LEARNING,
    MODE_REASONS,
    SPECULATIVE,
    Decision,
    LoadSnapshot,
    PolicyConfig,
    PolicyState,
    Reason,
    hysteresis_low,
)
from .base import Ask, Here

# Doublings of the wait between probes that are counted (2**32 times any wait is past any maximum).
MAX_PROBE_DOUBLINGS = 32
# A probe session sends at most this many requests: requests that bring back no usage (errors)
# must not make a session endless.
PROBE_MAX_REQUESTS = 4


class Probe:
    name: Final = "probe"
    reasons: Final[tuple[Reason, ...]] = ("probe",)

    def place(self, ask: Ask, here: Here, decision: Decision | None) -> Decision | None:
        if decision is None or decision.reason not in MODE_REASONS:
            return None
        cfg, state = here.cfg, decision.state
        if cfg.policy not in LEARNING or not probe_due(here.snapshot, state, cfg, decision.load):
            return None
        # A session's first probe counts toward the wait before the next session.
        probes = state.probes if state.probing else min(state.probes + 1, MAX_PROBE_DOUBLINGS)
        if cfg.probe_shadow:
            # A shadow is a session of its own; the request itself goes on as decided.
            return decision._replace(state=dataclasses.replace(state, probes=probes, probing=False), shadow=True)
        state = _probe_sent(dataclasses.replace(state, probes=probes, probing=True), here.state.probing)
        return Decision(SPECULATIVE, "probe", state, decision.load)


def probe_due(snapshot: LoadSnapshot, state: PolicyState, cfg: PolicyConfig, load: int) -> bool:
    """Whether the next request should go to the idle speculative server to re-measure acceptance:
    at once during a probe session, else after a wait that doubles with each probe."""
    idle = snapshot.speculative_idle_since
    if cfg.probe_s <= 0 or state.mode != BASELINE or idle is None or load >= cfg.probe_max_load:
        return False
    if cfg.capacity is not None and load > max(cfg.low_watermark, hysteresis_low(cfg.capacity)):
        return False
    if not snapshot.healthy.get(SPECULATIVE, False):
        return False
    if state.probing:
        return True
    # The exponent is bounded: past the maximum wait more doublings change nothing, and 2.0**1024
    # overflows (a count that once grew by one a request while no copy could be sent).
    wait = min(cfg.probe_s * 2.0 ** min(state.probes, MAX_PROBE_DOUBLINGS), max(cfg.probe_s, cfg.probe_max_s))
    return snapshot.now - max(idle, state.since) >= wait


def _probe_sent(state: PolicyState, was_probing: bool) -> PolicyState:
    """A probe request went out: counted in its session (a new one unless one was under way); the
    session ends at PROBE_MAX_REQUESTS."""
    if not was_probing:
        state = dataclasses.replace(state, session=state.session + 1, session_requests=0, session_tokens=0)
    sent = state.session_requests + 1
    if sent >= PROBE_MAX_REQUESTS:
        return dataclasses.replace(state, probing=False, session_requests=0, session_tokens=0)
    return dataclasses.replace(state, session_requests=sent)


def probe_returned(state: PolicyState, tokens: int, probe_tokens: int) -> PolicyState:
    """A probe of the session under way came back with `tokens` output tokens: the session ends
    once `probe_tokens` came back (enough for the engine to refresh its acceptance reading)."""
    total = state.session_tokens + tokens
    if total >= probe_tokens:
        return dataclasses.replace(state, probing=False, session_requests=0, session_tokens=0)
    return dataclasses.replace(state, session_tokens=total)


def shadow_unsent(state: PolicyState) -> PolicyState:
    """The shadow a decision asked for could not be sent: it does not count as a probe."""
    return dataclasses.replace(state, probes=max(0, state.probes - 1))


def probes_restarted(state: PolicyState) -> PolicyState:
    """The traffic changed (acceptance moved): probe again soon rather than after a doubled wait."""
    return dataclasses.replace(state, probes=0) if state.probes else state
