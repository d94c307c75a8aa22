"""specgate's own routes: /health, /ready, /routing (what it decides and why), /metrics and the
model list, answered by the gateway rather than forwarded. Handlers reach the running gateway
through `request.app.state.gate`."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import orjson
from fastapi import APIRouter, Request
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.responses import Response

from ..config import redact_url
from ..edge import access
from ..errors import ApiError
from ..gate import Gate
from ..policy.base import ALL_ROLES, Role
from ..routing.router import Router
from ..routing.steps.pipeline import describe as describe_steps
from ..routing.steps.spill import spill_on
from ..routing.switch import SOURCES, SWITCHES

router = APIRouter()


def _json(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    # Role keys (a str enum) are written as their values.
    body = orjson.dumps(obj, option=orjson.OPT_NON_STR_KEYS)
    return Response(body, status_code=status, media_type="application/json", headers=headers)


def request_id(request: Request) -> str:
    return access.request_id_of(request.headers.get("x-request-id", "").encode("latin-1"))


def _authorization(request: Request) -> bytes:
    return request.headers.get("authorization", "").encode("latin-1")


@router.get("/health")
async def health() -> Response:
    return _json({"status": "ok"})


@router.get("/ready")
async def ready(request: Request) -> Response:
    gate: Gate = request.app.state.gate
    up = [b for b in ALL_ROLES if gate.health.role_healthy(b)]
    servers = [n for n, s in gate.health.servers.items() if s.healthy]
    return _json({"ready": bool(up), "healthy_backends": up, "healthy_servers": servers}, 200 if up else 503)


@router.get("/routing")
async def routing(request: Request) -> Response:
    gate: Gate = request.app.state.gate
    if gate.settings.admin_keys:
        access.check_key(gate.settings.admin_keys, _authorization(request), "admin key")
    return _json(describe(gate))


def describe(gate: Gate) -> dict[str, Any]:
    """The /routing document: every server, role, group and the policy's beliefs."""
    fleet, s = gate.fleet, gate.settings
    servers = _servers(gate)
    groups = [_group(g) for g in fleet.routers]
    first = fleet.routers[0]
    in_effect, why = gate.health.signal_in_effect()
    return {
        "policy": s.policy,
        "topology": fleet.topology.kind,
        # The steps a new request's placement goes through, in order (routing/steps/pipeline.py).
        "pipeline": describe_steps(first.steps),
        # The first group's mode, watermarks and beliefs (with one group, the gateway's); every
        # group's are under "groups".
        "mode": first.state.mode,
        "load_signal": s.load_signal,
        "load_signal_in_effect": in_effect,
        "load_signal_why": why,
        "engine_setting": s.engine,
        "load": sum(g["load"] for g in groups),
        "inflight": fleet.tracker.total,
        # Prompt tokens the servers reported over those estimated from request bodies (tokens.py):
        # the fleet's, which scales clients without a ratio of their own, and how many have one.
        "prompt_token_ratio": round(gate.token_ratio.value, 3),
        "prompt_token_ratio_clients": len(gate.token_ratio),
        # Conversations whose server is remembered (cache affinity), the slack and balance of its rule, and
        # how the first group weighs a stay among a role's servers (every group's under "groups").
        "affinity": {
            "entries": len(gate.affinity),
            "slack": s.affinity_slack,
            "balance": s.affinity_balance,
            "rule": first.turns.rule(),
        },
        # Traffic classes: what names them, and what is known of each tracked one.
        "classes": {
            "key": s.class_key,
            "max": s.max_classes,
            "tracked": _classes(gate.classes.describe(first.now()), first),
            # The traffic's acceptance by its classes, and the share of the traffic that stands for.
            "mix": _mix(gate.classes.mix(first.now())),
        },
        # The clients' switch (routing/switch.py): the classes' defaults, and the requests that
        # asked for each, honoured or not (those not honoured went where the decision's reason says).
        "speculation": _speculation(gate),
        # The SLOs the pooled class rule keeps each request within where it can (steps/classes.py).
        # The SLOs a pooled class is kept within, and whether its first token is predicted (a prefill rate).
        "slo": {
            "ttft_ms": s.slo_ttft_ms,
            "tpot_ms": s.slo_tpot_ms,
            "ttft_predicted": s.slo_ttft_ms is not None and s.prefill_tok_s > 0,
        },
        "watermarks": {"high": first.cfg.high_watermark, "low": first.cfg.low_watermark},
        "calibration": s.calibration,
        "spillover_limit": s.spillover_limit,
        "backends": _backends(gate, servers),
        "servers": servers,
        "groups": groups,
        **({"adaptive": first.adaptive.describe(first.now())} if first.adaptive is not None else {}),
        # The model policy's step-time model (speedmodel.py); absent without a fit (adaptive rules).
        **({"model": first.speed.describe()} if first.speed is not None else {}),
    }


def _speculation(gate: Gate) -> dict[str, Any]:
    tally = gate.metrics.speculation_switch
    asked = {
        switch: {
            outcome: sum(tally.value(switch, source, flag) for source in SOURCES)
            for outcome, flag in (("honoured", "true"), ("not_honoured", "false"))
        }
        for switch in SWITCHES
    }
    return {"class_defaults": gate.settings.class_switches, "asked": asked}


def _servers(gate: Gate) -> dict[str, dict[str, Any]]:
    """/routing's `servers`: each server's health, this gateway's requests on it, its engine's reading."""
    fleet, tracker = gate.fleet, gate.fleet.tracker
    servers = {}
    for name, srv in gate.health.servers.items():
        h = srv.health
        servers[name] = {
            "role": srv.role,
            "group": srv.group,
            "url": redact_url(srv.url),
            "healthy": h.healthy,
            "inflight": tracker.count(name),
            # Of those, batch requests (x-specgate-priority: batch): not in the load the mode compares.
            "batch": tracker.batch(name),
            # The tokens those requests hold (prompts as estimated, plus generated so far), and the
            # engine's own count of its KV cache in use (tokens, and the pool's fraction).
            "tokens": tracker.tokens(name),
            # Of those, prompt tokens still to prefill (not cached there, no byte back yet).
            "prefill_tokens": tracker.prefill(name),
            "engine_tokens": h.engine_tokens,
            "engine_kv_usage": h.engine_kv_usage,
            "engine_kv_capacity": h.engine_kv_capacity,
            "engine_cache_hit_rate": h.engine_cache_hit_rate,
            # Requests not this gateway's, as last read (the engine's count minus ours then).
            "others": tracker.others(name),
            "others_smoothed": round(tracker.others_smooth(name), 2),
            "others_balance": round(tracker.others_balance(name), 2),
            "load": fleet.router_of(name).loads.server_load(name),
            "engine": h.engine,
            "engine_load": h.engine_load,
            "engine_signal_up": bool(h.engine_signal_up),
            "engine_signal_error": h.engine_signal_error,
            "spec_accept_length": h.spec_accept_length,
            "last_error": h.last_error,
        }
    return servers


def _backends(gate: Gate, servers: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """/routing's `backends`: with one server a role, the role's entry is that server's (from
    `servers`); with several, a summary."""
    tracker = gate.fleet.tracker
    backends: dict[str, Any] = {}
    for b in ALL_ROLES:
        names = [n for n, srv in gate.health.servers.items() if srv.role == b]
        if not names:
            continue
        if len(names) == 1:
            backends[b] = {k: v for k, v in servers[names[0]].items() if k not in ("role", "group")}
        else:
            loads = [servers[n]["engine_load"] for n in names]
            backends[b] = {
                "servers": names,
                "healthy": gate.health.role_healthy(b),
                "inflight": sum(tracker.count(n) for n in names),
                "tokens": sum(tracker.tokens(n) for n in names),
                "engine_load": None if None in loads else sum(loads),
            }
    return backends


def _group(g: Router) -> dict[str, Any]:
    """One entry of /routing's `groups`: the group's mode, load, watermarks, capacity and beliefs."""
    return {
        "name": g.group.name,
        "mode": g.state.mode,
        "load": g.load,
        "watermarks": {"high": g.cfg.high_watermark, "low": g.cfg.low_watermark},
        # Streams the speculative role holds before its KV pool is full (None: unknown), and
        # the watermarks in effect, capped to it.
        "kv_capacity_streams": g.kv.kv_streams,
        # Tokens a conversation's next turn adds (counted in the capacity: room for it).
        "turn_growth_tokens": round(g.kv.turn_growth),
        # How a turn's stay on the server holding its cache is weighed (affinity.py): priced
        # (each server's cost in stream-seconds, at `turn_out_tokens` a turn) or in_flight.
        "affinity_rule": g.turns.rule(),
        "turn_out_tokens": round(g.turns.out_tokens),
        # A paired group's footprint growth (tokens a second past its scatter, forecast.py), which
        # the capacity is read ahead at while the footprint is under half the pool; None: no
        # forecast, the footprint as it is.
        "kv_forecast_growth_tok_s": None if g.kv.footprint is None else round(max(0.0, g.kv.footprint.rate())),
        "watermarks_in_effect": {"high": g.policy_cfg().high_watermark, "low": g.policy_cfg().low_watermark},
        "kv_spill": _spill(g),
        "servers": {role: list(names) for role, names in g.group.servers.items()},
        **({"adaptive": g.adaptive.describe(g.now())} if g.adaptive is not None else {}),
        **({"model": g.speed.describe()} if g.speed is not None else {}),
    }


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    gate: Gate = request.app.state.gate
    if gate.settings.protect_metrics:
        access.check_key(gate.settings.admin_keys, _authorization(request), "admin key")
    if gate.classes.stats:
        gate.metrics.publish_class_accepts(gate.classes.accepts(asyncio.get_running_loop().time()))
    return Response(generate_latest(gate.metrics.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models")
async def models(request: Request) -> Response:
    """Every healthy server's models, merged by id: clients list them before they send."""
    gate: Gate = request.app.state.gate
    access.authorize(gate.settings, _authorization(request))
    healthy = [n for n, srv in gate.health.servers.items() if srv.healthy]
    if not healthy:
        raise ApiError(503, "No healthy backend: every server is down.", "server_error", "no_healthy_backend")
    probes = await asyncio.gather(
        *(gate.upstream.get(b, "/v1/models", gate.settings.health_timeout_s) for b in healthy)
    )
    seen: dict[str, Any] = {}
    for probe in probes:
        if probe.status != 200:
            continue
        with contextlib.suppress(orjson.JSONDecodeError, AttributeError, TypeError):
            for card in orjson.loads(probe.body).get("data", []):
                if isinstance(card, dict) and isinstance(card.get("id"), str):
                    seen.setdefault(card["id"], card)
    if not seen:
        raise ApiError(502, "No backend listed its models.", "server_error", "upstream_unavailable")
    return _json({"object": "list", "data": list(seen.values())}, headers={"x-request-id": request_id(request)})


def _spill(g: Router) -> dict[str, object]:
    """The spill to speculation once the baseline's KV pools are full (routing/steps/spill.py): whether it
    is on, its fractions, and each role's pools as the rule reads them (None: unknown)."""
    base, spec = g.kv_used(Role.BASELINE), g.kv_used(Role.SPECULATIVE)
    return {
        "on": spill_on(g.cfg),
        "at": g.cfg.kv_spill_at,
        "room": g.cfg.kv_spill_room,
        "baseline_least_used": None if base is None else round(base[0], 3),
        "speculative_most_used": None if spec is None else round(spec[1], 3),
    }


def _classes(tracked: dict[str, dict[str, Any]], router: Router) -> dict[str, dict[str, Any]]:
    """Each tracked class, with the watermarks its acceptance calls for in the first group and what
    each role of a pool would gain with one more of its streams now (routing/steps/classes.py; null in
    a pair, without a speed model or a known acceptance)."""
    for info in tracked.values():
        accept = info["accept_length"]
        view = router.class_pricing.view(None, accept)
        known = view.high is not None and view.low is not None
        info["watermarks"] = {"high": view.high, "low": view.low} if known else None
        gains = None if accept is None else router.pool_gains(accept)
        info["gains_tok_s"] = None if gains is None else {"speculative": round(gains.speculative, 1),
                                                          "baseline": round(gains.baseline, 1)}  # fmt: skip
    return tracked


def _mix(mix: tuple[float, float] | None) -> dict[str, float] | None:
    return None if mix is None else {"accept_length": round(mix[0], 3), "share": round(mix[1], 3)}
