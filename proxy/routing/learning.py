"""What a group's learning policy (adaptive, model) believes of its traffic and servers: the
adaptive estimate and curves (proxy/policy/beliefs.py), the model policy's step-time model
(speedmodel.py), and the speculative role's acceptance: probes' evidence pooled by client
(evidence.py), the traffic classes' mix (classes.py), or the engine's own reading."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from ..fleet.engines import ENGINES
from ..fleet.servers import ServerView
from ..fleet.topology import Group
from ..policy.base import ROLES, SPECULATIVE, Policy, PolicyConfig
from ..policy.beliefs import ACCEPT_CHANGE, Adaptive, AdaptiveConfig
from ..policy.calibration import Calibration
from ..policy.evidence import AcceptanceEvidence, stream_accept
from ..policy.speedmodel import ModelLimits, StepModel
from .classes import ClassBook

# Where the traffic's acceptance was read, when its classes' mix stands for part of it.
_MIXED = {s: f"from traffic classes and {s}" for s in ("from probe streams", "live")}


class Learning:
    """One group's beliefs. `adaptive` and `speed` are None where the policy learns nothing (and
    `speed` without a fit in the calibration file)."""

    __slots__ = (
        "_classes",
        "_servers",
        "_spec_views",
        "accept_now",
        "accept_seen",
        "adaptive",
        "evidence",
        "group",
        "speed",
    )

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
        if not policy.learns:
            return
        if adaptive is None:
            raise ValueError("the adaptive policy needs its AdaptiveConfig")
        self.adaptive = Adaptive(adaptive, calibration, (cfg.high_watermark, cfg.low_watermark), clock())
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
