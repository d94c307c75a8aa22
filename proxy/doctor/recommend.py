"""The topology and policy to run, with the reason, and the settings to paste. Pure.

paired (SPECGATE_TOPOLOGY=paired) is for a speculative and a baseline server sharing one GPU: one
runs at a time in effect, so a group's mode picks which. pooled is for servers on different GPUs or
hosts: both run at once, so the mode follows the total load (proxy/fleet/topology.py). Lists of
unequal length can only be pooled. Whether two servers on one host share a GPU cannot be seen over
HTTP: the operator says it (--shared-gpu / --separate-gpus), else it is assumed and said so.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

from ..config import Settings
from ..fleet.topology import TopologyKind, TopologyName
from ..policy.base import PolicyName
from .judge import Finding


@dataclass(frozen=True)
class Setup:
    """What the recommendation is made from."""

    # Each server as configured: (its name where one was given, its URL without credentials).
    speculative: Sequence[tuple[str | None, str]]
    baseline: Sequence[tuple[str | None, str]]
    shared_gpu: bool | None  # as the operator said; None: not said
    calibration: str | None  # the file's path
    calibration_has_model: bool
    topology_set: TopologyName | None  # SPECGATE_TOPOLOGY as set
    api_key_set: bool
    credentials_left_out: bool  # a URL held credentials, not shown
    # Servers that draft adaptively in the engine (SPECGATE_ADAPTIVE_URL).
    adaptive: Sequence[tuple[str | None, str]] = ()


@dataclass(frozen=True)
class Recommendation:
    topology: TopologyKind
    topology_why: str
    policy: PolicyName
    policy_why: str
    settings: tuple[str, ...]  # `SPECGATE_...=...` lines
    findings: tuple[Finding, ...]


def host(url: str) -> str:
    return (urlsplit(url).hostname or url).lower()


def topology(setup: Setup) -> tuple[TopologyKind, str]:
    spec, base = setup.speculative, setup.baseline
    if not spec and not base:
        return (
            "adaptive",
            "adaptive servers alone: their engines choose how far to draft, specgate where each request goes",
        )
    if len(spec) != len(base):
        return "pooled", f"{len(spec)} speculative and {len(base)} baseline servers: lists of unequal length are pooled"
    if setup.shared_gpu is True:
        return (
            "paired",
            "each speculative server shares its GPU with the baseline listed in its place (--shared-gpu)",
        )
    if setup.shared_gpu is False:
        return "pooled", "the servers run on separate GPUs (--separate-gpus): both can work at once"
    apart = [f"{s} and {b}" for (_, s), (_, b) in zip(spec, base, strict=True) if host(s) != host(b)]
    if apart:
        return "pooled", f"{apart[0]} are on different hosts, so on different GPUs: both can work at once"
    return "paired", (
        "each pair is on one host, assumed to share its GPU (pass --separate-gpus if they run on different GPUs)"
    )


def policy(setup: Setup, topo: TopologyKind) -> tuple[PolicyName, str]:
    """As docs/choosing.md's table: a pair's one mode follows its calibrated watermarks; a pool's
    roles are priced by the curves (or the speed model), which classes need."""
    if setup.calibration is None:
        default: PolicyName = Settings.model_fields["policy"].default
        return default, (
            "the gateway's default, on its default watermarks, a guess; run `specgate calibrate --save "
            "calibration.json` to measure where speculation stops paying on your servers"
        )
    if topo == "adaptive":
        default_policy: PolicyName = Settings.model_fields["policy"].default
        return default_policy, "no pair or pool to choose between: the policy does not act"
    if topo == "paired":
        return "threshold", "a pair sharing a GPU has one mode: the calibration file's watermarks decide it"
    if setup.calibration_has_model:
        return "model", "the calibration file holds a speed model: the model policy prices the pool's roles by it"
    return "adaptive", "the calibration file's curves price the pool's roles, kept current from traffic"


def recommend(setup: Setup) -> Recommendation:
    topo, topo_why = topology(setup)
    chosen, policy_why = policy(setup, topo)
    lines = [
        f"SPECGATE_SPECULATIVE_URL={_listed(setup.speculative) or 'none'}",
        f"SPECGATE_BASELINE_URL={_listed(setup.baseline) or 'none'}",
        f"SPECGATE_POLICY={chosen}",
    ]
    if topo != "adaptive":
        lines.insert(2, f"SPECGATE_TOPOLOGY={topo}")
    if setup.adaptive:
        lines.insert(2, f"SPECGATE_ADAPTIVE_URL={_listed(setup.adaptive)}")
    if setup.calibration is not None:
        lines.append(f"SPECGATE_CALIBRATION={setup.calibration}")
    if setup.api_key_set:
        lines.append("SPECGATE_UPSTREAM_API_KEY=<the servers' --api-key, as you set it>")
    found: list[Finding] = []
    if setup.topology_set is not None and setup.topology_set != topo:
        found.append(Finding("warning", f"SPECGATE_TOPOLOGY={setup.topology_set}, but {topo} fits: {topo_why}"))
    if setup.credentials_left_out:
        found.append(Finding("warning", "a server URL holds credentials, left out here: add them back"))
    return Recommendation(topo, topo_why, chosen, policy_why, tuple(lines), tuple(found))


def _listed(servers: Sequence[tuple[str | None, str]]) -> str:
    return ",".join(f"{name}={url}" if name else url for name, url in servers)
