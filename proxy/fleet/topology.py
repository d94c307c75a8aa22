"""Which servers specgate routes to, and how they group (SPECGATE_TOPOLOGY).

`SPECGATE_SPECULATIVE_URL` and `SPECGATE_BASELINE_URL` each hold one base URL or a comma list;
an entry may be `NAME=URL` to name the server in metrics and `/routing` (a bounded set: the
configured ones). Unnamed servers are called by their role when a role has one server, else
`speculative-0`, `speculative-1`, ... in the order given.

- paired (the default when both lists are as long): the i-th speculative and i-th baseline
  server share GPUs and form `group-i`, with a mode and hysteresis of its own. A new request goes
  to the least-loaded healthy group, then to that group's server for its mode.
- pooled: the two roles are pools on disjoint GPUs, one group (`pool`) whose mode follows the
  total load; within the role, the least-loaded healthy server, chosen at random among near-ties.

One server of each role is one paired group: the simple case, as before.

`SPECGATE_ADAPTIVE_URL` lists servers that draft adaptively in the engine (SGLang's
`--speculative-adaptive`), each on GPUs of its own: they form one more group, `adaptive`, beside
the pair or pool, or alone (the speculative and baseline URLs set empty: topology `adaptive`).
Which of them a request goes to is proxy/routing/homogeneous.py's rule.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from ..policy.base import ROLES, Role

TopologyName = Literal["paired", "pooled"]
# A fleet of adaptive servers alone has no pair or pool.
TopologyKind = Literal["paired", "pooled", "adaptive"]
ADAPTIVE_GROUP = "adaptive"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")


@dataclass(frozen=True)
class ServerSpec:
    """One server as configured (a setting's entry); the running gateway's is servers.Server."""

    name: str
    role: Role
    url: str


@dataclass(frozen=True)
class Group:
    name: str
    # The servers of each role in this group: one each when paired.
    servers: dict[Role, tuple[str, ...]]

    def of(self, role: Role) -> tuple[str, ...]:
        return self.servers.get(role, ())

    @property
    def adaptive(self) -> bool:
        """Whether this is the group of adaptive servers (whose engines choose how far to draft)."""
        return Role.ADAPTIVE in self.servers


@dataclass(frozen=True)
class Topology:
    kind: TopologyKind
    servers: tuple[ServerSpec, ...]
    groups: tuple[Group, ...]

    def names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.servers)


def entries(raw: str) -> list[tuple[str | None, str]]:
    """(name or None, url) for each comma-separated entry of a URL setting."""
    out: list[tuple[str | None, str]] = []
    for part in raw.split(","):
        part = part.strip()
        if not part:
            continue
        name, sep, url = part.partition("=")
        # A URL holds no `=` before its scheme: `name=http://...`.
        if sep and "://" not in name:
            out.append((name.strip(), url.strip()))
        else:
            out.append((None, part))
    return out


def build(speculative: str, baseline: str, kind: TopologyName | None, adaptive: str = "") -> Topology:
    """The topology the settings describe; ValueError naming what is wrong."""
    lists: dict[Role, list[tuple[str | None, str]]] = {
        Role.SPECULATIVE: entries(speculative),
        Role.BASELINE: entries(baseline),
        Role.ADAPTIVE: entries(adaptive),
    }
    paired_roles = lists[Role.SPECULATIVE] or lists[Role.BASELINE]
    if not paired_roles and not lists[Role.ADAPTIVE]:
        raise ValueError("no server given")
    if not paired_roles and kind is not None:
        raise ValueError(f"SPECGATE_TOPOLOGY={kind} groups a pair or pool: with adaptive servers alone, leave it unset")
    if paired_roles:
        for role in ROLES:
            if not lists[role]:
                raise ValueError(
                    f"no {role} server given: a pair or pool needs both roles (servers that draft adaptively in "
                    "the engine go in SPECGATE_ADAPTIVE_URL)"
                )
    servers = [spec for role in Role for spec in _specs(role, lists[role])]
    names = [s.name for s in servers]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"server names must be unique: {', '.join(dupes)}")
    by_role = {role: tuple(s.name for s in servers if s.role == role) for role in Role}
    spec, base = by_role[Role.SPECULATIVE], by_role[Role.BASELINE]
    groups: tuple[Group, ...] = ()
    found: TopologyKind = "adaptive"
    if paired_roles:
        found = kind or ("paired" if len(spec) == len(base) else "pooled")
        groups = _groups(found, spec, base)
    if by_role[Role.ADAPTIVE]:
        groups += (Group(ADAPTIVE_GROUP, {Role.ADAPTIVE: by_role[Role.ADAPTIVE]}),)
    return Topology(found, tuple(servers), groups)


def _specs(role: Role, found: list[tuple[str | None, str]]) -> list[ServerSpec]:
    out = []
    for i, (name, url) in enumerate(found):
        if name is None:
            name = role if len(found) == 1 else f"{role}-{i}"
        elif not _NAME.fullmatch(name):
            raise ValueError(f"server name {name!r}: letters, digits, '.', '_' and '-' only, at most 63")
        out.append(ServerSpec(name, role, url.rstrip("/")))
    return out


def _groups(kind: TopologyName, spec: tuple[str, ...], base: tuple[str, ...]) -> tuple[Group, ...]:
    if kind == "pooled":
        return (Group("pool", {Role.SPECULATIVE: spec, Role.BASELINE: base}),)
    if len(spec) != len(base):
        raise ValueError(
            f"SPECGATE_TOPOLOGY=paired needs as many speculative as baseline servers ({len(spec)} and "
            f"{len(base)}): the i-th of each share GPUs"
        )
    return tuple(
        Group(f"group-{i}", {Role.SPECULATIVE: (s,), Role.BASELINE: (b,)})
        for i, (s, b) in enumerate(zip(spec, base, strict=True))
    )
