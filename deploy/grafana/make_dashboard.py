"""Writes deploy/grafana/dashboards/specgate.json. Run it after changing a panel:

    python deploy/grafana/make_dashboard.py

Generated, not hand-edited, so every panel has the same units, legends and datasource, and a test
checks that the committed JSON is what this script makes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

DS = {"type": "prometheus", "uid": "prometheus"}
RATE = "$__rate_interval"
SGLANG = "sglang[:_]"  # metric prefix up to SGLang 0.5.3 (`sglang:`) and from 0.5.4 (`sglang_`)
# vLLM's names for what the server panels show (compose's `vllm` profile); each panel reads whichever
# engine the servers run, so one dashboard serves both profiles.
VLLM_ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
VLLM_DRAFTS = "vllm:spec_decode_num_drafts_total"


def target(expr: str, legend: str, ref: str) -> dict[str, Any]:
    return {"datasource": DS, "expr": expr, "legendFormat": legend, "refId": ref, "range": True}


def timeseries(
    title: str,
    desc: str,
    targets: list[tuple[str, str]],
    grid: tuple[int, int, int, int],
    *,
    unit: str = "short",
    stack: bool = False,
    overrides: list[dict[str, Any]] | None = None,
    minimum: float | None = 0,
    thresholds: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    x, y, w, h = grid
    defaults: dict[str, Any] = {
        "unit": unit,
        "custom": {
            "drawStyle": "line",
            "lineWidth": 2,
            "fillOpacity": 15 if stack else 5,
            "showPoints": "never",
            "stacking": {"mode": "normal" if stack else "none", "group": "A"},
            "thresholdsStyle": {"mode": "line" if thresholds else "off"},
        },
        "thresholds": {"mode": "absolute", "steps": thresholds or [{"color": "green", "value": None}]},
    }
    if minimum is not None:
        defaults["min"] = minimum
    return {
        "id": 0,
        "type": "timeseries",
        "title": title,
        "description": desc,
        "datasource": DS,
        "gridPos": {"x": x, "y": y, "w": w, "h": h},
        "targets": [target(e, lg, chr(ord("A") + i)) for i, (e, lg) in enumerate(targets)],
        "fieldConfig": {"defaults": defaults, "overrides": overrides or []},
        "options": {
            "legend": {"displayMode": "table", "placement": "bottom", "calcs": ["lastNotNull", "max"]},
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
    }


def stat(
    title: str,
    desc: str,
    expr: str,
    legend: str,
    grid: tuple[int, int, int, int],
    mappings: list[dict[str, Any]],
    steps: list[dict[str, Any]],
) -> dict[str, Any]:
    x, y, w, h = grid
    return {
        "id": 0,
        "type": "stat",
        "title": title,
        "description": desc,
        "datasource": DS,
        "gridPos": {"x": x, "y": y, "w": w, "h": h},
        "targets": [target(expr, legend, "A")],
        "fieldConfig": {
            "defaults": {
                "mappings": mappings,
                "thresholds": {"mode": "absolute", "steps": steps},
                "color": {"mode": "thresholds"},
            },
            "overrides": [],
        },
        "options": {
            "colorMode": "background",
            "graphMode": "none",
            "textMode": "value_and_name",
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
        },
    }


def row(title: str, y: int) -> dict[str, Any]:
    return {
        "id": 0,
        "type": "row",
        "title": title,
        "collapsed": False,
        "gridPos": {"x": 0, "y": y, "w": 24, "h": 1},
        "panels": [],
    }


def quantiles(metric: str) -> list[tuple[str, str]]:
    out = []
    for q in ("0.5", "0.95"):
        expr = f"histogram_quantile({q}, sum by (le, backend) (rate({metric}_bucket[{RATE}])))"
        out.append((expr, f"{{{{backend}}}} p{int(float(q) * 100)}"))
    return out


def by_name(name: str, legend: str, agg: str = "sum by (backend)", vllm: str | None = None) -> tuple[str, str]:
    """An SGLang gauge by either prefix, or vLLM's gauge of the same meaning where it has one."""
    names = f"{SGLANG}{name}" + (f"|vllm:{vllm}" if vllm else "")
    return f'{agg} ({{__name__=~"{names}"}})', legend


def or_vllm(sglang: tuple[str, str], vllm_expr: str) -> tuple[str, str]:
    """SGLang's gauge, else what vLLM's counters give (vLLM counts where SGLang keeps a gauge)."""
    expr, legend = sglang
    return f"{expr} or {vllm_expr}", legend


def fixed_color(name: str, color: str, dashed: bool = False) -> dict[str, Any]:
    props: list[dict[str, Any]] = [{"id": "color", "value": {"mode": "fixed", "fixedColor": color}}]
    if dashed:
        props.append({"id": "custom.lineStyle", "value": {"fill": "dash", "dash": [10, 10]}})
    return {"matcher": {"id": "byName", "options": name}, "properties": props}


def panels() -> list[dict[str, Any]]:
    up_map = [
        {"type": "value", "options": {"0": {"text": "DOWN", "color": "red"}, "1": {"text": "UP", "color": "green"}}}
    ]
    mode_map = [
        {
            "type": "value",
            "options": {"0": {"text": "baseline", "color": "blue"}, "1": {"text": "speculative", "color": "orange"}},
        }
    ]
    mode_axis = {
        "matcher": {"id": "byName", "options": "mode (1 speculative, 0 baseline)"},
        "properties": [
            {"id": "custom.axisPlacement", "value": "right"},
            {"id": "min", "value": 0},
            {"id": "max", "value": 1},
            {"id": "custom.lineInterpolation", "value": "stepAfter"},
            {"id": "custom.fillOpacity", "value": 20},
            {"id": "color", "value": {"mode": "fixed", "fixedColor": "purple"}},
            {"id": "decimals", "value": 0},
        ],
    }
    return [
        row("Routing", 0),
        timeseries(
            "Routing mode, load and watermarks",
            "The load specgate compares with the watermarks, and the mode new requests get. Above the high "
            "watermark new requests go to the baseline; they return to speculation at the low one. Under "
            "SPECGATE_POLICY=adaptive the watermarks move with the live workload, toward the crossover "
            "estimate: the load where specgate now believes speculation stops paying (0: at no load).",
            [
                ("specgate_load", "load"),
                ('specgate_watermark{level="high"}', "high watermark"),
                ('specgate_watermark{level="low"}', "low watermark"),
                ("specgate_crossover_estimate", "crossover estimate"),
                ("specgate_routing_mode", "mode (1 speculative, 0 baseline)"),
            ],
            (0, 1, 16, 9),
            unit="short",
            overrides=[
                fixed_color("load", "green"),
                fixed_color("high watermark", "red", dashed=True),
                fixed_color("low watermark", "orange", dashed=True),
                fixed_color("crossover estimate", "blue", dashed=True),
                mode_axis,
            ],
        ),
        stat(
            "Routing mode",
            "Where new requests go now.",
            "specgate_routing_mode",
            "mode",
            (16, 1, 8, 3),
            mode_map,
            [{"color": "blue", "value": None}, {"color": "orange", "value": 1}],
        ),
        stat(
            "Backends up",
            "specgate's view of each server's health.",
            "specgate_backend_up",
            "{{backend}}",
            (16, 4, 8, 3),
            up_map,
            [{"color": "red", "value": None}, {"color": "green", "value": 1}],
        ),
        stat(
            "Mode switches (1h)",
            "Routing mode switches in the last hour; many means the watermarks are too close.",
            "sum(increase(specgate_mode_switches_total[1h]))",
            "switches",
            (16, 7, 8, 3),
            [],
            [{"color": "green", "value": None}, {"color": "orange", "value": 30}, {"color": "red", "value": 120}],
        ),
        timeseries(
            "Routing decisions per second by backend and reason",
            "Every routing decision: light_load/heavy_load/hysteresis_hold by the policy, return_hold while the "
            "load waits out SPECGATE_LOW_WATERMARK_HOLD_S, dwell_hold, switch_cost and probe (adaptive), "
            "kv_spill when the baseline's KV pools are full, class, affinity and batch, spillover, client_on/"
            "client_off (a client's switch), slo (a class kept within SPECGATE_SLO_TPOT_MS), in_engine (adaptive "
            "servers), "
            "only_healthy when a server is down, failover for retries.",
            [
                (
                    f"sum by (backend, reason) (rate(specgate_routing_decisions_total[{RATE}]))",
                    "{{backend}} / {{reason}}",
                )
            ],
            (0, 10, 12, 8),
            unit="reqps",
            stack=True,
        ),
        timeseries(
            "In-flight requests per backend",
            "Requests specgate is relaying now, per server.",
            [("sum by (backend) (specgate_inflight_requests)", "{{backend}}")],
            (12, 10, 12, 8),
            stack=True,
        ),
        row("Throughput and latency", 18),
        timeseries(
            "Output tokens per second",
            "Output tokens relayed, from each response's usage, per server and in total.",
            [
                (f"sum by (backend) (rate(specgate_output_tokens_total[{RATE}]))", "{{backend}}"),
                (f"sum(rate(specgate_output_tokens_total[{RATE}]))", "total"),
            ],
            (0, 19, 12, 8),
            unit="none",
            overrides=[fixed_color("total", "white", dashed=True)],
        ),
        timeseries(
            "Requests per second by status",
            "Responses by status class (backend none: answered by specgate).",
            [(f"sum by (code) (rate(specgate_requests_total[{RATE}]))", "{{code}}")],
            (12, 19, 12, 8),
            unit="reqps",
            stack=True,
            overrides=[fixed_color("2xx", "green"), fixed_color("4xx", "orange"), fixed_color("5xx", "red")],
        ),
        timeseries(
            "Time to first token, p50 and p95",
            "Streams only: request received to first chunk relayed.",
            quantiles("specgate_time_to_first_token_seconds"),
            (0, 27, 8, 8),
            unit="s",
        ),
        timeseries(
            "Inter-chunk latency, p50 and p95",
            "Gap between chunks relayed to the client (a speculative chunk often carries several tokens).",
            quantiles("specgate_inter_chunk_latency_seconds"),
            (8, 27, 8, 8),
            unit="s",
        ),
        timeseries(
            "End-to-end latency, p50 and p95",
            "Request received to the end of its response.",
            quantiles("specgate_request_duration_seconds"),
            (16, 27, 8, 8),
            unit="s",
        ),
        row("Failures", 35),
        timeseries(
            "Failovers, upstream errors, client disconnects",
            "Retries on the other server, failures talking to each server by kind, and clients that left early "
            "(their generations are aborted).",
            [
                (f"sum by (from, to) (rate(specgate_failovers_total[{RATE}]))", "failover {{from}} -> {{to}}"),
                (
                    f"sum by (server, kind) (rate(specgate_server_upstream_errors_total[{RATE}]))",
                    "error {{server}} {{kind}}",
                ),
                (f"sum by (backend) (rate(specgate_client_disconnects_total[{RATE}]))", "disconnect {{backend}}"),
            ],
            (0, 36, 24, 8),
            unit="reqps",
            thresholds=[{"color": "green", "value": None}, {"color": "red", "value": 1}],
        ),
        row("Inference servers (SGLang or vLLM, from their own /metrics)", 44),
        timeseries(
            "Speculative accept length",
            "Tokens accepted per verification step (counts the bonus token; 1 means drafts are wasted). "
            "SGLang's gauge, or 1 + accepted / drafts from vLLM's counters.",
            [
                or_vllm(
                    by_name("spec_accept_length", "{{backend}}", "max by (backend)"),
                    f"(1 + sum by (backend) (rate({VLLM_ACCEPTED}[{RATE}])) "
                    f"/ sum by (backend) (rate({VLLM_DRAFTS}[{RATE}])))",
                )
            ],
            (0, 45, 6, 8),
            unit="none",
            thresholds=[{"color": "red", "value": None}, {"color": "green", "value": 2}],
        ),
        timeseries(
            "Server running and queued requests",
            "As the servers report them (SGLang refreshes these every 40 decode steps and keeps them when "
            "idle; vLLM's are live).",
            [
                by_name("num_running_reqs", "{{backend}} running", vllm="num_requests_running"),
                by_name("num_queue_reqs", "{{backend}} queued", vllm="num_requests_waiting"),
            ],
            (6, 45, 6, 8),
        ),
        timeseries(
            "Server KV cache usage",
            "Share of the KV cache in use; near 1 the server queues requests.",
            [by_name("token_usage", "{{backend}}", "max by (backend)", vllm="kv_cache_usage_perc")],
            (12, 45, 6, 8),
            unit="percentunit",
            thresholds=[{"color": "green", "value": None}, {"color": "red", "value": 0.9}],
        ),
        timeseries(
            "Server generation throughput",
            "Output tokens per second as each server reports it (vLLM: the rate of its token counter).",
            [
                or_vllm(
                    by_name("gen_throughput", "{{backend}}"),
                    f"sum by (backend) (rate(vllm:generation_tokens_total[{RATE}]))",
                )
            ],
            (18, 45, 6, 8),
            unit="none",
        ),
        row("What specgate reads from each server", 53),
        stat(
            "Engine signal readable",
            "Whether specgate could read the server's load (running + queued) from its /metrics at the last "
            "poll. Unreadable: SPECGATE_LOAD_SIGNAL=engine or max counts that server by specgate's own "
            "in-flight requests instead, and /routing says why.",
            "specgate_engine_signal_up",
            "{{backend}}",
            (0, 54, 6, 8),
            [
                {
                    "type": "value",
                    "options": {
                        "0": {"text": "UNREADABLE", "color": "orange"},
                        "1": {"text": "READ", "color": "green"},
                    },
                }
            ],
            [{"color": "orange", "value": None}, {"color": "green", "value": 1}],
        ),
        timeseries(
            "Accept length specgate reads",
            "The live mean acceptance length specgate takes from each server (SGLang's gauge, or vLLM's "
            "counters over a short window; bonus token included). A gap: no speculation there, no drafts "
            "lately, or /metrics unreadable.",
            [("specgate_accept_length", "{{backend}}")],
            (6, 54, 18, 8),
            unit="none",
            thresholds=[{"color": "red", "value": None}, {"color": "green", "value": 2}],
        ),
        row("Groups and servers (several servers: SPECGATE_TOPOLOGY)", 62),
        timeseries(
            "Mode per group",
            "Each group's mode for new requests (1 speculative, 0 baseline): a paired group's two servers "
            "switch together on the group's own load; a pool has one group. With several specgate replicas "
            "each has its own view: the line is the lowest of them, so a dip means some replica sends that "
            "group's new requests to its baseline.",
            [("min by (group) (specgate_group_mode)", "{{group}}")],
            (0, 63, 8, 8),
            unit="none",
        ),
        timeseries(
            "Load per group",
            "The load each group's policy compares with its watermarks (largest over replicas), and the "
            "group's high watermark.",
            [
                ("max by (group) (specgate_group_load)", "{{group}} load"),
                ('max by (group) (specgate_group_watermark{level="high"})', "{{group}} high watermark"),
            ],
            (8, 63, 8, 8),
            unit="short",
        ),
        timeseries(
            "Requests per second per server",
            "Requests specgate sent to each server (all replicas, retries included): groups and the servers "
            "of a pool should share evenly.",
            [(f"sum by (server) (rate(specgate_server_requests_total[{RATE}]))", "{{server}}")],
            (16, 63, 8, 8),
            unit="reqps",
        ),
        timeseries(
            "In flight per server",
            "Requests in flight on each server: specgate's own (summed over replicas) and the engine's "
            "running + queued as last read (-1: unreadable).",
            [
                ("sum by (server) (specgate_server_inflight)", "{{server}} specgate"),
                ("max by (server) (specgate_server_engine_load)", "{{server}} engine"),
            ],
            (0, 71, 12, 8),
            unit="short",
        ),
        timeseries(
            "Tokens in flight per server",
            "The tokens specgate's requests hold on each server (prompts as estimated, plus generated so far; "
            "summed over replicas) and the engine's KV cache in use as last read (SGLang's count; -1: not "
            "reported).",
            [
                ("sum by (server) (specgate_server_tokens)", "{{server}} specgate"),
                ("max by (server) (specgate_server_engine_tokens)", "{{server}} engine"),
            ],
            (12, 71, 12, 8),
            unit="short",
        ),
        timeseries(
            "Cache affinity",
            "Turns of remembered conversations sent to the server holding their prefix cache (hits), turns "
            "with no server remembered (misses), and turns sent elsewhere by reason; and each engine's "
            "prefix cache hit rate (see specgate_server_cache_hit_rate).",
            [
                (f"sum(rate(specgate_affinity_hits_total[{RATE}]))", "hits"),
                (f"sum(rate(specgate_affinity_misses_total[{RATE}]))", "misses"),
                (f"sum by (reason) (rate(specgate_affinity_breaks_total[{RATE}]))", "break: {{reason}}"),
            ],
            (0, 79, 12, 8),
            unit="reqps",
        ),
        timeseries(
            "Traffic classes",
            "Requests per second by traffic class and the backend they went to (x-specgate-class or "
            "SPECGATE_CLASS_KEY), and each class's learnt acceptance length.",
            [
                (f"sum by (class, backend) (rate(specgate_class_requests_total[{RATE}]))", "{{class}} -> {{backend}}"),
                ("max by (class) (specgate_class_accept_length)", "{{class}} acceptance"),
            ],
            (12, 79, 12, 8),
            unit="short",
        ),
        timeseries(
            "Clients' speculation switch",
            "Requests that asked for speculation on or off (x-specgate-speculation, the body's speculation "
            "field, or their class's SPECGATE_CLASS_SPECULATION), by whether they went where they asked; "
            "one not honoured went where its x-specgate-reason says (no room, a server down).",
            [
                (
                    f"sum by (switch, honoured) (rate(specgate_speculation_switch_total[{RATE}]))",
                    "{{switch}} honoured={{honoured}}",
                )
            ],
            (0, 87, 12, 8),
            unit="reqps",
            stack=True,
        ),
    ]


def dashboard() -> dict[str, Any]:
    numbered = panels()
    for i, panel in enumerate(numbered, 1):
        panel["id"] = i
    return {
        "uid": "specgate",
        "title": "specgate",
        "tags": ["specgate", "sglang", "vllm"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "refresh": "5s",
        "graphTooltip": 1,
        "time": {"from": "now-30m", "to": "now"},
        "templating": {"list": []},
        "annotations": {"list": []},
        "panels": numbered,
    }


if __name__ == "__main__":
    out = Path(__file__).parent / "dashboards" / "specgate.json"
    out.write_text(json.dumps(dashboard(), indent=2) + "\n")
    print(f"wrote {out}")
