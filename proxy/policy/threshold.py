"""The threshold policy: one mode for a group's new requests, with hysteresis.

threshold (one mode for new requests, with hysteresis):

    mode' = baseline     if mode = speculative and L >= high
          = speculative  if mode = baseline    and L <= low (for low_hold_s, when set)
          = mode         otherwise
    backend = mode'

The hold (SPECGATE_LOW_WATERMARK_HOLD_S, 2 s by default) is asymmetric on purpose: leaving
speculation early costs little, since the baseline serves a light load well, but a request sent to
the speculative server during a dip of a second stays there for its whole length, and the load is
back by then (reason return_hold while the load waits out the hold). Where the two servers tie, a
load wandering about the low watermark otherwise switches back and forth, and on a shared GPU each
switch leaves both servers busy while the old mode drains: measured in `loadtest scaleout
--defaults` at 40 streams, 0.94x the better fixed choice with no hold, 0.97x with 2 s (and
0.99-1.00x with the engine signal's /metrics read every 0.5 s, config.ENGINE_SCRAPE_INTERVAL_S).
"""

from __future__ import annotations

import dataclasses
from typing import Final

from .base import BASELINE, SPECULATIVE, PolicyConfig, PolicyName, PolicyState, Reason, Role


def next_mode(load: int, state: PolicyState, cfg: PolicyConfig, now: float = 0.0) -> PolicyState:
    """The threshold policy's hysteresis, also applied when requests finish. A high watermark of 0
    means speculation never pays: everything goes to the baseline."""
    if cfg.high_watermark == 0:
        # Kept as it is when already there: an adaptive probe session lives in this state.
        return state if state.mode == BASELINE else PolicyState(BASELINE)
    if state.mode == SPECULATIVE and load >= cfg.high_watermark:
        return PolicyState(BASELINE)
    if state.mode == BASELINE:
        if load > cfg.low_watermark:
            return state if state.low_since is None else dataclasses.replace(state, low_since=None)
        since = now if state.low_since is None else state.low_since
        if now - since >= cfg.low_hold_s:
            return PolicyState(SPECULATIVE)
        return state if state.low_since is not None else dataclasses.replace(state, low_since=since)
    return state


def return_held(load: int, state: PolicyState, cfg: PolicyConfig) -> bool:
    """Whether the state stays in baseline mode only because the low watermark's hold runs."""
    return state.mode == BASELINE and state.low_since is not None and load <= cfg.low_watermark


def mode_reason(mode: Role, load: int, state: PolicyState, cfg: PolicyConfig) -> Reason:
    """Why the threshold rule's mode (and the adaptive one's, where no switch was held) is `mode`."""
    if mode == SPECULATIVE:
        return "light_load"
    if load >= cfg.high_watermark:
        return "heavy_load"
    return "return_hold" if return_held(load, state, cfg) else "hysteresis_hold"


class ThresholdPolicy:
    """SPECGATE_POLICY=threshold: the watermarks as configured."""

    name: Final[PolicyName] = "threshold"
    learns: Final = False
    solves: Final = False

    def settle(
        self, load: int, spec_load: int, state: PolicyState, cfg: PolicyConfig, now: float, fresh: bool, margin: float
    ) -> tuple[PolicyState, Reason | None]:
        return next_mode(load, state, cfg, now), None

    def reason(self, mode: Role, load: int, state: PolicyState, cfg: PolicyConfig) -> Reason:
        return mode_reason(mode, load, state, cfg)
