"""The policy's configurations for unit tests, built the way the gateway builds them
(`Settings.policy_config`, `Settings.adaptive_config`), so the defaults have one source."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from proxy.adaptive import AdaptiveConfig
from proxy.config import Settings
from proxy.metrics import Metrics
from proxy.policy import PolicyConfig, PolicyName
from proxy.servers import Health, Server, servers_of
from proxy.topology import Topology

# What the policy does with nothing asked of the adaptive extras: no dwell, no probes, the
# shortest freshness the gateway uses. Tests of those extras set them.
PLAIN = {
    "min_dwell_s": 0.0,
    "probe_s": 0.0,
    "probe_max_s": 0.0,
    "probe_max_load": 0,
    "probe_shadow": False,
    "accept_fresh_s": 10.0,
}


def policy_cfg(
    policy: PolicyName = "threshold", high: int | None = None, low: int | None = None, **fields: Any
) -> PolicyConfig:
    """The settings' configuration for `policy`, with these watermarks and fields."""
    over: dict[str, Any] = {"policy": policy, **PLAIN, **fields}
    if high is not None:
        over["high_watermark"] = high
    if low is not None:
        over["low_watermark"] = low
    return dataclasses.replace(Settings(_env_file=None).policy_config(None), **over)


def adaptive_cfg(**fields: Any) -> AdaptiveConfig:
    return dataclasses.replace(Settings(_env_file=None).adaptive_config(), **fields)


@dataclass
class Rig:
    """What the gateway builds at start for these settings, nothing started: the servers (whose
    `health` a test sets as the health loops would) and the metrics."""

    settings: Settings
    topology: Topology
    servers: dict[str, Server]
    metrics: Metrics

    @property
    def health(self) -> dict[str, Health]:
        return {name: s.health for name, s in self.servers.items()}


def rig(**settings: Any) -> Rig:
    s = Settings(_env_file=None, **settings)
    t = s.routing_topology()
    return Rig(s, t, servers_of(t), Metrics(t.names(), [g.name for g in t.groups]))
