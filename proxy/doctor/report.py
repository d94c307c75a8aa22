"""The doctor's report: text for a person, JSON for a script. Only formatting: the findings and the
recommendation are judge.py's and recommend.py's. Nothing here is secret: URLs come without
credentials, the probe's text is never kept, the API key never reaches this module."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from ..policy.base import LoadSignal
from .judge import Finding, ServerVerdict
from .recommend import Recommendation

MARKS = {"error": "ERROR", "warning": "WARN ", "ok": "ok   "}


@dataclass(frozen=True)
class Diagnosis:
    servers: Sequence[ServerVerdict]
    fleet: Sequence[Finding]
    load_signal: LoadSignal
    recommendation: Recommendation

    @property
    def findings(self) -> list[Finding]:
        return [f for v in self.servers for f in v.findings] + [*self.fleet, *self.recommendation.findings]

    @property
    def blocks(self) -> bool:
        return any(f.blocks for f in self.findings)


def _size(value: int | None) -> str:
    return f"{value:,} tokens" if value is not None else "not reported"


def server_lines(v: ServerVerdict) -> list[str]:
    o = v.obs
    head = f"{o.role} {o.url}" + (f" ({o.name})" if o.name != o.role else "")
    if o.error is not None:
        return [head, f"  reachable:    no ({o.error})"]
    a = v.acceptance
    speculates = {True: "yes", False: "no", None: "unknown"}[a.speculates]
    shown = f", acceptance {a.value:.2f}" if a.value is not None else ""
    return [
        head,
        f"  reachable:    yes, /health {'200' if o.health is None else o.health}",
        f"  engine:       {v.engine.name if v.engine else 'unknown'} ({v.engine_how})",
        f"  metrics:      {'yes' if o.metrics_problem is None else o.metrics_problem}",
        f"  model:        {', '.join(o.facts.models) or 'none listed'}",
        f"  context:      {_size(o.facts.context_len)}",
        f"  KV pool:      {_size(v.kv_pool)}",
        f"  speculates:   {speculates}{shown} ({a.how})",
        f"  engine load:  {'readable' if v.load_readable else 'not readable'}",
    ]


def text(d: Diagnosis) -> str:
    out: list[str] = ["specgate doctor", ""]
    for v in d.servers:
        out += [*server_lines(v), ""]
    readable = all(v.load_readable for v in d.servers)
    out.append(
        f"load signal: SPECGATE_LOAD_SIGNAL={d.load_signal}"
        + (" (this replica's requests in flight)" if d.load_signal == "local" else "")
        + f"; the engines' load is {'readable on every server' if readable else 'not readable on every server'}"
    )
    out.append("")
    problems = [f for f in d.findings if f.level != "ok"]
    out.append("problems:" if problems else "problems: none")
    out += [f"  {MARKS[f.level]} {f.message}" for f in problems]
    r = d.recommendation
    out += ["", f"topology: {r.topology}: {r.topology_why}", f"policy:   {r.policy}: {r.policy_why}", ""]
    out.append("settings to use:")
    out += [f"  {line}" for line in r.settings]
    out += ["", "verdict: " + ("something blocks: fix the ERROR lines above" if d.blocks else "ready")]
    return "\n".join(out) + "\n"


def as_json(d: Diagnosis) -> str:
    def server(v: ServerVerdict) -> dict[str, Any]:
        o, a = v.obs, v.acceptance
        return {
            "name": o.name,
            "role": str(o.role),
            "url": o.url,
            "reachable": o.error is None,
            "error": o.error,
            "health": "ok" if o.health is None else o.health,
            "engine": v.engine.name if v.engine else None,
            "engine_detected_by": v.engine_how,
            "metrics": o.metrics_problem is None,
            "models": list(o.facts.models),
            "context_len": o.facts.context_len,
            "kv_pool_tokens": v.kv_pool,
            "speculates": a.speculates,
            "accept_length": a.value,
            "acceptance_from": a.how,
            "engine_load_readable": v.load_readable,
        }

    r = d.recommendation
    doc = {
        "ok": not d.blocks,
        "servers": [server(v) for v in d.servers],
        "load_signal": d.load_signal,
        "problems": [{"level": f.level, "message": f.message} for f in d.findings if f.level != "ok"],
        "recommendation": {
            "topology": r.topology,
            "topology_reason": r.topology_why,
            "policy": r.policy,
            "policy_reason": r.policy_why,
            "settings": list(r.settings),
        },
    }
    return orjson.dumps(doc, option=orjson.OPT_INDENT_2).decode() + "\n"
