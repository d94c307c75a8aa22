"""What a group's learning policy (adaptive, model) believes of its traffic and servers: the
adaptive estimate and curves (proxy/policy/beliefs.py), the model policy's step-time model
(speedmodel.py), and the speculative role's acceptance: probes' evidence pooled by client
(evidence.py), the traffic classes' mix (classes.py), or the engine's own reading."""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Mapping

from ..fleet.engines import ENGINES
from ..fleet.servers import ServerView
from ..fleet.topology import Group
from ..policy.base import ROLES, SPECULATIVE, Policy, PolicyConfig, PolicyState, Role
from ..policy.beliefs import ACCEPT_CHANGE, UPDATE_EVERY_S, Adaptive, AdaptiveConfig
from ..policy.calibration import Calibration
from ..policy.evidence import AcceptanceEvidence, stream_accept
from ..policy.speedmodel import ModelLimits, StepModel
from .classes import ClassBook
from .steps.probe import probes_restarted

log = logging.getLogger("specgate.routing")

# Where the traffic's acceptance was read, when its classes' mix stands for part of it.
_MIXED = {s: f"from traffic classes and {s}" for s in ("from probe streams", "live")}


class Learning:
    """One group's beliefs. `adaptive` and `speed` are None where the policy learns nothing (and
    `speed` without a fit in the calibration file)."""

    __slots__ = (
        "_classes", "_servers", "_spec_views", "accept_now", "accept_seen", "adaptive", "evidence", "forecast_s",
        "group", "speed", "switch_per_token",
    )  # fmt: skip

    def __init__(
        self,
        cfg: PolicyConfig,
        policy: Policy,
        group: Group,
        servers: Mapping[str, ServerView],
        adaptive: AdaptiveConfig | None,
        calibration: Calibration | None,
        classes: ClassBook | None,
        clock: Callable[[], float],
        pooled: bool = False,
    ) -> None:
        self.group = group
        self._servers = servers
        self._spec_views = tuple(servers[s] for s in group.of(SPECULATIVE))
        self._classes = classes
        # Acceptance measured from probe streams, pooled by client: it stands while the newest
        # reading is younger than accept_fresh_s, then the engine's reading (which includes the
        # probes' steps once refreshed) takes over again.
        self.evidence = AcceptanceEvidence(cfg.accept_fresh_s)
        self.accept_seen: float | None = None
        # The acceptance and its source as last read (accept_live), which the model policy solves at
        # for every request and lease: read at most every UPDATE_EVERY_S, and at once when a probe's
        # evidence comes, as the adaptive policy reads it.
        self.accept_now: tuple[float | None, str] = (None, "live")
        self.adaptive: Adaptive | None = None
        self.speed: StepModel | None = None
        # 1 / (P * H), which prices a switch of a paired group per token it re-prefills
        # (adaptive.switch_pays; 0: not priced, as in a pool, whose conversations stay where their
        # cache is between the watermarks); and how far ahead its KV footprint is read (capacity.py).
        self.switch_per_token = 0.0
        self.forecast_s = 0.0
        if not policy.learns:
            return
        if adaptive is None:
            raise ValueError("the adaptive policy needs its AdaptiveConfig")
        self.adaptive = Adaptive(adaptive, calibration, (cfg.high_watermark, cfg.low_watermark), clock())
        if not pooled:
            self.forecast_s = adaptive.kv_forecast_s
            if adaptive.prefill_tok_s > 0:
                self.switch_per_token = 1.0 / (adaptive.prefill_tok_s * adaptive.half_life_s)
        if policy.solves and calibration is not None and calibration.model is not None:
            limits = ModelLimits(
                min_watermark=adaptive.min_watermark, max_watermark=adaptive.max_watermark, margin=adaptive.margin
            )
            counts = {role: len(group.of(role)) for role in ROLES}
            self.speed = StepModel(calibration.model, limits, counts)
            self.accept_now = self.accept_live(clock())

    def engine_accept(self) -> float | None:
        """The speculative servers' acceptance as their engines report it (their mean)."""
        views = self._spec_views
        if len(views) == 1:  # most groups: read for every pool's class request
            return views[0].spec_accept_length
        found = [a for v in views if (a := v.spec_accept_length) is not None]
        return sum(found) / len(found) if found else None

    def counts_steps(self) -> bool:
        """Whether the speculative servers' streams send one content event per decode step."""
        names = [v.engine for v in self._spec_views]
        return bool(names) and all(n is not None and ENGINES[n].stream_steps for n in names)

    def stream_accept(self, tokens: int, events: int) -> float | None:
        """A stream's acceptance from its tokens and content events, where its engine sends one
        event a step and the policy learns (None: nothing to learn from it)."""
        return stream_accept(tokens, events) if self.adaptive is not None and self.counts_steps() else None

    def accept_live(self, now: float) -> tuple[float | None, str]:
        """The traffic's acceptance on the speculative servers as believed now, and where it was
        read: its traffic classes' mix for the share of the traffic whose class's acceptance is
        known, and for the rest what probes or the engine read (classes.py)."""
        measured = self.evidence.value(now)
        live, source = (measured, "from probe streams") if measured is not None else (self.engine_accept(), "live")
        mix = self._classes.mix(now) if self._classes is not None else None
        if mix is None:
            return live, source
        accept, share = mix
        if live is None or share >= 1.0:
            return accept, "from traffic classes"
        return share * accept + (1.0 - share) * live, _MIXED[source]

    def reread(self, now: float) -> bool:
        """Read the acceptance again (accept_now); True where it moved by more than ACCEPT_CHANGE:
        the traffic changed, and probes should start again soon."""
        accept, _ = self.accept_now = self.accept_live(now)
        seen, self.accept_seen = self.accept_seen, accept
        return accept is not None and seen is not None and abs(accept - seen) > ACCEPT_CHANGE * seen

    def configured(self, cfg: PolicyConfig) -> PolicyConfig:
        """`cfg` with what the policy believes at the start: its watermarks, and its curves where
        switches are priced."""
        a = self.adaptive
        if a is None:
            return cfg
        high, low = a.watermarks()
        cfg = dataclasses.replace(cfg, high_watermark=high, low_watermark=low)
        return dataclasses.replace(cfg, curves=a.curves()) if self.switch_per_token else cfg

    def update(
        self, now: float, state: PolicyState, cfg: PolicyConfig, caps: Callable[[], dict[Role, int]]
    ) -> tuple[PolicyState, PolicyConfig] | None:
        """The mode's state and configuration once what the policy believes is read again, at most
        every UPDATE_EVERY_S (None: not due). `caps`: each role's streams a server holds (capacity.py)."""
        a = self.adaptive
        if a is None or now - a.updated_at < UPDATE_EVERY_S:
            return None
        if self.reread(now):
            state = probes_restarted(state)
        accept, source = self.accept_now
        if a.update(accept, now, source, caps()) and self.speed is None:
            high, low = a.watermarks()
            log.info("adaptive watermarks now high=%d low=%d: %s", high, low, a.estimate.why)
            cfg = dataclasses.replace(cfg, high_watermark=high, low_watermark=low)
        if self.switch_per_token:
            cfg = dataclasses.replace(cfg, curves=a.curves())
        return state, cfg

    def measured(self, client: str, tokens: int, accept: float, now: float, session: int | None = None) -> None:
        """A probe's stream measured `accept`: evidence, acted on at the next update."""
        assert self.adaptive is not None
        self.evidence.measured(client, tokens, accept, now, session)
        self.adaptive.updated_at = -math.inf

    def model_marks(self, load: int, streams: int, tokens: int) -> tuple[int, int]:
        """The model policy's watermarks at `load`, for `streams` interactive streams holding `tokens`."""
        assert self.speed is not None
        accept, source = self.accept_now
        return self.speed.watermarks(load, tokens, streams, accept, source)
