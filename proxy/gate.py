"""What a request reaches at run time: every resource the app's lifespan made, in one container.

A module of its own so that the app factory (app.py) and the hot path (ingress.py, relay.py) all
import it from here, and none of them imports another to name it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .config import Settings
from .observability.metrics import Metrics
from .observability.tracing import Tracing
from .relay.shadow import Prober
from .relay.stored import StoredResponses
from .routing.affinity import AffinityTable
from .routing.classes import ClassBook
from .routing.fleet import Fleet
from .routing.tokens import TokenRatio
from .transport.health import HealthMonitor
from .transport.upstream import Upstream


@dataclass
class Gate:
    settings: Settings
    metrics: Metrics
    upstream: Upstream
    health: HealthMonitor
    fleet: Fleet
    # Shadow probes (adaptive policy, SPECGATE_ADAPTIVE_PROBE_MODE=shadow); None otherwise.
    prober: Prober | None = None
    # Which server holds each stored Responses API response (previous_response_id goes there).
    stored: StoredResponses = field(default_factory=lambda: StoredResponses(0))
    # OpenTelemetry traces (proxy/observability/tracing.py); None when off, the hot path's one test.
    tracing: Tracing | None = None
    # Prompt tokens the servers report over those estimated from bodies (proxy/routing/tokens.py).
    token_ratio: TokenRatio = field(default_factory=TokenRatio)
    # Where each conversation's last turn went (proxy/routing/affinity.py).
    affinity: AffinityTable = field(default_factory=lambda: AffinityTable(0))
    # What is known of each traffic class (proxy/routing/classes.py).
    classes: ClassBook = field(default_factory=lambda: ClassBook(1))
