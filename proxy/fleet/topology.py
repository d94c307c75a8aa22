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
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from ..policy.base import ROLES, Role

TopologyName = Literal["paired", "pooled"]
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
        return self.servers[role]


@dataclass(frozen=True)
class Topology:
    kind: TopologyName
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


def build(speculative: str, baseline: str, kind: TopologyName | None) -> Topology:
    """The topology the settings describe; ValueError naming what is wrong."""
    lists: dict[Role, list[tuple[str | None, str]]] = {
        Role.SPECULATIVE: entries(speculative),
        Role.BASELINE: entries(baseline),
    }
    servers: list[ServerSpec] = []
    for role in ROLES:
        found = lists[role]
        if not found:
            raise ValueError(f"no {role} server given")
        for i, (name, url) in enumerate(found):
            if name is None:
                name = role if len(found) == 1 else f"{role}-{i}"
            elif not _NAME.fullmatch(name):
                raise ValueError(f"server name {name!r}: letters, digits, '.', '_' and '-' only, at most 63")
            servers.append(ServerSpec(name, role, url.rstrip("/")))
    names = [s.name for s in servers]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"server names must be unique: {', '.join(dupes)}")
    spec = tuple(s.name for s in servers if s.role == Role.SPECULATIVE)
    base = tuple(s.name for s in servers if s.role == Role.BASELINE)
    if kind is None:
        kind = "paired" if len(spec) == len(base) else "pooled"
    if kind == "paired":
        if len(spec) != len(base):
            raise ValueError(
                f"SPECGATE_TOPOLOGY=paired needs as many speculative as baseline servers ({len(spec)} and "
                f"{len(base)}): the i-th of each share GPUs"
            )
        groups = tuple(
            Group(f"group-{i}", {Role.SPECULATIVE: (s,), Role.BASELINE: (b,)})
            for i, (s, b) in enumerate(zip(spec, base, strict=True))
        )
    else:
        groups = (Group("pool", {Role.SPECULATIVE: spec, Role.BASELINE: base}),)
    return Topology(kind, tuple(servers), groups)
